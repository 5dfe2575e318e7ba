"""EAGLE-3 heads: fused features from three target layers, trained on teacher-forced shards, drafting
losslessly, written and read in vLLM's EAGLE-3 layout."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run
from safetensors import safe_open

from app import models
from app.drafts import eagle3_head
from app.drafts.feature import FeatureProposer
from app.training import eagle3_training, teacher_forcing

PROMPTS = ["def add(a, b):\n  return a", "import os\nfor name in os.listdir(path):\n    "]


@pytest.fixture(scope="module")
def bundled():
    """The bundled tiny target (8 layers: the fused layers are 2, 4 and 5) and its tokenizer."""
    return models.load(models.TINY_TARGET, dtype="fp32")


@pytest.fixture(scope="module")
def trained(bundled, tmp_path_factory):
    """A head trained for a few seconds on the tiny target's teacher-forced shards, and its folder."""
    target, tokenizer = bundled
    folder = tmp_path_factory.mktemp("eagle3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(teacher_forcing, "ROW", 64)
        mp.setattr(teacher_forcing, "SHARD_ROWS", 16)
        mp.setattr(eagle3_training, "CROP", 64)
        teacher_forcing.build(target, tokenizer, folder / "teacher", tokens=32 * 64, seed=0, log=lambda r: None)
        vocab = eagle3_training.vocabulary(folder / "teacher", 512, target.config.vocab_size, [0, 1, 2])
        head, info = eagle3_training.train(target, folder / "teacher", vocab, 80, 0, lambda r: None)
    head.save(folder / "head", info)
    return head, folder


@pytest.mark.parametrize("tree", [0, 8])
def test_an_eagle3_head_drafts_from_fused_features_and_the_output_is_the_targets(bundled, trained, tree):
    (target, tokenizer), (head, _) = bundled, trained
    fused = []
    hook = head.fc.register_forward_hook(lambda m, i, o: fused.append(i[0].shape[-1]))
    try:
        accepted = 0
        for prompt in PROMPTS:
            proposer = FeatureProposer(target, head)
            spec, steps = run(target, tokenizer, prompt, proposer, k=4, k_policy="fixed", tree=tree, max_new_tokens=32)
            assert spec == run(target, tokenizer, prompt, None, max_new_tokens=32)[0]
            accepted += sum(s.accepted for s in steps)
    finally:
        hook.remove()
    assert accepted > 0, "a trained head is right sometimes"
    # fc reads the target's states entering layers 2, 4 and 5 side by side: three widths of its own.
    assert fused and set(fused) == {3 * target.config.hidden_size} and head.feature_layers == (2, 4, 5)


def test_an_eagle3_head_on_the_fast_paths_caches_drafts_as_on_its_growing_cache(bundled, trained):
    """The GPU fast path's caches (their graphs' buffers run eagerly here) for the target and the head:
    its steps read the target's fused features (3H wide) and its own (H wide), each width its own graph
    input; the drafts are the growing cache's, with picks on the device (nothing taught) and without."""
    from conftest import host_reads

    from app.kv.static_cache import StaticCachePool, cache_length

    (target, tokenizer), (head, _) = bundled, trained
    for prompt in PROMPTS:
        pool = StaticCachePool(cache_length(len(tokenizer(prompt)["input_ids"]), 32), graphs=True)
        graphed = FeatureProposer(target, head)
        graphed.static_len = pool.max_len
        out, rounds = host_reads(target, tokenizer, prompt, graphed, pool, 32)
        growing, rounds_growing = host_reads(target, tokenizer, prompt, FeatureProposer(target, head), pool, 32)
        assert out == growing == run(target, tokenizer, prompt, None, max_new_tokens=32)[0]
        assert [d for d, _ in rounds] == [d for d, _ in rounds_growing]
        assert all(reads == ["tolist"] for d, reads in rounds if d), rounds


def test_feature_regression_pulls_what_the_heads_lm_head_reads_onto_the_targets_next_features(bundled, trained):
    """--feature-regression: on the same shards, seed and steps, what the LM head of the head trained
    with EAGLE-1's regression reads lies nearer the target's feature at the drafted position than
    EAGLE-3's own loss leaves it, and nearer that feature than the one it was given."""
    from app.training.steps import unrolled

    (target, _), (plain, folder) = bundled, trained
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eagle3_training, "CROP", 64)
        vocab = plain.draft_vocab
        head, info = eagle3_training.train(target, folder / "teacher", vocab, 80, 0, lambda r: None, regression=True)
    plain_info = json.loads((folder / "head" / "training.json").read_text())
    assert info["loss_weights"] == [1.0, 0.1] and plain_info["loss_weights"] == [0.0, 1.0]
    b = next(eagle3_training.batches(folder / "teacher", 8, 64, torch.Generator().manual_seed(1)))
    ids, features = b["ids"].long(), b["features"].float()

    def gap(h, want):
        return torch.nn.functional.smooth_l1_loss(h, want).item()

    with torch.no_grad():
        embeds = target.get_input_embeddings()(ids[:, 1:])
        read = {
            k: m.readout(unrolled(m, embeds, b["fused"][:, :-1].float(), 1)[0]) for k, m in (("r", head), ("p", plain))
        }
    assert gap(read["r"], features[:, 1:]) < 0.8 * gap(read["p"], features[:, 1:])  # 0.71 against 1.05 here
    assert gap(read["r"], features[:, 1:]) < gap(read["r"], features[:, :-1])  # 0.71 against 0.83


def test_an_eagle3_head_is_written_in_vllms_layout_and_loads_back_as_a_draft(bundled, trained):
    (target, _), (head, folder) = bundled, trained
    config = json.loads((folder / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["draft_vocab_size"] == 512
    h = target.config.hidden_size
    with safe_open(str(folder / "head" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("fc.weight").get_shape() == [h, 3 * h]
        assert f.get_slice("midlayer.self_attn.q_proj.weight").get_shape()[1] == 2 * h
        assert {"midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(f.keys())
    pair = models.load_pair(models.TINY_TARGET, "eagle:" + str(folder / "head"), dtype="fp32")
    loaded = pair.draft.head
    assert isinstance(loaded, eagle3_head.Eagle3Head) and torch.equal(loaded.draft_vocab, head.draft_vocab)
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a.half().float(), b), name  # kept in fp16 on disk
    assert pair.proposer(models.SpecConfig()).feature_layers == (2, 4, 5)


def test_the_export_names_vllms_eagle3_method_for_an_eagle3_head(trained):
    from test_export import FIXED, GREEDY, info, spec_config

    from app.export import vllm

    _, folder = trained
    exported = vllm(models.TINY_TARGET, info("eagle:" + str(folder / "head")), FIXED, GREEDY)
    want = {"method": "eagle3", "model": str(folder / "head"), "num_speculative_tokens": 5}
    assert spec_config(exported.argv) == want


def test_an_eagle3_head_drafts_in_int8_beside_an_int8_target_and_the_output_is_the_targets(trained):
    """In the exact int8 precision the head's projections and draft scores run in int8 (its fp32
    steps cost several times theirs); the target's verification keeps the output plain decoding's."""
    from app.models import exact, int8_kernel

    if int8_kernel.module() is None:
        pytest.skip(f"the int8 kernel does not run here: {int8_kernel.why()}")
    _, folder = trained
    pair = models.load_pair(models.TINY_TARGET, "eagle:" + str(folder / "head"), dtype="int8")
    head = pair.draft.head
    attention = head.body.layers[0].layer.self_attn
    assert isinstance(head.fc, exact.Int8Linear) and isinstance(attention.q_proj, exact.Int8Linear)
    assert isinstance(head.rows_linear, exact.Int8Linear) and head.specdec_precision == exact.NAME
    accepted = 0
    for prompt in PROMPTS:
        proposer = pair.proposer(models.SpecConfig())
        spec, steps = run(pair.target, pair.tokenizer, prompt, proposer, k=4, k_policy="fixed", max_new_tokens=32)
        assert spec == run(pair.target, pair.tokenizer, prompt, None, max_new_tokens=32)[0]
        accepted += sum(s.accepted for s in steps)
    assert accepted > 0, "the int8 head is right sometimes"
