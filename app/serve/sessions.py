"""Teaching sessions (Step one round) as plain data, with a small bounded cache of live runs.

A visitor's session is a `Teaching` record: the request's settings and the Step record of
each round computed so far, the newest KEEP_BACK in full and the older ones without their
teaching tables (a chain round is under a kilobyte in full, a few hundred bytes without). It
pickles (ZeroGPU sends a call's inputs and outputs between processes) and costs kilobytes, not
the megabytes of two KV caches. Step back re-shows a kept round and Step shows the kept rounds
after it again before computing a new one, so neither recomputes what is on record. A new round
continues a live run when this process still holds one; otherwise it re-runs the engine from
the seed, with the recorded k of each round, and lands on exactly the rounds shown before:
greedy decoding has no randomness, and sampling draws from one seeded generator in the same order.

Live runs are bounded twice: at most MAX_LIVE at once (least recently used goes first)
and TTL seconds without a step. An abandoned session therefore holds no model memory
for long, and no number of visitors holds more than MAX_LIVE runs' worth.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from app.core.config import UserError
from app.core.events import Step
from app.core.policy import KPolicy

# Live runs held at once; 0 always replays. On ZeroGPU a run lives in a worker process that the next call may not
# see, so there it always replays.
MAX_LIVE = int(os.environ.get("SPECDEC_TEACH_LIVE") or ("0" if os.environ.get("SPACES_ZERO_GPU") else "4"))
TTL = 600.0  # seconds a live run outlives its last step; after that the next Step replays
# Visitor sessions Gradio keeps in memory (each holds a copy of the page's values, its plots and records
# included, so about half a MiB after a run); the least recently used go first, and such a visitor's next
# Step starts again at round 1. Gradio's default of 10,000 let memory grow with every new visitor.
MAX_SESSIONS = int(os.environ.get("SPECDEC_SESSIONS") or 32)
STATE_TTL = 3600.0  # seconds the visitor's gr.State (kilobytes of plain data) outlives its last step
# Rounds Step back reaches: their tables are kept in full. Older rounds keep only what the pane
# draws, so a session of 2,048 one-token rounds stays under a megabyte.
KEEP_BACK = 32


@dataclass(frozen=True)
class Teaching:
    """One visitor's stepping session: plain, picklable data that rebuilds the run."""

    key: tuple  # the request's settings; a different key starts a new session
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    steps: tuple[Step, ...] = ()  # every round computed so far, in order (older than KEEP_BACK: slim)
    shown: int = 0  # rounds on screen: Step back lowers it, Step raises it before computing a new round
    done: bool = False  # the last round computed ended the generation

    @property
    def rounds(self) -> int:
        return len(self.steps)

    @property
    def ks(self) -> tuple[int, ...]:
        return tuple(s.k for s in self.steps)

    @property
    def nodes(self) -> tuple[int, ...]:  # each round's tree budget (0: a chain), where the policy shapes rounds
        return tuple(s.nodes for s in self.steps)

    @property
    def ended(self) -> bool:
        """The generation's last round is on screen: the next Step starts over."""
        return self.done and self.shown == self.rounds


class _Replay:
    """The request's own policy, made to choose the recorded k for the rounds already shown."""

    def __init__(self, inner: KPolicy, ks: tuple[int, ...], nodes: tuple[int, ...] = ()):
        self.inner, self.ks, self.nodes, self.round = inner, ks, nodes, 0

    def next_k(self) -> int:
        k = self.inner.next_k()
        if self.round < len(self.ks):
            k = self.ks[self.round]
        self.round += 1
        return k

    def next_nodes(self) -> int:  # asked after next_k, for the same round
        nodes = self.inner.next_nodes()
        return self.nodes[self.round - 1] if self.round - 1 < len(self.nodes) else nodes

    def update(self, drafted, accepted, context=None, parents=None, path=None):
        self.inner.update(drafted, accepted, context, parents, path)


@dataclass
class _Live:
    run: Iterator[Step]
    steps: list[Step]
    used: float


class LiveRuns:
    """Suspended engine runs by session id: least recently used out first, and none older than ttl."""

    def __init__(self, max_live: int = MAX_LIVE, ttl: float = TTL, clock: Callable[[], float] = time.monotonic):
        self.max_live, self.ttl, self.clock = max_live, ttl, clock
        self._runs: OrderedDict[str, _Live] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._runs)

    def take(self, session_id: str) -> _Live | None:
        """Remove and return a session's live run (a run is advanced by one request at a time)."""
        with self._lock:
            self._expire()
            return self._runs.pop(session_id, None)

    def put(self, session_id: str, live: _Live) -> None:
        if self.max_live <= 0:
            return
        with self._lock:
            live.used = self.clock()
            self._runs[session_id] = live
            self._runs.move_to_end(session_id)
            self._expire()
            while len(self._runs) > self.max_live:
                self._runs.popitem(last=False)

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._runs.pop(session_id, None)

    def _expire(self) -> None:
        now = self.clock()
        for sid in [s for s, live in self._runs.items() if now - live.used > self.ttl]:
            del self._runs[sid]


LIVE = LiveRuns()


def forget(session: Teaching | None) -> None:
    """gr.State's delete_callback: the visitor left or the state expired, so drop the live run."""
    if isinstance(session, Teaching):
        LIVE.drop(session.id)


Start = Callable[[KPolicy | None], Iterator[Step]]  # a fresh engine run of the request, with this policy


def advance(
    session: Teaching | None, key: tuple, start: Start, policy: Callable[[], KPolicy], live: LiveRuns | None = None
) -> tuple[Teaching, list[Step], Step | None]:
    """Show one more round: (the updated session, every round up to it, that round or None at the end).

    After Step back it is the next kept round, nothing computed; else the engine runs one round.
    `start(policy)` begins the request's engine run; `policy()` makes the request's own k policy.
    A new key, or a session whose last round is on screen, starts over from round 1. `live`
    defaults to the app's store.
    """
    live = LIVE if live is None else live
    if session is None or session.key != key or session.ended:
        if session is not None:
            live.drop(session.id)
        session = Teaching(key)
    if session.shown < session.rounds:
        return at(session, session.shown + 1)
    held = live.take(session.id)
    if held is None or len(held.steps) != session.rounds:
        held = _rebuild(session, start, policy)
    step = next(held.run, None)
    if step is None:
        return replace(session, done=True), held.steps, None
    held.steps.append(step)
    session = replace(session, steps=_kept(session.steps, step), shown=session.rounds + 1, done=bool(step.stop_reason))
    if not session.done:
        live.put(session.id, held)
    return session, held.steps, step


def back(session: Teaching | None) -> tuple[Teaching, list[Step], Step] | None:
    """Step back: the round before the one on screen, from the session's records (nothing is
    recomputed), or None where there is none to go back to (round 1, or past KEEP_BACK)."""
    if session is None or session.shown <= 1 or session.shown - 1 <= session.rounds - KEEP_BACK:
        return None
    return at(session, session.shown - 1)


def at(session: Teaching, shown: int | None = None) -> tuple[Teaching, list[Step], Step]:
    """The session showing its first `shown` kept rounds (None: those on screen), the last of them."""
    shown = session.shown if shown is None else shown
    steps = list(session.steps[:shown])
    return replace(session, shown=shown), steps, steps[-1]


def _kept(steps: tuple[Step, ...], step: Step) -> tuple[Step, ...]:
    """The session's records with `step` added; the round that falls out of Step back's reach keeps only
    what the pane draws (its text and kinds), not its teaching tables."""
    old = len(steps) - KEEP_BACK
    if old >= 0:
        steps = (*steps[:old], replace(steps[old], decisions=[], top=[], race=[]), *steps[old + 1 :])
    return (*steps, step)


def _rebuild(session: Teaching, start: Start, policy: Callable[[], KPolicy]) -> _Live:
    """Re-run the engine through the rounds already shown, with their k, and hold it there."""
    run = start(_Replay(policy(), session.ks, session.nodes))
    steps = []
    for k in session.ks:
        step = next(run, None)
        if step is None or step.k != k:  # cannot happen with a deterministic engine; say so if it does
            raise UserError("this teaching session could not be resumed: press Step to start again")
        steps.append(step)
    return _Live(run, steps, 0.0)
