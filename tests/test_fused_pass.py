"""The fused pass (kv/fused_pass.py): the graphs' forward in few kernels gives transformers' logits and
features on a static cache, through chains, trees and rollbacks; it joins each model's projections
once, keeping each weight once; a model it does not run keeps transformers' layers."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from app.bench import gpucheck
from app.kv import fused_pass
from app.kv.static_cache import StaticRollbackCache


def qwen2_with_biases():
    """A random Qwen2-shaped model: q, k and v with biases, grouped heads."""
    return gpucheck.build("tiny-target", torch.device("cpu"), torch.float32, seed=5).eval()


def passes(lm) -> list[torch.Tensor]:
    """Logits and features of a run of passes: a prompt, chains of several widths, a tree, rollbacks."""
    ids = [(7 * i + 3) % 90 for i in range(40)]
    out = list(lm.extend_with_features(ids[:12], keep=1))
    for i, width in ((12, 1), (13, 4), (17, 2), (19, 8)):
        out += lm.extend_with_features(ids[i : i + width], keep=width)
        lm.rollback(lm.length - 1)  # the next pass overwrites the forgotten slot
        out.append(lm.extend([ids[i + width - 1]], keep=1))
    out += lm.extend_with_features(ids[27:28] + [5, 6, 7, 8], keep=0, parents=[-1, -1, 0, 2])
    return out


@pytest.mark.parametrize("make", [lambda: tiny_llama(vocab=96).eval(), qwen2_with_biases], ids=["llama", "qwen2"])
@pytest.mark.parametrize("taps", [(), (0, 1)], ids=["last-states", "taps"])
def test_the_fused_pass_gives_transformers_logits_and_features(make, taps):
    model = make()
    with torch.inference_mode():
        fused = StaticRollbackCache(model, 256, graphs=True, feature_layers=taps)
        own = StaticRollbackCache(model, 256, graphs=True, feature_layers=taps, fused=False)
        assert fused.fused is not None and own.fused is None
        got, want = passes(fused), passes(own)
    assert fused_pass.of(model) is fused.fused, "the fused pass ran every graph pass (none fell back)"
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, msg=lambda m, i=i: f"output {i}: {m}")


def test_joining_keeps_each_weight_once_and_its_numbers():
    model = qwen2_with_biases()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    before = [p.weight.clone() for p in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
    prepared = fused_pass.of(model)
    assert prepared is not None and fused_pass.of(model) is prepared, "prepared once a model"
    after = [p.weight for p in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    layer = prepared.layers[0]
    assert {w.untyped_storage().data_ptr() for w in after[:3]} == {layer.qkv.untyped_storage().data_ptr()}
    assert {w.untyped_storage().data_ptr() for w in after[3:]} == {layer.gate_up.untyped_storage().data_ptr()}


@pytest.mark.parametrize("where", ["layer", "projection"])
def test_a_layer_with_a_hook_of_its_own_keeps_transformers_layers(where):
    model = tiny_llama(vocab=96).eval()
    if where == "layer":
        model.model.layers[1].register_forward_pre_hook(lambda *a: None)
    else:  # the fused pass reads the weights itself, so a projection's hook would never run
        model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: None)
    assert "hooks" in (fused_pass.unsupported(model) or "")
    assert StaticRollbackCache(model, 256, graphs=True).fused is None


def test_another_family_keeps_transformers_layers():
    model = tiny_llama(vocab=96).eval()
    model.config.model_type = "stablelm"
    assert "llama" in (fused_pass.unsupported(model) or "")


def test_a_fused_pass_that_fails_hands_the_model_to_transformers_layers_and_says_so_once(monkeypatch, caplog):
    model = qwen2_with_biases()
    with torch.inference_mode():
        want = passes(StaticRollbackCache(model, 256, graphs=True, fused=False))
        real = fused_pass.FusedPass.__call__

        def failing(self, input_ids, *args, **kwargs):
            if input_ids.shape[1] == 5:  # some passes ran fused first, then one fails half-way
                at = int(kwargs["cache"].layers[0].cumulative_length)
                kwargs["cache"].layers[0].keys[:, :, at : at + 5] = 7.0  # its slots, written in part
                raise RuntimeError("no kernel image is available for execution on the device")
            return real(self, input_ids, *args, **kwargs)

        monkeypatch.setattr(fused_pass.FusedPass, "__call__", failing)
        with caplog.at_level("WARNING", logger="app.kv.fused_pass"):
            lm = StaticRollbackCache(model, 256, graphs=True)
            assert lm.fused is not None
            got = passes(lm)
    assert fused_pass.of(model) is None
    assert [r.getMessage() for r in caplog.records] == [
        "the fused pass failed, so transformers' layers run this model: no kernel image is available for "
        "execution on the device"
    ]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_an_early_exit_view_reuses_its_targets_joined_weights():
    """A view sharing the target's layers (a new model object each request) joins nothing again: the
    weights a graph of the target reads stay where they are, held once."""
    from app.drafts.model import early_exit_view

    model = qwen2_with_biases()
    target = fused_pass.of(model)
    assert target is not None
    q = model.model.layers[1].self_attn.q_proj
    where = q.weight.data_ptr()
    for _ in range(2):
        view = fused_pass.of(early_exit_view(model, 2))
        assert view is not None and view.layers[1] is target.layers[1]
    assert q.weight.data_ptr() == where


def test_joining_inside_inference_mode_leaves_plain_weights():
    model = qwen2_with_biases()
    with torch.inference_mode():
        prepared = fused_pass.of(model)
    assert prepared is not None and not prepared.layers[0].qkv.is_inference()
    assert not model.model.layers[0].self_attn.q_proj.weight.is_inference()
