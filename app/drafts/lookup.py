"""Prompt lookup: drafts copied from earlier in the context (no model)."""

from __future__ import annotations

import torch

from app.core.config import SamplingConfig
from app.drafts.draw import Proposal


class PromptLookup:
    """Propose what followed the most recent earlier match of the context's last n-gram.

    Longest n first. It has no distribution, so verification treats q as one-hot.
    """

    name = "prompt-lookup"
    wants_features = False
    context_limit = None
    cache_factory = None  # no model, no cache

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        self.ids = list(prompt_ids)
        self._drafts: list[int] = []

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        ids = self.ids
        for n in range(min(self.ngram_max, len(ids) - 1), self.ngram_min - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    self._drafts = ids[start + n : start + n + k]
                    return Proposal(list(self._drafts), None)
        self._drafts = []
        return Proposal([], None)

    def commit(self, accepted: int, token: int, features: torch.Tensor | None = None) -> None:
        self.ids += self._drafts[:accepted] + [token]
        self._drafts = []

    def end(self) -> None:
        pass
