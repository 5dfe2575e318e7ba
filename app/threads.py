"""How many threads torch uses inside one operation (intra-op), chosen for a shared machine.

Measured on this project's 2-core CPU with the bundled pair (README, "Threads"): with another
process busy, two threads collapse to a tenth of one thread's speed or less (OpenMP workers
wait on a core that is taken), while one thread keeps going. So the default is the setting
whose worst case is best: one thread. `--threads N` or SPECDEC_THREADS=N overrides it, e.g.
for a large model on a many-core machine you own.
"""

from __future__ import annotations

import os

import torch

from app.config import SpecError

ENV = "SPECDEC_THREADS"
DEFAULT = 1  # the best worst case measured (see the module docstring)


def choose(requested: int | None = None) -> int:
    """Threads to use: `requested` (a --threads flag) if given, else SPECDEC_THREADS, else DEFAULT."""
    if requested is not None:
        n, source = requested, "--threads"
    elif os.environ.get(ENV, "").strip():
        raw, source = os.environ[ENV].strip(), ENV
        try:
            n = int(raw)
        except ValueError:
            raise SpecError(f"{ENV} must be a whole number of threads, got {raw!r}") from None
    else:
        return DEFAULT
    if n < 1:
        raise SpecError(f"{source} must be at least 1, got {n}")
    return n


def apply(requested: int | None = None) -> int:
    """Set torch's intra-op threads by `choose` and return the number set."""
    n = choose(requested)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
