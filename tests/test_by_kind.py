"""The app's "By kind of text" panel: the bench's runner on the bundled sample, question by question,
with the bench's own figures, ended by Stop or the run limit after a round."""

from __future__ import annotations

import json
import re
import shlex

from conftest import TINY_TARGET, form_fields

from app import category_runner
from app.bench import bench
from app.serve import by_kind, queue_limits

FIELDS = form_fields(prompt="unused by the panel", target=TINY_TARGET, draft="prompt-lookup", temperature=1.0)
FIELDS |= dict(max_new_tokens=16, k_policy="fixed", k=3)


def _run(control=None):
    return list(by_kind.by_kind(**FIELDS, control=control or {"stop": False}, progress=lambda *a, **k: None))


def test_the_panel_gives_the_benchs_figures_for_the_same_questions_and_settings(tmp_path):
    updates = _run()
    doc = updates[-1][2]
    sample = category_runner.select(category_runner.read_questions(category_runner.SAMPLE), None, by_kind.PER_CATEGORY)
    assert not doc["stopped"] and len(doc["questions"]) == len(sample) == 14
    assert sum(isinstance(u[0], str) and "answering" in u[0] for u in updates) == 14, "progress per question"
    # the bench run the page names, word for word
    status = updates[-1][0]
    printed = re.search(r"`(python -m app bench [^`]*)`", status).group(1)
    out = tmp_path / "bench"
    assert bench.main(shlex.split(printed)[4:] + ["--out", str(out)]) == 0
    want = json.loads(out.with_suffix(".json").read_text())["summary"]
    assert list(doc["summary"]) == list(want)
    for category, entry in want.items():
        got = doc["summary"][category]["prompt-lookup"]
        for key in ("tokens_per_pass", "alpha", "identical"):
            assert got[key] == entry["prompt-lookup"][key], (category, key)
    assert "| **overall** |" in status
    assert updates[-1][1].data, "the bar chart"


def test_stop_ends_the_panel_after_a_round_with_the_questions_answered_so_far():
    control = {"stop": False}
    updates = []
    for update in by_kind.by_kind(**FIELDS, control=control, progress=lambda *a, **k: None):
        updates.append(update)
        if "| coding |" in str(update[0]):
            control["stop"] = True  # after the first question's figures
    doc = updates[-1][2]
    assert doc["stopped"] and len(doc["questions"]) == 1 and doc["questions_asked"] == 14
    assert updates[-1][0].startswith("Stopped after 1 of 14 questions")


def test_the_run_limit_ends_the_panel_as_stop_does(monkeypatch):
    monkeypatch.setattr(queue_limits, "run_seconds", lambda: 0.0)
    doc = _run()[-1][2]
    assert doc["stopped"] and doc["questions"] == []


def test_the_two_panels_share_one_layout_and_wiring_and_declare_only_their_words():
    """By kind of text and Which draft is worth it: one panel.layout and one handler each (panel.handler),
    wired under the handler's API name to the panel's own status, figure and records."""
    from app.serve import panel, ui, which_draft

    demo = ui.build_ui()
    props = {c["id"]: c["props"] for c in demo.config["components"]}
    by_elem = {p.get("elem_id"): i for i, p in props.items() if p.get("elem_id")}
    for shown in (by_kind.PANEL, which_draft.PANEL):
        assert isinstance(shown, panel.Panel) and shown.elem_id in by_elem
        assert props[by_elem[f"{shown.key}-run"]]["value"] == shown.run
        wired = next(d for d in demo.config["dependencies"] if d["api_name"] == shown.handler.__name__)
        status, plot, records = (props[i] for i in wired["outputs"])
        assert (status["elem_id"], plot["elem_id"]) == (f"{shown.key}-status", f"{shown.key}-plot")
        assert (plot["label"], records["label"]) == (shown.plot, shown.records)
    assert (by_kind.by_kind.__name__, which_draft.which_draft.__name__) == ("by_kind", "which_draft")
