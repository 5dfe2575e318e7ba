"""The app's event handlers: every function a click or an API client calls, with inputs checked by name
(boundary.py) and user errors as one-line messages, never a traceback."""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from app import models
from app.core.config import UserError
from app.models import hosting
from app.request import CONVERTING, LOADING, MEASURING, loading_note  # noqa: F401 - the views' phase names
from app.serve import boundary, queue_limits
from app.serve.boundary import MAX_NEW_TOKENS_CAP
from app.serve.form import Click, Form, fill_seed, takes_form, takes_models, typed_id  # noqa: F401 - fill_seed: the UI's start_run
from app.serve.texts import EXAMPLES, example_row  # noqa: F401 - the API's examples

log = logging.getLogger(__name__)


def as_user_error(e: Exception) -> gr.Error:
    """A user error: one line in the server log, the message in the browser, no traceback. Gradio
    renders a message as HTML, and messages quote what a visitor typed: it goes out as text."""
    log.warning("user error: %s", e)
    return gr.Error(html.escape(str(e), quote=False), print_exception=False)


# Every handler a client can call: inputs checked by name, no raw exception text out (boundary.py).
guarded = boundary.guarded(as_user_error, passthrough=(gr.Error,))


def loaded_pair(target: str, draft: str, dtype: str = "auto", progress=None) -> models.Pair:
    """The loaded pair; while a first load waits on the wheel's GGUF conversion, `progress` (the
    page's tracker) hears how far it is."""
    waiting = None if progress is None else lambda: _converting(progress)
    try:  # a slow load goes on in the background and never holds the device slot for long
        key = (target, draft, dtype)
        return queue_limits.within_load_time(key, lambda: models.load_pair(target, draft, dtype=dtype), waiting=waiting)
    except UserError as e:
        raise as_user_error(e) from None


@dataclass(frozen=True)
class Prepared:
    """One click's pair and prompt ids: resolved and encoded once, by the click's first handler."""

    pair: models.Pair
    ids: list[int]


def new_click(control: dict | None) -> None:
    """A click starts: its first handler parses the form and hands it down (form.Click); start_run calls
    this, so nothing of an earlier click is reused."""
    if control is not None:
        control["click"] = None


def _converting(progress) -> None:
    """The conversion's share of tensors done, while the wheel's GGUF converts (the converter may be
    the server's start-up or another request; its bar is the loader's own count)."""
    done = models.gguf_target.converting()
    if done is not None:
        progress(done, desc=CONVERTING)


def prepared(form: Form, control: dict | None = None, last: bool = False, progress=None) -> Prepared:
    """The form's pair and prompt ids, prepared once per click (handed down in `control`, form.Click),
    else resolved and encoded now. `last`: the click's final handler, which drops what it shared.
    `progress`: the page's tracker, told how far a first load's GGUF conversion is."""
    click = control.get("click") if isinstance(control, dict) else None
    click = click if isinstance(click, Click) and click.form is form else None
    if last and isinstance(control, dict):
        control["click"] = None
    if click is not None and click.ids is not None and click.pair is not None:
        return Prepared(click.pair, click.ids)  # type: ignore[arg-type]
    pair = loaded_pair(form.target, form.draft, form.dtype, progress)
    ready = Prepared(pair, pair.encode(form.prompt, form.settings.run.chat))
    if click is not None and not last:
        # A click that never reaches its last handler holds its pair until the session's next click.
        click.ids, click.pair = ready.ids, pair
    return ready


def measuring(progress) -> Callable[[float], None]:
    """What calibration reports its progress to: the page's tracker, under MEASURING."""
    return lambda fraction: progress(fraction, desc=MEASURING)


@guarded
@takes_form(after=(("control", None), ("progress", gr.Progress())))
def check_request(form: Form, control=None, progress=gr.Progress()) -> str:
    """Refuse bad settings, an unloadable pair or a bad prompt before a run starts; a good request's
    pair and ids are kept for the rest of the click.

    Its one output is the run's status line, where a first request's load shows its phase; a refusal
    is a message, and the previous run's results stay on screen.
    """
    try:
        cap = _context_cap(form.target)
        if form.settings.run.max_new_tokens > cap:
            raise UserError(
                f"max new tokens must be a whole number from 1 to {cap} for this target, "
                f"got {form.settings.run.max_new_tokens}"
            )
        progress(0.0, desc=loading_note(form.target, form.dtype))
        prepared(form, control, progress=progress)
    except UserError as e:
        raise as_user_error(e) from None
    return ""


def _context_cap(model_id: str) -> int:
    """Max new tokens for this target: its context from config.json when it is on this machine already
    (nothing is converted or downloaded to find out; the load checks the context again)."""
    try:
        config = models.local_config(model_id)
        ctx = json.loads(config.read_text()).get("max_position_embeddings") if config else None
    except (UserError, OSError, ValueError):
        ctx = None
    return min(MAX_NEW_TOKENS_CAP, ctx or MAX_NEW_TOKENS_CAP)


def _cap_label(cap: int) -> str:
    """The range, in the label: the box refuses what lies outside it (check_request)."""
    return f"Max new tokens, 1 to {cap}" + (" (the target's context)" if cap < MAX_NEW_TOKENS_CAP else "")


def _cap_box(cap: int, value) -> gr.Number:
    """Max new tokens for a new cap: a value above it comes down to it, with the label saying so; any
    other value stays as typed, so a bad one is still refused with a message."""
    try:
        value = min(int(value), cap)
    except (TypeError, ValueError, OverflowError):
        pass
    return gr.Number(value=value, label=_cap_label(cap))


@guarded
def cap_for_target(target, custom_target, value) -> gr.Slider:
    """When the target changes, cap Max new tokens to its context where that is known without loading."""
    return _cap_box(_context_cap(typed_id(target, custom_target)), value)


@guarded
def drafts_for_target(target):
    """When the preset target changes: the drafts it can run, its default selected, and chat formatting
    as its template says."""
    labels = models.presets.drafts_for_target(target)
    chat = models.presets.id_of(target) in models.presets.CHAT_TARGETS
    return gr.Dropdown(choices=_choices(labels), value=labels[0]), gr.Checkbox(value=chat)


@guarded
def drafts_for_custom_target(custom_target):
    """A typed target is offered every draft, the one chosen kept (nothing is known of it before it loads)."""
    if not (custom_target or "").strip():
        return gr.Dropdown()
    return gr.Dropdown(choices=_choices(models.DRAFT_PRESETS))


def _choices(presets) -> list[tuple[str, str]]:
    """Dropdown entries (shown label, value): presets that are neither bundled nor cached say so."""
    return [(f"{name} · needs a download" if models.needs_download(name) else name, name) for name in presets]


@guarded
@takes_models
def load_pair(target, draft, dtype="auto", progress=gr.Progress()):
    """Load (or fetch from the shared cache) a pair and say what was loaded."""
    progress(0.1, desc=f"loading {target}")
    pair = loaded_pair(target, draft, dtype, progress)
    progress(1.0, desc="ready")
    t = pair.target
    # Preset names as the user picked them; a custom id or directory as given.
    shown_target, shown_draft = hosting.shown(target), hosting.shown(draft)  # as typed, never a resolved path
    return (
        f"Loaded target **{shown_target}** ({models.exact_model.parameter_count(t) / 1e6:.1f}M parameters, "
        f"{t.config.num_hidden_layers} layers, context {models.context_length(t)} tokens, "
        f"{models.precision_of(t)}, {t.device}) with draft **{shown_draft}**. The server keeps the "
        f"{models.loading.MAX_CACHED} models loaded last, in any precision, and drops the oldest."
        + (f" Note: {pair.note}." if pair.note else "")
    )


@guarded
@takes_form(after=(("control", None),))
def export_for(form: Form, control=None) -> str:
    """The same pair and settings as `vllm serve` and `llama-server` commands (python -m app export);
    Generate's last handler, so it ends the click's shared pair and ids."""
    from app import export
    from app.args import command_line

    try:
        typed = (form.target, form.draft)  # commands name the models as picked
        pair = prepared(form, control, last=True).pair
        here = command_line(form.prompt, form.target, form.draft, form.settings, form.dtype)
        elsewhere = export.for_pair(pair, form.settings.spec, form.settings.sampling, typed=typed)
        return f"# this run from the command line, these settings exactly\n{here}\n\n{elsewhere}"
    except UserError as e:
        return f"# no export: {e}"


@guarded
@takes_models
def cap_for_loaded(target, draft, dtype, value) -> gr.Slider:
    """After a load: cap Max new tokens to the loaded target's context (the pair is cached by then)."""
    pair = loaded_pair(target, draft, dtype)
    return _cap_box(min(MAX_NEW_TOKENS_CAP, models.context_length(pair.target)), value)


def list_presets() -> dict:
    """The preset targets and draft sources, label to id (a bundled model's id is its label, not its path)."""

    def public(presets: dict[str, str]) -> dict[str, str]:
        return {label: label if Path(value).is_absolute() else value for label, value in presets.items()}

    return {
        "targets": public(models.TARGET_PRESETS),
        "drafts": public(models.DRAFT_PRESETS),
        "allowlist": sorted(models.allowlist()) if models.allowlist() else None,
    }
