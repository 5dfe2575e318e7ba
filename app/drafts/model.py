"""Drafts from a causal LM: a small model (with the target's tokenizer, or re-tokenised across
tokenizers), or the target's own first layers (early exit, self-speculation); and their draft kinds."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import nn
from transformers import PreTrainedModel

from app.core import engine
from app.core.config import SamplingConfig, SpecConfig, UserError
from app.core.contracts import KVCache, Proposer
from app.core.tree_shape import siblings_per_depth
from app.drafts.cross_tokenizer import CrossTokenizerProposer, TokenBridge
from app.drafts.draft_spec import BaseDraft, BaseKind, Draft, DraftInfo, DraftSpec, Loading
from app.drafts.draw import Branches, Proposal, draw, greedy_siblings, pick_on_device, stacked
from app.kv.cache import DynamicRollbackCache, refuse_uncroppable


class ModelProposer:
    """A draft model (or the target's first layers) with its own KV cache.

    The cache lags the committed ids by one or two tokens: the next propose feeds them
    in one pass. That is how the draft still sees the last draft after a full accept.
    """

    branches = True  # siblings beside its chain (draw.Branches)

    wants_features = False
    # Set by the engine after begin() where it can verify a chain's picks without
    # reading them first (engine.generate): the host then reads them once, with the verdict.
    picks_on_device = False

    def __init__(
        self,
        model: PreTrainedModel,
        name: str,
        cache_factory: Callable[[PreTrainedModel], KVCache] = DynamicRollbackCache,
    ):
        self.model, self.name = model, name
        # Which KV cache the draft runs on: the request may give the static one (the GPU fast path).
        self.cache_factory: Callable[[Any], KVCache] | None = cache_factory
        self.context_limit: int | None = getattr(model.config, "max_position_embeddings", None)

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        self.ids = list(prompt_ids)
        assert self.cache_factory is not None, "a model draft runs on a cache of its own"
        self.lm = self.cache_factory(self.model)
        # Padded embedding rows beyond the target's vocabulary must never be drafted.
        self.vocab_size = vocab_size
        self._drafts = Branches(0)
        self.picks_on_device = False
        self._pending: Proposal | None = None
        self._main: list[int] = []  # the pending drafts' chain nodes

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator, nodes: int = 0) -> Proposal:
        self._drafts = drafts = Branches(k, nodes)
        if k == 0:
            return Proposal([], None)
        logits = self.lm.extend(self.ids[self.lm.length :], keep=1)[-1]
        # A tree's siblings stay on the device under greedy only: drawn ones are read to be drawn apart.
        if self.picks_on_device and cfg.picks_stay_on_device and (not nodes or cfg.greedy) and self.lm.device_steps:
            return self._on_device(logits, k, nodes, cfg, gen)
        for i in range(k):
            history = self.ids + drafts.chain
            x, q = draw(logits[: self.vocab_size], history, cfg, gen)
            drafts.add(x, q, logits[: self.vocab_size], history, cfg, gen)
            if i < k - 1:
                logits = self.lm.step(x)
        return drafts.proposal()

    def _on_device(
        self, logits: torch.Tensor, k: int, nodes: int, cfg: SamplingConfig, gen: torch.Generator
    ) -> Proposal:
        """A chain (greedy, a race or a draw), or a greedy tree of the chain and its siblings (Branches'
        shape), whose every pick feeds the next step on the device: no step waits for the device, and
        the host reads the picks once, with the target's verdict (Proposal.pending)."""
        counts = siblings_per_depth(k, nodes)
        picks: list[torch.Tensor] = []
        qs: list[torch.Tensor | None] = []
        parents: list[int] = []
        main: list[int] = []  # the chain's nodes
        for i in range(k):
            row = logits[: self.vocab_size]
            pick, q = pick_on_device(row, cfg, len(self.ids) + i, gen)
            parent = main[-1] if main else -1
            main.append(len(parents))
            picks.append(pick.reshape(1))
            qs.append(q)
            parents.append(parent)
            if counts[i]:  # greedy (propose): the next best tokens of the same row, beside the pick
                siblings = greedy_siblings(row, pick, counts[i])
                picks.append(siblings)
                qs += [None] * len(siblings)
                parents += [parent] * len(siblings)
            if i < k - 1:
                logits = self.lm.step(pick)
        self._pending, self._main = Proposal([], stacked(qs), pending=torch.cat(picks), parents=parents), main
        return self._pending

    def commit(self, path: list[int], token: int, features: torch.Tensor | None = None) -> None:
        if self._pending is not None:  # picks on the device (a chain, a greedy tree), read with the verdict
            assert self._pending.pending is None, "the verdict reads the picks before anything commits"
            self._drafts = Branches.read_after(self._pending.tokens, self._pending.parents, self._main)
            self._pending = None
        # The cache holds ids + the chain's drafts but its last; keep only the part the target agreed with.
        kept, on_chain = self._drafts.kept(path)
        self.lm.rollback(min(self.lm.length, len(self.ids) + on_chain))
        self.ids += kept + [token]
        self._drafts = Branches(0)

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
    view = _shallow(model, config)
    node: nn.Module = view
    for part in parents:
        child = node._modules[part]
        assert child is not None  # a module on the path that decoder_layers found
        copied = _shallow(child, config)
        node._modules[part] = copied
        node = copied
    layers = cast(nn.ModuleList, node._modules[name])  # decoder_layers found a ModuleList there
    node._modules[name] = nn.ModuleList(list(layers)[:n_layers])
    return view


M = TypeVar("M", bound=nn.Module)


def _shallow(module: M, config) -> M:
    """A copy of module whose child dict (and config, if it has one) can be replaced without touching it."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    # An instance-level forward (accelerate's device hooks, a benchmark's clock) is bound to the
    # original module: kept, it would run all of the original's layers instead of the view's.
    out.__dict__.pop("forward", None)
    if hasattr(module, "config"):
        out.config = config
    return out


@torch.inference_mode()
def decode_seconds_per_token(model, prompt_ids: list[int], n: int = 64) -> float:
    """Batch-1 cached decode time per token, as the engine runs the model (direct passes where it
    is admitted, direct_pass.py)."""
    lm = DynamicRollbackCache(model)
    logits = lm.extend(prompt_ids)
    tok = int(logits[-1].argmax())
    for _ in range(4):  # warm-up
        tok = int(lm.step(tok).argmax())
    engine.sync(model.device)
    start = time.perf_counter()
    for _ in range(n):
        tok = int(lm.step(tok).argmax())
    engine.sync(model.device)
    return (time.perf_counter() - start) / n


class ModelKind(BaseKind):
    """A separate draft model, named by a Hub id or a local directory: any text no other kind reads."""

    name = "model"
    can_be_target = True

    def parse(self, text: str, probe: bool) -> DraftSpec | None:
        return DraftSpec(self, source=text)

    def load(self, spec: DraftSpec, loading: Loading) -> Draft:
        model, tokenizer = loading.model()
        refuse_uncroppable(model)
        if loading.shares_vocabulary(tokenizer):
            return ModelDraft(self, spec, loading.name, assistant=model, model=model)
        bridge = TokenBridge(loading.tokenizer, tokenizer)
        note = "different tokenizers: drafts are re-tokenised"
        return ModelDraft(self, spec, loading.name, note=note, model=model, bridge=bridge)

    def vllm(self, info: DraftInfo, k: int, spec: SpecConfig) -> tuple[dict | None, list[str]]:
        if info.different_tokenizer:
            return None, [
                "a draft with a different tokenizer has no counterpart in vLLM (its draft model must share "
                "the target's vocabulary): the command serves the target alone"
            ]
        return {"method": "draft_model", "model": info.name, "num_speculative_tokens": k}, []

    def llama_server(self, info: DraftInfo, k: int, spec: SpecConfig, gguf) -> tuple[list[str], list[str]]:
        if info.different_tokenizer:
            return [], [
                "a draft with a different tokenizer has no counterpart in llama.cpp (it requires compatible "
                "vocabularies): the command serves the target alone"
            ]
        notes: list[str] = []
        return ["-md", gguf(info.name, notes), "--draft-max", str(k), "--draft-min", "0"], notes


@dataclass
class ModelDraft(BaseDraft):
    model: PreTrainedModel | None = None
    bridge: TokenBridge | None = None  # set when the draft has another tokenizer: its drafts are re-tokenised

    def proposer(self, target, spec: SpecConfig) -> Proposer:
        assert self.model is not None, "a loaded model draft holds its model"
        if self.bridge is not None:
            if spec.tree:
                raise UserError(
                    "draft trees need a draft with the target's tokenizer: this one re-tokenises its drafts"
                )
            return CrossTokenizerProposer(self.model, self.bridge, self.name)
        return ModelProposer(self.model, self.name)

    def info(self) -> DraftInfo:
        return DraftInfo(self.spec, different_tokenizer=self.bridge is not None)

    def modules(self) -> list[nn.Module]:
        assert self.model is not None, "a loaded model draft holds its model"
        return [self.model]

    def params(self) -> int:
        assert self.model is not None, "a loaded model draft holds its model"
        return self.model.num_parameters()

    def seconds_per_token(self, target, prompt_ids: list[int]) -> float:
        return decode_seconds_per_token(self.model, prompt_ids)


EARLY_EXIT_PREFIX = "early-exit:"  # how users type it: early-exit:N


class EarlyExitKind(BaseKind):
    name = "early_exit"
    loads_weights = False
    described = "early exit"

    def parse(self, text: str, probe: bool) -> DraftSpec | None:
        if not text.lower().startswith(EARLY_EXIT_PREFIX):
            return None
        count = text[len(EARLY_EXIT_PREFIX) :].strip()
        if not (count.isascii() and count.isdigit() and len(count) <= 4):
            raise UserError(f"early exit needs a layer count, like early-exit:2; got {text[:40]!r}")
        return DraftSpec(self, layers=int(count))

    def check(self, spec: DraftSpec) -> None:
        if spec.layers < 1:
            raise UserError(f"early exit needs at least one layer, like early-exit:2; got {spec.layers}")

    def show(self, spec: DraftSpec) -> str:
        return f"{EARLY_EXIT_PREFIX}{spec.layers}"

    def load(self, spec: DraftSpec, loading: Loading) -> Draft:
        early_exit(loading.target, spec.layers)  # validates N against the target's depth
        return EarlyExitDraft(self, spec, str(spec))


class EarlyExitDraft(BaseDraft):
    def proposer(self, target, spec: SpecConfig) -> Proposer:
        return early_exit(target, self.spec.layers)


KIND, EARLY_EXIT = ModelKind(), EarlyExitKind()
