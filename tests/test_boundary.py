"""The boundary: inputs checked by name, UserError to a clear message, anything else to a generic one."""

from __future__ import annotations

import logging

import pytest

from app.core.config import UserError
from app.serve import boundary


class Shown(Exception):
    """Stands in for gr.Error: what the visitor sees."""


guarded = boundary.guarded(lambda e: Shown(str(e)))


@guarded
def handler(prompt, seed, k=4):
    if prompt == "raise":
        raise PermissionError(13, "Permission denied", "/srv/private/weights")
    if prompt == "refuse":
        raise UserError("a clear reason")
    return prompt, seed, k


@guarded
def streaming(prompt, max_new_tokens):
    yield 1
    raise OSError("/home/owner/.cache: No space left on device")


@pytest.mark.slow  # a server and several hundred requests
def test_a_bad_value_in_any_input_of_any_endpoint_gets_a_readable_message(tmp_path):
    import json
    import threading
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from app_server import serve

    log = tmp_path / "server.log"
    # Four callers at once from one address: the join limit and the places per address are lifted.
    with serve(log, SPECDEC_JOINS_PER_MINUTE="100000", SPECDEC_QUEUE_PER_IP="64") as url:
        config = httpx.get(url + "config", timeout=30).json()
        good = _base_values(config)
        kinds = {c["id"]: c.get("type") for c in config["components"]}
        deps = [d for d in config["dependencies"] if d.get("backend_fn") and d["inputs"]]
        assert len(deps) >= 10
        cases = []  # (where, the bad value, the event, its raw data)
        swept = set()  # components that met every bad value already, in an earlier event
        for n, dep in enumerate(deps):
            base = [json.dumps(good[i]) for i in dep["inputs"]]
            where = dep.get("api_name") or dep["id"]
            for pos, comp in enumerate(dep["inputs"]):
                if kinds[comp] == "state":
                    continue  # held by the server, never sent
                # Every value in a component's first event; in each later one, three in turn: every
                # input of every event still meets bad values, and every check meets every value.
                first = comp not in swept
                swept.add(comp)
                values = SWEEP_VALUES if first else [SWEEP_VALUES[(n + pos + j) % len(SWEEP_VALUES)] for j in range(3)]
                for bad in values:
                    data = list(base)
                    data[pos] = bad
                    cases.append(((where, pos), bad, dep, "[" + ", ".join(data) + "]"))
            cases.append(((where, "short"), None, dep, "[" + ", ".join(base[:-1]) + "]"))  # one value short

        # Each caller is one visitor who sends bad value after bad value in one session, as a page
        # would: what one refusal leaves in the session must not break the next call.
        sessions = threading.local()

        def failure(case):
            (where, pos), bad, dep, data = case
            if not hasattr(sessions, "hash"):
                sessions.hash = uuid.uuid4().hex
            ok, out = _call(url, dep, data, sessions.hash)
            wanted = "values" if pos == "short" else ""  # a short call is told how many values it needs
            readable = isinstance(out, str) and len(out) > 10 and "internal error" not in out and wanted in out
            return None if ok or readable else (where, pos, bad, out)

        # A few callers at once, as visitors would be: the server checks the calls while the others travel.
        with ThreadPoolExecutor(4) as pool:
            failures = [f for f in pool.map(failure, cases) if f is not None]
        assert len(cases) > 300 and not failures, failures[:10]
        logged = log.read_text()
        assert "Traceback" not in logged and "internal error" not in logged, logged[-3000:]
        assert len(logged.splitlines()) < 300, "refusals are logged at a bounded rate"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seed=2**70), "seed must be a whole number"),
        (dict(seed=float("nan")), "seed must be a finite number, got not a number"),
        (dict(seed=float("inf")), "seed must be a finite number, got a number too large to hold"),
        (dict(seed="abc"), "seed must be a number"),
        (dict(k=float("nan")), "k must be a finite number"),
        (dict(k=True), "k must be a number"),
        (dict(prompt="a\udc80b"), "prompt contains an invalid character at position 1"),
        (dict(prompt=["not", "text"]), "prompt must be text"),
    ],
)
def test_bad_inputs_are_refused_with_a_clear_message(kwargs, message):
    args = dict(prompt="ok", seed=None) | kwargs
    with pytest.raises(Shown, match=message):
        handler(**args)


def test_good_inputs_pass_through():
    assert handler("ok", None, k=3) == ("ok", None, 3)
    assert handler("ok", "", 4.0) == ("ok", "", 4.0)
    with pytest.raises(Shown, match="^a clear reason$"):
        handler("refuse", 0)


def test_any_other_error_is_logged_and_reaches_the_visitor_as_a_generic_message(caplog):
    with caplog.at_level(logging.ERROR, logger="app.boundary"):
        with pytest.raises(Shown) as raised:
            handler("raise", 0)
        assert str(raised.value) == boundary.INTERNAL and "/srv" not in str(raised.value)
        gen = streaming("ok", 8)
        assert next(gen) == 1
        with pytest.raises(Shown, match="internal error"):
            next(gen)
    assert "PermissionError" in caplog.text and "Traceback" in caplog.text, "the owner's log keeps the detail"


def test_every_handler_that_takes_visitor_input_is_guarded():
    import inspect

    from app.serve.ui import build_ui

    handlers = {fn.fn for fn in build_ui().fns.values() if fn.fn is not None}
    takes_input = [h for h in handlers if set(inspect.signature(h).parameters) & set(boundary.FIELDS)]
    assert len(takes_input) >= 6
    unguarded = [h.__name__ for h in takes_input if not getattr(h, "guarded", False)]
    assert not unguarded, f"handlers that take visitor input without the boundary: {unguarded}"


def test_raw_values_are_checked_by_parameter_and_by_component_before_preprocessing():
    import gradio as gr

    def handler(prompt, seed, value, mode, flag, example, session):
        pass

    blocks = [
        gr.Textbox(),
        gr.Number(),
        gr.Slider(0, 10, label="Max new tokens"),
        gr.Radio(["a", "b"], label="Mode"),
        gr.Checkbox(label="Chat"),
        gr.Dataset(components=[gr.Textbox()], samples=[["x"], ["y"]]),
        gr.State(),
    ]
    good = ["hi", None, 3, "a", True, 1, None]
    boundary.check_payload(handler, blocks, good)
    for pos, bad, message in [
        (0, None, "prompt must be text, got nothing"),
        (1, float("inf"), "seed must be a finite number"),
        (1, [], "seed must be a number, got a list"),
        (2, None, "Max new tokens must be a number, got nothing"),
        (2, {}, "Max new tokens must be a number, got an object"),
        (3, "c", "Mode must be one of a, b"),
        (3, None, r"Mode must be one of a, b, got nothing \(null\)"),
        (4, "abc", "Chat must be true or false"),
        (5, 7, "example must be the number of one of the examples"),
        (5, None, "example must be the number"),
    ]:
        values = list(good)
        values[pos] = bad
        with pytest.raises(UserError, match=message):
            boundary.check_payload(handler, blocks, values)
    with pytest.raises(UserError, match="takes 7 values, got 6"):
        boundary.check_payload(handler, blocks, good[:-1])
    # A number its component would refuse (Gradio's own refusal logs a traceback a request).
    bounded = [gr.Number(minimum=0.1, maximum=2, label="Temperature"), gr.Slider(1, 4, label="Repetition penalty")]
    for values, message in [
        ([1e3, 2], "Temperature must be from 0.1 to 2, got 1000"),
        (["1e3", 2], "Temperature must be from 0.1 to 2, got 1000"),
        ([0, 2], "Temperature must be from 0.1 to 2, got 0"),
        ([1, 0.5], "Repetition penalty must be from 1 to 4, got 0.5"),
    ]:
        with pytest.raises(UserError, match=message):
            boundary.check_payload(lambda a, b: None, bounded, values)
    boundary.check_payload(lambda a, b: None, bounded, [0.7, 1.2])


def test_log_records_are_rate_limited_and_say_how_many_were_left_out():
    now = [0.0]
    limit = boundary.RateLimited(burst=3, window=60.0, clock=lambda: now[0])
    records = [logging.LogRecord("app", logging.WARNING, "", 0, f"bad {i}", (), None) for i in range(10)]
    assert [limit.filter(r) for r in records] == [True] * 3 + [False] * 7
    now[0] = 61.0
    assert limit.filter(records[0]) and records[0].msg == "(7 similar messages left out) bad 0"


# What a script may post for any input: no type the component expects, or no finite number.
SWEEP_VALUES = ["null", '"abc"', "[]", "{}", "NaN", "Infinity", "-Infinity", "true", "1e300", '"1e3"']


def _base_values(config: dict) -> dict[int, object]:
    """Component id -> a good value: the page's own, with the tiny pair and a short run."""
    good = {}
    for comp in config["components"]:
        props = comp.get("props", {})
        label, value = str(props.get("label") or ""), props.get("value")
        if label == "Target":
            value = "stdlib-code target (bundled)"
        elif label == "Draft":
            value = "prompt lookup (n-grams)"
        elif props.get("elem_id") == "max-new":
            value = 2
        elif comp.get("type") == "dataset":
            value = 0
        good[comp["id"]] = value
    return good


def _call(url: str, dep: dict, data_json: str, session: str) -> tuple[bool, object]:
    """Send one event's raw JSON data as the page would, in visitor session `session`; (succeeded,
    output or error text)."""
    import json

    import httpx

    body = f'{{"data": {data_json}, "fn_index": {dep["id"]}, "session_hash": "{session}", "event_data": null}}'
    headers = {"content-type": "application/json"}
    if dep.get("queue") is False:  # the page posts these directly, outside the queue
        r = httpx.post(f"{url}gradio_api/run/predict", content=body, headers=headers, timeout=120)
        doc = r.json()
        return r.status_code == 200, doc.get("error", doc.get("data"))
    r = httpx.post(f"{url}gradio_api/queue/join", content=body, headers=headers, timeout=120)
    if r.status_code != 200:
        return False, r.json().get("detail")
    with httpx.stream("GET", f"{url}gradio_api/queue/data", params={"session_hash": session}, timeout=300) as s:
        for line in s.iter_lines():
            if line.startswith("data:"):
                msg = json.loads(line[5:])
                if msg.get("msg") == "process_completed":
                    out = msg.get("output") or {}
                    return bool(msg.get("success")), out.get("error") if not msg.get("success") else out.get("data")
    return False, None


def test_a_number_sent_as_text_reaches_gradio_as_a_number_and_a_blank_seed_as_none():
    """Gradio's own preprocessing fails on "1e3" or " " in a number box, with a traceback per request;
    the gate hands it what the check accepted instead."""
    import gradio as gr

    def handler(seed, max_new_tokens, prompt):
        return None

    values = [" ", "1e3", "1e3"]
    boundary.check_payload(handler, [gr.Number(), gr.Number(precision=0), gr.Textbox()], values)
    assert values == [None, 1000.0, "1e3"], "text boxes keep their text"


def test_each_settings_messages_name_one_range():
    """The page's slider, the API's check and the engine's own check agree on a setting's range."""
    from app.core import config, knobs
    from app.serve.knob_widgets import WIDGETS

    by_name = {k.name: k for k in knobs.KNOBS}
    assert by_name["tree"].hi == WIDGETS["tree"].hi == config.TREE_MAX
    assert by_name["temperature"].hi == config.MAX_TEMPERATURE
    with pytest.raises(UserError, match=r"from 0.001 to 100, got 150"):
        config.SamplingConfig(temperature=150.0).validate()
