"""The static-cache path (the GPU fast path, run eagerly on CPU) gives the target's own greedy output."""

import pytest
from conftest import host_reads, pair_of, run, tiny_llama

from app.drafts.lookup import PromptLookup
from app.drafts.model import ModelProposer
from app.kv import fused_pass
from app.kv.static_cache import BUCKETS, StaticCachePool, StaticRollbackCache, available, cache_length

PROMPT = "def add(a, b):\n  return a"


def static_run(target, tokenizer, proposer, k_policy="fixed", k=4, n=40):
    """One greedy engine run on the static cache."""
    cache = StaticCachePool(cache_length(len(tokenizer(PROMPT)["input_ids"]), n))
    return run(target, tokenizer, PROMPT, proposer, k=k, k_policy=k_policy, max_new_tokens=n, target_cache=cache)


@pytest.mark.parametrize("k_policy,k", [("fixed", 1), ("fixed", 4), ("fixed", 8), ("adaptive", 4)])
def test_static_cache_greedy_equals_dynamic(target, near_draft, tokenizer, k_policy, k):
    ar, _ = run(target, tokenizer, PROMPT, max_new_tokens=40)
    max_len = cache_length(len(tokenizer(PROMPT)["input_ids"]), 40)
    plain, _ = static_run(target, tokenizer, None)
    spec, steps = static_run(
        target, tokenizer, ModelProposer(near_draft, "near", StaticCachePool(max_len)), k_policy, k
    )
    lookup, _ = static_run(target, tokenizer, PromptLookup(3, 1), k_policy, k)
    assert plain == spec == lookup == ar
    assert 0 < sum(s.accepted for s in steps) < sum(len(s.drafted) for s in steps), "needs accepts and rejections"


def test_rollback_moves_the_pointer_and_never_recomputes(target):
    lm = StaticRollbackCache(target, 256)
    first = lm.extend(list(range(3, 23)), keep=1)
    lm.extend([5, 6, 7], keep=3)
    lm.rollback(20)
    assert int(lm.cache.get_seq_length()) == lm.length == 20
    again = lm.extend([5], keep=1)
    assert lm.tokens_processed == 24  # nothing was fed twice
    fresh = StaticRollbackCache(target, 256)
    assert (fresh.extend(list(range(3, 23)) + [5], keep=1) - again).abs().max() < 1e-4
    assert first.shape == again.shape


def test_fast_path_is_graphs_by_default_on_cuda_and_off_elsewhere(target, monkeypatch):
    import torch

    from app.core.config import UserError

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert available("auto", cuda) == ("graphs", "static cache and CUDA graphs of the eager passes")
    assert available("compile", cuda)[0] == "compile"
    assert available("off", cuda)[0] is None and "--fast-path off" in available("off", cuda)[1]
    assert available("auto", cpu)[0] is None and available("graphs", cpu)[0] is None
    assert available("auto", cuda, target)[0] == "graphs"  # a full-attention model
    with pytest.raises(UserError, match="--fast-path takes auto, graphs, compile, off"):
        available("fast", cuda)
    monkeypatch.setenv("SPACES_ZERO_GPU", "1")
    assert "ZeroGPU" in available("auto", cuda)[1]
    assert cache_length(100, 128) % 256 == 0 and cache_length(100, 128) >= 100 + 128 + BUCKETS[-1]


def test_a_sliding_window_model_keeps_the_dynamic_cache_by_default(tokenizer):
    """The default fast path steps aside for a model the static cache cannot hold, rather than failing it."""
    import torch

    from app.kv import static_cache

    windowed = tiny_llama(len(tokenizer))
    windowed.config.layer_types = ["sliding_attention"] * windowed.config.num_hidden_layers
    windowed.config.sliding_window = 16
    kind, note = static_cache.available("auto", torch.device("cuda"), windowed)
    assert kind is None and "full-attention" in note


def test_calibration_fits_a_static_cache_sized_for_a_short_request(tokenizer):
    """A short request's static cache holds less than the calibration's usual context (256 tokens
    for a model with a 1,024-token window): its passes and short runs must fit in it. On CUDA every
    --compile request is calibrated with a cache of its own length."""
    from app import calibrate

    target = tiny_llama(len(tokenizer), ctx=1024)
    pair = pair_of(target, tokenizer, "tiny")
    max_len = cache_length(len(tokenizer(PROMPT)["input_ids"]), 40)
    assert max_len < calibrate.CONTEXT + 9 + BUCKETS[-1]
    heard = []
    costs = calibrate.measure(pair, 8, StaticCachePool(max_len), report=heard.append)
    assert len(costs.verify_s) == 9 and all(t > 0 for t in costs.verify_s)
    assert heard == sorted(heard) and len(heard) > 3 and heard[-1] > 0.85, "its progress, for the UI"
    assert costs.context <= max_len // 2
    assert costs.verify_per_context_s, "the second, longer context must fit in the cache too"


def test_a_padded_pass_leaves_the_pointer_after_its_real_tokens(target, monkeypatch):
    """The compiled path pads a pass to its bucket's width and moves the pointer back over the padding.
    Run here eagerly on CPU (compile's graph capture swapped for the plain forward): a pass of 4 is
    padded to 5, and the cache then holds exactly the real positions, with the next logits a fresh
    forward's."""
    from app.kv import static_cache

    monkeypatch.setattr(static_cache, "compiled", lambda model: model)
    lm = StaticRollbackCache(target, 256, compile=True)
    ids = list(range(3, 13))
    lm.extend(ids[:6])  # a prefill of 6: wider than every bucket but 9, padded to 9
    lm.extend(ids[6:], keep=4)  # 4 tokens, padded to 5
    assert int(lm.cache.get_seq_length()) == lm.length == len(ids)
    after = lm.extend([7], keep=1)
    fresh = StaticRollbackCache(target, 256)
    assert (fresh.extend(ids + [7], keep=1) - after).abs().max() < 1e-4


@pytest.mark.parametrize("compile", [False, True])
def test_a_tree_pass_and_its_kept_path_on_the_static_cache_equal_a_fresh_forward(target, monkeypatch, compile):
    """A tree verified on the static cache (eagerly, and padded to a bucket as the compiled path pads it,
    run here with the plain forward) gives each node its branch's logits, and after a rollback to its
    kept path the cache is the committed text's own, the pointer right after the kept path."""
    from app.kv import static_cache

    monkeypatch.setattr(static_cache, "compiled", lambda model: model)
    ids = list(range(3, 15))
    tokens, parents = [5, 6, 7, 8, 9, 10], [-1, -1, 0, 0, 3, 1]  # node 4 (9) below node 3 (8) below node 0
    lm = StaticRollbackCache(target, 256, compile=compile)
    lm.extend(ids[:-1])
    logits, hidden = lm.extend_with_features(ids[-1:] + tokens, parents=parents)
    assert logits.shape[0] == 7 and hidden.shape[0] == 7
    whole = StaticRollbackCache(target, 256).extend(ids + [5, 8, 9])  # the branch 5 -> 8 -> 9
    for row, at in ((0, len(ids) - 1), (1, len(ids)), (4, len(ids) + 1), (5, len(ids) + 2)):
        assert (logits[row] - whole[at]).abs().max() < 1e-4, row
    lm.rollback(len(ids), path=[0, 3, 4])
    assert int(lm.cache.get_seq_length()) == lm.length == len(ids) + 3
    after = lm.extend([11], keep=1)
    want = StaticRollbackCache(target, 256).extend(ids + [5, 8, 9, 11], keep=1)
    assert (after - want).abs().max() < 1e-4
    assert lm.tokens_processed == len(ids) + len(tokens) + 1, "nothing was fed twice"


def test_greedy_trees_on_the_static_cache_give_the_targets_own_output(target, near_draft, tokenizer):
    """The --compile path's cache verifies trees too: every draft source's greedy tree output is plain decoding's."""
    from app.drafts.lookup import PromptLookup

    ar, _ = run(target, tokenizer, PROMPT, max_new_tokens=40)
    max_len = cache_length(len(tokenizer(PROMPT)["input_ids"]), 40)
    for tree in (8, 32):
        for proposer in (ModelProposer(near_draft, "near", StaticCachePool(max_len)), PromptLookup(3, 1)):
            cache = StaticCachePool(max_len)
            settings = dict(k=4, k_policy="fixed", tree=tree, max_new_tokens=40, target_cache=cache)
            got, steps = run(target, tokenizer, PROMPT, proposer, **settings)
            assert got == ar, (tree, proposer)
        assert any(s.parents and len(s.drafted) > s.k for s in steps), "the run must have verified real trees"


def graphs_run(target, tokenizer, proposer, **settings):
    """One greedy engine run on the CUDA-graph path's static cache, its passes run eagerly on the CPU."""
    cache = StaticCachePool(cache_length(len(tokenizer(PROMPT)["input_ids"]), 40), graphs=True)
    return run(target, tokenizer, PROMPT, proposer, max_new_tokens=40, target_cache=cache, **settings)


@pytest.mark.parametrize("k_policy,k,tree", [("fixed", 1, 0), ("fixed", 4, 0), ("fixed", 8, 0), ("fixed", 4, 8)])
def test_the_graph_path_gives_the_targets_own_greedy_output(target, near_draft, tokenizer, k_policy, k, tree):
    """The graphs' passes (ids, positions and sight in one buffer, the mask built inside the pass, padded
    to a bucket) for the target and a model draft alike: chains of every width and trees equal plain decoding."""
    ar, _ = run(target, tokenizer, PROMPT, max_new_tokens=40)
    max_len = cache_length(len(tokenizer(PROMPT)["input_ids"]), 40)
    draft = ModelProposer(near_draft, "near", StaticCachePool(max_len, graphs=True))
    spec, steps = graphs_run(target, tokenizer, draft, k=k, k_policy=k_policy, tree=tree)
    lookup, _ = graphs_run(target, tokenizer, PromptLookup(3, 1), k=k, k_policy=k_policy, tree=tree)
    assert spec == lookup == ar
    assert 0 < sum(s.accepted for s in steps) < sum(len(s.drafted) for s in steps), "needs accepts and rejections"
    if tree:
        assert any(s.parents and len(s.drafted) > s.k for s in steps), "the run must have verified real trees"


def test_a_chain_and_a_tree_of_one_width_share_one_graph_and_its_numbers(target):
    """One buffer layout serves both: a tree pass and a chain pass of the same bucket go through one
    WidthPass per output kind, and each row's logits equal a fresh forward over its branch."""
    ids = list(range(3, 15))
    lm = StaticRollbackCache(target, 256, graphs=True)
    lm.extend(ids[:-1])
    tree = lm.extend(ids[-1:] + [5, 6, 7, 8], parents=[-1, -1, 0, 2])  # 5 nodes: bucket 5
    passes = dict(lm.pooled.graphs.passes)
    assert (5, False, (), True) in passes  # fused_pass runs the tiny Llama
    lm.rollback(len(ids) - 1)
    chain = lm.extend(ids[-1:] + [5, 7, 8], keep=4)  # 4 tokens: bucket 5 as well
    assert lm.pooled.graphs.passes == passes, "the chain reused the tree's pass of width 5"
    whole = StaticRollbackCache(target, 256).extend(ids + [5, 7, 8])
    for row, at in ((0, len(ids) - 1), (1, len(ids)), (3, len(ids) + 1), (4, len(ids) + 2)):
        assert (tree[row] - whole[at]).abs().max() < 1e-4, row
    assert (chain - whole[len(ids) - 1 :]).abs().max() < 1e-4


def test_a_graph_pass_reads_nothing_back_to_the_host(target):
    """What a CUDA graph cannot hold and a round must not pay: no op in a pass makes the host wait on the
    device (.item(), a data-dependent shape, a comparison read as a bool). The model's own mask builder
    does (its causal-skip test), which is why the graph path builds its mask inside the pass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "masked_select", "unique_dim", "_unique2"}

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in reads:
                self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ids = list(range(3, 23))
    graphs, plain = StaticRollbackCache(target, 256, graphs=True), StaticRollbackCache(target, 256)
    for lm in (graphs, plain):
        lm.extend(ids)
    with HostReads() as on_graphs:
        graphs.extend([5, 6, 7, 8], keep=4)
        graphs.extend([9], keep=1)
        graphs.extend([5, 6, 7], parents=[-1, 0])
    with HostReads() as on_plain:
        plain.extend([5, 6, 7, 8], keep=4)
    assert on_graphs.seen == []
    assert on_plain.seen, "the probe must see the model's own mask builder read a value"


def test_a_first_start_names_the_graphs_captured_while_measuring(target, tokenizer, monkeypatch):
    """The first request of a kind measures this machine, which on CUDA runs each pass width once and so
    captures its graph: the run's note (the CLI prints it) says how many and how long. A CPU captures
    nothing, so the tally is stood in for here; a later request that captures nothing adds nothing."""
    from app import request
    from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig
    from app.kv import cuda_graphs

    pair = pair_of(target, tokenizer, "tiny")
    ids = tokenizer(PROMPT)["input_ids"]
    settings = Settings(SamplingConfig(), SpecConfig(k=4, k_policy="fixed"), RunConfig(8))
    tallies = iter([(3, 0.5), (17, 2.8), (17, 2.8), (17, 2.8)])
    monkeypatch.setattr(cuda_graphs, "captures", lambda: next(tallies))
    caches = StaticCachePool(cache_length(len(ids), 8), graphs=True)
    first = request.start(pair, ids, settings, measured=None, caches=caches)
    assert first.note.endswith("; 14 CUDA graphs captured in 2.3 s while measuring")
    again = request.start(pair, ids, settings, caches=caches)
    assert "captured" not in again.note


def test_the_servers_fast_path_setting_is_every_requests_default(monkeypatch):
    """app.py --fast-path (SPECDEC_FAST_PATH) is the off switch for the page, whose requests name none."""
    import torch

    from app.kv import static_cache

    cuda = torch.device("cuda")
    assert static_cache.default_mode() == "auto"
    monkeypatch.setenv(static_cache.FAST_PATH_ENV, "off")
    assert static_cache.available(static_cache.default_mode(), cuda)[0] is None
    monkeypatch.setenv(static_cache.FAST_PATH_ENV, "Compile ")
    assert static_cache.available(static_cache.default_mode(), cuda)[0] == "compile"


def test_a_greedy_round_on_the_fast_path_reads_the_host_once(target, near_draft, tokenizer):
    """Each read of a device value to the host waits for the GPU: a round makes one, the verdict's.
    The draft's picks feed its next step on the device, go to the target's pass there, and come back
    with the verdict in the same read; the output stays plain decoding's, on the graphs' cache and on
    the static cache's plain passes alike."""
    ar, _ = run(target, tokenizer, PROMPT, max_new_tokens=40)
    max_len = cache_length(len(tokenizer(PROMPT)["input_ids"]), 40)
    for graphs in (True, False):
        pool = StaticCachePool(max_len, graphs=graphs)
        out, per_round = host_reads(target, tokenizer, PROMPT, ModelProposer(near_draft, "near", pool), pool, 40)
        assert out == ar
        drafting = [reads for drafts, reads in per_round if drafts]
        assert len(drafting) >= 5 and all(r == ["tolist"] for r in drafting), per_round
        # The same drafts as when each pick is read as it is made (more reads: one a step).
        _, read_each = host_reads(
            target, tokenizer, PROMPT, ModelProposer(near_draft, "near", pool), pool, 40, on_device=False
        )
        assert [d for d, _ in per_round] == [d for d, _ in read_each]
        assert sum(len(r) for _, r in read_each) > sum(len(r) for _, r in per_round)


def test_a_greedy_tree_round_on_the_fast_path_reads_the_host_once(target, near_draft, tokenizer):
    """A greedy tree (the chain and its siblings) stays on the device too: each depth's siblings are the
    next best tokens of the pick's own row, taken there, and the target's pass takes every node there;
    the verdict reads them all in its one read. The same trees as when every pick and sibling is read
    as it is made, and the output is plain decoding's."""
    ar, _ = run(target, tokenizer, PROMPT, max_new_tokens=40)
    pool = StaticCachePool(cache_length(len(tokenizer(PROMPT)["input_ids"]), 40), graphs=True)
    out, per_round = host_reads(target, tokenizer, PROMPT, ModelProposer(near_draft, "near", pool), pool, 40, tree=8)
    assert out == ar
    drafting = [(drafts, reads) for drafts, reads in per_round if drafts]
    assert len(drafting) >= 5 and all(len(d) == 8 and r == ["tolist"] for d, r in drafting), per_round
    _, read_each = host_reads(
        target, tokenizer, PROMPT, ModelProposer(near_draft, "near", pool), pool, 40, on_device=False, tree=8
    )
    assert [d for d, _ in per_round] == [d for d, _ in read_each]
    assert sum(len(r) for _, r in read_each) > sum(len(r) for _, r in per_round)


def test_a_shared_noise_round_on_the_fast_path_reads_the_host_once(target, near_draft, tokenizer):
    """Shared noise races each pick against noise keyed by its position alone, so a sampled chain's
    picks stay on the device too: one read a round, the same drafts as reading each pick, and the
    output is plain sampling's with the same seed."""
    from app.core.config import SHARED_NOISE, SamplingConfig

    cfg = SamplingConfig(temperature=0.8, seed=11, rule=SHARED_NOISE)
    plain, _ = run(target, tokenizer, PROMPT, max_new_tokens=40, temperature=0.8, seed=11, rule=SHARED_NOISE)
    pool = StaticCachePool(cache_length(len(tokenizer(PROMPT)["input_ids"]), 40), graphs=True)
    out, per_round = host_reads(target, tokenizer, PROMPT, ModelProposer(near_draft, "near", pool), pool, 40, True, cfg)
    assert out == plain
    drafting = [reads for drafts, reads in per_round if drafts]
    assert len(drafting) >= 5 and all(r == ["tolist"] for r in drafting), per_round
    _, read_each = host_reads(target, tokenizer, PROMPT, ModelProposer(near_draft, "near", pool), pool, 40, False, cfg)
    assert [d for d, _ in per_round] == [d for d, _ in read_each]
    assert sum(len(r) for _, r in read_each) > sum(len(r) for _, r in per_round)


def test_a_drawn_round_on_the_fast_path_reads_the_host_once(target, near_draft, tokenizer):
    """Rejection sampling's draws, the draft's and the verdict's, are made on the device from the run's
    generator there: a drafting round reads the host once. (Its distribution: test_sampling.py.)"""
    from app.core.config import SamplingConfig

    cfg = SamplingConfig(temperature=0.8, seed=11)
    pool = StaticCachePool(cache_length(len(tokenizer(PROMPT)["input_ids"]), 40), graphs=True)
    out, per_round = host_reads(target, tokenizer, PROMPT, ModelProposer(near_draft, "near", pool), pool, 40, True, cfg)
    drafting = [reads for drafts, reads in per_round if drafts]
    assert len(out) == 40 and len(drafting) >= 5 and all(r == ["tolist"] for r in drafting), per_round
    _, read_each = host_reads(target, tokenizer, PROMPT, ModelProposer(near_draft, "near", pool), pool, 40, False, cfg)
    assert all(len(r) > 1 for d, r in read_each if d), "read as drawn, each draw is a read"


def test_fixed_width_passes_read_every_row_from_a_pass_of_that_width(target, tokenizer, monkeypatch):
    """With a fixed width, every pass whose logits a run reads is exactly that wide: the prompt's
    pass ends in one (its earlier tokens only fill the cache), a step and a verify are padded to it,
    and a tree after the prompt too. The logits are a plain static cache's (within rounding)."""
    from app.kv import cuda_graphs

    widths = []
    call = cuda_graphs.WidthPass.__call__

    def spy(self, *args, **kwargs):
        widths.append(self.width)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(cuda_graphs.WidthPass, "__call__", spy)
    ids = list(range(3, 43))
    fixed, plain = StaticRollbackCache(target, 256, graphs=True, width=16), StaticRollbackCache(target, 256)
    got = [fixed.extend(ids[:30], keep=1), fixed.extend(ids[30:35], keep=5)]
    got.append(fixed.extend(ids[35:36] + [5, 6, 7], parents=[-1, 0, 0]))
    fixed.rollback(36)
    got.append(fixed.step(9))
    want = [plain.extend(ids[:30], keep=1), plain.extend(ids[30:35], keep=5)]
    want.append(plain.extend(ids[35:36] + [5, 6, 7], parents=[-1, 0, 0]))
    plain.rollback(36)
    want.append(plain.step(9))
    assert widths[-4:] == [16, 16, 16, 16], widths  # the prompt's last token, the verify, the tree, the step
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4
    assert fixed.length == plain.length == 37


@pytest.mark.parametrize("k", [4, 8])
def test_where_fixed_width_rows_are_exact_speculative_output_is_plain_decodings(target, near_draft, tokenizer, k):
    """The exact choice on the fast path for a float precision: every round's pass one width, so a row's
    logits are the same bits in a plain step and inside a verify pass wherever rows_exact holds (as it
    did in fp32 on the CPUs this was written on: a float product's row depends on the matrix shape,
    not on where the row sits). Then greedy speculative output is plain decoding's, bit for bit."""
    from app.kv import static_cache

    width = static_cache.fixed_width(k + 1)
    if not static_cache.rows_exact(target, width):
        pytest.skip(f"this CPU's fp32 rows of {width}-token passes differ by where they sit")
    max_len = cache_length(len(tokenizer(PROMPT)["input_ids"]), 40)
    pool = StaticCachePool(max_len, graphs=True, width=width)
    plain, _ = run(target, tokenizer, PROMPT, max_new_tokens=40, target_cache=pool)
    draft = ModelProposer(near_draft, "near", StaticCachePool(max_len, graphs=True))
    spec, steps = run(target, tokenizer, PROMPT, draft, k=k, k_policy="fixed", max_new_tokens=40, target_cache=pool)
    assert spec == plain
    assert any(s.rejected for s in steps)


def test_on_the_fast_path_a_request_takes_a_fixed_width_where_the_probe_finds_it_exact(target, tokenizer, monkeypatch):
    """runs.prepare on the graphs (stood in for CUDA here): the target's pool gets the one width its
    settings' widest pass needs, if the probe finds its rows exact, and says so; a draft's pool keeps
    the bucket widths."""
    from app import runs
    from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig
    from app.kv import static_cache

    monkeypatch.setattr(static_cache, "available", lambda mode, device, model=None: ("graphs", "graphs"))
    pair = pair_of(target, tokenizer, "tiny")
    ids = tokenizer(PROMPT)["input_ids"]
    for exact in (True, False):
        monkeypatch.setattr(static_cache, "rows_exact", lambda model, width, max_len, exact=exact: exact)
        settings = Settings(SamplingConfig(), SpecConfig(k=12, k_policy="fixed"), RunConfig(8))
        got = runs.prepare(pair, ids, settings)
        assert got.target_cache.width == (16 if exact else None)
        assert ("same bits wherever they sit (probed)" in got.note) == exact
        assert got.draft_cache is not None
        draft_side = got.draft_cache(target)
        assert draft_side.width is None and draft_side.graphs
        draft_side.close()
    # A tree's ancestors sit apart in its pass: no claim of exact rows for trees.
    tree = runs.prepare(pair, ids, Settings(SamplingConfig(), SpecConfig(k=4, k_policy="fixed", tree=12), RunConfig(8)))
    assert tree.target_cache.width is None and "probed" not in tree.note
    assert static_cache.widest_pass(SpecConfig(k_policy="adaptive", k_max=8)) == 9
    assert static_cache.fixed_width(9) == 16 and static_cache.fixed_width(16) == 16


def test_a_long_pass_at_a_fixed_width_is_two_passes_not_one_a_token(target):
    """A prompt longer than the fixed width fills the cache in one pass, then reads its last rows from a
    pass of the width: two model calls, whatever the prompt's length."""
    calls = []
    forward, fused = target.forward, fused_pass.FusedPass.__call__

    def counted(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    def counted_fused(self, input_ids, *args, **kwargs):
        calls.append(input_ids.shape[1])
        return fused(self, input_ids, *args, **kwargs)

    lm = StaticRollbackCache(target, 512, graphs=True, width=8)
    target.forward = counted
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fused_pass.FusedPass, "__call__", counted_fused)
            lm.extend(list(range(3, 303)), keep=1)
    finally:
        del target.forward
    assert calls == [299, 8] and lm.length == 300  # the prompt's eager pass, then the fixed width's (fused)
    lm.close()


def test_a_pooled_cache_starts_at_slot_zero_whatever_the_last_request_left(target):
    """The pointer of a cache given back is reset on the device when it is taken again: a request that
    failed half-way (its pointer ahead of its own count) leaves nothing behind for the next one."""
    lm = StaticRollbackCache(target, 256, graphs=True)
    lm.extend(list(range(3, 23)))
    import torch

    with torch.inference_mode():  # as the passes do
        for layer in lm.cache.layers:
            layer.cumulative_length += 3  # as if a pass had written and then failed before it was counted
    lm.close()
    again = StaticRollbackCache(target, 256, graphs=True)
    assert int(again.cache.get_seq_length()) == again.length == 0
    fresh = StaticRollbackCache(target, 256)
    assert (again.extend(list(range(3, 13)), keep=1) - fresh.extend(list(range(3, 13)), keep=1)).abs().max() < 1e-5
    again.close()
    fresh.close()


def test_the_pools_do_not_keep_a_model_alive(tokenizer):
    """The loader drops the oldest model; its pooled caches and graphs must not keep its weights."""
    import gc
    import weakref

    model = tiny_llama(len(tokenizer))
    lm = StaticRollbackCache(model, 256, graphs=True)
    lm.extend(list(range(3, 13)), keep=1)
    lm.close()
    gone = weakref.ref(model)
    del model, lm
    gc.collect()
    assert gone() is None


def test_a_pass_whose_graph_cannot_be_captured_runs_eagerly_with_one_log_line(target, tokenizer, monkeypatch, caplog):
    """Where a model's pass cannot be held in a CUDA graph, the request still runs: the warm-up was its
    pass, the width then runs eagerly on the same buffers, and the log gets one line, no traceback.
    (The GPU's side is stood in for: this machine has none.)"""
    import logging

    import torch

    from app.kv import cuda_graphs

    init = cuda_graphs.WidthPass.__init__

    def on_a_gpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.cuda = True

    def warm_up(self):
        logits, features = self._pass()
        return (logits.clone(), features), None

    def record(self, side):
        raise RuntimeError("operation not permitted when stream is capturing\\nmore")

    monkeypatch.setattr(cuda_graphs.WidthPass, "__init__", on_a_gpu)
    monkeypatch.setattr(cuda_graphs.WidthPass, "_warm_up", warm_up)
    monkeypatch.setattr(cuda_graphs.WidthPass, "_record", record)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(cuda_graphs, "_said", False)
    ar, _ = run(target, tokenizer, PROMPT, max_new_tokens=40)
    max_len = cache_length(len(tokenizer(PROMPT)["input_ids"]), 40) + 256  # caches of their own
    with caplog.at_level(logging.WARNING, logger="app.kv.cuda_graphs"):
        draft = ModelProposer(tiny_llama(len(tokenizer)), "near", StaticCachePool(max_len, graphs=True))
        spec, _ = run(
            target,
            tokenizer,
            PROMPT,
            draft,
            k=4,
            k_policy="fixed",
            max_new_tokens=40,
            target_cache=StaticCachePool(max_len, graphs=True),
        )
    assert spec == ar
    lines = [r for r in caplog.records if r.name == "app.kv.cuda_graphs"]
    assert len(lines) == 1 and "runs eagerly" in lines[0].getMessage() and lines[0].exc_info is None
