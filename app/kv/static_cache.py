"""The GPU fast path: a static KV cache with a position pointer, and CUDA graphs for its shapes.

A static cache is allocated once at its full length; rolling back a rejected draft only
moves the pointer back (the next pass overwrites the stale keys, and the mask hides any beyond
it). Fixed shapes let each pass be captured as a CUDA graph and replayed: passes over few tokens
(draft steps, verify over k+1, a tree's nodes) are padded up to a bucket width, so a handful of
graphs serve every k and tree. Longer passes (the prompt) run eagerly.

Two ways to get the graphs: `graphs` captures the model's eager forward with torch.cuda.CUDAGraph
(cuda_graphs.py; the default on CUDA, no compiler at run time), `compile` lets
torch.compile(mode="reduce-overhead") capture them (--fast-path compile). On a CPU the static cache
and the graphs' buffers run eagerly (the tests prove their numbers there); they were not faster than
the dynamic cache there, so a CPU keeps that. ZeroGPU runs each call in a fresh process: no graphs.
A feature-level draft's head gets a static cache of its own on the fast path (drafts/head_passes.py);
the target's passes, which also hand it their hidden states, run on the static cache like any other.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import PreTrainedModel, StaticCache

from app.core import decoder_layers, transfer
from app.core.config import FAST_PATHS, K_MAX, TREE_MAX, UserError
from app.kv import cuda_graphs, fused_pass
from app.kv.cache import RollbackCache

# Pass widths with a graph: a draft step, verify over k+1 for k = 1, 2, 4, 8, 16, and trees up to TREE_MAX nodes.
BUCKETS = (1, 2, 3, 5, 9, 17, 33, 65)
LENGTH_STEP = 256  # cache lengths are rounded up to this, so requests of similar length share graphs
# Fixed-width passes (StaticRollbackCache.width) are a multiple of this many rows: a matrix product's
# row tiles then hold whole rows alike, where a remainder row could take another code path.
WIDTH_STEP = 8


def fixed_width(need: int) -> int:
    """The one pass width of a request whose passes compare rows: the least multiple of WIDTH_STEP >= need."""
    return -(-need // WIDTH_STEP) * WIDTH_STEP


PADDING = max(BUCKETS[-1], fixed_width(TREE_MAX + 1))  # the most padding a pass may write past its tokens


FAST_PATH_ENV = "SPECDEC_FAST_PATH"  # the server's --fast-path, and the CLI's default


def default_mode() -> str:
    """The fast path a request that names none takes: SPECDEC_FAST_PATH, else auto."""
    return os.environ.get(FAST_PATH_ENV, "").strip().lower() or "auto"


def available(mode: str, device: torch.device, model: PreTrainedModel | None = None) -> tuple[str | None, str]:
    """Which fast path runs for this request ("graphs", "compile" or None: the dynamic cache), and why."""
    if mode not in FAST_PATHS:
        raise UserError(f"--fast-path takes {', '.join(FAST_PATHS)}, got {mode!r}")
    if mode == "off":
        return None, "off (--fast-path off): dynamic cache, eager passes"
    if os.environ.get("SPACES_ZERO_GPU"):
        return None, "off on ZeroGPU, which runs each call in a fresh process (no graphs to replay)"
    if device.type != "cuda" and mode == "auto":
        return None, "CUDA only: on CPU the static cache was not faster"
    if device.type != "cuda":
        return None, f"--fast-path {mode} is CUDA only: on CPU the static cache was not faster"
    why = unsupported(model) if model is not None else None
    if why:
        return None, f"off: {why}"
    kind = "compile" if mode == "compile" else "graphs"
    how = "torch.compile's CUDA graphs" if kind == "compile" else "CUDA graphs of the eager passes"
    return kind, f"static cache and {how}"


def unsupported(model: PreTrainedModel) -> str | None:
    """Why this model cannot run on a static cache with graphs (None: it can)."""
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "a model spread over several devices runs eagerly (a graph is captured on one device)"
    if any(getattr(t, "is_sliding", False) for t in StaticCache(config=model.config, max_cache_len=1).layers):
        return "the static cache path supports full-attention models only"
    kind = getattr(model.config, "_attn_implementation", None) or "eager"
    if kind not in ("sdpa", "eager"):
        return f"graphs build their own mask, read by sdpa or eager attention; this model runs {kind!r}"
    return None


def cache_length(prompt_len: int, max_new_tokens: int) -> int:
    """Static length for a request: prompt, new tokens, the widest draft (a chain or a tree) and the
    widest padded pass; rounded up."""
    need = prompt_len + max_new_tokens + max(K_MAX, TREE_MAX) + PADDING + 1
    return -(-need // LENGTH_STEP) * LENGTH_STEP


@functools.cache
def compiled(model: PreTrainedModel):
    """The model's forward under torch.compile with CUDA graphs, shared by every request."""
    # One graph per bucket width, per output kind (logits, or logits and features), per pass kind (a
    # chain's causal pass, or a tree's with its mask and positions) and per pooled cache: more than
    # dynamo's default of 8, past which it would quietly fall back to eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 128)
    return torch.compile(model, mode="reduce-overhead", dynamic=False)


_pool = cuda_graphs.Pools()
_exact_lock = threading.Lock()


class StaticRollbackCache(RollbackCache):
    """The KV cache contract (extend, rollback, length) over a static cache with a pointer.

    Caches are pooled per model and length and reused by later requests, so a graph sees the
    same cache tensors again instead of being recaptured; close() gives one back. `graphs`: passes
    up to the widest bucket run through cuda_graphs (captured on CUDA, the same buffers eagerly on a
    CPU); `compile`: through torch.compile's graphs.
    """

    cache: StaticCache | None  # None once close() gave it back
    device_steps = True  # step() takes a token still on the device

    def __init__(
        self,
        model: PreTrainedModel,
        max_len: int,
        compile: bool = False,
        feature_layers: tuple[int, ...] = (),
        graphs: bool = False,
        width: int | None = None,
        fused: bool = True,
    ):
        why = unsupported(model)
        if why and (graphs or "full-attention" in why):
            raise UserError(f"{why}: run with --fast-path off")
        super().__init__(model, feature_layers)
        self.max_len = max_len
        self.forward = compiled(model) if compile else model
        self.compile, self.graphs = compile, graphs
        # Graphs replay fused_pass's few kernels where it runs the model, else transformers' layers. It
        # joins the projections' weights at its first use, before any graph of this model is captured
        # (a graph reads the weights where they were), so it is prepared for either kind.
        prepared = fused_pass.of(model) if graphs or compile else None
        self.fused = prepared if fused and graphs else None
        # Every pass of up to `width` tokens is padded to exactly `width`, and wider ones end in such a
        # pass over the rows whose logits are read: the rows a run compares then always come from the
        # same matrix shapes, whose rows are the same bits wherever they sit (rows_exact probes it).
        self.width = width
        self.pooled = _pool.take(model, max_len, lambda: StaticCache(config=model.config, max_cache_len=max_len))
        self.cache = self.pooled.cache

    def close(self) -> None:
        """Give the cache back for the next request (once; the cache is unusable here afterwards)."""
        cache, self.cache = self.cache, None
        if cache is not None:
            _pool.give(self.model, self.max_len, self.pooled)

    def step(self, token: int | torch.Tensor) -> torch.Tensor:
        """(V,) logits of one more token (a draft step: one graph on the fast path). The token may be a
        0-d tensor on the device (the previous step's argmax): the host never reads it."""
        if not isinstance(token, torch.Tensor):
            return self.extend([token], keep=1)[-1]
        return self.extend([0], keep=1, on_device=token.reshape(1))[-1]

    def _forward(
        self, ids: list[int], keep: int, features: bool, on_device: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = len(ids)
        if self.width is not None and n > self.width and 0 < keep <= self.width:
            # The rows read come from a pass of the fixed width; the ones before it only fill the cache,
            # in one pass of their own (the same in a plain and a speculative run: the prompt but its last).
            return self._filled_then(
                ids[: n - keep], features, lambda: self._one_pass(ids[n - keep :], keep, features, on_device)
            )
        return self._one_pass(ids, keep, features, on_device)

    def _filled_then(self, before: list[int], features: bool, rest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`before` through the cache in one pass whose logits are not read, then rest()'s pass: its
        logits, and the features of both where asked."""
        _, first = self._one_pass(before, 1, features, None)
        logits, then = rest()
        return logits, (torch.cat([first, then]) if first is not None and then is not None else None)

    def _one_pass(
        self, ids: list[int], keep: int, features: bool, on_device: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = len(ids)
        ids = self._embeddable(ids)
        if self.length + n > room(self.max_len):
            raise UserError(f"static cache of {self.max_len} tokens is full: raise its length")
        late = None
        if on_device is not None:  # the last ids' values, on the device
            late = (n - len(on_device), self._embeddable_on_device(on_device))
        width = self._bucket(n)
        if self.graphs and width is not None:
            # Padded to the bucket as below; the graph's outputs are overwritten by its next replay.
            rows = cuda_graphs.chain(ids + ids[-1:] * (width - n), self.length)
            out, fused = self._replay(width, features, rows, late)
            logits = out[:n].clone()
            hidden = fused[:n].clone() if fused is not None else None
            if width > n:
                assert self.cache is not None, "the cache was given back (close)"
                self.cache.crop(n - width)
        elif self.compile and width is not None:
            # Pad to the bucket: the padding sits after the real tokens, so causal attention
            # keeps it out of their logits, and the pointer is moved back over it below.
            # Graph outputs are overwritten by the next replay: clone what is kept.
            x = _with(transfer.queued(torch.tensor([ids + ids[-1:] * (width - n)]), self.device), late)
            torch.compiler.cudagraph_mark_step_begin()
            out = self.forward(input_ids=x, cache=self.cache, use_cache=True, output_hidden_states=features)
            logits = out.logits[0, :n].clone()
            fused = self._features(out, features)
            hidden = fused[:n].clone() if fused is not None else None
            if width > n:
                assert self.cache is not None, "the cache was given back (close)"
                self.cache.crop(n - width)
        else:
            x = _with(transfer.queued(torch.tensor([ids]), self.device), late)
            out = self.model(
                input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep, output_hidden_states=features
            )
            logits, hidden = out.logits[0], self._features(out, features)
        self.length += n
        self.tokens_processed += n
        return (logits[-keep:] if keep else logits), hidden

    def _tree_forward(
        self,
        ids: list[int],
        tokens: list[int],
        parents: Sequence[int],
        features: bool,
        on_device: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # One pass over the static cache's every slot: the mask hides the slots past the pass, as the
        # causal mask does. A compiled pass is padded to its bucket like any other.
        assert self.cache is not None, "the cache was given back (close)"
        m, n = len(ids), len(tokens)
        if self.width is not None and m > 1 and m + n > self.width:  # as _forward: the rows read, at the width
            return self._filled_then(
                list(ids[:-1]), features, lambda: self._tree_forward(ids[-1:], tokens, parents, features, on_device)
            )
        fed = self._embeddable(list(ids) + list(tokens))
        late = None if on_device is None else (m, self._embeddable_on_device(on_device))
        if self.length + m + n > room(self.max_len):
            raise UserError(f"static cache of {self.max_len} tokens is full: raise its length")
        width = self._bucket(m + n) if self.compile or self.graphs else None
        pad = width - (m + n) if width is not None else 0
        if self.graphs and width is not None:  # the bucket's graph, shared with chains of its width
            rows, prefix, sees = self.tree_rows(m, parents, pad)
            out, fused = self._replay(
                width, features, cuda_graphs.packed(fed + fed[-1:] * pad, rows, prefix, self.length, sees), late
            )
            logits = out[m - 1 : m + n].clone()
        else:
            position, mask = self.tree_layout(m, parents, self.max_len, pad)
            x = _with(transfer.queued(torch.tensor([fed + fed[-1:] * pad]), self.device), late)
            common = dict(input_ids=x, position_ids=position, attention_mask=mask, cache=self.cache, use_cache=True)
            if width is not None:  # the bucket's graph, as for a chain's pass: every row's logits, a fixed shape
                torch.compiler.cudagraph_mark_step_begin()
                out = self.forward(**common, output_hidden_states=features)
                logits = out.logits[0, m - 1 : m + n].clone()
            else:
                out = self.model(**common, logits_to_keep=n + 1, output_hidden_states=features)
                logits = out.logits[0]
            fused = self._features(out, features)
        hidden = fused[: m + n].clone() if fused is not None else None
        if pad:
            self.cache.crop(-pad)
        self.length += m + n
        self.tokens_processed += m + n
        return logits, hidden

    def _embeddable_on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """_embeddable's guard on ids still on the device."""
        return torch.where(ids < self.rows, ids, self.stand_in)

    def _bucket(self, n: int) -> int | None:
        """The width a pass of n tokens runs at: the fixed width where it fits, else its bucket."""
        return self.width if self.width is not None and n <= self.width else bucket(n)

    def _replay(
        self, width: int, features: bool, rows: torch.Tensor, late: tuple[int, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pass of `width` rows through this cache's graph of that width and output kind (`late`: ids
        from an offset on, on the device: WidthPass)."""
        key = (width, features, self.feature_layers, self.fused is not None)
        return self.pooled.graphs.get(key, lambda: self.width_pass(width, features))(rows, late)

    def width_pass(self, width: int, features: bool) -> cuda_graphs.WidthPass:
        """A new pass of `width` rows over this cache: fused_pass's where it runs, else the model's own
        forward (a graph captures it at its first use on CUDA)."""
        # The pass holds the model weakly: the pool, which keeps it, must not keep the model alive.
        model, cache, layers, fused = weakref.ref(self.model), self.cache, self.feature_layers, self.fused

        def forward(**inputs):
            if fused is not None and fused_pass.of(model()) is fused:
                try:
                    return fused(**inputs, cache=cache, taps=layers if features else None)
                except torch.OutOfMemoryError:  # the request's, not the pass's: transformers' layers need memory too
                    raise
                except (RuntimeError, TypeError, ValueError, IndexError) as e:  # the model's own layers then
                    fused_pass.refuse(model(), e)
            out = model()(**inputs, cache=cache, use_cache=True, output_hidden_states=features)
            return out.logits[0], (decoder_layers.entering(out.hidden_states, layers)[0] if features else None)

        return cuda_graphs.WidthPass(self.model.config, self.device, forward, width, self.max_len)

    def _layers(self) -> list:
        assert self.cache is not None, "the cache was given back (close)"
        return self.cache.layers

    def _crop(self, length: int) -> None:
        # The pointer moves back; nothing is copied.
        if length < self.length:
            assert self.cache is not None, "the cache was given back (close)"
            self.cache.crop(length - self.length)
            self.length = length


def _with(x: torch.Tensor, late: tuple[int, torch.Tensor] | None) -> torch.Tensor:
    """(1, n) ids with the values from `late`'s offset on taken from its device tensor."""
    if late is not None:
        x[0, late[0] : late[0] + len(late[1])] = late[1]
    return x


_exact: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(width, max_len): bool}
PROBE_CONTEXT = 64  # cached tokens before the probe's passes


@torch.inference_mode()
def rows_exact(model: PreTrainedModel, width: int, max_len: int | None = None) -> bool:
    """Whether the model's rows on fixed-width passes (graphs, StaticRollbackCache.width) are the same
    bits wherever they sit: `width` one-token passes against one pass of `width` tokens after the same
    context, in a static cache of max_len (a request's: the attention's kernel may depend on it), on this
    device and in this precision. Probed once per model, width and length (on CUDA it also captures that
    width's graph for the request's caches)."""
    max_len = max_len or cache_length(PROBE_CONTEXT, width)
    key = (width, max_len, fused_pass.of(model) is not None)  # the pass it probed: a refused fused pass's verdict goes
    with _exact_lock:
        known = _exact.get(model, {}).get(key)
    if known is not None:
        return known
    vocab = cast(torch.Tensor, model.get_input_embeddings().weight).shape[0]
    ids = torch.randint(0, vocab, (PROBE_CONTEXT + width,), generator=torch.Generator().manual_seed(3)).tolist()
    one, wide = (StaticRollbackCache(model, max_len, graphs=True, width=width) for _ in range(2))
    try:
        for lm in (one, wide):
            lm.extend(ids[:PROBE_CONTEXT], keep=1)
        ones = torch.stack([one.extend([t], keep=1)[-1] for t in ids[PROBE_CONTEXT:]])
        exact = torch.equal(ones, wide.extend(ids[PROBE_CONTEXT:], keep=width))
    finally:
        one.close()
        wide.close()
    with _exact_lock:
        _exact.setdefault(model, {})[key] = exact
    return exact


def widest_pass(spec) -> int:
    """The most tokens a round's verify pass feeds under these draft settings: the drafts and the
    token before them (a chain of k, or a tree's nodes)."""
    return max(spec.k if spec.k_policy == "fixed" else spec.k_max, spec.tree) + 1


def bucket(n: int) -> int | None:
    """The graph width a pass of n tokens is padded to (None: wider than every graph, run eagerly)."""
    return next((b for b in BUCKETS if b >= n), None)


def room(max_len: int) -> int:
    """The most tokens a pass may end at in a static cache of max_len: the widest graph's padding
    must still fit after it."""
    return max_len - PADDING


@dataclass(frozen=True)
class StaticCachePool:
    """A target_cache for engine.generate: static caches of max_len tokens. Its length is known to
    whoever plans passes ahead of a request (calibrate.py), since a pass past the end is an error."""

    max_len: int
    compile: bool = False
    graphs: bool = False
    width: int | None = None  # every pass this wide (StaticRollbackCache.width), for rows exact at every width
    fused: bool = True  # graphs replay fused_pass where it runs the model (False: transformers' layers)

    def __call__(self, model: PreTrainedModel) -> StaticRollbackCache:
        return StaticRollbackCache(
            model, self.max_len, self.compile, graphs=self.graphs, width=self.width, fused=self.fused
        )
