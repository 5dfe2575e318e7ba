"""The Gradio app: speculative and autoregressive decoding side by side, live. The layout is here and the
event wiring at its end; the handlers are in handlers.py and the fixed texts in texts.py. Only serve/
imports gradio, and everything shown comes from the engine's Step records through views/.
"""

from __future__ import annotations

import logging
import os
import threading
from types import SimpleNamespace

import gradio as gr

from app import models
from app.serve import by_kind, controls, form, knob_widgets, one_round, panel, queue_limits, sessions, which_draft
from app.serve.generation import generate_both, request_stop, start_run  # noqa: F401
from app.serve.handlers import (  # noqa: F401 - the handlers are the app's API, reached through ui too
    _cap_label,
    _choices,
    _context_cap,
    cap_for_loaded,
    cap_for_target,
    check_request,
    drafts_for_custom_target,
    drafts_for_target,
    export_for,
    fill_seed,
    guarded,
    list_presets,
    load_pair,
)
from app.serve.one_round import step_round  # noqa: F401
from app.serve.texts import CSS, EXAMPLES, EXPLANATION, GLOSSARY, KNOWS, TIMING_NOTE, example_row
from app.views import render

log = logging.getLogger(__name__)


def build_ui() -> gr.Blocks:
    with gr.Blocks(title="Speculative decoding, live", analytics_enabled=False) as demo:
        gr.Markdown(
            "# Speculative decoding, live\nA fast draft proposes k tokens; the target checks them all "
            "in one pass and keeps what it agrees with. Same output, fewer target passes."
        )
        gr.Markdown(KNOWS, elem_id="knows")
        c = SimpleNamespace(fields={})  # every component the wiring reads, by name; fields: the settings
        with gr.Row():
            with gr.Column(scale=3):
                _prompt_column(c)
            with gr.Column(scale=2):
                _model_controls(c)
                _decoding_controls(c)
        with gr.Row():
            c.run_btn = gr.Button("Generate", variant="primary")
            c.step_btn = gr.Button("Step one round")
            c.stop_btn = gr.Button("Stop", variant="stop")
        # A click's check loads the pair: its phase shows here (the panes keep the last results).
        c.run_status = gr.Markdown(elem_id="run-status", min_height=0)
        gr.Markdown(TIMING_NOTE)
        gr.HTML(render.LEGEND)
        _results(c)
        _teaching(c)
        with c.examples_slot:
            # Clicking an example also sets its own decoding settings (greedy for code, sampling for English).
            gr.Examples(
                [example_row(e) for e in EXAMPLES],
                [c.prompt, *(c.fields[name] for name in EXAMPLE_SETTINGS)],
                example_labels=[e["label"] for e in EXAMPLES],
                cache_examples=False,
                label="Examples, each with its own settings: code and structured answers (greedy), open-ended "
                "writing (sampled)",
            )
        _wire(c)
    return demo


def _prompt_column(c) -> None:
    # The first screen is the first example with its own settings, not bare greedy decoding.
    c.first = example_row(EXAMPLES[0])
    c.prompt = gr.Textbox(label="Prompt", lines=6, value=c.first[0], elem_id="prompt")
    c.examples_slot = gr.Column()  # filled later, once the settings an example sets exist


def _model_controls(c) -> None:
    with gr.Accordion("Models", open=True):
        c.target = gr.Dropdown(
            _choices(models.TARGET_PRESETS),
            value=next(iter(models.TARGET_PRESETS)),
            label="Target",
            allow_custom_value=True,
        )
        c.custom_target = gr.Textbox("", label="…or a custom target (Hub id or local directory)")
        # the drafts the default target runs; a change of target re-lists them (drafts_for_target)
        c.draft = gr.Dropdown(
            _choices(models.presets.drafts_for_target(next(iter(models.TARGET_PRESETS)))),
            value=models.presets.default_draft(next(iter(models.TARGET_PRESETS))),
            label="Draft",
            allow_custom_value=True,
        )
        c.custom_draft = gr.Textbox("", label="…or a custom draft (Hub id, local dir, prompt-lookup, early-exit:N)")
        controls.group("models", c, dict(dtype=form.server_dtype()))
        c.load_btn = gr.Button("Load pair", size="sm")
        c.status = gr.Markdown()


# The settings an example sets, in the order of example_row after its prompt.
EXAMPLE_SETTINGS = (
    "decoding",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "max_new_tokens",
    "seed",
    "chat",
)


def _decoding_controls(c) -> None:
    values = dict(zip(EXAMPLE_SETTINGS, c.first[1:], strict=True))
    cap = _context_cap(next(iter(models.TARGET_PRESETS)))
    values["max_new_tokens"] = min(values["max_new_tokens"], cap)
    with gr.Accordion("Decoding", open=False):
        # Greedy ignores the sampling-only controls, so they are greyed out under it (sampling_controls).
        controls.group("decoding", c, values, overrides=dict(max_new_tokens=dict(label=_cap_label(cap))))
    with gr.Accordion("Speculation", open=False):
        controls.group("speculation", c)


def _results(c) -> None:
    # Only the page's style changes (REJECTED_VIEW): no request, and it applies mid-run too.
    c.rejected_view = gr.Radio(
        list(REJECTED_VIEWS),
        value=REJECTED_VIEWS[0],
        label="Rejected drafts in the speculative pane",
        elem_id="rejected-view",
    )
    with gr.Row():
        with gr.Column(min_width=300):
            gr.Markdown("### Speculative")
            # autoscroll follows the newest tokens unless the reader has scrolled up.
            c.spec_pane = gr.HTML(render.SPEC_PLACEHOLDER, elem_id="spec-pane", max_height=520, autoscroll=True)
        with gr.Column(min_width=300):
            gr.Markdown("### Autoregressive (target alone)")
            c.ar_pane = gr.HTML(render.AR_PLACEHOLDER, elem_id="ar-pane", max_height=520, autoscroll=True)
    c.check = gr.Markdown(elem_id="greedy-check")
    c.summary = gr.Markdown(elem_id="summary")
    with gr.Accordion("Run this setup elsewhere: vLLM and llama.cpp commands", open=False):
        c.export_code = gr.Code(
            language="shell", label="export (copy button at the top right)", interactive=False, elem_id="export"
        )
    # min_width wraps the plots one to a row on a narrow screen instead of squeezing them.
    with gr.Row():
        c.fig_time = gr.Plot(label="tokens over time", elem_id="plot-time", min_width=320)
        c.fig_k = gr.Plot(label="k per round", elem_id="plot-k", min_width=320)
    with gr.Row():
        c.fig_acc = gr.Plot(label="acceptance per round", elem_id="plot-acc", min_width=320)
        c.fig_pos = gr.Plot(label="acceptance by position", elem_id="plot-pos", min_width=320)
        c.fig_hist = gr.Plot(label="tokens per round", elem_id="plot-hist", min_width=320)


def _teaching(c) -> None:
    # Step opens this view and scrolls it into sight (_wire): closed, a round's result would land out of view.
    with gr.Accordion("Teaching mode: one round at a time", open=False, elem_id="teaching") as c.teaching:
        with gr.Row():
            c.back_btn = gr.Button("Step back", size="sm", elem_id="step-back")
            c.forward_btn = gr.Button("Step forward", size="sm", elem_id="step-forward")
            c.play_btn = gr.Button(one_round.PLAY, size="sm", elem_id="auto-play")
            c.reset_btn = gr.Button("Reset", size="sm", elem_id="step-reset")
        c.timer = gr.Timer(one_round.AUTOPLAY_S, active=False)  # Auto-play's ticks, a round each
        with gr.Accordion("Glossary: α, acceptance rate, c, k, bonus token, prefill", open=False):
            gr.Markdown(GLOSSARY, elem_id="glossary")
        c.step_note = gr.Markdown(one_round.INTRO, elem_id="step-note")
        c.step_pane = gr.HTML(render.STEP_PLACEHOLDER, elem_id="step-pane", max_height=360, autoscroll=True)
        c.decisions = gr.Dataframe(
            headers=render.DECISION_HEADERS,
            label="Each drafted token, judged in order",
            interactive=False,
            elem_id="decisions",
            # Shares of the width and wrapped cells: on a phone every column stays in view, each cell whole.
            wrap=True,
            column_widths=["16%", "13%", "16%", "18%", "13%", "24%"],
        )
        # A short label: a long one wraps to two lines on a phone, over the figure's own title.
        c.residual = gr.Plot(label="p, q and the target token's source", elem_id="residual")
    c.panels = [panel.layout(p) for p in (by_kind.PANEL, which_draft.PANEL)]
    with gr.Accordion("How speculative decoding works", open=False):
        gr.Markdown(EXPLANATION)
    with gr.Accordion("Records (JSON)", open=False):
        c.records = gr.JSON(label="both runs: settings, per-round records and stats")
    c.presets_json = gr.JSON(visible=False)
    # Plain data (sessions.Teaching); its live run is dropped when the visitor leaves or idles out.
    c.session = gr.State(None, time_to_live=sessions.STATE_TTL, delete_callback=sessions.forget)
    c.control = gr.State({"stop": False}, time_to_live=sessions.STATE_TTL)  # this session's Stop request


def _wire(c) -> None:
    model_inputs = [*(getattr(c, name) for name in form.MODEL_FIELDS), c.dtype]  # form.takes_models' order
    # The settings form's fields (form.fields()), each the component its API parameter reads, in order.
    by_name = {name: getattr(c, name) for name in form.PAIR_FIELDS} | c.fields
    inputs = [by_name[name] for name in form.names()]
    # One queue for the device; SPECDEC_CONCURRENCY runs share it at once (queue_limits.py).
    device = dict(concurrency_limit=queue_limits.concurrency(), concurrency_id="device")
    private = dict(api_visibility="private")
    # Each run first fills a blank seed and checks the request; only a good request replaces what is
    # on screen, so a failed load leaves the previous results in place.
    c.run_btn.click(start_run, [c.seed, c.decoding, c.control], c.seed, queue=False, **private).then(
        check_request, [*inputs, c.control], c.run_status, **private, **device
    ).success(
        generate_both,
        [*inputs, c.control],
        [c.spec_pane, c.ar_pane, c.check, c.summary, c.fig_time, c.fig_k, c.fig_acc, c.fig_pos, c.fig_hist, c.records],
        api_name="generate",
        **device,
    ).success(export_for, [*inputs, c.control], c.export_code, **private)
    _wire_teaching(c, inputs, device, private)
    for shown in c.panels:
        handler = shown.panel.handler
        shown.run.click(start_run, [c.seed, c.decoding, c.control], c.seed, queue=False, **private).then(
            handler, [*inputs, c.control], shown.outputs, api_name=handler.__name__, **device
        )
        shown.stop.click(request_stop, c.control, None, queue=False, **private)
    # One round of Step is short, so Stop only ends a generation or a panel's run (cooperatively, after a round).
    c.stop_btn.click(request_stop, c.control, None, queue=False, **private)
    c.load_btn.click(load_pair, model_inputs, c.status, api_name="load_pair", **device).success(
        cap_for_loaded, [*model_inputs, c.max_new_tokens], c.max_new_tokens, **private, **device
    )
    gr.on(
        [c.target.change, c.custom_target.blur],
        cap_for_target,
        [c.target, c.custom_target, c.max_new_tokens],
        c.max_new_tokens,
        queue=False,
        **private,
    )
    c.target.change(drafts_for_target, c.target, [c.draft, c.fields["chat"]], queue=False, **private)
    c.custom_target.blur(drafts_for_custom_target, c.custom_target, c.draft, queue=False, **private)
    greyed = [c.fields[name] for name in knob_widgets.sampling_only()]
    c.decoding.change(sampling_controls, c.decoding, greyed, queue=False, **private)
    c.rejected_view.change(None, c.rejected_view, None, js=REJECTED_VIEW, **private)
    gr.Button(visible=False).click(list_presets, None, c.presets_json, api_name="presets")


def _wire_teaching(c, inputs: list, device: dict, private: dict) -> None:
    shown = [c.session, c.step_pane, c.decisions, c.step_note, c.residual]
    c.step_btn.click(lambda: gr.Accordion(open=True), None, c.teaching, queue=False, **private).then(
        None, js=SHOW_TEACHING, **private
    )

    def step(button, api: dict):
        return (
            button.click(start_run, [c.seed, c.decoding, c.control], c.seed, queue=False, **private)
            .then(check_request, [*inputs, c.control], c.run_status, **private, **device)
            .success(step_round, [c.session, *inputs, c.control], shown, **api, **device)
        )

    step(c.step_btn, dict(api_name="step")).success(None, js=SHOW_TEACHING, **private)  # again: the page has grown
    step(c.forward_btn, private)  # beside Step back, in the view
    c.back_btn.click(one_round.step_back, [c.session, *inputs, c.control], shown, api_name="step_back", **device)
    # Auto-play starts (or pauses) a timer whose every tick steps a round; a tick is skipped while the
    # one before it runs. The end of the generation, Stop, Reset or an error stops it.
    play = [c.timer, c.play_btn]
    c.play_btn.click(start_run, [c.seed, c.decoding, c.control], c.seed, queue=False, **private).then(
        one_round.toggle_play, c.play_btn, play, queue=False, **private
    )
    c.timer.tick(
        one_round.play_round,
        [c.session, *inputs, c.control],
        shown + play,
        show_progress="minimal",
        **private,
        **device,
    ).failure(one_round.paused, None, play, queue=False, **private)
    c.stop_btn.click(one_round.paused, None, play, queue=False, **private)
    c.reset_btn.click(one_round.reset, c.session, shown + play, queue=False, **private)


REJECTED_VIEWS = ("inline (whitespace as · and ↵)", "a small mark: hover or tap it for the drafts")
# Runs in the browser: the body's rej-marks class picks the view (style.css), for every pane at once.
REJECTED_VIEW = f"(view) => {{ document.body.classList.toggle('rej-marks', view === '{REJECTED_VIEWS[1]}'); }}"
# Runs in the browser after Step: once the view's contents are laid out (its open state lands a few
# frames after the click), its top edge goes to the top of the window, or as near as the page allows.
SHOW_TEACHING = """() => {
  const show = (frames) => {
    if (document.getElementById('step-note')?.offsetParent) {
      document.getElementById('teaching').scrollIntoView({block: 'start'});
    } else if (frames > 0) {
      requestAnimationFrame(() => show(frames - 1));
    }
  };
  show(300);
}"""


def _prepare(model_id: str) -> None:
    try:
        models.prepare(model_id)
    except Exception as e:  # noqa: BLE001 - a start-up convenience: the first request reports it properly
        log.warning("could not prepare %s at start-up: %s", model_id, e)


@guarded
def sampling_controls(decoding: str) -> list[dict]:
    """Temperature, top-k, top-p and the sampling rule (knob_widgets.sampling_only): usable under sampling,
    greyed out under greedy, which ignores them."""
    return [gr.update(interactive=decoding != "greedy") for _ in knob_widgets.sampling_only()]


def launch(host: str | None = None, port: int | None = None, share: bool = False) -> None:
    from starlette.middleware import Middleware
    from transformers.utils import logging as hf_logging

    from app.serve import boundary
    from app.serve.handlers import as_user_error

    models.hosting.serving()  # ids typed into this server are visitors', whoever the proxy makes them look like
    hf_logging.disable_progress_bar()  # the server log is for requests and real errors, not load bars
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    boundary.limit_logging()  # a flood of bad requests writes a few lines a minute, not thousands
    demo = build_ui()
    # The default target's one-time work (converting the wheel's GGUF) runs beside the server, so the
    # first page does not wait for it; the first request for the model waits only for what is left.
    threading.Thread(target=_prepare, args=(next(iter(models.TARGET_PRESETS)),), daemon=True).start()
    # The queue otherwise rebuilds a pandas summary of up to its last 10,000 events after every event,
    # for a monitoring page this app keeps closed: per event, that is server time a run could use.
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", str(2**31))
    os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", "64")
    # api_open=False everywhere (Gradio opens it off a Space): a direct POST to a queued event's
    # /run/ route would skip the fair queue, its per-visitor cap and its rate limit.
    demo.queue(max_size=queue_limits.MAX_QUEUED, default_concurrency_limit=queue_limits.concurrency(), api_open=False)
    queue_limits.install(demo)  # no visitor holds more than a few places in it
    queue_limits.distrust_forwarding()  # the caps count the peer, or what the app's proxy setting says
    boundary.gate(demo, as_user_error)  # every raw input checked before Gradio's preprocessing
    demo.delete_cache = (3600, 3600)  # Gradio's temporary files (the app itself writes none) go after an hour
    demo.launch(
        server_name=host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=port or int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        share=share or os.environ.get("GRADIO_SHARE", "").lower() in ("1", "true"),
        # show_error=False: only gr.Error messages (written for visitors) reach a client. The app has
        # no file inputs, so the upload route is closed, and it keeps no run history.
        css=CSS,
        show_error=False,
        max_file_size="1kb",
        run_history=False,
        enable_monitoring=False,  # Gradio's /monitoring/summary would be public
        state_session_capacity=sessions.MAX_SESSIONS,  # memory stays bounded however many visit
        # Refusals first: an address past its share of refused requests gets a 429 before anything runs.
        app_kwargs={
            "middleware": [Middleware(m) for m in (queue_limits.Refusals, boundary.NoUploads, boundary.ProxyWatch)]
        },
        quiet=True,  # Gradio's own lines name launch(share=True); this app's switch is --share
        prevent_thread_lock=True,
    )
    print(f"* Running on local URL:  {demo.local_url}", flush=True)
    print(f"* Public URL: {demo.share_url}" if demo.share_url else START_NOTE, flush=True)
    demo.block_thread()


START_NOTE = "* For a public link, start the app with: python app.py --share (public hosting serves presets only)"
