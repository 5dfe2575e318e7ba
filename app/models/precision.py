"""Which dtype a target runs fastest in on this machine, for --dtype auto: measured once per model,
device and thread setting, as the calibration is.

On a GPU that is bf16 (fp16 without bf16 support). On a CPU it depends: with AMX or AVX-512 BF16,
bf16 passes run well ahead of fp32 for small models, which are bound by memory bandwidth; without
native bf16 they are emulated and slower. So on a CPU both are timed, and bf16 is kept only where
it is clearly faster.
"""

from __future__ import annotations

import copy
import threading
import time

import torch

from app.models import threads

MARGIN = 0.9  # bf16 is picked where its passes take at most this share of fp32's
WIDTHS = (1, 9)  # a plain step's pass and a verify pass's
REPS = 3  # timed passes per width and dtype, after one warm-up
CONTEXT = 64  # cached tokens before the timed passes

_choice: dict[tuple, torch.dtype] = {}
_lock = threading.Lock()


def native_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products natively (AMX, AVX-512 BF16) in oneDNN."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
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


def choose(name: str, model) -> torch.dtype:
    """The dtype `model` (loaded in fp32 on a CPU) runs its passes fastest in on this machine and
    thread setting; a GPU's is loading.choose_device's default."""
    key = (name, str(model.device), threads.key())
    with _lock:
        known = _choice.get(key)
    if known is None:
        known = torch.float32
        if native_bf16():
            low = copy.deepcopy(model).to(torch.bfloat16)
            if pass_seconds(low) <= MARGIN * pass_seconds(model):
                known = torch.bfloat16
            del low
        with _lock:
            _choice[key] = known
    return known


def chosen(name: str, device: str) -> torch.dtype | None:
    """What choose() picked for this model here before, if it ran."""
    with _lock:
        return _choice.get((name, device, threads.key()))
