"""How good the target's own text is: held-out loss, loops and distinct n-grams.

    python -m app quality [--target DIR] [--out runs/quality.json]

The model card's repetition figures come from here: 128-token continuations of held-out
code prompts (several per held-out file) and of English prompts, under three settings.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from app import args as generation_args
from app import models
from app.bench import progress
from app.core import knobs
from app.data import corpus

ENGLISH = (
    "Once upon a time",
    "The old lighthouse keeper looked out over the grey sea and remembered",
    "Why do cities grow along rivers? Historians point to several reasons, the first of which",
    '"""Helpers for reading configuration files.\n\nThe functions in this module',
    "# We keep the cache small on purpose. The reason is that",
    'def retry(func, attempts=3):\n    """Call func until it succeeds.\n\n    This is useful when',
    "Note that this function is not thread-safe. If you need",
    "This document describes how the scheduler decides",
)
SETTINGS = {
    "greedy": {},
    "greedy, repetition_penalty=1.2": {"repetition_penalty": 1.2},
    "sampled, T=0.7, top_p=0.95": {"do_sample": True, "temperature": 0.7, "top_p": 0.95},
}


def loops(ids: list[int], n: int = 8, times: int = 3) -> bool:
    """A continuation loops when some n-gram occurs `times` or more times in it."""
    grams = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    return bool(grams) and max(grams.values()) >= times


def distinct(ids: list[int], n: int = 4) -> float:
    """Distinct n-grams over all n-grams of one continuation."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def held_out_texts() -> list[tuple[str, str]]:
    """(name, source) of every held-out file: the stdlib's and the packages'."""
    out = []
    for path in corpus.stdlib_files():
        if path.name in corpus.HELD_OUT and path.parent.name.startswith("python"):
            out.append((path.name, path.read_text(encoding="utf-8")))
    for dist_name, rel in corpus.HELD_OUT_PACKAGES:
        try:
            dist = corpus.md.distribution(dist_name)
        except corpus.md.PackageNotFoundError:
            continue
        path = Path(dist.locate_file(rel))
        if path.is_file():
            out.append((rel, path.read_text(encoding="utf-8")))
    return out


def code_prompts(per_file: int = 3, n_chars: int = 600) -> list[str]:
    """Code up to a `def` line, at `per_file` spread-out places in each held-out file."""
    prompts = []
    for _, src in held_out_texts():
        defs = [m.end() for m in re.finditer(r"^ *def [^\n]*:\n", src, re.M) if m.start() > n_chars]
        for i in range(per_file):
            if defs:
                end = defs[(2 * i + 1) * len(defs) // (2 * per_file)]
                prompts.append(src[end - n_chars : end])
    return list(dict.fromkeys(prompts))


@torch.inference_mode()
def continuations(model, tokenizer, prompts, new_tokens: int, counter=None, **kw) -> list[list[int]]:
    """`new_tokens` tokens after each prompt; `counter` (progress.bar) advances once per prompt."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        torch.manual_seed(i)
        gen = model.generate(
            ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            **({"do_sample": False} | kw),
        )
        out.append(gen[0, ids.shape[1] :].tolist())
        if counter is not None:
            counter.update()
    return out


@torch.inference_mode()
def file_loss(model, tokenizer, files: int = 5, tokens: int = 2048) -> float:
    """Mean next-token loss on the first `tokens` tokens of the first held-out stdlib files."""
    ctx = model.config.max_position_embeddings
    losses = []
    for _, src in held_out_texts()[:files]:
        ids = tokenizer(src)["input_ids"][: tokens + 1]
        for s in range(0, len(ids) - 1, ctx):
            x = torch.tensor([ids[s : s + ctx + 1]])
            logits = model(input_ids=x[:, :-1]).logits[0]
            losses.append((F.cross_entropy(logits, x[0, 1:], reduction="sum").item(), x.shape[1] - 1))
    return sum(loss for loss, _ in losses) / sum(n for _, n in losses)


def measure(target: str, new_tokens: int = 128, dtype: str | None = None) -> dict:
    progress.say("quality", f"loading {target}")
    model, tokenizer = models.load(target, dtype=dtype)
    suites = {"code": code_prompts(), "english": list(ENGLISH)}
    progress.say("quality", "held-out loss on the first 2,048 tokens of 5 files")
    report = {
        "target": Path(target).name,
        "precision": models.precision_of(model),
        "new_tokens": new_tokens,
        "held_out_loss_first_2048_tokens_of_5_files": round(file_loss(model, tokenizer), 4),
        "prompts": {k: len(v) for k, v in suites.items()},
        "results": {},
    }
    # Every continuation counts once: each setting's suites, then one sample per setting.
    total = len(SETTINGS) * (sum(map(len, suites.values())) + 1)
    with progress.bar("continuation", total) as counter:
        for label, kw in SETTINGS.items():
            for suite, prompts in suites.items():
                conts = continuations(model, tokenizer, prompts, new_tokens, counter, **kw)
                report["results"][f"{suite} / {label}"] = dict(
                    loop_rate=round(sum(map(loops, conts)) / len(conts), 3),
                    distinct_4=round(sum(map(distinct, conts)) / len(conts), 3),
                )
        report["samples"] = {
            label: tokenizer.decode(continuations(model, tokenizer, [suites["code"][0]], 96, counter, **kw)[0])
            for label, kw in SETTINGS.items()
        }
    report["sample_prompt"] = suites["code"][0]
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app quality", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=models.TINY_TARGET, help="model directory or id")
    ap.add_argument("--new-tokens", type=int, default=128)
    generation_args.add_knob(ap, knobs.by_name("dtype"))
    ap.add_argument("--out", type=Path, default=Path("runs/quality.json"))
    args = ap.parse_args(argv)
    report = measure(args.target, args.new_tokens, args.dtype)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    print(f"written to {args.out}", file=sys.stderr)  # stdout is the JSON alone
    return 0
