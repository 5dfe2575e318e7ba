"""Every setting a front end takes, declared once: its name, type, default, range, meaning, CLI flag and help.

The CLI's options (args.py), the settings form and its API parameters (serve/form.py), the checks on
what a client sends (serve/boundary.py) and the page's controls (serve/controls.py) are all generated
from KNOBS. How the page shows a setting (its words, widget kind and element id) is the serve layer's
own declaration, serve/knob_widgets.py. Adding a setting is one Knob here, its widget there if the page
shows it, and its use in the engine (a field of its config).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from app.core.config import (
    K_MAX,
    K_POLICIES,
    MAX_TEMPERATURE,
    RULES,
    TREE_MAX,
    RunConfig,
    SamplingConfig,
    Settings,
    SpecConfig,
    k_cap,
)

CONFIGS = {"sampling": SamplingConfig, "spec": SpecConfig, "run": RunConfig}
FROM_CONFIG: Any = object()  # a knob's default: its config field's own
MAX_NEW_TOKENS = 2048  # the longest run a front end asks for: a typo such as 99999 would run to the context's end
DTYPES = ("auto", "fp32", "bf16", "int8")  # the precisions a visitor may pick for the target


@dataclass(frozen=True)
class Knob:
    """One setting. `name` is the API's parameter, the CLI flag (--name-with-dashes) and, where `config`
    says which, the field of SamplingConfig, SpecConfig or RunConfig it sets."""

    name: str
    kind: type  # int, float, str or bool
    what: str  # its name in a message: "top-k must be ..."
    config: str | None = None  # sampling | spec | run; None: the front end reads it itself
    default: Any = FROM_CONFIG  # the CLI's and an API caller's default (None: the front end decides)
    lo: float | None = None  # the range a client may send at all; the config's validate() then checks sense
    hi: float | None = None
    choices: tuple = ()  # the values it takes (CLI, form and boundary)
    blank: bool = False  # a blank value is fine: the front end fills it (the seed)
    required: bool = False  # an API caller sends it (the first fields the API took)
    help: str | None = None  # the CLI's help; None: none
    cli: Mapping[str, Any] | None = field(default_factory=dict)  # argparse extras; None: no CLI option

    @property
    def value(self) -> Any:
        """The default, read from the config field when the knob does not give its own."""
        if self.default is not FROM_CONFIG:
            return self.default
        (f,) = [f for f in fields(CONFIGS[self.config or ""]) if f.name == self.name]
        return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def tree_nodes(text: str) -> int | str:
    """--tree's value: a node count, auto or off."""
    word = text.strip().lower()
    if word in ("off", "auto"):
        return 0 if word == "off" else "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tree takes a node count, auto or off, got {text!r}") from None


KNOBS: list[Knob] = [
    # The form's fields in the order the API takes them; a knob added later goes last, so API callers
    # that omit it get its default.
    Knob(
        "chat",
        bool,
        "chat",
        "run",
        default=None,
        required=True,
        help="format the prompt with the chat template (default: when the target has one)",
        cli=dict(action=argparse.BooleanOptionalAction),
    ),
    Knob(
        "decoding",
        str,
        "decoding",
        default="greedy",
        choices=("greedy", "sampling"),
        required=True,
        cli=None,  # the CLI's greedy is --temperature 0
    ),
    Knob(
        "temperature",
        float,
        "temperature",
        "sampling",
        lo=0,
        hi=MAX_TEMPERATURE,  # the engine's own bound (config.py), so the two messages name one range
        required=True,
        help="0 means greedy",
    ),
    Knob("top_k", int, "top-k", "sampling", lo=0, hi=10**9, required=True),
    Knob("top_p", float, "top-p", "sampling", lo=0, hi=1, required=True),
    Knob(
        "seed",
        int,
        "seed",
        "sampling",
        lo=0,
        hi=2**63 - 1,  # torch.Generator.manual_seed takes a 64-bit seed
        blank=True,
        required=True,
    ),
    Knob("max_new_tokens", int, "max new tokens", "run", lo=1, hi=MAX_NEW_TOKENS, required=True),
    Knob(
        "k_policy",
        str,
        "k policy",
        "spec",
        default=None,  # the CLI's: fixed when --k or a tree is given, else adaptive
        choices=K_POLICIES,
        required=True,
    ),
    Knob(
        "k",
        int,
        "k",
        "spec",
        default=None,  # the CLI's: no --k is adaptive k
        lo=1,
        hi=K_MAX,
        required=True,
        help="draft length; alone it means a fixed k (default: adaptive)",
    ),
    Knob(
        "repetition_penalty",
        float,
        "repetition penalty",
        "sampling",
        lo=0,
        hi=100,
        help="> 1 discourages repeating context tokens, as in transformers' generate (1: off)",
        # Applied to p and q alike at every position, so speculation stays lossless.
    ),
    Knob(
        "no_repeat_ngram_size",
        int,
        "no-repeat n-gram size",
        "sampling",
        lo=0,
        hi=64,
        help="forbid repeating any n-gram of this size, as in generate (0: off)",
    ),
    Knob(
        "rule",
        str,
        "sampling rule",
        "sampling",
        choices=RULES,
        help="how sampled drafts are judged: rejection (min(1, p/q), the most drafts kept; a seed repeats "
        "its text under fixed or heuristic k, not adaptive k, which follows this machine's timings) or "
        "shared-noise (target and draft race the same seeded noise: for a seed, the text of plain sampling, "
        "whatever the draft or k)",
    ),
    Knob(
        "tree",
        int,
        "tree nodes",
        "spec",
        lo=0,
        hi=TREE_MAX,
        help="up to N draft nodes a round, verified in one target pass, as on the page: with fixed k (the "
        "default with --tree N) a tree of N nodes, k deep (4 unless --k); with --k-policy adaptive this "
        "machine's cost model shapes each round (a plain step, a chain or a tree of up to N nodes); auto: "
        f"adaptive within {TREE_MAX} nodes; off or 0: a chain (default)",
        cli=dict(type=tree_nodes),
    ),
    Knob(
        "dtype",
        str,
        "precision",
        default=None,  # the CLI's: auto, or SPECDEC_DTYPE; a visitor's: the server's (serve/form.py)
        choices=DTYPES,
        help="int8, fp32, fp16, bf16 or auto: the fastest precision whose passes are exact at every width "
        "here, probed once per model (default: auto, or SPECDEC_DTYPE; int8: int8 weights with integer "
        "sums, a Llama-shaped target on a CPU)",
        cli=dict(choices=None),  # the CLI also takes fp16, and the loader says what it cannot use
    ),
    # The CLI's own: the page keeps their defaults.
    Knob("k_max", int, "k max", "spec", help="upper bound for heuristic and adaptive k"),
    Knob("stop", str, "stop string", "run", help="stop string (repeatable)", cli=dict(action="append", default=[])),
]


def by_name(name: str) -> Knob:
    """The declared setting called `name` (the CLI commands that take one of them alone read it here)."""
    return next(k for k in KNOBS if k.name == name)


def settings(values: Mapping[str, Any]) -> Settings:
    """The one mapping from knob values (by name; a missing one keeps its config's default) to validated
    Settings. k is fixed k, or heuristic's start: it raises their cap when above k max (config.k_cap).
    Adaptive k picks its own, up to k max, so k never moves adaptive's cap.

    `tree` means one thing wherever it is set (page, CLI, API): up to that many nodes a round. Under
    adaptive k the cost model shapes each round within it (a plain step, a chain or a tree); under a
    fixed k it is a fixed tree k deep. "auto" is adaptive shaping within TREE_MAX nodes."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in CONFIGS}
    for knob in KNOBS:
        if knob.config and knob.name in values:
            parts[knob.config][knob.name] = values[knob.name]
    spec, run = parts["spec"], parts["run"]
    policy = spec.get("k_policy", SpecConfig.k_policy)
    spec["k_max"] = k_cap(policy, spec.get("k", SpecConfig.k), spec.get("k_max", SpecConfig.k_max))
    run["stop"] = tuple(run.get("stop", ()))
    if spec.get("tree") == "auto":
        spec["tree"], spec["tree_auto"] = TREE_MAX, True
    else:
        spec["tree_auto"] = bool(spec.get("tree")) and policy == "adaptive"
    built: dict[str, Any] = {name: cls(**parts[name]) for name, cls in CONFIGS.items()}
    return Settings(**built)
