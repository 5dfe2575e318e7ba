"""The greedy check's verdict: identical, a near-tie within the measured rounding noise, or a
mismatch above it, which a planted off-by-one in the verify rule gets in bf16 as in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import run

from app.core import divergence, sampling, verify
from app.core.config import SamplingConfig
from app.core.divergence import IDENTICAL, MISMATCH, NEAR_TIE
from app.drafts.model import ModelProposer
from app.kv.cache import DynamicRollbackCache
from app.views import check

PROMPT = "def add(a, b):\n  return a"


def greedy_continuation(target, ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        with torch.inference_mode():
            t = int(target(torch.tensor([ids + out])).logits[0, -1].argmax())
        out.append(t)
    return out


def test_noise_floor_is_the_largest_difference_between_pass_widths(target, tokenizer):
    ids = tokenizer(PROMPT * 3)["input_ids"]
    assert divergence.noise_floor(target, ids, 5, DynamicRollbackCache) < 1e-3  # fp32

    # A cache that adds rounding to every wide pass: the floor is what it added.
    class Noisy(DynamicRollbackCache):
        def extend(self, fed, keep=1):
            out = super().extend(fed, keep)
            return out + 0.25 * (len(fed) > 1)

    assert divergence.noise_floor(target, ids, 5, Noisy) == pytest.approx(0.25, abs=1e-3)


def test_identical_outputs_are_identical(target, near_draft, tokenizer, no_eos):
    ids = tokenizer(PROMPT)["input_ids"]
    got, _ = run(target, tokenizer, PROMPT, ModelProposer(near_draft, "near"), k=3, k_policy="fixed", max_new_tokens=16)
    plain, _ = run(target, tokenizer, PROMPT, max_new_tokens=16)
    assert divergence.explain(target, DynamicRollbackCache, ids, got, plain, 4).kind == IDENTICAL


def test_a_branch_at_a_near_tie_is_rounding_and_above_the_noise_a_mismatch(target, tokenizer):
    """The speculative side takes the runner-up at the closest call of plain decoding's output and
    goes on greedily from there: a near-tie when the noise covers that margin, a bug when it does not."""
    ids = tokenizer(PROMPT)["input_ids"]
    plain = greedy_continuation(target, ids, 12)
    with torch.inference_mode():
        rows = target(torch.tensor([ids + plain])).logits[0, len(ids) - 1 : -1].float()
    top2 = rows.topk(2).values
    j = int((top2[:, 0] - top2[:, 1]).argmin())
    runner_up = int(rows[j].topk(2).indices[1])
    spec = plain[:j] + [runner_up]
    spec += greedy_continuation(target, ids + spec, 12 - len(spec))
    margin = float(top2[j, 0] - top2[j, 1])
    tie = divergence.explain(target, DynamicRollbackCache, ids, spec, plain, 4, noise=margin * 1.5 + 1e-3)
    assert tie.kind == NEAR_TIE and tie.position == j and tie.margin == pytest.approx(margin, abs=1e-3)
    assert {t for t, _ in tie.plain_row[:2]} == {plain[j], runner_up}
    # The branch point: both rows' scores, the two candidates named, one click below a plain sentence.
    table = check.branch_point(tie, lambda t: f"tok{t}")
    line = check.divergence_line("Greedy check", tie, table)
    lead, below = line.split("<details>")
    assert f"Identical up to token {j}. There the target's two best tokens were almost tied" in lead
    assert "Precision › int8" in lead and "near-tie" not in lead
    assert "near-tie" in below and table in below
    assert f"token {j}" in table and f"tok{plain[j]}" in table and f"tok{runner_up}" in table
    assert "plain decoding's" in table and "speculative's" in table
    assert f"{tie.plain_row[0][1]:.3f}" in table and f"{dict(tie.verify_row)[tie.plain_row[0][0]]:.3f}" in table
    bug = divergence.explain(target, DynamicRollbackCache, ids, spec, plain, 4)
    assert bug.kind == MISMATCH and "a bug, not rounding" in check.divergence_line("Greedy check", bug)


PENALISED = SamplingConfig(0.0, 0, 1.0, 0, 3.0, 2)  # greedy, repetition penalty 3, no repeated 2-grams


def _penalised_branch(target, tokenizer):
    """(prompt ids, plain ids, speculative ids) of a greedy run under PENALISED whose speculative side
    branches at token 0 to the processed runner-up, as a near-tie would, and goes on under the rules."""
    ids = tokenizer(PROMPT * 2)["input_ids"]
    _, plain_steps = run(target, tokenizer, ids, None, max_new_tokens=16, repetition_penalty=3.0,
                         no_repeat_ngram_size=2)  # fmt: skip
    plain = [t for st in plain_steps for t in st.emitted]
    with torch.inference_mode():
        raw = target(torch.tensor([ids + plain])).logits[0, len(ids) - 1 : -1].float()
    assert any(int(raw[i].argmax()) != plain[i] for i in range(len(plain))), "the controls changed a choice"
    first = sampling.penalise(raw[:1], ids, [], PENALISED)[0]
    runner_up = int(first.topk(2).indices[1])
    _, rest = run(target, tokenizer, ids + [runner_up], None, max_new_tokens=15, repetition_penalty=3.0,
                  no_repeat_ngram_size=2)  # fmt: skip
    return ids, plain, [runner_up] + [t for st in rest for t in st.emitted]


def test_a_greedy_run_with_repetition_controls_is_held_to_its_processed_scores(target, tokenizer):
    """Greedy decoding under a repetition penalty takes the processed argmax, often not the raw one:
    after a near-tie branch, every later speculative token that followed those rules falls short of
    nothing. Held to the raw logits, the same text was reported as a bug."""
    ids, plain, spec = _penalised_branch(target, tokenizer)
    cfg = PENALISED
    branch = divergence.explain(target, DynamicRollbackCache, ids, spec, plain, 4, noise=1e-3, cfg=cfg)
    # The branch itself falls short by its margin, and no token after it falls short at all.
    assert branch.position == 0 and branch.worst_at == 0
    assert branch.worst_shortfall == pytest.approx(abs(branch.margin), abs=1e-4)
    noise = abs(branch.margin) * 1.5 + 1e-3
    assert divergence.explain(target, DynamicRollbackCache, ids, spec, plain, 4, noise=noise, cfg=cfg).kind == NEAR_TIE
    raw_verdict = divergence.explain(target, DynamicRollbackCache, ids, spec, plain, 4, noise=noise)
    assert raw_verdict.kind == MISMATCH and raw_verdict.worst_shortfall > noise, "raw logits: a false bug"


def test_the_benchs_greedy_check_holds_a_penalised_run_to_its_processed_scores(target, tokenizer):
    """The bench reports each differing contender's verdict with the run's settings, so a penalised
    bench run's near-tie is not a false mismatch either."""
    from types import SimpleNamespace as NS

    from app.bench import bench

    ids, plain, spec = _penalised_branch(target, tokenizer)
    margin = divergence.explain(target, DynamicRollbackCache, ids, spec, plain, 4, noise=1e-3, cfg=PENALISED).margin
    field = [NS(ours=True, name="autoregressive"), NS(ours=True, name="adaptive"), NS(ours=False, name="hf")]
    outputs = {"autoregressive": plain, "adaptive": spec, "hf": spec}
    steps = {"adaptive": [NS(emitted=spec, drafted=[0, 0, 0])]}
    costs = NS(logit_noise=abs(margin) * 1.5 + 1e-3)
    got = bench._divergences(NS(target=target), ids, field, outputs, steps, costs, PENALISED)
    assert list(got) == ["adaptive"] and got["adaptive"]["kind"] == NEAR_TIE and got["adaptive"]["position"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_planted_off_by_one_in_the_verify_rule_is_a_loud_mismatch(
    target, near_draft, tokenizer, no_eos, monkeypatch, dtype
):
    """The verify rule reads the next position's logits (an off-by-one): its drafts are judged against
    the wrong row and the output drifts from the target's, by far more than rounding."""
    p_model = copy.deepcopy(target).to(dtype)
    q_model = copy.deepcopy(near_draft).to(dtype)
    ids = tokenizer(PROMPT)["input_ids"]
    plain, _ = run(p_model, tokenizer, PROMPT, max_new_tokens=24)
    real = verify.greedy

    def off_by_one(drafts, parents, logits, teach=True, pending=None):
        return real(drafts, parents, logits.roll(-1, 0), teach, pending)

    monkeypatch.setattr(verify, "greedy", off_by_one)
    got, _ = run(p_model, tokenizer, PROMPT, ModelProposer(q_model, "near"), k=3, k_policy="fixed", max_new_tokens=24)
    monkeypatch.undo()
    assert got != plain
    noise = divergence.noise_floor(p_model, ids + plain, 4, DynamicRollbackCache)
    d = divergence.explain(p_model, DynamicRollbackCache, ids, got, plain, 4, noise)
    assert d.kind == MISMATCH and d.worst_shortfall > d.noise


def test_under_shared_noise_a_branch_at_a_close_race_is_rounding_and_above_the_noise_a_mismatch(target, tokenizer):
    """The same verdict for the same-seed check: the scores are the race's, log p − log E, whose
    noise floor is 2/T times the logits'."""
    from app.core import sampling
    from app.core.config import SHARED_NOISE, SamplingConfig

    cfg = SamplingConfig(temperature=0.8, seed=7, rule=SHARED_NOISE)

    def scores(history: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            p = sampling.probs(target(torch.tensor([history])).logits[0, -1], cfg).double()
        return p.log() - sampling.race_noise(cfg.seed, len(history), p.shape[-1]).double().log()

    def race_continuation(history: list[int], n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            out.append(int(scores(history + out).argmax()))
        return out

    ids = tokenizer(PROMPT)["input_ids"]
    plain = race_continuation(ids, 10)
    top2 = [scores(ids + plain[:i]).topk(2) for i in range(len(plain))]
    j = min(range(len(plain)), key=lambda i: float(top2[i].values[0] - top2[i].values[1]))
    spec = plain[:j] + [int(top2[j].indices[1])]
    spec += race_continuation(ids + spec, 10 - len(spec))
    margin = float(top2[j].values[0] - top2[j].values[1])
    noise = margin * cfg.temperature / 2 * 1.5 + 1e-3  # in logits: the race's floor is 2/T of it
    tie = divergence.explain(target, DynamicRollbackCache, ids, spec, plain, 4, noise=noise, cfg=cfg)
    assert tie.kind == NEAR_TIE and tie.position == j and tie.score == "race"
    assert tie.margin == pytest.approx(margin, abs=1e-3) and tie.noise == pytest.approx(noise * 2 / 0.8)
    line = check.divergence_line("Same-seed check (shared noise)", tie)
    assert "race scores log p − log E" in line and "near-tie" in line
    bug = divergence.explain(target, DynamicRollbackCache, ids, spec, plain, 4, cfg=cfg)
    assert bug.kind == MISMATCH and "a bug, not rounding" in check.divergence_line("Same-seed check", bug)
