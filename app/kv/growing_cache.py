"""A KV cache whose layers keep spare room, so a pass writes its new positions in place.

transformers' DynamicLayer appends by `torch.cat`, which copies the layer's whole cache on every
pass: for the bundled target at a few hundred tokens that is megabytes a pass, on a CPU whose
passes are bound by memory traffic. A growing layer writes the new keys and values into a buffer
with room to spare, and a rollback only moves its length back. `keys` and `values` read as views of
the positions held, so whatever reads a DynamicLayer reads this one; they are made when read, since
a pass that writes the buffers itself (the int8 kernel's) and every rollback only move the length
(two views a layer each time cost a one-token int8 pass ~0.1 ms, as much again its rollback).

For inference only, one sequence, and nothing may keep a returned tensor past the next rollback:
the next pass overwrites the positions a rollback forgot, in place (so outside inference mode, or
under autograd, it would corrupt what was kept).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Spare positions allocated whenever the buffer (re)grows: at least ROOM (a layer's `room`), or half
# what it then holds, so a generation rarely regrows and a long prompt's cache holds at most 1.5
# times its data.
ROOM = 256


class GrowingLayer(DynamicLayer):
    _k: torch.Tensor | None
    _v: torch.Tensor | None

    def __init__(self, room: int = ROOM):
        super().__init__()
        self.room = room
        self._k = self._v = None  # the buffers; keys and values are views of the first `_held` positions
        self._held = 0
        # What a pass derives from the buffers and keeps beside them (the int8 kernel's key pairs and
        # steps, exact_model._derived), still true of their first `derived_upto` positions: every write
        # to the buffers lowers it to where the write starts.
        self.derived: tuple[torch.Tensor, ...] | None = None
        self.derived_upto = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            self._k, self._v = (
                self._grown(old, new, start, end + max(self.room, end // 2))
                for old, new in ((self._k, key_states), (self._v, value_states))
            )
            self.derived = None  # sized for the old buffers
        assert self._v is not None  # grown together with _k
        self.rewritten(start)
        self._k[..., start:end, :].copy_(key_states)
        self._v[..., start:end, :].copy_(value_states)
        self.hold(end)
        return self.keys, self.values

    def room_for(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(key buffer, value buffer, start) where `tokens` new positions fit in place from `start`, for a
        pass that writes them itself and then calls `hold(start + tokens)`; None before the first
        update or when they do not fit (update allocates and grows)."""
        if self._k is None or self._v is None:
            return None
        start = self.get_seq_length()
        return (self._k, self._v, start) if start + tokens <= self._k.shape[-2] else None

    @staticmethod
    def _grown(old: torch.Tensor | None, new: torch.Tensor, held: int, size: int) -> torch.Tensor:
        """A buffer of `size` positions shaped like `new`, holding old's first `held` positions."""
        buffer = new.new_empty(*new.shape[:-2], size, new.shape[-1])
        if old is not None:
            buffer[..., :held, :].copy_(old[..., :held, :])
        return buffer

    def hold(self, length: int) -> None:
        """Hold the buffers' first `length` positions (also after a pass that wrote them in place, room_for)."""
        assert self._k is not None and self._v is not None  # called once the buffers exist
        self._held = length
        # dropped, so the next read makes them (__getattr__)
        self.__dict__.pop("keys", None)
        self.__dict__.pop("values", None)

    def rewritten(self, start: int) -> None:
        """The buffers change (or may be overwritten) from position `start` on: what was derived from
        them holds before it only. Called by whatever writes into the buffers or their views."""
        self.derived_upto = min(self.derived_upto, start)

    def __getattr__(self, name: str) -> torch.Tensor:
        """`keys` and `values` once the buffers exist: views of the positions held, made on first read
        after hold. Any other missing attribute is missing."""
        k, v = self.__dict__.get("_k"), self.__dict__.get("_v")
        if name not in ("keys", "values") or k is None or v is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        held = self.__dict__["_held"]
        self.keys, self.values = k[..., :held, :], v[..., :held, :]
        return self.__dict__[name]

    def get_seq_length(self) -> int:
        return self._held if self._k is not None else super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove positions (DynamicLayer's convention): they are
        overwritten by the next pass, never copied."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if tokens_to_remove and self._k is not None:
            self.hold(max(0, self.get_seq_length() + tokens_to_remove))

    def reset(self) -> None:
        super().reset()
        self._k = self._v = None
        self._held = 0
        self.derived, self.derived_upto = None, 0

    # DynamicLayer's versions of these replace `keys` and `values` but not the buffers behind them,
    # so the next pass would quietly undo them: refused rather than wrong.
    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a growing cache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a growing cache holds one sequence")

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError("a growing cache holds one sequence (no beam search)")

    def offload(self) -> None:
        raise NotImplementedError("a growing cache is not offloaded")

    def prefetch(self) -> None:
        raise NotImplementedError("a growing cache is not offloaded")


def new_cache(config, room: int = ROOM) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers grow in place; any other layer
    (a sliding window, say) stays as transformers builds it."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
