"""What the round loop needs from its collaborators: a draft source and a KV cache that rolls back.

The engine is written against these Protocols only; `drafts/` and `kv/` implement them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from app.core import tree_shape
from app.core.config import SamplingConfig


@dataclass
class Proposal:
    tokens: list[int]  # the drafts x_1..x_n, n <= k (for a tree: its nodes, parents before children)
    q: torch.Tensor | None  # (n, V) draft distributions after processing; None means one-hot (greedy too)
    feature_position: int | None = None  # feature drafts: which target feature (a position) they started from
    # Node i hangs below node parents[i] (-1: below the last committed token), and q's row i is the
    # distribution it was drawn from given its earlier siblings (verify's tree rule). Left out: a chain,
    # whose parents are [-1, 0, 1, ..].
    parents: list[int] = field(default_factory=list)
    # A chain's picks still on the device (engine.py's verify feeds them to the target there, and
    # reads them with its verdict): `tokens` is empty until then, and filled in place.
    pending: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens) if self.pending is None else len(self.pending)
        if not self.parents:
            self.parents = tree_shape.chain(n)
        if len(self.parents) != n:
            raise ValueError(f"{n} drafts need as many parents, got {len(self.parents)}")


class Proposer(Protocol):
    name: str
    # True: commit also receives the target's features of the kept positions; such a proposer may name
    # `feature_layers`, the target layers whose entering states it reads fused (absent: the last layer's, normed)
    wants_features: bool
    context_limit: int | None  # tokens the draft can attend to (None: no limit of its own)
    # The KV cache the draft's model runs on, which a run may swap for the static one (the GPU fast
    # path); None for a draft that runs no model's cache or keeps its own.
    cache_factory: Callable[[Any], KVCache] | None
    # A source that can draft trees says so with a class attribute `branches = True`; the engine
    # refuses a tree to any other, and its kind refuses one when the run is set up.

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        """Start a request from the prompt's ids; only ids below vocab_size may be drafted."""

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator, nodes: int = 0) -> Proposal:
        """Draft up to k tokens after the committed ones: a chain, or with a node budget (nodes > 0,
        given only to a source that branches) a tree of at most that many nodes, k deep."""

    def commit(self, path: list[int], token: int, features: torch.Tensor | None = None) -> None:
        """The target kept the drafted nodes `path` (their tokens, in order, are the accepted drafts; a
        chain's are its first len(path)), then chose `token`.

        features (only when wants_features): (m, H) the target's last-layer hidden states, or (m, 3H)
        the states entering its feature_layers, of the positions it processed this round and kept;
        the last one is where `token` was chosen.
        """

    def end(self) -> None:
        """The request is over: give back what begin() took (pooled caches)."""


class KVCache(Protocol):
    """One request's view of a shared causal LM: feed tokens, read logits, roll back to a length."""

    length: int  # tokens the cache holds
    tokens_processed: int  # every token ever fed, so tests can prove rollback never re-prefills
    device: torch.device
    feature_layers: tuple[int, ...]  # the features a pass returns: () the last layer's, else these layers' inputs
    device_steps: bool  # step() also takes a 0-d tensor on the device (a draft's pick the host never reads)

    def extend(
        self, ids: list[int], keep: int = 0, parents: Sequence[int] = (), on_device: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Feed ids after the cached ones; (keep, V) logits of the last `keep` (0: all). The last
        len(parents) ids are drafts (node i below parents[i], -1: below the last committed id); a tree of
        them gives the (1 + n, V) logits after the last committed id and each node. Where device_steps,
        `on_device` holds the values of a chain's last ids on the device (ids holds stand-ins)."""

    def extend_with_features(
        self, ids: list[int], keep: int = 0, parents: Sequence[int] = (), on_device: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As extend, plus the (len(ids), H) features of every fed position."""

    def step(self, token: Any) -> torch.Tensor:
        """(V,) logits of one more token: an id, or where device_steps a 0-d tensor on the device."""

    def rollback(self, length: int, path: Sequence[int] = ()) -> None:
        """Forget every cached position at or after `length`; with path, the drafts fed from slot
        `length` on that the target kept (node indices, in order) move into place and stay."""

    def close(self) -> None:
        """The request is over: a pooled cache goes back to its pool."""
