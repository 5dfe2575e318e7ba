"""The bench's `--suite FILE`: Spec-Bench's (and MT-bench's) question format, read, run turn by turn and
reported per category the way its leaderboard reports (the runner is app/category_runner.py, which the
app's "By kind of text" panel shares), as JSON, a text table and an HTML page with the bar chart.

With --tree, each draft runs twice in the same interleaved run: as a chain and as a tree.
"""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path

from app import category_runner, models, request
from app.args import settings, with_chat
from app.bench import progress
from app.core.config import Settings, settings_dict
from app.data.prompts import suite


def is_file_suite(suite: str) -> bool:
    """Whether --suite names a file (a path, or a name ending .jsonl or .txt) rather than a built-in suite."""
    return suite.endswith((".jsonl", ".txt")) or Path(suite).is_file()


def specbench(args) -> dict:
    """Every selected question, turn by turn: plain decoding first (its answer is the history), then
    each draft's speculative run (and its tree, with --tree) in rotating order, on the same ids."""
    picked = category_runner.select(_questions(args.suite), args.categories, args.per_category)
    drafts = _drafts(args)
    progress.say("bench", f"loading {args.target or models.DEFAULT_TARGET} and {len(drafts)} draft(s)")
    pairs = {d: models.load_pair(args.target, d, args.device, args.dtype) for d in drafts}
    first = next(iter(pairs.values()))
    st = with_chat(settings(args), args, first.tokenizer)
    plain = category_runner.timed(first, st, False, None)
    field = {}
    for d, pair in pairs.items():
        for name, shape in _shapes(d, st):
            field[name] = category_runner.timed(pair, shape, True, request.costs(pair, shape))
    context = models.context_length(first.target)
    rows = []
    for n, q in progress.counted(enumerate(picked), "question", len(picked)):
        rows.append(category_runner.answer(q, first.tokenizer, plain, field, st.run, context, n))
    s = st.sampling
    return dict(
        format="spec-bench",
        file=str(args.suite),
        target=first.target_name,
        drafts=list(field),
        settings=settings_dict("bench", s, st.spec, st.run),
        history="plain decoding's answers (greedy: the same conversation on both sides)"
        if s.greedy
        else "plain decoding's sampled answers: the speculative runs answer the same history",
        summary=category_runner.summarize(rows, list(field)),
        questions=rows,
        device=str(first.target.device),
        dtype=str(first.target.dtype),
    )


def _questions(name: str) -> list[category_runner.Question]:
    """A question file's questions, or a built-in suite's requests as one-turn questions of its name."""
    if is_file_suite(name):
        return category_runner.read_questions(Path(name))
    return [category_runner.Question(str(i), name, (prompt,)) for i, prompt in enumerate(suite(name, chat=True), 1)]


def _shapes(draft: str, st: Settings) -> list[tuple[str, Settings]]:
    """A draft's contenders: its chain, and with --tree its tree too (named "draft · tree N|auto")."""
    sp = st.spec
    if not sp.tree:
        return [(draft, st)]
    chain = dataclasses.replace(st, spec=dataclasses.replace(sp, tree=0, tree_auto=False))
    return [(draft, chain), (f"{draft} · tree {'auto' if sp.tree_auto else sp.tree}", st)]


def _drafts(args) -> list[str]:
    """--drafts a,b,c, else --draft or the target's default draft."""
    return split_drafts(args.drafts) if args.drafts else [args.draft or models.default_draft(args.target)]


def split_drafts(text: str) -> list[str]:
    """The drafts of a --drafts list. Preset labels hold commas ("..., bundled"), so a piece that is
    no draft on its own joins the one before it."""
    out: list[str] = []
    for piece in text.split(","):
        if out and piece.startswith(" ") and not piece.strip().startswith(("early-exit", "prompt-lookup")):
            out[-1] += "," + piece
        else:
            out.append(piece.strip())
    return [d.strip() for d in out if d.strip()]


def table(doc: dict) -> str:
    """The summary as a text table, a row per category and draft."""
    head = f"{'category':<16} {'draft':<28} {'n':>3} {'tok/pass':>8} {'alpha':>6} {'tok/s':>7} {'plain':>7} "
    head += f"{'speedup':>8} {'range':>13} {'same':>5}"
    lines = [head]
    for category, entry in doc["summary"].items():
        for d in doc["drafts"]:
            v = entry[d]
            sp = v["speedup"]
            span = f"{sp['min']:.2f}-{sp['max']:.2f}x"
            lines.append(
                f"{category:<16} {_label(d):<28} {entry['questions']:>3} {_f(v['tokens_per_pass'])} "
                f"{_f(v['alpha'], 6)} {v['tokens_per_s']:>7.1f} {v['plain_tokens_per_s']:>7.1f} "
                f"{sp['median']:>7.2f}x {span:>13} {100 * v['identical']:>4.0f}%"
            )
    return "\n".join(lines)


def _label(draft: str) -> str:
    """A draft as the table names it: a directory by its last part, at most 28 characters."""
    return (Path(draft).name if "/" in draft else draft)[:28]


def _f(x, width: int = 8) -> str:
    return f"{x:>{width}.2f}" if x is not None else f"{'-':>{width}}"


def html_report(doc: dict) -> str:
    """A self-contained page: the table and the grouped bar chart by category."""
    from app.views import bench_figures

    figure = bench_figures.category_figure(doc).to_html(full_html=False, include_plotlyjs=True)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>bench: {html.escape(doc["file"])}</title>
<style>body{{font-family:sans-serif;margin:2em}}</style></head><body>
<h1>{html.escape(doc["target"])} on {html.escape(doc["file"])}</h1>
<p>History of later turns: {html.escape(doc["history"])}. {doc["device"]}, {doc["dtype"]}.</p>
<pre>{html.escape(table(doc))}</pre>{figure}</body></html>"""
