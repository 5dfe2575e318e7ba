"""Questions by kind of text, answered turn by turn by plain decoding and by each draft, and summarised
per category the way Spec-Bench's leaderboard reports: the one runner behind the bench's
`--suite FILE.jsonl` and the app's "By kind of text" panel, so both give the same figures.

The format is Spec-Bench's (and MT-bench's) question.jsonl, one question a line,
`{"question_id", "category", "turns": [...]}`, or a plain file with one prompt a line. Each later turn
follows the target's own answer to the turn before, as plain decoding gave it: the speculative runs
see the same history, so under greedy decoding both sides answer the same conversation, and under
sampling the history is plain decoding's.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from app import request
from app.core import engine, metrics
from app.core.config import RunConfig, Settings, UserError
from app.core.costs import Costs
from app.core.policy import make_policy

SAMPLE = Path(__file__).resolve().parents[1] / "assets" / "specbench-sample.jsonl"
PLAIN = "prompts"  # the category of every line of a plain prompts file
PLAIN_SIDE = "plain"  # a row's plain-decoding side

# (prompt ids, new tokens) -> (ids, seconds, Steps)
Side = Callable[[list[int], int], tuple[list[int], float, list]]


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


class Stopped(Exception):
    """A run's stop check fired (Stop, or a run limit) between two rounds."""


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


def timed(pair, settings: Settings, speculative: bool, costs: Costs | None, stop: Callable[[], bool] | None = None):
    """One side as a timed run, (prompt ids, n) -> (ids, seconds, Steps): the wall clock covers
    everything from prompt ids to the last token. `stop`, checked after every round, raises Stopped."""
    s, sp, r = settings.sampling, settings.spec, settings.run

    def run(ids: list[int], n: int):
        settings = Settings(s, sp, RunConfig(n, r.stop, r.chat))
        job = request.start(pair, ids, settings, speculative=speculative, calibrated=False, measured=costs)
        policy = make_policy(sp, costs) if speculative else None
        start = time.perf_counter()
        steps = []
        for step in job.steps(policy, display=False):  # as transformers', nothing but the output is decoded
            steps.append(step)
            if stop is not None and stop():
                raise Stopped
        engine.sync(pair.target.device)
        return [t for x in steps for t in x.emitted], time.perf_counter() - start, steps

    return run


def answer(q: Question, tokenizer, plain: Side, field: dict[str, Side], r: RunConfig, context: int, n: int) -> dict:
    """One question's row: every turn by plain decoding first (its answer is the next turn's history),
    then by each draft in an order that rotates with the question's number n."""
    answers: list[str] = []
    sides: dict[str, dict] = {name: dict(tokens=0, seconds=0.0, steps=[], ids=[]) for name in [PLAIN_SIDE, *field]}
    names = list(field)
    for t in range(len(q.turns)):
        ids = conversation(tokenizer, q.turns[: t + 1], answers, r.chat, context)
        out, seconds, steps = plain(ids, r.max_new_tokens)
        _add(sides[PLAIN_SIDE], out, seconds, steps)
        for name in names[n % len(names) :] + names[: n % len(names)]:
            got, spent, got_steps = field[name](ids, r.max_new_tokens)
            _add(sides[name], got, spent, got_steps)
        answers.append(tokenizer.decode(out, skip_special_tokens=True))
    base = sides[PLAIN_SIDE]
    row = dict(question_id=q.question_id, category=q.category, turns=len(q.turns), plain=_side(base))
    for name in field:
        side = _side(sides[name])
        side["speedup"] = side["tokens_per_s"] / row[PLAIN_SIDE]["tokens_per_s"]
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
                plain_tokens_per_s=statistics.median(x[PLAIN_SIDE]["tokens_per_s"] for x in group),
                speedup=dict(median=statistics.median(speedups), min=min(speedups), max=max(speedups)),
                identical=sum(x[d]["identical"] for x in group) / len(group),
            )
    return out
