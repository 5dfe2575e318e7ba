"""Direct passes give the bits of the model's own forward, and only models they suit are admitted."""

import pytest
import torch
from test_architectures import CONFIGS, WINDOW, build

from app import direct_pass
from app.cache import CachedModel
from app.models import DEFAULT_TARGET, load

CONTEXT = list(range(20, 60))


def _twins(model):
    """A cache that runs direct passes, and one that runs the model's own forward."""
    direct, own = CachedModel(model), CachedModel(model)
    own.direct = None
    assert direct.direct is not None
    return direct, own


def _same_passes(model, context, widths=(1, 2, 5, 9)):
    direct, own = _twins(model)
    assert torch.equal(direct.extend(context, keep=1), own.extend(context, keep=1))
    for n in widths:  # a verify pass over n tokens, then rolled back, as in a round
        ids = [(7 * n + i) % 250 for i in range(n)]
        a, fa = direct.extend_with_features(ids, keep=n)
        b, fb = own.extend_with_features(ids, keep=n)
        assert torch.equal(a, b) and torch.equal(fa, fb)
        direct.rollback(len(context) + 1), own.rollback(len(context) + 1)
        assert direct.length == own.length == len(context) + 1 == direct.cache.get_seq_length()
    for token in (5, 77, 123):  # draft steps
        assert torch.equal(direct.step(token), own.step(token))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_direct_passes_equal_the_models_forward_bit_for_bit_and_roll_back(arch):
    _same_passes(build(arch, 300, seed=1), CONTEXT)


def test_the_bundled_targets_direct_passes_equal_its_forward_bit_for_bit():
    target, tokenizer = load(DEFAULT_TARGET)
    _same_passes(target, tokenizer("def walk(root):\n    for path in os.listdir(root):\n")["input_ids"])


@pytest.mark.parametrize("arch", ["gpt2", "gemma2", "phi3"])
def test_other_families_keep_their_own_forward(arch):
    assert direct_pass.parts(build(arch, 300, seed=1)) is None


def test_a_sliding_window_keeps_the_forward_that_builds_its_mask():
    assert CONFIGS["mistral"]().sliding_window == WINDOW
    assert direct_pass.parts(build("mistral", 300, seed=1)) is None


def test_a_model_whose_probe_differs_in_the_last_bit_is_not_admitted(monkeypatch):
    model = build("llama", 300, seed=2)
    real = direct_pass.forward

    def off(p, cache, ids, keep=0, features=False):
        logits, hidden = real(p, cache, ids, keep, features)
        return torch.nextafter(logits, logits + 1), hidden  # one ulp: still "close", not the same bits

    monkeypatch.setattr(direct_pass, "forward", off)
    assert direct_pass.parts(model) is None
    monkeypatch.setattr(direct_pass, "forward", real)
    assert direct_pass.parts(model) is None  # decided once per model
    assert CachedModel(model).direct is None
