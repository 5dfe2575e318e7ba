"""A model in the exact int8 precision (exact.py's arithmetic): which models it runs, the conversion of
an fp32 causal LM and of its EAGLE-1 head, the decoder layers that run as two kernel calls each, or a
whole stack as one (int8_kernel.cpp), where the kernel loads, and what a converted model counts and reads."""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn
from transformers.utils import output_capturing

from app.core import decoder_layers
from app.models import exact, int8_kernel

CACHE_LINE = 64  # bytes: each layer's packed weights start on a line of their own in the shared buffer


class KernelLayer(nn.Module):
    """A decoder layer of the exact precision in two kernel calls (int8_kernel.cpp) and the cache's
    update between them, where the kernel runs: the same operations in the same order as its modules,
    the same bits. Mixed into the model's own layer class, whose forward runs where it does not."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        args = self._own_arguments()
        kernel = int8_kernel.module() if args is not None and position_embeddings is not None else None
        if kernel is None or hidden_states.dtype != torch.float32:
            return super().forward(
                hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings, **kwargs
            )
        return _through(kernel, [args], hidden_states, attention_mask, position_embeddings, cache)

    @staticmethod
    def run_stack(layers, h, mask, position_embeddings, cache, taps=(), tapped=None):
        """A pass's decoder layers without each module's call machinery (which cost more per layer than a
        one-token layer's attention): all in one kernel call where every layer's cache has room for the
        new positions in place, else each in its two calls from here. The same calls in the same order
        as forward, so the same bits. None where forward must run: no kernel, a layer it does not fuse,
        or hooks on a layer, which only the module call would run."""
        kernel = int8_kernel.module()
        if kernel is None or h.dtype != torch.float32 or position_embeddings is None:
            return None
        stack = []
        for layer in layers:
            args = layer._own_arguments() if isinstance(layer, KernelLayer) else None
            if args is None or layer._forward_pre_hooks or not _idle(layer._forward_hooks.values()):
                return None
            stack.append(args)
        rooms = _rooms(cache, stack, h.shape[1])
        if rooms is None:
            return _through(kernel, stack, h, mask, position_embeddings, cache, taps, tapped)
        return _in_place(kernel, layers, stack, rooms, h, mask, position_embeddings, taps, tapped)

    def _own_arguments(self) -> tuple[tuple, tuple, int] | None:
        """The layer's kernel arguments, gathered on first use; None where its weights are not packed for
        the kernel (it did not load)."""
        args = self.__dict__.get("_kernel_args")
        if args is None and self.self_attn.qkv.packed is not None:
            args = self._kernel_args = self._arguments()
        return args

    def _arguments(self) -> tuple[tuple, tuple, int]:
        """The kernel's arguments that are the layer's own (weights, sizes, norms), gathered once:
        looking them up through the modules each pass cost more than a one-token layer's attention."""
        attn, mlp = self.self_attn, self.mlp
        heads, kv_heads = (n // attn.head_dim for n in attn.sizes[:2])
        norm, qkv = self.input_layernorm, attn.qkv
        # an EAGLE head's first layer has no input norm (feature_head.py)
        weight, eps = (None, 0.0) if isinstance(norm, nn.Identity) else (norm.weight, norm.variance_epsilon)
        into = (weight, eps, qkv.packed, qkv.scale, qkv.bias, qkv.half, qkv.wide, heads, kv_heads)
        o, norm, up, down = attn.o_proj, self.post_attention_layernorm, mlp.gate_up, mlp.down_proj
        out_of = (
            attn.scaling,
            attn.weight_levels,
            o.packed,
            o.scale,
            o.bias,
            o.half,
            o.wide,
            norm.weight,
            norm.variance_epsilon,
            up.packed,
            up.scale,
            up.bias,
            up.out_features,
            down.packed,
            down.scale,
            down.bias,
            down.half,
            down.wide,
        )
        return into, out_of, attn.layer_idx


class KernelNorm(nn.Module):
    """A model's final RMSNorm in the kernel's own code (int8_kernel.rms_norm: the module's bits, its
    six ATen calls a pass in one). Mixed into the model's own norm class, whose forward runs where the
    kernel does not."""

    def forward(self, hidden_states):
        kernel = int8_kernel.module()
        if kernel is None or hidden_states.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return super().forward(hidden_states)
        return kernel.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _through(kernel, stack, h, mask, position_embeddings, cache, taps=(), tapped=None):
    """Hidden states through layers given by their kernel arguments: per layer the first kernel call,
    the cache's update and the second; the states entering the layers in `taps` go to `tapped`."""
    b, t = h.shape[:2]
    entering, first, blocked = {}, 0, None
    for i, (into, out_of, layer_idx) in enumerate(stack):
        if i in taps:
            entering[i] = h
        q, k, v = kernel.attention_in(h, *into, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        if i == 0:  # every layer of a pass sees the same keys' positions
            first, blocked = exact.blocked_keys(mask, b, t, k.shape[2], q.device)
        h = kernel.attention_out(h, q, k, v, first, blocked, *out_of)
    if tapped is not None:
        tapped.extend(entering[i] for i in taps)
    return h


def _rooms(cache, stack, t: int) -> list | None:
    """Each layer's cache layer with room for t new positions in place (growing_cache.GrowingLayer.room_for)
    and that room, or None where some layer has none (no cache, another kind, a first or growing pass)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    rooms = []
    for _, _, layer_idx in stack:
        held = layers[layer_idx] if layer_idx < len(layers) else None
        room = held.room_for(t) if hasattr(held, "room_for") else None
        if room is None:
            return None
        rooms.append((held, room))
    return rooms if len({start for _, (_, _, start) in rooms}) == 1 else None


def _in_place(kernel, layers, stack, rooms, h, mask, position_embeddings, taps=(), tapped=None):
    """_through's passes in one kernel call (int8_kernel.cpp's Stack), which writes each layer's new keys
    and values into its cache buffers in place: the same calls in the same order, so the same bits."""
    b, t = h.shape[:2]
    start = rooms[0][1][2]
    first, blocked = exact.blocked_keys(mask, b, t, start + t, h.device)
    derived = [_derived(held, k) for held, (k, _, _) in rooms]
    kept = all(derived)
    out = _stack_of(kernel, layers, stack).run(
        h,
        *position_embeddings,
        [k for _, (k, _, _) in rooms],
        [v for _, (_, v, _) in rooms],
        start,
        first,
        blocked,
        list(taps),
        [x for pair in derived for x in pair] if kept else [],
        min(min(held.derived_upto for held, _ in rooms), start),
    )
    for held, _ in rooms:
        held.hold(start + t)
        if kept:
            held.derived_upto = start + t
    if tapped is not None:
        tapped.extend(out[1:])
    return out[0]


def _derived(held, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[()]:
    """What the kernel keeps beside a growing layer's buffers (Stack.run's `kept`): its keys as the int16
    pairs attention sums them in and its keys' and values' steps, so that a pass converts only its own
    new keys, not every cached one. Made with the buffers' room; () where the kernel keeps none (a head
    size other than 64 or 128)."""
    b, kv, room, width = keys.shape
    if width - 1 not in (64, 128):
        return ()
    if held.derived is None:
        cap = -(-room // 32) * 32
        pairs = torch.zeros(b * kv, (width - 1) // 2 * cap, dtype=torch.int32)
        held.derived, held.derived_upto = (pairs, torch.zeros(2, b * kv, cap, dtype=torch.float64)), 0
    return held.derived


_stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stack_of(kernel, layers, stack):
    """The kernel's Stack of these layers' arguments, built once per run of layers (its first layer keeps
    a few, keyed by the layers' identities: a model's whole stack, an early exit's first layers)."""
    key = tuple(id(layer) for layer in layers)
    held = _stacks.setdefault(layers[0], {})
    if key not in held:
        held[key] = kernel.Stack([(into, out_of) for into, out_of, _ in stack])
    return held[key]


def _idle(hooks) -> bool:
    """Whether these forward hooks would do nothing now: transformers' output-capturing hooks (which its
    model wrapper installs on every layer) while no wrapper call is capturing."""
    if not hooks:
        return True
    collector = getattr(output_capturing, "_active_collector", None)
    capturing = collector is None or collector.get() is not None
    return not capturing and decoder_layers.capturing_only(hooks)


_fused: dict[tuple[type, type], type] = {}


def _fused_class(base: type, mixin: type = KernelLayer) -> type:
    """The model's own class (a decoder layer's, a norm's) with the kernel's forward first (one class
    per base and mixin)."""
    if (base, mixin) not in _fused:
        _fused[base, mixin] = type(f"Exact{base.__name__}", (mixin, base), {})
    return _fused[base, mixin]


def supports(model: nn.Module) -> bool:
    """Whether convert() can run this model: Llama-shaped (decoder_layers.llama_shaped), with sizes in
    whole vector lanes."""
    if not decoder_layers.llama_shaped(model):
        return False
    config = model.config
    return (
        getattr(config, "intermediate_size", 1) % exact.LANES == 0
        and getattr(config, "hidden_size", 1) % exact.LANES == 0
    )


def convert(model: nn.Module) -> nn.Module:
    """A copy of an fp32 causal LM in the exact precision: int8 linear layers and LM head, exact
    attention and SiLU. The input embedding stays fp32 (a row lookup needs no sums)."""
    if not supports(model):
        raise ValueError("the int8 precision runs Llama-shaped decoders (SmolLM2, Llama, Qwen2, Mistral)")
    converted = copy.copy(model)  # shares the embedding; the layers and the final norm below are new modules
    converted._modules = dict(model._modules)
    base = copy.copy(model.model)
    base._modules = dict(model.model._modules)
    base.layers = nn.ModuleList(_exact_layer(layer, model.config) for layer in model.model.layers)
    base.norm = copy.copy(model.model.norm)  # shares its weight
    base.norm.__class__ = _fused_class(type(model.model.norm), KernelNorm)
    converted.model = base
    head = exact.Int8Linear.of(model.get_output_embeddings())
    head.weight = model.get_output_embeddings().weight  # the rows a feature head drafts from (tied: the embedding)
    converted.set_output_embeddings(head)
    converted.specdec_precision = exact.NAME
    converted.config = copy.deepcopy(model.config)
    converted.config._attn_implementation = exact.ATTENTION
    base.config = converted.config
    _onto_huge_pages(converted)
    return converted


def _exact_layer(layer: nn.Module, config) -> nn.Module:
    """A copy of a Llama-shaped decoder layer with int8 attention and MLP, run by KernelLayer."""
    new = copy.copy(layer)
    new._modules = dict(layer._modules)
    new.self_attn = exact.ExactAttention(layer.self_attn, config)
    new.mlp = exact.ExactMLP(layer.mlp)
    new.__class__ = _fused_class(type(layer))  # still the model's own layer class to transformers' hooks
    return new


def convert_head(head: nn.Module, target: nn.Module) -> nn.Module:
    """A feature head for a target in this precision, in the same kernels: an EAGLE-1 head's fusion
    layer and decoder layer as the kernel's whole layers, an EAGLE-3 head's projections one by one,
    and either's draft-vocabulary scores in int8. Its proposals may then differ from the fp32 head's
    by rounding, which moves α only: the target's verification decides the output. Where the kernel
    does not run, the head stays as it is (its fp32 passes are then the faster)."""
    from app.drafts.eagle3_head import Eagle3Head
    from app.drafts.feature_head import FeatureHead

    if int8_kernel.module() is None:
        return head
    if type(head) is Eagle3Head:
        _int8_projections(head)
    elif type(head) is FeatureHead and decoder_layers.llama_layers(head.body.layers):
        body = head.body
        head.fc = exact.Int8Linear.of(head.fc)
        head.config._attn_implementation = body.config._attn_implementation = exact.ATTENTION
        body.layers = nn.ModuleList(_exact_layer(layer, head.config) for layer in body.layers)
    else:
        return head
    rows = head.draft_rows(target.get_output_embeddings())
    if rows is not None:
        head.rows_linear = exact.Int8Linear(rows[1])
    head.specdec_precision = exact.NAME
    _onto_huge_pages(head)
    return head


def _onto_huge_pages(model: nn.Module) -> None:
    """The packed weights of the model's int8 layers moved into one buffer, in the order a pass reads
    them, on memory the kernel asks Linux to back with 2 MB pages (int8_kernel.cpp's huge_buffer): a
    pass streams them all, and on 4 KB pages every page of the stream costs a TLB miss (SmolLM2's
    one-token pass took 0.93 of its 4 KB-page time, an A/B on a 2-core AMD EPYC). The same bytes, so
    the same bits; each layer's `packed` becomes a view of the buffer."""
    kernel = int8_kernel.module()
    linears = [m for m in model.modules() if isinstance(m, exact.Int8Linear) and m.packed is not None]
    if kernel is None or not linears:
        return
    spans = [-(-linear.packed.numel() // CACHE_LINE) * CACHE_LINE for linear in linears]
    buffer = kernel.huge_buffer(sum(spans))
    at = 0
    for linear, span in zip(linears, spans, strict=True):
        packed = linear.packed
        linear.packed = buffer[at : at + packed.numel()].view(packed.shape).copy_(packed)
        at += span


def _int8_projections(head: nn.Module) -> None:
    """An EAGLE-3 head's linear layers in int8, one by one: its fused layer reads the embedding and g
    through norms of its own, which the kernel's whole-layer path does not, and int8 projections still
    take most of the fp32 step's cost (SmolLM2's head: 3.0 against 0.5 ms a drafted step on a 2-core
    AMD EPYC). Its own LM head keeps the float rows that drafting gathers (draft_rows)."""
    for module in list(head.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not head.lm_head:
                setattr(module, name, exact.Int8Linear.of(child))


def parameter_count(model: nn.Module) -> int:
    """The model's parameters as its fp32 original counts them: int8 layers count their weights, and
    an LM head that keeps the tied embedding's rows is not counted twice."""
    count = sum(p.numel() for p in model.parameters())
    for layer in model.modules():
        if isinstance(layer, exact.Int8Linear) and layer.weight is None:
            count += layer.in_features * layer.out_features
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a pass reads: parameters and buffers, without the input embedding's
    table (a pass reads one row of it) when the LM head has its own copy."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    head = model.get_output_embeddings()
    if isinstance(head, exact.Int8Linear):
        tensors.pop(id(model.get_input_embeddings().weight), None)
    return sum(t.numel() * t.element_size() for t in tensors.values())
