"""The app's "Which draft is worth it" panel: the bench's draft-size sweep, streamed question by
question, with the bench's own α, c and tokens per pass, ended by Stop or the run limit."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from test_by_kind import FIELDS

from app import category_runner, models, sweep
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


def _run(control=None, progress=lambda *a, **k: None):
    return list(which_draft.which_draft(**FIELDS, control=control or {"stop": False}, progress=progress))


def test_the_panel_gives_the_benchs_alpha_cost_and_tokens_per_pass_for_the_same_settings(tmp_path):
    told: list[float] = []
    updates = _run(progress=lambda done, desc=None: told.append(done))
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
    assert "python -m app bench --sizes" in status
    _names_drafts_as_the_page_does(status, doc)
    _legend_has_an_entry_per_kind_of_text_and_a_key(updates[-1][1], list(doc["sizes"]))
    _prefill_is_in_both_clocks_and_the_page_says_so(status, doc)
    # progress: the share of measurements done, rising to the last answer (it sat at 0.0 throughout); the
    # patched cost timing announces none of its 3 rounds, and the last step is announced before it runs
    assert told == sorted(told) and told[0] == 0.0 and told[-1] > 0.85 and len(set(told)) > 20, told


def _names_drafts_as_the_page_does(status: str, doc: dict) -> None:
    sentences = " ".join(sweep.verdicts(doc).values())
    assert "prompt lookup (n-grams)" in sentences and "prompt-lookup" not in sentences
    assert "early exit after 6 layers" in sentences + status and "| early exit after 6 layers |" in status
    assert "| prompt lookup (n-grams) |" in status and "draft-" not in status


def _legend_has_an_entry_per_kind_of_text_and_a_key(fig, kinds: list[str]) -> None:
    """A legend entry per kind of text (its measured, predicted and best traces in one legend group),
    and two entries that key measured and predicted once: 10 for the sample's 7 kinds and overall."""
    shown = [t.name for t in fig.data if t.showlegend is not False]
    assert shown[: len(kinds)] == kinds and len(shown) == len(kinds) + 2 <= 10, shown
    for kind in kinds:
        assert {t.legendgroup for t in fig.data if t.name.startswith(kind)} == {kind}
    measured = next(t for t in fig.data if t.name == "overall")
    assert "prompt lookup (n-grams)" in measured.text and "early exit after 1 layer" in measured.text, "hover names"


def _prefill_is_in_both_clocks_and_the_page_says_so(status: str, doc: dict) -> None:
    """What a rag point's speedup compares: the same passage-long prompt and the same tokens on both
    sides, both clocks including its prefill, which the page names with the longest prompt's length."""
    longest = max(doc["prompts"], key=lambda p: p["tokens"])
    assert f"up to {longest['tokens']} for {longest['category']}" in status and "includes its prefill" in status
    rag = next(p for p in doc["prompts"] if p["category"] == "rag")
    assert rag["tokens"] > 70, "a passage, not a one-line question"
    row = next(r for r in doc["questions"] if r["category"] == "rag")
    for d in DRAFTS:
        assert row[d]["identical"] and row[d]["tokens"] == row["plain"]["tokens"], d


def test_drafts_are_named_by_the_pages_preset_labels():
    feature = "feature draft for SmolLM2 (EAGLE-style, trained here)"
    assert sweep.name(models.SMOLLM2_FEATURE) == sweep.name("assets/models/smollm2/draft-feature") == feature
    assert sweep.name(feature) == feature and sweep.name(models.PROMPT_LOOKUP) == "prompt lookup (n-grams)"
    assert sweep.name("early-exit:2") == "early exit after 2 layers" == models.presets.draft_label("early-exit:2")
    assert sweep.name("early-exit:1") == "early exit after 1 layer"


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
