"""Passes of one width over one static KV cache, replayed as CUDA graphs.

A pass's inputs live in one static buffer: the ids, their positions, and what each row sees (a
prefix of the cache, plus rows of the pass itself: a tree node's ancestors). The attention mask is
built from them inside the pass, so a chain and a tree of one width share one graph, and nothing
in a pass reads a value back to the host: the cache's write position is its own device counter
(transformers' StaticLayer). On CUDA a pass is captured at its first use, with
torch.cuda.CUDAGraph over the model's eager forward (no compiler at run time, so a fresh process
needs nothing built), and replayed after. On a CPU the same pass runs eagerly on the same buffers,
which is how the tests prove its numbers without a GPU.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from app.core import decoder_layers

HEADER = 4  # rows of the input buffer before the in-pass sight rows: ids, positions, prefixes, start
_captured = {"graphs": 0, "seconds": 0.0}  # in this process, for the first start's note
_captured_lock = threading.Lock()
_capture_lock = threading.Lock()
_said = False  # whether a failed capture was logged (once a process)
log = logging.getLogger(__name__)


def captures() -> tuple[int, float]:
    """(graphs captured so far in this process, seconds spent capturing them)."""
    with _captured_lock:
        return int(_captured["graphs"]), float(_captured["seconds"])


def packed(
    ids: Sequence[int], positions: Sequence[int], prefix: Sequence[int], start: int, sees: Sequence[Sequence[int]]
) -> torch.Tensor:
    """The (HEADER + W, W) input buffer of a pass of W rows from slot `start`: row r attends to slots
    [0, prefix[r]) and to the slots in sees[r] (each in start .. start + W - 1)."""
    width = len(ids)
    rows = torch.zeros(HEADER + width, width, dtype=torch.long)
    rows[0], rows[1], rows[2], rows[3, 0] = torch.tensor(ids), torch.tensor(positions), torch.tensor(prefix), start
    for r, slots in enumerate(sees):
        rows[HEADER + r, [s - start for s in slots]] = 1
    return rows


def chain(ids: Sequence[int], start: int) -> torch.Tensor:
    """The input buffer of a causal pass: each row at its own slot, seeing everything up to it."""
    slots = range(start, start + len(ids))
    return packed(ids, slots, [s + 1 for s in slots], start, [])


def sight(inputs: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The (W, len(slots)) bool of which cache slots each row of a packed input sees, on its device."""
    width = inputs.shape[1]
    prefix, start, sees = inputs[2], inputs[3, :1], inputs[HEADER:].bool()
    offset = slots - start  # each cache slot's place in this pass (in range for its own rows)
    inside = (offset >= 0) & (offset < width)
    return (slots[None] < prefix[:, None]) | (sees[:, offset.clamp(0, width - 1)] & inside)


class WidthPass:
    """One pass width and output kind over one static cache: the input buffer, and on CUDA the graph.

    `config` is the model's (its attention kind sets the mask's form); `forward(model inputs) ->
    (logits, features or None)` is the pass itself (the caller's, so a request's features come out as
    its cache returns them); its outputs are the graph's static tensors on CUDA, overwritten by the
    next replay: a caller keeps what it needs by copying.
    """

    def __init__(
        self,
        config,
        device: torch.device,
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
        width: int,
        max_len: int,
    ):
        self.config, self.forward, self.width, self.device = config, forward, width, device
        self.inputs = torch.zeros(HEADER + width, width, dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)
        self.cuda = device.type == "cuda"
        self.pool = None  # the graphs' memory pool (Graphs sets it)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.extra: torch.Tensor | None = None  # the (W, F) features buffer of a pass that takes them
        # the (W, max_len) slots each row also sees, anywhere in the cache (a feature head's tree depth,
        # whose nodes see ancestors from earlier passes): a pass that takes it is a graph of its own
        self.seen: torch.Tensor | None = None
        self.eager = False  # its capture failed: the same pass, on the same buffers, without a graph

    def __call__(
        self,
        rows: torch.Tensor,
        late: tuple[int, torch.Tensor] | None = None,
        extra: torch.Tensor | None = None,
        seen: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the pass on these inputs (packed): eagerly on a CPU, else by its graph (captured now if new).
        `late`: (offset, ids on the device) for the ids from that offset on (a draft's picks, which the
        host has not read), copied over the packed ones on the device. `extra`: a (n, F) input of the
        first n rows on the device (a feature head's features), handed to the pass as `features`.
        `seen`: a (W, max_len) bool on the host of the cache slots each row also sees; a pass is called
        with it always or never (the mask it captured reads it or not)."""
        # A pinned source lets the copy queue behind the device's work instead of waiting for it; the
        # caching host allocator keeps the block until the copy has read it.
        self.inputs.copy_(rows.pin_memory() if self.cuda else rows, non_blocking=self.cuda)
        if seen is not None:
            if self.seen is None:
                self.seen = torch.zeros(self.width, len(self.slots), dtype=torch.bool, device=self.device)
            self.seen.copy_(seen.pin_memory() if self.cuda else seen, non_blocking=self.cuda)
        if late is not None:
            self.inputs[0, late[0] : late[0] + len(late[1])] = late[1]
        if extra is not None:
            if self.extra is None:  # a padding row reads zeros, or an earlier pass's rows: thrown away
                self.extra = torch.zeros(self.width, extra.shape[-1], dtype=extra.dtype, device=extra.device)
            self.extra[: len(extra)] = extra
        if not self.cuda or self.eager:
            return self._pass()
        if self.graph is None:
            return self._capture()
        self.graph.replay()
        assert self.out is not None  # set by the capture
        return self.out

    def _pass(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, position = self.inputs[0], self.inputs[1]
        sees = sight(self.inputs, self.slots)
        mask = decoder_layers.as_mask(sees if self.seen is None else sees | self.seen, self.config)
        more = {} if self.extra is None else {"features": self.extra[None]}
        return self.forward(input_ids=ids[None], position_ids=position[None], attention_mask=mask, **more)

    def _capture(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        # PyTorch's recipe: run once on a side stream (lazy set-up, library workspaces), then capture.
        # That run is this request's pass; capturing runs nothing, so the cache is written once.
        # One capture at a time in the process (PyTorch's rule).
        t0 = time.perf_counter()
        with _capture_lock:
            result, side = self._warm_up()
            try:
                self.graph, self.out = self._record(side)
            except RuntimeError as e:  # a model whose pass a graph cannot hold: this width stays eager
                self.eager = True
                _say_once(f"a CUDA graph of a {self.width}-token pass could not be captured, so it runs eagerly: {e}")
                return result
        with _captured_lock:
            _captured["graphs"] += 1
            _captured["seconds"] += time.perf_counter() - t0
        return result

    def _warm_up(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], torch.cuda.Stream]:
        """The pass itself, on a side stream of the model's GPU (not the shared default capture stream),
        its outputs copied out; and that stream, to capture on."""
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                logits, features = self._pass()
                result = logits.clone(), (features.clone() if features is not None else None)
            current.wait_stream(side)
        return result, side

    def _record(self, side: torch.cuda.Stream):
        """(graph, its outputs): the pass captured on `side`; thread_local: other requests' passes on
        other compute threads may run meanwhile."""
        with torch.cuda.device(self.device):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                out = self._pass()
            torch.cuda.current_stream().wait_stream(side)
        return graph, out


def _say_once(text: str) -> None:
    """One warning line a process (a visitor's requests must not flood the log), without a traceback."""
    global _said
    if not _said:
        _said = True
        log.warning(text.splitlines()[0][:300])


class Graphs:
    """Every width's pass over one static cache, keyed by width and output kind, with one memory pool
    for all their graphs (they never run at once). It lives as long as the cache it was captured on."""

    def __init__(self):
        self.passes: dict[tuple, WidthPass] = {}
        self.pool = None

    def get(self, key: tuple, make: Callable[[], WidthPass]) -> WidthPass:
        if key not in self.passes:
            made = self.passes[key] = make()
            if made.cuda:
                self.pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
                made.pool = self.pool
        return self.passes[key]


@dataclass
class Pooled:
    """A static cache and the graphs captured on its tensors: they are reused together."""

    cache: Any  # transformers' StaticCache
    graphs: Graphs

    def reset(self) -> None:
        """Move the cache's write pointer back to its start, on the device (nothing is read): a pass
        that failed half-way leaves no offset behind for the next request."""
        with torch.inference_mode():  # the counters were made under it
            for layer in self.cache.layers:
                counter = getattr(layer, "cumulative_length", None)  # transformers' StaticLayer
                if isinstance(counter, torch.Tensor):
                    counter.zero_()


class Pools:
    """Free static caches, with their graphs, per model and length. A model's entries go when the
    model does (the loader drops the oldest): nothing here holds the model itself."""

    def __init__(self):
        self._free: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def take(self, model, max_len: int, make: Callable[[], Any]) -> Pooled:
        """A free cache of this model and length, its pointer at the start, or a new one from make()."""
        with self._lock:
            free = self._free.get(model, {}).get(max_len, [])
            pooled = free.pop() if free else None
        if pooled is None:
            return Pooled(make(), Graphs())
        pooled.reset()
        return pooled

    def give(self, model, max_len: int, pooled: Pooled) -> None:
        with self._lock:
            self._free.setdefault(model, {}).setdefault(max_len, []).append(pooled)

    def free(self, model, max_len: int) -> int:
        """How many caches of this model and length are free (for tests)."""
        with self._lock:
            return len(self._free.get(model, {}).get(max_len, []))
