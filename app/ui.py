"""The Gradio app: speculative and autoregressive decoding side by side, live.

The only module that imports gradio. Everything it shows comes from the engine's Step
records through `render`, `metrics` and `plots`; it holds no engine logic of its own.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import torch

from app import boundary, calibrate, engine, hosting, metrics, models, plots, queue_limits, render, sessions, threads
from app.config import MAX_NEW_TOKENS_CAP, RunConfig, SamplingConfig, SpecConfig, SpecError, settings_dict
from app.events import KIND_LABELS
from app.policy import make_policy
from app.render import visible
from app.zerogpu import gpu

log = logging.getLogger(__name__)
EXAMPLES = json.loads((models.ROOT / "assets" / "prompts.json").read_text())
CSS = (models.ROOT / "assets" / "style.css").read_text()
TIMING_NOTE = ("**Timing:** both panes run on the same device, interleaved round by round. Each has its own "
               "clock that stops while the other runs, and the pane that is behind on its own clock goes "
               "next, so neither slows the other and their progress on screen keeps the true ratio.")
UPDATE_EVERY = 0.25  # seconds between streamed text updates; rendering shares the CPU
PLOT_EVERY = 1.5  # seconds between plot updates: figures are heavier than text
KNOWS = ("*The bundled models run offline and know **Python and its English docstrings and comments** "
         "(trained on the standard library and the installed packages' sources); for general English pick a Hub "
         "preset such as Qwen2.5 or SmolLM2, which needs a download.*")
EXPLANATION = """
**Speculative decoding** (Leviathan et al. 2023; Chen et al. 2023) makes a large *target* model
faster without changing what it writes.

1. A cheap *draft* (a small model, n-gram lookup in the prompt, or the target's own first layers)
   proposes the next **k** tokens, x₁…x_k, with probabilities **q**.
2. The target scores all k in **one** forward pass, giving its own probabilities **p** at every position.
3. Each draft is accepted with probability **min(1, p(x)/q(x))**: the draw **u** decides. Under greedy
   decoding this is simply "does the draft equal the target's argmax?".
4. At the first rejection the target draws its own token from **norm(max(0, p − q))**: the mass the draft
   under-used. That correction makes the output distribution exactly p. If every draft is accepted,
   a **bonus** token comes from p for free.

A **feature-level draft** (EAGLE-style, "feature draft" in the presets) does not guess from tokens alone:
it reads the target's own last hidden state and extrapolates it one layer deep, then uses the target's own
LM head. Those features already hold what the target is about to say, so such a draft agrees with the target
far more often than a separate small model of the same cost.

So each target pass yields between 1 and k+1 tokens. With per-token acceptance α and a draft that
costs c of a target pass, the expected speedup is (1 − α^(k+1)) / ((1 − α)(k·c + 1)).
"""


def example_row(example: dict) -> list:
    """An example's prompt and its settings, in the order of the Examples inputs."""
    s = example["settings"]
    return [example["prompt"], "greedy" if s["decoding"] == "greedy" else "sampling", s.get("temperature") or 0.8,
            s["top_k"], s["top_p"], s["repetition_penalty"], s["no_repeat_ngram_size"], s["max_new_tokens"],
            s.get("seed", 0)]


def _model_ids(target: str, custom_target: str, draft: str, custom_draft: str) -> tuple[str, str]:
    return (custom_target or "").strip() or target, (custom_draft or "").strip() or draft


def fill_seed(seed, decoding) -> int:
    """A blank Seed box: 0 under greedy (nothing is random), else a fresh random seed, shown back."""
    if seed is None or str(seed).strip() == "":
        return 0 if decoding == "greedy" else random.randrange(2**31)
    return int(seed)


def _configs(decoding, temperature, top_k, top_p, seed, max_new_tokens, k_policy, k, chat,
             repetition_penalty=1.0, no_repeat_ngram_size=0):
    greedy = decoding == "greedy"
    return (
        SamplingConfig(0.0 if greedy else float(temperature), int(top_k), float(top_p), fill_seed(seed, decoding),
                       float(repetition_penalty), int(no_repeat_ngram_size)),
        # Adaptive chooses k itself up to the default cap: the k slider does not move that cap.
        SpecConfig(k=int(k), k_policy=k_policy, k_max=SpecConfig.k_max if k_policy == "adaptive" else max(8, int(k))),
        RunConfig(int(max_new_tokens), (), bool(chat)),
    )


def _user_error(e: Exception) -> gr.Error:
    """A user error: one line in the server log, the message in the browser, no traceback."""
    log.warning("user error: %s", e)
    return gr.Error(str(e), print_exception=False)


# Every handler a client can call: inputs checked by name, no raw exception text out (boundary.py).
guarded = boundary.guarded(_user_error, passthrough=(gr.Error,))


def _pair(target: str, draft: str) -> models.Pair:
    try:
        return models.load_pair(target, draft)
    except SpecError as e:
        raise _user_error(e) from None


@guarded
def check_request(prompt, target, custom_target, draft, custom_draft, chat, decoding, temperature, top_k,
                  top_p, seed, max_new_tokens, k_policy, k, repetition_penalty=1.0, no_repeat_ngram_size=0) -> None:
    """Refuse bad settings, an unloadable pair or a bad prompt before a run starts.

    It has no outputs, so a refusal is a message and the previous run's results stay on screen.
    """
    target, draft = _model_ids(target, custom_target, draft, custom_draft)
    try:
        for cfg in _configs(decoding, temperature, top_k, top_p, seed, max_new_tokens, k_policy, k, chat,
                            repetition_penalty, no_repeat_ngram_size):
            cfg.validate()
        _pair(target, draft).encode(prompt, bool(chat))
    except SpecError as e:
        raise _user_error(e) from None


def _context_cap(model_id: str) -> int:
    """Max new tokens for this target: its context from config.json when it is a local directory."""
    try:
        config = Path(models.resolve(model_id)) / "config.json"
        ctx = json.loads(config.read_text()).get("max_position_embeddings") if config.exists() else None
    except (SpecError, OSError, ValueError):
        ctx = None
    return min(MAX_NEW_TOKENS_CAP, ctx or MAX_NEW_TOKENS_CAP)


def _cap_label(cap: int) -> str:
    return f"Max new tokens (the target's context is {cap})" if cap < MAX_NEW_TOKENS_CAP else "Max new tokens"


def _cap_slider(cap: int, value) -> gr.Slider:
    return gr.Slider(maximum=cap, value=min(int(value or cap), cap), label=_cap_label(cap))


@guarded
def cap_for_target(target, custom_target, value) -> gr.Slider:
    """When the target changes, cap Max new tokens to its context where that is known without loading."""
    return _cap_slider(_context_cap((custom_target or "").strip() or target), value)


def _choices(presets: dict[str, str]) -> list[tuple[str, str]]:
    """Dropdown entries (shown label, value): presets that are neither bundled nor cached say so."""
    return [(f"{name} · needs a download" if models.needs_download(name) else name, name) for name in presets]


def _interleave(spec_it: Iterator, ar_it: Iterator) -> Iterator[tuple[str, object]]:
    """Advance whichever run is behind on its own clock; yield ("spec"|"ar", step)."""
    clocks, its = {"spec": 0.0, "ar": 0.0}, {"spec": spec_it, "ar": ar_it}
    while its:
        side = min(its, key=clocks.get)
        step = next(its[side], None)
        if step is None:
            del its[side]
            continue
        clocks[side] = step.elapsed
        yield side, step


def _figures(spec, ar):
    return (plots.tokens_vs_time(spec, ar), plots.k_per_round(spec), plots.acceptance_per_round(spec),
            plots.acceptance_by_position(spec), plots.tokens_per_round(spec))


@gpu
@guarded
def generate_both(prompt, target, custom_target, draft, custom_draft, chat, decoding, temperature, top_k,
                  top_p, seed, max_new_tokens, k_policy, k, repetition_penalty=1.0, no_repeat_ngram_size=0,
                  control=None):
    """Stream both panes; the last update carries the full records of both runs.

    `control` is this session's {"stop": bool}: Stop sets it and the run ends after the current
    round with a final, partial update (cancelling the event instead would flag every output "Error").
    """
    target, draft = _model_ids(target, custom_target, draft, custom_draft)
    try:
        s, sp, r = _configs(decoding, temperature, top_k, top_p, seed, max_new_tokens, k_policy, k, chat,
                            repetition_penalty, no_repeat_ngram_size)
        for cfg in (s, sp, r):
            cfg.validate()
        pair = _pair(target, draft)
        ids = pair.encode(prompt, r.chat)
        shown = pair.tokenizer.decode(ids, skip_special_tokens=True)
        costs = calibrate.costs_for(pair, sp, sampling=s)  # measured once per pair and kind of sampling
        runs = _interleave(
            engine.generate(pair.target, pair.tokenizer, ids, pair.proposer(sp), s, sp, r,
                            policy=make_policy(sp, costs)),
            engine.generate(pair.target, pair.tokenizer, ids, None, s, sp, r),
        )
        spec, ar = [], []
        last_text = last_plot = 0.0
        figures = _figures(spec, ar)
        stopped = False
        deadline = time.monotonic() + queue_limits.run_seconds()  # a run past it ends as if stopped
        for side, step in runs:
            (spec if side == "spec" else ar).append(step)
            if control and control.get("stop") or time.monotonic() > deadline:
                stopped = True
                break
            now = time.monotonic()
            if now - last_text >= UPDATE_EVERY:
                if now - last_plot >= PLOT_EVERY:
                    figures, last_plot = _figures(spec, ar), now
                last_text = now
                yield _outputs(shown, spec, ar, s.greedy, figures, None, done=False, costs=costs)
        # Models named as the visitor picked them: a resolved name can be an install path on this host.
        doc = {"speculative": metrics.report(spec, target, draft,
                                             settings_dict("speculative", s, sp, r), costs),
               "autoregressive": metrics.report(ar, target, None, settings_dict("autoregressive", s, sp, r))}
        doc["comparison"] = metrics.compare(doc["speculative"]["stats"], doc["autoregressive"]["stats"])
        doc["stopped"] = stopped  # True: Stop ended both runs early, so every figure is partial
        doc["threads"] = threads.key()  # "auto" or the fixed count (README, "Threads")
        yield _outputs(shown, spec, ar, s.greedy, _figures(spec, ar), doc, stopped=stopped, costs=costs)
    except SpecError as e:
        raise _user_error(e) from None
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise _user_error(SpecError("out of memory: try a smaller model, fewer new tokens or a shorter prompt")) \
            from None


def _outputs(prompt, spec, ar, greedy, figures, doc, done=True, stopped=False, costs=None):
    return (render.pane_html(prompt, spec), render.pane_html(prompt, ar, kind_classes=False),
            render.greedy_check(spec, ar, greedy, done and not stopped, stopped),
            render.summary_markdown(spec, ar, done and not stopped, stopped, costs), *figures,
            doc if doc is not None else gr.skip())


@guarded
def start_run(seed, decoding, control) -> int:
    """A click on Generate or Step: clear an earlier Stop, fill a blank seed (shown back)."""
    control["stop"] = False
    return fill_seed(seed, decoding)


def request_stop(control) -> None:
    """Stop: the running generation sees this after its current round and ends with a partial update."""
    control["stop"] = True


@gpu
@guarded
def step_round(session, prompt, target, custom_target, draft, custom_draft, chat, decoding, temperature,
               top_k, top_p, seed, max_new_tokens, k_policy, k, repetition_penalty=1.0, no_repeat_ngram_size=0):
    """Teaching mode: run exactly one more speculative round of a stepping session."""
    target, draft = _model_ids(target, custom_target, draft, custom_draft)
    if (seed is None or str(seed).strip() == "") and session is not None and not session.done:
        # An API caller's blank seed continues the run it is stepping through (whose seed was filled
        # on round 1) instead of drawing a fresh one, which would restart it every round.
        _prompt, _target, _draft, _chat, previous, *_ = session.key
        seed = previous.seed
    try:
        s, sp, r = _configs(decoding, temperature, top_k, top_p, seed, max_new_tokens, k_policy, k, chat,
                            repetition_penalty, no_repeat_ngram_size)
        # The filled seed, not the box: a session resumes only the very run it showed (sessions.py).
        key = (prompt, target, draft, r.chat, s, sp, r)
        pair = _pair(target, draft)
        ids = pair.encode(prompt, r.chat)
        session, steps, step = sessions.advance(
            session, key, lambda policy: engine.generate(pair.target, pair.tokenizer, ids, pair.proposer(sp), s, sp,
                                                         r, policy=policy, teach=True),
            lambda: make_policy(sp))
    except SpecError as e:
        raise _user_error(e) from None
    if step is None:
        return session, gr.skip(), gr.skip(), "Generation finished: press Step to start again.", gr.skip()
    session_prompt = pair.tokenizer.decode(ids, skip_special_tokens=True)
    note = (f"**Round {step.round}** · k = {step.k} · drafted {len(step.drafted)} · accepted {step.accepted} · "
            f"target token: **{KIND_LABELS[step.token_kind]}** `{visible(step.token_text)}`"
            + (f" · stopped: {step.stop_reason.replace('_', ' ')}" if step.stop_reason else "")
            + _feature_note(pair, ids, steps, step))
    headers = render.GREEDY_HEADERS if s.greedy else render.DECISION_HEADERS
    return (session, render.pane_html(session_prompt, steps),
            {"headers": headers, "data": render.decision_rows(step, s.greedy)}, note,
            plots.decision_figure(step))


def _feature_note(pair, ids, steps, step) -> str:
    """For a feature draft: which of the target's features the head read to start this round."""
    if step.feature_position is None:
        return ""
    committed = ids + [t for s in steps[:-1] for t in s.emitted]
    pos = step.feature_position
    read = visible(pair.tokenizer.decode(committed[pos : pos + 1]))
    newest = visible(pair.tokenizer.decode(committed[pos + 1 : pos + 2]))
    return (f"\n\nThe head read the target's last-layer feature at position {pos} (its state after `{read}`) "
            f"together with the embedding of the newest token `{newest}`, then drafted on its own predicted features.")


@guarded
def load_pair(target, custom_target, draft, custom_draft, progress=gr.Progress()):
    """Load (or fetch from the shared cache) a pair and say what was loaded."""
    target, draft = _model_ids(target, custom_target, draft, custom_draft)
    progress(0.1, desc=f"loading {target}")
    pair = _pair(target, draft)
    progress(1.0, desc="ready")
    t = pair.target
    # Preset names as the user picked them; a custom id or directory as given.
    shown_target, shown_draft = hosting.shown(target), hosting.shown(draft)  # as typed, never a resolved path
    return (f"Loaded target **{shown_target}** ({t.num_parameters() / 1e6:.1f}M parameters, "
            f"{t.config.num_hidden_layers} layers, context {models.context_length(t)} tokens, {t.dtype}, "
            f"{t.device}) with draft **{shown_draft}**." + (f" Note: {pair.note}." if pair.note else ""))


@guarded
def export_for(target, custom_target, draft, custom_draft, chat, decoding, temperature, top_k, top_p, seed,
               max_new_tokens, k_policy, k, repetition_penalty=1.0, no_repeat_ngram_size=0) -> str:
    """The same pair and settings as `vllm serve` and `llama-server` commands (python -m app export)."""
    from app import export

    try:
        s, sp, _ = _configs(decoding, temperature, top_k, top_p, seed, max_new_tokens, k_policy, k, chat,
                            repetition_penalty, no_repeat_ngram_size)
        return export.for_pair(_pair(*_model_ids(target, custom_target, draft, custom_draft)), sp, s)
    except SpecError as e:
        return f"# no export: {e}"


@guarded
def cap_for_loaded(target, custom_target, draft, custom_draft, value) -> gr.Slider:
    """After a load: cap Max new tokens to the loaded target's context (the pair is cached by then)."""
    pair = _pair(*_model_ids(target, custom_target, draft, custom_draft))
    return _cap_slider(min(MAX_NEW_TOKENS_CAP, models.context_length(pair.target)), value)


def list_presets() -> dict:
    """The preset targets and draft sources, label to id (a bundled model's id is its label, not its path)."""
    def public(presets: dict[str, str]) -> dict[str, str]:
        return {label: label if Path(value).is_absolute() else value for label, value in presets.items()}

    return {"targets": public(models.TARGET_PRESETS), "drafts": public(models.DRAFT_PRESETS),
            "allowlist": sorted(models.allowlist()) if models.allowlist() else None}


def build_ui() -> gr.Blocks:
    with gr.Blocks(title="Speculative decoding, live", analytics_enabled=False) as demo:
        gr.Markdown("# Speculative decoding, live\nA fast draft proposes k tokens; the target checks them all "
                    "in one pass and keeps what it agrees with. Same output, fewer target passes.")
        gr.Markdown(KNOWS, elem_id="knows")
        with gr.Row():
            with gr.Column(scale=3):
                # The first screen is the first example with its own settings, not bare greedy decoding.
                (first_prompt, first_decoding, first_t, first_top_k, first_top_p, first_rep, first_no_repeat,
                 first_max_new, first_seed) = example_row(EXAMPLES[0])
                prompt = gr.Textbox(label="Prompt", lines=6, value=first_prompt, elem_id="prompt")
                examples_slot = gr.Column()  # filled below, once the settings an example sets exist
            with gr.Column(scale=2):
                with gr.Accordion("Models", open=True):
                    target = gr.Dropdown(_choices(models.TARGET_PRESETS), value=next(iter(models.TARGET_PRESETS)),
                                         label="Target", allow_custom_value=True)
                    custom_target = gr.Textbox(label="…or a custom target (Hub id or local directory)")
                    draft = gr.Dropdown(_choices(models.DRAFT_PRESETS), value=next(iter(models.DRAFT_PRESETS)),
                                        label="Draft", allow_custom_value=True)
                    custom_draft = gr.Textbox(label="…or a custom draft (Hub id, local dir, prompt-lookup, "
                                                    "early-exit:N)")
                    load_btn = gr.Button("Load pair", size="sm")
                    status = gr.Markdown()
                with gr.Accordion("Decoding", open=False):
                    decoding = gr.Radio(["greedy", "sampling"], value=first_decoding, label="Decoding")
                    temperature = gr.Slider(0.05, 2.0, first_t, step=0.05, label="Temperature (sampling)")
                    top_k = gr.Slider(0, 200, first_top_k, step=1, label="Top-k (0 = off)")
                    top_p = gr.Slider(0.05, 1.0, first_top_p, step=0.05, label="Top-p (1 = off)")
                    seed = gr.Number(first_seed, precision=0, label="Seed (blank: a fresh random seed)")
                    # Applied to p and q alike at every position, so speculation stays lossless.
                    rep_penalty = gr.Slider(1.0, 2.0, first_rep, step=0.05, label="Repetition penalty (1 = off)")
                    no_repeat = gr.Slider(0, 8, first_no_repeat, step=1, label="No-repeat n-gram size (0 = off)")
                    cap = _context_cap(next(iter(models.TARGET_PRESETS)))
                    max_new = gr.Slider(1, cap, min(first_max_new, cap), step=1, elem_id="max-new",
                                        label=_cap_label(cap))
                    chat = gr.Checkbox(False, label="Chat formatting (models with a chat template)")
                with gr.Accordion("Speculation", open=False):
                    k_policy = gr.Radio(["adaptive", "heuristic", "fixed"], value="adaptive", label="k policy")
                    k = gr.Slider(1, 16, 4, step=1, label=f"k: fixed k, or heuristic's start "
                                                          f"(adaptive ignores it and picks k ≤ {SpecConfig.k_max})")
        with gr.Row():
            run_btn = gr.Button("Generate", variant="primary")
            step_btn = gr.Button("Step one round")
            stop_btn = gr.Button("Stop", variant="stop")
        gr.Markdown(TIMING_NOTE)
        gr.HTML(render.LEGEND)
        with gr.Row():
            with gr.Column(min_width=300):
                gr.Markdown("### Speculative")
                # autoscroll follows the newest tokens unless the reader has scrolled up.
                spec_pane = gr.HTML(render.SPEC_PLACEHOLDER, elem_id="spec-pane", max_height=520, autoscroll=True)
            with gr.Column(min_width=300):
                gr.Markdown("### Autoregressive (target alone)")
                ar_pane = gr.HTML(render.AR_PLACEHOLDER, elem_id="ar-pane", max_height=520, autoscroll=True)
        check = gr.Markdown(elem_id="greedy-check")
        summary = gr.Markdown(elem_id="summary")
        with gr.Accordion("Run this setup elsewhere: vLLM and llama.cpp commands", open=False):
            export_code = gr.Code(language="shell", label="export (copy button at the top right)", interactive=False,
                                  elem_id="export")
        # min_width wraps the plots one to a row on a narrow screen instead of squeezing them.
        with gr.Row():
            fig_time = gr.Plot(label="tokens over time", elem_id="plot-time", min_width=320)
            fig_k = gr.Plot(label="k per round", elem_id="plot-k", min_width=320)
        with gr.Row():
            fig_acc = gr.Plot(label="acceptance per round", elem_id="plot-acc", min_width=320)
            fig_pos = gr.Plot(label="acceptance by position", elem_id="plot-pos", min_width=320)
            fig_hist = gr.Plot(label="tokens per round", elem_id="plot-hist", min_width=320)
        with gr.Accordion("Teaching mode: one round at a time", open=False):
            step_note = gr.Markdown("Press **Step one round** to draft, verify and decide one round.")
            step_pane = gr.HTML(render.STEP_PLACEHOLDER, elem_id="step-pane", max_height=360, autoscroll=True)
            decisions = gr.Dataframe(headers=render.DECISION_HEADERS, label="Each drafted token, judged in order",
                                     interactive=False, elem_id="decisions")
            residual = gr.Plot(label="p, q and the distribution the target's token was drawn from")
        with gr.Accordion("How speculative decoding works", open=False):
            gr.Markdown(EXPLANATION)
        with gr.Accordion("Records (JSON)", open=False):
            records = gr.JSON(label="both runs: settings, per-round records and stats")
        presets_json = gr.JSON(visible=False)
        # Plain data (sessions.Teaching); its live run is dropped when the visitor leaves or idles out.
        session = gr.State(None, time_to_live=sessions.STATE_TTL, delete_callback=sessions.forget)
        control = gr.State({"stop": False}, time_to_live=sessions.STATE_TTL)  # this session's Stop request

        with examples_slot:
            # Clicking an example also sets its own decoding settings (greedy for code, sampling for English).
            gr.Examples([example_row(e) for e in EXAMPLES],
                        [prompt, decoding, temperature, top_k, top_p, rep_penalty, no_repeat, max_new, seed],
                        example_labels=[e["label"] for e in EXAMPLES], cache_examples=False,
                        label="Examples, each with its own settings: low-entropy code (greedy), open-ended English "
                              "(sampled)")
        model_inputs = [target, custom_target, draft, custom_draft]
        settings = [chat, decoding, temperature, top_k, top_p, seed, max_new, k_policy, k, rep_penalty, no_repeat]
        # One queue for the device; SPECDEC_CONCURRENCY runs share it at once (queue_limits.py).
        device = dict(concurrency_limit=queue_limits.concurrency(), concurrency_id="device")
        # Each run first fills a blank seed and checks the request; only a good request replaces what is
        # on screen, so a failed load leaves the previous results in place.
        run_btn.click(start_run, [seed, decoding, control], seed, queue=False, api_visibility="private").then(
            check_request, [prompt, *model_inputs, *settings], None, api_visibility="private", **device,
        ).success(
            generate_both, [prompt, *model_inputs, *settings, control],
            [spec_pane, ar_pane, check, summary, fig_time, fig_k, fig_acc, fig_pos, fig_hist, records],
            api_name="generate", **device,
        ).success(export_for, [*model_inputs, *settings], export_code, api_visibility="private")
        step_btn.click(start_run, [seed, decoding, control], seed, queue=False, api_visibility="private").then(
            check_request, [prompt, *model_inputs, *settings], None, api_visibility="private", **device,
        ).success(
            step_round, [session, prompt, *model_inputs, *settings],
            [session, step_pane, decisions, step_note, residual], api_name="step", **device,
        )
        # One round of Step is short, so Stop only ends a generation (cooperatively: see generate_both).
        stop_btn.click(request_stop, control, None, queue=False, api_visibility="private")
        load_btn.click(load_pair, model_inputs, status, api_name="load_pair", **device).success(
            cap_for_loaded, [*model_inputs, max_new], max_new, api_visibility="private", **device)
        gr.on([target.change, custom_target.blur], cap_for_target, [target, custom_target, max_new], max_new,
              queue=False, api_visibility="private")
        gr.Button(visible=False).click(list_presets, None, presets_json, api_name="presets")
    return demo


def launch(host: str | None = None, port: int | None = None, share: bool = False) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the server log is for requests and real errors, not load bars
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    demo = build_ui()
    demo.queue(max_size=queue_limits.MAX_QUEUED, default_concurrency_limit=queue_limits.concurrency())
    queue_limits.install(demo)  # no visitor holds more than a few places in it
    demo.launch(server_name=host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                server_port=port or int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
                share=share or os.environ.get("GRADIO_SHARE", "").lower() in ("1", "true"),
                # show_error=False: only gr.Error messages (written for visitors) reach a client; the app
                # has no file inputs, so uploads are refused above a few bytes.
                css=CSS, show_error=False, max_file_size="1kb")
