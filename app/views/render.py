"""Records to display: highlighted HTML spans, the summary table, the decision table.

Pure functions (no gradio, no torch), so tests check them without a browser.
"""

from __future__ import annotations

import html
import itertools
from collections.abc import Sequence

from app.core import metrics
from app.core.config import REJECTION, SHARED_NOISE
from app.core.events import ACCEPTED, BONUS, CORRECTED, KIND_LABELS, REJECTED, TARGET, Step

CLASS = {ACCEPTED: "acc", CORRECTED: "cor", BONUS: "bon", REJECTED: "rej", TARGET: "tgt"}
LEGEND = (
    '<div class="legend">'
    + " ".join(
        f'<span class="tok {CLASS[k]}">{KIND_LABELS[k]}</span>' for k in (ACCEPTED, CORRECTED, BONUS, TARGET, REJECTED)
    )
    + ' <span class="round r1">&nbsp;shading alternates by round&nbsp;</span>'
    '<span class="legend-note">in rejected drafts, · is a space and ↵ a newline</span></div>'
)
PLACEHOLDER = '<div class="pane placeholder">Press <b>Generate</b>: {what} streams here, newest text in view.</div>'
SPEC_PLACEHOLDER = PLACEHOLDER.format(what="the speculative output, coloured by who wrote each token,")
AR_PLACEHOLDER = PLACEHOLDER.format(what="the target's own output")
STEP_PLACEHOLDER = (
    '<div class="pane placeholder">Press <b>Step one round</b>: each round adds its drafts '
    "and the target's verdict here.</div>"
)
LIVE_MIN_ROUNDS = 8  # rounds on each side before a live speedup is shown: early ratios swing widely


def visible(piece: str) -> str:
    """Whitespace drawn as symbols (· space, ↵ newline, ⇥ tab), so it can be seen and never breaks a line."""
    return piece.replace(" ", "·").replace("\t", "⇥").replace("\r", "").replace("\n", "↵")


def drawn(piece: str) -> str:
    """Whitespace drawn as visible's symbols, each newline still breaking its line after its ↵."""
    return visible(piece).replace("↵", "↵\n")


def code(piece: str, in_table: bool = False) -> str:
    """A token as Markdown inline code, readable whatever it holds: whitespace drawn (visible), a
    fence one backtick longer than any run inside it (a ``` token stays three backticks), and a
    table cell's pipes escaped."""
    shown = visible(piece) or "(no text yet)"
    fence = (
        "`" * (1 + max(len("".join(run)) for tick, run in itertools.groupby(shown) if tick == "`"))
        if "`" in shown
        else "`"
    )
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    out = f"{fence}{pad}{shown}{pad}{fence}"
    return out.replace("|", "\\|") if in_table else out


def status_mark(kind: str, word: str) -> str:
    """A status word with a CSS dot before it: no emoji, so no missing-glyph boxes."""
    return f'<span class="mark {kind}">{word}</span>'


def pane_html(prompt: str, steps: Sequence[Step], kind_classes: bool = True, drawn_round: int | None = None) -> str:
    """The prompt, then every round as a shaded group of coloured token spans.

    kind_classes=False gives plain text, for the autoregressive pane. drawn_round: the round whose
    whitespace is drawn (the teaching view's round), so a bonus space or newline is seen.
    """
    parts = [f'<div class="pane"><span class="prompt">{html.escape(prompt)}</span>']
    if not kind_classes:
        return parts[0] + html.escape("".join(s.text for s in steps)) + "</div>"
    for s in steps:
        # Rejected drafts show their whitespace as symbols, inline: their newlines and
        # indentation would otherwise break the layout of the text that was kept. Each round's
        # rejected drafts also get a mark before them, which the page shows instead when the
        # reader picks marks (style.css, .rej-marks): zero width, so no column moves.
        # A tree's thrown-away branches follow one another, each after a fork mark (style.css draws it,
        # so it adds no text to the pane).
        spans = s.spans()
        branches = s.thrown_away() if s.is_tree else []
        forks = set(itertools.accumulate(len(b) for b in branches[:-1]))  # where each later branch starts
        pieces, rejected, seen = [], [], 0
        for piece, kind in spans:
            if kind == REJECTED:
                if seen in forks:
                    pieces.append('<span class="fork" title="another branch of the tree, thrown away"></span>')
                    rejected.append("¦")
                rejected.append(piece)
                seen += 1
            shown = visible(piece) if kind == REJECTED else drawn(piece) if s.round == drawn_round else piece
            pieces.append(f'<span class="tok {CLASS[kind]}" data-kind="{kind}">{html.escape(shown)}</span>')
        if rejected:
            pieces.insert([kind for _, kind in spans].index(REJECTED), _rejected_mark(rejected))
        tokens = "".join(pieces)
        parts.append(f'<span class="round r{s.round % 2}" title="{_round_title(s, len(branches))}">{tokens}</span>')
    parts.append("</div>")
    return "".join(parts)


def _round_title(s: Step, branches: int) -> str:
    """A round's tooltip: its draft and what was kept of it (`branches`: a tree's thrown away)."""
    if not s.drafted:
        return ""
    if not s.is_tree:
        return f"round {s.round}: k={s.k}, kept {s.accepted} of {len(s.drafted)}"
    return (
        f"round {s.round}: a tree of {len(s.drafted)} drafts, {s.k} deep; kept {s.accepted} on its path, "
        f"{branches} branch{'es' if branches != 1 else ''} thrown away"
    )


def _rejected_mark(pieces: Sequence[str]) -> str:
    """A small mark where drafts were rejected, whitespace as symbols: hovering, focusing or tapping it
    shows them (style.css draws data-drafts), as a title tooltip never shows on a touch screen."""
    drafts = html.escape(visible("".join(pieces)), quote=True)
    return (
        f'<span class="rej-mark" tabindex="0" role="note" data-drafts="{drafts}" '
        f'aria-label="rejected drafts: {drafts}"></span>'
    )


def kind_counts(steps: Sequence[Step]) -> dict[str, int]:
    """How many tokens of each kind a pane shows."""
    counts: dict[str, int] = {}
    for s in steps:
        for _, kind in s.spans():
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def summary_markdown(
    spec: Sequence[Step], ar: Sequence[Step], done: bool = True, stopped: bool = False, costs=None
) -> str:
    """Both panes' figures side by side, with measured and theoretical speedup.

    While running (done=False) the speedup waits for a few rounds; after Stop it is marked partial.
    """
    a, b = metrics.summarize(ar), metrics.summarize(spec, costs)
    cmp = metrics.compare(b, a) if spec and ar else {"achieved_speedup": None}
    table = _figures_table(b, a)
    theory = _theory(b)
    few = min(len(spec), len(ar)) < LIVE_MIN_ROUNDS
    if stopped:
        head = "### Stopped: partial figures\nOnly the rounds before Stop are counted. " + (
            "Too few rounds for a speedup."
            if few
            else f"Speedup so far {_fmt(cmp['achieved_speedup'], '.2f', '×')} · {theory}"
        )
    elif not done and few:
        head = f"### Speedup: measuring…\nShown after {LIVE_MIN_ROUNDS} rounds: the first rounds' ratio swings widely."
    elif not done:
        head = f"### Speedup {_fmt(cmp['achieved_speedup'], '.2f', '×')} so far (live) · {theory}"
    else:
        head = f"### Speedup {_fmt(cmp['achieved_speedup'], '.2f', '×')} achieved · {theory}{stop_note(spec, ar)}"
        head += unequal_note(b, a)
    return head + "\n\n" + table


def drift_note(ratio: float | None) -> str:
    """The line that says a run disagreed with the machine's measurement (kept_costs.drift), or ""."""
    if ratio is None:
        return ""
    return (
        f"\n\nThis run's one-token passes took {ratio:.2f}× the time this machine's measurement says "
        "(it was taken at the first request, perhaps while the machine was busy): the next Generate "
        "measures again, and its prediction and choice of k follow."
    )


def unequal_note(b: dict, a: dict) -> str:
    """Where the two runs ended at different lengths (an end-of-turn token one of them reached first),
    the speedup is a ratio of rates over unequal texts: said under the headline, with both lengths."""
    if b["new_tokens"] == a["new_tokens"]:
        return ""
    return (
        f"\n\nThe runs wrote {b['new_tokens']} and {a['new_tokens']} tokens: their texts differ, so this compares "
        "tokens per second over unequal lengths, not the time to the same text."
    )


def _figures_table(b: dict, a: dict) -> str:
    """The markdown table of the speculative (b) and autoregressive (a) summaries' figures, a row each."""
    pct = lambda x: _fmt(None if x is None else 100 * x, ".1f", "%")  # noqa: E731
    rows = [
        ("tokens", b["new_tokens"], a["new_tokens"]),
        ("tokens / s", _fmt(b["tokens_per_s"], ".1f"), _fmt(a["tokens_per_s"], ".1f")),
        (
            "time to first token",
            _fmt(b["time_to_first_token_s"], ".3f", " s"),
            _fmt(a["time_to_first_token_s"], ".3f", " s"),
        ),
        ("target passes", b["target_passes"], a["target_passes"]),
        # vLLM's name for the same figure: its spec-decode metrics report it as mean acceptance length.
        ("tokens per target pass (mean acceptance length)", _fmt(b["tokens_per_pass"]), _fmt(a["tokens_per_pass"])),
        ("acceptance rate (accepted ÷ drafted)", pct(b["acceptance_rate"]), "–"),
        ("α per token (accepted ÷ (accepted + rejections))", pct(b["alpha"]), "–"),
        # Over the rounds that drafted, as the formulas take it: the plain rounds are the row below.
        (
            "mean k of the rounds that drafted"
            if not b["tree_rounds"]
            else "nodes per round that drafted (a tree's nodes, a chain's k)",
            _fmt(b["mean_k"]),
            "–",
        ),
        *([("rounds that drafted a tree", b["tree_rounds"], "–")] if b["tree_rounds"] else []),
        ("measured cost ratio c (draft token ÷ target pass)", _fmt(b["cost_ratio_c"], ".3f"), "–"),
        ("rounds that drafted nothing", b["rounds_by_kind"][TARGET], "–"),
    ]
    return "| | speculative | autoregressive |\n|---|---|---|\n" + "\n".join(
        f"| {name} | {x} | {y} |" for name, x, y in rows
    )


def _theory(b: dict) -> str:
    """What theory expects of this run: Leviathan's idealised speedup (and the one predicted for this
    machine where there are costs), or a tree's tokens per pass."""
    theory = f"{_fmt(b['theoretical_speedup'], '.2f', '×')} Leviathan's idealised"
    if b["tree_rounds"]:
        # Leviathan's formulas are a chain's: one guess per depth. A tree is judged by its tokens per pass.
        theory = (
            f"{_fmt(b['tokens_per_pass'])} tokens per target pass with trees: one pass checked every branch, "
            "so a round kept its longest branch the target agreed with, where a chain has one guess per depth"
        )
    elif b.get("predicted_speedup") is None:
        theory += " (this run's α and c, a verify pass costed as one plain step)"
    else:
        # Both from the same α, rounds and measured costs (metrics.summarize): idealised ≥ predicted.
        theory += (
            " (as predicted, but a verify pass over k + 1 tokens costed as a one-token pass)"
            f" · {_fmt(b['predicted_speedup'], '.2f', '×')} predicted for this machine "
            "(the same α over this machine's measured verify and draft times, "
            "plus this run's prefill as measured)"
        )
    return theory


def stop_note(spec: Sequence[Step], ar: Sequence[Step]) -> str:
    """' · stopped: context full' when a run ended because the model's context was full."""
    reasons = {steps[-1].stop_reason for steps in (spec, ar) if steps}
    return " · stopped: context full" if "context_full" in reasons else ""


GREEDY = "greedy"  # the check's and the decision table's rule when nothing is sampled

DECISION_HEADERS = ["draft token", "q(x)", "p(x)", "min(1, p/q)", "u", "decision"]
# Under shared noise the token at each position is argmax(p / E) for the position's keyed noise E.
SHARED_HEADERS = ["draft token", "q(x)", "p(x)", "draft == argmax p/E (both race E)", "u", "decision"]
# Under greedy nothing is random: a draft is kept exactly when it is the target's argmax, and p is
# shown as the plain softmax (greedy has no temperature).
GREEDY_HEADERS = [
    "draft token",
    "q(x) = 1: the draft's own pick",
    "p(x) at T = 1",
    "draft == argmax p",
    "u",
    "decision",
]
GREEDY_Q_NOTE = (
    "**Why q(x) = 1 under greedy:** the draft proposes its own most likely token, with nothing left to "
    "chance, so the probability it gives the token it proposed is 1. Nothing is drawn either: a draft is "
    "kept exactly when it is the target's most likely token too (draft == argmax p)."
)


def tree_order(parents: Sequence[int]) -> list[tuple[int, int]]:
    """(node, depth) of a tree's nodes depth first, each node's children in the order listed, so the
    kept path (listed first, Step.parents) comes first and every branch sits under its parent."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    out: list[tuple[int, int]] = []
    stack = [(node, 1) for node in reversed(children.get(-1, []))]
    while stack:
        node, depth = stack.pop()
        out.append((node, depth))
        stack += [(child, depth + 1) for child in reversed(children.get(node, []))]
    return out


def _indent(depth: int) -> str:
    """A tree node's label prefix: em spaces, which a table cell does not collapse, then └ below depth 1."""
    return "" if depth <= 1 else "\u2003\u2003" * (depth - 2) + "└\u2009"


def cell_text(text: str) -> str:
    return visible(text) or "(no text yet)"  # a byte of a multi-byte character has none


def decision_rows(step: Step, rule: str = REJECTION) -> list[list]:
    """One table row per judged draft: token, q(x), p(x), the rule applied, u, decision.

    The rule column (headers_for) is min(1, p/q) under the rejection rule, and yes/no under greedy
    ("draft == argmax p") and shared noise ("draft wins the race"), where nothing is drawn per draft.
    A tree round lists every node depth first, indented under its parent, the kept path first.
    """
    rule = (
        (lambda d: "yes" if d.accept_prob >= 1 else "no") if rule != REJECTION else (lambda d: round(d.accept_prob, 4))
    )

    def row(label: str, d) -> list:
        return [label, round(d.q, 4), round(d.p, 4), rule(d), "–" if d.u is None else round(d.u, 4)]

    if step.is_tree:
        by_node = {d.node: d for d in step.decisions}
        rows = []
        for node, depth in tree_order(step.parents):
            label = _indent(depth) + cell_text(step.draft_text[node])
            d = by_node.get(node)
            if d is None:
                rows.append([label, "–", "–", "–", "–", "not judged (its parent or a sibling before it decided)"])
            else:
                rows.append(row(label, d) + ["accept · kept path" if d.accepted else "reject"])
    else:
        rows = [row(cell_text(d.text), d) + ["accept" if d.accepted else "reject"] for d in step.decisions]
        rows += [
            [cell_text(step.draft_text[i]), "–", "–", "–", "–", "never judged (after a rejection)"]
            for i in range(len(step.decisions), len(step.drafted))
        ]
    why = {
        CORRECTED: "drawn where the first draft was rejected",
        BONUS: "drawn after every draft was kept",
        TARGET: "nothing was drafted this round",
    }.get(step.token_kind, "")
    rows.append([cell_text(step.token_text), "–", "–", "–", "–", f"{step.token_kind}: the target's own token ({why})"])
    return rows


def headers_for(rule: str) -> list[str]:
    """The decision table's headers for GREEDY or a sampling rule."""
    return {GREEDY: GREEDY_HEADERS, SHARED_NOISE: SHARED_HEADERS}.get(rule, DECISION_HEADERS)


def race_markdown(step: Step) -> str:
    """The shared-noise rule's two races where the target chose this round, as a table: the target's
    pick is its argmax p/E, the draft's its argmax q/E over the same noise E, and they agree or not."""
    if not step.race:
        return ""
    target_pick = max(step.race, key=lambda r: r[4])[0]
    draft_pick = max(step.race, key=lambda r: r[5])[0] if any(r[5] > 0 for r in step.race) else None
    rows = [
        f"| {code(text, in_table=True)} | {p:.4f} | {q:.4f} | {ps:.3f} | {qs:.3f} | "
        + " ".join(m for m, hit in (("target's pick", i == target_pick), ("draft's pick", i == draft_pick)) if hit)
        + " |"
        for i, text, p, q, ps, qs in step.race
    ]
    if draft_pick is None:
        verdict = "Every draft was kept, so only the target raced here: its pick is the bonus token."
    elif draft_pick == target_pick:
        verdict = "Both races have the same winner."
    else:
        verdict = "The races have different winners: the draft's token is rejected and the target's is emitted."
    return (
        "\n\n**Shared noise where the target chose.** Each token's noise E is fixed by the seed and the "
        "position; the target picks the largest p/E, the draft the largest q/E. "
        + verdict
        + "\n\n| token | p | q | p/E | q/E | |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows)
    )


def category_table(summary: dict, drafts: Sequence[str]) -> str:
    """The per-category figures (category_runner.summarize) as a Markdown table, a row per category and draft."""
    lines = [
        "| kind of text | draft | questions | tokens per target pass | α | speedup (range) | same text |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for category, entry in summary.items():
        for d in drafts:
            v = entry[d]
            sp = v["speedup"]
            name = f"**{category}**" if category == "overall" else category
            draft = html.escape(d).replace("|", "\\|")
            lines.append(
                f"| {name} | {draft} | {entry['questions']} | {_fmt(v['tokens_per_pass'])} | "
                f"{_fmt(v['alpha'])} | {sp['median']:.2f}× ({sp['min']:.2f}–{sp['max']:.2f}) | "
                f"{100 * v['identical']:.0f}% |"
            )
    parted = any(entry[d]["identical"] < 1 for entry in summary.values() for d in drafts)
    return "\n".join(lines) + (f"\n\n{SAME_TEXT_NOTE}" if parted else "")


# Why "same text" can be under 100% (the table's rows come from runs the greedy check does not judge).
SAME_TEXT_NOTE = (
    "**Same text under 100%:** under greedy decoding in fp32 or bf16 a verify pass rounds a row's "
    "logits a little differently from a one-token pass, so where the target's two best tokens are "
    "almost tied the two runs can tip different ways; Generate's check line explains each such "
    "branch. Precision › int8 gives a row the same logits at every width, and the same text. Under "
    "sampling with the rejection rule the texts differ by design."
)
