"""Benchmarks: speculative vs autoregressive vs transformers' assisted generation, and
the model card's figures for the bundled family. Ratios from one run, not absolute times.

    python -m app bench [--suite code|prose|all] [--draft ...] [--k 4] [--out runs/bench]
    python -m app bench --card       # acceptance and cost of every bundled draft
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from app import engine, metrics, models, plots
from app.cache import CachedModel
from app.cli import add_generation_args, configs
from app.config import RunConfig, SamplingConfig, SpecConfig, settings_dict
from app.train import HELD_OUT, stdlib_files

PROMPTS_FILE = models.ROOT / "assets" / "prompts.json"


def held_out_prompts(n_chars: int = 700) -> list[str]:
    """One prompt per held-out stdlib file: the code up to and including a `def` line."""
    prompts = []
    for path in stdlib_files():
        if path.name not in HELD_OUT or not path.parent.name.startswith("python"):
            continue
        src = path.read_text(encoding="utf-8")
        defs = [m.end() for m in re.finditer(r"^ *def [^\n]*:\n", src, re.M) if m.start() > 1500]
        if defs:
            end = defs[len(defs) // 2]
            prompts.append(src[max(0, end - n_chars) : end])
    return prompts


def suite(name: str) -> list[str]:
    """Prompts of a suite: held-out code, the example prose, or both."""
    examples = json.loads(PROMPTS_FILE.read_text())
    if name == "code":
        return held_out_prompts()
    if name == "prose":
        return [e["prompt"] for e in examples if e["kind"] == "prose"]
    return held_out_prompts() + [e["prompt"] for e in examples if e["kind"] == "prose"]


@torch.inference_mode()
def decode_seconds_per_token(model, prompt_ids: list[int], n: int = 64) -> float:
    """Batch-1 cached decode time per token, as the engine runs a draft or a target."""
    lm = CachedModel(model)
    logits = lm.extend(prompt_ids)
    tok = int(logits[-1].argmax())
    for _ in range(4):  # warm-up
        tok = int(lm.extend([tok])[-1].argmax())
    engine.sync(model.device)
    start = time.perf_counter()
    for _ in range(n):
        tok = int(lm.extend([tok])[-1].argmax())
    engine.sync(model.device)
    return (time.perf_counter() - start) / n


@torch.inference_mode()
def hf_generate(target, ids: list[int], n: int, assistant=None, lookup: int | None = None, k: int = 4):
    """transformers' own greedy generate (plain, assisted, or prompt lookup): (ids, seconds)."""
    x = torch.tensor([ids], device=target.get_input_embeddings().weight.device)
    kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=target.generation_config.pad_token_id)
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        kw |= dict(assistant_model=assistant)
    if lookup:
        kw |= dict(prompt_lookup_num_tokens=lookup)
    engine.sync(target.device)
    start = time.perf_counter()
    out = target.generate(x, **kw)
    engine.sync(target.device)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def run_one(pair, prompt: str, s: SamplingConfig, sp: SpecConfig, r: RunConfig, mode: str):
    ids = pair.encode(prompt, r.chat)
    proposer = pair.proposer(sp) if mode == "speculative" else None
    steps = list(engine.generate(pair.target, pair.tokenizer, ids, proposer, s, sp, r))
    return ids, steps


def bench(args) -> dict:
    """Each prompt: a warm-up, then autoregressive, speculative and HF runs one after another."""
    s, sp, r = configs(args)
    pair = models.load_pair(args.target, args.draft, args.device, args.dtype)
    prompts = suite(args.suite)[: args.limit or None]
    rows = []
    run_one(pair, prompts[0], s, sp, RunConfig(8), "speculative")  # warm-up, discarded
    for i, prompt in enumerate(prompts):
        ids, ar = run_one(pair, prompt, s, sp, r, "autoregressive")
        _, spec = run_one(pair, prompt, s, sp, r, "speculative")
        a, b = metrics.summarize(ar), metrics.summarize(spec)
        row = dict(prompt=i, prompt_tokens=len(ids), autoregressive=a, speculative=b,
                   speedup=metrics.compare(b, a)["achieved_speedup"])
        if s.greedy:
            row["identical"] = [t for x in spec for t in x.emitted] == [t for x in ar for t in x.emitted]
            if args.hf and (pair.draft_model is not None or pair.draft_name == models.PROMPT_LOOKUP):
                n = len([t for x in ar for t in x.emitted])
                _, t_plain = hf_generate(pair.target, ids, n)
                lookup = sp.k if pair.draft_name == models.PROMPT_LOOKUP else None
                _, t_asst = hf_generate(pair.target, ids, n, pair.draft_model, lookup, sp.k)
                row["hf"] = dict(plain_tokens_per_s=n / t_plain, assisted_tokens_per_s=n / t_asst,
                                 assisted_speedup=t_plain / t_asst,
                                 ours_over_hf_assisted=b["tokens_per_s"] / (n / t_asst))
        rows.append(row)
        print(f"prompt {i}: speedup {row['speedup']:.2f}x, alpha {_f(b['alpha'])}, "
              f"accepted/drafted {_f(b['acceptance_rate'])}"
              + (f", vs HF assisted {row['hf']['ours_over_hf_assisted']:.2f}x" if "hf" in row else ""),
              file=sys.stderr)
    return dict(target=pair.target_name, draft=pair.draft_name, suite=args.suite,
                settings=settings_dict("bench", s, sp, r), summary=aggregate(rows), prompts=rows,
                device=str(pair.target.device), dtype=str(pair.target.dtype), torch=torch.__version__)


def aggregate(rows: list[dict]) -> dict:
    """Medians over prompts, and pooled acceptance over every round."""
    def med(f):
        vals = [f(r) for r in rows if f(r) is not None]
        return statistics.median(vals) if vals else None

    acc = sum(r["speculative"]["accepted"] for r in rows)
    drafted = sum(r["speculative"]["drafted"] for r in rows)
    rej = sum(r["speculative"]["rejections"] for r in rows)
    out = dict(
        prompts=len(rows),
        median_speedup=med(lambda r: r["speedup"]),
        alpha=acc / (acc + rej) if acc + rej else None,
        acceptance_rate=acc / drafted if drafted else None,
        median_tokens_per_pass=med(lambda r: r["speculative"]["tokens_per_pass"]),
        median_cost_ratio_c=med(lambda r: r["speculative"]["cost_ratio_c"]),
        median_theoretical_speedup=med(lambda r: r["speculative"]["theoretical_speedup"]),
        all_identical=all(r.get("identical", True) for r in rows),
    )
    if any("hf" in r for r in rows):
        out["median_hf_assisted_speedup"] = med(lambda r: r.get("hf", {}).get("assisted_speedup"))
        out["median_ours_over_hf_assisted"] = med(lambda r: r.get("hf", {}).get("ours_over_hf_assisted"))
    return out


def card(args) -> dict:
    """Model card figures: greedy acceptance at k=4 on held-out code, and decode cost ratios."""
    prompts = held_out_prompts()[: args.limit or None]
    target, tok = models.load(models.DEFAULT_TARGET, args.device, args.dtype)
    probe = tok(prompts[0])["input_ids"][-200:]
    t_target = statistics.median(decode_seconds_per_token(target, probe) for _ in range(3))
    out = {"target": dict(decode_ms=1000 * t_target, params=target.num_parameters())}
    s, r = SamplingConfig(), RunConfig(args.max_new_tokens)
    for name in ("draft-distilled", "draft-small", "draft-weak"):
        pair = models.load_pair(models.DEFAULT_TARGET, str(models.BUNDLED / name), args.device, args.dtype)
        t_draft = statistics.median(decode_seconds_per_token(pair.draft_model, probe) for _ in range(3))
        rows = []
        for prompt in prompts:
            _, ar = run_one(pair, prompt, s, SpecConfig(), r, "autoregressive")
            _, spec = run_one(pair, prompt, s, SpecConfig(k=4, k_policy="fixed"), r, "speculative")
            _, adaptive = run_one(pair, prompt, s, SpecConfig(k_policy="adaptive"), r, "speculative")
            a, b, c = (metrics.summarize(x) for x in (ar, spec, adaptive))
            rows.append(dict(autoregressive=a, speculative=b, speedup=metrics.compare(b, a)["achieved_speedup"],
                             adaptive_speedup=metrics.compare(c, a)["achieved_speedup"]))
        summary = aggregate(rows)
        summary["median_adaptive_speedup"] = statistics.median(r["adaptive_speedup"] for r in rows)
        out[name] = dict(params=pair.draft_model.num_parameters(), decode_ms=1000 * t_draft,
                         cost_per_token_vs_target=t_draft / t_target, **summary)
        print(name, json.dumps(out[name]), file=sys.stderr)
    return out


def _f(x):
    return "n/a" if x is None else f"{x:.3f}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m app bench", description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=["code", "prose", "all"], default="code")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers' assisted generation")
    ap.add_argument("--card", action="store_true", help="model card figures for the bundled family")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"), help="writes OUT.json and OUT.html")
    add_generation_args(ap)
    args = ap.parse_args(argv)
    doc = card(args) if args.card else bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    if not args.card:
        plots.bench_figure(doc).write_html(args.out.with_suffix(".html"), include_plotlyjs=True)  # works offline
    json.dump(doc.get("summary", doc), sys.stdout, indent=1)
    print()
    return 0
