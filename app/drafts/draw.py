"""The step every model-backed draft repeats: process the logits exactly as the target's will be, then
take the argmax (greedy) or draw from q."""

from __future__ import annotations

import torch

from app.core import sampling
from app.core.config import SamplingConfig
from app.core.contracts import Proposal, Proposer

__all__ = ["Proposal", "Proposer", "draw"]


def draw(
    logits: torch.Tensor, history: list[int] | None, cfg: SamplingConfig, gen: torch.Generator
) -> tuple[int, torch.Tensor | None]:
    """(token, q) from (V,) logits: q is None under greedy (one-hot on the argmax).

    history is the context the repetition controls read; None when the caller already applied them.
    """
    if history is not None and cfg.penalised:
        logits = sampling.penalise(logits[None], history, [], cfg)[0]
    if cfg.greedy:
        return int(logits.argmax()), None
    q = sampling.probs(logits, cfg)
    return sampling.sample(q, gen), q
