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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seed=2**70), "seed must be a whole number"),
        (dict(seed=float("nan")), "seed must be a finite number"),
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
