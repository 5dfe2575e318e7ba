"""Adaptive k follows this machine's measured costs, and reads no clock: same seed, same text."""

import dataclasses
import itertools
import random

import pytest
from conftest import pair_of, run

from app import calibrate, kept_costs, request
from app.core import cost_fit, engine, metrics
from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig
from app.core.costs import Costs
from app.core.policy import AdaptiveK
from app.drafts.model import ModelProposer
from app.kv.cache import DynamicRollbackCache
from app.models import PROMPT_LOOKUP

PROMPT = "def add(a, b):\n  return a"
# A machine where a verify pass over n tokens costs 1 + 0.25 (n - 1) steps, drafting 0.05 a token.
STEEP = Costs(
    verify_s=tuple(1 + 0.25 * i for i in range(9)),
    draft_round_s=0.0,
    draft_token_s=0.05,
    overhead_s=0.0,
    plain_round_s=1.0,
)
# The same machine measured after 100 tokens, where a pass over n tokens costs n ms more per context token.
GROWING = dataclasses.replace(STEEP, verify_per_context_s=tuple(1e-3 * n for n in range(1, 10)), context=100)


def test_k_depends_on_the_records_only():
    records = [(k, random.Random(k).randint(0, k)) for k in [4, 6, 3, 8, 2, 5, 7, 1, 4, 4]]
    ks = []
    for _ in range(2):
        policy = AdaptiveK(SpecConfig(k_max=8), STEEP)
        seq = []
        for drafted, accepted in records:
            # Wildly different times each pass: the policy must not read them.
            policy.update(drafted, accepted)
            seq.append(policy.next_k())
        ks.append(seq)
    assert ks[0] == ks[1]
    assert len(set(ks[0])) > 1


def test_same_seed_gives_the_same_sampled_text_with_adaptive_k(target, near_draft, tokenizer):
    outs = [
        run(
            target,
            tokenizer,
            PROMPT,
            ModelProposer(near_draft, "near"),
            temperature=0.9,
            seed=3,
            k_policy="adaptive",
            k_max=8,
            max_new_tokens=60,
        )
        for _ in range(2)
    ]
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
    _, steps = run(
        target, tokenizer, PROMPT, ModelProposer(near_draft, "near"), k=4, k_policy="fixed", max_new_tokens=40
    )
    doc = metrics.report(steps, "t", "d", {}, STEEP)
    st = doc["stats"]
    lengths = [len(s.drafted) for s in steps[1:]]  # round 1, the prefills, counts as measured on both sides
    assert st["predicted_speedup"] == pytest.approx(
        STEEP.predicted_speedup(st["alpha"], lengths, first_round_s=steps[0].elapsed)
    )
    assert 1 < st["predicted_speedup"] < STEEP.predicted_speedup(st["alpha"], lengths)
    assert st["theoretical_speedup"] is not None
    assert {"predicted_speedup", "theoretical_speedup"} <= set(doc["labels"])
    assert list(doc["costs"]["verify_s"]) == list(STEEP.verify_s)
    assert metrics.summarize(steps)["predicted_speedup"] is None  # without costs, nothing is claimed


@pytest.mark.parametrize("draft", ["model", PROMPT_LOOKUP])
def test_calibration_measures_every_part(target, near_draft, tokenizer, draft):
    pair = pair_of(target, tokenizer, "tiny", near_draft if draft == "model" else None, draft)
    costs = calibrate.measure(pair, 4)
    assert len(costs.verify_s) == 5 and all(t > 0 for t in costs.verify_s)
    assert list(costs.verify_s) == sorted(costs.verify_s)
    assert costs.plain_round_s >= costs.verify_s[0]
    assert costs.draft_round_s + costs.draft_token_s > 0  # prompt lookup's search is measured too, not 0
    run = request.start(pair, pair.encode("def f"), Settings(spec=SpecConfig(k_policy="adaptive", k_max=4)))
    policy = run.policy()
    assert isinstance(policy, AdaptiveK) and policy.costs is kept_costs.costs_for(pair, SpecConfig(k_max=4))


def test_calibration_runs_under_the_requests_sampling_once_per_cost_class(target, near_draft, tokenizer, monkeypatch):
    """Sampled rounds cost more than greedy ones, the more so the more they draft (a probability row
    and a draw per draft, a filtered row per verified position), so a sampled request must not be
    planned on greedy timings. Temperature and seed change no cost: they share one measurement."""
    pair = pair_of(target, tokenizer, "tiny-sampling", near_draft, "model")
    spec, seen = SpecConfig(k_policy="adaptive", k_max=3), []
    real_generate = calibrate.engine.generate
    monkeypatch.setattr(kept_costs, "_cache", {})

    def spy(*args, sampling_cfg=SamplingConfig(), **kwargs):
        seen.append(sampling_cfg)
        return real_generate(*args, sampling_cfg=sampling_cfg, **kwargs)

    monkeypatch.setattr(calibrate.engine, "generate", spy)
    greedy = kept_costs.costs_for(pair, spec)
    assert seen and all(s.greedy for s in seen)
    sampled_cfg = SamplingConfig(temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    seen.clear()
    sampled = kept_costs.costs_for(pair, spec, sampling=sampled_cfg)
    assert sampled is not greedy
    assert seen and all(s == sampled_cfg for s in seen)  # the request's own settings, every round
    seen.clear()
    hotter = dataclasses.replace(sampled_cfg, temperature=0.5, seed=7)
    assert kept_costs.costs_for(pair, spec, sampling=hotter) is sampled and not seen
    policy = request.start(pair, pair.encode("def f"), Settings(hotter, spec)).policy()
    assert isinstance(policy, AdaptiveK) and policy.costs is sampled
    # Greedy rounds take the argmax: the UI's top-k and top-p sliders cost them nothing.
    assert kept_costs.costs_for(pair, spec, sampling=SamplingConfig(top_k=50, top_p=0.9)) is greedy
    # Each of sampling itself, top-k, top-p and either repetition control is a cost of its own.
    others = [
        SamplingConfig(temperature=0.7),
        SamplingConfig(temperature=0.7, top_k=50),
        SamplingConfig(temperature=0.7, top_p=0.9),
        SamplingConfig(no_repeat_ngram_size=3),
        SamplingConfig(repetition_penalty=1.2),
    ]
    measured = [kept_costs.costs_for(pair, spec, sampling=cfg) for cfg in others]
    assert len({id(c) for c in [greedy, sampled, *measured]}) == 2 + len(others)


def test_calibration_shrugs_off_a_burst_that_covers_whole_short_runs(target, near_draft, tokenizer, monkeypatch):
    """A neighbour busy through two of the three short plain runs (every round in them ten times as
    long) must not set the plain round's cost, or "predicted for this machine" swings with it: the
    runs take turns with speculative ones, and rounds keep their lower quartile (a median of these
    twelve rounds would be a slowed one). Times are fixed here, so nothing depends on the clock."""
    pair = pair_of(target, tokenizer, "tiny", near_draft, "model")
    curve, round_s, runs = [0.001] * 5, 0.002, []
    monkeypatch.setattr(calibrate, "verify_curve", lambda *args, **kwargs: list(curve))

    def slowed(steps):
        runs.append(steps[0].k == 0)  # plain runs draft nothing
        plain_run = sum(runs)
        slow = runs[-1] and plain_run <= 2
        # The rounds' own pass and draft times are fixed too: a plain round's pass sets the curve's
        # level at width 1, and a real one on a loaded machine is slower than round_s.
        fixed = [dataclasses.replace(s, verify_time=curve[0], draft_time=0.0) for s in steps[1:]]
        return [(s, round_s * (10 if slow else 1)) for s in fixed]

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
    Passes cost more after a longer context, a wide pass the most: timed after two contexts, the curve
    gives each width's cost per context token, and every round's pass is brought back to the curve's
    context before it sets the level. Times are fixed here, so nothing depends on the clock."""
    pair = pair_of(target, tokenizer, "tiny", near_draft, "model")
    k_max = 8
    curve = [0.001 + 0.0001 * n for n in range(k_max + 1)]  # back to back: flatter and lower

    def per_context(width):  # seconds more per context token: 1 us, plus 0.5 us a token
        return 1e-6 * (1 + 0.5 * (width - 1))

    def draft_s(k):  # concave: 1.0 ms for the first draft, 0.4 ms for each of the next three, 0.2 ms after
        return 0.0 if k == 0 else 0.001 + 0.0004 * min(k - 1, 3) + 0.0002 * max(k - 4, 0)

    reference = min(target.config.max_position_embeddings // 2, calibrate.CONTEXT)

    def verify_s(width, cached=reference):  # inside rounds: 2 ms, plus 0.25 ms a token, after `reference` cached
        return 0.002 + 0.00025 * (width - 1) + per_context(width) * (cached - reference)

    monkeypatch.setattr(
        calibrate,
        "verify_curve",
        lambda target, context, widths, *args, **kwargs: [
            t + per_context(n) * (len(context) - reference) for n, t in enumerate(curve, start=1)
        ],
    )

    def fixed(steps):
        out = []
        for s in steps[1:]:
            n = len(s.drafted)
            # A round's pass feeds its last kept token again: it reads one position fewer from the cache.
            s = dataclasses.replace(s, draft_time=draft_s(n), verify_time=verify_s(n + 1, s.context - 1))
            out.append((s, s.draft_time + s.verify_time + 0.0001))
        return out

    monkeypatch.setattr(calibrate, "_busy", fixed)
    costs = calibrate.measure(pair, k_max)
    assert calibrate.lengths(k_max) == [1, 4, 8]
    assert costs.context == reference + 1  # rounds that begin there read what the curve's passes read
    assert costs.verify_per_context_s == pytest.approx([per_context(n) for n in range(1, k_max + 2)])
    for context in (reference - 50, reference + 100):
        assert costs.verify_time(5, context) == pytest.approx(verify_s(5, context - 1))
        assert costs.plain_s(context) == pytest.approx(verify_s(1, context - 1) + 0.0001)
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
    assert cost_fit.interpolate({1: 1.0, 4: 2.2, 8: 3.0}, 9) == pytest.approx(
        [1.0, 1.0, 1.4, 1.8, 2.2, 2.4, 2.6, 2.8, 3.0]
    )
    assert cost_fit.interpolate({}, 3) == [0.0, 0.0, 0.0]


def test_a_longer_context_makes_rounds_dearer_and_k_shorter():
    """Attention reads every cached position, so a pass costs more after a longer context and a wide
    pass more than a narrow one: the prediction and adaptive k follow the contexts the rounds read."""
    assert GROWING.verify_time(5, 100) == STEEP.verify_time(5) == STEEP.verify_s[4]
    assert GROWING.round_s(4, 300) - GROWING.round_s(4) == pytest.approx(200 * 5e-3)
    assert GROWING.round_s(8, 300) - GROWING.round_s(8, 100) > GROWING.round_s(2, 300) - GROWING.round_s(2, 100)
    assert GROWING.plain_s(300) == pytest.approx(STEEP.plain_round_s + 200 * 1e-3)
    # Below the measured context a pass costs less, but never nothing, nor less than a narrower one.
    assert GROWING.verify_time(1, 0) == pytest.approx(0.9)
    far = dataclasses.replace(GROWING, context=1000)
    assert far.verify_time(9, 0) == pytest.approx(STEEP.verify_s[8] / 2)
    assert far.verify_time(2, 700) == far.verify_time(1, 700)  # the wider pass's line falls below it there
    assert far.verify_curve(700) == sorted(far.verify_curve(700))
    # Plain decoding of the same tokens pays the same context: both sides of the prediction move.
    e = metrics.expected_tokens_per_pass(0.8, 4)
    assert GROWING.predicted_speedup(0.8, [4], contexts=[400]) == pytest.approx(
        e * (1 + 300 * 1e-3) / (STEEP.round_s(4) + 300 * 5e-3)
    )
    assert GROWING.predicted_speedup(0.8, [4] * 10, contexts=[100] * 10) == pytest.approx(
        STEEP.predicted_speedup(0.8, [4] * 10)
    )
    assert GROWING.best_k(0.9, 8, 1000) < GROWING.best_k(0.9, 8, 100)
    ks = {}
    for context in (100, 1000):
        policy = AdaptiveK(SpecConfig(k_max=8), GROWING)
        for _ in range(5):
            policy.update(4, 4, context=context)
        ks[context] = policy.next_k()
    assert ks[1000] < ks[100]


def test_each_round_records_the_context_its_passes_read(target, near_draft, tokenizer):
    _, steps = run(
        target, tokenizer, PROMPT, ModelProposer(near_draft, "near"), k_policy="adaptive", k_max=6, max_new_tokens=40
    )
    assert steps[0].context == len(tokenizer(PROMPT)["input_ids"])
    for before, after in itertools.pairwise(steps):
        assert after.context == before.context + len(before.emitted)
    st = metrics.summarize(steps, GROWING)
    assert st["predicted_speedup"] == pytest.approx(
        GROWING.predicted_speedup(
            st["alpha"],
            [len(s.drafted) for s in steps[1:]],
            first_round_s=steps[0].elapsed,
            contexts=[s.context for s in steps[1:]],
        )
    )
    assert st["predicted_speedup"] != pytest.approx(metrics.summarize(steps, STEEP)["predicted_speedup"])

    class Recording(AdaptiveK):
        def update(self, drafted, accepted, context=None, parents=(), path=()):
            seen.append(context)
            super().update(drafted, accepted, context)

    seen, spec = [], SpecConfig(k_policy="adaptive", k_max=6)
    steps = list(
        engine.generate(
            target,
            tokenizer,
            tokenizer(PROMPT)["input_ids"],
            ModelProposer(near_draft, "near"),
            sampling_cfg=SamplingConfig(),
            spec=spec,
            run=RunConfig(max_new_tokens=40),
            policy=Recording(spec, GROWING),
            target_cache=DynamicRollbackCache,
        )
    )
    assert seen[:-1] == [s.context for s in steps[1:]]  # each choice of k knows the context it is for


# A machine where a drafted token costs as much as a plain step: every k that drafts loses to a plain step.
LOSING = dataclasses.replace(STEEP, draft_token_s=1.0)


def test_adaptive_k_takes_plain_steps_where_every_k_loses_and_probes_now_and_then():
    assert all(LOSING.speedup(a, k) < 1 for a in (0.5, 0.9, 0.999) for k in range(1, 9))
    assert LOSING.best_k(0.9, 8, k_min=0) == 0 and LOSING.best_k(0.9, 8) >= 1
    assert STEEP.best_k(0.9, 8, k_min=0) > 0, "where drafting wins, it drafts"
    ks = []
    policy = AdaptiveK(SpecConfig(k=4, k_max=8), LOSING)
    for _ in range(30):
        k = policy.next_k()
        ks.append(k)
        policy.update(min(k, 1), 0)  # every probe's draft is rejected
    probes = [i for i, k in enumerate(ks) if k]
    # each probe that keeps nothing doubles the plain steps before the next: a useless draft's grow rare
    gaps = [b - a - 1 for a, b in itertools.pairwise(probes)]
    every, most = AdaptiveK.PROBE_EVERY, AdaptiveK.PROBE_MAX
    assert ks[0] == 4 and gaps == [min(every * 2**i, most) for i in range(len(gaps))] and len(probes) <= 5
    # A k > 0 round that drafted nothing (prompt lookup without a match) is no plain step.
    policy = AdaptiveK(SpecConfig(k=4, k_max=8), STEEP)
    for _ in range(20):
        policy.update(0, 0)
    assert policy.next_k() == 4
    # A draft that turns good again is found by the probes and drafting resumes.
    policy = AdaptiveK(SpecConfig(k=4, k_max=8), dataclasses.replace(STEEP, draft_token_s=0.3))
    for _ in range(3):
        policy.update(4, 0)
    assert policy.next_k() == 0
    seen = []
    for _ in range(40):
        k = policy.next_k()
        seen.append(k)
        policy.update(k, k)  # every draft accepted
    assert seen[: AdaptiveK.PROBE_EVERY] == [0] * AdaptiveK.PROBE_EVERY and seen[-1] > 0 and all(seen[-10:])


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_plain_steps_leave_the_text_as_it_was(target, near_draft, tokenizer, temperature):
    """Greedy: the same text as the target alone. Sampled: the same text for the same seed, twice."""

    spec = SpecConfig(k=4, k_policy="adaptive", k_max=8)

    def once(proposer, policy=None):
        ids, steps = run(
            target, tokenizer, PROMPT, proposer, temperature=temperature, seed=5, k=4, k_policy="adaptive", k_max=8,
            max_new_tokens=48, policy=policy,
        )  # fmt: skip
        return ids, [s.k for s in steps]

    out, ks = once(ModelProposer(near_draft, "near"), AdaptiveK(spec, LOSING))
    assert ks.count(0) >= len(ks) // 2 and any(ks[1:]), ks  # mostly plain steps, with probes
    if temperature == 0.0:
        assert out == once(None)[0]
    else:
        assert (out, ks) == once(ModelProposer(near_draft, "near"), AdaptiveK(spec, LOSING))


def test_idealised_and_predicted_read_the_same_inputs_so_idealised_is_never_below():
    """Leviathan's idealised figure differs from the prediction only in costing a wide verify pass as a
    one-token pass, so on a machine where a wide pass costs more it is the upper bound."""
    rng = random.Random(0)
    for _ in range(200):
        widths = list(itertools.accumulate(rng.uniform(0.0, 0.5) for _ in range(9)))
        costs = Costs(
            verify_s=tuple(1 + w for w in widths),
            draft_round_s=rng.uniform(0, 0.3),
            draft_token_s=rng.uniform(0, 0.5),
            overhead_s=rng.uniform(0, 0.2),
            plain_round_s=rng.uniform(0.8, 1.5),
            verify_per_context_s=tuple(rng.uniform(0, 1e-3) for _ in range(9)),
            context=100,
        )
        alpha, lengths = rng.random(), [rng.randint(0, 8) for _ in range(rng.randint(1, 30))]
        contexts = [rng.randint(10, 2000) for _ in lengths]
        first = rng.uniform(0, 3)
        predicted = costs.predicted_speedup(alpha, lengths, first, contexts)
        assert costs.idealised_speedup(alpha, lengths, first, contexts) >= predicted
    # Where a pass's width is free, the two agree.
    flat = dataclasses.replace(STEEP, verify_s=(1.0,) * 9)
    assert flat.idealised_speedup(0.7, [4, 2, 0]) == pytest.approx(flat.predicted_speedup(0.7, [4, 2, 0]))
    assert STEEP.idealised_speedup(0.7, [4]) > STEEP.predicted_speedup(0.7, [4])


def test_a_runs_idealised_figure_is_built_on_its_predictions_inputs(target, near_draft, tokenizer):
    _, steps = run(
        target, tokenizer, PROMPT, ModelProposer(near_draft, "near"), k=4, k_policy="fixed", max_new_tokens=40
    )
    st = metrics.summarize(steps, GROWING)
    inputs = (st["alpha"], [len(s.drafted) for s in steps[1:]], steps[0].elapsed, [s.context for s in steps[1:]])
    assert st["theoretical_speedup"] == pytest.approx(GROWING.idealised_speedup(*inputs))
    assert st["theoretical_speedup"] > st["predicted_speedup"] == pytest.approx(GROWING.predicted_speedup(*inputs))
    # Without measured costs, Leviathan's formula at the run's own alpha and c, as before.
    bare = metrics.summarize(steps)
    assert bare["theoretical_speedup"] == pytest.approx(
        metrics.expected_speedup(bare["alpha"], bare["cost_ratio_c"], bare["mean_k"])
    )


def test_heuristic_k_grows_to_its_cap_and_no_further():
    from app.core.policy import HeuristicK

    policy, seen = HeuristicK(SpecConfig(k=3, k_policy="heuristic", k_max=6)), []
    for _ in range(5):  # every draft kept: +2 a round, up to k_max
        k = policy.next_k()
        seen.append(k)
        policy.update(k, k)
    assert seen == [3, 5, 6, 6, 6]
    policy.update(6, 2)  # a rejection: one less
    assert policy.next_k() == 5


def test_a_round_never_drafts_past_the_tokens_left_less_the_bonus_slot(target, near_draft, tokenizer, no_eos):
    """With every draft kept a round emits k + 1 tokens: so k is at most the tokens left minus one."""
    for n in (1, 2, 5, 9):
        proposer = ModelProposer(near_draft, "near")
        _, steps = run(target, tokenizer, "def add(a, b):", proposer, k=8, k_policy="fixed", max_new_tokens=n)
        before = 0
        for s in steps:
            assert s.k <= n - before - 1, (n, s.round, s.k)
            before += len(s.emitted)
        assert before == n


def test_a_run_that_disagrees_with_the_machines_measurement_has_it_measured_again():
    """kept_costs.drift: a plain run whose one-token passes took 1.5x (or 0.6x) the measured time drops
    the measurement, so the next request measures again; one within DRIFT keeps it; too few rounds tell
    nothing. The page says so under the summary."""
    from types import SimpleNamespace

    from app.views import render

    costs = Costs(verify_s=(0.01, 0.012), draft_round_s=0.0, draft_token_s=0.001, overhead_s=0.0, plain_round_s=0.01)

    def plain(seconds: float, n: int = 12):
        return [SimpleNamespace(drafted=[], verify_time=seconds, context=100 + i) for i in range(n)]

    for seconds, forgotten in ((0.015, True), (0.006, True), (0.011, False), (0.0092, False)):
        kept_costs._cache[("drift test",)] = costs
        ratio = kept_costs.drift(costs, plain(seconds))
        assert (ratio is not None) == forgotten and (("drift test",) not in kept_costs._cache) == forgotten
        kept_costs._cache.pop(("drift test",), None)
    kept_costs._cache[("drift test",)] = costs
    assert kept_costs.drift(costs, plain(0.02, n=5)) is None and ("drift test",) in kept_costs._cache
    kept_costs.forget(costs)
    assert ("drift test",) not in kept_costs._cache
    assert "1.50×" in render.drift_note(1.5) and render.drift_note(None) == ""
