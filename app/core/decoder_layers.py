"""Hidden states through a model's own decoder layers, without the model wrapper: the way the target's
direct passes (kv/direct_pass.py) and a feature head's drafting steps (drafts/feature_head.py) run
layers on a KV cache."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask, sdpa_mask
from transformers.utils import output_capturing

from app.core import transfer
from app.core.config import UserError

# Families whose attention is exactly Llama's (full rotary on q and k with transformers' rotate_half, no
# q/k norms or clipping), which the app's own layers (the int8 kernel's, the fused GPU pass) recompute:
# others that look alike (StableLM's partial rotary, Cohere's interleaved one) would give wrong logits.
LLAMA_FAMILIES = ("llama", "mistral", "qwen2")
LLAMA_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def llama_layers(layers) -> bool:
    """Whether every layer has q, k, v and o projections without norms of their own and a SiLU-gated MLP."""
    for layer in layers:
        for part, names in LLAMA_PROJECTIONS.items():
            module = getattr(layer, part, None)
            if module is None or not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
                return False
        attn = layer.self_attn
        if hasattr(attn, "q_norm") or getattr(attn, "sliding_window", None):
            return False
    return True


def llama_shaped(model) -> bool:
    """Whether the model is a Llama-family decoder with such layers under a standard rotary embedding
    and an LM head of its own."""
    config = model.config
    if getattr(config, "model_type", None) not in LLAMA_FAMILIES or getattr(config, "clip_qkv", None):
        return False
    if (
        float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0
        or getattr(config, "hidden_act", None) != "silu"
    ):
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers is not None and model.get_output_embeddings() is not None and llama_layers(layers)


def capturing_only(hooks) -> bool:
    """Whether these forward hooks are all transformers' output-capturing ones (its model wrapper installs
    them on every layer; they act only inside a wrapper call that asks for hidden states)."""
    return all(getattr(h, "__module__", None) == output_capturing.__name__ for h in hooks)


def through_masked(
    config,
    layers,
    rotary: nn.Module,
    h: torch.Tensor,
    cache: DynamicCache,
    mask: torch.Tensor | None = None,
    position: torch.Tensor | None = None,
    taps: tuple[int, ...] = (),
    tapped: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """(1, T, H) hidden states of T new positions through decoder layers that append to `cache`,
    under the causal mask that transformers' own `create_causal_mask` builds for them, or under a
    given (1, 1, T, cached + T) `mask` at given (1, T) positions (a tree: tree_pass). The states
    entering the layers numbered in `taps` are appended to `tapped`, in the order of `taps`."""
    if position is None:
        position = (torch.arange(h.shape[1], device=h.device) + cache.get_seq_length()).unsqueeze(0)
    position_embeddings = rotary(h, position_ids=position)
    # A whole pass reads no mask as causal over the new positions (exact.blocked_keys), which is the
    # plain causal mask create_causal_mask builds here; only layers called one by one need it built.
    out = _as_one_pass(layers, h, mask, position_embeddings, cache, taps, tapped)
    if out is not None:
        return out
    if mask is None:
        mask = create_causal_mask(
            config=config, inputs_embeds=h, attention_mask=None, cache=cache, position_ids=position
        )
    entering: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        if i in taps:
            entering[i] = h
        h = layer(
            h,
            attention_mask=mask,
            position_embeddings=position_embeddings,
            position_ids=position,
            cache=cache,
            use_cache=True,
        )
    if tapped is not None:
        tapped.extend(entering[i] for i in taps)
    return h


def _as_one_pass(layers, h, mask, position_embeddings, cache, taps=(), tapped=None) -> torch.Tensor | None:
    """The pass run by the layers themselves where they run a whole one (an exact int8 model's kernel
    layers: run_stack; no mask: causal over the new positions), else None, before anything ran (each
    layer is then called)."""
    run_stack = getattr(layers[0], "run_stack", None) if len(layers) else None
    return None if run_stack is None else run_stack(layers, h, mask, position_embeddings, cache, taps, tapped)


def fused_layers(num_layers: int) -> tuple[int, ...]:
    """The decoder layers whose entering hidden states an EAGLE-3 head fuses: a low, a middle and a
    high one (2, L/2 and L - 3, as EAGLE-3's code and vLLM choose them), distinct and in order."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}))


def entering(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """(B, T, len(layers) H): from a model's own `output_hidden_states` (entry i enters layer i, the
    last is normed), the states entering `layers` concatenated; with no layers, the last, normed."""
    if not layers:
        return hidden_states[-1]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def through_layers(layers, rotary: nn.Module, h: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """(1, 1, H) hidden state of one new position through decoder layers that append to `cache`.
    One query attends to every cached position, so no mask is built or passed."""
    position = torch.full((1, 1), cache.get_seq_length(), dtype=torch.long, device=h.device)
    position_embeddings = rotary(h, position)
    out = _as_one_pass(layers, h, None, position_embeddings, cache)
    if out is not None:
        return out
    for layer in layers:
        h = layer(
            h,
            attention_mask=None,
            position_ids=position,
            cache=cache,
            use_cache=True,
            position_embeddings=position_embeddings,
        )
    return h


def tree_pass(sees: list[list[int]], prefix: list[int], kv: int, config, device) -> torch.Tensor:
    """(1, 1, Q, kv) attention mask for Q new rows over kv key slots: row r sees slots [0, prefix[r])
    and the slots in sees[r] (its ancestors and itself, for a node of a tree). In the form the
    model's attention reads it (as_mask)."""
    # Drawn on the host and sent in one queued copy: row by row on a GPU it was two launches a row, and
    # each list of slots a plain copy that waited for the device.
    return as_mask(transfer.queued(sight_rows(sees, prefix, kv), device), config)


def sight_rows(sees: list[list[int]], prefix: list[int], kv: int) -> torch.Tensor:
    """(Q, kv) bool on the host: row r sees slots [0, prefix[r]) and the slots in sees[r]."""
    allowed = torch.zeros(len(sees), kv, dtype=torch.bool)
    for r, (slots, upto) in enumerate(zip(sees, prefix, strict=True)):
        allowed[r, :upto] = True
        allowed[r, slots] = True
    return allowed


def as_mask(allowed: torch.Tensor, config) -> torch.Tensor:
    """The (1, 1, Q, kv) mask of a (Q, kv) bool `allowed` (True: attend) in the form the model's
    attention reads it: bool for sdpa, 0 / -inf additive for eager."""
    kind = getattr(config, "_attn_implementation", None) or "eager"
    if kind == "sdpa" or ALL_MASK_ATTENTION_FUNCTIONS.get(kind) is sdpa_mask:  # a kind that reads sdpa's masks
        return allowed[None, None]
    if kind == "eager":
        dtype = getattr(config, "dtype", None) or torch.float32
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return additive.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    raise UserError(f"draft trees need sdpa or eager attention; this model runs {kind!r}: run it without a tree")
