"""Where drafts come from: a small model, prompt lookup, the target's early layers, or a
feature-level head that reads the target's hidden states (EAGLE-style).

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
    feature_position: int | None = None  # feature drafts: which target feature (a position) they started from


class Proposer(Protocol):
    name: str
    wants_features: bool  # True: commit also receives the target's features of the kept positions

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        """Start a request from the prompt's ids; only ids below vocab_size may be drafted."""

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        """Draft up to k tokens after the committed ones."""

    def commit(self, accepted: int, token: int, features: torch.Tensor | None = None) -> None:
        """The target kept the first `accepted` drafts, then chose `token`.

        features (only when wants_features): (m, H) the target's last-layer hidden states of the
        positions it processed this round and kept; the last one is where `token` was chosen.
        """


class ModelProposer:
    """A draft model (or the target's first layers) with its own KV cache.

    The cache lags the committed ids by one or two tokens: the next propose feeds them
    in one pass. That is how the draft still sees the last draft after a full accept.
    """

    wants_features = False

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
            logits = logits[: self.vocab_size]
            if cfg.penalised:
                logits = sampling.penalise(logits[None], self.ids + tokens, [], cfg)[0]
            if cfg.greedy:  # q is one-hot on the argmax: no distribution to build
                x = int(logits.argmax())
            else:
                qs.append(sampling.probs(logits, cfg))
                x = sampling.sample(qs[-1], gen)
            tokens.append(x)
            if i < k - 1:
                logits = self.lm.step(x)
        self._drafts = tokens
        return Proposal(tokens, torch.stack(qs) if qs else None)

    def commit(self, accepted: int, token: int, features: torch.Tensor | None = None) -> None:
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
    wants_features = False

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


class FeatureProposer:
    """EAGLE-1 drafting: a one-layer head over the target's own features, with its own KV cache.

    Its cache holds one entry per pair (x_{j+1}, f_j) whose feature came from the target; drafted
    pairs use the head's predicted features and are rolled back at commit, then re-fed with the
    target's true features (as EAGLE does). Before the target's first pass there are no features,
    so the first round drafts nothing.
    """

    wants_features = True

    def __init__(self, target: PreTrainedModel, head, name: str = "feature-head"):
        self.target, self.head, self.name = target, head, name
        self.model = head  # what context_length and the teaching view look at
        # Looked up once: transformers' accessors walk the module tree on every call.
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        self.ids = list(prompt_ids)
        self.vocab_size = vocab_size
        self.cache = self.head.new_cache()
        self.pairs = 0  # true pairs in the head's cache
        # (m, H) blocks of the target's features not yet fed to the head: f_pairs .. f_{len(ids)-2}.
        # Fed ones are dropped, so a round never copies the whole history.
        self.features: list[torch.Tensor] = []
        self.n_features = 0  # features received in all
        self.tokens_processed = 0  # pairs fed through the head, so tests can prove rollback never re-feeds
        self._drafts: list[int] = []
        self.read_feature: int | None = None  # position of the target feature the last draft round read

    def _step(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """Feed pairs (tokens[i], features[i]); return the (n, H) predicted next features."""
        x = torch.tensor([tokens], device=self.embed.weight.device)
        self.tokens_processed += len(tokens)
        return self.head(self.embed(x), features[None], self.cache)[0]

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        self._drafts = []
        if k == 0 or self.n_features == 0:
            return Proposal([], None)
        with torch.inference_mode():  # one context for the round, not one per step
            return self._propose(k, cfg, gen)

    def _propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        f = self.features[0] if len(self.features) == 1 else torch.cat(self.features)
        self.features = []
        # Pairs j = pairs+1 .. len(ids)-1: token x_j with the target's feature f_{j-1}.
        predicted = self._step(self.ids[self.pairs + 1 :], f)
        self.pairs = len(self.ids) - 1
        self.read_feature = len(self.ids) - 2
        tokens, qs = [], []
        feature = predicted[-1]
        for i in range(k):
            logits = self.lm_head(feature)[None, : self.vocab_size]
            if cfg.penalised:
                logits = sampling.penalise(logits, self.ids + tokens, [], cfg)
            if cfg.greedy:
                x = int(logits.argmax())
            else:
                qs.append(sampling.probs(logits[0], cfg))
                x = sampling.sample(qs[-1], gen)
            tokens.append(x)
            if i < k - 1:  # EAGLE drafts on its own predicted feature
                feature = self._step([x], feature[None])[-1]
        self._drafts = tokens
        return Proposal(tokens, torch.stack(qs) if qs else None, self.read_feature)

    def commit(self, accepted: int, token: int, features: torch.Tensor | None = None) -> None:
        if features is None:
            raise ValueError("a feature head needs the target's features at every commit")
        drafted_pairs = self.cache.get_seq_length() - self.pairs
        if drafted_pairs > 0:  # pairs built on predicted features: the target's true ones replace them
            self.cache.crop(-drafted_pairs)
        self.ids += self._drafts[:accepted] + [token]
        self.features.append(features.detach())
        self.n_features += features.shape[0]
        self._drafts = []
