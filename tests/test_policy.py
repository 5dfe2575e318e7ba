"""Adaptive k follows this machine's measured costs, and reads no clock: same seed, same text."""

import dataclasses
import random

import pytest
from conftest import run

from app import calibrate, metrics
from app.config import SpecConfig
from app.costs import Costs
from app.models import PROMPT_LOOKUP, Pair
from app.policy import AdaptiveK
from app.proposers import ModelProposer

PROMPT = "def add(a, b):\n  return a"
# A machine where a verify pass over n tokens costs 1 + 0.25 (n - 1) steps, drafting 0.05 a token.
STEEP = Costs(verify_s=tuple(1 + 0.25 * i for i in range(9)), draft_round_s=0.0, draft_token_s=0.05,
              overhead_s=0.0, plain_round_s=1.0)


def test_k_depends_on_the_records_only():
    records = [(k, random.Random(k).randint(0, k)) for k in [4, 6, 3, 8, 2, 5, 7, 1, 4, 4]]
    ks = []
    for _ in range(2):
        policy = AdaptiveK(SpecConfig(k_max=8), STEEP)
        seq = []
        for drafted, accepted in records:
            # Wildly different times each pass: the policy must not read them.
            policy.update(drafted, accepted, random.random(), random.random())
            seq.append(policy.next_k())
        ks.append(seq)
    assert ks[0] == ks[1]
    assert len(set(ks[0])) > 1


def test_same_seed_gives_the_same_sampled_text_with_adaptive_k(target, near_draft, tokenizer):
    outs = [run(target, tokenizer, PROMPT, ModelProposer(near_draft, "near"), temperature=0.9, seed=3,
                k_policy="adaptive", k_max=8, max_new_tokens=60) for _ in range(2)]
    assert outs[0][0] == outs[1][0]
    assert [s.k for s in outs[0][1]] == [s.k for s in outs[1][1]]
    assert len({s.k for s in outs[0][1][:-1]}) > 1, "k must move for this to test anything"


def test_measured_curve_moves_k_where_leviathans_formula_would_not():
    idealised = Costs.idealised(c=0.05, k_max=8)
    for alpha in (0.6, 0.8, 0.9):
        assert STEEP.best_k(alpha, 8) <= idealised.best_k(alpha, 8)
    assert STEEP.best_k(0.8, 8) < idealised.best_k(0.8, 8)
    # Under Leviathan's own assumptions the model is Leviathan's formula.
    assert idealised.speedup(0.8, 4) == pytest.approx(metrics.expected_speedup(0.8, 0.05, 4))
    # Free drafts but a costly fixed round (prompt lookup's shape) favour long drafts.
    lookup = Costs(verify_s=STEEP.verify_s, draft_round_s=0.3, draft_token_s=0.0, overhead_s=0.0, plain_round_s=1.0)
    assert lookup.best_k(0.8, 8) >= STEEP.best_k(0.8, 8)


def test_predicted_speedup_is_reported_beside_leviathans(target, near_draft, tokenizer):
    _, steps = run(target, tokenizer, PROMPT, ModelProposer(near_draft, "near"), k=4, k_policy="fixed",
                   max_new_tokens=40)
    doc = metrics.report(steps, "t", "d", {}, STEEP)
    st = doc["stats"]
    lengths = [len(s.drafted) for s in steps[1:]]  # round 1, the prefills, counts as measured on both sides
    assert st["predicted_speedup"] == pytest.approx(
        STEEP.predicted_speedup(st["alpha"], lengths, first_round_s=steps[0].elapsed))
    assert 1 < st["predicted_speedup"] < STEEP.predicted_speedup(st["alpha"], lengths)
    assert st["theoretical_speedup"] is not None
    assert {"predicted_speedup", "theoretical_speedup"} <= set(doc["labels"])
    assert list(doc["costs"]["verify_s"]) == list(STEEP.verify_s)
    assert metrics.summarize(steps)["predicted_speedup"] is None  # without costs, nothing is claimed


@pytest.mark.parametrize("draft", ["model", PROMPT_LOOKUP])
def test_calibration_measures_every_part(target, near_draft, tokenizer, draft):
    pair = Pair(target, tokenizer, "tiny", draft, near_draft if draft == "model" else None)
    costs = calibrate.measure(pair, 4)
    assert len(costs.verify_s) == 5 and all(t > 0 for t in costs.verify_s)
    assert list(costs.verify_s) == sorted(costs.verify_s)
    assert costs.plain_round_s >= costs.verify_s[0]
    assert costs.draft_round_s + costs.draft_token_s > 0  # prompt lookup's search is measured too, not 0
    policy = calibrate.policy_for(pair, SpecConfig(k_policy="adaptive", k_max=4))
    assert isinstance(policy, AdaptiveK) and policy.costs is calibrate.costs_for(pair, SpecConfig(k_max=4))


def test_calibration_shrugs_off_a_burst_that_covers_whole_short_runs(target, near_draft, tokenizer, monkeypatch):
    """A neighbour busy through two of the three short plain runs (every round in them ten times as
    long) must not set the plain round's cost, or "predicted for this machine" swings with it: the
    runs take turns with speculative ones, and rounds keep their lower quartile (a median of these
    twelve rounds would be a slowed one). Times are fixed here, so nothing depends on the clock."""
    pair = Pair(target, tokenizer, "tiny", "model", near_draft)
    curve, round_s, runs = [0.001] * 5, 0.002, []
    monkeypatch.setattr(calibrate, "verify_curve", lambda *args, **kwargs: list(curve))

    def slowed(steps):
        runs.append(steps[0].k == 0)  # plain runs draft nothing
        plain_run = sum(runs)
        slow = runs[-1] and plain_run <= 2
        return [(s, round_s * (10 if slow else 1)) for s in steps[1:]]

    monkeypatch.setattr(calibrate, "_busy", slowed)
    costs = calibrate.measure(pair, 4)
    assert runs == [True, False] * calibrate.PARTS  # plain and speculative runs took turns
    assert costs.plain_round_s == pytest.approx(round_s)  # the unhurried plain run's rounds


def test_a_first_round_both_modes_pay_dilutes_the_predicted_speedup():
    lengths = [4] * 10
    rounds = STEEP.predicted_speedup(0.8, lengths)
    assert rounds > 1.5
    # A prefill as long as the rounds: (P + T) / (P + S) for rounds alone T / S.
    seconds = sum(STEEP.round_s(4) for _ in lengths)
    diluted = STEEP.predicted_speedup(0.8, lengths, first_round_s=seconds)
    assert diluted == pytest.approx((seconds + rounds * seconds) / (2 * seconds))
    assert 1 < diluted < rounds


def test_calibration_takes_round_times_as_rounds_spend_them(target, near_draft, tokenizer, monkeypatch):
    """The verify curve keeps its shape but takes its level from the rounds' own verify times (passes
    timed back to back ran a fifth faster than inside rounds), and a draft whose first steps cost more
    than its later ones is interpolated between the lengths it ran, not put on one line through them.
    Times are fixed here, so nothing depends on the clock."""
    pair = Pair(target, tokenizer, "tiny", "model", near_draft)
    k_max = 8
    curve = [0.001 + 0.0001 * n for n in range(k_max + 1)]  # back to back: flatter and lower

    def draft_s(k):  # concave: 1.0 ms for the first draft, 0.4 ms for each of the next three, 0.2 ms after
        return 0.0 if k == 0 else 0.001 + 0.0004 * min(k - 1, 3) + 0.0002 * max(k - 4, 0)

    def verify_s(width):  # inside rounds: 2 ms, plus 0.25 ms a token
        return 0.002 + 0.00025 * (width - 1)

    monkeypatch.setattr(calibrate, "verify_curve", lambda *args, **kwargs: list(curve))

    def fixed(steps):
        out = []
        for s in steps[1:]:
            n = len(s.drafted)
            s = dataclasses.replace(s, draft_time=draft_s(n), verify_time=verify_s(n + 1))
            out.append((s, s.draft_time + s.verify_time + 0.0001))
        return out

    monkeypatch.setattr(calibrate, "_busy", fixed)
    costs = calibrate.measure(pair, k_max)
    assert calibrate.lengths(k_max) == [1, 4, 8]
    for k in calibrate.lengths(k_max):
        assert costs.verify_s[k] == pytest.approx(verify_s(k + 1))
        assert costs.draft_time(k) == pytest.approx(draft_s(k))
        assert costs.round_s(k) == pytest.approx(draft_s(k) + verify_s(k + 1) + 0.0001)
    assert costs.verify_s[0] == pytest.approx(verify_s(1))  # plain rounds' own pass
    assert costs.overhead_s == pytest.approx(0.0001)
    # Between the lengths it ran, on the chord of its neighbours; a line through all three would miss.
    assert costs.draft_time(2) == pytest.approx(draft_s(1) + (draft_s(4) - draft_s(1)) / 3)
    line = costs.draft_round_s + 4 * costs.draft_token_s
    assert line < draft_s(4) - 0.0001
    assert costs.draft_time(0) == pytest.approx(costs.draft_round_s)  # a call that drafts nothing
    assert list(costs.draft_s) == sorted(costs.draft_s)


def test_interpolation_is_level_beyond_its_points_and_zero_without_any():
    assert calibrate._interpolate({1: 1.0, 4: 2.2, 8: 3.0}, 9) == pytest.approx(
        [1.0, 1.0, 1.4, 1.8, 2.2, 2.4, 2.6, 2.8, 3.0])
    assert calibrate._interpolate({}, 3) == [0.0, 0.0, 0.0]
