"""A draft's direct one-token step equals its own forward, and only models it suits are admitted."""

import pytest
import torch
from test_architectures import CONFIGS, WINDOW, build

from app import fast_step
from app.cache import CachedModel

CONTEXT = list(range(20, 60))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_direct_step_equals_the_models_forward_and_rolls_back(arch):
    model = build(arch, 300, seed=1)
    assert fast_step.parts(model) is not None
    fast, plain = CachedModel(model, fast_step=True), CachedModel(model)
    fast.extend(CONTEXT, keep=1), plain.extend(CONTEXT, keep=1)
    for token in (5, 77, 123):
        a, b = fast.step(token), plain.extend([token], keep=1)[-1]
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert fast.length == plain.length == len(CONTEXT) + 3 == fast.cache.get_seq_length()
    fast.rollback(len(CONTEXT) + 1), plain.rollback(len(CONTEXT) + 1)
    assert torch.allclose(fast.step(9), plain.extend([9], keep=1)[-1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "gemma2", "phi3"])
def test_other_families_keep_their_own_forward(arch):
    assert fast_step.parts(build(arch, 300, seed=1)) is None


def test_a_sliding_window_keeps_the_forward_that_builds_its_mask():
    assert CONFIGS["mistral"]().sliding_window == WINDOW
    assert fast_step.parts(build("mistral", 300, seed=1)) is None


def test_a_model_whose_probe_disagrees_is_not_admitted(monkeypatch):
    model = build("llama", 300, seed=2)
    real = fast_step.step
    monkeypatch.setattr(fast_step, "step", lambda p, cache, token: real(p, cache, token) + 1.0)
    assert fast_step.parts(model) is None
    monkeypatch.setattr(fast_step, "step", real)
    assert fast_step.parts(model) is None  # decided once per model
    assert CachedModel(model, fast_step=True).fast is None
