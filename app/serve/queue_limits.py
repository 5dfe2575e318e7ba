"""A fair queue: no client address holds more than its share, and no run holds the device for long.

Gradio's queue has one global size, so a single client posting joins could fill all of it
and every later visitor got "Queue is full". `install` puts three checks in front of the
queue, all keyed on the client's address, since everything else in a join (its session hash
included) is the client's own choice:
- an address holds at most a quarter of the places the other addresses leave free, so no
  number of addresses fills the queue and a newcomer always finds a place;
- an address joins at most SPECDEC_JOINS_PER_MINUTE times a minute;
- a browser session holds at most a few places (a courtesy for honest clients; a script can
  pick new session hashes, which is why the address counts).

The address: behind a proxy (a Space, or SPECDEC_TRUST_PROXY=1) every request arrives from the
proxy, which appends the address it saw to X-Forwarded-For. Whatever a client wrote there
itself comes first, so the address is the entry the trusted proxy added: the last one, or
with SPECDEC_PROXY_HOPS=N proxies in a row, the N-th from the end. Elsewhere the header is
the client's own word and is ignored. A whole class behind one school NAT shares an address,
and so its few places: a host serving a classroom raises SPECDEC_QUEUE_PER_IP. A queued visitor
sees Gradio's own status: their place in the queue and its estimated wait.

An address whose requests keep being refused (a 4xx: a closed route, a join over its caps, a
stream for a session the queue does not hold) is answered at once with a 429, before Gradio does
any work, once SPECDEC_REFUSALS_PER_MINUTE (120) of its requests were refused within a minute: a
script's loop of refused calls then costs the server the least a request can, and the log holds one
line a minute for that address, not a line (or a traceback) for each call.

These limits, and a run's deadline (SPECDEC_RUN_SECONDS), bind a public server (models/hosting.py:
a Space, a bind beyond loopback, or a request that came through a proxy). A private server is its
owner's: none applies there unless its variable is set.

SPECDEC_CONCURRENCY is how many generations share the device at once (default 1). Each run
has its own KV caches, so memory grows with it: raise it only where the device has room for
that many runs of the largest allowed model at the longest allowed length.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection

from app.core.config import UserError
from app.models import hosting

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_QUEUED = 64  # places in the whole queue
PER_IP = 3  # places one address may hold at most (SPECDEC_QUEUE_PER_IP)
SHARE = 4  # an address holds at most 1/SHARE of the places the other addresses leave free
MAX_CONCURRENCY = 8  # SPECDEC_CONCURRENCY above this is refused: one device, one memory
RATE_WINDOW = 60.0  # seconds over which joins per address are counted
MAX_TRACKED = 10_000  # addresses whose recent joins are remembered; the stalest go first
SESSION_VAR, IP_VAR, RATE_VAR = "SPECDEC_QUEUE_PER_SESSION", "SPECDEC_QUEUE_PER_IP", "SPECDEC_JOINS_PER_MINUTE"
REFUSALS_VAR = "SPECDEC_REFUSALS_PER_MINUTE"


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        raise UserError(f"{name} must be a whole number, got {raw!r}") from None
    if not lo <= n <= hi:
        raise UserError(f"{name} must be from {lo} to {hi}, got {n}")
    return n


def enforced(name: str) -> bool:
    """Whether the limit that variable `name` sets binds now: on a public server, or where it is set."""
    return bool(os.environ.get(name, "").strip()) or hosting.public()


def per_session() -> int:
    """Jobs one browser session may have waiting or running (a run is two chained jobs at most)."""
    return _env_int(SESSION_VAR, 2, 1, MAX_QUEUED)


def per_ip() -> int:
    """Jobs one client address may have waiting or running at most, whatever its fair share: a few, so
    one address's flood adds minutes, not an hour, to a newcomer's wait (a classroom behind one NAT
    raises it with SPECDEC_QUEUE_PER_IP)."""
    return _env_int(IP_VAR, PER_IP, 1, MAX_QUEUED)


def joins_per_minute() -> int:
    """Joins one client address may make in a minute: a classroom's clicks, not a script's loop."""
    return _env_int(RATE_VAR, 120, 1, 100_000)


def refusals_per_minute() -> int:
    """Refused requests an address may make in a minute before its requests are answered with a 429:
    a page load's stray 404s, and a classroom's, stay far below it."""
    return _env_int(REFUSALS_VAR, 120, 1, 100_000)


def concurrency() -> int:
    """Generations that share the device at once: SPECDEC_CONCURRENCY, default 1."""
    return _env_int("SPECDEC_CONCURRENCY", 1, 1, MAX_CONCURRENCY)


def run_seconds() -> float:
    """The deadline of one run: past it, a generation ends as if Stop were pressed (none on a
    private server unless SPECDEC_RUN_SECONDS is set)."""
    if not enforced("SPECDEC_RUN_SECONDS"):
        return float("inf")
    return float(_env_int("SPECDEC_RUN_SECONDS", 180, 5, 3600))


def stopper(control: dict | None) -> Callable[[], bool]:
    """Whether a run starting now should end: its visitor pressed Stop, or it has passed run_seconds()."""
    deadline = time.monotonic() + run_seconds()
    return lambda: bool(control and control.get("stop")) or time.monotonic() > deadline


def load_seconds() -> float:
    """How long a request waits for a model load before the load goes on without it."""
    return float(_env_int("SPECDEC_LOAD_SECONDS", 60, 1, 3600))


_loads: dict[tuple, Future] = {}  # loads under way, by what they load: a second request waits on the first
_loads_lock = threading.RLock()  # reentrant: a load already done runs its callback at once


def _in_thread_of_its_own(load: Callable[[], T]) -> Future:
    """load() on a thread that ends with it, so a lookup never waits behind slow downloads of others.
    Not a pool: a thread that lives on keeps the OpenMP team a load's torch ops made, and one team more
    than the compute threads' stops OpenMP's workers spinning in every pass (compute_thread.py)."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(load())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name="specdec-load", daemon=True).start()
    return future


WAIT_REPORT_SECONDS = 0.5  # how often a request waiting on a load tells its page how far it is


def within_load_time(
    key: tuple, load: Callable[[], T], seconds: float | None = None, waiting: Callable[[], None] | None = None
) -> T:
    """load(), waited for at most `seconds` (load_seconds()); a slower load goes on in the background.

    A request therefore holds its place on the device for a bounded time however slow a download is;
    the next request for the same key finds the load under way, or its result in the model cache.
    `waiting` is called every WAIT_REPORT_SECONDS while the request waits (to report progress).
    """
    with _loads_lock:
        future = _loads.get(key)
        if future is None:
            future = _loads[key] = _in_thread_of_its_own(load)
            future.add_done_callback(lambda _: _forget(key, future))
    deadline = time.monotonic() + (load_seconds() if seconds is None else seconds)
    while True:
        left = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, min(left, WAIT_REPORT_SECONDS) if waiting else left))
        except FutureTimeout:
            if time.monotonic() >= deadline:
                raise UserError(
                    "the models are still loading (a first download can take minutes); the load goes on in "
                    "the background, so try again in a minute"
                ) from None
            if waiting is not None:
                waiting()


def _forget(key: tuple, future: Future) -> None:
    with _loads_lock:
        if _loads.get(key) is future:
            del _loads[key]


def behind_proxy() -> bool:
    return bool(os.environ.get("SPACE_ID")) or os.environ.get("SPECDEC_TRUST_PROXY") == "1"


def distrust_forwarding() -> None:
    """Keep uvicorn from taking a client's address from X-Forwarded-For. By default it trusts the
    header from a loopback peer (FORWARDED_ALLOW_IPS), so on a loopback bind, or behind a local proxy
    the app was not told of, a visitor could name any address and dodge the per-address caps. The app
    reads the header itself, only as its own proxy setting says (client_ip)."""
    os.environ["FORWARDED_ALLOW_IPS"] = ""  # no peer's header is trusted: an empty list of hosts


def proxy_hops() -> int:
    """How many trusted proxies in a row append to X-Forwarded-For (a Space has one)."""
    return _env_int("SPECDEC_PROXY_HOPS", 1, 1, 16)


def client_ip(request) -> str:
    """The visitor's address: the entry the trusted proxy appended to X-Forwarded-For, else the peer."""
    if request is None:
        return "?"
    peer = request.client.host if request.client else "?"
    if behind_proxy():
        entries = [e.strip() for e in request.headers.get("x-forwarded-for", "").split(",")]
        entries = [e for e in entries if e]
        if entries:
            return entries[-min(proxy_hops(), len(entries))][:64]
    return peer


def fair_share(held_by_others: int, cap: int, size: int = MAX_QUEUED) -> int:
    """Places one address may hold: 1/SHARE of what the others leave free (at least one), at most cap."""
    return max(1, min(cap, (size - held_by_others) // SHARE))


def _events(queue) -> list:
    """Jobs in Gradio's queue, waiting or running."""
    waiting = [e for q in queue.event_queue_per_concurrency_id.values() for e in q.queue]
    return waiting + [e for job in queue.active_jobs if job for e in job]


def refusal(queue, session_hash: str | None, ip: str, session_cap: int, ip_cap: int) -> str | None:
    """Why this visitor may not queue one more job now, or None if they may."""
    events = _events(queue)
    mine = sum(1 for e in events if e.session_hash == session_hash)
    if session_hash and mine >= session_cap:
        return (
            f"You already have {mine} requests waiting or running; each visitor may have {session_cap}. "
            "Wait for them to finish, or press Stop."
        )
    here = sum(1 for e in events if client_ip(e.request) == ip)
    share = fair_share(len(events) - here, ip_cap)
    if here >= share:
        return (
            f"Your network already has {here} requests waiting or running (at most {share} while the "
            "server is this busy). Please try again in a moment."
        )
    return None


class AddressRate:
    """Events per address (joins, refusals) over the last `window` seconds; at most `limit` of them."""

    def __init__(self, limit: int, window: float = RATE_WINDOW, clock: Callable[[], float] = time.monotonic):
        self.limit, self.window, self.clock = limit, window, clock
        self._seen: OrderedDict[str, deque] = OrderedDict()

    def _recent(self, ip: str, keep: bool) -> deque:
        now = self.clock()
        seen = self._seen.pop(ip, None) or deque()
        while seen and now - seen[0] > self.window:
            seen.popleft()
        if keep or seen:  # an address with nothing recent is not remembered by a mere look
            self._seen[ip] = seen  # most recently seen last, so the stalest address is dropped first
            while len(self._seen) > MAX_TRACKED:
                self._seen.popitem(last=False)
        return seen

    def full(self, ip: str) -> bool:
        """Whether `ip` has had `limit` events within the window."""
        return len(self._recent(ip, keep=False)) >= self.limit

    def count(self, ip: str) -> None:
        """Count an event from `ip` (past the limit it is not: the window ends a window after the limit)."""
        seen = self._recent(ip, keep=True)
        if len(seen) < self.limit:
            seen.append(self.clock())

    def admit(self, ip: str) -> bool:
        """Count a join from `ip` and say whether it is within the limit (a refused join is not counted)."""
        if self.full(ip):
            return False
        self.count(ip)
        return True


TOO_MANY = b"Too many refused requests from your network. Please wait a minute."


class Refusals:
    """ASGI middleware: counts each address's refused requests, and past refusals_per_minute() (where
    it binds) answers the address's requests with a 429 before Gradio sees them.

    Gradio refuses a queue stream for a session it does not hold (a made-up hash, or a client
    reopening a stream that broke off) only after the stream has started: it sends the client an error event,
    then raises, and uvicorn would log a traceback of some 80 lines for each such request. Here that
    ends the response cleanly and counts as a refusal; its address is logged once a minute at most.
    """

    def __init__(self, app):
        self.app, self.rate = app, AddressRate(refusals_per_minute())
        self._noted = AddressRate(1)  # addresses logged within the last minute

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ip = client_ip(HTTPConnection(scope))
        if enforced(REFUSALS_VAR) and self.rate.full(ip):
            self._note(ip, f"{self.rate.limit} refused requests within a minute; its requests get a 429 for now")
            return await _answer(send, 429, TOO_MANY)
        status = 0

        async def watched(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if not status or not _refused(e):
                raise
            status = 404  # the stream was refused after its 200 went out; its error event was sent
            self._note(ip, "asked for a queue stream the queue does not hold (refused)")
            with contextlib.suppress(OSError):  # the client may be gone already
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        if 400 <= status < 500 and enforced(REFUSALS_VAR):  # a private server's refusals are not held against it
            self.rate.count(ip)

    def _note(self, ip: str, what: str) -> None:
        if self._noted.admit(ip):
            log.warning("%s: %s", ip, what)


def _refused(e: BaseException | None) -> bool:
    """Whether an exception is (or was caused by) an HTTP refusal: Starlette wraps one raised after the
    response started in a RuntimeError."""
    for _ in range(8):  # a short chain: the refusal and Starlette's wrapper
        if e is None:
            return False
        if isinstance(e, HTTPException) and 400 <= e.status_code < 500:
            return True
        e = e.__cause__ or e.__context__
    return False


async def _answer(send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", str(int(RATE_WINDOW)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install(demo) -> None:
    """Put the per-address and per-session checks in front of demo's queue (call after demo.queue()).

    Gradio 6 has no per-visitor cap, so this wraps its Queue.push, the one entry of every job;
    a refusal is a 400 whose detail is the message above, which the browser shows as it is
    (a "queue_full" 503 would reach visitors only as a generic "busy").
    """
    queue = demo._queue
    push = queue.push
    session_cap, ip_cap, rate = per_session(), per_ip(), AddressRate(joins_per_minute())
    lock = asyncio.Lock()  # the count and the push are one step, or two joins could both pass

    async def capped_push(body, request, username):
        async with lock:
            ip = client_ip(request)
            caps = [c if enforced(n) else MAX_QUEUED for c, n in ((session_cap, SESSION_VAR), (ip_cap, IP_VAR))]
            private = caps == [MAX_QUEUED, MAX_QUEUED]  # a private server's queue is its owner's
            why = None if private else refusal(queue, body.session_hash, ip, *caps)
            if not why and enforced(RATE_VAR) and not rate.admit(ip):
                why = f"Too many requests from your network this minute (at most {rate.limit}). Please wait a moment."
            if why:
                return False, why, "error"
            return await push(body=body, request=request, username=username)

    queue.push = capped_push
    clean = queue.clean_events

    async def clean_and_forget(*args, **kwargs):
        """Gradio's clean_events, run when a stream's client has gone; then, once no live job of the
        session is left, its message queue goes too. Gradio drops it on one of its two ways of noticing
        the client left but keeps it on the other, and a stream reopened for the session then waited on
        it for ever (the cancelled job never writes again); now Gradio refuses that stream at once."""
        await clean(*args, **kwargs)
        session = kwargs.get("session_hash")
        if session and not any(e.session_hash == session and e.alive for e in _events(queue)):
            with contextlib.suppress(KeyError):
                del queue.pending_messages_per_session[session]
            queue.pending_event_ids_session.pop(session, None)

    queue.clean_events = clean_and_forget
