"""python -m app generate | bench | train: every UI claim, reproducible from a terminal."""

from __future__ import annotations

import argparse
import json
import sys

from app.config import RunConfig, SamplingConfig, SpecConfig, SpecError, settings_dict

COLOURS = {"accepted": "\x1b[32m", "corrected": "\x1b[31m", "bonus": "\x1b[34m", "rejected": "\x1b[2;9m", "target": ""}
RESET = "\x1b[0m"


def add_generation_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--target", help="Hub id or local dir (default: the bundled stdlib-code target)")
    ap.add_argument("--draft", help="Hub id, local dir, prompt-lookup or early-exit:N (default: bundled draft)")
    ap.add_argument("--k", type=int, help="draft length; alone it means a fixed k (default: adaptive)")
    ap.add_argument("--k-policy", choices=["fixed", "heuristic", "adaptive"])
    ap.add_argument("--k-max", type=int, default=8, help="upper bound for heuristic and adaptive k")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="> 1 discourages repeating context tokens, as in transformers' generate (1: off)")
    ap.add_argument("--no-repeat-ngram-size", type=int, default=0,
                    help="forbid repeating any n-gram of this size, as in generate (0: off)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--chat", action="store_true", help="format the prompt with the chat template")
    ap.add_argument("--device", help="cuda, cuda:1, mps or cpu (default: best available)")
    ap.add_argument("--dtype", help="fp32, fp16 or bf16 (default: bf16 on CUDA, fp32 on CPU)")


def configs(args) -> tuple[SamplingConfig, SpecConfig, RunConfig]:
    policy = args.k_policy or ("fixed" if args.k is not None else "adaptive")
    k = args.k if args.k is not None else 4
    return (
        SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed,
                       args.repetition_penalty, args.no_repeat_ngram_size),
        SpecConfig(k=k, k_policy=policy, k_max=max(args.k_max, k) if policy != "fixed" else args.k_max),
        RunConfig(args.max_new_tokens, tuple(args.stop), args.chat),
    )


def cmd_generate(args) -> int:
    from app import engine, metrics, models

    s, sp, r = configs(args)
    for cfg in (s, sp, r):
        cfg.validate()
    if not args.prompt or not args.prompt.strip():
        raise SpecError("prompt is empty: pass --prompt TEXT")
    pair = models.load_pair(args.target, args.draft, args.device, args.dtype, draft=args.mode == "speculative")
    ids = pair.encode(args.prompt, r.chat)
    proposer = pair.proposer(sp) if args.mode == "speculative" else None
    steps = list(engine.generate(pair.target, pair.tokenizer, ids, proposer, s, sp, r))
    draft = pair.draft_name if proposer else None
    doc = metrics.report(steps, pair.target_name, draft, settings_dict(args.mode, s, sp, r))
    if args.json:
        json.dump(doc, sys.stdout)
        print()
        return 0
    colour = sys.stdout.isatty() or args.colour
    if colour:  # the prompt, then each round with its rejected drafts struck through
        print(args.prompt, end="")
        for step in steps:
            for piece, kind in step.spans():
                print(f"{COLOURS[kind]}{piece}{RESET}", end="")
        print()
    else:  # exactly the generated text, as --json's "text", so it can be piped
        print(doc["text"])
    st = doc["stats"]
    line = (f"\n{st['new_tokens']} tokens in {st['elapsed_s']:.2f}s ({st['tokens_per_s']:.1f} tok/s), "
            f"{st['target_passes']} target passes")
    if draft:
        line += (f"; acceptance {_pct(st['acceptance_rate'])} of drafts, alpha {_pct(st['alpha'])}, "
                 f"{st['tokens_per_pass']:.2f} tokens/pass, theoretical speedup {_num(st['theoretical_speedup'])}x")
        if colour:
            line += f"\n{COLOURS['accepted']}accepted{RESET} {COLOURS['corrected']}corrected{RESET} " \
                    f"{COLOURS['bonus']}bonus{RESET} {COLOURS['rejected']}rejected{RESET}"
    print(line, file=sys.stderr)
    return 0


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x):
    return "n/a" if x is None else f"{x:.2f}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="one generation; --json prints records and stats")
    g.add_argument("--prompt", required=True)
    g.add_argument("--mode", choices=["speculative", "autoregressive"], default="speculative")
    add_generation_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--colour", action="store_true", help="colour even when stdout is not a terminal")
    g.set_defaults(func=cmd_generate)
    # bench and train parse their own options (see --help on each).
    sub.add_parser("bench", help="speculative vs autoregressive (and transformers) on prompt suites", add_help=False)
    sub.add_parser("train", help="rebuild the bundled model family", add_help=False)
    return ap


def _delegate(command: str, rest: list[str]) -> int:
    if command == "bench":
        from app import bench

        return bench.main(rest)
    from app import train

    train.main(rest)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # stderr carries our one-line errors and summary only
    hf_logging.disable_progress_bar()
    try:
        if argv and argv[0] in ("bench", "train"):
            return _delegate(argv[0], argv[1:])
        args = parser().parse_args(argv)
        return args.func(args)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # anything else still ends in one line, never a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: {type(e).__name__}: {first}", file=sys.stderr)
        return 1
