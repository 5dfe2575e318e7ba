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
    bundled: list[str] = []
    if target_id == models.SMOLLM2:
        bundled = [models.SMOLLM2_SMALL, models.SMOLLM2_FEATURE]
    elif Path(target_id).resolve() == Path(models.TINY_TARGET).resolve():
        bundled = [str(models.BUNDLED / n) for n in ("draft-weak", "draft-small", "draft-distilled", "draft-feature")]
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
    say: Callable[[str], None] = lambda text: None,
) -> Iterator[dict]:
    """The sweep's document after each question answered by plain decoding and every draft (its
    category's curve complete), then once more when done. `load(draft)` gives the pair; `stop`, checked
    after every round, ends the sweep after the current measurement and the last document says so."""
    first = load(models.PROMPT_LOOKUP)  # the target alone, beside a draft that loads nothing
    target, tok = first.target, first.tokenizer
    layers = target.config.num_hidden_layers
    drafts = drafts or drafts_for(target_id, layers, exits=exits)
    st, context = settings, models.context_length(target)
    probe = category_runner.conversation(tok, picked[0].turns[:1], [], st.run.chat, context)
    halt = stop or (lambda: False)
    doc = dict(target=target_id, layers=layers, drafts=drafts, draft_cost={}, device=str(target.device))
    doc |= dict(settings=settings_dict("bench", st.sampling, st.spec, st.run), dtype=models.precision_of(target))
    pairs = {}
    for i, d in enumerate(drafts, start=1):
        say(f"loading draft {i}/{len(drafts)}: {d}")
        pairs[d] = load(d)
    timers = {d: functools.partial(p.draft.seconds_per_token, p.target, probe) for d, p in pairs.items()}
    ratios = cost_ratios(timers, functools.partial(decode_seconds_per_token, target, probe), halt, say)
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
            say(f"draft {i}/{len(drafts)}: {d}: measuring this machine's round costs for adaptive k")
        field[d] = category_runner.timed(p, st, True, request.costs(p, st) if planned else None, halt)
    rows: list[dict] = []
    for n, q in enumerate(picked):
        say(f"question {n + 1}/{len(picked)} ({q.category}): plain decoding and {len(drafts)} drafts")
        try:
            rows.append(category_runner.answer(q, tok, plain, field, st.run, context, n))
        except category_runner.Stopped:
            yield _document(doc, rows, picked, stopped=True)
            return
        if n + 1 < len(picked):
            yield _document(doc, rows, picked, stopped=False)
    yield _document(doc, rows, picked, stopped=False)


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
        label = name(best["draft"], doc["layers"])
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
            text += f"; the best early exit, {name(top['draft'], doc['layers'])}, ran at {top['speedup']:.2f}×{alpha}"
        out[category] = text + "."
    return out


def name(draft: str, layers: int) -> str:
    if draft.startswith("early-exit:"):
        return f"early exit at {draft.split(':')[1]} of {layers} layers"
    return Path(draft).name if "/" in draft else draft
