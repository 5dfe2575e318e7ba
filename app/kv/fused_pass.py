"""A Llama-family pass on a static cache in few kernels: the forward that the CUDA graphs capture.

Under a graph's replay every kernel costs a few microseconds however few bytes it moves, so a small
model's step is set by how many kernels it launches, not by its weights. transformers' decoder layer
launches about forty a layer (a norm of six, three projections, a rotary embedding of ten on queries
and keys, the cache's position arithmetic, repeated keys and values for grouped heads, ...). This pass
computes the same layer in about sixteen: one fused norm, one q/k/v product, the rotary embedding on
queries and keys at once, the grouped query heads folded into the query length so that attention
reads the cache's keys and values where they lie, one gate/up product, and the output and down
products adding their residual as they go. What every layer shares (positions, the rotary angles,
the mask) is computed once a pass.

Its sums run in another order than the layer's own (fused products, a fused norm), so its logits
equal transformers' to rounding, not bit for bit; speculative output still equals plain decoding
wherever the rows are exact at the fixed width (static_cache.rows_exact probes this very pass).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from app.core import decoder_layers

_lock = threading.RLock()  # of() holds it while a FusedPass joins its layers' weights
_prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> FusedPass or None
log = logging.getLogger(__name__)


def unsupported(model: Any) -> str | None:
    """Why this model's passes keep transformers' own layers (None: the fused pass runs them)."""
    if not decoder_layers.llama_shaped(model):
        return f"the fused pass runs Llama-shaped {', '.join(decoder_layers.LLAMA_FAMILIES)} layers"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not all(type(p) is nn.Linear for p in projections) or _hooked(layer):
            return "the fused pass runs plain linear layers without hooks"
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None or mlp.gate_proj.bias is not None:
            return "the fused pass runs output, gate and down layers without biases"
    return None


def _hooked(layer: nn.Module) -> bool:
    """Whether a hook would act on a call within the layer, none of which the fused pass makes: any but
    transformers' output-capturing hooks, or accelerate's placement hook."""
    return any(
        m._forward_pre_hooks or hasattr(m, "_hf_hook") or not decoder_layers.capturing_only(m._forward_hooks.values())
        for m in layer.modules()
    )


@dataclass
class _Layer:
    """One decoder layer's weights as the fused pass reads them."""

    norm: torch.Tensor
    norm_eps: float
    qkv: torch.Tensor  # (q + k + v outputs, H): the three projections' rows, one tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    post_eps: float
    gate_up: torch.Tensor  # (2 I, H): gate's rows, then up's
    down: torch.Tensor


def _joined(*linears: nn.Linear) -> torch.Tensor:
    """The linears' weights as one tensor, whose row blocks then become their weights (views), so the
    model holds each weight once and every path reads the same numbers. Plain tensors even when asked
    inside inference mode: the model's weights outlive the request that first ran the pass."""
    with torch.inference_mode(False), torch.no_grad():
        joined = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(joined[start : start + rows], requires_grad=False)
        start += rows
    return joined


_joins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder layer -> its _Layer


def _weights(layer: Any) -> _Layer:
    """A decoder layer's weights as the fused pass reads them, joined once a layer: an early exit's
    view of a target shares its layers, and a second join would move weights a graph already reads."""
    if layer not in _joins:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv_bias = None
        if any(p.bias is not None for p in projections):
            with torch.inference_mode(False), torch.no_grad():
                qkv_bias = torch.cat(
                    [p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections]
                )
        _joins[layer] = _Layer(
            norm=layer.input_layernorm.weight,
            norm_eps=layer.input_layernorm.variance_epsilon,
            qkv=_joined(*projections),
            qkv_bias=qkv_bias,
            o=attn.o_proj.weight,
            post_norm=layer.post_attention_layernorm.weight,
            post_eps=layer.post_attention_layernorm.variance_epsilon,
            gate_up=_joined(mlp.gate_proj, mlp.up_proj),
            down=mlp.down_proj.weight,
        )
    return _joins[layer]


class FusedPass:
    """The pass of one model: `__call__(input_ids, position_ids, attention_mask, cache, taps)` ->
    ((T, V) logits, features), the signature StaticRollbackCache's graphs call."""

    def __init__(self, model: Any):
        config, base = model.config, model.model
        self.model = weakref.ref(model)
        self.heads, self.kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        with _lock:
            self.layers = [_weights(layer) for layer in base.layers]
        self.scaling = self.head_dim**-0.5
        # rotate_half's signs, made once: in a graph, a tensor made each pass is kernels replayed each step
        with torch.inference_mode(False):
            self.signs = _signs(self.head_dim, base.embed_tokens.weight.detach())

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache,
        taps: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(1, T) ids at (1, T) positions under a (1, 1, T, L) mask (sdpa's bool or eager's additive)
        through every layer, appending to the static cache `cache`: ((T, V) logits, and with `taps` the
        states entering those layers side by side, or with () the last normed states, else None)."""
        model: Any = self.model()
        assert model is not None, "the model is gone"
        base = model.model
        h = base.embed_tokens(input_ids)  # (1, T, H)
        t, d, kv, group = h.shape[1], self.head_dim, self.kv_heads, self.heads // self.kv_heads
        cos, sin = base.rotary_emb(h, position_ids)  # (1, T, D) each
        # rotate_half(x)·sin is x rolled by half a head times sin with its first half negated: the
        # same products, one kernel fewer a layer
        cos, sin = cos[:, :, None], (sin * self.signs)[:, :, None]
        # grouped query heads folded into the query length (row g·T + i: head g of the group, token i),
        # so every kv head attends once, to its own keys as the cache holds them
        mask = _additive(attention_mask, h.dtype).repeat(1, 1, group, 1)  # (1, 1, G·T, L)
        layers = cache.layers
        for held in layers:  # a request's first pass may be its first on this cache: allocate it, as update would
            if not held.is_initialized:
                like = torch.empty(1, kv, t, d, dtype=h.dtype, device=h.device)
                held.lazy_initialization(like, like)
        where = layers[0].cumulative_length + torch.arange(t, device=h.device)
        entering = []
        width = (self.heads + 2 * kv) * d
        for w, held in zip(self.layers, layers, strict=True):
            entering.append(h)
            x = F.rms_norm(h, (h.shape[-1],), w.norm, w.norm_eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias).view(1, t, width // d, d)
            qk = qkv[:, :, : self.heads + kv]
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)  # (1, T, Hq + Hkv, D)
            q = qk[:, :, : self.heads].view(1, t, kv, group, d).permute(0, 2, 3, 1, 4).reshape(1, kv, group * t, d)
            held.keys.index_copy_(2, where, qk[:, :, self.heads :].transpose(1, 2))
            held.values.index_copy_(2, where, qkv[:, :, self.heads + kv :].transpose(1, 2))
            out = F.scaled_dot_product_attention(q, held.keys, held.values, attn_mask=mask, scale=self.scaling)
            out = out.view(1, kv, group, t, d).permute(0, 3, 1, 2, 4).reshape(t, self.heads * d)
            h = torch.addmm(h.view(t, -1), out, w.o.t()).view(1, t, -1)  # output layer and residual
            x = F.rms_norm(h, (h.shape[-1],), w.post_norm, w.post_eps)
            gate, up = F.linear(x, w.gate_up).view(t, 2, -1).unbind(1)
            h = torch.addmm(h.view(t, -1), F.silu(gate) * up, w.down.t()).view(1, t, -1)
        h = F.rms_norm(h, (h.shape[-1],), base.norm.weight, base.norm.variance_epsilon)
        logits = model.lm_head(h)[0]
        features = None if taps is None else torch.cat([entering[i] for i in taps], dim=-1)[0] if taps else h[0]
        # the cache's write positions move last: a pass that fails anywhere leaves them where they
        # were, for transformers' layers to write the same slots (refuse)
        torch._foreach_add_([layer.cumulative_length for layer in layers], t)
        return logits, features


def _signs(d: int, like: torch.Tensor) -> torch.Tensor:
    """(D,) -1 on the first half of a head, +1 on the second: rotate_half's signs."""
    return torch.cat([like.new_full((d // 2,), -1.0), like.new_ones(d - d // 2)])


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An sdpa bool mask as 0 / -inf in `dtype` (sdpa would convert it in every layer), or an additive
    one as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def refuse(model: Any, error: Exception) -> None:
    """After the fused pass failed on this model: transformers' layers run its passes from now on, and
    the log says why, once a model (a visitor's request must not flood it)."""
    with _lock:
        if _prepared.get(model) is None:
            return
        _prepared[model] = None
    log.warning("the fused pass failed, so transformers' layers run this model: %s", str(error).splitlines()[0][:300])


def of(model: Any) -> FusedPass | None:
    """The model's fused pass, prepared once (its projections' weights joined); None where it runs
    transformers' own layers (unsupported says why)."""
    with _lock:
        if model not in _prepared:
            _prepared[model] = None if unsupported(model) else FusedPass(model)
        return _prepared[model]
