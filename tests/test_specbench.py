"""The bench reads Spec-Bench's question format (and plain prompt files), runs multi-turn questions
turn by turn on the target's own history, and reports the leaderboard's figures per category."""

from __future__ import annotations

import json

import pytest

from app import category_runner
from app.bench import bench, specbench
from app.core.config import UserError
from app.models import load
from app.models.presets import TINY_TARGET

TINY = "stdlib-code target (bundled)"


def test_the_sample_holds_every_task_and_multi_turn_questions():
    sample = category_runner.read_questions(category_runner.SAMPLE)
    categories = {q.category for q in sample}
    assert {"coding", "writing", "translation", "summarization", "qa", "math_reasoning", "rag"} <= categories
    assert any(len(q.turns) == 2 for q in sample)
    picked = category_runner.select(sample, "qa,rag", 1)
    assert [q.category for q in picked] == ["qa", "rag"]
    with pytest.raises(UserError, match="no questions of category poetry"):
        category_runner.select(sample, "poetry", 0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('["a list"]', "a JSON object"),
        ('{"question_id": 2, "turns": ["x"]}', "missing category"),
        ('{"question_id": 2, "category": "qa", "turns": []}', "non-empty list"),
        ('{"question_id": 2, "category": "qa", "turns": ["ok", ""]}', "non-empty list"),
        ('{"question_id": 1, "category": "qa", "turns": ["again"]}', "appears twice"),
    ],
)
def test_a_bad_line_is_refused_with_its_number_before_anything_runs(tmp_path, monkeypatch, capsys, line, message):
    path = tmp_path / "q.jsonl"
    good = json.dumps({"question_id": 1, "category": "qa", "turns": ["What is 2 + 2?"]})
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(UserError, match=rf"q.jsonl:3: .*{message}"):
        category_runner.read_questions(path)
    monkeypatch.setattr("app.models.load_pair", lambda *a, **k: pytest.fail("a run started"))
    from app import cli

    assert cli.main(["bench", "--suite", str(path)]) != 0
    assert "q.jsonl:3" in capsys.readouterr().err


def test_a_later_turn_follows_the_earlier_answer():
    _, tokenizer = load(TINY_TARGET)
    ids = category_runner.conversation(tokenizer, ["def f(x):", "def g(y):"], ["    return x"], False, 1000)
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("def f(x):\n\n    return x\n\ndef g(y):")


def test_a_question_file_gives_the_leaderboards_figures_per_category(tmp_path):
    path = tmp_path / "q.jsonl"
    lines = [
        {"question_id": 1, "category": "coding", "turns": ["def add(a, b):", "def sub(a, b):"]},
        {"question_id": 2, "category": "coding", "turns": ["import os\n\ndef walk(root):"]},
        {"question_id": 3, "category": "prose", "turns": ["The weather today"]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run"
    argv = ["--suite", str(path), "--target", TINY, "--drafts", "prompt-lookup,early-exit:2", "--no-chat"]
    assert bench.main(argv + ["--max-new-tokens", "12", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["format"] == "spec-bench" and doc["drafts"] == ["prompt-lookup", "early-exit:2"]
    assert list(doc["summary"]) == ["coding", "prose", "overall"]
    first = doc["questions"][0]
    assert first["turns"] == 2 and first["plain"]["tokens"] > 12, "both turns answered"
    for category in doc["summary"].values():
        for draft in doc["drafts"]:
            v = category[draft]
            assert v["tokens_per_pass"] >= 1 and v["speedup"]["min"] <= v["speedup"]["max"]
            assert v["alpha"] is None or 0 <= v["alpha"] <= 1  # None: nothing was drafted
            assert v["identical"] == 1.0, "greedy: the same text as plain decoding"
    assert doc["summary"]["overall"]["questions"] == 3
    assert (
        "category_figure" not in out.with_suffix(".html").read_text()
        and "plotly" in out.with_suffix(".html").read_text()
    )
    assert "overall" in specbench.table(doc)


def test_a_plain_file_is_one_prompt_a_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("def add(a, b):\n\nThe weather today\n")
    read = category_runner.read_questions(path)
    assert [(q.category, q.turns) for q in read] == [
        ("prompts", ("def add(a, b):",)),
        ("prompts", ("The weather today",)),
    ]


def test_with_a_tree_each_draft_runs_as_a_chain_and_as_a_tree(tmp_path):
    out = tmp_path / "run"
    argv = ["--suite", str(category_runner.SAMPLE), "--categories", "qa,rag", "--per-category", "1", "--target", TINY]
    argv += ["--draft", "prompt-lookup", "--k", "3", "--tree", "8", "--max-new-tokens", "8", "--no-chat"]
    assert bench.main(argv + ["--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["drafts"] == ["prompt-lookup", "prompt-lookup · tree 8"]
    chain, tree = (doc["summary"]["overall"][d] for d in doc["drafts"])
    assert chain["identical"] == tree["identical"] == 1.0, "greedy: both the target's own text"
    rounds = [r["prompt-lookup · tree 8"] for r in doc["questions"]]
    assert all(r["tokens"] > 0 for r in rounds)


def test_several_drafts_on_a_built_in_suite_run_its_requests_as_one_category():
    """bench --suite code --drafts a,b is one interleaved run of the suite's requests, as of a file's."""
    from app.data.prompts import suite

    asked = specbench._questions("code-40")
    assert [q.turns for q in asked] == [(p,) for p in suite("code-40", chat=True)]
    assert {q.category for q in asked} == {"code-40"} and len({q.question_id for q in asked}) == 40
