"""gpucheck runs end to end on CPU with tiny shapes, so the GPU check cannot rot unseen."""

import json

import pytest

from app import cli


def test_gpucheck_reports_every_figure_on_cpu(capsys):
    assert (
        cli.main(
            [
                "gpucheck",
                "--shapes",
                "tiny",
                "--device",
                "cpu",
                "--steps",
                "2",
                "--context",
                "48",
                "--new-tokens",
                "20",
                "--k",
                "1,4",
                "--no-equality",  # the next test checks the bundled family, on its own settings
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    doc = json.loads(out)  # stdout is the JSON alone; progress goes to stderr
    assert "gpucheck: building random-weight" in err and "gpucheck: timing the eager cache (1/4)" in err
    assert err.index("timing the static_eager cache (2/4)") < err.index("gpucheck: static_eager done")
    assert doc["compiled"].startswith("skipped")  # CUDA only unless forced
    assert set(doc["rows_exact"]) == {"8", "16"} and all(isinstance(v, bool) for v in doc["rows_exact"].values())
    # Operators a step: the same per layer, so the 4-layer target's exceed the 2-layer draft's by
    # twice a layer's. transformers' layer makes about forty; fused_pass's at most sixteen, its
    # projections joined (q/k/v one product, gate/up one, output and down adding their residual).
    ops = doc["ops_a_step"]
    assert set(ops) == {"tiny-target", "tiny-draft"}
    per_layer = {kind: (ops["tiny-target"][kind] - ops["tiny-draft"][kind]) / 2 for kind in ("fused", "transformers")}
    assert per_layer["transformers"] >= 35 and 4 <= per_layer["fused"] <= 16, per_layer
    assert all(ops["tiny-draft"][kind] > 2 * n for kind, n in per_layer.items())
    for kind in ("eager", "static_eager", "graphs", "graphs_transformers"):
        times = doc[kind]
        assert times["target"]["step_ms"] > 0 and set(times["target"]["verify_ms"]) == {"1", "4"}
        assert times["draft_step_ms"] > 0
        assert times["engine_autoregressive"]["tokens_per_round"] == 1.0
        for k in ("1", "4"):
            run = times["engine_self_draft"][k]
            # The target drafting for itself is always right: every round keeps all k plus one.
            assert run["alpha"] == 1.0
            assert run["tokens_per_round"] > 1.5
            # The pass clock splits each round: passes were timed, and the rest is a share of the round.
            assert run["model_ms"] > 0 and 0 < run["overhead_share"] < 1
            assert run["model_ms"] + run["overhead_ms"] == pytest.approx(run["round_ms"])


@pytest.mark.parametrize("dtype", ["int8", "auto"])
def test_gpucheck_refuses_a_precision_random_weights_cannot_have(dtype, capsys):
    """--dtype is the declared precision setting; random weights have no int8 copy and give auto nothing
    to probe, so those get a message with the choices instead of a crash."""
    assert cli.main(["gpucheck", "--shapes", "tiny", "--device", "cpu", "--dtype", dtype, "--no-equality"]) == 2
    assert f"random-weight models in fp32, bf16, fp16, got --dtype {dtype}" in capsys.readouterr().err


@pytest.mark.slow
def test_gpucheck_checks_the_bundled_family_against_generate(capsys):
    assert (
        cli.main(["gpucheck", "--no-timing", "--device", "cpu", "--equality-prompts", "1", "--equality-tokens", "16"])
        == 0
    )
    doc = json.loads(capsys.readouterr().out)["equality"]
    assert doc["dtype"] == "fp32"
    for draft in ("draft-feature", "draft-distilled", "prompt-lookup"):
        row = doc[draft]["eager"]
        # One prompt, greedy bare and with its penalties (plain and four speculative settings each),
        # then shared noise (four speculative settings against its plain run).
        assert row["checked"] == 14 and row["identical"] == 14 and row["mismatches"] == []
        assert row["near_ties"] == row["bugs"] == 0
        # Every speculative run against the engine's own plain decoding too: the bucket widths here.
        assert row["speculative_as_plain"] == "12/12" and row["width"] is None
        assert row["tokens_per_s"]["autoregressive"] > 0 and row["speedup"] > 0


def test_gpucheck_gives_a_planted_bug_the_mismatch_verdict(monkeypatch):
    """An off-by-one in the greedy verify rule: each difference is judged, and none passes as rounding."""
    from app import models
    from app.bench import gpu_equality
    from app.core import verify

    pair = models.load_pair(models.TINY_TARGET, models.PROMPT_LOOKUP, "cpu", "fp32")
    example = {"prompt": "def parse(line):\n", "settings": {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0}}
    real = verify.greedy

    def off_by_one(drafts, parents, logits, teach=True, pending=None):
        return real(drafts, parents, logits.roll(-1, 0), teach, pending)

    monkeypatch.setattr(verify, "greedy", off_by_one)
    monkeypatch.setattr(gpu_equality, "EQUALITY_SPECS", gpu_equality.EQUALITY_SPECS[1::2])  # k = 4 and adaptive
    row = gpu_equality._equal_runs(pair, [example], 24, "off")
    assert row["bugs"] > 0 and row["near_ties"] == 0
    same, runs = map(int, row["speculative_as_plain"].split("/"))
    assert runs == 6 and same < runs  # bare, penalised and shared noise, at k = 4 and adaptive
    assert {m["verdict"] for m in row["mismatches"]} == {"mismatch"}


def test_the_sync_count_counts_what_cudas_debug_mode_warns(monkeypatch):
    """CUDA's sync debug mode warns at each host sync; on a CPU a stand-in warns at each read of a
    value (.tolist, .item), at each host number written into a float tensor (on CUDA a copy from
    pageable memory; on this path the round's float tensors are the device's, its host buffers hold ids;
    host float tensors elsewhere would be flagged too) and at each tensor made from host numbers on a
    device (torch.tensor(..., device=)), so the count runs here: one a round under every rule on the
    graphs' cache, and under greedy for a tree (its siblings and the kept path's move included)."""
    import warnings

    import torch

    from app.bench import gpucheck
    from app.kv import static_cache

    mode = {"on": False}
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__("on", m == "warn"))

    def sync(where: bool = True) -> None:
        if mode["on"] and where:
            warnings.warn("called a synchronizing CUDA operation", stacklevel=3)

    for name in ("tolist", "item"):
        real = getattr(torch.Tensor, name)

        def read(self, _real=real):
            sync()
            return _real(self)

        monkeypatch.setattr(torch.Tensor, name, read)
    real_set = torch.Tensor.__setitem__

    def write(self, index, value):
        sync(self.is_floating_point() and not isinstance(value, torch.Tensor))
        return real_set(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", write)
    real_tensor = torch.tensor

    def made_on(*args, **kwargs):  # host numbers made straight into a device tensor: a plain copy on CUDA
        sync(kwargs.get("device") is not None)
        return real_tensor(*args, **kwargs)

    target = gpucheck.build("tiny-target", torch.device("cpu"), torch.float32)
    # after the build: transformers computes the rotary frequencies through torch.tensor while loading
    monkeypatch.setattr(torch, "tensor", made_on)
    tok = gpucheck.id_tokenizer(target.config.vocab_size)
    prompt = list(range(3, 40))
    pool = static_cache.StaticCachePool(static_cache.cache_length(len(prompt), 30), graphs=True)
    syncs = gpucheck.round_syncs(gpucheck.self_pair(target, tok), prompt, 24, pool)
    assert set(syncs) == set(gpucheck.RULES) | {f"greedy_tree_{gpucheck.TREE_NODES}"}
    for rule in syncs.values():
        assert rule["rounds"] >= 4 and rule["syncs"] == rule["rounds"], syncs
