"""Bad input gets an error that says what to change; the CLI exits non-zero without a traceback."""

import json
import subprocess
import sys

import pytest
from conftest import char_tokenizer, run, tiny_llama

from app import cli, models
from app.core import text
from app.core.config import UserError
from app.drafts.model import ModelProposer


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory, tokenizer):
    """A real target/draft pair on disk, loaded through from_pretrained like Hub models."""
    root = tmp_path_factory.mktemp("pair")
    for name, seed, layers in (("target", 1, 3), ("draft", 2, 1)):
        model = tiny_llama(len(tokenizer), layers=layers, hidden=32, seed=seed, scale=10.0, ctx=64)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    other = char_tokenizer("xyz")
    model = tiny_llama(len(other), layers=1, hidden=32, seed=3)
    model.save_pretrained(root / "alien")
    other.save_pretrained(root / "alien")
    return root


def cli_run(capsys, *argv):
    code = cli.main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_empty_prompt(tokenizer):
    with pytest.raises(UserError, match="prompt is empty"):
        text.prompt_ids(tokenizer, "   ", chat=False, context=64)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_below_one(target, tokenizer, n):
    with pytest.raises(UserError, match="max new tokens must be at least 1"):
        run(target, tokenizer, "abc", max_new_tokens=n)


def test_the_cap_on_a_visitors_run_is_the_servers_not_the_engines(target, tokenizer):
    """The engine runs past the server's cap (the context ends it); a visitor's request is refused."""
    from app.serve import boundary

    ids, steps = run(target, tokenizer, "abc", max_new_tokens=boundary.MAX_NEW_TOKENS_CAP + 1)
    assert steps[-1].stop_reason in ("context_full", "eos")
    with pytest.raises(UserError, match="max new tokens"):
        boundary.FIELDS["max_new_tokens"](boundary.MAX_NEW_TOKENS_CAP + 1)


def test_prompt_longer_than_context(tokenizer):
    with pytest.raises(UserError, match="shorten the prompt"):
        text.prompt_ids(tokenizer, "a" * 100, chat=False, context=64)


def test_k_below_one(target, near_draft, tokenizer):
    with pytest.raises(UserError, match="k must be at least 1"):
        run(target, tokenizer, "abc", ModelProposer(near_draft, "d"), k=0, k_policy="fixed")


def test_impossible_sampling_settings(target, tokenizer):
    with pytest.raises(UserError, match="top-p must be in"):
        run(target, tokenizer, "abc", temperature=1.0, top_p=0.0)
    with pytest.raises(UserError, match="temperature must be >= 0"):
        run(target, tokenizer, "abc", temperature=-1.0)


def test_unknown_model_path():
    with pytest.raises(UserError, match="could not load .*local directory or a Hub id") as e:
        models.load("/no/such/model/dir")
    assert ".." not in str(e.value), "one period between the cause and the advice"


def test_incompatible_draft_names_both_vocabularies(pair_dir):
    with pytest.raises(UserError, match=r"different vocabulary \(6 tokens.*\(48 tokens"):
        models.load_pair(str(pair_dir / "target"), str(pair_dir / "alien"))


def test_early_exit_deeper_than_target(pair_dir):
    with pytest.raises(UserError, match="early exit needs 1 <= N < 3"):
        models.load_pair(str(pair_dir / "target"), "early-exit:5")


def test_chat_without_template(tokenizer):
    with pytest.raises(UserError, match="no chat template"):
        text.prompt_ids(tokenizer, "hi", chat=True, context=64)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "abc", "--max-new-tokens", "0"], "max new tokens must be between 1 and 2048"),
        (["--prompt", "abc", "--max-new-tokens", "99999"], "max new tokens must be between 1 and 2048"),
        (["--prompt", "a" * 100], "shorten the prompt"),
        (["--prompt", "abc", "--k", "0"], "k must be at least 1"),
        (["--prompt", "abc", "--top-p", "2"], "top-p must be in"),
    ],
)
def test_cli_bad_input(capsys, pair_dir, argv, message):
    code, out, err = cli_run(capsys, "--target", str(pair_dir / "target"), "--draft", str(pair_dir / "draft"), *argv)
    assert code == 2
    assert out == ""
    *phases, last = err.splitlines()  # the slow steps it reached are named first, then one line of error
    assert last.startswith("error: ") and message in last and "Traceback" not in err
    assert all(line.startswith("generate: ") for line in phases), err


def test_cli_unknown_and_incompatible_models(capsys, pair_dir):
    code, _, err = cli_run(capsys, "--prompt", "abc", "--target", "/no/such/dir")
    assert code == 2 and "could not load" in err
    code, _, err = cli_run(
        capsys, "--prompt", "abc", "--target", str(pair_dir / "target"), "--draft", str(pair_dir / "alien")
    )
    assert code == 2 and "different vocabulary" in err


def test_cli_json_for_a_real_local_pair(pair_dir):
    # The real command, in a subprocess: JSON on stdout with records and stats.
    cmd = [
        sys.executable,
        "-m",
        "app",
        "generate",
        "--prompt",
        "def f(a):",
        "--target",
        str(pair_dir / "target"),
        "--draft",
        str(pair_dir / "draft"),
        "--max-new-tokens",
        "12",
        "--k",
        "3",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["target"] == str(pair_dir / "target") and doc["draft"] == str(pair_dir / "draft")
    assert len(doc["token_ids"]) <= 12 and doc["text"]
    assert doc["settings"]["speculation"]["k_policy"] == "fixed"
    for key in (
        "tokens_per_s",
        "acceptance_rate",
        "alpha",
        "tokens_per_pass",
        "target_passes",
        "theoretical_speedup",
        "cost_ratio_c",
        "time_to_first_token_s",
    ):
        assert key in doc["stats"]
    step = doc["steps"][0]
    for key in (
        "round",
        "k",
        "drafted",
        "draft_text",
        "accepted",
        "token",
        "token_kind",
        "rejected",
        "draft_time",
        "verify_time",
        "decisions",
    ):
        assert key in step
    assert {"p", "q", "accept_prob", "u", "accepted"} <= set(step["decisions"][0])
    assert doc["stats"]["target_passes"] == len(doc["steps"])
    ar = subprocess.run(cmd[:-3] + ["--mode", "autoregressive", "--json"], capture_output=True, text=True, timeout=300)
    assert json.loads(ar.stdout)["token_ids"] == doc["token_ids"]


def test_a_transformers_older_than_the_cache_rename_is_refused_by_name():
    """Before 5.24 the forward ignored cache=, so every pass would silently lose its context."""
    code = "import transformers; transformers.__version__ = '5.17.0'; import app.kv.cache"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "transformers 5.17.0 is installed; this app needs >= 5.24" in done.stderr
