"""Every summary figure, computed once from the Step records (no torch, no gradio)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy

from app.core.costs import Costs, expected_tokens_per_pass
from app.core.events import BONUS, CORRECTED, TARGET, Step

# What each speedup figure means; the JSON report carries these beside the numbers.
LABELS = {
    "theoretical_speedup": "Leviathan et al.'s idealised speedup: with this machine's costs, the same "
    "inputs as predicted_speedup but every verify pass costed as a one-token pass, so it is never below "
    "it; without them, the measured alpha and c with one verify pass costed as one plain step",
    "predicted_speedup": "predicted for this machine: the same expected tokens per round over this "
    "machine's measured round time (verify time per width and context length, "
    "draft cost, overhead), "
    "plus the run's first round (the prompt's prefill) as measured, on both sides",
    "achieved_speedup": "measured: speculative tokens/s over autoregressive tokens/s",
}


def expected_speedup(alpha: float, c: float, k: float) -> float:
    """S = (1 - a^(k+1)) / ((1 - a)(k c + 1)): walltime gain over the target alone."""
    return expected_tokens_per_pass(alpha, k) / (k * c + 1)


def summarize(steps: Sequence[Step], costs: Costs | None = None) -> dict:
    """Summary of one run (speculative or autoregressive) from its records.

    acceptance_rate is accepted / drafted; alpha is accepted / (accepted + rejections),
    the per-token rate in Leviathan's formula. They differ because a round stops
    judging at its first rejection. With `costs` (calibrate.py), predicted_speedup is
    what this machine's cost model expects at the measured alpha for these rounds, with the first
    round (the prefills) as measured.
    """
    tokens = sum(len(s.emitted) for s in steps)
    drafted = sum(len(s.drafted) for s in steps)
    accepted = sum(s.accepted for s in steps)
    rejections = sum(1 for s in steps if s.accepted < len(s.drafted))
    elapsed = steps[-1].elapsed if steps else 0.0
    # Round 1 carries both prefills; c is about steady-state steps, so it is left out.
    later = [s for s in steps[1:] if s.drafted]
    draft_per_token = sum(s.draft_time for s in later) / max(sum(len(s.drafted) for s in later), 1)
    verify_per_pass = sum(s.verify_time for s in later) / max(len(later), 1)
    c = draft_per_token / verify_per_pass if later and verify_per_pass > 0 else None
    alpha = accepted / (accepted + rejections) if accepted + rejections else None
    mean_k = drafted / max(sum(1 for s in steps if s.drafted), 1)
    stats = dict(
        new_tokens=tokens,
        rounds=len(steps),
        # How each round's own token came about: corrected, bonus, or target (nothing drafted).
        rounds_by_kind={kind: sum(s.token_kind == kind for s in steps) for kind in (CORRECTED, BONUS, TARGET)},
        target_passes=len(steps),
        drafted=drafted,
        accepted=accepted,
        rejections=rejections,
        acceptance_rate=accepted / drafted if drafted else None,
        alpha=alpha,
        tokens_per_pass=tokens / len(steps) if steps else None,
        mean_k=mean_k if drafted else None,
        elapsed_s=elapsed,
        tokens_per_s=tokens / elapsed if elapsed > 0 else None,
        time_to_first_token_s=steps[0].elapsed if steps else None,
        draft_time_s=sum(s.draft_time for s in steps),
        verify_time_s=sum(s.verify_time for s in steps),
        cost_ratio_c=c,
        # Drafts a round that drafted, verified in its one pass: k for a chain, a tree's node count.
        nodes_per_round=mean_k if drafted else None,
        tree_rounds=sum(1 for s in steps if s.is_tree),
        expected_tokens_per_pass=None,
        theoretical_speedup=None,
        predicted_speedup=None,
        stop_reason=steps[-1].stop_reason if steps else None,
    )
    # The formulas are a chain's: a tree's rounds keep more than they expect at the same alpha.
    if alpha is not None and drafted and not any(s.is_tree for s in steps):
        stats |= _expected(steps, min(alpha, 1.0), c, mean_k, costs)
    return stats


def _expected(steps: Sequence[Step], alpha: float, c: float | None, mean_k: float, costs: Costs | None) -> dict:
    """What the formulas expect of a run that drafted: tokens per pass, and the idealised and
    predicted speedups (the machine's cost model's, with `costs`)."""
    out = dict(expected_tokens_per_pass=expected_tokens_per_pass(alpha, mean_k))
    if c is not None:
        out["theoretical_speedup"] = expected_speedup(alpha, c, mean_k)
    if costs is not None:
        # Round 1 holds the prompt's prefill, which plain decoding pays too: it counts as measured.
        # Both figures read the same inputs, so only the width of a verify pass sets them apart.
        inputs: dict[str, Any] = dict(
            alpha=alpha,
            draft_lengths=[len(s.drafted) for s in steps[1:]],
            first_round_s=steps[0].elapsed,
            contexts=[s.context for s in steps[1:]],
        )
        out["predicted_speedup"] = costs.predicted_speedup(**inputs)
        out["theoretical_speedup"] = costs.idealised_speedup(**inputs)
    return out


def compare(spec: dict, ar: dict) -> dict:
    """Achieved speedup of a speculative run over an autoregressive one, by throughput."""
    achieved = None
    if spec.get("tokens_per_s") and ar.get("tokens_per_s"):
        achieved = spec["tokens_per_s"] / ar["tokens_per_s"]
    return dict(
        achieved_speedup=achieved,
        theoretical_speedup=spec.get("theoretical_speedup"),
        predicted_speedup=spec.get("predicted_speedup"),
    )


def acceptance_by_position(steps: Sequence[Step]) -> list[float]:
    """Share of rounds in which draft i (1..k) was accepted, among rounds that drafted it."""
    offered: list[int] = []
    kept: list[int] = []
    for s in steps:
        for i in range(len(s.drafted)):
            if i == len(offered):
                offered.append(0)
                kept.append(0)
            offered[i] += 1
            kept[i] += i < s.accepted
    return [k / o for k, o in zip(kept, offered, strict=True)]


def report(steps: Sequence[Step], target: str, draft: str | None, settings: dict, costs: Costs | None = None) -> dict:
    """The JSON document of one run: text, generated ids, records and summary.

    `costs` (this machine's, from calibrate.py) adds predicted_speedup and the measured costs.
    """
    return dict(
        text="".join(s.text for s in steps),
        token_ids=[t for s in steps for t in s.emitted],
        target=target,
        draft=draft,
        settings=settings,
        stats=summarize(steps, costs),
        labels=LABELS,
        costs=costs.to_dict() if costs is not None else None,
        steps=[s.to_dict() for s in steps],
    )


BOOTSTRAP_DRAWS = 10_000  # the interval's ends then move by about 0.001 from seed to seed
MIN_PROMPTS = 5  # below this, resampling prompts says little, and one prompt says nothing


def alpha_interval(counts: list[tuple[int, int]], draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval of pooled alpha, resampling prompts: counts holds each prompt's
    (accepted, rejections). Prompts, not rounds, are the unit: rounds of one prompt share its text,
    and a goal such as alpha >= 0.90 is only met if another draw of prompts would meet it too."""
    n = numpy.array([a + r for a, r in counts], dtype=float)
    if len(n) < MIN_PROMPTS or not n.sum():
        return None
    accepted = numpy.array([a for a, _ in counts], dtype=float)
    pick = numpy.random.default_rng(seed).integers(0, len(n), size=(draws, len(n)))
    totals = n[pick].sum(axis=1)
    kept = totals > 0  # a resample of prompts without a single decision has no alpha
    alphas = accepted[pick].sum(axis=1)[kept] / totals[kept]
    if not alphas.size:
        return None
    return [float(x) for x in numpy.quantile(alphas, [0.025, 0.975])]
