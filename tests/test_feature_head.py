"""The feature-level (EAGLE-style) draft: lossless, fed the target's true features, Hub layout."""

import json

import pytest
import torch
from conftest import hf_greedy_until_eos as hf_greedy
from conftest import host_reads, run
from safetensors.torch import save_file
from test_sampling import N, exact_distribution, tv, tv_bound
from transformers import DynamicCache

from app import models
from app.core.config import SamplingConfig, UserError
from app.drafts.feature import FeatureProposer
from app.drafts.feature_head import FeatureHead, is_head_dir, load_head
from app.training import train

PROMPTS = ["def add(a, b):\n  return a", "the cat sat on the mat. the cat"]


def random_windows(vocab: int, batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(3, vocab, (batch, length + 1), generator=g)


@pytest.fixture(scope="module")
def head(target, tokenizer):
    """A head trained for a few seconds on the tiny target: right often, wrong often."""
    torch.manual_seed(0)
    h, _ = train.train_feature_head(target, random_windows(len(tokenizer), 8, 48), steps=120, lr=5e-3)
    return h


@pytest.mark.parametrize("k,policy", [(1, "fixed"), (4, "fixed"), (8, "fixed"), (4, "adaptive")])
def test_greedy_equals_generate(target, tokenizer, head, no_eos, k, policy):
    accepted = rejected = 0
    for prompt in PROMPTS:
        spec, steps = run(
            target, tokenizer, prompt, FeatureProposer(target, head), k=k, k_policy=policy, max_new_tokens=40
        )
        assert spec == hf_greedy(target, tokenizer, prompt, 40)
        accepted += sum(s.accepted for s in steps)
        rejected += sum(len(s.rejected) > 0 for s in steps)
    assert accepted > 0 and rejected > 0, "the head must be sometimes right and sometimes wrong to bite"


def test_greedy_on_the_static_cache_equals_generate(target, tokenizer, head, no_eos):
    """The GPU fast path's target cache also hands the head its features (run eagerly here)."""
    from app.kv.static_cache import StaticCachePool, cache_length

    for prompt in PROMPTS:
        cache = StaticCachePool(cache_length(len(tokenizer(prompt)["input_ids"]), 40))
        spec, steps = run(
            target,
            tokenizer,
            prompt,
            FeatureProposer(target, head),
            k=4,
            k_policy="fixed",
            max_new_tokens=40,
            target_cache=cache,
        )
        assert spec == hf_greedy(target, tokenizer, prompt, 40)
        assert sum(s.accepted for s in steps) > 0


def test_a_greedy_head_round_on_the_fast_path_reads_the_host_once(target, tokenizer, head, no_eos):
    """The head's picks feed its next step on the device and reach the target's pass there (with the
    features it hands back): the round's one read is the verdict's, and the output is generate()'s."""
    from app.kv.static_cache import StaticCachePool, cache_length

    for prompt in PROMPTS:
        pool = StaticCachePool(cache_length(len(tokenizer(prompt)["input_ids"]), 40), graphs=True)
        graphed = FeatureProposer(target, head)
        graphed.static_len = pool.max_len  # the head's own passes as graphs, as runs.py sets it
        out, per_round = host_reads(target, tokenizer, prompt, graphed, pool, 40)
        assert out == hf_greedy(target, tokenizer, prompt, 40)
        drafting = [reads for drafts, reads in per_round if drafts]
        assert len(drafting) >= 4 and all(r == ["tolist"] for r in drafting), per_round
        # The same drafts as when each pick is read as it is made.
        _, read_each = host_reads(target, tokenizer, prompt, FeatureProposer(target, head), pool, 40, on_device=False)
        assert [d for d, _ in per_round] == [d for d, _ in read_each]


def test_a_greedy_head_tree_on_the_fast_path_reads_the_host_once_a_depth(target, tokenizer, head, no_eos):
    """EAGLE-2's tree takes its next depth's shape from each depth's best offers, so the host reads
    them: one read a depth (offers and ids together; the masks and ids of the head's passes go by
    queued copies), then the verdict's. The output is generate()'s."""
    from app.kv.static_cache import StaticCachePool, cache_length

    prompt = PROMPTS[0]
    pool = StaticCachePool(cache_length(len(tokenizer(prompt)["input_ids"]), 40), graphs=True)
    graphed = FeatureProposer(target, head)
    graphed.static_len = pool.max_len
    vocab = torch.arange(0, len(tokenizer), 2)  # a draft vocabulary (every other id): the batched depths
    graphed.use_vocab(vocab, target.get_output_embeddings().weight[vocab])
    out, per_round = host_reads(target, tokenizer, prompt, graphed, pool, 40, tree=8)
    assert out == hf_greedy(target, tokenizer, prompt, 40)
    drafting = [reads for drafts, reads in per_round if drafts]
    # k = 4 depths read, then the verdict (a round near the end drafts fewer depths)
    assert all(set(r) == {"tolist"} and len(r) <= 5 for r in drafting), per_round
    assert sum(len(r) == 5 for r in drafting) >= 4, per_round


def test_a_shared_noise_head_round_on_the_fast_path_reads_the_host_once(target, tokenizer, head, no_eos):
    """A sampled chain under shared noise: the head's races stay on the device until the verdict, the
    drafts are those read pick by pick, and the text is plain sampling's with the same seed."""
    from app.core.config import SHARED_NOISE, SamplingConfig
    from app.kv.static_cache import StaticCachePool, cache_length

    prompt = PROMPTS[0]
    cfg = SamplingConfig(temperature=0.7, seed=3, rule=SHARED_NOISE)
    plain, _ = run(target, tokenizer, prompt, max_new_tokens=40, temperature=0.7, seed=3, rule=SHARED_NOISE)
    pool = StaticCachePool(cache_length(len(tokenizer(prompt)["input_ids"]), 40), graphs=True)
    graphed = FeatureProposer(target, head)
    graphed.static_len = pool.max_len
    chains, on_device = [], graphed._chain_on_device
    graphed._chain_on_device = lambda *a: chains.append(a[1]) or on_device(*a)  # type: ignore[method-assign]
    out, per_round = host_reads(target, tokenizer, prompt, graphed, pool, 40, True, cfg)
    assert out == plain
    drafting = [reads for drafts, reads in per_round if drafts]
    assert len(drafting) >= 4 and all(r == ["tolist"] for r in drafting), per_round
    assert len(chains) == len(drafting), "every drafting round's picks stayed on the device"
    _, read_each = host_reads(target, tokenizer, prompt, FeatureProposer(target, head), pool, 40, False, cfg)
    assert [d for d, _ in per_round] == [d for d, _ in read_each]


@pytest.mark.parametrize("tree", [0, 8])
def test_the_heads_graph_passes_give_the_eager_passes_drafts(target, tokenizer, head, no_eos, tree, monkeypatch):
    """The head on a static cache of its own, its chain steps and a tree's depths (each also given the
    slots its rows see across the whole cache) through the graphs' buffers, run eagerly on a CPU: every
    round drafts what the head on its growing cache drafts, and the output is generate()'s. Through the
    request path, as the page runs."""
    from app import runs
    from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig
    from app.drafts import head_passes
    from app.kv.static_cache import StaticCachePool, cache_length
    from app.models.pair import Pair

    prompt = PROMPTS[0]
    ids = tokenizer(prompt)["input_ids"]
    pool = StaticCachePool(cache_length(len(ids), 40), graphs=True)
    settings = Settings(SamplingConfig(), SpecConfig(k=4, k_policy="fixed", tree=tree), RunConfig(40))

    class HeadPair(Pair):
        def proposer(self, spec):
            return FeatureProposer(target, head)

    def eager_depth(*args):
        raise AssertionError("a depth of a few nodes runs as its width's graph")

    monkeypatch.setattr(head_passes.GraphedHeadPasses, "_depth", eager_depth)
    pair = HeadPair(target, tokenizer, "tiny")
    graphed = runs.prepare(pair, ids, settings, caches=pool)
    assert graphed.proposer().static_len == pool.max_len
    eager = runs.prepare(pair, ids, settings, caches=StaticCachePool(pool.max_len))
    assert eager.proposer().static_len is None
    for teach in (False, True):
        a, b = list(graphed.steps(teach=teach)), list(eager.steps(teach=teach))
        assert [s.drafted for s in a] == [s.drafted for s in b]
        assert [t for s in a for t in s.emitted] == hf_greedy(target, tokenizer, prompt, 40)
    if tree:
        assert any(s.parents and len(s.drafted) > s.k for s in a), "the run must have drafted real trees"


def test_the_heads_static_passes_equal_its_growing_cache_passes(target, head):
    """Every pass the head makes, on its static cache (the graphs' buffers, run eagerly on a CPU) and on
    its growing cache: a prompt's pairs (wider than every graph), one pair, a pick still on the device,
    a tree's depth after a crop; the same features each time, and the same length."""
    from app.drafts import head_passes

    embed = target.get_input_embeddings()
    g = torch.Generator().manual_seed(0)
    f = torch.randn(80, target.config.hidden_size, generator=g)
    ids = torch.randint(3, 40, (80,), generator=g).tolist()
    eager, graphed = head_passes.EagerHeadPasses(head, embed), head_passes.GraphedHeadPasses(head, embed, 256)
    with torch.inference_mode():
        for passes in (eager, graphed):
            passes.got = [passes.causal(ids[:70], f[:70]), passes.causal(ids[70:71], f[70:71])]
            passes.got.append(passes.causal(torch.tensor(ids[71]), f[71:72]))
            passes.got.append(passes.causal(ids[72:75], f[72:75]))  # three pairs: padded to a width of 5
            passes.crop(71)
            # a tree's two depths after 71 true pairs: two nodes, then a child of each, which sees its parent
            passes.got.append(passes.tree(ids[75:77], f[75:77], 71, 71, [[71], [72]]))
            passes.got.append(passes.tree(ids[77:79], f[77:79], 72, 71, [[71, 73], [72, 74]]))
    for a, b in zip(eager.got, graphed.got, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-5
    assert eager.length == graphed.length == 75
    graphed.close()
    # A commit crops outside inference mode, while the cache's pointer was made inside it (on a GPU, its
    # move to the device in the first pass does that): the crop must not be an in-place error.
    with torch.inference_mode():
        inside = head_passes.GraphedHeadPasses(head, embed, 512)  # a fresh cache, made in inference mode
        inside.causal(ids[:5], f[:5])
    inside.crop(3)
    assert inside.length == 3
    inside.close()


def test_features_equal_a_fresh_forward_and_rollback_never_refeeds(target, tokenizer, head, no_eos):
    proposer = FeatureProposer(target, head)
    seen = []
    commit = proposer.commit

    def spy(accepted, token, features=None):
        seen.append(features.clone())
        commit(accepted, token, features)

    proposer.commit = spy
    ids, steps = run(target, tokenizer, PROMPTS[0], proposer, k=4, k_policy="fixed", max_new_tokens=40)
    full = tokenizer(PROMPTS[0])["input_ids"] + ids
    with torch.no_grad():
        fresh = target(input_ids=torch.tensor([full]), output_hidden_states=True).hidden_states[-1][0]
    handed = torch.cat(seen)
    assert handed.shape[0] == len(full) - 1  # every committed position but the newest token
    assert torch.allclose(handed, fresh[:-1], atol=1e-4)
    assert sum(len(s.rejected) for s in steps) > 0, "rollback must have happened"
    # Each true pair was fed once; only drafted pairs (k - 1 per round) were fed beyond that.
    assert proposer.tokens_processed == proposer.pairs + sum(max(0, len(s.drafted) - 1) for s in steps)
    assert proposer.passes.length == proposer.pairs


def test_sampling_with_the_head_as_q_matches_the_target_distribution():
    from test_sampling import char_tokenizer, tiny_llama

    tok = char_tokenizer("ab")
    p_model = tiny_llama(len(tok), layers=2, hidden=16, seed=11, scale=8.0)
    torch.manual_seed(3)
    h = FeatureHead(p_model.config).eval()
    with torch.no_grad():
        h.fc.weight.mul_(4.0)  # a head whose q is far from p, so rejections happen
    prompt = tok("abba")["input_ids"]
    cfg_t = 0.6
    exact = exact_distribution(p_model, prompt, SamplingConfig(temperature=cfg_t))
    counts, rejections = {}, 0
    for seed in range(N):
        ids, steps = run(
            p_model,
            tok,
            prompt,
            FeatureProposer(p_model, h),
            temperature=cfg_t,
            seed=seed,
            k=2,
            k_policy="fixed",
            max_new_tokens=3,
        )
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        rejections += sum(len(s.drafted) > s.accepted for s in steps)
    got = {s: c / N for s, c in counts.items()}
    assert rejections > N // 10, "q must differ from p for the test to bite"
    assert tv(got, exact) < tv_bound(exact)


def eagle_layout(head: FeatureHead, target, out, extra_embed=True, dtype=torch.float16):
    """Write a head exactly as published EAGLE-1 repos do: config.json + fused-layer tensors."""
    out.mkdir(parents=True)
    tensors = {k: v.to(dtype) for k, v in head.state_for_disk().items()}
    if extra_embed:
        tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(dtype).clone()
    save_file(tensors, str(out / "model.safetensors"))
    c = target.config
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "bias": True,
                "hidden_act": "silu",
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "max_position_embeddings": c.max_position_embeddings,
                "model_type": "llama",
                "num_attention_heads": c.num_attention_heads,
                "num_hidden_layers": 1,
                "num_key_value_heads": c.num_key_value_heads,
                "rms_norm_eps": c.rms_norm_eps,
                "torch_dtype": "float16",
                "vocab_size": c.vocab_size,
            }
        )
    )


def test_a_published_eagle1_head_loads_from_its_layout(tmp_path):
    pair = models.load_pair(models.TINY_TARGET, "prompt-lookup")
    torch.manual_seed(0)
    head = FeatureHead(pair.target.config)
    eagle_layout(head, pair.target, tmp_path / "EAGLE-bundled")
    assert is_head_dir(tmp_path / "EAGLE-bundled") and not is_head_dir(models.BUNDLED / "target")
    loaded = load_head(tmp_path / "EAGLE-bundled", pair.target)
    for name, t in head.state_for_disk().items():
        assert torch.equal(loaded.state_for_disk()[name], t.to(torch.float16).float()), name
    for draft in (str(tmp_path / "EAGLE-bundled"), "eagle:" + str(tmp_path / "EAGLE-bundled")):
        fpair = models.load_pair(models.TINY_TARGET, draft)
        assert fpair.draft.head is not None
        ids = fpair.encode("def main(argv=None):\n")
        ar, _ = run(fpair.target, fpair.tokenizer, ids, max_new_tokens=24)
        spec, _ = run(fpair.target, fpair.tokenizer, ids, fpair.proposer(), k=3, k_policy="fixed", max_new_tokens=24)
        assert spec == ar


def test_cached_passes_equal_the_body_models_own_forward(tokenizer):
    """The head's cached passes (its decoder layer called directly, a mask built for several
    positions, none for one) give the wrapped body's bits, cache and all."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for target in (
        models.load_pair(models.TINY_TARGET, "prompt-lookup").target,
        Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        ),
    ):
        torch.manual_seed(0)
        head = FeatureHead(target.config).eval()
        h = target.config.hidden_size
        e, f = torch.randn(1, 12, h), torch.randn(1, 12, h)
        fast, slow = head.new_cache(), DynamicCache(config=head.config)  # slow: transformers' own cache
        with torch.inference_mode():
            for a, b in ((0, 5), (5, 6), (6, 9), (9, 10), (10, 12)):  # a prefill, steps, passes of 3 and 2
                got = head(e[:, a:b], f[:, a:b], fast)
                fused = head.fc(torch.cat([e[:, a:b], f[:, a:b]], -1))
                want = head.body(inputs_embeds=fused, cache=slow, use_cache=True).last_hidden_state
                assert torch.equal(got, want), (a, b, (got - want).abs().max())
            fast.crop(-3), slow.crop(-3)  # a rollback, then a pass over the cropped cache
            got = head(e[:, 9:12], f[:, 9:12], fast)
            want = head.body(
                inputs_embeds=head.fc(torch.cat([e[:, 9:12], f[:, 9:12]], -1)), cache=slow, use_cache=True
            ).last_hidden_state
            assert torch.equal(got, want)
        assert fast.get_seq_length() == slow.get_seq_length() == 12


def test_a_missing_head_directory_is_named_as_a_path_not_a_hub_id(tmp_path):
    with pytest.raises(UserError) as e:
        models.load_pair(models.TINY_TARGET, "eagle:" + str(tmp_path / "no-such-head"))
    assert "does not exist" in str(e.value) and "Hub" not in str(e.value) and "offline" not in str(e.value)


def test_qwen2_heads_keep_their_qkv_biases(tmp_path, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    target = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    head = FeatureHead(target.config)
    names = set(head.state_for_disk())
    assert "layers.0.self_attn.q_proj.bias" in names and "layers.0.self_attn.o_proj.bias" not in names
    eagle_layout(head, target, tmp_path / "qwen-head")
    cfg = json.loads((tmp_path / "qwen-head" / "config.json").read_text())
    (tmp_path / "qwen-head" / "config.json").write_text(json.dumps(cfg | {"qkv_bias": True}))
    loaded = load_head(tmp_path / "qwen-head", target)
    ids = tokenizer("the cat")["input_ids"]
    ar, _ = run(target, tokenizer, ids, max_new_tokens=16)
    spec, _ = run(target, tokenizer, ids, FeatureProposer(target, loaded), k=3, k_policy="fixed", max_new_tokens=16)
    assert spec == ar


def test_bad_heads_are_refused_clearly(tmp_path, target, tokenizer):
    (tmp_path / "bin-only").mkdir()
    (tmp_path / "bin-only" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UserError, match="safetensors"):
        load_head(tmp_path / "bin-only", target)
    wide = FeatureHead(__import__("conftest").tiny_llama(len(tokenizer), hidden=32).config)
    eagle_layout(wide, __import__("conftest").tiny_llama(len(tokenizer), hidden=32), tmp_path / "wide")
    with pytest.raises(UserError, match="width"):
        load_head(tmp_path / "wide", target)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4))
    with pytest.raises(UserError, match="Llama or Qwen2"):
        FeatureHead(gpt2.config)


def test_a_head_for_a_sliding_window_target_is_one_full_attention_layer(tokenizer):
    """EAGLE's head attends to everything drafted so far, whatever the target's first layer is."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
    )
    assert DynamicCache(config=config).layers[0].__class__.__name__ == "DynamicSlidingWindowLayer"
    head = FeatureHead(config).eval()
    cache = head.new_cache()
    assert [type(layer).__name__ for layer in cache.layers] == ["GrowingLayer"]
    with torch.inference_mode():
        head(torch.randn(1, 9, 32), torch.randn(1, 9, 32), cache)
    assert cache.get_seq_length() == 9  # nothing fell out of a window


def test_the_training_time_test_unrolls_as_drafting_does(target):
    """Depth j of the training-time test gives, at each position, the feature a drafting round
    computes there j steps after the target's last one: true pairs in the cache, then its own."""
    from app.training.train_drafts import unrolled

    torch.manual_seed(0)
    head = FeatureHead(target.config).eval()
    t, hidden = 12, target.config.hidden_size
    embeds, features = torch.randn(1, t, hidden), torch.randn(1, t, hidden)
    with torch.no_grad():
        deep = unrolled(head, embeds, features, depth=3)
        assert torch.allclose(deep[0], head(embeds, features), atol=1e-5), "depth 0 is the plain causal pass"
        for start in (0, 4, 7):  # a round whose last true pair sits at `start`
            cache = head.new_cache()
            f = head(embeds[:, : start + 1], features[:, : start + 1], cache)[:, -1:]
            for j in (1, 2):
                f = head(embeds[:, start + j : start + j + 1], f, cache)
                assert torch.allclose(f[0, -1], deep[j][0, start + j], atol=1e-5), (start, j)
        broken = unrolled(head, embeds, features.roll(1, dims=1), depth=3)
        assert not torch.allclose(broken[2][0, 9], deep[2][0, 9], atol=1e-3), "the check must bite"


def test_a_penalised_greedy_head_drafts_over_its_vocabulary_as_over_the_full_row(
    target, tokenizer, head, no_eos, monkeypatch
):
    """Under repetition controls a greedy head with a draft vocabulary penalises only its own scores
    (sampling.penalise_subset): every round drafts what the full row's argmax drafted, and the output
    is plain decoding's."""
    from app.core import sampling

    def proposer():
        p = FeatureProposer(target, head)
        vocab = torch.arange(0, len(tokenizer), 2)  # a draft vocabulary of every other id
        p.use_vocab(vocab, target.get_output_embeddings().weight[vocab])
        return p

    settings = dict(k=4, k_policy="fixed", max_new_tokens=40, repetition_penalty=1.3, no_repeat_ngram_size=3)
    fast, fast_steps = run(target, tokenizer, PROMPTS[1], proposer(), **settings)

    def full_row(scores, slot_of, history, cfg):  # the reference: the whole row, penalised, at those places
        vocab = (slot_of >= 0).nonzero().flatten()[slot_of[slot_of >= 0].argsort()]
        row = torch.full((len(slot_of),), float("-inf"))
        row[vocab] = scores.float()
        return sampling.penalise(row[None], history, [], SamplingConfig(**{**cfg.__dict__}))[0][vocab]

    monkeypatch.setattr(sampling, "penalise_subset", full_row)
    slow, slow_steps = run(target, tokenizer, PROMPTS[1], proposer(), **settings)
    assert [s.drafted for s in fast_steps] == [s.drafted for s in slow_steps]
    assert fast == slow and sum(len(s.drafted) for s in fast_steps) > 0
