"""A fair queue: one visitor cannot take more than its cap, others still get served; runs end by a deadline."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest
from app_server import serve

from app.core.config import UserError
from app.serve import queue_limits

pytestmark = pytest.mark.slow  # servers

ARGS = [
    "def f(a):\n    return a",
    "stdlib-code target (bundled)",
    "",
    "distilled draft (bundled)",
    "",
    False,
    "greedy",
    0.8,
    0,
    1.0,
    0,
    40,
    "adaptive",
    4,
    1.0,
    0,
]


def _event(session: str, ip: str):
    request = SimpleNamespace(headers={"x-forwarded-for": ip}, client=SimpleNamespace(host="10.9.9.9"))
    return SimpleNamespace(session_hash=session, request=request)


def test_caps_count_waiting_and_running_jobs_per_session_and_address(monkeypatch):
    monkeypatch.setenv("SPECDEC_TRUST_PROXY", "1")
    queue = SimpleNamespace(
        event_queue_per_concurrency_id={
            "device": SimpleNamespace(queue=[_event("a", "1.1.1.1"), _event("b", "1.1.1.1")])
        },
        active_jobs=[[_event("a", "1.1.1.1")], None],
    )
    assert "each visitor may have 2" in queue_limits.refusal(queue, "a", "1.1.1.1", 2, 10)
    assert queue_limits.refusal(queue, "b", "1.1.1.1", 2, 10) is None
    assert "Your network" in queue_limits.refusal(queue, "c", "1.1.1.1", 2, 3)
    assert queue_limits.refusal(queue, "c", "2.2.2.2", 2, 3) is None
    # Without a proxy to vouch for it, X-Forwarded-For is the client's own word: the peer address counts.
    monkeypatch.delenv("SPECDEC_TRUST_PROXY")
    monkeypatch.delenv("SPACE_ID", raising=False)
    assert queue_limits.client_ip(_event("a", "1.1.1.1").request) == "10.9.9.9"


def test_concurrency_is_wired_and_bounded(monkeypatch):
    monkeypatch.setenv("SPECDEC_CONCURRENCY", "2")
    from app.serve.ui import build_ui

    limits = {fn.concurrency_limit for fn in build_ui().fns.values() if fn.concurrency_id == "device"}
    assert limits == {2}, "every device event takes its limit from SPECDEC_CONCURRENCY"
    for bad in ("0", "99", "two"):
        monkeypatch.setenv("SPECDEC_CONCURRENCY", bad)
        with pytest.raises(UserError, match="SPECDEC_CONCURRENCY"):
            queue_limits.concurrency()


def test_a_run_past_its_deadline_ends_as_if_stopped(monkeypatch):
    from app.serve import ui

    monkeypatch.setattr(queue_limits, "run_seconds", lambda: 0.0)
    args = list(ARGS)
    args[11] = 200
    *_, doc = list(ui.generate_both(*args, control={"stop": False}))[-1]
    assert doc["stopped"] and doc["speculative"]["stats"]["new_tokens"] < 200


def _join(url: str, fn_index: int, session: str, ip: str):
    import httpx

    return httpx.post(
        url + "gradio_api/queue/join",
        headers={"x-forwarded-for": ip},
        timeout=30,
        json={
            "data": [*ARGS, None],
            "fn_index": fn_index,
            "session_hash": session,
            "event_data": None,
            "trigger_id": None,
        },
    )


def test_one_visitor_cannot_fill_the_queue_and_another_is_still_served(tmp_path):
    import httpx
    from gradio_client import Client

    with serve(
        tmp_path / "server.log", SPECDEC_TRUST_PROXY="1", SPECDEC_QUEUE_PER_SESSION="2", SPECDEC_QUEUE_PER_IP="3"
    ) as url:
        config = httpx.get(url + "config", timeout=30).json()
        fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
        # Raw joins, as a script would send them: 10 from one session, then 10 from one address.
        same_session = [_join(url, fn_index, "flood", "10.0.0.1") for _ in range(10)]
        same_address = [_join(url, fn_index, uuid.uuid4().hex, "10.0.0.2") for _ in range(10)]
        assert [r.status_code for r in same_session].count(200) == 2
        assert [r.status_code for r in same_address].count(200) == 3
        assert "each visitor may have 2" in same_session[-1].json()["detail"]
        assert "Your network already has 3" in same_address[-1].json()["detail"]
        start = time.monotonic()
        out = Client(url, verbose=False).predict(*ARGS[:11], 8, *ARGS[12:], api_name="/generate")
        assert out[-1]["speculative"]["token_ids"] == out[-1]["autoregressive"]["token_ids"]
        assert time.monotonic() - start < 60, "served after the flood's few admitted jobs"
