"""How the page shows the declared settings (core/knobs.py): each one's words, widget kind, range on
screen and element id. The settings' names, ranges and meaning stay in core; a setting named here is
on the page and in the settings form (form.py), in the API's order, KNOBS'.

Plain data, no gradio: controls.py builds the components, and form.py and boundary.py read `shown()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.core import knobs
from app.core.config import K_MAX, REJECTION, SHARED_NOISE, TREE_MAX, SpecConfig
from app.core.knobs import FROM_CONFIG, MAX_NEW_TOKENS, Knob


@dataclass(frozen=True)
class Widget:
    """How the page shows a knob; controls.py builds the component."""

    kind: str  # slider | number | radio | checkbox
    label: str
    group: str = "decoding"  # the accordion it sits in: models | decoding | speculation
    lo: float | None = None  # a slider's range and step
    hi: float | None = None
    step: float | None = None
    value: Any = FROM_CONFIG  # what the page starts with, when not the knob's default
    options: tuple[tuple[str, Any], ...] = ()  # a radio's (shown label, value) pairs, in the order shown
    info: str | None = None
    elem_id: str | None = None
    sampling_only: bool = False  # greyed out under greedy decoding, which ignores it


SAMPLING = "(sampling only"
# By knob name, in the page's order within each group; a widget added later goes last in its group.
WIDGETS: dict[str, Widget] = {
    "dtype": Widget(
        "radio",
        "Precision",
        group="models",
        options=(
            ("auto: the fastest exact one here", "auto"),
            ("int8: exact at every width", "int8"),
            ("fp32", "fp32"),
            ("bf16", "bf16"),
        ),
        info="int8 weights with integer sums give a row the same logits in a one-token pass and a verify "
        "pass, so greedy output is plain decoding's exactly; auto picks it where it runs. In fp32 and "
        "bf16 a verify pass can round a near-tie the other way, and the check then says so",
        elem_id="dtype",
    ),
    "decoding": Widget("radio", "Decoding"),
    "temperature": Widget("slider", f"Temperature {SAMPLING})", lo=0.05, hi=2.0, step=0.05, sampling_only=True),
    "top_k": Widget("slider", f"Top-k {SAMPLING}; 0 = off)", lo=0, hi=200, step=1, sampling_only=True),
    "top_p": Widget("slider", f"Top-p {SAMPLING}; 1 = off)", lo=0.05, hi=1.0, step=0.05, sampling_only=True),
    "seed": Widget("number", "Seed (blank: a fresh random seed)"),
    "rule": Widget(
        "radio",
        f"Sampling rule {SAMPLING})",
        options=(("rejection (min(1, p/q))", REJECTION), ("shared noise (same text as plain)", SHARED_NOISE)),
        info="shared noise: for a seed, plain sampling's text, whatever the draft or k. Rejection: more "
        "drafts kept; a seed repeats its text under fixed or heuristic k, not adaptive k",
        sampling_only=True,
    ),
    "repetition_penalty": Widget("slider", "Repetition penalty (1 = off)", lo=1.0, hi=2.0, step=0.05),
    "no_repeat_ngram_size": Widget("slider", "No-repeat n-gram size (0 = off)", lo=0, hi=8, step=1),
    # A number box, not a slider: a slider clamps a typed 0 or 100000 without a word, while a value
    # outside the range the label states is refused with a message when a run starts.
    "max_new_tokens": Widget("number", f"Max new tokens, 1 to {MAX_NEW_TOKENS}", elem_id="max-new"),
    "chat": Widget("checkbox", "Chat formatting: the prompt is an instruction (models with a chat template)"),
    "k_policy": Widget("radio", "k policy", group="speculation", value="adaptive", elem_id="k-policy"),
    "k": Widget(
        "slider",
        f"k: fixed k, or heuristic's start (adaptive ignores it and picks k ≤ {SpecConfig.k_max})",
        group="speculation",
        lo=1,
        hi=K_MAX,
        step=1,
        value=SpecConfig.k,
        elem_id="k",
    ),
    "tree": Widget(
        "slider",
        "Tree nodes: 0 drafts a chain. With fixed k, a tree of N nodes, k deep; with adaptive k, "
        "this machine's cost model shapes each round (a plain step, a chain or a tree of up to N nodes). "
        "One target pass verifies the whole tree",
        group="speculation",
        lo=0,
        hi=TREE_MAX,  # the API's and the CLI's limit: one range in every message
        step=1,
        elem_id="tree-nodes",
    ),
}


def shown() -> list[Knob]:
    """The knobs on the page and in the form, in the API's order (KNOBS')."""
    return [k for k in knobs.KNOBS if k.name in WIDGETS]


def start_value(knob: Knob):
    """What the page starts with when the first example does not set it."""
    w = WIDGETS[knob.name]
    return knob.value if w.value is FROM_CONFIG else w.value


def sampling_only() -> list[str]:
    """The knobs greyed out under greedy decoding, which ignores them."""
    return [k.name for k in shown() if WIDGETS[k.name].sampling_only]
