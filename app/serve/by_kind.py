"""The "By kind of text" panel: two bundled questions per category (the Spec-Bench-format sample, written
for this project), answered by plain decoding and by the current pair and settings through the bench's
own runner (app/category_runner.py), streamed question by question and drawn as the bench's bar chart."""

from __future__ import annotations

import dataclasses

import gradio as gr

from app import category_runner, models, request
from app.core.config import Settings
from app.models import hosting
from app.serve import panel, queue_limits
from app.serve.form import Form
from app.serve.handlers import LOADING, MEASURING, loaded_pair, measuring
from app.views import bench_figures, render

PER_CATEGORY = 2  # questions of each category (the whole sample): the run fits one visitor's run limit
TOKENS = 40  # new tokens a turn at most, for the same reason
COMMAND = "python -m app bench --suite assets/specbench-sample.jsonl --per-category {per} --no-sweep --no-hf"


def panel_settings(settings: Settings, tokenizer) -> Settings:
    """The visitor's settings, with at most TOKENS new tokens a turn and chat formatting wherever the
    target has a chat template (the questions are instructions), as the bench sets it."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    n = min(settings.run.max_new_tokens, TOKENS)
    return dataclasses.replace(settings, run=dataclasses.replace(settings.run, max_new_tokens=n, chat=chat))


def _stream(form: Form, control, progress):
    """Stream (status, chart, records) question by question; Stop or the run limit ends it after the
    current round, with the figures of the questions answered so far."""
    picked = category_runner.select(category_runner.read_questions(category_runner.SAMPLE), None, PER_CATEGORY)
    progress(0.0, desc=LOADING)
    pair = loaded_pair(form.target, form.draft, form.dtype, progress)
    settings = panel_settings(form.settings, pair.tokenizer)
    stop = queue_limits.stopper(control)

    progress(0.0, desc=MEASURING)
    costs = request.costs(pair, settings, report=measuring(progress))
    draft = hosting.shown(form.draft)  # as typed: a resolved name can be an install path on this host
    plain = category_runner.timed(pair, settings, False, None, stop)
    field = {draft: category_runner.timed(pair, settings, True, costs, stop)}
    context = models.context_length(pair.target)
    rows: list[dict] = []
    summary: dict = {}  # per category, of the questions answered so far
    stopped = False
    for n, q in enumerate(picked):
        # Progress goes in the status text: a progress bar would cover the figures streamed so far.
        note = f"Question {n + 1} of {len(picked)} ({q.category}, {len(q.turns)} turn(s)): answering…"
        yield _status(summary, draft, note), gr.skip(), gr.skip()
        try:
            rows.append(category_runner.answer(q, pair.tokenizer, plain, field, settings.run, context, n))
        except category_runner.Stopped:
            stopped = True
            break
        summary = category_runner.summarize(rows, [draft])  # once per question, for the table and the chart
        yield _status(summary, draft, None), _chart(summary, draft), gr.skip()
    doc = _doc(rows, summary, draft, settings, stopped, len(picked))
    ending = f"Stopped after {len(rows)} of {len(picked)} questions." if stopped else None
    final = command(form, settings) if not stopped else None
    yield _status(summary, draft, ending, final, settings.spec.k_policy == "adaptive"), _chart(summary, draft), doc


def _chart(summary: dict, draft: str):
    return bench_figures.category_figure(dict(summary=summary, drafts=[draft])) if summary else gr.skip()


def command(form: Form, settings: Settings) -> str:
    """The bench command that answers the same questions with this pair and these settings."""
    import shlex

    from app.args import flags

    words = shlex.split(COMMAND.format(per=PER_CATEGORY)) + ["--target", form.target, "--draft", form.draft]
    return shlex.join(words + flags(settings) + ["--dtype", form.dtype])


def _status(summary: dict, draft: str, note: str | None, final: str | None = None, adaptive: bool = False) -> str:
    parts = [note] if note else []
    if summary:
        parts.append(render.category_table(summary, [draft]))
    if final is not None and adaptive:
        parts.append(
            "Adaptive k follows this machine's round timings as they come, so its tokens per pass and α move "
            "from run to run, the bench's runs included; with a fixed k the greedy figures are the bench's "
            f"exactly. The same questions and settings in the bench: `{final}`. Speedups are this run's wall clock."
        )
    elif final is not None:
        parts.append(
            f"Greedy figures (tokens per pass, α, same text) are the bench's for the same settings: `{final}`. "
            "Speedups are this run's wall clock."
        )
    return "\n\n".join(parts)


def _doc(rows: list[dict], summary: dict, draft: str, settings: Settings, stopped: bool, total: int) -> dict:
    return dict(
        format="spec-bench",
        file=category_runner.SAMPLE.name,
        drafts=[draft],
        settings=settings.as_dict("bench"),
        stopped=stopped,
        questions_asked=total,
        summary=summary,
        questions=rows,
    )


by_kind = panel.handler(_stream, "by_kind")
PANEL = panel.Panel(
    "By kind of text: where a draft saves most",
    "by-kind",
    "kind",
    f"Two short questions of each kind (code, writing, translation, summaries, questions, arithmetic, answers "
    f"from a passage), each answered by plain decoding and by speculation with the pair and settings above, at "
    f"most {TOKENS} new tokens a turn. Code and structured answers usually keep more drafts per target pass "
    "than open-ended writing.",
    "Run by kind of text",
    "speedup and tokens per target pass, by kind of text",
    "per question and per category (JSON)",
    by_kind,
)
