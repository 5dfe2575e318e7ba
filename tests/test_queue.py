"""A fair queue: one visitor cannot take more than its cap, others still get served; runs end by a deadline."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest
from app_server import serve
from conftest import TINY_TARGET, form_fields

from app.core.config import UserError
from app.models import hosting
from app.serve import queue_limits

pytestmark = pytest.mark.slow  # servers

# Every field, as a raw join sends them: greedy, a chain of adaptive k, fp32.
QUEUED = form_fields(True, prompt="def f(a):\n    return a", target=TINY_TARGET, draft="distilled draft (bundled)")
QUEUED |= dict(temperature=0.8, max_new_tokens=40, dtype="fp32")
ARGS = list(QUEUED.values())


def _args(max_new: int) -> list:
    """ARGS with another max new tokens."""
    return list((QUEUED | dict(max_new_tokens=max_new)).values())


def _event(session: str, ip: str):
    request = SimpleNamespace(headers={"x-forwarded-for": ip}, client=SimpleNamespace(host="10.9.9.9"))
    return SimpleNamespace(session_hash=session, request=request)


def _queue(*events):
    return SimpleNamespace(
        event_queue_per_concurrency_id={"device": SimpleNamespace(queue=list(events))}, active_jobs=[]
    )


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


def test_the_address_is_the_one_the_trusted_proxy_appended(monkeypatch):
    """A client may write anything into X-Forwarded-For; the proxy appends what it saw, so that counts."""
    monkeypatch.setenv("SPACE_ID", "someone/specdec")
    forged = _event("a", "6.6.6.6, 7.7.7.7, 203.0.113.9").request
    assert queue_limits.client_ip(forged) == "203.0.113.9"
    monkeypatch.setenv("SPECDEC_PROXY_HOPS", "2")  # a CDN in front of the platform's proxy
    assert queue_limits.client_ip(forged) == "7.7.7.7"
    assert queue_limits.client_ip(_event("a", "203.0.113.9").request) == "203.0.113.9"


def test_no_number_of_addresses_fills_the_queue(monkeypatch):
    """Each address takes at most a quarter of what the others leave: a newcomer always finds a place."""
    monkeypatch.setenv("SPECDEC_TRUST_PROXY", "1")
    held = 0
    for _ in range(40):  # 40 addresses, each taking all it may
        share = queue_limits.fair_share(held, cap=queue_limits.per_ip())
        assert share <= queue_limits.MAX_QUEUED // 4
        held += share
        if held >= queue_limits.MAX_QUEUED:
            break
    assert queue_limits.fair_share(16, cap=16) == 12 and queue_limits.fair_share(0, cap=16) == 16
    # The first four addresses, as greedy as they may be, leave room for others.
    first_four = 16 + 12 + 9 + 6
    assert queue_limits.fair_share(first_four, cap=16) >= 1 and first_four < queue_limits.MAX_QUEUED
    queue = _queue(*[_event(str(i), "1.1.1.1") for i in range(12)], *[_event(f"x{i}", "2.2.2.2") for i in range(16)])
    assert "at most 12" in queue_limits.refusal(queue, "new", "1.1.1.1", 2, 16)


def test_joins_are_rate_limited_per_address():
    now = [0.0]
    rate = queue_limits.AddressRate(limit=3, window=60.0, clock=lambda: now[0])
    assert [rate.admit("1.1.1.1") for _ in range(4)] == [True, True, True, False]
    assert rate.admit("2.2.2.2"), "another address has its own count"
    now[0] = 61.0
    assert rate.admit("1.1.1.1"), "the window slides"
    refused = queue_limits.AddressRate(limit=2, window=60.0, clock=lambda: now[0])
    assert not refused.full("3.3.3.3") and "3.3.3.3" not in refused._seen, "a look remembers nothing"
    for _ in range(5):
        refused.count("3.3.3.3")
    assert refused.full("3.3.3.3") and len(refused._seen["3.3.3.3"]) == 2, "past the limit nothing is kept"
    now[0] = 122.0
    assert not refused.full("3.3.3.3"), "a window after the limit, the address is served again"


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
    *_, doc = list(ui.generate_both(*_args(200), control={"stop": False}))[-1]
    assert doc["stopped"] and doc["speculative"]["stats"]["new_tokens"] < 200


def _join(url: str, fn_index: int, session: str, ip: str | None, max_new: int = 40):
    """A raw join, as a script sends it; ip: the X-Forwarded-For it claims (None: no header)."""
    import httpx

    data = _args(max_new)
    return httpx.post(
        url + "gradio_api/queue/join",
        headers={"x-forwarded-for": ip} if ip else {},
        timeout=60,
        json={
            "data": [*data, None],
            "fn_index": fn_index,
            "session_hash": session,
            "event_data": None,
            "trigger_id": None,
        },
    )


def test_one_visitor_cannot_fill_the_queue_and_another_is_still_served(tmp_path):
    import httpx
    from gradio_client import Client

    with serve(tmp_path / "server.log", SPECDEC_TRUST_PROXY="1", SPECDEC_QUEUE_PER_SESSION="2") as url:
        config = httpx.get(url + "config", timeout=30).json()
        fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
        # Raw joins, as a script would send them: 10 from one session, then 10 from one address.
        # The first job loads the models, so the joins all arrive while it runs.
        same_session = [_join(url, fn_index, "flood", "10.0.0.1") for _ in range(10)]
        same_address = [_join(url, fn_index, uuid.uuid4().hex, "10.0.0.2", 8) for _ in range(10)]
        assert [r.status_code for r in same_session].count(200) == 2
        assert "each visitor may have 2" in same_session[-1].json()["detail"]
        codes = [r.status_code for r in same_address]
        assert codes.count(200) == queue_limits.PER_IP == 3, "one address holds a few places, whatever its sessions"
        assert "Your network already has" in same_address[-1].json()["detail"]
        out = Client(url, verbose=False).predict(*_args(8), api_name="/generate")
        assert out[-1]["speculative"]["token_ids"] == out[-1]["autoregressive"]["token_ids"]
        # The direct route skips the queue: it is closed for every queued event, the private one too.
        for api in ("generate", "step", "presets"):
            r = httpx.post(f"{url}gradio_api/run/{api}", json={"data": []}, timeout=30)
            assert r.status_code == 404 and "join the queue" in r.json()["detail"], api
        private = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "check_request")
        r = httpx.post(f"{url}gradio_api/run/predict", json={"data": ARGS, "fn_index": private}, timeout=30)
        assert r.status_code == 404
        # Named parameters through the queue still work.
        named = QUEUED | dict(max_new_tokens=8)
        out = Client(url, verbose=False).predict(**named, api_name="/generate")
        assert out[-1]["speculative"]["token_ids"] == out[-1]["autoregressive"]["token_ids"]


def test_a_private_server_has_no_public_limits_until_it_is_reached_through_a_proxy(tmp_path, monkeypatch):
    import httpx

    with serve(tmp_path / "server.log") as url:  # 127.0.0.1, no SPECDEC_* limits set: the owner's
        with httpx.Client(timeout=30) as owner:  # more refused calls than a public server takes from an address
            codes = [owner.post(url + "gradio_api/run/generate", json={"data": []}).status_code for _ in range(130)]
        assert codes == [404] * 130, "no refusal limit on the owner"
        config = httpx.get(url + "config", timeout=30).json()
        fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
        own = [_join(url, fn_index, "owner", None, 4) for _ in range(6)]
        assert [r.status_code for r in own] == [200] * 6, "no per-session or per-address cap on the owner"
        # The first request through a proxy makes the server public for good: the caps bind from then on.
        proxied = [_join(url, fn_index, "visitor", "10.0.0.9", 4) for _ in range(4)]
        codes = [r.status_code for r in proxied]
        assert codes.count(200) <= 2 and codes[-1] == 400, codes  # the session's cap, or the address's share
        assert "each visitor may have 2" in proxied[-1].text or "Your network already has" in proxied[-1].text
    monkeypatch.delenv("SPACE_ID", raising=False)
    monkeypatch.delenv("SPECDEC_RUN_SECONDS", raising=False)
    monkeypatch.setattr(hosting, "public", lambda: False)
    assert queue_limits.run_seconds() == float("inf"), "a private server's runs end when they end"
    monkeypatch.setenv("SPECDEC_RUN_SECONDS", "30")
    assert queue_limits.run_seconds() == 30.0, "unless its owner sets a deadline"
    monkeypatch.delenv("SPECDEC_RUN_SECONDS")
    monkeypatch.setattr(hosting, "public", lambda: True)
    assert queue_limits.run_seconds() == 180.0


def test_forged_session_hashes_and_forwarded_for_take_no_more_than_a_share(tmp_path):
    """Behind a Space's proxy: 80 joins with new session hashes and forged X-Forwarded-For entries."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from gradio_client import Client

    with serve(tmp_path / "server.log", SPACE_ID="someone/specdec", SPECDEC_JOINS_PER_MINUTE="1000") as url:
        config = httpx.get(url + "config", timeout=30).json()
        fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")

        def forged(i: int):  # the proxy appends the address it saw (10.6.6.6) after the client's own entries
            return _join(url, fn_index, uuid.uuid4().hex, f"192.0.2.{i % 250}, 198.51.100.{i % 7}, 10.6.6.6", 16)

        with ThreadPoolExecutor(16) as pool:  # all at once, while the first job still loads the models
            flood = list(pool.map(forged, range(80)))
        admitted = [r.status_code for r in flood].count(200)
        assert admitted <= queue_limits.MAX_QUEUED // 4, admitted
        assert "Your network already has" in next(r.json()["detail"] for r in flood if r.status_code != 200)
        # Three more real addresses, each as greedy: together they still leave the queue room.
        others = [
            [_join(url, fn_index, uuid.uuid4().hex, f"10.7.7.{a}", 8).status_code for _ in range(30)] for a in range(3)
        ]
        assert all(codes.count(200) <= queue_limits.MAX_QUEUED // 4 for codes in others)
        assert admitted + sum(c.count(200) for c in others) < queue_limits.MAX_QUEUED
        # A genuine visitor joins while all of that waits, and is served: it waits behind the others' shares only.
        visitor = Client(url, verbose=False, headers={"x-forwarded-for": "10.8.8.8"})
        out = visitor.predict(*_args(8), api_name="/generate")
        assert out[-1]["speculative"]["token_ids"] == out[-1]["autoregressive"]["token_ids"]


def test_a_classroom_behind_one_address_is_served(tmp_path):
    """Many visitors behind one school NAT, on a host that raised the places per address as the docs
    say: each has its own session, and every one is served."""
    from concurrent.futures import ThreadPoolExecutor

    from gradio_client import Client

    with serve(tmp_path / "server.log", SPACE_ID="someone/specdec", SPECDEC_QUEUE_PER_IP="30") as url:

        def student(i: int) -> bool:
            client = Client(url, verbose=False, headers={"x-forwarded-for": f"172.16.0.{i}, 10.5.5.5"})
            out = client.predict(*_args(6), api_name="/generate")
            return out[-1]["speculative"]["token_ids"] == out[-1]["autoregressive"]["token_ids"]

        with ThreadPoolExecutor(6) as pool:
            assert all(pool.map(student, range(6)))


def test_a_slow_load_goes_on_in_the_background_without_holding_the_request():
    import threading

    release, calls = threading.Event(), []

    def slow():
        calls.append(1)
        release.wait(60)
        return "pair"

    for _ in range(2):  # the second request waits on the load the first one started
        with pytest.raises(UserError, match="still loading"):
            queue_limits.within_load_time(("slow", "draft"), slow, seconds=0.05)
    assert len(calls) == 1
    release.set()
    assert queue_limits.within_load_time(("slow", "draft"), slow, seconds=60) == "pair"


def test_a_model_already_loaded_is_served_while_another_one_loads(monkeypatch):
    import threading

    from app import models
    from app.models import loading

    models.load(models.TINY_TARGET)  # cached
    started, release = threading.Event(), threading.Event()

    def slow_load(*args):
        started.set()
        release.wait(60)
        raise UserError("never mind")

    monkeypatch.setattr(loading, "_load_uncached", slow_load)
    other = threading.Thread(target=lambda: pytest.raises(UserError, models.load, "someone/slow-model"))
    other.start()
    try:
        assert started.wait(60)
        assert models.load(models.TINY_TARGET)[0] is not None, "served from the cache while the other load runs"
    finally:
        release.set()
        other.join(60)


@pytest.mark.slow
def test_a_claimed_forwarding_address_does_not_dodge_the_per_address_cap(tmp_path):
    """Without SPECDEC_TRUST_PROXY, X-Forwarded-For is a client's claim: uvicorn must not make it the
    peer's address (by default it does for a loopback peer), or each claimed address gets its own cap."""
    import httpx

    with serve(tmp_path / "server.log", SPECDEC_QUEUE_PER_SESSION="2") as url:
        config = httpx.get(url + "config", timeout=30).json()
        fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
        claimed = [_join(url, fn_index, uuid.uuid4().hex, f"192.0.2.{i}", 200) for i in range(8)]
        codes = [r.status_code for r in claimed]
        assert codes.count(200) == queue_limits.PER_IP, codes
        assert "Your network already has" in claimed[-1].json()["detail"]


def _stream(url: str, session: str, ip: str, until: str | None = None) -> str:
    """A queue stream as the browser reads it: to its end (an incomplete body raises), or, with `until`,
    up to the first line holding it, then the client goes away."""
    import httpx

    params, headers, lines = {"session_hash": session}, {"x-forwarded-for": ip}, []
    with httpx.stream("GET", url + "gradio_api/queue/data", params=params, headers=headers, timeout=120) as r:
        for line in r.iter_lines():
            lines.append(line)
            if until and until in line:
                break
    return "\n".join(lines)


def _new_lines(log, before: int) -> list[str]:
    return [line for line in log.read_text().splitlines()[before:] if not line.startswith("* ")]


def test_streams_for_sessions_the_queue_does_not_hold_end_cleanly_in_one_log_line(tmp_path):
    """Gradio refuses such a stream after it has started, and uvicorn logged some 80 lines of traceback for
    each: 50 made-up session hashes wrote 4,000 lines. Now each stream ends cleanly with Gradio's own error
    event, an address is logged once a minute at most, and the app keeps serving, a reopened stream too."""
    import httpx

    log = tmp_path / "server.log"
    with serve(log, SPECDEC_TRUST_PROXY="1") as url:
        config = httpx.get(url + "config", timeout=30).json()
        fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
        before = len(log.read_text().splitlines())
        made_up = [_stream(url, uuid.uuid4().hex, "10.0.0.1") for _ in range(50)]
        assert all('"session_not_found":true' in text for text in made_up), made_up[0]
        # A visitor whose stream broke off mid-run reopens it: Gradio no longer holds it, and says so.
        session = uuid.uuid4().hex
        assert _join(url, fn_index, session, "10.0.0.2", 40).status_code == 200
        assert '"msg"' in _stream(url, session, "10.0.0.2", until='"msg"')
        time.sleep(1)
        assert '"session_not_found":true' in _stream(url, session, "10.0.0.2")
        # The queue still serves a run to its end.
        session = uuid.uuid4().hex
        assert _join(url, fn_index, session, "10.0.0.3", 4).status_code == 200
        assert "process_completed" in _stream(url, session, "10.0.0.3", until="process_completed")
        lines = _new_lines(log, before)
        assert not any("Traceback" in line or "Exception in ASGI" in line for line in lines), lines[:5]
        assert len(lines) <= 3, lines  # the proxy seen; each address once
        assert httpx.get(url + "config", timeout=30).status_code == 200


def test_a_flood_of_refused_calls_is_refused_cheaply_and_others_are_served(tmp_path):
    """An address whose calls keep being refused (404s from the closed direct route) gets a 429 before
    Gradio does any work; other addresses are answered as before, and the log gains one line."""
    import httpx
    from gradio_client import Client

    log = tmp_path / "server.log"
    with serve(log, SPECDEC_TRUST_PROXY="1", SPECDEC_REFUSALS_PER_MINUTE="20") as url:
        before = len(log.read_text().splitlines())
        with httpx.Client(headers={"x-forwarded-for": "10.0.0.1"}, timeout=30) as flood:
            codes = [flood.post(url + "gradio_api/run/generate", json={"data": ARGS}).status_code for _ in range(100)]
            assert codes == [404] * 20 + [429] * 80, codes
            page = flood.get(url + "config")
            assert page.status_code == 429 and page.headers["retry-after"] == "60", "the whole address waits"
        other = httpx.post(
            url + "gradio_api/run/generate", json={"data": ARGS}, headers={"x-forwarded-for": "10.0.0.2"}, timeout=30
        )
        assert other.status_code == 404 and "join the queue" in other.json()["detail"], (
            "another address: Gradio's answer"
        )
        visitor = Client(url, verbose=False, headers={"x-forwarded-for": "10.0.0.3"})
        out = visitor.predict(*_args(8), api_name="/generate")
        assert out[-1]["speculative"]["token_ids"] == out[-1]["autoregressive"]["token_ids"]
        lines = _new_lines(log, before)
        assert not any("Traceback" in line for line in lines), lines[:5]
        assert len(lines) <= 3 and sum("10.0.0.1" in line for line in lines) == 1, lines
