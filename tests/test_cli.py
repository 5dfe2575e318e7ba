"""The CLI as a user runs it: plain output is the text, help is quick, bugs show their traceback,
and a Hub id fails fast when the Hub cannot be reached."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_TARGET, form_fields

from app import cli, models
from app.models import threads

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("draft", [None, "prompt-lookup", "early-exit:2"])
def test_plain_output_is_exactly_the_json_text(capsys, monkeypatch, draft):
    from app import kept_costs

    monkeypatch.setattr(kept_costs, "_cache", {})  # a first run here, as in a fresh process
    # The bundled target with each kind of draft source; stdout is not a terminal here.
    prompt = "import os\n\n\ndef main(argv=None):\n"  # every source's drafts are both kept and rejected here
    argv = [
        "generate",
        "--target",
        models.TINY_TARGET,
        "--prompt",
        prompt,
        "--max-new-tokens",
        "40",
        "--k",
        "4",
        *(["--draft", draft] if draft else []),
    ]
    assert cli.main([*argv, "--json"]) == 0
    first = capsys.readouterr()
    doc = json.loads(first.out)  # stdout is the JSON alone; each slow step is named on stderr first
    assert "generate: loading models" in first.err and "generate: measuring this machine" in first.err
    assert first.err.index("measuring") < first.err.index("100/100"), "the measurement counts up to done"
    assert doc["threads"] == threads.choose()  # "auto" unless SPECDEC_THREADS fixes a count
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == doc["text"] + "\n"
    assert doc["text"] and any(s["rejected"] for s in doc["steps"]), "rejected drafts existed and were left out"
    assert "n/ax" not in captured.err and "tokens/pass" in captured.err, "a missing figure reads n/a, not n/ax"


def test_a_tree_runs_summary_line_has_no_figure_it_cannot_give(capsys):
    argv = ["generate", "--target", models.TINY_TARGET, "--prompt", "import os\n\n\ndef main(argv=None):\n"]
    assert cli.main([*argv, "--max-new-tokens", "24", "--k", "3", "--tree", "6"]) == 0
    err = capsys.readouterr().err
    assert "tokens/pass" in err and "n/a" not in err and "no speedup predicted" in err, err


def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom app import cli\ntry:\n    cli.main(['generate', '--help'])\n"
        "except SystemExit:\n    pass\nprint(sorted({'torch', 'transformers', 'gradio'} & set(sys.modules)))"
    )
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--max-new-tokens" in proc.stdout and proc.stdout.strip().endswith("[]"), proc.stdout[-200:]
    print(f"generate --help took {time.monotonic() - t:.2f}s")


def test_generate_help_lists_every_registered_draft_kind(capsys):
    from types import SimpleNamespace

    from app.drafts import kinds

    def draft_help() -> str:
        with pytest.raises(SystemExit):
            cli.main(["generate", "--help"])
        return " ".join(capsys.readouterr().out.split())  # argparse wraps lines

    shown = draft_help()
    assert "eagle:DIR" in shown and len(kinds.typed()) == len(kinds.KINDS)
    assert all(typed in shown for typed in kinds.typed()), shown
    toy = SimpleNamespace(name="toy")
    kinds.register(toy, "toy:")
    try:
        assert "eagle:DIR, toy: or a Hub id" in draft_help(), "a kind registered at run time is listed too"
    finally:
        kinds.unregister(toy)
    assert "toy:" not in draft_help()


def test_a_bug_is_one_line_by_default_and_a_traceback_with_debug(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("planted bug")

    monkeypatch.setattr(models, "load_pair", broken)
    assert cli.main(["generate", "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "ZeroDivisionError: planted bug" in err and "--debug" in err and "Traceback" not in err
    assert cli.main(["generate", "--prompt", "x", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "planted bug" in err


def _offline_env(tmp_path, offline: bool) -> dict:
    """A Hub that refuses connections (a closed local port) and an empty Hugging Face cache."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{port}", OMP_NUM_THREADS="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


@pytest.mark.parametrize("offline", [False, True])
def test_hub_id_fails_fast_and_says_how_to_get_the_model(tmp_path, offline):
    code = (
        "import json, time\nfrom app import models\nmodels.load  # the loader's import is not what is timed\n"
        "for name in ('someone/some-model', 'Qwen2.5-1.5B-Instruct'):\n"
        "    t = time.monotonic()\n    try:\n        models.load(name)\n    except models.UserError as e:\n"
        "        print(json.dumps({'s': time.monotonic() - t, 'msg': str(e)}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_offline_env(tmp_path, offline),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out, preset = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert out["s"] < 5, f"took {out['s']:.1f}s"
    assert "hf download Qwen/Qwen2.5-1.5B-Instruct" in preset["msg"], "a preset's hint names its Hub id"
    assert "HF_HUB_OFFLINE" in out["msg"] and "local directory" in out["msg"] and ".." not in out["msg"]
    assert ("HF_HUB_OFFLINE is set" in out["msg"]) == offline
    assert "Retry" not in proc.stderr


def test_cli_with_an_unreachable_hub_is_one_line(tmp_path):
    t = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "generate",
            "--prompt",
            "x",
            "--target",
            "someone/some-model",
            "--mode",
            "autoregressive",
        ],
        cwd=ROOT,
        env=_offline_env(tmp_path, False),
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.monotonic() - t
    # the phase it was in, then the error in one line
    *phases, last = proc.stderr.splitlines()
    assert proc.returncode == 2 and last.startswith("error: ") and "error" not in "".join(phases), proc.stderr
    assert all(line.startswith("generate: ") for line in phases), proc.stderr
    assert "HF_HUB_OFFLINE" in proc.stderr
    assert took < 30, f"{took:.1f}s: the Hub was retried instead of detected as unreachable"


def test_a_sampled_run_is_planned_on_timings_of_sampled_rounds(capsys, monkeypatch):
    """Adaptive k and "predicted for this machine" read a calibration taken under the request's own
    sampling settings: sampled rounds cost more than greedy ones (calibrate.measure)."""
    from app import calibrate, kept_costs

    seen, real_measure = [], calibrate.measure
    monkeypatch.setattr(kept_costs, "_cache", {})
    monkeypatch.setattr(calibrate, "measure", lambda *a, **kw: seen.append(kw["sampling"]) or real_measure(*a, **kw))
    argv = [
        "generate",
        "--target",
        models.TINY_TARGET,
        "--prompt",
        "import os\n",
        "--max-new-tokens",
        "8",
        "--k-max",
        "2",
        "--draft",
        "prompt-lookup",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--json",
    ]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s.temperature, s.top_p) for s in seen] == [(0.8, 0.9)]
    assert doc["stats"]["predicted_speedup"] is not None


def test_the_command_the_page_prints_reproduces_the_pages_run(capsys):
    """The page's "from the command line" line is this run exactly: the same pair, settings and text."""
    import shlex

    from app.args import command_line
    from app.serve import ui

    prompt = "import os\n\n\ndef main(argv=None):\n"
    fields = form_fields(prompt=prompt, target=TINY_TARGET, draft="distilled draft (bundled)", decoding="sampling")
    fields |= dict(temperature=0.9, top_k=11, top_p=0.95, seed=0, max_new_tokens=24, k_policy="adaptive", k=3)
    fields |= dict(rule="shared-noise", tree=6)  # shared noise: the seed's text, any k
    control = {"stop": False}
    ui.start_run(11, "sampling", control)
    ui.check_request(**fields, control=control)
    *_, doc = list(ui.generate_both(**fields, control=control))[-1]
    printed = ui.export_for(**fields, control=control)
    form = ui.form.parse(fields)
    line = command_line(prompt, form.target, form.draft, form.settings, form.dtype)
    assert f"# this run from the command line, these settings exactly\n{line}\n" in printed
    words = shlex.split(line)
    assert words[:4] == ["python", "-m", "app", "generate"] and "--tree" in words and "--dtype" in words
    capsys.readouterr()
    assert cli.main([*words[3:], "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert ran["settings"] == json.loads(json.dumps(doc["speculative"]["settings"]))
    assert ran["token_ids"] == doc["speculative"]["token_ids"] == doc["autoregressive"]["token_ids"]
