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
from collections.abc import Callable

from app.core.config import K_MAX, MAX_NEW_TOKENS_CAP, UserError

log = logging.getLogger(__name__)
INTERNAL = "internal error (logged): please try again, or report it with the time it happened"
MAX_PROMPT_CHARS = 200_000  # far beyond any bundled context; refuses megabytes before tokenising
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit seed


def _number(name: str, value, whole: bool) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise UserError(f"{name} must be a number, got {value[:20]!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{name} must be a finite number, got {value}")
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


def seed(value) -> None:
    """A blank seed is fine (the app fills it); anything else is a whole number torch can take."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return
    whole("seed", 0, MAX_SEED)(value)


def text(name: str, limit: int, blank: bool = True) -> Callable:
    def check(value) -> None:
        if value is None and blank:
            return
        if not isinstance(value, str):
            raise UserError(f"{name} must be text, got {type(value).__name__}")
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
            raise UserError(f"{name} must be one of {', '.join(map(str, options))}, got {str(value)[:30]!r}")

    return check


def flag(name: str) -> Callable:
    def check(value) -> None:
        if not isinstance(value, bool) and value not in (0, 1, None):
            raise UserError(f"{name} must be true or false")

    return check


MODEL_ID_CHARS = 500  # hosting.check gives the precise limit; this only keeps megabytes out
# The app's input fields by handler parameter name. Ranges are what a client could send at all;
# the configs' own validate() then checks what makes sense (top-p in (0, 1], k <= k max, ...).
FIELDS: dict[str, Callable] = {
    "prompt": text("prompt", MAX_PROMPT_CHARS),
    **{n: text(n.replace("_", " "), MODEL_ID_CHARS) for n in ("target", "custom_target", "draft", "custom_draft")},
    "chat": flag("chat"),
    "decoding": choice("decoding", ("greedy", "sampling")),
    "temperature": real("temperature", 0, 1000),
    "top_k": whole("top-k", 0, 10**9),
    "top_p": real("top-p", 0, 1),
    "seed": seed,
    "max_new_tokens": whole("max new tokens", 1, MAX_NEW_TOKENS_CAP),
    "k_policy": choice("k policy", ("adaptive", "heuristic", "fixed")),
    "k": whole("k", 1, K_MAX),
    "repetition_penalty": real("repetition penalty", 0, 100),
    "no_repeat_ngram_size": whole("no-repeat n-gram size", 0, 64),
}


def check_fields(fn: Callable, args: tuple, kwargs: dict) -> None:
    """Check every argument of `fn` that FIELDS knows, by parameter name."""
    bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    for name, value in bound.arguments.items():
        if name in FIELDS:
            FIELDS[name](value)


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
