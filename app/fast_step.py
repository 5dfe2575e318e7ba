"""One-token steps of a draft model through its own modules, without the model wrapper.

A draft step feeds one token, which attends to every cached position, so there is no mask to
build. Calling the embedding, the decoder layers, the final norm and the LM head directly skips
the wrapper's per-call work (mask construction, output collection, argument handling), a large
share of a small model's step on a CPU: the bundled distilled draft's step went from 1.31 to
0.97 ms. Only drafts use it: their numerics decide how often they are right, never what the
output is. A model is admitted once, after one probe step agrees with its own forward; any
other model keeps the wrapper.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

# Decoders whose layers take (hidden, position_embeddings, cache) and whose embedding is used as
# is: Gemma scales it, others differ further, so they are left to the wrapper.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class Parts:
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    rotary: nn.Module
    lm_head: nn.Module

    def modules(self) -> list[nn.Module]:
        """Every module a direct step runs, for whoever times passes (bench's forward clock)."""
        return [self.embed, *self.layers, self.norm, self.rotary, self.lm_head]


_admitted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Parts, or None
_lock = threading.Lock()


def parts(model: PreTrainedModel) -> Parts | None:
    """The model's modules for a direct step, or None when it must use its own forward."""
    with _lock:
        if model not in _admitted:
            found = _find(model)
            _admitted[model] = found if found is not None and _agrees(model, found) else None
        return _admitted[model]


def _find(model: PreTrainedModel) -> Parts | None:
    if getattr(model.config, "model_type", None) not in FAMILIES:
        return None
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
        return None  # a sliding window needs its mask
    base = getattr(model, "model", None)
    names = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in names) or model.get_output_embeddings() is None:
        return None
    return Parts(base.embed_tokens, base.layers, base.norm, base.rotary_emb, model.get_output_embeddings())


@torch.inference_mode()
def step(p: Parts, cache: DynamicCache, token: int) -> torch.Tensor:
    """(V,) logits of `token` after the cached positions; the cache grows by one."""
    h = p.embed(torch.tensor([[token]], device=p.embed.weight.device))
    return p.lm_head(p.norm(through_layers(p.layers, p.rotary, h, cache)))[0, -1]


def through_layers(layers, rotary: nn.Module, h: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """(1, 1, H) hidden state of one new position through decoder layers that append to `cache`.
    One query attends to every cached position, so no mask is built or passed."""
    position = torch.full((1, 1), cache.get_seq_length(), dtype=torch.long, device=h.device)
    position_embeddings = rotary(h, position)
    for layer in layers:
        h = layer(h, attention_mask=None, position_ids=position, cache=cache, use_cache=True,
                  position_embeddings=position_embeddings)
    return h


@torch.inference_mode()
def _agrees(model: PreTrainedModel, p: Parts) -> bool:
    """One probe step against the model's own forward over the same three tokens."""
    device = p.embed.weight.device
    probe = [i % p.embed.weight.shape[0] for i in (11, 12, 13)]
    try:
        full = model(input_ids=torch.tensor([probe], device=device), use_cache=False).logits[0, -1]
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([probe[:-1]], device=device), cache=cache, use_cache=True)
        fast = step(p, cache, probe[-1])
    except (TypeError, ValueError, RuntimeError, AttributeError):  # a layer with another signature
        return False
    tolerance = 1e-3 if full.dtype == torch.float32 else 5e-2
    return bool((fast.float() - full.float()).abs().max() <= tolerance * (1 + full.float().abs().max()))
