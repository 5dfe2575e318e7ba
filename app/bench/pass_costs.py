"""`python -m app bench --passes`: what one target pass costs here, by width and dtype, against the
machine's memory bandwidth.

A verify pass over n tokens reads every weight once, so at small n it is bound by memory: its
floor is the weights' bytes over the bandwidth. The report gives ms per pass for n = 1..k_max+1
in each dtype, the bandwidth a large copy reaches, and the share of it a one-token pass uses; and a
one-token pass after LONG_CONTEXT cached positions (or as many as the model takes), where the
attention's reads of the cache join the weights'.
"""

from __future__ import annotations

import copy
import sys
import time

import torch

from app import calibrate, models
from app.bench import progress
from app.core import text
from app.data.prompts import suite
from app.models import exact, exact_model, int8_kernel, threads

COPY_BYTES = 256 << 20  # larger than any cache, so the copy streams from memory
COPY_REPS = 5
LONG_CONTEXT = 1024
DTYPES = ("fp32", "bf16", exact.NAME)  # int8: models/exact.py, the passes whose rows are exact at every width


def bandwidth() -> float:
    """Bytes per second a large tensor copy reaches (read plus write), the fastest of a few."""
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(COPY_REPS + 1):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * COPY_BYTES / best


def passes(args) -> dict:
    """ms per target pass by width for each dtype, and how close a one-token pass comes to the bandwidth."""
    target_id = models.presets.id_of(args.target or models.DEFAULT_TARGET)
    progress.say("passes", f"loading {target_id}")
    target, tok = models.load(target_id, args.device, "fp32")
    chat = bool(getattr(tok, "chat_template", None))
    context = text.prompt_ids(tok, suite("code", chat=chat)[0], chat, 1 << 20)
    longest = min(LONG_CONTEXT, getattr(target.config, "max_position_embeddings", LONG_CONTEXT) - 1)
    long_context = (context * (longest // len(context) + 1))[:longest]
    context = long_context[: calibrate.CONTEXT]
    widths = args.k_max + 1
    # Auto threads read the machine's load when they start: a busy machine times on fewer (docs/threads.md).
    how = "chosen from this machine's load now" if threads.key() == threads.AUTO else "fixed"
    progress.say("passes", f"measuring the memory bandwidth, on {torch.get_num_threads()} torch threads ({how})")
    bytes_per_s = bandwidth()
    out = dict(
        target=target_id,
        device=str(target.device),
        threads=torch.get_num_threads(),
        context=len(context),
        long_context=len(long_context),
        bandwidth_gb_s=bytes_per_s / 1e9,
    )
    for name in DTYPES:
        if name == exact.NAME and not (target.device.type == "cpu" and exact_model.supports(target)):
            continue
        progress.say("passes", f"timing passes of 1..{widths} tokens in {name}")
        model = _in(target, name)
        ms = [1000 * t for t in calibrate.pass_times(model, context, widths)]
        weight_bytes = exact_model.weight_bytes(model)
        floor_ms = 1000 * weight_bytes / bytes_per_s
        out[name] = dict(
            ms_by_width=ms,
            one_token_ms_after_long_context=1000 * calibrate.pass_times(model, long_context, 1)[0],
            weight_mb=weight_bytes / 1e6,
            bandwidth_floor_ms=floor_ms,
            share_of_bandwidth=floor_ms / ms[0],
        )
        if name == exact.NAME:  # which code ran it: the kernel's instruction set, or torch ops
            out[name]["kernel"] = int8_kernel.isa() or f"none, torch ops: {int8_kernel.why()}"
        print(name, out[name], file=sys.stderr)
    faster = min((n for n in DTYPES if n in out), key=lambda n: out[n]["ms_by_width"][0])
    out["faster_one_token_pass"] = faster
    return out


def _in(target, name: str):
    """A copy of the loaded fp32 target in precision `name` (models.load shares the loaded one)."""
    if name == exact.NAME:
        return exact_model.convert(target).eval()
    return copy.deepcopy(target).to({"fp32": torch.float32, "bf16": torch.bfloat16}[name])
