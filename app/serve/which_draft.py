"""The "Which draft is worth it" panel: the draft-size sweep (app/sweep.py) for the visitor's target, one
short question of each kind of text answered by plain decoding and by every draft of the sweep, streamed
question by question and drawn as speedup against draft cost, with a sentence that reads each curve."""

from __future__ import annotations

import dataclasses
import shlex

import gradio as gr

from app import category_runner, models, sweep
from app.args import flags
from app.core.config import Settings
from app.serve import panel, queue_limits
from app.serve.form import Form
from app.serve.handlers import LOADING, loaded_pair
from app.views import draft_size

# A few minutes on the default target on two cores: one question of each kind, few tokens, four
# early-exit depths, and a fixed k, which needs no calibration of round costs for each draft.
PER_CATEGORY = 1
TOKENS = 16
EXITS = 4
COMMAND = "python -m app bench --sizes --exits {exits}"


def panel_settings(settings: Settings, tokenizer) -> Settings:
    """The visitor's settings at a fixed k (their k), at most TOKENS new tokens a turn, and chat
    formatting wherever the target has a chat template (the questions are instructions)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    run = dataclasses.replace(settings.run, max_new_tokens=min(settings.run.max_new_tokens, TOKENS), chat=chat)
    spec = dataclasses.replace(settings.spec, k_policy="fixed", tree=0, tree_auto=False)
    return dataclasses.replace(settings, run=run, spec=spec)


def _stream(form: Form, control, progress):
    """Stream (status, figure, document) question by question; Stop or the run limit ends the sweep
    after the current measurement, with the figures measured so far."""
    picked = category_runner.select(category_runner.read_questions(category_runner.SAMPLE), None, PER_CATEGORY)
    progress(0.0, desc=LOADING)
    first = loaded_pair(form.target, models.PROMPT_LOOKUP, form.dtype, progress)
    settings = panel_settings(form.settings, first.tokenizer)
    stop = queue_limits.stopper(control)

    def load(draft: str) -> models.Pair:
        return loaded_pair(form.target, draft, form.dtype)

    target_id = models.presets.id_of(form.target)
    doc: dict = {}
    for doc in sweep.measure(
        load, target_id, picked, settings, exits=EXITS, stop=stop, say=lambda text, done: progress(done, desc=text)
    ):
        done = len(doc["questions"]) == len(picked) or doc["stopped"]
        note = None if done else f"{len(doc['questions'])} of {len(picked)} kinds of text measured…"
        yield status(doc, note, settings, form.target, form.dtype), _figure(doc), doc if done else gr.skip()


def _figure(doc: dict):
    return draft_size.figure(doc) if doc["sizes"] else gr.skip()


def status(doc: dict, note: str | None, settings: Settings, target: str, dtype: str) -> str:
    """The panel's text: progress or how it ended, a sentence per kind of text measured, and the
    bench command that reproduces the figures."""
    parts = [note] if note else []
    if doc["stopped"]:
        parts.append(f"Stopped after {len(doc['questions'])} of {doc['questions_asked']} questions.")
    parts += [f"- {sentence}" for sentence in sweep.verdicts(doc).values()]
    if "overall" in doc["sizes"]:
        parts.append(_table(doc, "overall"))
    if note is None:
        command = shlex.join([*shlex.split(COMMAND.format(exits=EXITS)), "--target", target, *flags(settings)])
        command += f" --dtype {dtype}"
        parts.append(_prefill(doc))
        parts.append(
            f"α, c and tokens per pass are the bench's for the same settings: `{command}`. "
            "Speedups are this run's wall clock, a single short question of each kind: read the shape, not the digits."
        )
    return "\n\n".join(parts)


def _prefill(doc: dict) -> str:
    """Why a long prompt's points sit nearer 1×: both clocks include the prompt's prefill (measured on
    SmolLM2 at 16 tokens: a third to nearly a half of plain decoding's time, most for the summary and the
    rag passage)."""
    longest = max(doc["prompts"], key=lambda p: p["tokens"])
    shortest = min(doc["prompts"], key=lambda p: p["tokens"])
    return (
        f"Both clocks, plain and speculative, start at the prompt, so each includes its prefill: {shortest['tokens']} "
        f"tokens for {shortest['category']} up to {longest['tokens']} for {longest['category']}. At {TOKENS} new "
        "tokens that is a large share of each run, and it pulls a long prompt's speedups toward 1×; a point far "
        "below 1× is a draft that costs more than it saves, whatever the kind of text."
    )


def _table(doc: dict, category: str) -> str:
    """One kind of text's points, cheapest draft first (the others are in the figure and the JSON)."""
    lines = [f"**{category}**", "", "| draft | c | α | tokens per pass | speedup | predicted |", "|---" * 6 + "|"]
    for p in doc["sizes"][category]["points"]:
        alpha = f"{p['alpha']:.2f}" if p["alpha"] is not None else "–"
        tpp = f"{p['tokens_per_pass']:.2f}" if p["tokens_per_pass"] is not None else "–"
        pred = f"{p['predicted']:.2f}×" if p["predicted"] is not None else "–"
        lines.append(f"| {p['label']} | {p['c']:.3f} | {alpha} | {tpp} | {p['speedup']:.2f}× | {pred} |")
    return "\n".join(lines)


which_draft = panel.handler(_stream, "which_draft")
PANEL = panel.Panel(
    "Which draft is worth it: speedup against draft size",
    "which-draft",
    "size",
    f"Early exit at {EXITS} depths of the target, its bundled drafts and prompt lookup, each on one short question "
    f"of every kind of text (at most {TOKENS} new tokens, your k, fixed), against plain decoding. Too small a draft "
    "is rejected too often; too large a one costs as much as it saves. Dashed: Leviathan's speedup predicted from "
    "the same α and cost c. A few minutes on the default target.",
    "Run the draft-size sweep",
    "speedup against draft cost, by kind of text",
    "per draft and kind of text (JSON)",
    which_draft,
)
