"""Prompt lookup: drafts copied from earlier in the context (no model), and its draft kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from app.core.config import SamplingConfig, SpecConfig
from app.core.contracts import KVCache, Proposer
from app.drafts.draft_spec import BaseDraft, BaseKind, Draft, DraftInfo, DraftSpec, Loading
from app.drafts.draw import Proposal


class PromptLookup:
    """Propose what followed the most recent earlier match of the context's last n-gram.

    Longest n first. It has no distribution, so verification treats q as one-hot.
    """

    branches = True  # several matches' continuations merged into one trie

    name = "prompt-lookup"
    wants_features = False
    context_limit: int | None = None
    cache_factory: Callable[[Any], KVCache] | None = None  # no model, no cache

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, eos: tuple[int, ...] = ()):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        # a continuation is cut before an end-of-text id, as transformers' lookup does: the output ends
        # there only if the target itself picks it
        self.eos = frozenset(eos)

    def _until_eos(self, follow: list[int]) -> list[int]:
        for i, t in enumerate(follow):
            if t in self.eos:
                return follow[:i]
        return follow

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        self.ids = list(prompt_ids)
        self._drafts: list[int] = []

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator, nodes: int = 0) -> Proposal:
        if nodes:  # several matches' continuations as branches of one tree
            return self._propose_tree(k, nodes)
        ids = self.ids
        for n in range(min(self.ngram_max, len(ids) - 1), self.ngram_min - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    self._drafts = self._until_eos(ids[start + n : start + n + k])
                    if self._drafts:
                        return Proposal(list(self._drafts), None)
        self._drafts = []
        return Proposal([], None)

    def _propose_tree(self, k: int, nodes: int) -> Proposal:
        """The continuations of the context's last n-gram at every earlier match (longest n first, the
        most recent match first), merged into a trie of at most `nodes` nodes, k deep: each node's
        children are distinct tokens, and q is one-hot on each."""
        ids, seen = self.ids, set()
        tokens: list[int] = []
        parents: list[int] = []
        node: dict[tuple[int, int], int] = {}
        for n in range(min(self.ngram_max, len(ids) - 1), self.ngram_min - 1, -1) if k else ():
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                follow = tuple(self._until_eos(ids[start + n : start + n + k]))
                if ids[start : start + n] != tail or not follow or follow in seen:
                    continue
                seen.add(follow)
                parent = -1
                for t in follow:
                    if (parent, t) not in node:
                        if len(tokens) == nodes:
                            break
                        node[(parent, t)] = len(tokens)
                        tokens.append(t)
                        parents.append(parent)
                    parent = node[(parent, t)]
                if len(tokens) == nodes:
                    break
            if len(tokens) == nodes:
                break
        self._drafts, self._parents = tokens, parents
        return Proposal(list(tokens), None, parents=list(parents))

    def commit(self, path: list[int], token: int, features: torch.Tensor | None = None) -> None:
        self.ids += [self._drafts[i] for i in path] + [token]
        self._drafts = []

    def end(self) -> None:
        pass


LOOKUP_TEXT = "prompt-lookup"  # how users type it


class LookupKind(BaseKind):
    name = "prompt_lookup"
    loads_weights = False
    described = "prompt lookup"

    def parse(self, text: str, probe: bool) -> DraftSpec | None:
        return DraftSpec(self) if text.lower() in (LOOKUP_TEXT, "prompt_lookup", "prompt lookup") else None

    def show(self, spec: DraftSpec) -> str:
        return LOOKUP_TEXT

    def load(self, spec: DraftSpec, loading: Loading) -> Draft:
        return LookupDraft(self, spec, LOOKUP_TEXT)

    def vllm(self, info: DraftInfo, k: int, spec: SpecConfig) -> tuple[dict | None, list[str]]:
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": spec.ngram_max,
            "prompt_lookup_min": spec.ngram_min,
        }, []

    def llama_server(self, info: DraftInfo, k: int, spec: SpecConfig, gguf) -> tuple[list[str], list[str]]:
        argv = ["--spec-type", "ngram-simple", "--spec-ngram-size-n", str(spec.ngram_max)]
        argv += ["--spec-ngram-size-m", str(k), "--draft-max", str(k)]
        notes = []
        if spec.ngram_min < spec.ngram_max:
            notes.append(
                f"llama.cpp matches {spec.ngram_max}-grams only; this app also falls back to shorter "
                f"n-grams down to {spec.ngram_min}"
            )
        return argv, notes


class LookupDraft(BaseDraft):
    def proposer(self, target, spec: SpecConfig) -> Proposer:
        return PromptLookup(spec.ngram_max, spec.ngram_min, eos_ids(target))

    def idle_note(self, step) -> str:
        return "No n-gram ending the text so far occurs earlier in it, so prompt lookup had nothing to propose."


def eos_ids(target) -> tuple[int, ...]:
    """The target's end-of-text ids, from its generation config (or its config)."""
    found = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    found = found if found is not None else getattr(target.config, "eos_token_id", None)
    if found is None:
        return ()
    return tuple(found) if isinstance(found, (list, tuple)) else (int(found),)


KIND = LookupKind()
