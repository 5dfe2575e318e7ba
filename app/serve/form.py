"""The settings form: the UI's inputs as one ordered list of named fields, parsed once per click into
one typed `Form` that every handler of the click takes (handed down in the session's control state).

The names are the API's named parameters (`client.predict(prompt=..., rule=...)`): Gradio reads
them from a handler's signature, so `takes_form` gives each handler the one signature built here
instead of each spelling out the fields again.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from app.core import knobs
from app.core.config import Settings
from app.core.knobs import DTYPES
from app.serve.knob_widgets import shown

_REQUIRED = inspect.Parameter.empty


def server_dtype() -> str:
    """The precision a visitor starts with: the server's own (loading.default_dtype), else auto."""
    from app.models.loading import default_dtype

    chosen = default_dtype()
    return chosen if chosen in DTYPES else "auto"


# What a caller names before the settings: the prompt and the pair as picked or typed.
PAIR_FIELDS = ("prompt", "target", "custom_target", "draft", "custom_draft")
MODEL_FIELDS = PAIR_FIELDS[1:]  # the pair: each preset picked, then the id typed over it
SERVER_DEFAULTS = {"dtype": server_dtype}  # defaults only the server knows


def _api_default(knob: knobs.Knob) -> object:
    if knob.required:
        return _REQUIRED
    return SERVER_DEFAULTS[knob.name]() if knob.name in SERVER_DEFAULTS else knob.value


def fields() -> tuple[tuple[str, object], ...]:
    """(name, default) of every field, in the order the UI wires its inputs: the pair, then each
    declared setting the page shows (knob_widgets.shown), so API callers that omit a later one get its default."""
    return tuple((name, _REQUIRED) for name in PAIR_FIELDS) + tuple((k.name, _api_default(k)) for k in shown())


def names() -> tuple[str, ...]:
    return tuple(name for name, _ in fields())


FIELDS, NAMES = fields(), names()  # as declared at import; fields() and names() read the knobs at the time


def blank(seed) -> bool:
    return seed is None or str(seed).strip() == ""


def typed_id(picked: str, custom: str | None) -> str:
    """A model as typed: a custom id, when given, over the preset picked."""
    return (custom or "").strip() or picked


def model_ids(values) -> tuple[str, str]:
    """The pair as typed, from MODEL_FIELDS by name."""
    return typed_id(values["target"], values["custom_target"]), typed_id(values["draft"], values["custom_draft"])


@dataclass(frozen=True)
class Form:
    """One click's inputs, parsed once: the prompt, the pair as typed and validated Settings."""

    prompt: str
    target: str
    draft: str
    settings: Settings
    seed_given: bool  # False: the Seed box was blank and the seed was filled (fill_seed)
    dtype: str = "auto"  # the target's precision: auto (the fastest exact one here), int8, fp32 or bf16

    def with_seed(self, seed: int) -> Form:
        sampling = dataclasses.replace(self.settings.sampling, seed=seed)
        return dataclasses.replace(self, settings=dataclasses.replace(self.settings, sampling=sampling))


@dataclass
class Click:
    """One click's request, parsed by the first handler the click chains and handed down to the rest in
    the session's control state (control["click"]): the raw fields it was parsed from, its Form, and,
    once prepared, the prompt's ids and the pair. The click's last handler drops it (and the next click
    replaces it); a Click pickled across ZeroGPU's worker leaves the pair behind."""

    values: dict
    form: Form
    ids: list[int] | None = None
    pair: object | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "pair": None}


def handed_down(values: dict, control) -> Form:
    """The click's Form where `control` carries one parsed from these very values, else a fresh parse
    handed down from here. A blank seed is parsed afresh: each such call draws its own seed."""
    click = control.get("click") if isinstance(control, dict) else None
    if isinstance(click, Click) and click.values == values and click.form.seed_given:
        return click.form
    form = parse(values)
    if isinstance(control, dict):
        control["click"] = Click(dict(values), form)
    return form


def fill_seed(seed, decoding) -> int:
    """A blank Seed box: 0 under greedy (nothing is random), else a fresh random seed, shown back."""
    import random

    if blank(seed):
        return 0 if decoding == "greedy" else random.randrange(2**31)
    return int(seed)


def parse(values: dict) -> Form:
    """The fields (by name) as one Form; bad settings raise UserError with what to change."""
    v = {name: values.get(name, default) for name, default in fields()}
    target, draft = model_ids(v)
    greedy = v["decoding"] == "greedy"
    given = {k.name: _typed(k, v[k.name]) for k in shown() if k.config and k.name not in ("temperature", "seed")}
    given |= dict(temperature=0.0 if greedy else float(v["temperature"]), seed=fill_seed(v["seed"], v["decoding"]))
    # The UI's k slider never moves adaptive k's cap; adaptive k's trees are shaped each round (knobs.settings).
    settings = knobs.settings(given)
    return Form(v["prompt"], target, draft, settings, not blank(v["seed"]), str(v["dtype"]))


def _typed(knob: knobs.Knob, value):
    """A field's value as its knob's type (the page sends 4.0 for a whole-number slider)."""
    return value if knob.kind is str else knob.kind(value)


def takes_form(before: tuple[str, ...] = (), after: tuple[tuple[str, object], ...] = ()):
    """Decorate fn(*before, form, **after): its public signature is `before`, the FIELDS, then `after`
    (name, default) pairs; a call's field values are parsed into one Form."""

    def wrap(fn: Callable) -> Callable:
        def call(values: dict) -> tuple[list, dict]:
            typed = {n: values[n] for n, _ in fields() if n in values}
            form = handed_down(typed, values.get("control"))
            return [*(values[n] for n in before), form], {n: values[n] for n, _ in after}

        return _behind(fn, [*((n, _REQUIRED) for n in before), *fields(), *after], call)

    return wrap


def takes_models(fn: Callable) -> Callable:
    """Decorate fn(target, draft, *rest): its public signature is MODEL_FIELDS, then fn's own rest; the
    pair it gets is the pair as typed (model_ids), as every handler of the form reads it."""
    rest = list(inspect.signature(fn).parameters.values())[2:]
    params = [*((n, _REQUIRED) for n in MODEL_FIELDS), *((p.name, p.default) for p in rest)]
    return _behind(fn, params, lambda values: ([*model_ids(values), *(values[p.name] for p in rest)], {}))


def _behind(fn: Callable, params: list[tuple[str, object]], call: Callable[[dict], tuple[list, dict]]) -> Callable:
    """fn behind a public signature of (name, default) pairs (_REQUIRED: none); call(values by name)
    gives fn's arguments."""
    P = inspect.Parameter
    signature = inspect.Signature([P(n, P.POSITIONAL_OR_KEYWORD, default=d) for n, d in params])

    def split(args, kwargs) -> tuple[list, dict]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return call(bound.arguments)

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(*args, **kwargs):
            lead, tail = split(args, kwargs)
            yield from fn(*lead, **tail)

        wrapper = gen_wrapper
    else:

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            lead, tail = split(args, kwargs)
            return fn(*lead, **tail)

    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    return wrapper
