"""Where drafts come from: a small model, prompt lookup, or the target's early layers.

Every source keeps its own copy of the committed tokens, proposes up to k new ones,
then learns how many the target kept. Choosing k is the policy's job, not theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from app import sampling
from app.cache import CachedModel, early_exit_view
from app.config import SamplingConfig


@dataclass
class Proposal:
    tokens: list[int]  # the drafts x_1..x_n, n <= k
    q: torch.Tensor | None  # (n, V) draft distributions after processing; None means one-hot (greedy too)


class Proposer(Protocol):
    name: str

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        """Start a request from the prompt's ids; only ids below vocab_size may be drafted."""

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        """Draft up to k tokens after the committed ones."""

    def commit(self, accepted: int, token: int) -> None:
        """The target kept the first `accepted` drafts, then chose `token`."""


class ModelProposer:
    """A draft model (or the target's first layers) with its own KV cache.

    The cache lags the committed ids by one or two tokens: the next propose feeds them
    in one pass. That is how the draft still sees the last draft after a full accept.
    """

    def __init__(self, model: PreTrainedModel, name: str):
        self.model, self.name = model, name

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        self.ids = list(prompt_ids)
        self.lm = CachedModel(self.model)
        # Padded embedding rows beyond the target's vocabulary must never be drafted.
        self.vocab_size = vocab_size
        self._drafts: list[int] = []

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        if k == 0:
            self._drafts = []
            return Proposal([], None)
        logits = self.lm.extend(self.ids[self.lm.length :], keep=1)[-1]
        tokens, qs = [], []
        for i in range(k):
            logits = sampling.penalise(logits[None, : self.vocab_size], self.ids + tokens, [], cfg)[0]
            if cfg.greedy:  # q is one-hot on the argmax: no distribution to build
                x = int(logits.argmax())
            else:
                qs.append(sampling.probs(logits, cfg))
                x = sampling.sample(qs[-1], gen)
            tokens.append(x)
            if i < k - 1:
                logits = self.lm.extend([x])[-1]
        self._drafts = tokens
        return Proposal(tokens, torch.stack(qs) if qs else None)

    def commit(self, accepted: int, token: int) -> None:
        # The cache holds ids + drafts[:-1]; keep only the part the target agreed with.
        self.lm.rollback(min(self.lm.length, len(self.ids) + accepted))
        self.ids += self._drafts[:accepted] + [token]
        self._drafts = []


def early_exit(target: PreTrainedModel, n_layers: int) -> ModelProposer:
    """Self-speculation: the target's first n layers, final norm and LM head."""
    return ModelProposer(early_exit_view(target, n_layers), f"early-exit:{n_layers}")


class PromptLookup:
    """Propose what followed the most recent earlier match of the context's last n-gram.

    Longest n first. It has no distribution, so verification treats q as one-hot.
    """

    name = "prompt-lookup"

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

    def commit(self, accepted: int, token: int) -> None:
        self.ids += self._drafts[:accepted] + [token]
        self._drafts = []
