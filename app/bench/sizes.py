"""`python -m app bench --sizes`: which draft is worth it for a target, per kind of text.

Too small a draft is rejected too often; too large a one costs as much as it saves. The sweep puts the
target's drafts on one curve: early exit at a spread of depths (a continuous draft size), the target's
bundled or named draft models, its feature head and prompt lookup. For each draft and each category of
the Spec-Bench-format sample it measures α, the draft's cost c per token over a target pass, tokens
per pass and the speedup at adaptive k, all in one interleaved run (app/questions.py, as the bench's
`--suite FILE` runs it), and sets beside them Leviathan et al.'s predicted speedup from the same α and
c at the best k.
"""

from __future__ import annotations

import functools
import html
from pathlib import Path

from app import models, questions, request
from app.args import settings, with_chat
from app.bench import progress, specbench
from app.bench.card import cost_ratio
from app.core.config import settings_dict
from app.core.costs import Costs
from app.drafts.model import decode_seconds_per_token

EXITS = 8  # early-exit depths spread over a deep target; a shallow one gets every layer
PER_CATEGORY = 1  # questions of each category by default: the sweep runs every draft on each


def depths(layers: int, most: int = EXITS) -> list[int]:
    """Early-exit depths for a target of `layers` layers: every one below the top for a small model,
    else `most` spread evenly between the bottom and the top."""
    if layers - 1 <= most:
        return list(range(1, layers))
    return sorted({max(1, min(layers - 1, round(layers * i / (most + 1)))) for i in range(1, most + 1)})


def drafts_for(target_id: str, layers: int, named: list[str] | None = None) -> list[str]:
    """The sweep's drafts: `named` ones if given, else early exit at depths(), the target's bundled
    drafts and prompt lookup."""
    if named:
        return named
    bundled: list[str] = []
    if target_id == models.SMOLLM2:
        bundled = [models.SMOLLM2_SMALL, models.SMOLLM2_FEATURE]
    elif Path(target_id).resolve() == Path(models.TINY_TARGET).resolve():
        bundled = [str(models.BUNDLED / n) for n in ("draft-weak", "draft-small", "draft-distilled", "draft-feature")]
    return [f"early-exit:{n}" for n in depths(layers)] + bundled + [models.PROMPT_LOOKUP]


def predicted(alpha: float | None, c: float, k_max: int) -> tuple[float | None, int | None]:
    """(speedup, k): Leviathan et al.'s (1 − α^(k+1)) / ((1 − α)(k·c + 1)) at its best k ≤ k_max, as
    the cost model computes it under Leviathan's assumptions."""
    if alpha is None:
        return None, None
    ideal = Costs.idealised(c=c, k_max=k_max)
    best = ideal.best_k(alpha, k_max)
    return ideal.speedup(alpha, best), best


def sizes(args) -> dict:
    """Every draft of the sweep on the sample's questions (PER_CATEGORY of each category unless
    --per-category says), plain decoding first, then each draft in rotating order on the same ids."""
    suite = Path(args.suite) if specbench.is_file_suite(args.suite) else questions.SAMPLE
    picked = questions.select(questions.read_questions(suite), args.categories, args.per_category or PER_CATEGORY)
    target_id = models.presets.id_of(args.target or models.DEFAULT_TARGET)
    progress.say("sizes", f"loading {target_id}")
    target, tok = models.load(target_id, args.device, args.dtype)
    named = specbench.split_drafts(args.drafts) if args.drafts else None
    drafts = drafts_for(target_id, target.config.num_hidden_layers, named)
    st = with_chat(settings(args), args, tok)
    context = models.context_length(target)
    probe = questions.conversation(tok, picked[0].turns[:1], [], st.run.chat, context)
    pairs, cost = {}, {}
    for i, d in enumerate(drafts, start=1):
        progress.say("sizes", f"draft {i}/{len(drafts)}: {d}: loading it and timing its cost per token")
        pairs[d] = models.load_pair(target_id, d, args.device, args.dtype)
        timed = functools.partial(pairs[d].draft.seconds_per_token, pairs[d].target, probe)
        cost[d] = cost_ratio(timed, functools.partial(decode_seconds_per_token, pairs[d].target, probe))[2]
    first = pairs[drafts[0]]
    plain = questions.timed(first, st, False, None)
    # a fixed k plans nothing, so it needs no round costs: only adaptive and heuristic k measure them
    planned = st.spec.k_policy != "fixed"
    field = {}
    for i, (d, p) in enumerate(pairs.items(), start=1):
        if planned:
            progress.say("sizes", f"draft {i}/{len(drafts)}: {d}: measuring this machine's round costs for adaptive k")
        field[d] = questions.timed(p, st, True, request.costs(p, st) if planned else None)
    rows = [
        questions.answer(q, tok, plain, field, st.run, context, n)
        for n, q in progress.counted(enumerate(picked), "question", len(picked))
    ]
    summary = questions.summarize(rows, drafts)
    return dict(
        format="spec-bench",
        file=suite.name,
        target=target_id,
        layers=target.config.num_hidden_layers,
        drafts=drafts,
        settings=settings_dict("bench", st.sampling, st.spec, st.run),
        draft_cost=cost,
        sizes=curves(summary, drafts, cost, st.spec.k_max),
        summary=summary,
        questions=rows,
        device=str(target.device),
        dtype=models.precision_of(first.target),
    )


def curves(summary: dict, drafts: list[str], cost: dict[str, float], k_max: int) -> dict:
    """Per category: each draft's c, α, tokens per pass, measured speedup (median over questions) and
    predicted speedup with its k, in order of c; and the draft fastest as measured and as predicted."""
    out = {}
    for category, entry in summary.items():
        points = []
        for d in sorted(drafts, key=lambda x: cost[x]):
            e = entry[d]
            speedup, k = predicted(e["alpha"], cost[d], k_max)
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
            fastest=max(points, key=lambda p: p["speedup"])["draft"],
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
        name = _name(best["draft"], doc["layers"])
        if best["speedup"] < 1:
            out[category] = f"For {category}, no draft beats plain decoding here (the best, {name}, ran at "
            out[category] += f"{best['speedup']:.2f}×)."
            continue
        text = f"For {category}, {name} is fastest here ({best['speedup']:.2f}×"
        text += f", α {best['alpha']:.2f}, c {best['c']:.3f})" if best["alpha"] is not None else ")"
        exits = [p for p in points if p["draft"].startswith("early-exit:")]
        shallower = [p for p in exits if p["c"] < best["c"] and p["alpha"] is not None]
        deeper = [p for p in exits if p["c"] > best["c"]]
        if best in exits and shallower and deeper and max(p["alpha"] for p in shallower) < (best["alpha"] or 0):
            text += "; shallower exits are rejected too often, deeper ones cost too much"
        elif exits:
            top = max(exits, key=lambda p: p["speedup"])
            alpha = f", α {top['alpha']:.2f}" if top["alpha"] is not None else ""
            text += f"; the best early exit, {_name(top['draft'], doc['layers'])}, ran at {top['speedup']:.2f}×{alpha}"
        out[category] = text + "."
    return out


def _name(draft: str, layers: int) -> str:
    if draft.startswith("early-exit:"):
        return f"early exit at {draft.split(':')[1]} of {layers} layers"
    return Path(draft).name if "/" in draft else draft


def table(doc: dict) -> str:
    """The sweep as text: a row per category and draft, cheapest draft first."""
    lines = [f"{'category':<16} {'draft':<30} {'c':>6} {'alpha':>6} {'tok/pass':>8} {'speedup':>8} {'predicted':>9}"]
    for category, curve in doc["sizes"].items():
        for p in curve["points"]:
            alpha = f"{p['alpha']:>6.2f}" if p["alpha"] is not None else f"{'-':>6}"
            tpp = f"{p['tokens_per_pass']:>8.2f}" if p["tokens_per_pass"] is not None else f"{'-':>8}"
            pred = f"{p['predicted']:>8.2f}x" if p["predicted"] is not None else f"{'-':>9}"
            lines.append(
                f"{category:<16} {_name(p['draft'], doc['layers'])[:30]:<30} {p['c']:>6.3f} {alpha} {tpp} "
                f"{p['speedup']:>7.2f}x {pred}"
            )
    return "\n".join(lines + [""] + list(verdicts(doc).values()))


def html_report(doc: dict) -> str:
    """A self-contained page: the figure, then the table and its reading."""
    from app.views import draft_size

    figure = draft_size.figure(doc).to_html(full_html=False, include_plotlyjs=True)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>which draft: {html.escape(doc["target"])}</title>
<style>body{{font-family:sans-serif;margin:2em}}</style></head><body>
<h1>Which draft is worth it: {html.escape(doc["target"])}, {doc["layers"]} layers</h1>
<p>{html.escape(doc["file"])}, {doc["device"]}, {html.escape(doc["dtype"])}.</p>{figure}
<pre>{html.escape(table(doc))}</pre></body></html>"""
