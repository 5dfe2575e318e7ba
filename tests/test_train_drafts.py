"""The drafts' training command for a pretrained target (train_drafts): where it runs, what a larger
run adds, resuming, and the record it writes."""

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from app import models
from app.drafts.feature_head import FeatureHead
from app.training import target_text, train, train_drafts
from app.training.target_text import Row


def test_a_stopped_head_training_resumes_to_the_same_head(target, tmp_path, monkeypatch):
    """`train --target` resumes the head from its last checkpoint: a run stopped after one and
    resumed gives the weights of a run never stopped, and reports the time of all its steps."""
    monkeypatch.setattr(train_drafts, "CHECKPOINT_EVERY", 2)
    clock = itertools.count(0.0, 10.0)  # each reading of the training's clock is 10 s after the one before
    monkeypatch.setattr(train_drafts, "time", SimpleNamespace(time=lambda: next(clock)))
    g = torch.Generator().manual_seed(0)
    hidden, vocab_size = target.config.hidden_size, target.config.vocab_size
    rows = []
    for _ in range(6):
        ids = torch.randint(3, vocab_size, (20,), generator=g)
        logp = torch.randn(20, 4, generator=g).log_softmax(-1)
        top = torch.randint(3, vocab_size, (20, 4), generator=g)
        rows.append(Row("code", ids, torch.randn(20, hidden, generator=g).half(), top.int(), logp.half()))
    vocab = torch.arange(vocab_size)

    class Stop(Exception):
        pass

    def stop_at_the_last_step(record):
        if record.get("step") == 5:
            raise Stop

    whole, _ = train_drafts.train_head(target, rows, vocab, 6, seed=0, log=lambda r: None)
    with pytest.raises(Stop):
        train_drafts.train_head(target, rows, vocab, 6, seed=0, log=stop_at_the_last_step, work=tmp_path)
    saved = torch.load(tmp_path / "head-checkpoint.pt", weights_only=False)
    assert saved["step"] == 4 and saved["seconds"] > 0
    log: list[dict] = []
    resumed, info = train_drafts.train_head(target, rows, vocab, 6, seed=0, log=log.append, work=tmp_path)
    assert {"model": "feature head", "resumed_at": 4} in log
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert info["train_seconds"] > saved["seconds"] + 10, "the resumed run counts the steps before it too"
    assert not (tmp_path / "head-checkpoint.pt").exists(), "a finished run leaves no checkpoint behind"


def test_the_trained_heads_acceptance_is_measured_in_fp32_whatever_the_default(tmp_path, monkeypatch):
    """The α a training run records must not depend on its machine: under the auto dtype a bf16 CPU
    would measure it in bf16, whose near-ties give other outputs than the card's fp32 run."""
    from app.training import acceptance

    monkeypatch.setenv("SPECDEC_DTYPE", "bf16")
    pair = models.load_pair(models.TINY_TARGET, "prompt-lookup")
    assert pair.target.dtype == torch.bfloat16, "the default the record must not follow"
    FeatureHead(pair.target.config).save(tmp_path / "head")
    seen = {}
    monkeypatch.setattr(acceptance, "suites", lambda p, **kw: seen.setdefault("dtype", p.target.dtype))
    train_drafts.measured_acceptance(models.TINY_TARGET, tmp_path / "head", scale=1.0)
    assert seen["dtype"] == torch.float32


def _fake_answers(target, tokenizer, todo, sample, seed, log, new):
    n = 3
    return [
        Row(kind, torch.arange(n), torch.zeros(n, 4).half(), torch.zeros(n, 16).int(), torch.zeros(n, 16).half())
        for kind, _ in todo
    ]


@pytest.mark.parametrize("scale,sampled", [(1.0, 2), (4.0, 8), (0.01, 1)])
def test_a_larger_scale_samples_more_of_the_targets_answers(tmp_path, monkeypatch, scale, sampled):
    """More data, not only more steps: each sampled pass is a phase file of its own, so a larger run
    reuses the passes a smaller one wrote and adds the rest."""
    monkeypatch.setattr(target_text, "answer_rows", _fake_answers)
    monkeypatch.setattr(target_text, "code_rows", lambda *a, **kw: [])
    monkeypatch.setattr(target_text, "second_turns", lambda tok, todo, first, seed: [("chat", [])] * len(todo))
    target_text.build_rows(None, None, tmp_path, 0, scale, log=lambda r: None)
    written = sorted(p.name for p in tmp_path.glob("answers-sampled-*.pt"))
    assert written == [f"answers-sampled-{i}.pt" for i in range(sampled)]


def test_a_phase_stopped_mid_write_is_written_again(tmp_path, monkeypatch):
    """A build killed while it saves a phase leaves no file the next build would take for the phase."""
    monkeypatch.setattr(target_text, "answer_rows", _fake_answers)
    monkeypatch.setattr(target_text, "code_rows", lambda *a, **kw: [])
    monkeypatch.setattr(target_text, "second_turns", lambda tok, todo, first, seed: [("chat", [])] * len(todo))
    save = torch.save

    def stopped(obj, path):
        Path(path).write_bytes(b"PK")  # the start of a file, then the stop
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", stopped)
    with pytest.raises(KeyboardInterrupt):
        target_text.build_rows(None, None, tmp_path, 0, 1.0, log=lambda r: None)
    assert not (tmp_path / "answers-greedy.pt").exists()
    monkeypatch.setattr(torch, "save", save)
    rows = target_text.build_rows(None, None, tmp_path, 0, 1.0, log=lambda r: None)
    assert rows and (tmp_path / "answers-greedy.pt").is_file()


@pytest.mark.parametrize("cuda", [False, True])
def test_the_target_command_trains_a_larger_head_on_a_gpu(monkeypatch, cuda):
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(train_drafts, "main", lambda args, command: seen.__setitem__("args", args))
    train.main(["--target", "smollm2", "--only", "draft-feature"])
    args = seen["args"]
    assert (args.device, args.scale) == (("cuda", train.GPU_SCALE) if cuda else ("cpu", 1.0))
    train.main(["--target", "smollm2", "--device", "cpu", "--scale", "0.5"])
    assert (seen["args"].device, seen["args"].scale) == ("cpu", 0.5), "what the user asks for wins"
    if not cuda:
        with pytest.raises(SystemExit, match="no CUDA device"):
            train.main(["--target", "smollm2", "--device", "cuda"])
    with pytest.raises(SystemExit, match="--head-steps must be at least 1"):
        train.main(["--target", "smollm2", "--device", "cpu", "--head-steps", "0"])


def test_the_larger_held_out_code_suite_is_never_trained_on():
    """40 chat-form code requests, none of them among the instructions the drafts train on, nor any of
    their tasks; the card and bench read it as --suite code-40."""
    from app.data import instructions
    from app.data.prompts import suite

    held = suite("code-40", chat=True)
    assert len(held) == len(set(held)) == 40 and held == instructions.held_out_code_suite()
    trained = {text for _, text in instructions.training_instructions(0)}
    assert not trained & set(held)
    assert not any(task in request for task in instructions.CODE_TASKS for request in held)
