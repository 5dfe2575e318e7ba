"""One contract, every KV cache: the dynamic cache (direct passes where they apply, the model's own
forward elsewhere) and the static cache run the same checks, so they cannot drift apart again."""

import pytest
import torch
from conftest import run, tiny_llama

from app.core.config import RunConfig, SamplingConfig, SpecConfig
from app.core.engine import generate
from app.drafts.model import ModelProposer
from app.kv.cache import DynamicRollbackCache, RollbackCache
from app.kv.static_cache import StaticCachePool, StaticRollbackCache, _pool

# "graphs": the CUDA-graph path's buffers and in-pass mask, run eagerly on a CPU.
KINDS = {"dynamic": DynamicRollbackCache, "static": StaticCachePool(256), "graphs": StaticCachePool(256, graphs=True)}
IDS = list(range(3, 23))


@pytest.fixture(params=list(KINDS))
def factory(request):
    return KINDS[request.param]


def test_every_cache_is_a_model_cache(target, factory):
    lm = factory(target)
    assert isinstance(lm, RollbackCache)
    for name in ("extend", "extend_with_features", "step", "rollback", "close"):
        assert callable(getattr(lm, name))
    lm.close()


def test_rollback_equals_a_fresh_forward(target, factory):
    lm = factory(target)
    lm.extend(IDS, keep=1)
    lm.extend([5, 6, 7, 8], keep=4)
    lm.rollback(len(IDS) + 1)
    assert lm.length == len(IDS) + 1
    again = lm.extend([9], keep=1)
    assert lm.tokens_processed == len(IDS) + 4 + 1  # nothing was fed twice
    fresh = factory(target)
    want = fresh.extend(IDS + [5, 9], keep=1)
    assert (again - want).abs().max() < 1e-4
    lm.close(), fresh.close()


def test_step_equals_extend_by_one(target, factory):
    a, b = factory(target), factory(target)
    a.extend(IDS, keep=1)
    b.extend(IDS, keep=1)
    assert (a.step(7) - b.extend([7], keep=1)[-1]).abs().max() < 1e-4
    assert a.length == b.length == len(IDS) + 1
    a.close(), b.close()


def test_features_are_the_last_hidden_states(target, factory):
    lm = factory(target)
    logits, features = lm.extend_with_features(IDS, keep=2)
    assert logits.shape[0] == 2 and features.shape == (len(IDS), target.config.hidden_size)
    with torch.inference_mode():
        again = target.get_output_embeddings()(features[-2:])
    assert (again - logits).abs().max() < 1e-4  # post-norm: what the LM head reads
    lm.close()


def test_ids_beyond_the_embedding_table_get_a_stand_in(tokenizer, factory):
    """A draft with fewer embedding rows than the target's vocabulary is fed a stand-in id, never an
    IndexError; the static path once lacked this."""
    small = tiny_llama(20, layers=1, hidden=32, seed=3)
    lm = factory(small)
    out = lm.extend([3, 25, 40, 7], keep=1)
    assert out.shape == (1, 20) and torch.isfinite(out).all()
    lm.close()


def test_static_draft_with_a_smaller_vocabulary_stays_lossless(target, tokenizer):
    """The engine on static caches for both models, the draft's table smaller than the target's ids."""
    prompt = "def add(a, b):\n  return a"
    want, _ = run(target, tokenizer, prompt, max_new_tokens=24)
    small = tiny_llama(len(tokenizer) - 15, layers=1, hidden=32, seed=2, scale=30.0)
    ids = tokenizer(prompt)["input_ids"]
    assert max(ids) >= len(tokenizer) - 15, "the prompt must hold ids the smaller draft cannot embed"
    caches = StaticCachePool(256)
    steps = list(
        generate(
            target,
            tokenizer,
            ids,
            ModelProposer(small, "small", caches),
            target_cache=caches,
            sampling_cfg=SamplingConfig(),
            spec=SpecConfig(k=4, k_policy="fixed"),
            run=RunConfig(24),
        )
    )
    assert [t for s in steps for t in s.emitted] == want


def test_a_static_cache_goes_back_to_its_pool_when_the_run_ends(target, tokenizer):
    """Pooling is explicit (close at the end of a run), not left to the garbage collector."""
    before = _pool.free(target, 256)
    lm = StaticRollbackCache(target, 256)
    taken = _pool.free(target, 256)
    lm.close()
    lm.close()  # twice is harmless
    assert _pool.free(target, 256) == max(before, taken + 1) and lm.cache is None


def test_a_regrown_growing_cache_keeps_every_position(tokenizer):
    """Growing layers with room for two positions regrow on nearly every pass; after each regrowth the
    keys and values held are exactly those fed, the newest included."""
    from app.kv.growing_cache import GrowingLayer

    layer, keys, values = GrowingLayer(room=2), [], []
    g = torch.Generator().manual_seed(0)
    for width in (3, 1, 2, 1, 4, 1):
        k, v = torch.randn(1, 2, width, 8, generator=g), torch.randn(1, 2, width, 8, generator=g)
        keys.append(k), values.append(v)
        held_k, held_v = layer.update(k, v)
        assert torch.equal(held_k, torch.cat(keys, dim=-2)) and torch.equal(held_v, torch.cat(values, dim=-2))


def test_a_growing_layer_reads_as_the_positions_it_holds_after_in_place_writes_and_crops():
    """A pass that writes the buffers itself then calls hold, and a rollback crops: keys, values and the
    length read afterwards are those positions, however many times the length moved between reads."""
    from app.kv.growing_cache import GrowingLayer

    layer = GrowingLayer(room=8)
    fed = torch.arange(2 * 3 * 8, dtype=torch.float32).view(1, 2, 3, 8)
    layer.update(fed, -fed)
    k, v, start = layer.room_for(4)
    k[..., start : start + 4, :] = 7.0  # what the int8 kernel's stack writes
    v[..., start : start + 4, :] = -7.0
    layer.hold(start + 4)
    layer.crop(-1)
    layer.crop(-2)
    assert layer.get_seq_length() == 4
    assert torch.equal(layer.keys, torch.cat([fed, torch.full((1, 2, 1, 8), 7.0)], dim=-2))
    assert torch.equal(layer.values, -layer.keys)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys is None
