"""A pair, prompt ids and settings turned into a Step stream: the proposer, the KV caches (the static
fast path where it runs), the k policy and the engine's hooks. Every front end runs through here."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from app.core import engine
from app.core.config import Settings
from app.core.contracts import Proposer
from app.core.costs import Costs
from app.core.events import Step
from app.core.policy import KPolicy, make_policy
from app.core.record import Recorder
from app.kv import static_cache
from app.kv.cache import DynamicRollbackCache
from app.models import threads
from app.models.pair import Pair

# Spare positions of a paused stream's target cache. A growing cache's usual 256 (growing_cache.ROOM)
# spare a regrowing copy per pass; a stream paused while its visitor reads pays that copy only every
# few rounds, and holds a fifth of the memory (SmolLM2 int8: 6 MiB at a 44-token prompt, not 28).
PAUSED_ROOM = 16


@dataclass
class Run:
    """One request, ready to stream. steps() may be called again for a fresh run of the same request."""

    pair: Pair
    ids: list[int]
    settings: Settings
    speculative: bool = True
    target_cache: Callable = DynamicRollbackCache
    draft_cache: Callable | None = None  # for drafts that run a model's cache; None: their own default
    costs: Costs | None = None  # this machine's, when calibrated (calibrate.py)
    note: str = ""  # why the fast path does or does not run

    def proposer(self) -> Proposer | None:
        """A fresh draft source for one stream (its caches and ids are that stream's own)."""
        if not self.speculative:
            return None
        proposer = self.pair.proposer(self.settings.spec)
        if self.draft_cache is not None and proposer.cache_factory is not None:
            proposer.cache_factory = self.draft_cache
        pool = self.target_cache
        if isinstance(pool, static_cache.StaticCachePool) and pool.graphs and hasattr(proposer, "static_len"):
            proposer.static_len = pool.max_len  # a feature head's own passes as graphs too (head_passes.py)
        return proposer

    def policy(self) -> KPolicy:
        return make_policy(self.settings.spec, self.costs)

    def steps(
        self, policy: KPolicy | None = None, teach: bool = False, display: bool = True, paused: bool = False
    ) -> Iterator[Step]:
        """The engine's Step stream; teach fills the teaching tables of every round, and display=False
        leaves out the drafts' own text, which only a view reads (record.Recorder). paused: the stream
        is read a round at a time and held between reads (the teaching view), so its caches keep little
        spare room (PAUSED_ROOM)."""
        s = self.settings
        target_cache = self.target_cache
        if paused and target_cache is DynamicRollbackCache:
            target_cache = functools.partial(DynamicRollbackCache, room=PAUSED_ROOM)
        return engine.generate(
            self.pair.target,
            self.pair.tokenizer,
            self.ids,
            self.proposer(),
            target_cache=target_cache,
            sampling_cfg=s.sampling,
            spec=s.spec,
            run=s.run,
            policy=policy or self.policy(),
            recorder=Recorder(self.pair.tokenizer, display=display, teach=teach),
            before_round=threads.match_load,
        )


def prepare(
    pair: Pair,
    ids: list[int],
    settings: Settings,
    *,
    speculative: bool = True,
    fast_path: str | None = None,
    caches: Callable | None = None,
) -> Run:
    """A Run on static caches and CUDA graphs where the fast path runs (static_cache.available: by
    default on CUDA; None: the server's setting, static_cache.default_mode), else on the usual caches.
    `caches` names the target's cache instead (a measurement's own); a static pool serves a model
    draft too."""
    if caches is not None:
        draft_cache = _draft_side(caches) if isinstance(caches, static_cache.StaticCachePool) else None
        return Run(pair, list(ids), settings, speculative, caches, draft_cache)
    kind, note = static_cache.available(fast_path or static_cache.default_mode(), pair.target.device, pair.target)
    if kind is None:
        return Run(pair, list(ids), settings, speculative, note=note)
    max_len, width = static_cache.cache_length(len(ids), settings.run.max_new_tokens), None
    if kind == "graphs" and not settings.spec.tree:
        # One pass width for every round of this request's settings (a plain run's too), where the probe
        # finds a row the same bits wherever it sits in such a pass: then speculative output is plain
        # decoding's exactly, as on a CPU in int8. Chains only: a tree's ancestors sit apart in its pass,
        # and the attention may group their sums differently from plain decoding's.
        need = static_cache.fixed_width(static_cache.widest_pass(settings.spec))
        if static_cache.rows_exact(pair.target, need, max_len):
            width = need
            note += f"; every round's pass {need} tokens wide, whose rows are the same bits wherever they sit (probed)"
        else:
            note += f"; rows of {need}-token passes differ by where they sit here (probed): not exact at every width"
    caches = static_cache.StaticCachePool(max_len, compile=kind == "compile", graphs=kind == "graphs", width=width)
    return Run(pair, list(ids), settings, speculative, caches, _draft_side(caches), note=note)


def _draft_side(caches: static_cache.StaticCachePool) -> Callable:
    """A model draft's cache beside a static target cache: the same kind of pool at the bucket widths
    (its passes are compared with nothing), or the dynamic cache for a draft the static path cannot
    hold (sliding windows), which then runs eagerly."""
    own = dataclasses.replace(caches, width=None)

    def make(model):
        return own(model) if static_cache.unsupported(model) is None else DynamicRollbackCache(model)

    return make
