"""A draft kind is one object: every registered kind keeps the Proposer and Draft contracts, and a
new kind registered from a test runs in generate, the bench's card and the export with no other
change in app/."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

import pytest
import torch

from app import cli, models, runs
from app.bench import bench
from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig
from app.core.contracts import Proposal, Proposer
from app.drafts import kinds
from app.drafts.draft_spec import BaseDraft, BaseKind, Draft, DraftSpec

TINY = "stdlib-code target (bundled)"
# One text of every built-in kind, loaded on the tiny family.
BUILT_IN = {
    "prompt_lookup": "prompt-lookup",
    "early_exit": "early-exit:2",
    "feature_head": "feature draft (EAGLE-style, bundled)",
    "model": "distilled draft (bundled)",
}


def members(protocol) -> set[str]:
    """The attributes and methods a Protocol declares (its annotations and its own functions)."""
    own = {n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}
    return own | set(getattr(protocol, "__annotations__", {}))


def gaps(obj, protocol) -> set[str]:
    """What obj lacks of a Protocol: a missing member, or a method that cannot be called the way the
    protocol declares it (a parameter missing or renamed, as the engine passes them by name)."""
    out = {m for m in members(protocol) if not hasattr(obj, m)}
    for name, declared in vars(protocol).items():
        if not inspect.isfunction(declared) or name.startswith("_") or name in out:
            continue
        method = getattr(obj, name)
        if not callable(method):
            out.add(name)
            continue
        params = list(inspect.signature(method).parameters.values())
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        wanted = list(inspect.signature(declared).parameters)[1:]  # without self
        names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not takes_any and names[: len(wanted)] != wanted:
            out.add(f"{name}{tuple(wanted)}")
    return out


def test_every_registered_kind_keeps_the_contracts():
    assert {k.name for k in kinds.KINDS} == set(BUILT_IN), "a kind without a conformance case"
    for kind in kinds.KINDS:
        pair = models.load_pair(TINY, BUILT_IN[kind.name])
        assert pair.draft_spec.kind is kind and kinds.parse(str(pair.draft_spec)) == pair.draft_spec
        missing = gaps(pair.draft, Draft)
        assert not missing, f"{kind.name}'s draft lacks {missing}"
        proposer = pair.proposer(SpecConfig())
        missing = gaps(proposer, Proposer)
        assert not missing, f"{kind.name}'s proposer lacks {missing}"
        ids = pair.encode("def add(a, b):\n    return")
        assert pair.draft.seconds_per_token(pair.target, ids) > 0
        first = next(iter(runs.Run(pair, ids, Settings(run=RunConfig(2))).steps()))
        assert pair.draft.params() >= 0 and isinstance(pair.draft.idle_note(first), str)


def test_the_contract_check_bites():
    """A proposer without cache_factory (which runs reads), and one whose commit cannot take a tree's
    kept path, are caught by the same check."""

    class Partial:
        name, wants_features, context_limit = "partial", False, None

        def begin(self, prompt_ids, vocab_size): ...
        def propose(self, k, cfg, gen, nodes=0): ...
        def commit(self, accepted, token, features=None): ...
        def end(self): ...

    assert gaps(Partial(), Proposer) == {"cache_factory", "commit('path', 'token', 'features')"}


class RepeatLast:
    """A toy proposer: k copies of the last committed token."""

    name, wants_features, context_limit, cache_factory = "toy", False, None, None

    def begin(self, prompt_ids, vocab_size):
        self.ids = list(prompt_ids)
        self.drafted: list[int] = []

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator, nodes: int = 0) -> Proposal:
        self.drafted = [self.ids[-1]] * k
        return Proposal(list(self.drafted), None)

    def commit(self, path, token, features=None):
        self.ids += [self.drafted[i] for i in path] + [token]

    def end(self):
        pass


class ToyKind(BaseKind):
    name, loads_weights, described = "toy", False, "a toy draft"

    def parse(self, text: str, probe: bool):
        return DraftSpec(self) if text == "toy:" else None

    def show(self, spec):
        return "toy:"

    def load(self, spec, loading):
        return ToyDraft(self, spec, "toy:")


@dataclass
class ToyDraft(BaseDraft):
    def proposer(self, target, spec):
        return RepeatLast()


@pytest.fixture
def toy():
    kind = ToyKind()
    kinds.register(kind)
    yield kind
    kinds.unregister(kind)


def test_a_new_kind_runs_in_generate_the_card_and_the_export(toy, capsys, tmp_path):
    prompt = "aaaaaaaa"
    base = ["generate", "--prompt", prompt, "--target", TINY, "--max-new-tokens", "24", "--no-chat", "--json"]
    assert cli.main([*base, "--draft", "toy:", "--k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert cli.main([*base, "--mode", "autoregressive"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["text"] == plain["text"], "the toy draft's output is the target's own"
    assert sum(len(s["drafted"]) for s in spec["steps"]) > 0, "it drafted"

    out = tmp_path / "card"
    assert bench.main(["--card", "--draft", "toy:", "--limit", "1", "--max-new-tokens", "8", "--out", str(out)]) == 0
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["toy:"]["params"] == 0 and card["toy:"]["cost_per_token_vs_target"] > 0

    capsys.readouterr()
    assert cli.main(["export", "--target", TINY, "--draft", "toy:", "--json"]) == 0
    notes = [n for e in json.loads(capsys.readouterr().out) for n in e["notes"]]
    assert any("a toy draft (toy:) has no counterpart in vLLM" in n for n in notes)
    assert any("a toy draft (toy:) has no counterpart in llama-server" in n for n in notes)


def test_a_kind_name_is_registered_once(toy):
    with pytest.raises(ValueError, match="registered already"):
        kinds.register(ToyKind())


def test_a_source_that_cannot_branch_is_refused_a_tree_in_one_line(toy, capsys):
    """Asked for a tree, a source without branches says so; it never drafts a chain in its place."""
    argv = ["generate", "--prompt", "aaaa", "--target", TINY, "--max-new-tokens", "8", "--no-chat", "--json"]
    assert cli.main([*argv, "--draft", "toy:", "--tree", "8"]) != 0
    err = capsys.readouterr().err
    assert "the toy draft cannot branch: run it as a chain (tree 0)" in err and "Traceback" not in err
