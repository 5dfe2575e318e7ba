"""The benchmark runs every contender, checks every output, and writes its JSON and HTML."""

import json

from app import bench, models


def test_bench_writes_a_checked_self_contained_report(tmp_path, capsys):
    out = tmp_path / "b"
    # A model draft, so that transformers' assisted generation has a counterpart (it has none for a feature head).
    draft = str(models.BUNDLED / "draft-distilled")
    argv = ["--limit", "1", "--reps", "3", "--max-new-tokens", "12", "--draft", draft, "--out", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    names = set(doc["summary"]["contenders"])
    assert {"autoregressive", "adaptive", "hf_plain", "hf_assisted_default", "hf_assisted_k=4",
            "lookup_adaptive", "lookup_k=4", "hf_lookup_default", "hf_lookup_k=4"} <= names
    assert {f"k={k}" for k in range(1, 9)} <= names
    row = doc["prompts"][0]
    for name, entry in row["contenders"].items():
        assert entry["identical"], f"{name} differs from plain greedy decoding"
        assert entry["min"] <= entry["tokens_per_s"] <= entry["max"]
    sm = doc["summary"]
    assert sm["all_identical"] and sm["best_fixed_k"] in names
    assert sm["adaptive_over_best_fixed"] > 0 and sm["outside_forward_share"]["median"] > 0
    assert row["adaptive"]["predicted_speedup"] > 0 and row["adaptive"]["theoretical_speedup"] > 0
    assert {"fixed_k", "defaults", "lookup_fixed_k", "lookup_defaults"} <= set(row["ours_over_hf"])
    page = out.with_suffix(".html").read_text()
    assert "<html" in page and "hf_assisted_k=4" in page and "predicted for this machine" in page
    assert '<script src="http' not in page and "Plotly.newPlot" in page  # plotly.js embedded: opens offline
    assert str(out.with_suffix(".html")) in capsys.readouterr().err  # says where it went


def test_card_still_reports_every_bundled_draft(tmp_path):
    out = tmp_path / "card"
    assert bench.main(["--card", "--limit", "1", "--max-new-tokens", "8", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    for name in ("draft-distilled", "draft-small", "draft-weak"):
        assert doc[name]["median_adaptive_speedup"] > 0
