"""The field's benchmark format: Spec-Bench's (and MT-bench's) question.jsonl, one question a line,
`{"question_id", "category", "turns": [...]}`, or a plain file with one prompt a line; run turn by
turn through the chat template and reported the way its leaderboard reports, per category.

Each later turn follows the target's own answer to the turn before, as plain decoding gave it: the
speculative runs see the same history, so under greedy decoding both sides answer the same
conversation, and under sampling the history is plain decoding's (the report says so).
"""

from __future__ import annotations

import html
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app import calibrate, models
from app.args import settings, with_chat
from app.bench import progress
from app.bench.contenders import adaptive_k, ours
from app.core import metrics
from app.core.config import RunConfig, UserError, settings_dict

SAMPLE = Path(__file__).resolve().parents[2] / "assets" / "specbench-sample.jsonl"
PLAIN = "prompts"  # the category of every line of a plain prompts file


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


def is_file_suite(suite: str) -> bool:
    """Whether --suite names a file (a path, or a name ending .jsonl or .txt) rather than a built-in suite."""
    return suite.endswith((".jsonl", ".txt")) or Path(suite).is_file()


def read_questions(path: Path) -> list[Question]:
    """Every question of a Spec-Bench-format .jsonl file, or a plain file's lines as one-turn prompts.
    A bad line raises UserError naming its line number, before anything runs."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".jsonl":
        return [Question(str(i), PLAIN, (line,)) for i, line in enumerate(lines, 1) if line.strip()]
    out, seen = [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        q = _question(line, f"{path}:{number}")
        if q.question_id in seen:
            raise UserError(f"{path}:{number}: question_id {q.question_id} appears twice")
        seen.add(q.question_id)
        out.append(q)
    if not out:
        raise UserError(f"{path}: no questions")
    return out


def _question(line: str, where: str) -> Question:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{where}: a question is a JSON object, got {type(doc).__name__}")
    missing = [key for key in ("question_id", "category", "turns") if key not in doc]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)}")
    qid, category, turns = doc["question_id"], doc["category"], doc["turns"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise UserError(f"{where}: question_id must be a number or text, got {qid!r}")
    if not isinstance(category, str) or not category.strip():
        raise UserError(f"{where}: category must be non-empty text, got {category!r}")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise UserError(f"{where}: turns must be a non-empty list of non-empty texts")
    return Question(str(qid), category.strip(), tuple(turns))


def select(questions: Sequence[Question], categories: str | None, per_category: int) -> list[Question]:
    """The questions of the named categories (comma-separated; None: all), at most per_category of
    each (0: all), in file order."""
    wanted = [c.strip() for c in categories.split(",") if c.strip()] if categories else None
    known = list(dict.fromkeys(q.category for q in questions))
    unknown = [c for c in wanted or [] if c not in known]
    if unknown:
        raise UserError(f"no questions of category {', '.join(unknown)}: the file has {', '.join(known)}")
    out, taken = [], dict.fromkeys(known, 0)
    for q in questions:
        if (wanted is None or q.category in wanted) and (not per_category or taken[q.category] < per_category):
            out.append(q)
            taken[q.category] += 1
    return out


def conversation(tokenizer, turns: Sequence[str], answers: Sequence[str], chat: bool, context: int) -> list[int]:
    """The ids of the next turn: every earlier turn with its answer, then this one, through the chat
    template (without one, the turns and answers joined as plain text)."""
    if not chat:
        text = "\n\n".join(x for pair in zip(turns, [*answers, ""], strict=False) for x in pair if x)
        ids = tokenizer(text)["input_ids"]
    else:
        messages = []
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) >= context:
        raise UserError(f"a conversation is {len(ids)} tokens but the model's context is {context}")
    return ids


def specbench(args) -> dict:
    """Every selected question, turn by turn: plain decoding first (its answer is the history), then
    each draft's speculative run in rotating order, on the same ids."""
    questions = select(read_questions(Path(args.suite)), args.categories, args.per_category)
    drafts = _drafts(args)
    progress.say("bench", f"loading {args.target or models.DEFAULT_TARGET} and {len(drafts)} draft(s)")
    pairs = {d: models.load_pair(args.target, d, args.device, args.dtype) for d in drafts}
    first = next(iter(pairs.values()))
    st = with_chat(settings(args), args, first.tokenizer)
    s, sp, r = st.sampling, st.spec, st.run
    plain = ours(first, s, sp, r, False, None)
    field = {}
    for d, pair in pairs.items():
        costs = calibrate.costs_for(pair, sp if sp.tree_auto else adaptive_k(sp), sampling=s)
        field[d] = ours(pair, s, sp, r, True, costs)
    context = models.context_length(first.target)
    rows = []
    for n, q in progress.counted(enumerate(questions), "question", len(questions)):
        rows.append(_question_row(q, first, plain, field, r, context, n))
    return dict(
        format="spec-bench",
        file=str(args.suite),
        target=first.target_name,
        drafts=drafts,
        settings=settings_dict("bench", s, sp, r),
        history="plain decoding's answers (greedy: the same conversation on both sides)"
        if s.greedy
        else "plain decoding's sampled answers: the speculative runs answer the same history",
        summary=summarize(rows, drafts),
        questions=rows,
        device=str(first.target.device),
        dtype=str(first.target.dtype),
    )


def _drafts(args) -> list[str]:
    """--drafts a,b,c, else --draft or the target's default draft. Preset labels hold commas
    ("..., bundled"), so a piece that is no draft on its own joins the one before it."""
    if not args.drafts:
        return [args.draft or models.default_draft(args.target)]
    out: list[str] = []
    for piece in args.drafts.split(","):
        if out and piece.startswith(" ") and not piece.strip().startswith(("early-exit", "prompt-lookup")):
            out[-1] += "," + piece
        else:
            out.append(piece.strip())
    return [d.strip() for d in out if d.strip()]


def _question_row(q: Question, pair, plain, field: dict, r: RunConfig, context: int, n: int) -> dict:
    answers: list[str] = []
    sides: dict[str, dict] = {name: dict(tokens=0, seconds=0.0, steps=[], ids=[]) for name in ["plain", *field]}
    for t in range(len(q.turns)):
        ids = conversation(pair.tokenizer, q.turns[: t + 1], answers, r.chat, context)
        out, seconds, steps = plain(ids, r.max_new_tokens)
        _add(sides["plain"], out, seconds, steps)
        names = list(field)
        for name in names[n % len(names) :] + names[: n % len(names)]:  # rotating order across questions
            got, spent, got_steps = field[name](ids, r.max_new_tokens)
            _add(sides[name], got, spent, got_steps)
        answers.append(pair.tokenizer.decode(out, skip_special_tokens=True))
    base = sides["plain"]
    row = dict(question_id=q.question_id, category=q.category, turns=len(q.turns), plain=_side(base))
    for name in field:
        side = _side(sides[name])
        side["speedup"] = side["tokens_per_s"] / row["plain"]["tokens_per_s"]
        side["identical"] = sides[name]["ids"] == base["ids"]
        row[name] = side
    return row


def _add(side: dict, out: list[int], seconds: float, steps) -> None:
    side["tokens"] += len(out)
    side["seconds"] += seconds
    side["steps"] += steps or []
    side["ids"].append(out)


def _side(side: dict) -> dict:
    stats = metrics.summarize(side["steps"])
    return dict(
        tokens=side["tokens"],
        seconds=side["seconds"],
        tokens_per_s=side["tokens"] / side["seconds"] if side["seconds"] > 0 else 0.0,
        tokens_per_pass=stats["tokens_per_pass"],
        alpha=stats["alpha"],
    )


def summarize(rows: list[dict], drafts: list[str]) -> dict:
    """Per category and overall, per draft: the leaderboard's mean accepted tokens per target pass and
    speedup (median, with its range over questions), α, both runs' tokens/s, and the share identical."""
    groups = {c: [x for x in rows if x["category"] == c] for c in dict.fromkeys(x["category"] for x in rows)}
    groups["overall"] = rows
    out: dict = {}
    for name, group in groups.items():
        out[name] = dict(questions=len(group))
        for d in drafts:
            speedups = [x[d]["speedup"] for x in group]
            passes = [x[d]["tokens_per_pass"] for x in group if x[d]["tokens_per_pass"] is not None]
            alphas = [x[d]["alpha"] for x in group if x[d]["alpha"] is not None]
            out[name][d] = dict(
                tokens_per_pass=statistics.fmean(passes) if passes else None,
                alpha=statistics.fmean(alphas) if alphas else None,
                tokens_per_s=statistics.median(x[d]["tokens_per_s"] for x in group),
                plain_tokens_per_s=statistics.median(x["plain"]["tokens_per_s"] for x in group),
                speedup=dict(median=statistics.median(speedups), min=min(speedups), max=max(speedups)),
                identical=sum(x[d]["identical"] for x in group) / len(group),
            )
    return out


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
    from app.views import plots

    figure = plots.category_figure(doc).to_html(full_html=False, include_plotlyjs=True)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>bench: {html.escape(doc["file"])}</title>
<style>body{{font-family:sans-serif;margin:2em}}</style></head><body>
<h1>{html.escape(doc["target"])} on {html.escape(doc["file"])}</h1>
<p>History of later turns: {html.escape(doc["history"])}. {doc["device"]}, {doc["dtype"]}.</p>
<pre>{html.escape(table(doc))}</pre>{figure}</body></html>"""
