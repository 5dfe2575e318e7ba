"""Every value a visitor sends, checked where it enters, and no raw exception text going back.

A Gradio handler receives whatever a client posts: None for a number, NaN, 2**70, a lone
surrogate, a 300-character id. `guarded` checks each argument by its parameter name (FIELDS)
before the handler runs, so a bad value becomes one clear message instead of a Python error
from deep inside torch or the tokenizer. Anything else that goes wrong is logged with its
traceback and reaches the visitor only as "internal error (logged)": exception text can
carry host paths and other details that are not the visitor's business.

No gradio here: the caller passes how to build the error a visitor sees.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import time
from collections.abc import Callable

from app.core import knobs
from app.core.config import UserError
from app.core.knobs import Knob
from app.serve import knob_widgets

log = logging.getLogger(__name__)
INTERNAL = "internal error (logged): please try again, or report it with the time it happened"
MAX_PROMPT_CHARS = 200_000  # far beyond any bundled context; refuses megabytes before tokenising
# The longest run a visitor may ask for: a shared server's policy, not the engine's (the knob's range).
MAX_NEW_TOKENS_CAP = knobs.MAX_NEW_TOKENS


def _what(value) -> str:
    """How a value a client sent reads in a message: its JSON kind, never a Python type name."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str):
        return repr(value[:20])
    return type(value).__name__


def _number(name: str, value, whole: bool) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise UserError(f"{name} must be a number, got {value[:20]!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{name} must be a number, got {_what(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        # a number of hundreds of digits reaches here as inf: say what the visitor sent, not "inf"
        got = "not a number" if math.isnan(value) else "a number too large to hold"
        raise UserError(f"{name} must be a finite number, got {got}")
    if whole and value != int(value):
        raise UserError(f"{name} must be a whole number, got {value}")
    return value


def real(name: str, lo: float, hi: float) -> Callable:
    def check(value) -> None:
        if not lo <= _number(name, value, whole=False) <= hi:
            raise UserError(f"{name} must be between {lo} and {hi}, got {value}")

    return check


def whole(name: str, lo: int, hi: int) -> Callable:
    def check(value) -> None:
        if not lo <= _number(name, value, whole=True) <= hi:
            raise UserError(f"{name} must be a whole number from {lo} to {hi}, got {value}")

    return check


def blank_or(check: Callable) -> Callable:
    """A blank value is fine (the app fills it, as it does a seed); anything else passes `check`."""

    def either(value) -> None:
        if value is None or (isinstance(value, str) and not value.strip()):
            return
        check(value)

    return either


def text(name: str, limit: int, blank: bool = True) -> Callable:
    def check(value) -> None:
        if value is None and blank:
            return
        if not isinstance(value, str):
            raise UserError(f"{name} must be text, got {_what(value)}")
        if len(value) > limit:
            raise UserError(f"{name} is too long ({len(value)} characters; at most {limit})")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer or path can take it
            raise UserError(f"{name} contains an invalid character at position {e.start}") from None
        if "\x00" in value:
            raise UserError(f"{name} contains a NUL character")

    return check


def choice(name: str, options: tuple) -> Callable:
    def check(value) -> None:
        if value not in options:
            got = repr(value[:30]) if isinstance(value, str) else _what(value)  # null is "nothing", not 'None'
            raise UserError(f"{name} must be one of {', '.join(map(str, options))}, got {got}")

    return check


def flag(name: str) -> Callable:
    def check(value) -> None:
        if not isinstance(value, bool) and value not in (0, 1, None):
            raise UserError(f"{name} must be true or false")

    return check


def boolean(name: str) -> Callable:
    def check(value) -> None:
        if not isinstance(value, bool):
            raise UserError(f"{name} must be true or false, got {_what(value)}")

    return check


def for_knob(knob: Knob) -> Callable:
    """The check on what a client may send for a declared setting (core/knobs.py)."""
    if knob.choices:
        return choice(knob.what, knob.choices)
    if knob.kind is bool:
        return flag(knob.what)
    lo = -math.inf if knob.lo is None else knob.lo
    hi = math.inf if knob.hi is None else knob.hi
    check = (whole if knob.kind is int else real)(knob.what, lo, hi)
    return blank_or(check) if knob.blank else check


MODEL_ID_CHARS = 500  # hosting.check gives the precise limit; this only keeps megabytes out


def fields() -> dict[str, Callable]:
    """The app's input fields by handler parameter name: the prompt and pair, then every declared setting
    the page shows. Ranges are what a client could send at all; the configs' own validate() then
    checks what makes sense (top-p in (0, 1], k <= k max, ...)."""
    return {
        "prompt": text("prompt", MAX_PROMPT_CHARS, blank=False),
        "target": text("target", MODEL_ID_CHARS, blank=False),
        "draft": text("draft", MODEL_ID_CHARS, blank=False),
        **{n: text(n.replace("_", " "), MODEL_ID_CHARS) for n in ("custom_target", "custom_draft")},
        **{knob.name: for_knob(knob) for knob in knob_widgets.shown()},
    }


FIELDS = fields()  # as declared at import; the checks read fields() at the time


def _by_component(block, label: str) -> Callable | None:
    """The check for an input the app has no field for, from its component's kind (class name)."""
    kind = type(block).__name__
    if kind == "Slider":
        return real(label, -math.inf, math.inf)
    if kind == "Number":
        return lambda v: None if v is None else real(label, -math.inf, math.inf)(v)
    if kind in ("Textbox", "Code"):
        return text(label, MAX_PROMPT_CHARS)
    if kind == "Checkbox":
        return boolean(label)
    if kind in ("Radio", "Dropdown") and not getattr(block, "allow_custom_value", False):
        return choice(label, tuple(value for _, value in getattr(block, "choices", ())))
    if kind == "Dropdown":
        return text(label, MODEL_ID_CHARS, blank=False)
    if kind == "Dataset":
        count = len(getattr(block, "samples", None) or ())
        return lambda v: None if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < count else _no_example(v)
    return None


def _no_example(value) -> None:
    raise UserError(f"example must be the number of one of the examples, got {_what(value)}")


def check_payload(fn: Callable, blocks: list, values: list) -> None:
    """Check the raw values a client sent for an event, before Gradio's preprocessing touches them.

    Each value is checked by the handler parameter it lands in (FIELDS), else by its component's
    kind; a stateful input (gr.State) holds no client value and is skipped.
    """
    if not isinstance(values, list):
        raise UserError("data must be a list of values")
    if len(values) < len(blocks):
        raise UserError(f"this endpoint takes {len(blocks)} values, got {len(values)}")
    names = list(inspect.signature(fn).parameters) if fn is not None else []
    by_name = fields()
    for i, (block, value) in enumerate(zip(blocks, values, strict=False)):
        if getattr(block, "stateful", False):
            continue
        name = names[i] if i < len(names) else ""
        label = str(getattr(block, "label", None) or name or f"input {i + 1}").split(" (")[0].split(":")[0][:40]
        check = by_name.get(name) or _by_component(block, label)
        if check is not None:
            check(value)
        if isinstance(value, str) and type(block).__name__ in ("Number", "Slider"):
            # A number sent as text passed its check ("1e3", or a blank seed), but Gradio's own
            # preprocessing rounds numbers and fails on text: hand it the number, or None for blank.
            values[i] = float(value) if value.strip() else None
        _within(block, label, values[i])


def _within(block, label: str, value) -> None:
    """A number inside its component's own range: outside it, Gradio's preprocessing refuses it with a
    traceback in the log for every request, so it is refused here first, in one line."""
    if type(block).__name__ not in ("Number", "Slider") or isinstance(value, bool):
        return
    if not isinstance(value, (int, float)):
        return
    lo, hi = getattr(block, "minimum", None), getattr(block, "maximum", None)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = (
            f"from {lo:g} to {hi:g}"
            if lo is not None and hi is not None
            else (f"at least {lo:g}" if lo is not None else f"at most {hi:g}")
        )
        raise UserError(f"{label} must be {span}, got {value:g}")


def gate(demo, user_error: Callable[[UserError], BaseException]) -> None:
    """Check every event's raw inputs (check_payload) before Gradio preprocesses them.

    Gradio's own preprocessing fails on null, "abc", [] or NaN with a traceback in the log and
    {"error": null} for the client; this wraps the one method every queued and direct call
    goes through, so such values get the app's message instead.
    """
    process_api = demo.process_api
    params = inspect.signature(process_api)

    @functools.wraps(process_api)
    async def checked(*args, **kwargs):
        call = params.bind(*args, **kwargs)
        block_fn, inputs = call.arguments["block_fn"], call.arguments.get("inputs")
        block_fn = demo.fns[block_fn] if isinstance(block_fn, int) else block_fn
        if call.arguments.get("iterator") is None and not getattr(block_fn, "batch", False):
            try:
                check_payload(block_fn.fn, block_fn.inputs, inputs)
            except UserError as e:
                raise user_error(e) from None
        return await process_api(*args, **kwargs)

    demo.process_api = checked


class RateLimited(logging.Filter):
    """At most `burst` records per logger and level each `window` seconds; the rest are counted, and the
    next record that passes says how many were left out. A flood of bad requests cannot flood the log."""

    def __init__(self, burst: int = 20, window: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self._seen: dict[tuple, list] = {}  # (logger, level) -> [window start, records passed, left out]

    def filter(self, record: logging.LogRecord) -> bool:
        now, key = self.clock(), (record.name, record.levelno)
        seen = self._seen.setdefault(key, [now, 0, 0])
        if now - seen[0] > self.window:
            seen[0], seen[1] = now, 0
        if seen[1] >= self.burst:
            seen[2] += 1
            return False
        seen[1] += 1
        if seen[2]:
            record.msg, seen[2] = f"({seen[2]} similar messages left out) {record.msg}", 0
        return True


CLOSED_ROUTES = ("upload", "process_recording")  # Gradio's routes that take files from a client


class NoUploads:
    """ASGI middleware: the app has no file inputs, so Gradio's upload route stores nothing and
    answers no path; every other request passes untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].rstrip("/").rsplit("/", 1)[-1] in CLOSED_ROUTES:
            await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"this app takes no file uploads"})
            return
        await self.app(scope, receive, send)


PROXY_HEADERS = (b"x-forwarded-for", b"forwarded", b"x-real-ip", b"x-forwarded-host", b"cf-connecting-ip")


class ProxyWatch:
    """ASGI middleware: a request that came through a proxy or tunnel (forwarding headers, or a Host
    that is not this machine's loopback name) makes the server public for good (hosting.public),
    before the request itself is handled; SPECDEC_PRIVATE=1 is the owner saying it is not."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and _proxied(dict(scope.get("headers") or ())):
            from app.models import hosting

            if hosting.mark_proxied() and os.environ.get("SPECDEC_PRIVATE") != "1":
                log.warning("requests come through a proxy or tunnel: visitors may load the presets only")
        await self.app(scope, receive, send)


def _proxied(headers: dict[bytes, bytes]) -> bool:
    from app.models.hosting import LOOPBACK

    if any(h in headers for h in PROXY_HEADERS):
        return True
    host = headers.get(b"host", b"").decode("latin-1").strip()
    name = host[1 : host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    return name.lower() not in LOOPBACK


def limit_logging() -> None:
    """Rate-limit what reaches the server log's handlers (call after logging is configured)."""
    limit = RateLimited()
    for handler in logging.getLogger().handlers:
        handler.addFilter(limit)


def check_fields(fn: Callable, args: tuple, kwargs: dict) -> None:
    """Check every argument of `fn` that FIELDS knows, by parameter name."""
    bound, by_name = inspect.signature(fn).bind_partial(*args, **kwargs), fields()
    for name, value in bound.arguments.items():
        if name in by_name:
            by_name[name](value)


def guarded(user_error: Callable[[UserError], BaseException], passthrough: tuple[type[BaseException], ...] = ()):
    """Decorate a handler: check its inputs, map UserError to user_error, anything else to INTERNAL.

    `passthrough` are errors already meant for the visitor (gr.Error). Generators stay generators,
    so streaming handlers stream; GeneratorExit (a cancelled run) is not an Exception and passes.
    """

    def wrap(fn):
        def convert(e: Exception) -> BaseException:
            if isinstance(e, passthrough):
                return e
            if isinstance(e, UserError):
                return user_error(e)
            log.exception("internal error in %s", fn.__name__)
            return user_error(UserError(INTERNAL))

        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen_wrapper(*args, **kwargs):
                try:
                    check_fields(fn, args, kwargs)
                    yield from fn(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - the boundary: nothing raw leaves it
                    raise convert(e) from None

            gen_wrapper.guarded = True
            return gen_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                check_fields(fn, args, kwargs)
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the boundary: nothing raw leaves it
                raise convert(e) from None

        wrapper.guarded = True  # tests check that every handler taking visitor input has this
        return wrapper

    return wrap
