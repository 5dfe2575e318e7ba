"""Drafts from a causal LM with the target's tokenizer: a small model, or the target's own first layers
(early exit, self-speculation)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from app.core.config import SamplingConfig, UserError
from app.core.contracts import KVCache
from app.drafts.draw import Proposal, draw
from app.kv.cache import CachedModel


class ModelProposer:
    """A draft model (or the target's first layers) with its own KV cache.

    The cache lags the committed ids by one or two tokens: the next propose feeds them
    in one pass. That is how the draft still sees the last draft after a full accept.
    """

    wants_features = False

    def __init__(
        self, model: PreTrainedModel, name: str, cache_factory: Callable[[PreTrainedModel], KVCache] = CachedModel
    ):
        self.model, self.name = model, name
        # Which KV cache the draft runs on: the request may give the static one (the GPU fast path).
        self.cache_factory = cache_factory
        self.context_limit = getattr(model.config, "max_position_embeddings", None)

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        self.ids = list(prompt_ids)
        self.lm = self.cache_factory(self.model)
        # Padded embedding rows beyond the target's vocabulary must never be drafted.
        self.vocab_size = vocab_size
        self._drafts: list[int] = []

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        if k == 0:
            self._drafts = []
            return Proposal([], None)
        logits = self.lm.extend(self.ids[self.lm.length :], keep=1)[-1]
        tokens, qs = [], []
        for i in range(k):
            x, q = draw(logits[: self.vocab_size], self.ids + tokens, cfg, gen)
            if q is not None:
                qs.append(q)
            tokens.append(x)
            if i < k - 1:
                logits = self.lm.step(x)
        self._drafts = tokens
        return Proposal(tokens, torch.stack(qs) if qs else None)

    def commit(self, accepted: int, token: int, features: torch.Tensor | None = None) -> None:
        # The cache holds ids + drafts[:-1]; keep only the part the target agreed with.
        self.lm.rollback(min(self.lm.length, len(self.ids) + accepted))
        self.ids += self._drafts[:accepted] + [token]
        self._drafts = []

    def end(self) -> None:
        self.lm.close()


def early_exit(target: PreTrainedModel, n_layers: int) -> ModelProposer:
    """Self-speculation: the target's first n layers, final norm and LM head."""
    return ModelProposer(early_exit_view(target, n_layers), f"early-exit:{n_layers}")


def decoder_layers(model: PreTrainedModel) -> str:
    """The dotted path of the ModuleList of decoder blocks: model.layers, transformer.h, model.decoder.layers."""
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == model.config.num_hidden_layers:
            return path
    raise UserError(f"early exit needs a model with one list of decoder layers; {type(model).__name__} has none")


def early_exit_view(model: PreTrainedModel, n_layers: int) -> PreTrainedModel:
    """The target's first n layers, then its own final norm and LM head, sharing weights.

    Shallow copies of each module on the path to the layer list, with a shorter list and a
    config that says so: no weight is copied, and the shared target is left as it was.
    """
    total = model.config.num_hidden_layers
    if not 1 <= n_layers < total:
        raise UserError(f"early exit needs 1 <= N < {total} (the target's layer count), got {n_layers}")
    *parents, name = decoder_layers(model).split(".")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    view = node = _shallow(model, config)
    for part in parents:
        node._modules[part] = _shallow(node._modules[part], config)
        node = node._modules[part]
    node._modules[name] = nn.ModuleList(list(node._modules[name])[:n_layers])
    return view


def _shallow(module: nn.Module, config) -> nn.Module:
    """A copy of module whose child dict (and config, if it has one) can be replaced without touching it."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    # An instance-level forward (accelerate's device hooks, a benchmark's clock) is bound to the
    # original module: kept, it would run all of the original's layers instead of the view's.
    out.__dict__.pop("forward", None)
    if hasattr(module, "config"):
        out.config = config
    return out
