"""The page's controls for the declared settings (core/knobs.py): each knob's Widget (knob_widgets.py) built
as its Gradio component, in the place the page gives it."""

from __future__ import annotations

import gradio as gr

from app.core import knobs
from app.core.knobs import FROM_CONFIG, Knob
from app.serve import knob_widgets


def component(knob: Knob, value=FROM_CONFIG, sampled: bool = True, **overrides) -> gr.components.Component:
    """The control for one knob, starting at `value` (default: start_value); `sampled`: whether the
    page starts under sampling, else sampling-only controls start greyed out."""
    w = knob_widgets.WIDGETS[knob.name]
    value = knob_widgets.start_value(knob) if value is FROM_CONFIG else value
    common = dict(label=w.label, elem_id=w.elem_id)
    if w.sampling_only:
        common["interactive"] = sampled
    common |= overrides
    if w.kind == "slider":
        return gr.Slider(w.lo, w.hi, value, step=w.step, **common)
    if w.kind == "number":
        return gr.Number(value, precision=0 if knob.kind is int else None, **common)
    if w.kind == "radio":
        return gr.Radio(list(w.options or knob.choices), value=value, info=w.info, **common)
    if w.kind == "checkbox":
        return gr.Checkbox(value, **common)
    raise ValueError(f"no control for a {w.kind!r} widget ({knob.name})")


def group(name: str, c, values: dict | None = None, **overrides) -> None:
    """The controls of one group, in WIDGETS' order, each set on `c.fields` (and `c`) by its knob's name.
    `values`: start values by name (an example's); `overrides`: a control's own arguments, by name."""
    values = values or {}
    sampled = values.get("decoding", "sampling") != "greedy"  # under greedy, sampling-only ones start greyed
    for knob in [knobs.by_name(n) for n, w in knob_widgets.WIDGETS.items() if w.group == name]:
        built = component(knob, values.get(knob.name, FROM_CONFIG), sampled, **overrides.get(knob.name, {}))
        c.fields[knob.name] = built
        setattr(c, knob.name, built)
