"""The long commands say what they are doing on stderr before each slow step, and count their prompts,
while stdout carries their JSON alone."""

import json

import pytest

from app import cli, models
from app.bench import bench, quality


class Halt(Exception):
    """Stops a command at the slow step a test is looking at."""


def _halt_at(monkeypatch, capsys, module, name, seen):
    """Replace module.name by a call that records the stderr written so far, then stops the command."""

    def halted(*args, **kwargs):
        seen.append(capsys.readouterr().err)
        raise Halt

    monkeypatch.setattr(module, name, halted)


def test_bench_says_so_before_loading_and_measuring(monkeypatch, capsys):
    seen = []
    _halt_at(monkeypatch, capsys, bench.models, "load_pair", seen)
    with pytest.raises(Halt):
        bench.main(["--target", models.TINY_TARGET, "--limit", "1"])
    assert "bench: loading" in seen[0]
    monkeypatch.undo()
    _halt_at(monkeypatch, capsys, bench.kept_costs, "costs_for", seen)
    with pytest.raises(Halt):
        bench.main(["--target", models.TINY_TARGET, "--limit", "1"])
    assert "bench: measuring this machine" in seen[1]


@pytest.mark.slow
def test_bench_counts_its_prompts_on_stderr_and_keeps_stdout_json(tmp_path, capsys):
    argv = ["--target", models.TINY_TARGET, "--draft", models.PROMPT_LOOKUP, "--limit", "2", "--reps", "1"]
    argv += ["--no-hf", "--no-sweep", "--no-lookup", "--max-new-tokens", "6", "--out", str(tmp_path / "b")]
    assert cli.main(["bench", *argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["contenders"], "with --json, stdout is the summary's JSON and nothing else"
    for line in ("bench: loading", "bench: warm-up", "prompt 0/2", "prompt 1/2", "prompt 2/2", "bench: prompt 2/2:"):
        assert line in err, (line, err)
    assert err.index("prompt 0/2") < err.index("bench: prompt 1/2:"), "the count shows before the first prompt ends"
    assert "ours/HF" not in err, "no figure for a contender that was not run"
    # Without --json: a short table a reader takes in, which says why a comparison is missing.
    table = bench.summary_table(json.loads((tmp_path / "b.json").read_text()), "stdlib-code target")
    assert table.splitlines()[0] == "stdlib-code target · fp32 · 2 prompts"
    assert "ours: plain autoregressive" in table and "ours/HF: n/a, transformers' generate was not run" in table
    rows = table.splitlines()[3 : 3 + len(json.loads(out)["contenders"])]
    assert rows and not any("/" in r for r in rows), "models by name, never by their path on this host"


def test_quality_says_so_before_loading(monkeypatch, capsys):
    seen = []
    _halt_at(monkeypatch, capsys, quality.models, "load", seen)
    with pytest.raises(Halt):
        quality.main(["--target", models.TINY_TARGET])
    assert "quality: loading" in seen[0]


def test_quality_counts_its_continuations_on_stderr_and_keeps_stdout_json(tmp_path, monkeypatch, capsys):
    # Two code prompts and one English one, four tokens each: the counting, not the figures, is under test.
    monkeypatch.setattr(quality, "code_prompts", lambda: ["def f(x):\n    return", "import os\n"])
    monkeypatch.setattr(quality, "ENGLISH", ("Once upon a time",))
    monkeypatch.setattr(quality, "file_loss", lambda model, tokenizer: 1.0)
    assert quality.main(["--target", models.TINY_TARGET, "--new-tokens", "4", "--out", str(tmp_path / "q.json")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["prompts"] == {"code": 2, "english": 1}
    total = len(quality.SETTINGS) * 4  # three prompts and one sample per setting
    assert f"continuation 0/{total}" in err and f"continuation {total}/{total}" in err, err
    assert err.index("quality: loading") < err.index("quality: held-out loss") < err.index("continuation 0/")
    assert "written to" in err
