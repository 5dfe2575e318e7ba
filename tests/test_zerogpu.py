"""ZeroGPU: what crosses the worker boundary pickles; duration follows max_new_tokens; models are placed once."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from conftest import TINY_TARGET, form_fields

from app import models
from app.serve import sessions, zerogpu
from app.serve.boundary import MAX_NEW_TOKENS_CAP

FIELDS = form_fields(prompt="def f(a):\n    return a", target=TINY_TARGET, draft="distilled draft (bundled)")
FIELDS |= dict(decoding="sampling", temperature=0.9, seed=5, max_new_tokens=24, k_policy="heuristic", k=3)
ARGS = list(FIELDS.values())  # by position, as a worker receives them


def across(value):
    """What a ZeroGPU worker receives or returns: the value after a pickle round trip."""
    return pickle.loads(pickle.dumps(value))


def test_every_gpu_function_is_known():
    from app.serve import ui

    assert {ui.generate_both, ui.step_round} <= set(zerogpu.GPU_FUNCTIONS)


def test_generate_crosses_the_worker_boundary():
    from app.serve import ui

    outputs = [across(out) for out in ui.generate_both(*across(ARGS), control=across({"stop": False}))]
    doc = outputs[-1][-1]
    assert len(doc["speculative"]["token_ids"]) == 24 and not doc["stopped"]


def test_stepping_works_when_every_call_is_a_fresh_worker(monkeypatch):
    """Each call pickles the session in and out, and no live run survives between calls (as on ZeroGPU)."""
    from app.serve import ui

    def rounds(store: sessions.LiveRuns) -> list[str]:
        monkeypatch.setattr(sessions, "LIVE", store)
        session, notes = None, []
        for _ in range(4):
            session, pane, table, note, fig = across(ui.step_round(*across([session, *ARGS])))
            notes.append((note, table["data"]))
        return notes

    held = rounds(sessions.LiveRuns(max_live=4))
    fresh = rounds(sessions.LiveRuns(max_live=0))
    assert [n.split("**")[1] for n, _ in fresh] == ["Round 1", "Round 2", "Round 3", "Round 4"]
    assert fresh == held, "a worker that rebuilds the run shows the same rounds, draws and decisions"


def test_duration_follows_max_new_tokens():
    assert zerogpu.seconds(16) < zerogpu.seconds(512) <= zerogpu.seconds(MAX_NEW_TOKENS_CAP) == zerogpu.MAX_SECONDS
    assert zerogpu.seconds(float("nan")) == zerogpu.seconds(None) == zerogpu.seconds(128)


def test_preloaded_models_are_what_requests_on_that_device_find(monkeypatch):
    """models.preload caches under the key a request computes, so a worker never loads again."""
    label = "small draft (bundled)"
    models.preload(label, "draft", device="cpu")
    first = models._cache[(models.resolve(label, "draft"), "cpu", torch.bfloat16, False)]
    loaded, _ = models.load(label, "cpu", "bf16", role="draft")
    assert loaded is first[0] and next(loaded.parameters()).dtype == torch.bfloat16


def test_preload_places_the_listed_presets_only_on_zerogpu(monkeypatch):
    placed = []
    monkeypatch.setattr(models, "preload", lambda model_id, role: placed.append((model_id, role)))
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert zerogpu.preload() == [] and placed == []
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setenv("SPECDEC_PRELOAD", "stdlib-code target (bundled), prompt lookup (n-grams), /etc, gpt2")
    assert zerogpu.preload() == ["stdlib-code target (bundled)", "gpt2"]
    assert placed == [("stdlib-code target (bundled)", "target"), ("gpt2", "draft")]


def test_the_space_pins_a_gradio_release_with_the_fix():
    readme = (models.ROOT / "README.md").read_text()
    front = readme.split("---")[1]
    pinned = tuple(int(x) for x in re.search(r"^sdk_version: (\d+)\.(\d+)", front, re.M).groups())
    floor = re.search(r"^gradio>=(\d+)\.(\d+)", (models.ROOT / "requirements.txt").read_text(), re.M)
    assert pinned >= (6, 21) and tuple(int(x) for x in floor.groups()) >= (6, 21)


@pytest.fixture(autouse=True)
def _clean_cache():
    yield
    # the bf16 copies made here are not what other tests load
    for key in [k for k in models._cache if k[1] == "cpu" and k[2] != torch.float32]:
        models._cache.pop(key)
