"""What a draft is, as one typed value parsed once from CLI, UI or API text, and the contract every
kind of draft keeps.

A draft kind (kinds.py lists them) owns how its text is parsed and shown, how it loads, and what
the rest of the app asks of a loaded draft: its proposer, its export lines, why it drafted nothing,
and how the bench times it and counts its parameters. Loading, hosting, export, the bench and the
teaching view ask the kind, never the string again and never a chain of kind comparisons.
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from app.core.config import SamplingConfig, SpecConfig, UserError
from app.core.contracts import Proposer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from app.core.events import Step


@dataclass(frozen=True)
class DraftSpec:
    kind: DraftKind  # one of the registered kinds (kinds.py parses text into a spec)
    source: str = ""  # drafts with weights: the Hub id or local directory to load
    layers: int = 0  # early exit: how many of the target's layers draft

    def __post_init__(self) -> None:
        self.kind.check(self)

    @property
    def loads_model(self) -> bool:
        """Whether this draft has weights of its own to load (a model or a head)."""
        return self.kind.loads_weights

    def __str__(self) -> str:
        """The canonical text, which parses back to this spec."""
        return self.kind.show(self)


@dataclass(frozen=True)
class DraftInfo:
    """What the exporters need to know about a draft, without loading it."""

    spec: DraftSpec
    different_tokenizer: bool = False  # its drafts are re-tokenised for the target

    @property
    def kind(self) -> DraftKind:
        return self.spec.kind

    @property
    def name(self) -> str:
        return str(self.spec)


class Loading(Protocol):
    """What loading a draft may ask of models/ (which sits above drafts/), for one pair."""

    target: PreTrainedModel
    tokenizer: Any
    name: str  # the draft as resolved (what from_pretrained gets)

    def model(self) -> tuple[PreTrainedModel, Any]:
        """The draft as a causal LM with its tokenizer, on the target's first device, shared and cached."""
        ...

    def head(self, source: str) -> Any:
        """A feature head for this target, loaded once."""
        ...

    def shares_vocabulary(self, draft_tokenizer) -> bool:
        """True when the draft's ids are the target's; False when its drafts must be re-tokenised."""
        ...


class Draft(Protocol):
    """A loaded draft: what a Pair holds, and all that runs, the bench and the views ask of it."""

    kind: DraftKind
    spec: DraftSpec
    name: str  # how the draft is named in records and messages
    note: str  # one line for the UI about how it drafts ('' when there is nothing to say)
    assistant: PreTrainedModel | None  # a draft model transformers' assisted generation can run, or None

    def proposer(self, target: PreTrainedModel, spec: SpecConfig) -> Proposer:
        """A fresh proposer for one request (its cache and ids are that request's own)."""
        ...

    def info(self) -> DraftInfo:
        """What the exporters need to know about this draft."""
        ...

    def idle_note(self, step: Step) -> str:
        """Why a round with k > 0 drafted nothing ('' when the kind has nothing to say)."""
        ...

    def modules(self) -> list[torch.nn.Module]:
        """The draft's own modules, which the bench's pass clock times."""
        ...

    def params(self) -> int:
        """Parameters of the draft's own (0 for a draft without weights)."""
        ...

    def seconds_per_token(self, target: PreTrainedModel, prompt_ids: list[int]) -> float:
        """Drafting time per token on this machine, as the engine runs the draft."""
        ...


class DraftKind(Protocol):
    name: str
    loads_weights: bool  # it has weights of its own, which the hosting rules' model list governs
    can_be_target: bool  # the same text names a model that could serve as the target

    def parse(self, text: str, probe: bool) -> DraftSpec | None:
        """The spec when `text` names a draft of this kind, else None."""
        ...

    def check(self, spec: DraftSpec) -> None:
        """Raise UserError for a spec of this kind with missing or bad parameters."""
        ...

    def show(self, spec: DraftSpec) -> str:
        """The canonical text of a spec, which parse reads back."""
        ...

    def load(self, spec: DraftSpec, loading: Loading) -> Draft:
        """The loaded draft for one pair."""
        ...

    def vllm(self, info: DraftInfo, k: int, spec: SpecConfig) -> tuple[dict | None, list[str]]:
        """vLLM's --speculative-config for this draft (None: no counterpart) and notes."""
        ...

    def llama_server(self, info: DraftInfo, k: int, spec: SpecConfig, gguf) -> tuple[list[str], list[str]]:
        """llama-server's draft arguments ([] with a note: no counterpart) and notes; gguf(name, notes)
        names the GGUF file of a model."""
        ...

    def sglang(self, info: DraftInfo, k: int, spec: SpecConfig) -> tuple[list[str] | None, list[str]]:
        """SGLang's speculative arguments for this draft, or None where the export offers no SGLang command."""
        ...


class BaseKind:
    """Defaults for a kind: weights of its own, no counterpart in the serving engines, no checks."""

    name = ""
    loads_weights = True
    can_be_target = False
    described = ""  # how export notes name this kind

    def check(self, spec: DraftSpec) -> None:
        if self.loads_weights and not spec.source:
            raise UserError("no draft model given: pick a preset, a Hub id or a local directory")

    def show(self, spec: DraftSpec) -> str:
        return spec.source

    def _what(self, info: DraftInfo) -> str:
        return f"{self.described or 'this draft'} ({info.name})"

    def vllm(self, info: DraftInfo, k: int, spec: SpecConfig) -> tuple[dict | None, list[str]]:
        return None, [f"{self._what(info)} has no counterpart in vLLM: the command serves the target alone"]

    def llama_server(self, info: DraftInfo, k: int, spec: SpecConfig, gguf) -> tuple[list[str], list[str]]:
        return [], [f"{self._what(info)} has no counterpart in llama-server: the command serves the target alone"]

    def sglang(self, info: DraftInfo, k: int, spec: SpecConfig) -> tuple[list[str] | None, list[str]]:
        return None, []


@dataclass
class BaseDraft(ABC):
    """Defaults for a loaded draft: nothing to note, no modules, timed through its own proposer."""

    kind: Any
    spec: DraftSpec
    name: str
    note: str = ""
    assistant: Any = None

    def info(self) -> DraftInfo:
        return DraftInfo(self.spec)

    def idle_note(self, step) -> str:
        return ""

    def modules(self) -> list[torch.nn.Module]:
        return []

    def params(self) -> int:
        return sum(p.numel() for m in self.modules() for p in m.parameters())

    def seconds_per_token(self, target, prompt_ids: list[int]) -> float:
        return proposer_seconds_per_token(self.proposer(target, SpecConfig()), target, prompt_ids)

    @abstractmethod
    def proposer(self, target, spec: SpecConfig) -> Proposer:
        """A fresh proposer for one request."""


@torch.inference_mode()
def proposer_seconds_per_token(proposer: Proposer, target, prompt_ids: list[int], k: int = 8, rounds: int = 8) -> float:
    """A proposer's drafting time per token, as the engine calls it: each round proposes k after the
    prompt and commits nothing new, so every round drafts from the same context. A proposer that
    reads features gets the target's over the prompt first, as after a first round."""
    from app.core import engine
    from app.kv.cache import DynamicRollbackCache

    proposer.begin(prompt_ids, target.get_output_embeddings().weight.shape[0])
    features = None
    if proposer.wants_features:
        _, features = DynamicRollbackCache(target, getattr(proposer, "feature_layers", ())).extend_with_features(
            prompt_ids, keep=1
        )
        proposer.commit([], int(prompt_ids[-1]), features)
    greedy, gen = SamplingConfig(), torch.Generator()
    times = []
    for _ in range(rounds + 2):  # the first two warm up
        engine.sync(target.device)
        start = time.perf_counter()
        drafted = len(proposer.propose(k, greedy, gen).tokens)
        engine.sync(target.device)
        times.append((time.perf_counter() - start) / max(drafted, 1))
        proposer.commit([], int(prompt_ids[-1]), None if features is None else features[-1:])
    proposer.end()
    return statistics.median(times[2:])
