"""The cost model's curves fitted from timings: the calibration's rounds split into draft, pass and
the rest, a pass curve lifted to the level rounds show, the draft's curve and line, a tree's own cost.
Pure arithmetic on timed records; calibrate.py times them."""

from __future__ import annotations

import itertools
import statistics

import numpy

from app.core import tree_shape
from app.core.costs import Costs, by_width

MIN_SEEN = 3  # rounds of one draft length or pass width before its time is used on its own


def tree_seconds(trees: list[tuple], costs: Costs, at: AtReference) -> tuple[float, float]:
    """(fixed seconds, seconds per node past the chain) that a tree round adds to a chain's drafting
    of its depth and a pass of its width: growing the tree, its mask, moving the kept path. A line
    through the tree rounds' medians by nodes past the chain; (0, 0) without tree rounds."""
    extra: dict[int, list[float]] = {}
    for s, _ in trees:
        if s.round <= 2:  # a run's first round after its prefill re-reads the prompt (split_rounds)
            continue
        depth = max(tree_shape.depths(s.parents), default=0)
        width = len(s.drafted) + 1
        spent = s.draft_time + at(width, s.verify_time, s.context)
        extra.setdefault(len(s.drafted) - depth, []).append(spent - costs.draft_time(depth) - costs.verify_time(width))
    points = {n: statistics.median(t) for n, t in extra.items()}
    return fit_line(points) if points else (0.0, 0.0)


class AtReference:
    """A pass timed in a round that began at `context`, as it would have cost at the reference context:
    the runs' contexts grow past it, and the curve's level must not rise with them."""

    def __init__(self, per_context: tuple[float, ...], reference: int):
        self.per_context, self.reference = per_context, reference

    def __call__(self, width: int, seconds: float, context: int | None) -> float:
        if not self.per_context or context is None:
            return seconds
        return seconds - by_width(self.per_context, width) * (context - self.reference)


def split_rounds(speculative: list[tuple], at: AtReference) -> tuple[dict, dict, list]:
    """Draft times by drafts made, pass times by width, and each round's time outside both."""
    drafts: dict[int, list[float]] = {}
    verifies: dict[int, list[float]] = {}
    outside, previous_k = [], None
    for s, busy in speculative:
        # A run's second round is the first after its prefill, and a feature head re-reads the whole
        # prompt in it: that draft time is no round's. So is any round after a change of k.
        if s.round > 2 and s.k == previous_k:
            drafts.setdefault(len(s.drafted), []).append(s.draft_time)
        previous_k = s.k
        width = len(s.drafted) + 1
        verifies.setdefault(width, []).append(at(width, s.verify_time, s.context))
        outside.append(busy - s.draft_time - s.verify_time)
    return drafts, verifies, outside


def verify_levels(curve: list[float], verifies: dict[int, list[float]]) -> list[float]:
    """The curve's shape at the level the rounds show, width by width, never falling as width grows.

    Passes timed back to back run faster than the same pass inside a round, after the draft has had
    the caches, and the round adds the verify rule and rollback to it. Prompt lookup drafts any length
    up to k, so only widths seen often enough count: one slowed round must not lift every wider pass.
    """
    seen = {
        n - 1: lower_quartile(t) - curve[n - 1] for n, t in verifies.items() if len(t) >= MIN_SEEN and n <= len(curve)
    }
    level = interpolate(seen, len(curve))  # [width - 1]
    return list(itertools.accumulate((max(0.0, c + d) for c, d in zip(curve, level, strict=True)), max))


def draft_curve(drafts: dict, draft_points: dict, ks: list[int], k_max: int, draft_round: float) -> list[float]:
    """Seconds to draft 0..k_max tokens, interpolated between the lengths the calibration ran (not the
    line; see Costs.draft_s) and never falling as k grows; [] where too few lengths were seen. A call
    that drafts nothing costs what such calls cost when seen (prompt lookup's search without a match),
    else the line's fixed part."""
    seen = {n for n, t in drafts.items() if len(t) >= MIN_SEEN}
    ran = {n: draft_points[n] for n in ks if n in seen}
    if not len(ran) == len(ks) > 2:
        return []
    draft = list(itertools.accumulate(interpolate(ran, k_max + 1)[1:], max))
    draft.insert(0, draft_points[0] if 0 in seen else draft_round)
    return draft


def interpolate(points: dict[int, float], n: int) -> list[float]:
    """Values at 0..n-1, piecewise linear through `points` and level beyond the outermost ones (0 without any)."""
    if not points:
        return [0.0] * n
    xs = sorted(points)
    return [float(v) for v in numpy.interp(range(n), xs, [points[x] for x in xs])]


def lower_quartile(values: list[float]) -> float:
    """The first quartile, between the smallest and largest value however few there are (0 for none)."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """(fixed, per-token) seconds of drafting by least squares over (tokens drafted, seconds).

    Both are kept >= 0; with a single draft length all the time is put per token.
    """
    if len(points) == 1:
        ((k, t),) = points.items()
        return (t, 0.0) if k == 0 else (0.0, t / k)
    ks, ts = list(points), list(points.values())
    mk, mt = statistics.fmean(ks), statistics.fmean(ts)
    slope = sum((k - mk) * (t - mt) for k, t in zip(ks, ts, strict=True)) / sum((k - mk) ** 2 for k in ks)
    slope = max(slope, 0.0)
    return max(mt - slope * mk, 0.0), slope
