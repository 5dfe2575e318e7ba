"""The app's "Which draft is worth it" panel: the bench's draft-size sweep, streamed question by
question, with the bench's own α, c and tokens per pass, ended by Stop or the run limit."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from test_by_kind import FIELDS

from app import category_runner, sweep
from app.bench import bench
from app.serve import queue_limits, which_draft

COST = {"early-exit:1": 0.15, "early-exit:6": 0.8, "prompt-lookup": 0.001}
DRAFTS = list(COST)


@pytest.fixture(autouse=True)
def few_drafts(monkeypatch):
    """Three drafts and a cost per draft that is a fixed function of its name, for both front ends:
    the sweep is the same code, and a timed c would differ between two runs."""
    monkeypatch.setattr(sweep, "drafts_for", lambda target, layers, named=None, exits=8: named or DRAFTS)
    monkeypatch.setattr(sweep, "cost_ratios", lambda timers, t_target, stop, say: {d: [COST[d]] for d in timers})


def _run(control=None):
    return list(which_draft.which_draft(**FIELDS, control=control or {"stop": False}, progress=lambda *a, **k: None))


def test_the_panel_gives_the_benchs_alpha_cost_and_tokens_per_pass_for_the_same_settings(tmp_path):
    updates = _run()
    doc = updates[-1][2]
    kinds = {q.category for q in category_runner.read_questions(category_runner.SAMPLE)}
    assert not doc["stopped"] and len(doc["questions"]) == len(kinds) == 7
    assert len(updates) == 7 and all(u[2] is not doc for u in updates[:-1]), "a document only at the end"
    # the bench run the page names, word for word
    printed = re.search(r"`(python -m app bench [^`]*)`", updates[-1][0]).group(1)
    out = tmp_path / "sizes"
    assert bench.main(shlex.split(printed)[4:] + ["--out", str(out)]) == 0
    want = json.loads(out.with_suffix(".json").read_text())
    assert want["drafts"] == doc["drafts"] == DRAFTS and list(want["sizes"]) == list(doc["sizes"])
    for category, curve in want["sizes"].items():
        for got, expected in zip(doc["sizes"][category]["points"], curve["points"], strict=True):
            assert got["c"] == COST[got["draft"]]
            for key in ("draft", "c", "alpha", "tokens_per_pass", "predicted"):
                assert got[key] == expected[key], (category, key)
    status = updates[-1][0]
    for category in doc["sizes"]:
        assert f"- For {category}, " in status
    assert "python -m app bench --sizes" in status and "| early exit at 6 of 8 layers |" in status
    assert {t.name for t in updates[-1][1].data} >= {"coding: measured", "coding: predicted"}, "the figure"


def test_stop_ends_the_sweep_after_the_current_measurement():
    control = {"stop": False}
    updates = []
    for update in which_draft.which_draft(**FIELDS, control=control, progress=lambda *a, **k: None):
        updates.append(update)
        control["stop"] = True  # after the first question's figures
    doc = updates[-1][2]
    assert doc["stopped"] and len(doc["questions"]) == 1 and doc["questions_asked"] == 7
    assert "Stopped after 1 of 7 questions." in updates[-1][0] and "- For coding, " in updates[-1][0]


def test_the_run_limit_ends_the_sweep_as_stop_does(monkeypatch):
    monkeypatch.setattr(queue_limits, "run_seconds", lambda: 0.0)
    doc = _run()[-1][2]
    assert doc["stopped"] and doc["questions"] == [] and set(doc["draft_cost"]) == set(DRAFTS)
