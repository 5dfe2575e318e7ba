"""Handlers' model work runs on the process's compute threads, whichever server thread calls them: each
OS thread that runs torch keeps an OpenMP team, and one team more than the cores slows every pass."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from app.serve import compute_thread, zerogpu


def test_streams_and_calls_from_many_server_threads_run_on_one_compute_thread():
    ran = []

    @compute_thread.runs_on
    def stream(n):
        for i in range(n):
            ran.append(threading.get_ident())
            yield i

    @compute_thread.runs_on
    def once():
        ran.append(threading.get_ident())
        return 7

    with ThreadPoolExecutor(4) as server_threads:  # as a web server calls handlers: any free thread
        streamed = list(server_threads.map(lambda _: list(stream(3)), range(4)))
        assert server_threads.submit(once).result() == 7
    assert streamed == [[0, 1, 2]] * 4, "every stream yields its own items in order"
    assert len(set(ran)) == 1, "one compute thread did all the work (the default concurrency is 1)"
    assert ran[0] != threading.get_ident()


def test_a_stream_ended_early_is_closed_on_the_compute_thread():
    where = {}

    @compute_thread.runs_on
    def endless():
        try:
            while True:
                where["ran"] = threading.get_ident()
                yield 1
        finally:
            where["closed"] = threading.get_ident()

    it = endless()
    assert next(it) == 1
    it.close()  # a cancelled event closes its generator
    assert where["closed"] == where["ran"] != threading.get_ident()


def test_errors_cross_back_and_the_page_handlers_are_wrapped():
    @compute_thread.runs_on
    def fails():
        raise ValueError("bad")
        yield  # a generator function

    try:
        list(fails())
    except ValueError as e:
        assert str(e) == "bad"
    else:
        raise AssertionError("the handler's error reaches its caller")
    from app.serve import ui

    for handler in (ui.generate_both, ui.step_round):
        assert handler.__wrapped__ in zerogpu.GPU_FUNCTIONS  # gpu() put it on the compute threads
