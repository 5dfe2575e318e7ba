"""The Gradio app: speculative and autoregressive decoding side by side, live.

The only module that imports gradio. Everything it shows comes from the engine's Step
records through `render`, `metrics` and `plots`; it holds no engine logic of its own.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import gradio as gr
import torch

from app import engine, metrics, models, plots, render
from app.config import MAX_NEW_TOKENS_CAP, RunConfig, SamplingConfig, SpecConfig, SpecError, settings_dict

try:  # On Hugging Face ZeroGPU the device is lent per call; elsewhere this is a no-op.
    import spaces

    gpu = spaces.GPU
except ImportError:
    def gpu(fn):
        return fn

EXAMPLES = json.loads((models.ROOT / "assets" / "prompts.json").read_text())
CSS = (models.ROOT / "assets" / "style.css").read_text()
TIMING_NOTE = ("**Timing:** both panes run on the same device, interleaved round by round. Each has its own "
               "clock that stops while the other runs, and the pane that is behind on its own clock goes "
               "next, so neither slows the other and their progress on screen keeps the true ratio.")
UPDATE_EVERY = 0.25  # seconds between streamed text updates; rendering shares the CPU
PLOT_EVERY = 1.5  # seconds between plot updates: figures are heavier than text
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

So each target pass yields between 1 and k+1 tokens. With per-token acceptance α and a draft that
costs c of a target pass, the expected speedup is (1 − α^(k+1)) / ((1 − α)(k·c + 1)).
"""


def _model_ids(target: str, custom_target: str, draft: str, custom_draft: str) -> tuple[str, str]:
    return (custom_target or "").strip() or target, (custom_draft or "").strip() or draft


def _configs(decoding, temperature, top_k, top_p, seed, max_new_tokens, k_policy, k, chat):
    greedy = decoding == "greedy"
    return (
        SamplingConfig(0.0 if greedy else float(temperature), int(top_k), float(top_p), int(seed)),
        SpecConfig(k=int(k), k_policy=k_policy, k_max=max(8, int(k))),
        RunConfig(int(max_new_tokens), (), bool(chat)),
    )


def _pair(target: str, draft: str) -> models.Pair:
    try:
        return models.load_pair(target, draft)
    except SpecError as e:
        raise gr.Error(str(e)) from None


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
def generate_both(prompt, target, custom_target, draft, custom_draft, chat, decoding, temperature, top_k,
                  top_p, seed, max_new_tokens, k_policy, k):
    """Stream both panes; the last update carries the full records of both runs."""
    target, draft = _model_ids(target, custom_target, draft, custom_draft)
    try:
        s, sp, r = _configs(decoding, temperature, top_k, top_p, seed, max_new_tokens, k_policy, k, chat)
        for cfg in (s, sp, r):
            cfg.validate()
        pair = _pair(target, draft)
        ids = pair.encode(prompt, r.chat)
        shown = pair.tokenizer.decode(ids, skip_special_tokens=True)
        runs = _interleave(
            engine.generate(pair.target, pair.tokenizer, ids, pair.proposer(sp), s, sp, r),
            engine.generate(pair.target, pair.tokenizer, ids, None, s, sp, r),
        )
        spec, ar = [], []
        last_text = last_plot = 0.0
        figures = _figures(spec, ar)
        for side, step in runs:
            (spec if side == "spec" else ar).append(step)
            now = time.monotonic()
            if now - last_text >= UPDATE_EVERY:
                if now - last_plot >= PLOT_EVERY:
                    figures, last_plot = _figures(spec, ar), now
                last_text = now
                yield _outputs(shown, spec, ar, s.greedy, figures, None, done=False)
        doc = {"speculative": metrics.report(spec, pair.target_name, pair.draft_name,
                                             settings_dict("speculative", s, sp, r)),
               "autoregressive": metrics.report(ar, pair.target_name, None, settings_dict("autoregressive", s, sp, r))}
        doc["comparison"] = metrics.compare(doc["speculative"]["stats"], doc["autoregressive"]["stats"])
        yield _outputs(shown, spec, ar, s.greedy, _figures(spec, ar), doc)
    except SpecError as e:
        raise gr.Error(str(e)) from None
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise gr.Error("out of memory: try a smaller model, fewer new tokens or a shorter prompt") from None


def _outputs(prompt, spec, ar, greedy, figures, doc, done=True):
    return (render.pane_html(prompt, spec), render.pane_html(prompt, ar, kind_classes=False),
            render.greedy_check(spec, ar, greedy, done), render.summary_markdown(spec, ar), *figures,
            doc if doc is not None else gr.skip())


@gpu
def step_round(session, prompt, target, custom_target, draft, custom_draft, chat, decoding, temperature,
               top_k, top_p, seed, max_new_tokens, k_policy, k):
    """Teaching mode: run exactly one more speculative round of a stepping session."""
    target, draft = _model_ids(target, custom_target, draft, custom_draft)
    key = (prompt, target, draft, chat, decoding, temperature, top_k, top_p, seed, max_new_tokens, k_policy, k)
    try:
        if session is None or session["key"] != key or session["done"]:
            s, sp, r = _configs(decoding, temperature, top_k, top_p, seed, max_new_tokens, k_policy, k, chat)
            pair = _pair(target, draft)
            ids = pair.encode(prompt, r.chat)
            it = engine.generate(pair.target, pair.tokenizer, ids, pair.proposer(sp), s, sp, r)
            session = dict(key=key, it=it, steps=[], done=False, prompt=pair.tokenizer.decode(
                ids, skip_special_tokens=True))
        step = next(session["it"], None)
    except SpecError as e:
        raise gr.Error(str(e)) from None
    if step is None or step.stop_reason:
        session["done"] = True
    if step is None:
        return session, gr.skip(), gr.skip(), "Generation finished: press Step to start again.", gr.skip()
    session["steps"].append(step)
    note = (f"**Round {step.round}** · k = {step.k} · drafted {len(step.drafted)} · accepted {step.accepted} · "
            f"target token: **{step.token_kind}** {step.token_text!r}"
            + (f" · stopped: {step.stop_reason}" if step.stop_reason else ""))
    return (session, render.pane_html(session["prompt"], session["steps"]), render.decision_rows(step), note,
            plots.decision_figure(step))


def load_pair(target, custom_target, draft, custom_draft, progress=gr.Progress()):
    """Load (or fetch from the shared cache) a pair and say what was loaded."""
    target, draft = _model_ids(target, custom_target, draft, custom_draft)
    progress(0.1, desc=f"loading {target}")
    pair = _pair(target, draft)
    progress(1.0, desc="ready")
    t = pair.target
    return (f"✅ Loaded target `{pair.target_name}` ({t.num_parameters() / 1e6:.1f}M parameters, "
            f"{t.config.num_hidden_layers} layers, {t.dtype}, {t.device}) with draft `{pair.draft_name}`.")


def list_presets() -> dict:
    """The preset targets and draft sources, label to id."""
    return {"targets": models.TARGET_PRESETS, "drafts": models.DRAFT_PRESETS,
            "allowlist": sorted(models.allowlist()) if models.allowlist() else None}


def build_ui() -> gr.Blocks:
    with gr.Blocks(title="Speculative decoding, live") as demo:
        gr.Markdown("# Speculative decoding, live\nA fast draft proposes k tokens; the target checks them all "
                    "in one pass and keeps what it agrees with. Same output, fewer target passes.")
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=6, value=EXAMPLES[0]["prompt"])
                gr.Examples([[e["prompt"]] for e in EXAMPLES], [prompt], example_labels=[e["label"] for e in EXAMPLES],
                            cache_examples=False, label="Examples: low-entropy code and structure, high-entropy prose")
            with gr.Column(scale=2):
                with gr.Accordion("Models", open=True):
                    target = gr.Dropdown(list(models.TARGET_PRESETS), value=next(iter(models.TARGET_PRESETS)),
                                         label="Target", allow_custom_value=True)
                    custom_target = gr.Textbox(label="…or a custom target (Hub id or local directory)")
                    draft = gr.Dropdown(list(models.DRAFT_PRESETS), value=next(iter(models.DRAFT_PRESETS)),
                                        label="Draft", allow_custom_value=True)
                    custom_draft = gr.Textbox(label="…or a custom draft (Hub id, local dir, prompt-lookup, "
                                                    "early-exit:N)")
                    load_btn = gr.Button("Load pair", size="sm")
                    status = gr.Markdown()
                with gr.Accordion("Decoding", open=False):
                    decoding = gr.Radio(["greedy", "sampling"], value="greedy", label="Decoding")
                    temperature = gr.Slider(0.05, 2.0, 0.8, step=0.05, label="Temperature (sampling)")
                    top_k = gr.Slider(0, 200, 0, step=1, label="Top-k (0 = off)")
                    top_p = gr.Slider(0.05, 1.0, 1.0, step=0.05, label="Top-p (1 = off)")
                    seed = gr.Number(0, precision=0, label="Seed")
                    max_new = gr.Slider(1, MAX_NEW_TOKENS_CAP, 200, step=1, label="Max new tokens")
                    chat = gr.Checkbox(False, label="Chat formatting (models with a chat template)")
                with gr.Accordion("Speculation", open=False):
                    k_policy = gr.Radio(["adaptive", "heuristic", "fixed"], value="adaptive", label="k policy")
                    k = gr.Slider(1, 16, 4, step=1, label="k (fixed k, or the start for heuristic)")
        with gr.Row():
            run_btn = gr.Button("Generate", variant="primary")
            step_btn = gr.Button("Step one round")
            stop_btn = gr.Button("Stop", variant="stop")
        gr.Markdown(TIMING_NOTE)
        gr.HTML(render.LEGEND)
        with gr.Row():
            with gr.Column():
                gr.Markdown("### Speculative")
                spec_pane = gr.HTML(elem_id="spec-pane")
            with gr.Column():
                gr.Markdown("### Autoregressive (target alone)")
                ar_pane = gr.HTML(elem_id="ar-pane")
        check = gr.Markdown(elem_id="greedy-check")
        summary = gr.Markdown(elem_id="summary")
        with gr.Row():
            fig_time = gr.Plot(label="tokens over time", elem_id="plot-time")
            fig_k = gr.Plot(label="k per round", elem_id="plot-k")
        with gr.Row():
            fig_acc = gr.Plot(label="acceptance per round", elem_id="plot-acc")
            fig_pos = gr.Plot(label="acceptance by position", elem_id="plot-pos")
            fig_hist = gr.Plot(label="tokens per round", elem_id="plot-hist")
        with gr.Accordion("Teaching mode: one round at a time", open=False):
            step_note = gr.Markdown("Press **Step one round** to draft, verify and decide one round.")
            step_pane = gr.HTML()
            decisions = gr.Dataframe(headers=["draft token", "q(x)", "p(x)", "min(1, p/q)", "u", "decision"],
                                     label="Each drafted token, judged in order", interactive=False)
            residual = gr.Plot(label="p, q and the distribution the target's token was drawn from")
        with gr.Accordion("How speculative decoding works", open=False):
            gr.Markdown(EXPLANATION)
        with gr.Accordion("Records (JSON)", open=False):
            records = gr.JSON(label="both runs: settings, per-round records and stats")
        presets_json = gr.JSON(visible=False)
        session = gr.State(None)

        model_inputs = [target, custom_target, draft, custom_draft]
        settings = [chat, decoding, temperature, top_k, top_p, seed, max_new, k_policy, k]
        run_event = run_btn.click(
            generate_both, [prompt, *model_inputs, *settings],
            [spec_pane, ar_pane, check, summary, fig_time, fig_k, fig_acc, fig_pos, fig_hist, records],
            api_name="generate", concurrency_limit=1, concurrency_id="device",
        )
        step_event = step_btn.click(
            step_round, [session, prompt, *model_inputs, *settings],
            [session, step_pane, decisions, step_note, residual],
            api_name="step", concurrency_limit=1, concurrency_id="device",
        )
        stop_btn.click(None, cancels=[run_event, step_event])
        load_btn.click(load_pair, model_inputs, status, api_name="load_pair", concurrency_limit=1,
                       concurrency_id="device")
        gr.Button(visible=False).click(list_presets, None, presets_json, api_name="presets")
    return demo


def launch(host: str | None = None, port: int | None = None, share: bool = False) -> None:
    demo = build_ui()
    demo.queue(max_size=64, default_concurrency_limit=int(os.environ.get("SPECDEC_CONCURRENCY", "1")))
    demo.launch(server_name=host or os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                server_port=port or int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
                share=share or os.environ.get("GRADIO_SHARE", "").lower() in ("1", "true"),
                css=CSS, show_error=True)
