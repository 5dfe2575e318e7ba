"""`python -m app bench --sizes`: the draft-size sweep (app/sweep.py) from a terminal, as JSON, a table
with a sentence per kind of text, and an HTML page with the figure."""

from __future__ import annotations

import html
from pathlib import Path

from app import category_runner, models, sweep
from app.args import settings, with_chat
from app.bench import progress, specbench

PER_CATEGORY = 1  # questions of each category by default: the sweep runs every draft on each


def sizes(args) -> dict:
    """Every draft of the sweep on the sample's questions (PER_CATEGORY of each category unless
    --per-category says), plain decoding first, then each draft in rotating order on the same ids."""
    suite = Path(args.suite) if specbench.is_file_suite(args.suite) else category_runner.SAMPLE
    picked = category_runner.select(
        category_runner.read_questions(suite), args.categories, args.per_category or PER_CATEGORY
    )
    target_id = models.presets.id_of(args.target or models.DEFAULT_TARGET)
    progress.say("sizes", f"loading {target_id}")
    tok = models.load(target_id, args.device, args.dtype)[1]
    st = with_chat(settings(args), args, tok)
    named = specbench.split_drafts(args.drafts) if args.drafts else None

    def load(draft: str) -> models.Pair:
        return models.load_pair(target_id, draft, args.device, args.dtype)

    say = lambda text, done: progress.say("sizes", f"{done:4.0%} {text}")  # noqa: E731
    *_, doc = sweep.measure(load, target_id, picked, st, named, exits=args.exits, say=say)
    return dict(format="spec-bench", file=suite.name) | doc


def table(doc: dict) -> str:
    """The sweep as text: a row per category and draft, cheapest draft first."""
    width = max((len(p["label"]) for curve in doc["sizes"].values() for p in curve["points"]), default=5)
    lines = [
        f"{'category':<16} {'draft':<{width}} {'c':>6} {'alpha':>6} {'tok/pass':>8} {'speedup':>8} {'predicted':>9}"
    ]
    for category, curve in doc["sizes"].items():
        for p in curve["points"]:
            alpha = f"{p['alpha']:>6.2f}" if p["alpha"] is not None else f"{'-':>6}"
            tpp = f"{p['tokens_per_pass']:>8.2f}" if p["tokens_per_pass"] is not None else f"{'-':>8}"
            pred = f"{p['predicted']:>8.2f}x" if p["predicted"] is not None else f"{'-':>9}"
            lines.append(
                f"{category:<16} {p['label']:<{width}} {p['c']:>6.3f} {alpha} {tpp} {p['speedup']:>7.2f}x {pred}"
            )
    return "\n".join(lines + [""] + list(sweep.verdicts(doc).values()))


def html_report(doc: dict) -> str:
    """A self-contained page: the figure, then the table and its reading."""
    from app.views import draft_size

    figure = draft_size.figure(doc).to_html(full_html=False, include_plotlyjs=True)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>which draft: {html.escape(doc["target"])}</title>
<style>body{{font-family:sans-serif;margin:2em}}</style></head><body>
<h1>Which draft is worth it: {html.escape(doc["target"])}, {doc["layers"]} layers</h1>
<p>{html.escape(doc["file"])}, {doc["device"]}, {html.escape(doc["dtype"])}.</p>{figure}
<pre>{html.escape(table(doc))}</pre></body></html>"""
