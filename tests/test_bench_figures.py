"""The bench's and the model card's summary figures, from constructed rows and timings (no model runs)."""

import pytest

from app.bench import bench
from app.bench.card import aggregate, cost_ratio
from app.core.metrics import alpha_interval


def test_adaptive_is_compared_with_the_best_fixed_k_prompt_by_prompt():
    """Adaptive is 1.11x k = 2 on two prompts of three, yet the median of its speedups is 0.74x
    k = 2's: the comparison pairs each prompt's two runs, as ours against transformers does."""

    def row(adaptive, k1, k2):
        speeds = {"autoregressive": 1.0, "adaptive": adaptive, "k=1": k1, "k=2": k2}
        return dict(
            contenders={
                n: dict(speedup=v, tokens_per_s=100 * v, spread=0.0, identical=True) for n, v in speeds.items()
            },
            identical=True,
            speedup=adaptive,
            adaptive={},
            ours_over_hf={},
            outside_forward=dict(share=0.01, ms_per_round=0.1),
        )

    rows = [row(1.0, 0.5, 0.9), row(2.0, 0.5, 3.0), row(3.0, 0.5, 2.7)]
    sm = bench.summarize_rows(rows, ["autoregressive", "adaptive", "k=1", "k=2"], k=2)
    assert sm["best_fixed_k"] == "k=2"
    assert sm["adaptive_over_best_fixed"]["median"] == pytest.approx(1 / 0.9)
    assert sm["adaptive_over_best_fixed_of_medians"] == pytest.approx(2.0 / 2.7)


def test_card_costs_pair_each_draft_timing_with_the_target_timing_beside_it():
    """A host whose speed moves up and down as the card runs must not move the cost ratio: each
    draft timing is divided by the target timing taken right after it, and the ratios' median is
    the cost (the ratio of the two medians would read 0.10 here)."""
    draft_s, target_s, calls = iter([1.0, 2.0, 3.0]), iter([30.0, 10.0, 20.0]), []

    def timed(name, times):
        def run():
            calls.append(name)
            return next(times)

        return run

    d, t, cost = cost_ratio(timed("draft", draft_s), timed("target", target_s), reps=3)
    assert calls == ["draft", "target"] * 3
    assert cost == pytest.approx(0.15)  # median of 1/30, 2/10, 3/20
    assert (d, t) == (2.0, 20.0)


def test_the_cards_alpha_interval_resamples_prompts():
    """One hard prompt among easy ones widens the interval to what resampling prompts gives, and
    scaling every prompt's counts tenfold leaves it there: rounds of one prompt are not independent
    draws. Resampling decisions instead would give about 0.91-0.94 here, and a sqrt(10)-fold
    narrower interval after the scaling."""
    counts = [(96, 4)] * 9 + [(60, 40)]
    low, high = alpha_interval(counts)
    pooled = sum(a for a, _ in counts) / sum(a + r for a, r in counts)
    assert low == pytest.approx(0.852, abs=0.01) and high == pytest.approx(0.96)
    assert low < pooled < high
    assert alpha_interval([(10 * a, 10 * r) for a, r in counts]) == pytest.approx([low, high])
    assert alpha_interval(counts) == [low, high]  # seeded: the same card twice reads the same
    assert alpha_interval([(90, 10)] * 10) == pytest.approx([0.9, 0.9])  # prompts alike: no spread to resample
    assert alpha_interval(counts[:4]) is None  # too few prompts to resample
    assert alpha_interval([(0, 0)] * 5) is None
    rows = [
        dict(
            speculative=dict(
                accepted=a,
                rejections=r,
                drafted=a + r + 5,
                tokens_per_pass=2.0,
                cost_ratio_c=0.1,
                theoretical_speedup=2.0,
            ),
            speedup=1.5,
        )
        for a, r in counts
    ]
    summary = aggregate(rows)
    assert summary["alpha"] == pytest.approx(pooled) and summary["alpha_ci95"] == [low, high]
