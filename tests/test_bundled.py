"""The bundled family: loads offline, is really trained, and stays lossless with every draft."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app import models
from app.core import engine, metrics
from app.core.config import RunConfig, SpecConfig
from app.data import corpus
from app.kv.cache import DynamicRollbackCache
from app.training import train

NAMES = ["target", "draft-distilled", "draft-small", "draft-weak"]


@pytest.fixture(scope="module")
def held_out_text():
    _, held = corpus.split_corpus(corpus.stdlib_files())
    return held[0][:6000]


@pytest.mark.parametrize("name", NAMES)
def test_loads_offline_as_plain_transformers(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = models.BUNDLED / name
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (path / f).exists(), f
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok)
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    loaded, _ = models.load(str(path), device="cpu")
    assert loaded.dtype == torch.float32, "fp16 on disk is upcast on CPU"


def test_tokenizer_round_trips_and_keeps_indentation_apart():
    tok = AutoTokenizer.from_pretrained(models.BUNDLED / "target")
    text = "def f(x):\n    return 'naïve ✓ 日本'  # tab\there\n\n\tpass\r\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    pieces = tok.convert_ids_to_tokens(tok("if x:\n        y = 1\n")["input_ids"][1:])
    assert "Ċ" in pieces, "a newline is a token of its own"
    assert "ĠĠĠĠĠĠĠĠ" in pieces, "the indentation after it is a token of its own"


def held_out_loss(model, tok, text) -> float:
    ids = torch.tensor([tok(text)["input_ids"][:512]])
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_target_is_really_trained(held_out_text):
    model, tok = models.load(models.TINY_TARGET)
    bound = 0.6 * math.log(len(tok))  # uniform over the vocabulary is log V nats per token
    assert held_out_loss(model, tok, held_out_text) < bound
    torch.manual_seed(0)
    random = AutoModelForCausalLM.from_config(model.config).eval()
    assert held_out_loss(random, tok, held_out_text) > bound, "the bound must fail for random weights"


@pytest.mark.parametrize("draft", [*NAMES[1:], train.FEATURE_HEAD])
def test_greedy_speculative_equals_target_greedy(draft, held_out_text):
    pair = models.load_pair(models.TINY_TARGET, str(models.BUNDLED / draft))
    ids = pair.tokenizer(held_out_text[:800])["input_ids"]
    run = RunConfig(48)
    ar = [
        t
        for s in engine.generate(pair.target, pair.tokenizer, ids, None, run=run, target_cache=DynamicRollbackCache)
        for t in s.emitted
    ]
    spec = [
        t
        for s in engine.generate(
            pair.target,
            pair.tokenizer,
            ids,
            pair.proposer(),
            spec=SpecConfig(k=4, k_policy="fixed"),
            run=run,
            target_cache=DynamicRollbackCache,
        )
        for t in s.emitted
    ]
    assert spec == ar and len(ar) == 48


def test_bundled_drafts_agree_with_the_target_in_the_order_the_model_card_gives():
    """Greedy alpha at k = 4 on the openings of four held-out files (docstrings and headers, harder than
    the card's code): feature 0.92, distilled 0.66, small 0.51, weak 0.05 when the one-layer distilled
    draft shipped. A retrain that breaks a draft, or ships them in another order of quality, fails."""
    _, held = corpus.split_corpus(corpus.stdlib_files())
    alpha = {}
    for draft in ["draft-weak", "draft-small", "draft-distilled", train.FEATURE_HEAD]:
        pair = models.load_pair(models.TINY_TARGET, str(models.BUNDLED / draft))
        steps = [
            s
            for text in held[:4]
            for s in engine.generate(
                pair.target,
                pair.tokenizer,
                pair.tokenizer(text[:800])["input_ids"],
                pair.proposer(),
                spec=SpecConfig(k=4, k_policy="fixed"),
                run=RunConfig(64),
                target_cache=DynamicRollbackCache,
            )
        ]
        alpha[draft] = metrics.summarize(steps)["alpha"]  # pooled over the four openings
    assert alpha[train.FEATURE_HEAD] > 0.85 and alpha["draft-distilled"] > 0.55, alpha
    assert alpha[train.FEATURE_HEAD] > alpha["draft-distilled"] > alpha["draft-small"] > alpha["draft-weak"], alpha
    assert alpha["draft-weak"] < 0.2, alpha


def test_bundled_feature_draft_is_an_eagle1_head_of_the_target():
    from app.drafts.feature_head import is_head_dir

    path = models.BUNDLED / train.FEATURE_HEAD
    assert is_head_dir(path) and json.loads((path / "config.json").read_text())["num_hidden_layers"] == 1
    pair = models.load_pair(models.TINY_TARGET, "feature draft (EAGLE-style, bundled)")
    assert pair.draft.head is not None and pair.draft.head.fc.in_features == 2 * pair.target.config.hidden_size
    info = json.loads((path / "training.json").read_text())
    assert info["reads"] == "target" and info["held_out_top1"] > 0.5, "it must really be trained"


def test_training_command_runs_end_to_end(tmp_path):
    out = tmp_path / "family"
    results = train.main(
        [
            "--out",
            str(out),
            "--max-files",
            "6",
            "--scale",
            "0.002",
            "--ctx",
            "64",
            "--vocab-size",
            "400",
            "--batch",
            "2",
            "--unlikelihood-steps",
            "2",
        ]
    )
    assert set(results) == set(NAMES) | {train.FEATURE_HEAD}
    for name in NAMES:
        model = AutoModelForCausalLM.from_pretrained(out / name)
        assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(out / name))
        info = json.loads((out / name / "training.json").read_text())
        assert info["held_out_loss"] > 0 and info["command"].startswith("python -m app train")
        assert info["corpus"]["python-stdlib"]["tokens"] > 0 and len(info["corpus"]) > 1  # packages too
    target = json.loads((out / "target" / "training.json").read_text())
    phase = target["unlikelihood"]
    assert phase["steps"] == 2 and phase["repeated_share_first"] is not None  # a batch of its own text ran
    assert target["held_out_loss"] == phase["held_out_loss"] and target["corpus_phase"]["held_out_loss"] > 0
    head = json.loads((out / train.FEATURE_HEAD / "training.json").read_text())
    assert head["held_out_top1"] >= 0 and head["reads"] == "target"
    assert head["on_policy_steps"] > 0 and head["on_policy_rows"] > 0  # it also read the target's own text
    pair = models.load_pair(str(out / "target"), str(out / train.FEATURE_HEAD))
    assert pair.draft.head is not None
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    # The target logs two phases (unlikelihood last), the distilled draft two, plus the head.
    assert sum("done" in r for r in log) == len(NAMES) + 3
    assert any("on_policy_rows" in r for r in log)
