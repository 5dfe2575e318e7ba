"""A causal LM plus its KV cache: extend by tokens, roll back to a length."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from app.config import SpecError


class CachedModel:
    """One request's view of a shared model: the cache is private, the weights are not.

    `length` is how many tokens the cache holds; `tokens_processed` counts every token
    fed through the model, so tests can prove that rollback never re-prefills.
    """

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.tokens_processed = 0
        self.device = model.get_input_embeddings().weight.device

    @torch.inference_mode()
    def extend(self, ids: list[int], keep: int = 0) -> torch.Tensor:
        """Feed ids after the cached ones; return the (keep, V) logits of the last `keep` (0: all).

        Only the kept rows are computed, so a long prefill never holds a (len, V) tensor.
        """
        return self._forward(ids, keep, features=False)[0]

    @torch.inference_mode()
    def extend_with_features(self, ids: list[int], keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """As extend, plus the (len(ids), H) last-layer hidden states of every fed position."""
        return self._forward(ids, keep, features=True)

    def _forward(self, ids: list[int], keep: int, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep,
                         output_hidden_states=features)
        self.length += len(ids)
        self.tokens_processed += len(ids)
        return out.logits[0], out.hidden_states[-1][0] if features else None

    def rollback(self, length: int) -> None:
        """Forget every cached position at or after `length`: a crop, never a recompute."""
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length


def decoder_layers(model: PreTrainedModel) -> tuple[nn.Module, str]:
    """The base model and the name of its ModuleList of decoder blocks."""
    base = model.base_model
    for name, child in base.named_children():
        if isinstance(child, nn.ModuleList) and len(child) == model.config.num_hidden_layers:
            return base, name
    raise SpecError(
        f"early exit needs a model with one list of decoder layers; {type(model).__name__} has none"
    )


def early_exit_view(model: PreTrainedModel, n_layers: int) -> PreTrainedModel:
    """The target's first n layers, then its own final norm and LM head, sharing weights.

    A shallow copy with a shorter layer list and a config that says so: no weight is copied.
    """
    total = model.config.num_hidden_layers
    if not 1 <= n_layers < total:
        raise SpecError(f"early exit needs 1 <= N < {total} (the target's layer count), got {n_layers}")
    base, name = decoder_layers(model)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    view_base = copy.copy(base)
    view_base._modules = dict(base._modules)
    view_base._modules[name] = nn.ModuleList(list(getattr(base, name))[:n_layers])
    view_base.config = config
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._modules[model.base_model_prefix] = view_base
    view.config = config
    return view
