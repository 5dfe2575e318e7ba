"""The draft-size sweep: which draft is worth it for a target, per kind of text.

Too small a draft is rejected too often; too large a one costs as much as it saves. The sweep puts the
target's drafts on one curve: early exit at a spread of depths (a continuous draft size), the target's
bundled or named draft models, its feature head and prompt lookup. For each draft and each category of
the questions it measures α, the draft's cost c per token over a target pass, tokens per pass and the
speedup, all in one interleaved run (app/category_runner.py, as the bench's `--suite FILE` runs it), and sets
beside them Leviathan et al.'s predicted speedup from the same α and c. The bench (`bench --sizes`) and
the app's panel both run it.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from app import category_runner, models, request
from app.core.config import Settings, settings_dict
from app.core.costs import Costs
from app.drafts.model import decode_seconds_per_token

EXITS = 8  # early-exit depths spread over a deep target; a shallow one gets every layer


def depths(layers: int, most: int = EXITS) -> list[int]:
    """Early-exit depths for a target of `layers` layers: every one below the top for a small model,
    else `most` spread evenly between the bottom and the top."""
    if layers - 1 <= most:
        return list(range(1, layers))
    return sorted({max(1, min(layers - 1, round(layers * i / (most + 1)))) for i in range(1, most + 1)})


def drafts_for(target_id: str, layers: int, named: list[str] | None = None, exits: int = EXITS) -> list[str]:
    """The sweep's drafts: `named` ones if given, else early exit at depths(), the target's bundled
    drafts and prompt lookup."""
    if named:
        return named
    trained = models.presets.TRAINED_DRAFTS
    bundled = next((list(d) for t, d in trained.items() if Path(t).resolve() == Path(target_id).resolve()), [])
    # bundled drafts by their preset labels: a public server admits those, never an install path
    named_by_label = [models.presets.draft_label(d) for d in bundled]
    return [f"early-exit:{n}" for n in depths(layers, exits)] + named_by_label + [models.PROMPT_LOOKUP]


COST_REPS = 3  # rounds of timing each draft beside the target (odd: the median is one real round)


def cost_ratios(
    t_drafts: dict[str, Callable[[], float]],
    t_target: Callable[[], float],
    stop: Callable[[], bool],
    say: Callable[[str], None],
    reps: int = COST_REPS,
) -> dict[str, list[float]]:
    """Per draft, its seconds per token over the target's, one ratio a round: each round times the
    target once and every draft beside it, so a drifting host moves both alike. `stop` ends the
    timing after the current round."""
    ratios: dict[str, list[float]] = {d: [] for d in t_drafts}
    for r in range(reps):
        say(f"timing each draft's cost per token beside the target's: round {r + 1} of {reps}")
        target = t_target()
        for d, timer in t_drafts.items():
            ratios[d].append(timer() / target)
        if stop():
            break
    return ratios


def predicted(alpha: float | None, c: float, k_max: int, fixed: int | None = None) -> tuple[float | None, int | None]:
    """(speedup, k): Leviathan et al.'s (1 − α^(k+1)) / ((1 − α)(k·c + 1)) at its best k ≤ k_max, or at
    the `fixed` k the drafts ran at, as the cost model computes it under Leviathan's assumptions."""
    if alpha is None:
        return None, None
    ideal = Costs.idealised(c=c, k_max=max(k_max, fixed or 0))
    k = fixed if fixed is not None else ideal.best_k(alpha, k_max)
    return ideal.speedup(alpha, k), k


def measure(
    load: Callable[[str], models.Pair],
    target_id: str,
    picked: Sequence[category_runner.Question],
    settings: Settings,
    drafts: list[str] | None = None,
    exits: int = EXITS,
    stop: Callable[[], bool] | None = None,
    say: Callable[[str, float], None] = lambda text, done: None,
) -> Iterator[dict]:
    """The sweep's document after each question answered by plain decoding and every draft (its
    category's curve complete), then once more when done. `load(draft)` gives the pair; `stop`, checked
    after every round, ends the sweep after the current measurement and the last document says so;
    `say(text, done)` hears each step before it starts, with the share of steps done."""
    first = load(models.PROMPT_LOOKUP)  # the target alone, beside a draft that loads nothing
    target, tok = first.target, first.tokenizer
    layers = target.config.num_hidden_layers
    drafts = drafts or drafts_for(target_id, layers, exits=exits)
    st, context = settings, models.context_length(target)
    probe = _first_turn(tok, picked[0], st, context)
    halt = stop or (lambda: False)
    doc = _head(target_id, first, drafts, st, picked, context)
    turns = sum(len(q.turns) for q in picked)
    step = Tally(say, len(drafts) + COST_REPS + turns * (1 + len(drafts)))
    pairs = {}
    for i, d in enumerate(drafts, start=1):
        step(f"loading draft {i}/{len(drafts)}: {name(d)}")
        pairs[d] = load(d)
    timers = {d: functools.partial(p.draft.seconds_per_token, p.target, probe) for d, p in pairs.items()}
    ratios = cost_ratios(timers, functools.partial(decode_seconds_per_token, target, probe), halt, step)
    doc["draft_cost"] = {d: statistics.median(r) for d, r in ratios.items() if r}
    if halt():
        yield _document(doc, [], picked, stopped=True)
        return
    plain = category_runner.timed(first, st, False, None, halt)
    # a fixed k plans nothing, so it needs no round costs: only adaptive and heuristic k measure them
    planned = st.spec.k_policy != "fixed"
    field = {}
    for i, (d, p) in enumerate(pairs.items(), start=1):
        if planned:
            say(f"draft {i}/{len(drafts)}: {name(d)}: measuring this machine's round costs for adaptive k", step.done)
        field[d] = category_runner.timed(p, st, True, request.costs(p, st) if planned else None, halt)
    rows: list[dict] = []
    for n, q in enumerate(picked):
        where = f"question {n + 1}/{len(picked)} ({q.category})"
        sides = {d: step.before(side, f"{where}: {name(d)}") for d, side in field.items()}
        try:
            rows.append(
                category_runner.answer(
                    q, tok, step.before(plain, f"{where}: plain decoding"), sides, st.run, context, n
                )
            )
        except category_runner.Stopped:
            yield _document(doc, rows, picked, stopped=True)
            return
        if n + 1 < len(picked):
            yield _document(doc, rows, picked, stopped=False)
    yield _document(doc, rows, picked, stopped=False)


def _head(target_id: str, first: models.Pair, drafts: list[str], st: Settings, picked, context: int) -> dict:
    """The document's fixed part: the target, the drafts, the settings and each question's first turn length."""
    target = first.target
    doc = dict(target=target_id, layers=target.config.num_hidden_layers, drafts=drafts, draft_cost={})
    doc |= dict(device=str(target.device), settings=settings_dict("bench", st.sampling, st.spec, st.run))
    # both clocks include the prompt's prefill, which weighs most on a text to summarize or a passage
    prompts = [(q, len(_first_turn(first.tokenizer, q, st, context))) for q in picked]
    prompts_doc = [dict(question_id=q.question_id, category=q.category, tokens=n) for q, n in prompts]
    return doc | dict(dtype=models.precision_of(target), prompts=prompts_doc)


def _first_turn(tokenizer, q: category_runner.Question, settings: Settings, context: int) -> list[int]:
    return category_runner.conversation(tokenizer, q.turns[:1], [], settings.run.chat, context)


class Tally:
    """The sweep's progress: each draft's load, each round of cost timing and each side's answer to each
    turn is one step; a step is announced with the share done before it, then counted."""

    def __init__(self, say: Callable[[str, float], None], total: int):
        self.say, self.total, self.steps = say, total, 0

    @property
    def done(self) -> float:
        return min(1.0, self.steps / self.total)

    def __call__(self, text: str) -> None:
        self.say(text, self.done)
        self.steps += 1

    def before(self, side: category_runner.Side, text: str) -> category_runner.Side:
        """`side`, announced as one step each time it runs."""

        def run(ids: list[int], n: int):
            self(text)
            return side(ids, n)

        return run


def _document(doc: dict, rows: list[dict], picked: Sequence[category_runner.Question], stopped: bool) -> dict:
    summary = category_runner.summarize(rows, doc["drafts"]) if rows else {}
    spec = doc["settings"]["speculation"]
    fixed = spec["k"] if spec["k_policy"] == "fixed" else None
    sizes = curves(summary, doc["drafts"], doc["draft_cost"], spec["k_max"], fixed)
    return doc | dict(sizes=sizes, summary=summary, questions=rows, stopped=stopped, questions_asked=len(picked))


def curves(summary: dict, drafts: list[str], cost: dict[str, float], k_max: int, fixed: int | None = None) -> dict:
    """Per category: each draft's c, α, tokens per pass, measured speedup (median over questions) and
    predicted speedup with its k (`fixed`, or the best), in order of c; and the draft fastest as
    measured and as predicted."""
    out = {}
    for category, entry in summary.items():
        points = []
        for d in sorted(drafts, key=lambda x: cost[x]):
            e = entry[d]
            speedup, k = predicted(e["alpha"], cost[d], k_max, fixed)
            points.append(
                dict(
                    draft=d,
                    label=name(d),
                    c=cost[d],
                    alpha=e["alpha"],
                    tokens_per_pass=e["tokens_per_pass"],
                    speedup=e["speedup"]["median"],
                    predicted=speedup,
                    predicted_k=k,
                )
            )
        scored = [p for p in points if p["predicted"] is not None]
        out[category] = dict(
            points=points,
            # a draft none of whose tokens were kept ran as plain decoding: its speedup is the clock's noise
            fastest=max(points, key=lambda p: (bool(p["alpha"]), p["speedup"]))["draft"],
            fastest_predicted=max(scored, key=lambda p: p["predicted"])["draft"] if scored else None,
            questions=entry["questions"],
        )
    return out


def verdicts(doc: dict) -> dict[str, str]:
    """Per category, one sentence that reads the sweep: the fastest draft here, and where it sits
    among the early exits (shallower ones rejected too often, deeper ones too dear)."""
    out = {}
    for category, curve in doc["sizes"].items():
        points = curve["points"]
        best = next(p for p in points if p["draft"] == curve["fastest"])
        label = best["label"]
        if best["speedup"] < 1 or not best["alpha"]:
            out[category] = f"For {category}, no draft beats plain decoding here (the best, {label}, ran at "
            out[category] += f"{best['speedup']:.2f}×)."
            continue
        text = f"For {category}, {label} is fastest here ({best['speedup']:.2f}×"
        text += f", α {best['alpha']:.2f}, c {best['c']:.3f})" if best["alpha"] is not None else ")"
        exits = [p for p in points if p["draft"].startswith("early-exit:")]
        shallower = [p for p in exits if p["c"] < best["c"] and p["alpha"] is not None]
        deeper = [p for p in exits if p["c"] > best["c"]]
        if best in exits and shallower and deeper and max(p["alpha"] for p in shallower) < (best["alpha"] or 0):
            text += "; shallower exits are rejected too often, deeper ones cost too much"
        elif exits:
            top = max(exits, key=lambda p: p["speedup"])
            alpha = f", α {top['alpha']:.2f}" if top["alpha"] is not None else ""
            text += f"; of the early exits, {top['label']} ran fastest, at {top['speedup']:.2f}×{alpha}"
        out[category] = text + "."
    return out


def name(draft: str) -> str:
    """A draft as the page's draft list names it: a preset by its label (a bundled draft typed as a
    path too), any early exit worded as the preset ones are, anything else as typed."""
    if draft.startswith(models.EARLY_EXIT):
        depth = draft.removeprefix(models.EARLY_EXIT)
        return f"early exit after {depth} layer{'' if depth == '1' else 's'}"
    typed = models.presets.id_of(draft)
    if Path(typed).exists():
        typed = str(Path(typed).resolve())
    return models.presets.draft_label(typed)
