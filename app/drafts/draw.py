"""The step every model-backed draft repeats: process the logits exactly as the target's will be, then
take the argmax (greedy), draw from q, or race q against the shared noise."""

from __future__ import annotations

import torch

from app.core import sampling
from app.core.config import SamplingConfig
from app.core.contracts import Proposal, Proposer

__all__ = ["Proposal", "Proposer", "draw"]


def draw(
    logits: torch.Tensor,
    history: list[int] | None,
    cfg: SamplingConfig,
    gen: torch.Generator,
    position: int | None = None,
) -> tuple[int, torch.Tensor | None]:
    """(token, q) from (V,) logits: q is None under greedy (one-hot on the argmax).

    history is the context the repetition controls read; None when the caller already applied them.
    position is the absolute position of the token drawn (default len(history)): under the
    shared-noise rule the draft races the noise the target will race there, so it proposes the
    target's own pick whenever q leads it there.
    """
    if history is not None and cfg.penalised:
        logits = sampling.penalise(logits[None], history, [], cfg)[0]
    if cfg.greedy:
        return int(logits.argmax()), None
    q = sampling.probs(logits, cfg)
    if cfg.shared_noise:
        if position is None and history is None:
            raise ValueError("a shared-noise draw needs the token's position, or the history it follows")
        at = len(history) if position is None else position
        return int(sampling.race(q, sampling.race_noise(cfg.seed, at, q.shape[-1], q.device))), q
    return sampling.sample(q, gen), q
