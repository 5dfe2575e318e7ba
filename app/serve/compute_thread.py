"""Every handler's model work on the same few threads, so torch's OpenMP runs at full speed.

A web server runs each call, and each step of a streaming call, on whichever of its many worker
threads is free. Every OS thread that enters an OpenMP parallel region keeps a team of its own, and
once the live teams hold more threads than the machine has cores, GNU OpenMP stops its workers'
spin-waiting: every parallel region then pays for waking its workers. On a 2-core CPU that made the
int8 pass of the bundled target about twice as slow on a server thread as on the main thread
(a one-token pass 16.6 against 8.7 ms) and every float op about 1.4 times as slow. So the handlers'
work runs on a pool of `queue_limits.concurrency()` threads that live as long as the process: one
team each, as in the CLI. The queue lets that many device events run at once (ui.py), so none waits
here for a thread; a streaming handler's steps each run there in turn.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

PREFIX = "specdec-compute"
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """The process's compute threads, started at first use."""
    global _pool
    with _lock:
        if _pool is None:
            from app.serve import queue_limits

            _pool = ThreadPoolExecutor(max_workers=queue_limits.concurrency(), thread_name_prefix=PREFIX)
        return _pool


def _call(fn: Callable, *args):
    """fn(*args) on a compute thread, in a copy of the caller's context (Gradio keeps a request's
    progress and session there); from a compute thread itself, right here."""
    if threading.current_thread().name.startswith(PREFIX):
        return fn(*args)
    return pool().submit(contextvars.copy_context().run, fn, *args).result()


def _step(it):
    """The next item of `it`, or a sentinel: StopIteration cannot cross a Future."""
    try:
        return False, next(it)
    except StopIteration:
        return True, None


def runs_on(fn: Callable) -> Callable:
    """fn, run on the compute threads: a generator function stays one, each of its steps run there."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(*args, **kwargs):
            it = fn(*args, **kwargs)  # creating a generator runs none of its body
            try:
                while True:
                    done, item = _call(_step, it)
                    if done:
                        return
                    yield item
            finally:
                _call(it.close)  # a cancelled stream ends where it ran

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _call(functools.partial(fn, *args, **kwargs))

    return wrapper
