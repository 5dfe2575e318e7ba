"""Which precision a target runs in on this machine for --dtype auto: the fastest whose passes are
width-invariant here, measured once per model, device and thread setting, as the calibration is.

A pass is width-invariant when a row's logits are the same bits in a one-token pass and inside a
wider one: then speculative decoding's output is plain decoding's exactly, near-ties included. On a
CPU, the int8 precision (models/exact.py) is invariant by construction where it runs; fp32 and bf16
are probed and here were not (a float matrix product sums in an order set by the pass's width).
Where no precision is invariant, the faster of fp32 and bf16 is kept: bf16 only where it is clearly
faster, as with AMX or AVX-512 BF16 (emulated, it is slower). On a GPU it is bf16 (fp16 without
bf16 support).
"""

from __future__ import annotations

import copy
import threading
import time

import torch

from app.models import exact, exact_model, threads

MARGIN = 0.9  # bf16 is picked where its passes take at most this share of fp32's
WIDTHS = (1, 9)  # a plain step's pass and a verify pass's
REPS = 3  # timed passes per width and dtype, after one warm-up
CONTEXT = 64  # cached tokens before the timed passes

PROBE_WIDTHS = (2, 5, 9)  # verify widths whose rows are checked against one-token passes
_choice: dict[tuple, str] = {}
_lock = threading.Lock()


def native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (AMX, AVX-512 BF16). oneDNN's own
    `_is_mkldnn_bf16_supported` also says yes where it emulates bf16 on AVX-512, several times slower."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    try:
        return any(bool(check()) for check in checks if check is not None)
    except RuntimeError:
        return False


@torch.inference_mode()
def pass_seconds(model, widths: tuple[int, ...] = WIDTHS, reps: int = REPS) -> float:
    """Summed fastest seconds of one pass at each width after CONTEXT cached tokens."""
    from transformers import DynamicCache

    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, CONTEXT + max(widths)), generator=g, device=model.device)
    total = 0.0
    for width in widths:
        best = float("inf")
        for rep in range(reps + 1):
            cache = DynamicCache()
            model(ids[:, :CONTEXT], cache=cache, use_cache=True)
            start = time.perf_counter()
            model(ids[:, CONTEXT : CONTEXT + width], cache=cache, use_cache=True)
            if rep:
                best = min(best, time.perf_counter() - start)
        total += best
    return total


@torch.inference_mode()
def invariant(model, widths: tuple[int, ...] = PROBE_WIDTHS) -> bool:
    """Whether each row of a pass of every width in `widths` equals, bit for bit, the one-token pass
    at the same position after the same CONTEXT cached tokens."""
    from transformers import DynamicCache

    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(1)
    widest = max(widths)
    ids = torch.randint(0, vocab, (1, CONTEXT + widest), generator=g).to(model.device)
    cache = DynamicCache()
    model(ids[:, :CONTEXT], cache=cache, use_cache=True)
    ones = torch.stack(
        [model(ids[:, CONTEXT + i : CONTEXT + i + 1], cache=cache, use_cache=True).logits[0, 0] for i in range(widest)]
    )
    cache.crop(-widest)
    for width in widths:
        rows = model(ids[:, CONTEXT : CONTEXT + width], cache=cache, use_cache=True).logits[0]
        cache.crop(-width)
        if not torch.equal(rows, ones[:width]):
            return False
    return True


@torch.inference_mode()
def agreement(reference, other) -> float:
    """The share of CONTEXT probe positions where two models' argmax agree (one pass each)."""
    vocab = reference.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, CONTEXT), generator=torch.Generator().manual_seed(2)).to(reference.device)
    a, b = (m(ids).logits[0].argmax(-1) for m in (reference, other))
    return float((a == b).float().mean())


def choose(name: str, model) -> tuple[str, object]:
    """(precision, model in it): the precision `model` (loaded in fp32 on a CPU) runs in here, as
    typed (int8, bf16 or fp32), the fastest width-invariant one, else the faster of fp32 and bf16;
    with the copy the measurement built in it (None when it was measured before), for the loader
    to keep instead of building it again."""
    key = (name, str(model.device), threads.key())
    with _lock:
        known = _choice.get(key)
    if known is not None:
        return known, None
    known, built = _measure(model)
    with _lock:
        _choice[key] = known
    return known, built


AGREEMENT = 0.5  # int8 is a candidate only where its argmax agrees this often with fp32's on the probe (random
# tokens: SmolLM2 agrees at 0.77, a model whose attention computes otherwise near chance)


def _measure(model) -> tuple[str, object]:
    candidates = {"fp32": model}
    if native_bf16():
        candidates["bf16"] = copy.deepcopy(model).to(torch.bfloat16)
    if model.device.type == "cpu" and exact_model.supports(model):
        converted = exact_model.convert(model).eval()
        if agreement(model, converted) >= AGREEMENT:  # a family that converts but computes otherwise is left out
            candidates[exact.NAME] = converted
    exact_ones = [n for n, m in candidates.items() if invariant(m)]
    if len(exact_ones) > 1:
        picked = min(exact_ones, key=lambda n: pass_seconds(candidates[n]))
    elif exact_ones:
        picked = exact_ones[0]
    elif "bf16" in candidates and pass_seconds(candidates["bf16"]) <= MARGIN * pass_seconds(model):
        picked = "bf16"
    else:
        picked = "fp32"
    return picked, candidates[picked]


def chosen(name: str, device: str) -> str | None:
    """What choose() picked for this model here before, if it ran."""
    with _lock:
        return _choice.get((name, device, threads.key()))
