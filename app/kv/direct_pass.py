"""Passes of a decoder through its own modules, without the model wrapper.

The wrapper's per-call work (argument merging, output recording, dataclasses) is a large share
of a small model's pass on a CPU (docs/benchmarks.md). A direct pass runs the same modules with the
same arguments as the model's own forward, the causal mask included (built by transformers'
own `create_causal_mask`), so its logits are the same bits. That matters for the target, whose
logits decide the output: a model is admitted only after probe passes of one and of several
tokens on a cache give bitwise the logits and features of its own forward. Any other model
keeps the wrapper.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from app.core.decoder_layers import through_layers, through_masked
from app.kv import growing_cache

# Decoders whose forward is embed, mask, rotary, layers (hidden, position_embeddings, cache), final
# norm, LM head over the kept rows: Gemma scales its embedding and caps its logits, and others differ
# further, so they are left to the wrapper.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class Parts:
    config: object
    embed: nn.Embedding  # embed_tokens, an nn.Embedding in every family above
    layers: nn.ModuleList
    norm: nn.Module
    rotary: nn.Module
    lm_head: nn.Module


_admitted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Parts, or None
_lock = threading.Lock()


def parts(model: PreTrainedModel) -> Parts | None:
    """The model's modules for direct passes, or None when it must use its own forward."""
    with _lock:
        if model not in _admitted:
            found = _find(model)
            _admitted[model] = found if found is not None and _agrees(model, found) else None
        return _admitted[model]


def _find(model: PreTrainedModel) -> Parts | None:
    if getattr(model.config, "model_type", None) not in FAMILIES:
        return None
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
        return None  # a sliding window needs its own mask
    base = getattr(model, "model", None)
    names = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in names) or model.get_output_embeddings() is None:
        return None
    layers = base.layers[: model.config.num_hidden_layers]
    return Parts(model.config, base.embed_tokens, layers, base.norm, base.rotary_emb, model.get_output_embeddings())


# Context managers entered around every direct pass while registered: the benchmark's pass clock
# (bench/) times these passes through here, without replacing this module's functions.
_clocks: list[Callable[[], AbstractContextManager]] = []


@contextmanager
def clocked(clock: Callable[[], AbstractContextManager]):
    """Enter clock() around every direct pass made inside this block."""
    _clocks.append(clock)
    try:
        yield
    finally:
        _clocks.remove(clock)


def forward(
    p: Parts,
    cache: DynamicCache,
    ids: list[int],
    keep: int = 0,
    features: bool = False,
    mask: torch.Tensor | None = None,
    position: torch.Tensor | None = None,
    layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(keep, V) logits of the last `keep` of `ids` (0: all) fed after the cached positions, and
    with features=True the (len(ids), H) normed last hidden states (the wrapper's hidden_states[-1]),
    or with `layers` the (len(ids), len(layers) H) states entering those layers (passes.entering).
    The cache grows by len(ids). A tree pass gives its own mask and positions (decoder_layers.tree_pass)."""
    if not _clocks:
        return _forward(p, cache, ids, keep, features, mask, position, layers)
    with _clocks[-1]():
        return _forward(p, cache, ids, keep, features, mask, position, layers)


def step(p: Parts, cache: DynamicCache, token: int) -> torch.Tensor:
    """(V,) logits of `token` after the cached positions; the cache grows by one."""
    if not _clocks:
        return _step(p, cache, token)
    with _clocks[-1]():
        return _step(p, cache, token)


@torch.inference_mode()
def _forward(
    p: Parts, cache: DynamicCache, ids: list[int], keep: int, features: bool, mask=None, position=None, layers=()
):
    x = p.embed(torch.tensor([ids], device=p.embed.weight.device))
    tapped: list[torch.Tensor] = []
    h = through_masked(p.config, p.layers, p.rotary, x, cache, mask, position, layers if features else (), tapped)
    h = p.norm(h)
    logits = p.lm_head(h[:, -keep:] if keep else h)[0]
    if not features:
        return logits, None
    return logits, torch.cat(tapped, dim=-1)[0] if layers else h[0]


@torch.inference_mode()
def _step(p: Parts, cache: DynamicCache, token: int) -> torch.Tensor:
    h = p.embed(torch.tensor([[token]], device=p.embed.weight.device))
    return p.lm_head(p.norm(through_layers(p.layers, p.rotary, h, cache)))[0, -1]


@torch.inference_mode()
def _agrees(model: PreTrainedModel, p: Parts) -> bool:
    """Probe passes (a prefill, several tokens, one token, a direct step, a pass after a rollback)
    against the model's own forward on transformers' own cache: the same logits and features, bit
    for bit. The direct side runs on the growing cache that DynamicRollbackCache gives admitted models."""
    device = p.embed.weight.device
    probe = [i % p.embed.weight.shape[0] for i in (11, 12, 13, 14, 15, 16, 17)]
    # Room for two positions, so the probe also reads buffers that have regrown (kernels may
    # follow strides) and positions past a regrowth.
    own, direct = DynamicCache(config=model.config), growing_cache.new_cache(model.config, room=2)
    try:
        for ids in (probe[:3], probe[3:6], probe[6:]):
            out = model(
                input_ids=torch.tensor([ids], device=device), cache=own, use_cache=True, output_hidden_states=True
            )
            logits, features = forward(p, direct, ids, features=True)
            assert features is not None  # asked for with features=True
            if not (torch.equal(out.logits[0], logits) and torch.equal(out.hidden_states[-1][0], features)):
                return False
        if not torch.equal(
            model(input_ids=torch.tensor([probe[:1]], device=device), cache=own, use_cache=True).logits[0, -1],
            step(p, direct, probe[0]),
        ):
            return False
        # A rollback leaves stale positions in a growing buffer, which the next pass must overwrite exactly.
        own.crop(-3)
        direct.crop(-3)
        out = model(input_ids=torch.tensor([probe[1:3]], device=device), cache=own, use_cache=True)
        return torch.equal(out.logits[0], forward(p, direct, probe[1:3])[0])
    except (TypeError, ValueError, RuntimeError, AttributeError):  # a layer with another signature
        return False
