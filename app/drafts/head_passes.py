"""A feature head's passes over its own KV cache: eagerly on a growing cache, or on the fast path
as CUDA graphs over a static one.

The head's cache holds one pair (x_{j+1}, f_j) a slot. A pass feeds pairs after the cached ones:
a causal run (the true pairs after a verdict, a chain's next step) or a tree's depth (each node
seeing the true pairs and its ancestors, at the position of its depth). On the fast path each
pass of a bucket's width replays a graph (kv/cuda_graphs.py) whose inputs are the ids, the rows'
positions and sight, and the features; the head's step costs a replay instead of a launch per
kernel, as the target's passes do.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from torch import nn
from transformers import StaticCache

from app.core import decoder_layers, transfer
from app.kv import cuda_graphs, growing_cache, static_cache


class EagerHeadPasses:
    """The head's passes on a growing cache, each a fresh call (the default off the fast path)."""

    def __init__(self, head: Any, embed: nn.Module):
        self.head, self.embed = head, embed
        self.cache: Any = growing_cache.new_cache(head.config)
        self.device = cast(torch.Tensor, embed.weight).device

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def causal(self, tokens: list[int] | torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(n, H) predicted features of pairs (tokens[i], features[i]) after the cached ones; tokens
        may be one 0-d tensor on the device (a greedy pick, unread)."""
        x = tokens.view(1, 1) if isinstance(tokens, torch.Tensor) else torch.tensor([tokens], device=self.device)
        return self.head(self.embed(x), features[None], self.cache)[0]

    def tree(
        self, tokens: list[int], features: torch.Tensor, position: int, prefix: int, sees: list[list[int]]
    ) -> torch.Tensor:
        """(n, H) features of one depth's nodes, all at `position`: node i sees slots [0, prefix) and sees[i]."""
        return self._depth(tokens, features, position, prefix, sees, self.length + len(tokens))

    def _depth(self, tokens, features, position: int, prefix: int, sees, kv: int) -> torch.Tensor:
        """One tree depth through the head under its mask over kv key slots."""
        n = len(tokens)
        mask = decoder_layers.tree_pass(sees, [prefix] * n, kv, self.head.config, self.device)
        x = transfer.queued(torch.tensor([tokens]), self.device)  # behind the head's last pass, no wait
        where = torch.full((1, n), position, device=self.device)
        return self.head(self.embed(x), features[None], self.cache, mask, where)[0]

    def crop(self, length: int) -> None:
        """Forget the pairs at and after slot `length`."""
        if length < self.length:
            self.cache.crop(length - self.length)

    def close(self) -> None:
        """Nothing is pooled here."""


_pool = cuda_graphs.Pools()


class GraphedHeadPasses(EagerHeadPasses):
    """The head's passes on a static cache of max_len pairs, each of a bucket's width one graph (on a
    CPU, the graphs' buffers run eagerly). Caches and their graphs are pooled per head and length."""

    def __init__(self, head: Any, embed: nn.Module, max_len: int):
        self.head, self.embed, self.max_len = head, embed, max_len
        self.device = cast(torch.Tensor, embed.weight).device
        self.pooled = _pool.take(head, max_len, lambda: StaticCache(config=head.config, max_cache_len=max_len))
        self.cache = self.pooled.cache
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def causal(self, tokens: list[int] | torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        late, ids = None, tokens
        if isinstance(tokens, torch.Tensor):  # a pick still on the device: a stand-in id, then the pick
            late, ids = (0, tokens.reshape(1)), [0]
        assert isinstance(ids, list)
        slots = list(range(self._length, self._length + len(ids)))
        return self._run(ids, features, slots, [s + 1 for s in slots], late)

    @torch.inference_mode()
    def tree(
        self, tokens: list[int], features: torch.Tensor, position: int, prefix: int, sees: list[list[int]]
    ) -> torch.Tensor:
        # A node sees ancestors from earlier depths' passes, outside this pass's own slots, which the
        # graph's sight rows cannot say: a depth's graph also takes the slots each row sees across the
        # whole cache (its own graph for each width, beside the causal ones).
        n = len(tokens)
        if self._length + n > static_cache.room(self.max_len):
            raise ValueError(f"the head's static cache of {self.max_len} pairs is full")
        width = static_cache.bucket(n)
        if width is None:  # wider than every graph: one eager pass, its mask over the whole cache
            out = self._depth(tokens, features, position, prefix, sees, self.max_len)
            self._length += n
            return out
        start, pad = self._length, width - n
        # a padding row sees the true pairs and itself: its output is thrown away, its slot cropped
        rows = cuda_graphs.packed(
            tokens + tokens[-1:] * pad, [position] * width, [prefix] * width, start, [[start + r] for r in range(width)]
        )
        seen = decoder_layers.sight_rows(sees + [[]] * pad, [0] * width, self.max_len)  # the prefix is in rows
        key = (width, features.shape[-1], "tree")
        out, _ = self.pooled.graphs.get(key, lambda: self._width_pass(width))(rows, None, features, seen)
        if pad:
            self.cache.crop(-pad)
        self._length += n
        return out[:n].clone()

    @torch.inference_mode()
    def _run(
        self,
        tokens: list[int],
        features: torch.Tensor,
        position: list[int],
        prefix: list[int],
        late: tuple[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        """A causal pass: row i at `position[i]`, seeing slots [0, prefix[i])."""
        n = len(tokens)
        if self._length + n > static_cache.room(self.max_len):
            raise ValueError(f"the head's static cache of {self.max_len} pairs is full")
        graphed = static_cache.bucket(n)
        width = graphed or n  # wider than every graph (a prompt's pairs): one eager pass
        pad = width - n
        start = self._length
        rows = cuda_graphs.packed(
            tokens + tokens[-1:] * pad,
            position + [position[-1] + 1 + j for j in range(pad)],
            prefix + [start + n + j + 1 for j in range(pad)],
            start,
            [],
        )
        if graphed is None:
            out = self._eager(rows, features, late)
        else:
            out, _ = self.pooled.graphs.get((width, features.shape[-1]), lambda: self._width_pass(width))(
                rows, late, features
            )
        if pad:
            self.cache.crop(-pad)
        self._length += n
        return out[:n].clone()

    def _forward(self, input_ids, position_ids, attention_mask, features):
        h = self.head(self.embed(input_ids), features, self.cache, attention_mask, position_ids)
        return h[0], None

    def _width_pass(self, width: int) -> cuda_graphs.WidthPass:
        # The pass holds the head and the target's embedding weakly: the pool keeps the pass, and must
        # not keep them alive (nor this request's passes object).
        head, embed, cache = weakref.ref(self.head), weakref.ref(self.embed), self.cache

        def forward(input_ids, position_ids, attention_mask, features):
            return head()(embed()(input_ids), features, cache, attention_mask, position_ids)[0], None

        return cuda_graphs.WidthPass(self.head.config, self.device, forward, width, self.max_len)

    def _eager(self, rows: torch.Tensor, features: torch.Tensor, late) -> torch.Tensor:
        rows = transfer.queued(rows, self.device)
        if late is not None:
            rows[0, late[0] : late[0] + len(late[1])] = late[1]
        slots = torch.arange(self.max_len, device=self.device)
        mask = decoder_layers.as_mask(cuda_graphs.sight(rows, slots), self.head.config)
        return self._forward(rows[0][None], rows[1][None], mask, features[None])[0]

    def crop(self, length: int) -> None:
        if length < self._length:
            with torch.inference_mode():  # the pointer is a tensor made under it (commit runs outside it)
                self.cache.crop(length - self._length)
            self._length = length

    def close(self) -> None:
        """Give the cache and its graphs back for the next request."""
        if self.pooled is not None:
            _pool.give(self.head, self.max_len, self.pooled)
            self.pooled = None  # type: ignore[assignment]
