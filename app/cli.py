"""python -m app generate | bench | train | gpucheck | export | quality: every UI claim, from a terminal."""

from __future__ import annotations

import argparse
import json
import sys
import traceback

# Only light modules here: `--help` and argument errors must not wait for torch to import.
from app.args import add_generation_args, settings
from app.core.config import UserError
from app.core.events import KIND_LABELS, REJECTED

COLOURS = {
    "accepted": "\x1b[32m",
    "corrected": "\x1b[31m",
    "bonus": "\x1b[34m",
    "rejected": "\x1b[2;9m",
    "target": "\x1b[1m",
}
RESET = "\x1b[0m"


def _quiet_transformers() -> None:
    """stderr carries our one-line errors and summary only: no warnings, no progress bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def cmd_generate(args) -> int:
    from app import kept_costs, models, request
    from app.core import metrics
    from app.models import threads

    _quiet_transformers()

    threads.apply(args.threads)
    speculative = args.mode == "speculative"
    req = request.Request(
        args.prompt,
        args.target,
        args.draft,
        settings(args),
        speculative,
        args.device,
        args.dtype,
        args.fast_path,
        auto_chat=args.chat is None,
    )
    phase, report, measured = _phases()
    run = request.open_request(req, phase, report)
    measured()
    kept = kept_costs.origin(run.costs) if run.costs is not None else None
    if kept:
        phase(kept)
    if args.fast_path is not None or run.pair.target.device.type == "cuda":
        print(f"fast path: {run.note}", file=sys.stderr)
    steps = list(run.steps(teach=args.json))
    s = run.settings
    # Models named as typed (a preset's label, the default by its name), never by an install path.
    draft = (args.draft or models.default_draft(args.target)) if speculative else None
    doc = metrics.report(steps, args.target or models.DEFAULT_TARGET, draft, s.as_dict(args.mode), run.costs)
    doc["threads"] = threads.key()  # "auto" or the fixed count (docs/threads.md)
    doc["calibration"] = kept_costs.provenance(run.costs) if run.costs is not None else None
    if args.json:
        json.dump(doc, sys.stdout)
        print()
        return 0
    colour = sys.stdout.isatty() or args.colour
    _print_text(args.prompt, steps, doc["text"], colour)
    print(_stats_line(doc["stats"], draft, colour), file=sys.stderr)
    return 0


def _print_text(prompt: str, steps: list, text: str, colour: bool) -> None:
    """Print the generation to stdout: coloured rounds after the prompt, or the plain text."""
    from app.views import render

    if colour:  # the prompt, then each round with its rejected drafts struck through
        print(prompt, end="")
        for step in steps:
            for piece, kind in step.spans():  # rejected whitespace as · and ↵, so the layout holds
                print(f"{COLOURS[kind]}{render.visible(piece) if kind == REJECTED else piece}{RESET}", end="")
        print()
    else:  # exactly the generated text, as --json's "text", so it can be piped
        print(text)


def _stats_line(st: dict, draft: str | None, colour: bool) -> str:
    """The run's figures for stderr: tokens, time and passes, and with a draft its acceptance and speedups."""
    line = (
        f"\n{st['new_tokens']} tokens in {st['elapsed_s']:.2f}s ({st['tokens_per_s']:.1f} tok/s), "
        f"{st['target_passes']} target passes"
    )
    if st["stop_reason"] == "context_full":
        line += "; stopped: context full"
    if draft:
        line += (
            f"; acceptance {_pct(st['acceptance_rate'])} of drafts, alpha {_pct(st['alpha'])}, "
            f"{st['tokens_per_pass']:.2f} tokens/pass (mean acceptance length)"
        )
        if st["tree_rounds"]:  # Leviathan's formulas are a chain's: a tree is judged by its tokens per pass
            line += ", with trees (no speedup predicted: the formulas are a chain's)"
        else:
            line += (
                f", speedup predicted for this machine {_times(st['predicted_speedup'])} "
                f"(Leviathan's idealised {_times(st['theoretical_speedup'])})"
            )
        if colour:
            line += "\n" + " ".join(f"{COLOURS[kind]}{label}{RESET}" for kind, label in KIND_LABELS.items())
    return line


def _phases():
    """(phase, report, measured) for open_request: each slow step named on stderr before it starts,
    and a first measurement's progress as a percentage, so a first run is never silent for a minute;
    measured() ends the count once the run is ready."""
    from app.bench import progress
    from app.request import MEASURING

    bar = []

    def phase(text: str) -> None:
        progress.say("generate", text)

    def report(fraction: float) -> None:
        if not bar:
            phase(MEASURING)
            bar.append(progress.bar("% measured", 100))
        bar[0].update(round(100 * fraction) - bar[0].n)

    def measured() -> None:
        if bar:
            bar[0].update(100 - bar[0].n)
            bar[0].close()

    return phase, report, measured


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _times(x):
    """A ratio as 1.23x, or n/a where the run has none (no calibrated costs, or tree rounds)."""
    return "n/a" if x is None else f"{x:.2f}x"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    ap.add_argument(
        "--debug",
        action="store_true",
        help="print the full traceback of an unexpected error (may also follow the command)",
    )
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
    sub.add_parser("train", help="rebuild the bundled family, or a target's drafts (--target)", add_help=False)
    sub.add_parser("gpucheck", help="time the GPU fast path on random 7B/0.5B-shaped models", add_help=False)
    sub.add_parser("export", help="the pair and settings as vllm serve / llama-server commands", add_help=False)
    sub.add_parser("quality", help="the target's held-out loss, loops and distinct n-grams", add_help=False)
    return ap


def _delegate(command: str, rest: list[str]) -> int:
    _quiet_transformers()
    if command == "bench":
        from app.bench import bench

        return bench.main(rest)
    if command == "gpucheck":
        from app.bench import gpucheck

        return gpucheck.main(rest)
    if command == "export":
        from app import export

        return export.main(rest)
    if command == "quality":
        from app.bench import quality

        return quality.main(rest)
    from app.training import train

    train.main(rest)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv  # accepted anywhere, so `generate ... --debug` works too
    argv = [a for a in argv if a != "--debug"]
    try:
        if argv and argv[0] in ("bench", "train", "gpucheck", "export", "quality"):
            return _delegate(argv[0], argv[1:])
        args = parser().parse_args(argv)
        return args.func(args)
    except UserError as e:  # a user error: the message says what to change
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, not a user error: never hidden
        if debug:
            traceback.print_exc()
        else:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(
                f"error: {type(e).__name__}: {first}\n(an unexpected error, likely a bug: "
                "run again with --debug for the traceback)",
                file=sys.stderr,
            )
        return 1
