"""Hugging Face ZeroGPU: models placed once at start-up, a GPU lent per call for a bounded time.

On ZeroGPU each call of a `@spaces.GPU` function runs in a worker process that gets the GPU
for `duration` seconds; its arguments and results cross the process boundary pickled, and
what the worker loads or caches is gone afterwards. So, as ZeroGPU's guidance says:
- models are loaded at module level in the main process and moved with `.to("cuda")` there
  (`preload`), so every worker starts with them in place instead of loading them per call;
- per-request state is plain, picklable data (sessions.Teaching, the Stop flag's dict);
- `duration` follows the request's max_new_tokens, so short requests queue for less GPU time.
Everywhere else `gpu` runs the function on the compute threads (compute_thread.py) and `preload`
does nothing.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable

from app.serve import compute_thread

log = logging.getLogger(__name__)
BASE_SECONDS = 15.0  # loading the request onto the lent GPU, prefill, the first rounds
SECONDS_PER_TOKEN = 0.08  # two interleaved runs (speculative and plain) of a 7B target, with margin
MAX_SECONDS = 120  # the longest GPU loan ZeroGPU grants one call
DEFAULT_PRELOAD = ("SmolLM2-135M-Instruct (offline)", "feature draft for SmolLM2 (EAGLE-style, trained here)")
GPU_FUNCTIONS: list[Callable] = []  # every function wrapped by `gpu`, for the pickling test


def enabled() -> bool:
    """True on a ZeroGPU Space (the platform sets SPACES_ZERO_GPU)."""
    return bool(os.environ.get("SPACES_ZERO_GPU"))


def seconds(max_new_tokens) -> int:
    """GPU seconds to ask for a request of max_new_tokens (a bad value gets the default)."""
    try:
        n = max(1, min(int(max_new_tokens), 4096))
    except (TypeError, ValueError, OverflowError):  # the handler refuses it with a message
        n = 128
    return int(min(MAX_SECONDS, BASE_SECONDS + SECONDS_PER_TOKEN * n))


def gpu(fn: Callable, longest: bool = False) -> Callable:
    """`spaces.GPU` with a duration from the call's max_new_tokens (`longest`: the longest loan, for
    a call that runs many prompts) where `spaces` exists, else fn on the compute threads."""
    GPU_FUNCTIONS.append(fn)
    try:
        import spaces
    except ImportError:
        on_compute = compute_thread.runs_on(fn)  # one OpenMP team per compute thread (compute_thread.py)
        GPU_FUNCTIONS.append(on_compute)
        return on_compute
    signature = inspect.signature(fn)

    def duration(*args, **kwargs) -> int:
        if longest:
            return MAX_SECONDS
        try:
            return seconds(signature.bind_partial(*args, **kwargs).arguments.get("max_new_tokens"))
        except TypeError:
            return seconds(None)

    return spaces.GPU(duration=duration)(fn)


def preload_ids() -> list[str]:
    """Presets to place at start-up: SPECDEC_PRELOAD (comma list of preset labels or ids), else the default pair."""
    raw = os.environ.get("SPECDEC_PRELOAD", "")
    return [x.strip() for x in raw.split(",") if x.strip()] or list(DEFAULT_PRELOAD)


def preload() -> list[str]:
    """On ZeroGPU, load the preset models at module level and move them to CUDA; return what was placed."""
    if not enabled():
        return []
    from app import models
    from app.core.config import UserError
    from app.drafts import kinds

    placed = []
    for model_id in preload_ids():
        if model_id not in models.preset_ids():
            log.warning("SPECDEC_PRELOAD: %r is not a preset; skipped", model_id)
            continue
        role = "target" if model_id in (*models.TARGET_PRESETS, *models.TARGET_PRESETS.values()) else "draft"
        if not kinds.parse(models.resolve(model_id, role), probe=False).loads_model:
            continue  # prompt lookup and early exit have no weights of their own
        try:
            models.preload(model_id, role)
        except UserError as e:  # one preset that will not load must not keep the Space down
            log.warning("SPECDEC_PRELOAD: %s", e)
            continue
        placed.append(model_id)
    return placed
