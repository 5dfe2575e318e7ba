"""A fair queue: no visitor holds more than a few places, and no run holds the device for long.

Gradio's queue has one global size, so a single client posting joins could fill all of it
and every later visitor got "Queue is full". `install` puts a per-visitor cap in front of
the queue: jobs waiting or running per browser session, and per client address. Behind a
proxy (a Space, or SPECDEC_TRUST_PROXY=1) the address is the first X-Forwarded-For entry,
since every request arrives from the proxy; elsewhere that header is the client's own word
and is ignored. A whole class behind one school NAT shares an address, so that cap is wide.

SPECDEC_CONCURRENCY is how many generations share the device at once (default 1). Each run
has its own KV caches, so memory grows with it: raise it only where the device has room for
that many runs of the largest allowed model at the longest allowed length.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from app.core.config import UserError

MAX_QUEUED = 64  # places in the whole queue
MAX_CONCURRENCY = 8  # SPECDEC_CONCURRENCY above this is refused: one device, one memory


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


def per_session() -> int:
    """Jobs one browser session may have waiting or running (a run is two chained jobs at most)."""
    return _env_int("SPECDEC_QUEUE_PER_SESSION", 2, 1, MAX_QUEUED)


def per_ip() -> int:
    """Jobs one client address may have waiting or running: wide, for classrooms behind one NAT."""
    return _env_int("SPECDEC_QUEUE_PER_IP", 16, 1, MAX_QUEUED)


def concurrency() -> int:
    """Generations that share the device at once: SPECDEC_CONCURRENCY, default 1."""
    return _env_int("SPECDEC_CONCURRENCY", 1, 1, MAX_CONCURRENCY)


def run_seconds() -> float:
    """The deadline of one run: past it, a generation ends as if Stop were pressed."""
    return float(_env_int("SPECDEC_RUN_SECONDS", 180, 5, 3600))


def behind_proxy() -> bool:
    return bool(os.environ.get("SPACE_ID")) or os.environ.get("SPECDEC_TRUST_PROXY") == "1"


def client_ip(request) -> str:
    """The visitor's address: the proxy's X-Forwarded-For where there is a proxy, else the peer."""
    if request is None:
        return "?"
    if behind_proxy():
        forwarded = request.headers.get("x-forwarded-for", "")
        if forwarded.strip():
            return forwarded.split(",")[0].strip()
    return request.client.host if request.client else "?"


def _held(queue, matches: Callable) -> int:
    """Jobs in Gradio's queue (waiting or running) for which matches(event) is true."""
    waiting = [e for q in queue.event_queue_per_concurrency_id.values() for e in q.queue]
    running = [e for job in queue.active_jobs if job for e in job]
    return sum(1 for e in waiting + running if matches(e))


def refusal(queue, session_hash: str | None, ip: str, session_cap: int, ip_cap: int) -> str | None:
    """Why this visitor may not queue one more job now, or None if they may."""
    mine = _held(queue, lambda e: e.session_hash == session_hash)
    if session_hash and mine >= session_cap:
        return (
            f"You already have {mine} requests waiting or running; each visitor may have {session_cap}. "
            "Wait for them to finish, or press Stop."
        )
    here = _held(queue, lambda e: client_ip(e.request) == ip)
    if here >= ip_cap:
        return (
            f"Your network already has {here} requests waiting or running (at most {ip_cap}). "
            "Please try again in a moment."
        )
    return None


def install(demo) -> None:
    """Put the per-session and per-address caps in front of demo's queue (call after demo.queue()).

    Gradio 6 has no per-visitor cap, so this wraps its Queue.push, the one entry of every job;
    a refusal is a 400 whose detail is the message above, which the browser shows as it is
    (a "queue_full" 503 would reach visitors only as a generic "busy").
    """
    queue = demo._queue
    push = queue.push
    session_cap, ip_cap = per_session(), per_ip()
    lock = asyncio.Lock()  # the count and the push are one step, or two joins could both pass

    async def capped_push(body, request, username):
        async with lock:
            why = refusal(queue, body.session_hash, client_ip(request), session_cap, ip_cap)
            if why:
                return False, why, "error"
            return await push(body=body, request=request, username=username)

    queue.push = capped_push
