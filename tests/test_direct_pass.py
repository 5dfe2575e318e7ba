"""Direct passes give the bits of the model's own forward, and only models they suit are admitted."""

import pytest
import torch
from test_architectures import CONFIGS, WINDOW, build
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from app.kv import direct_pass
from app.kv.cache import DynamicRollbackCache
from app.kv.growing_cache import ROOM, GrowingLayer
from app.models import TINY_TARGET, load

CONTEXT = list(range(20, 60))


def _twins(model):
    """A cache that runs direct passes, and one that runs the model's own forward."""
    direct, own = DynamicRollbackCache(model), DynamicRollbackCache(model)
    own.direct, own.cache = None, DynamicCache(config=model.config)  # transformers' own cache, too
    assert direct.direct is not None and isinstance(direct.cache.layers[0], GrowingLayer)
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
    target, tokenizer = load(TINY_TARGET)
    _same_passes(target, tokenizer("def walk(root):\n    for path in os.listdir(root):\n")["input_ids"])


def test_a_cache_that_outgrows_its_room_still_gives_the_forwards_bits():
    """Rounds of verify-then-rollback on the bundled target until its growing cache reallocates."""
    target, _ = load(TINY_TARGET)
    direct, own = _twins(target)
    context = [(3 * i) % 4000 + 5 for i in range(100)]
    assert torch.equal(direct.extend(context, keep=1), own.extend(context, keep=1))
    room = direct.cache.layers[0]._k.shape[-2]
    while direct.length < room + 20:
        base, ids = direct.length, [(direct.length * 11 + i) % 4000 + 5 for i in range(9)]
        a, fa = direct.extend_with_features(ids, keep=9)
        b, fb = own.extend_with_features(ids, keep=9)
        assert torch.equal(a, b) and torch.equal(fa, fb), direct.length
        direct.rollback(base + 5), own.rollback(base + 5)
    assert direct.cache.layers[0]._k.shape[-2] > room  # it did regrow, and kept what it held
    assert torch.equal(direct.step(77), own.step(77))


def test_a_growing_layer_holds_what_a_dynamic_layer_holds():
    grow, dyn = GrowingLayer(), DynamicLayer()
    g = torch.Generator().manual_seed(0)
    for n, crop in ((5, 0), (3, -2), (ROOM, -1), (1, 0), (ROOM + 7, -30)):
        k, v = torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)
        out_g, out_d = grow.update(k, v), dyn.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(out_g, out_d, strict=True))
        grow.crop(crop), dyn.crop(crop)
        assert grow.get_seq_length() == dyn.get_seq_length()
        assert torch.equal(grow.keys, dyn.keys) and torch.equal(grow.values, dyn.values)
    with pytest.raises(ValueError):
        grow.crop(3)  # DynamicLayer's convention: a positive count is refused
    grow.crop(-10_000), dyn.crop(-10_000)  # more than it holds: nothing is left
    assert grow.get_seq_length() == dyn.get_seq_length() == 0
    grow.reset()
    k = torch.randn(1, 2, 3, 4, generator=g)
    assert torch.equal(grow.update(k, k)[0], k) and grow.get_seq_length() == 3  # fresh after a reset
    empty = GrowingLayer()
    empty.crop(-1)  # nothing held yet (transformers may initialise a layer without a pass): a no-op
    empty.lazy_initialization(k, k)
    empty.crop(-1)
    assert empty.get_seq_length() == 0


@pytest.mark.parametrize("arch", ["gpt2", "gemma2", "phi3"])
def test_other_families_keep_their_own_forward(arch):
    assert direct_pass.parts(build(arch, 300, seed=1)) is None


def test_a_sliding_window_keeps_the_forward_that_builds_its_mask():
    assert CONFIGS["mistral"]().sliding_window == WINDOW
    assert direct_pass.parts(build("mistral", 300, seed=1)) is None


def test_the_probe_reads_buffers_that_have_regrown(monkeypatch):
    """Admission covers a cache past its first allocation, not only the first few positions."""
    regrown = []
    real = GrowingLayer._grown

    def counting(old, new, held, size):
        regrown.append(old is not None)
        return real(old, new, held, size)

    monkeypatch.setattr(GrowingLayer, "_grown", staticmethod(counting))
    assert direct_pass.parts(build("llama", 300, seed=3)) is not None
    assert any(regrown)


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
    assert DynamicRollbackCache(model).direct is None


def test_fused_features_equal_the_models_hidden_states_entering_eagle3s_layers():
    """EAGLE-3's fused features come out of the target's own pass (direct, wrapper, static cache and a
    tree pass): the states entering layers 2, L/2 and L - 3, as `output_hidden_states` gives them."""
    from app.core.decoder_layers import fused_layers
    from app.kv.static_cache import StaticRollbackCache

    target, tokenizer = load(TINY_TARGET)
    layers = fused_layers(target.config.num_hidden_layers)
    assert layers == (2, 4, 5)  # the tiny target has 8 layers
    context = tokenizer("def walk(root):\n    for path in os.listdir(root):\n")["input_ids"]
    more = [(7 * i) % 250 + 5 for i in range(5)]
    own = DynamicCache(config=target.config)
    with torch.inference_mode():
        states = [
            target(input_ids=torch.tensor([ids]), cache=own, output_hidden_states=True).hidden_states
            for ids in (context, more)
        ]
    want = [torch.cat([s[i][0] for i in layers], -1) for s in states]
    direct, wrapped = DynamicRollbackCache(target, layers), DynamicRollbackCache(target, layers)
    wrapped.direct, wrapped.cache = None, DynamicCache(config=target.config)
    static = StaticRollbackCache(target, 128, feature_layers=layers)
    for lm in (direct, wrapped, static):
        for ids, expected in zip((context, more), want, strict=True):
            _, fused = lm.extend_with_features(ids, keep=1)
            assert fused.shape == (len(ids), 3 * target.config.hidden_size)
            # A static cache attends over its whole padded length, another sum order than a dynamic one's.
            torch.testing.assert_close(fused, expected, rtol=0, atol=0 if lm is not static else 1e-4)
    # A tree pass whose nodes form a chain is the same pass: its features are the chain's.
    tree = DynamicRollbackCache(target, layers)
    tree.extend(context[:-1])
    with torch.inference_mode():  # the masked tree pass itself, which extend keeps for branching trees
        _, fused = tree._tree_forward(context[-1:], more, list(range(-1, len(more) - 1)), True)
    chain = DynamicRollbackCache(target, layers)
    chain.extend(context[:-1])
    assert torch.equal(fused, chain.extend_with_features(context[-1:] + more)[1])
    assert direct.direct is not None  # the bundled target runs direct passes
