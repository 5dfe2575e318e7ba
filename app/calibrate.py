"""A quick measurement of this machine's costs for a pair, taken when it is first used with a kind
of sampling (`cost_class`).

The target's pass time for 1..k_max+1 new tokens is timed directly on a cached context, which
gives the curve's shape, and again on a longer one, which gives how it grows with the context;
short engine runs at a few draft lengths set its level and give the draft's cost and the round's
cost outside both, so they include exactly what a real round includes (prompt lookup's search
too, which is not free). It takes a second or two for a small pair; sampled rounds take longer.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from app import runs
from app.core import cost_fit, divergence, engine
from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig
from app.core.costs import Costs
from app.core.policy import FixedK
from app.kv import static_cache
from app.kv.cache import DynamicRollbackCache
from app.models import context_length

# Code with some repetition, so prompt lookup finds matches as it does in real code.
PROBE = '''import os


def walk(root, suffix=".py"):
    """Yield every file under root that ends with suffix."""
    for path, dirs, files in os.walk(root):
        for name in files:
            if name.endswith(suffix):
                yield os.path.join(path, name)


def count(root, suffix=".py"):
    """How many files under root end with suffix."""
    return sum(1 for _ in walk(root, suffix))


def sizes(root, suffix=".py"):
'''
# Passes cost more as the cache fills, a wide pass the most. The curve is timed after CONTEXT tokens
# (half the window, for a model with a short one) and again after up to twice as many, which gives
# each width's cost per context token (Costs.verify_time), so a run is predicted at the contexts its
# rounds read; timed at one context alone, the model predicted rounds fast.
CONTEXT = 256
# Over fewer tokens between the two contexts (a short window), the curves' difference is mostly
# timing noise: no slope is measured.
MIN_SPAN = 32
REPS = 5  # timed passes per width, after one warm-up
# Pass times keep the fastest of their repetitions: on a shared machine another process only ever
# adds time, so the minimum is the stable estimate of the curve's shape. Plain rounds and the passes
# inside rounds take the lower quartile: a neighbour busy about half the time slows about half the
# rounds, which is where a median sits, while the lower quartile stays on unhurried rounds as long as
# a quarter of them are. Draft times keep their median: most of their spread is the draft's own (a
# feature head first re-reads every position the target just kept, so a round after an early
# rejection is quick), and their lower quartile, with a pass curve timed back to back alone, put real
# rounds short. A neighbour busy through most speculative runs
# then lowers the prediction rather than raising it. The engine's own work per round is a
# difference of timings, so it keeps the median too.
# Plain and speculative runs take turns for the same reason: a burst that outlasts one short run
# then slows some rounds of each kind, not all rounds of one (docs/how-it-works.md, the cost model).

BLOCK = 4  # rounds in a row with the same k; the first of each block is not timed
PARTS = 3  # turns of a short plain run and a short speculative run


def lengths(k_max: int) -> list[int]:
    """The draft lengths a calibration runs: 1, the middle and k_max."""
    return sorted({1, (k_max + 1) // 2, k_max})


class _Alternate(FixedK):
    """Drafts each of `lengths` for BLOCK rounds in turn. Blocks, not strict alternation: a feature
    head's round starts by re-reading the positions kept in the round before, so a round is only
    timed after one of the same k, as in a real run."""

    def __init__(self, spec: SpecConfig):
        super().__init__(spec)
        self._ks = itertools.cycle([k for k in lengths(spec.k_max) for _ in range(BLOCK)])

    def next_k(self) -> int:
        return next(self._ks)


def pass_times(
    target, context: list[int], widths: int, cache: Callable = DynamicRollbackCache, reps: int = REPS
) -> list[float]:
    """Fastest seconds of one target pass over n = 1..widths new tokens after `context`, as timed.

    Widths are interleaved within each repetition so drift on a shared machine hits all alike.
    """
    return pass_widths(target, context, list(range(1, widths + 1)), cache, reps)


def verify_curve(
    target, context: list[int], widths: int, cache: Callable = DynamicRollbackCache, reps: int = REPS, widest: int = 0
) -> list[float]:
    """Seconds of one target pass over n = 1..max(widths, widest) new tokens after `context`
    (pass_times, smoothed): every width up to `widths`, and a few up to `widest` (wide_widths)."""
    fastest = pass_times(target, context, widths, cache, reps)
    if widths < 3:
        curve = list(itertools.accumulate(fastest, max))
    else:
        # Beyond one token a pass costs about a + b n (one matrix product per layer, wider): a line
        # through all widths averages out a spike at any one of them.
        a, b = cost_fit.fit_line(dict(enumerate(fastest[1:], start=2)))
        curve = [fastest[0]] + [max(fastest[0], a + b * n) for n in range(2, widths + 1)]
    wide = wide_widths(widths, widest)
    if not wide:
        return curve
    # Past the widths a chain verifies, a pass is flat while the hardware has room and then grows:
    # no line fits both, so a tree's widths are timed and joined piecewise.
    points = {widths: curve[-1], **dict(zip(wide, pass_widths(target, context, wide, cache, reps), strict=True))}
    joined = cost_fit.interpolate(points, widest + 1)[widths + 1 :]
    return list(itertools.accumulate(curve + joined, max))


def wide_widths(widths: int, widest: int) -> list[int]:
    """The widths past `widths` timed for trees: doubling from 12, and `widest` itself."""
    out = [w for w in (12, 16, 24, 32, 48) if widths < w < widest]
    return out + [widest] if widest > widths else out


@torch.inference_mode()
def pass_widths(
    target, context: list[int], widths: list[int], cache: Callable = DynamicRollbackCache, reps: int = REPS
) -> list[float]:
    """Fastest seconds of one target pass over each of `widths` new tokens after `context`."""
    lm = cache(target)
    lm.extend(context, keep=1)
    base = lm.length
    probe = (context * (max(widths) // max(len(context), 1) + 1))[: max(widths)]
    times: list[list[float]] = [[] for _ in widths]
    for rep in range(reps + 1):
        for i, n in enumerate(widths):
            start = time.perf_counter()
            lm.extend(probe[:n], keep=n)
            engine.sync(lm.device)
            if rep:
                times[i].append(time.perf_counter() - start)
            lm.rollback(base)
    lm.close()
    return [min(t) for t in times]


def _busy(steps) -> list[tuple]:
    """(step, busy seconds of its round) for every round after the first, which holds the prefills."""
    return [(b, b.elapsed - a.elapsed) for a, b in itertools.pairwise(steps)]


def cost_class(s: SamplingConfig) -> tuple:
    """What of a request's sampling settings changes the time of a round, not its text: greedy or
    sampled, top-k and top-p filtering when sampling (greedy rounds take the argmax and never filter,
    and the UI passes its sliders either way), each repetition control, and the sampling rule.
    Temperature and seed do not."""
    sampled = not s.greedy
    return (
        sampled,
        sampled and s.top_k > 0,
        sampled and s.top_p < 1,
        s.repetition_penalty != 1.0,
        s.no_repeat_ngram_size > 0,
        sampled and s.rule,  # shared noise draws a noise row per position instead of the rule's draws
    )


class _Turns:
    """Short runs of one kind after another, each going on from the text the last one of its kind
    produced, so turns see new text."""

    def __init__(self, pair, ids: list[int], settings: Settings, target_cache: Callable, policy=_Alternate):
        self.pair, self.settings, self.cache, self.size = pair, settings, target_cache, len(ids)
        self.policy = policy
        self.contexts = {False: ids, True: ids}

    def rounds(self, speculative: bool, n: int) -> list[tuple]:
        """(step, busy seconds) of n rounds after a first one, over more runs if EOS ends one early."""
        out = []
        for _ in range(8):
            context = self.contexts[speculative]
            run = runs.prepare(self.pair, context, self.settings, speculative=speculative, caches=self.cache)
            policy = self.policy(self.settings.spec) if speculative else None
            steps = list(itertools.islice(run.steps(policy), n + 1))
            out += _busy(steps)
            self.contexts[speculative] = (context + [t for s in steps for t in s.emitted])[-self.size :]
            if len(out) >= n:
                break
        return out


def measure(
    pair,
    k_max: int,
    target_cache: Callable = DynamicRollbackCache,
    sampling: SamplingConfig | None = None,
    tree: int = 0,
    report: Callable[[float], None] | None = None,
) -> Costs:
    """Costs of `pair` (models.Pair) on this machine for up to k_max drafts per round, with the rounds
    run under `sampling` (default greedy). Sampled rounds cost more than greedy ones, more so the more
    they draft: a probability row and a draw for every draft, a filtered row for every verified
    position, and the repetition controls over the history at each, so each kind is timed on its own.
    tree: the most nodes a tree may have (0: chains only); the pass is then timed up to that width,
    and a few rounds draft trees, which price a tree round beyond a chain's (Costs.tree_fixed_s,
    draft_node_s). `report(fraction)`, when given, hears how far the measurement has come."""
    report = report or (lambda fraction: None)
    report(0.0)
    probe = pair.tokenizer(PROBE)["input_ids"]
    limit, new_tokens = _window(pair, max(k_max, tree), target_cache)
    n = min(limit // 2, CONTEXT)
    ids = _repeat(probe, n)
    widest = tree + 1 if tree > k_max else 0
    curve = verify_curve(pair.target, ids, k_max + 1, target_cache, widest=widest)
    far = min(2 * n, limit - len(curve))
    report(0.15)
    per_context = context_slopes(pair.target, probe, curve, n, far, target_cache, dense=k_max + 1)
    report(0.3)
    # A round's pass feeds the last kept token again after len(ids) - 1 cached ones, so the curve's
    # passes after n cached tokens stand for rounds that begin at n + 1 (Step.context).
    at = cost_fit.AtReference(per_context, n + 1)
    spec = SpecConfig(k=1, k_policy="fixed", k_max=k_max)
    turns = _Turns(
        pair, ids, Settings(sampling or SamplingConfig(), spec, RunConfig(max_new_tokens=new_tokens)), target_cache
    )
    ks = lengths(k_max)
    tree_turns = _tree_turns(pair, ids, turns.settings, target_cache, k_max, tree)
    plain, speculative, trees = _take_turns(turns, tree_turns, len(ks), report)
    drafts, verifies, outside = cost_fit.split_rounds(speculative, at)
    verifies[1] = [at(1, s.verify_time, s.context) for s, _ in plain] + verifies.get(1, [])
    draft_points = {k: statistics.median(t) for k, t in drafts.items()} or {0: 0.0}
    draft_round, draft_token = cost_fit.fit_line(draft_points)
    verify = cost_fit.verify_levels(curve, verifies)
    costs = Costs(
        verify_s=tuple(verify),
        draft_round_s=draft_round,
        draft_token_s=draft_token,
        overhead_s=max(0.0, statistics.median(outside or [0.0])),
        plain_round_s=max(verify[0], cost_fit.lower_quartile([at(1, t, s.context) for s, t in plain])),
        draft_s=tuple(cost_fit.draft_curve(drafts, draft_points, ks, k_max, draft_round)),
        verify_per_context_s=per_context,
        context=at.reference,
        logit_noise=divergence.noise_floor(pair.target, ids, k_max + 1, target_cache),
    )
    if not trees:
        return costs
    fixed, per_node = cost_fit.tree_seconds(trees, costs, at)
    return replace(costs, tree_fixed_s=fixed, draft_node_s=per_node)


def _take_turns(turns: _Turns, tree_turns: list[_Turns], n_lengths: int, report: Callable) -> tuple[list, list, list]:
    """(plain, chain, tree) rounds, PARTS turns of each in a row, so a burst of load slows some of each."""
    plain, speculative, trees = [], [], []
    for part in range(PARTS):
        plain += turns.rounds(False, 4)
        speculative += turns.rounds(True, n_lengths * BLOCK)  # each run must hold one whole block of each length
        for t in tree_turns:
            trees += t.rounds(True, BLOCK)
        report(0.3 + 0.6 * (part + 1) / PARTS)
    return plain, speculative, trees


def _tree_turns(pair, ids: list[int], settings: Settings, target_cache: Callable, k_max: int, tree: int) -> list:
    """Turns of rounds drafting trees, a small one and the widest a run may choose (none without trees):
    what their rounds cost beyond a chain's drafting and a pass of their width is a tree's own cost
    (cost_fit.tree_seconds). They go k_max deep, or half the budget deep where the budget is no wider
    than k_max: the cost model chooses such trees too, and unmeasured they would cost nothing extra."""
    depth = k_max if tree > k_max else tree // 2
    if depth < 1:
        return []
    sizes = sorted({min(tree, depth + 2), tree})
    specs = [SpecConfig(k=depth, k_policy="fixed", k_max=k_max, tree=n) for n in sizes]
    return [_Turns(pair, ids, replace(settings, spec=spec), target_cache, policy=FixedK) for spec in specs]


def _window(pair, k_max: int, target_cache: Callable) -> tuple[int, int]:
    """(the context the calibration may use, new tokens a run may emit)."""
    # The draft's window too: runs stop where the smaller window ends, and then no round is timed.
    # The window as the engine reads it: the proposer's own context_limit (None: no limit of its own).
    own = pair.proposer(SpecConfig(k_max=k_max)).context_limit
    limit = min(context_length(pair.target), own or 1 << 20)
    new_tokens = 16 * (k_max + 1)  # a cap: runs stop after a few blocks of rounds
    if isinstance(target_cache, static_cache.StaticCachePool):
        # A static cache (the GPU path) holds only its own request's length, which may be less than the
        # usual context, and a pass past its end is an error, not a stop: everything shrinks to fit.
        limit = min(limit, static_cache.room(target_cache.max_len))
        new_tokens = min(new_tokens, limit - limit // 2)
    return limit, new_tokens


def context_slopes(
    target,
    probe: list[int],
    curve: list[float],
    n: int,
    far: int,
    target_cache: Callable = DynamicRollbackCache,
    dense: int | None = None,
) -> tuple[float, ...]:
    """Seconds more per context token for a pass over 1..len(curve) new tokens, from `curve` (timed
    after n tokens) and the same curve timed after `far`; () when far is too close to n to tell.

    Never negative, and never less for a wider pass, which reads the cache with more queries.
    dense: the widths timed one by one (verify_curve's `widths`), when the curve reaches past them.
    """
    if far - n < MIN_SPAN:
        return ()
    dense = dense or len(curve)
    widest = len(curve) if len(curve) > dense else 0
    curve_far = verify_curve(target, _repeat(probe, far), dense, target_cache, widest=widest)
    return tuple(
        itertools.accumulate((max(0.0, (b - a) / (far - n)) for a, b in zip(curve, curve_far, strict=True)), max)
    )


def _repeat(probe: list[int], n: int) -> list[int]:
    """The last n tokens of the probe repeated: a context of n tokens."""
    return (probe * (n // len(probe) + 1))[-n:]


def check_passes(pair, k_max: int, target_cache: Callable = DynamicRollbackCache) -> list[float]:
    """Fastest seconds of a one-token pass and of the widest chain's pass after the calibration's context:
    a second's worth of timing that tells whether a kept calibration still holds here."""
    limit, _ = _window(pair, k_max, target_cache)
    ids = _repeat(pair.tokenizer(PROBE)["input_ids"], min(limit // 2, CONTEXT))
    return pass_widths(pair.target, ids, [1, k_max + 1], target_cache)
