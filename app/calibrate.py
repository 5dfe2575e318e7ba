"""A quick measurement of this machine's costs for a pair, taken when it is first used with a kind
of sampling (`cost_class`).

The target's pass time for 1..k_max+1 new tokens is timed directly on a cached context, which
gives the curve's shape, and again on a longer one, which gives how it grows with the context;
short engine runs at a few draft lengths set its level and give the draft's cost and the round's
cost outside both, so they include exactly what a real round includes (prompt lookup's search
too, which is not free). 1.4-1.6 s for the bundled pairs, greedy; sampled rounds take longer.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable

import numpy
import torch

from app import engine, static_cache, threads
from app.cache import CachedModel
from app.config import RunConfig, SamplingConfig, SpecConfig
from app.costs import Costs, by_width
from app.models import context_length
from app.policy import KPolicy, make_policy

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
# rounds read (240-500 tokens in the bundled suite). Timed at one context alone, the model had
# predicted rounds 7-10% fast at 128 tokens and 3-7% at 256.
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
# rounds of the bundled pair 7-31% short at k = 2..8. A neighbour busy through most speculative runs
# then lowers the prediction rather than raising it. The engine's own work per round is a
# difference of timings, so it keeps the median too.
# Plain and speculative runs take turns for the same reason: a burst that outlasts one short run
# then slows some rounds of each kind, not all rounds of one (README, "predicted for this machine").

_cache: dict[tuple, Costs] = {}
_lock = threading.Lock()
MAX_CACHED = 16


BLOCK = 4  # rounds in a row with the same k; the first of each block is not timed
PARTS = 3  # turns of a short plain run and a short speculative run
MIN_SEEN = 3  # rounds of one draft length or pass width before its time is used on its own


def lengths(k_max: int) -> list[int]:
    """The draft lengths a calibration runs: 1, the middle and k_max."""
    return sorted({1, (k_max + 1) // 2, k_max})


class _Alternate(KPolicy):
    """Drafts each of `lengths` for BLOCK rounds in turn. Blocks, not strict alternation: a feature
    head's round starts by re-reading the positions kept in the round before, so a round is only
    timed after one of the same k, as in a real run."""

    def __init__(self, spec: SpecConfig):
        super().__init__(spec)
        self._ks = itertools.cycle([k for k in lengths(spec.k_max) for _ in range(BLOCK)])

    def next_k(self) -> int:
        return next(self._ks)


@torch.inference_mode()
def verify_curve(target, context: list[int], widths: int, cache: Callable = CachedModel,
                 reps: int = REPS) -> list[float]:
    """Fastest seconds of one target pass over n = 1..widths new tokens after `context`.

    Widths are interleaved within each repetition so drift on a shared machine hits all alike.
    """
    lm = cache(target)
    lm.extend(context, keep=1)
    base = lm.length
    probe = (context * (widths // max(len(context), 1) + 1))[:widths]
    times: list[list[float]] = [[] for _ in range(widths)]
    for rep in range(reps + 1):
        for n in range(1, widths + 1):
            start = time.perf_counter()
            lm.extend(probe[:n], keep=n)
            engine.sync(lm.device)
            if rep:  # rep 0 is the warm-up
                times[n - 1].append(time.perf_counter() - start)
            lm.rollback(base)
    fastest = [min(t) for t in times]
    if widths < 3:
        return list(itertools.accumulate(fastest, max))
    # Beyond one token a pass costs about a + b n (one matrix product per layer, wider): a line
    # through all widths averages out a spike at any one of them.
    a, b = _fit_line(dict(enumerate(fastest[1:], start=2)))
    return [fastest[0]] + [max(fastest[0], a + b * n) for n in range(2, widths + 1)]


def _busy(steps) -> list[tuple]:
    """(step, busy seconds of its round) for every round after the first, which holds the prefills."""
    return [(b, b.elapsed - a.elapsed) for a, b in itertools.pairwise(steps)]


def cost_class(s: SamplingConfig) -> tuple:
    """What of a request's sampling settings changes the time of a round, not its text: greedy or
    sampled, top-k and top-p filtering when sampling (greedy rounds take the argmax and never filter,
    and the UI passes its sliders either way), and each repetition control. Temperature and seed do not."""
    sampled = not s.greedy
    return (sampled, sampled and s.top_k > 0, sampled and s.top_p < 1, s.repetition_penalty != 1.0,
            s.no_repeat_ngram_size > 0)


def measure(pair, k_max: int, target_cache: Callable = CachedModel, sampling: SamplingConfig | None = None) -> Costs:
    """Costs of `pair` (models.Pair) on this machine for up to k_max drafts per round, with the rounds
    run under `sampling` (default greedy). Sampled rounds cost more than greedy ones, more so the
    more they draft: a probability row and a draw for every draft, a filtered row for every verified
    position, and the repetition controls over the history at each. With the bundled feature pair
    and the prose examples' settings (T = 0.7, top-p 0.95, both repetition controls), 8 drafts took
    34-36 ms against 19-25 greedy and a 9-token pass 24-28 ms against 16-19, beside one busy process;
    the greedy model chose k = 8 at a = 0.9 where the sampled one chose 4-5."""
    probe = pair.tokenizer(PROBE)["input_ids"]
    # The draft's window too: runs stop where the smaller window ends, and then no round is timed.
    limit = context_length(pair.target, *filter(None, [pair.draft_model]))
    new_tokens = 16 * (k_max + 1)  # a cap: runs stop after a few blocks of rounds (`rounds` below)
    if isinstance(target_cache, static_cache.StaticCaches):
        # A static cache (the GPU path) holds only its own request's length, which may be less than the
        # usual context, and a pass past its end is an error, not a stop: everything shrinks to fit.
        limit = min(limit, static_cache.room(target_cache.max_len))
        new_tokens = min(new_tokens, limit - limit // 2)
    n = min(limit // 2, CONTEXT)
    ids = _repeat(probe, n)
    curve = verify_curve(pair.target, ids, k_max + 1, target_cache)
    per_context = context_slopes(pair.target, probe, curve, n, min(2 * n, limit - k_max - 1), target_cache)
    # A round's pass feeds the last kept token again after len(ids) - 1 cached ones, so the curve's
    # passes after n cached tokens stand for rounds that begin at n + 1 (Step.context).
    reference = n + 1

    def at_reference(width: int, seconds: float, context: int | None) -> float:
        """A pass timed in a round that began at `context`, as it would have cost at the reference:
        the runs' contexts grow past it, and the curve's level must not rise with them."""
        if not per_context or context is None:
            return seconds
        return seconds - by_width(per_context, width) * (context - reference)

    sampling, run = sampling or SamplingConfig(), RunConfig(max_new_tokens=new_tokens)
    spec = SpecConfig(k=1, k_policy="fixed", k_max=k_max)
    ks = lengths(k_max)
    kw = {} if target_cache is CachedModel else dict(target_cache=target_cache)

    contexts = {False: ids, True: ids}

    def rounds(speculative: bool, n: int) -> list[tuple]:
        """(step, busy seconds) of n rounds after a first one, over more runs if EOS ends one early.
        Each call goes on from the text the last one of its kind produced, so turns see new text."""
        out = []
        for _ in range(8):
            context = contexts[speculative]
            proposer, policy = (pair.proposer(spec), _Alternate(spec)) if speculative else (None, None)
            it = engine.generate(pair.target, pair.tokenizer, context, proposer, sampling, spec, run, policy, **kw)
            steps = list(itertools.islice(it, n + 1))
            out += _busy(steps)
            contexts[speculative] = (context + [t for s in steps for t in s.emitted])[-len(ids):]
            if len(out) >= n:
                break
        return out

    plain, speculative = [], []
    for _ in range(PARTS):
        plain += rounds(False, 4)
        # each run must hold one whole block of each length
        speculative += rounds(True, len(ks) * BLOCK)
    drafts: dict[int, list[float]] = {}
    verifies: dict[int, list[float]] = {1: [at_reference(1, s.verify_time, s.context) for s, _ in plain]}
    outside = []
    previous_k = None
    for s, busy in speculative:
        # A run's second round is the first after its prefill, and a feature head re-reads the whole
        # prompt in it: that draft time is no round's. So is any round after a change of k.
        if s.round > 2 and s.k == previous_k:
            drafts.setdefault(len(s.drafted), []).append(s.draft_time)
        previous_k = s.k
        verifies.setdefault(len(s.drafted) + 1, []).append(at_reference(len(s.drafted) + 1, s.verify_time, s.context))
        outside.append(busy - s.draft_time - s.verify_time)
    draft_points = {n: statistics.median(t) for n, t in drafts.items()} or {0: 0.0}
    draft_round, draft_token = _fit_line(draft_points)
    # Passes timed back to back run faster than the same pass inside a round, after the draft has
    # had the caches (a 9-token pass of the bundled target: 5.9-6.3 ms alone, 7.1-7.8 ms in rounds),
    # and the round adds the verify rule and rollback to it. So the curve keeps its shape and takes
    # its level, width by width, from the rounds. Prompt lookup drafts any length up to k, so only
    # widths seen often enough count: one slowed round must not lift every wider pass.
    level = _interpolate({n - 1: _lower_quartile(t) - curve[n - 1] for n, t in verifies.items()
                          if len(t) >= MIN_SEEN and n <= len(curve)}, len(curve))  # [width - 1]
    verify = list(itertools.accumulate((max(0.0, c + d) for c, d in zip(curve, level, strict=True)), max))
    # Between the lengths the calibration ran, the draft's cost is interpolated, not the line (see
    # Costs.draft_s), and never falls as k grows. A call that drafts nothing costs what such calls
    # cost when seen (prompt lookup's search without a match), else the line's fixed part.
    seen = {n for n, t in drafts.items() if len(t) >= MIN_SEEN}
    ran = {n: draft_points[n] for n in ks if n in seen}
    draft = []
    if len(ran) == len(ks) > 2:
        draft = list(itertools.accumulate(_interpolate(ran, k_max + 1)[1:], max))
        draft.insert(0, draft_points[0] if 0 in seen else draft_round)
    return Costs(verify_s=tuple(verify), draft_round_s=draft_round, draft_token_s=draft_token,
                 overhead_s=max(0.0, statistics.median(outside or [0.0])),
                 plain_round_s=max(verify[0], _lower_quartile([at_reference(1, t, s.context) for s, t in plain])),
                 draft_s=tuple(draft), verify_per_context_s=per_context, context=reference)


def context_slopes(target, probe: list[int], curve: list[float], n: int, far: int,
                   target_cache: Callable = CachedModel) -> tuple[float, ...]:
    """Seconds more per context token for a pass over 1..len(curve) new tokens, from `curve` (timed
    after n tokens) and the same curve timed after `far`; () when far is too close to n to tell.

    Never negative, and never less for a wider pass, which reads the cache with more queries.
    """
    if far - n < MIN_SPAN:
        return ()
    curve_far = verify_curve(target, _repeat(probe, far), len(curve), target_cache)
    return tuple(itertools.accumulate((max(0.0, (b - a) / (far - n)) for a, b in zip(curve, curve_far, strict=True)),
                                      max))


def _repeat(probe: list[int], n: int) -> list[int]:
    """The last n tokens of the probe repeated: a context of n tokens."""
    return (probe * (n // len(probe) + 1))[-n:]


def _interpolate(points: dict[int, float], n: int) -> list[float]:
    """Values at 0..n-1, piecewise linear through `points` and level beyond the outermost ones (0 without any)."""
    if not points:
        return [0.0] * n
    xs = sorted(points)
    return [float(v) for v in numpy.interp(range(n), xs, [points[x] for x in xs])]


def _lower_quartile(values: list[float]) -> float:
    """The first quartile, between the smallest and largest value however few there are (0 for none)."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def _fit_line(points: dict[int, float]) -> tuple[float, float]:
    """(fixed, per-token) seconds of drafting by least squares over (tokens drafted, seconds).

    Both are kept >= 0; with a single draft length all the time is put per token.
    """
    if len(points) == 1:
        (k, t), = points.items()
        return (t, 0.0) if k == 0 else (0.0, t / k)
    ks, ts = list(points), list(points.values())
    mk, mt = statistics.fmean(ks), statistics.fmean(ts)
    slope = sum((k - mk) * (t - mt) for k, t in zip(ks, ts, strict=True)) / sum((k - mk) ** 2 for k in ks)
    slope = max(slope, 0.0)
    return max(mt - slope * mk, 0.0), slope


def costs_for(pair, spec: SpecConfig, target_cache: Callable = CachedModel,
              sampling: SamplingConfig | None = None) -> Costs:
    """This machine's costs for `pair`, measured once per pair, draft, k_max, threads, cache kind and
    cost class of the sampling settings (`cost_class`; default greedy), under the first request's."""
    sampling = sampling or SamplingConfig()
    key = (pair.target_name, pair.draft_name, str(pair.target.device), pair.target.dtype, spec.k_max,
           threads.key(), getattr(target_cache, "__name__", str(target_cache)), cost_class(sampling))
    with _lock:
        if key not in _cache:
            if len(_cache) >= MAX_CACHED:  # the least recently used goes: greedy stays while it is in use
                _cache.pop(next(iter(_cache)))
            _cache[key] = measure(pair, spec.k_max, target_cache, sampling=sampling)
        _cache[key] = _cache.pop(key)  # now the most recently used
        return _cache[key]


def policy_for(pair, spec: SpecConfig, target_cache: Callable = CachedModel,
               sampling: SamplingConfig | None = None) -> KPolicy:
    """A fresh k policy for one request; adaptive k is guided by this machine's measured costs."""
    costs = costs_for(pair, spec, target_cache, sampling) if spec.k_policy == "adaptive" else None
    return make_policy(spec, costs)
