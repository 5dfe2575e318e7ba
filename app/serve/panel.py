"""A panel of bench figures streamed question by question ("By kind of text", "Which draft is worth it"):
one layout and one handler for every such panel (ui.py wires them alike); each declares only its words
and its stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import gradio as gr

from app.core.config import UserError
from app.serve import heap
from app.serve.form import Form, takes_form
from app.serve.handlers import as_user_error, guarded
from app.serve.zerogpu import gpu

Stream = Callable[[Form, dict | None, Callable], Iterator[tuple]]  # (form, control, progress) -> updates


@dataclass(frozen=True)
class Panel:
    """What one panel declares; `key` names its components' element ids: KEY-run, KEY-stop, KEY-status,
    KEY-plot."""

    title: str  # the accordion's
    elem_id: str  # the accordion's
    key: str
    about: str  # what it runs, in Markdown
    run: str  # the run button's label
    plot: str  # the figure's label
    records: str  # the JSON's label
    handler: Callable  # handler()'s, for its stream: its name is the API's


def handler(stream: Stream, name: str) -> Callable:
    """The panel's handler, called `name` (its API name) and documented as `stream`: the stream's (status,
    figure, records) updates, on the longest GPU loan. A user's mistake reaches the page as its error, and
    the memory the run freed goes back to the OS however it ends."""

    def run(form: Form, control=None, progress=gr.Progress()):
        try:
            yield from stream(form, control, progress)
        except UserError as e:
            raise as_user_error(e) from None
        finally:
            heap.release()

    run.__name__ = run.__qualname__ = name
    run.__module__, run.__doc__ = stream.__module__, stream.__doc__
    return gpu(guarded(takes_form(after=(("control", None), ("progress", gr.Progress())))(run)), longest=True)


def layout(panel: Panel) -> SimpleNamespace:
    """The panel's accordion: its run and stop buttons, and its outputs in the order its stream yields them."""
    with gr.Accordion(panel.title, open=False, elem_id=panel.elem_id):
        gr.Markdown(panel.about)
        with gr.Row():
            run = gr.Button(panel.run, variant="primary", elem_id=f"{panel.key}-run")
            stop = gr.Button("Stop", variant="stop", elem_id=f"{panel.key}-stop")
        status = gr.Markdown(elem_id=f"{panel.key}-status")
        plot = gr.Plot(label=panel.plot, elem_id=f"{panel.key}-plot")
        records = gr.JSON(label=panel.records, open=False)
    return SimpleNamespace(panel=panel, run=run, stop=stop, outputs=[status, plot, records])
