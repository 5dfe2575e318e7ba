"""EAGLE-style drafting: a feature head over the target's own hidden states (the head itself: feature_head.py)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from app.core.config import SamplingConfig
from app.drafts.draw import Proposal, draw


class FeatureProposer:
    """EAGLE-1 drafting: a one-layer head over the target's own features, with its own KV cache.

    Its cache holds one entry per pair (x_{j+1}, f_j) whose feature came from the target; drafted
    pairs use the head's predicted features and are rolled back at commit, then re-fed with the
    target's true features (as EAGLE does). Before the target's first pass there are no features,
    so the first round drafts nothing.
    """

    wants_features = True
    cache_factory = None  # the head keeps its own growing cache

    def __init__(self, target: PreTrainedModel, head, name: str = "feature-head"):
        self.target, self.head, self.name = target, head, name
        self.context_limit = getattr(head.config, "max_position_embeddings", None)
        # Looked up once: transformers' accessors walk the module tree on every call.
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        # A head with a reduced draft vocabulary scores only those rows of the LM head (q = 0 elsewhere).
        self.vocab, self.w_sub = head.draft_rows(self.lm_head) or (None, None)

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
            x, q = self._draw(feature, self.ids + tokens, cfg, gen)
            if q is not None:
                qs.append(q)
            tokens.append(x)
            if i < k - 1:  # EAGLE drafts on its own predicted feature
                feature = self._step([x], feature[None])[-1]
        self._drafts = tokens
        return Proposal(tokens, torch.stack(qs) if qs else None, self.read_feature)

    def _draw(self, feature: torch.Tensor, history: list[int], cfg: SamplingConfig, gen: torch.Generator):
        """A draft token from a predicted feature, through the LM head (or its draft-vocabulary rows)."""
        if self.vocab is None:
            return draw(self.lm_head(feature)[: self.vocab_size], history, cfg, gen)
        scores = torch.nn.functional.linear(feature, self.w_sub)
        if cfg.greedy and not cfg.penalised:  # the argmax of the subset: no full row needed
            return int(self.vocab[scores.argmax()]), None
        logits = torch.full((self.vocab_size,), float("-inf"), device=scores.device, dtype=scores.dtype)
        logits[self.vocab] = scores
        return draw(logits, history, cfg, gen)

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

    def end(self) -> None:
        pass
