"""The settings form: the UI's inputs as one ordered list of named fields, parsed once per click into
one typed `Form` that every handler takes.

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

from app.args import make_settings
from app.core.config import REJECTION, Settings, SpecConfig

_REQUIRED = inspect.Parameter.empty
DTYPES = ("auto", "fp32", "bf16", "int8")  # the precisions a visitor may pick for the target


def server_dtype() -> str:
    """The precision a visitor starts with: the server's own (loading.default_dtype), else auto."""
    from app.models.loading import default_dtype

    chosen = default_dtype()
    return chosen if chosen in DTYPES else "auto"


# (name, default) in the order the UI wires its inputs; the last four came later, so API callers
# that omit them get the old behaviour.
FIELDS: tuple[tuple[str, object], ...] = (
    ("prompt", _REQUIRED),
    ("target", _REQUIRED),
    ("custom_target", _REQUIRED),
    ("draft", _REQUIRED),
    ("custom_draft", _REQUIRED),
    ("chat", _REQUIRED),
    ("decoding", _REQUIRED),
    ("temperature", _REQUIRED),
    ("top_k", _REQUIRED),
    ("top_p", _REQUIRED),
    ("seed", _REQUIRED),
    ("max_new_tokens", _REQUIRED),
    ("k_policy", _REQUIRED),
    ("k", _REQUIRED),
    ("repetition_penalty", 1.0),
    ("no_repeat_ngram_size", 0),
    ("rule", REJECTION),
    ("tree", 0),
    ("dtype", server_dtype()),
)
NAMES = tuple(name for name, _ in FIELDS)


def blank(seed) -> bool:
    return seed is None or str(seed).strip() == ""


def model_ids(target: str, custom_target: str, draft: str, custom_draft: str) -> tuple[str, str]:
    """The pair as typed: a custom id, when given, over the preset picked."""
    return (custom_target or "").strip() or target, (custom_draft or "").strip() or draft


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


def fill_seed(seed, decoding) -> int:
    """A blank Seed box: 0 under greedy (nothing is random), else a fresh random seed, shown back."""
    import random

    if blank(seed):
        return 0 if decoding == "greedy" else random.randrange(2**31)
    return int(seed)


def parse(values: dict) -> Form:
    """The fields (by name) as one Form; bad settings raise UserError with what to change."""
    v = {name: values.get(name, default) for name, default in FIELDS}
    target, draft = model_ids(v["target"], v["custom_target"], v["draft"], v["custom_draft"])
    settings = make_settings(
        0.0 if v["decoding"] == "greedy" else float(v["temperature"]),
        int(v["top_k"]),
        float(v["top_p"]),
        fill_seed(v["seed"], v["decoding"]),
        float(v["repetition_penalty"]),
        int(v["no_repeat_ngram_size"]),
        v["rule"],
        k=int(v["k"]),
        k_policy=v["k_policy"],
        k_max=SpecConfig.k_max,  # the UI's k slider never moves adaptive k's cap (make_settings)
        max_new_tokens=int(v["max_new_tokens"]),
        chat=bool(v["chat"]),
        tree=int(v["tree"]),
        tree_auto=v["k_policy"] == "adaptive" and int(v["tree"]) > 0,  # adaptive k's trees: shaped each round
    )
    return Form(v["prompt"], target, draft, settings, not blank(v["seed"]), str(v["dtype"]))


def takes_form(before: tuple[str, ...] = (), after: tuple[tuple[str, object], ...] = ()):
    """Decorate fn(*before, form, **after): its public signature is `before`, the FIELDS, then `after`
    (name, default) pairs; a call's field values are parsed into one Form."""

    def wrap(fn: Callable) -> Callable:
        P = inspect.Parameter
        params = [P(n, P.POSITIONAL_OR_KEYWORD) for n in before]
        params += [P(n, P.POSITIONAL_OR_KEYWORD, default=d) for n, d in FIELDS]
        params += [P(n, P.POSITIONAL_OR_KEYWORD, default=d) for n, d in after]
        signature = inspect.Signature(params)

        def split(args, kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = bound.arguments
            return [values[n] for n in before], parse(values), {n: values[n] for n, _ in after}

        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen_wrapper(*args, **kwargs):
                lead, form, tail = split(args, kwargs)
                yield from fn(*lead, form, **tail)

            wrapper = gen_wrapper
        else:

            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                lead, form, tail = split(args, kwargs)
                return fn(*lead, form, **tail)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return wrapper

    return wrap
