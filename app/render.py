"""Records to display: highlighted HTML spans, the summary table, the decision table.

Pure functions (no gradio, no torch), so tests check them without a browser.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from app import metrics
from app.events import ACCEPTED, BONUS, CORRECTED, REJECTED, TARGET, Step

LEGEND = (
    '<div class="legend"><span class="tok acc">accepted draft</span> '
    '<span class="tok cor">corrected by the target</span> '
    '<span class="tok bon">bonus (all drafts kept)</span> '
    '<span class="tok rej">rejected draft</span> '
    '<span class="round r1">&nbsp;shading alternates by round&nbsp;</span></div>'
)
CLASS = {ACCEPTED: "acc", CORRECTED: "cor", BONUS: "bon", REJECTED: "rej", TARGET: "tgt"}


def pane_html(prompt: str, steps: Sequence[Step], kind_classes: bool = True) -> str:
    """The prompt, then every round as a shaded group of coloured token spans.

    kind_classes=False gives plain text, for the autoregressive pane.
    """
    parts = [f'<div class="pane"><span class="prompt">{html.escape(prompt)}</span>']
    if not kind_classes:
        return parts[0] + html.escape("".join(s.text for s in steps)) + "</div>"
    for s in steps:
        tokens = "".join(
            f'<span class="tok {CLASS[kind]}" data-kind="{kind}">{html.escape(piece)}</span>'
            for piece, kind in s.spans()
        )
        title = f"round {s.round}: k={s.k}, kept {s.accepted} of {len(s.drafted)}" if s.drafted else ""
        parts.append(f'<span class="round r{s.round % 2}" title="{title}">{tokens}</span>')
    parts.append("</div>")
    return "".join(parts)


def kind_counts(steps: Sequence[Step]) -> dict[str, int]:
    """How many tokens of each kind a pane shows."""
    counts: dict[str, int] = {}
    for s in steps:
        for _, kind in s.spans():
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def summary_markdown(spec: Sequence[Step], ar: Sequence[Step]) -> str:
    """Both panes' figures side by side, with measured and theoretical speedup."""
    a, b = metrics.summarize(ar), metrics.summarize(spec)
    cmp = metrics.compare(b, a) if spec and ar else {"achieved_speedup": None}
    pct = lambda x: _fmt(None if x is None else 100 * x, ".1f", "%")  # noqa: E731
    rows = [
        ("tokens", b["new_tokens"], a["new_tokens"]),
        ("tokens / s", _fmt(b["tokens_per_s"], ".1f"), _fmt(a["tokens_per_s"], ".1f")),
        ("time to first token", _fmt(b["time_to_first_token_s"], ".3f", " s"),
         _fmt(a["time_to_first_token_s"], ".3f", " s")),
        ("target passes", b["target_passes"], a["target_passes"]),
        ("tokens per target pass", _fmt(b["tokens_per_pass"]), _fmt(a["tokens_per_pass"])),
        ("acceptance rate (accepted ÷ drafted)", pct(b["acceptance_rate"]), "–"),
        ("α per token (accepted ÷ (accepted + rejections))", pct(b["alpha"]), "–"),
        ("mean k", _fmt(b["mean_k"]), "–"),
        ("measured cost ratio c (draft token ÷ target pass)", _fmt(b["cost_ratio_c"], ".3f"), "–"),
    ]
    table = "| | speculative | autoregressive |\n|---|---|---|\n" + "\n".join(
        f"| {name} | {x} | {y} |" for name, x, y in rows
    )
    head = (f"### Speedup {_fmt(cmp['achieved_speedup'], '.2f', '×')} achieved · "
            f"{_fmt(b['theoretical_speedup'], '.2f', '×')} theoretical "
            f"(Leviathan et al. for the measured α, c and mean k)")
    return head + "\n\n" + table


def greedy_check(spec: Sequence[Step], ar: Sequence[Step], greedy: bool, done: bool = True) -> str:
    """Under greedy decoding both panes must be identical, token for token."""
    if not greedy:
        return ("Sampling: the two panes use different random draws, so their texts differ; "
                "each has exactly the target's distribution.")
    a = [t for s in ar for t in s.emitted]
    b = [t for s in spec for t in s.emitted]
    n = min(len(a), len(b))
    if a[:n] != b[:n]:
        first = next(i for i in range(n) if a[i] != b[i])
        return f"❌ Greedy check failed: the outputs differ at token {first}."
    if not done:
        return f"⏳ Greedy check: identical so far ({n} tokens)."
    if len(a) != len(b):
        return f"❌ Greedy check failed: {len(b)} speculative tokens against {len(a)} autoregressive."
    return f"✅ Greedy check passed: the two outputs are identical, token for token ({n} tokens)."


def decision_rows(step: Step) -> list[list]:
    """One table row per judged draft: token, q(x), p(x), min(1, p/q), u, decision."""
    rows = [[repr(d.text), round(d.q, 4), round(d.p, 4), round(d.accept_prob, 4),
             "–" if d.u is None else round(d.u, 4), "accept" if d.accepted else "reject"]
            for d in step.decisions]
    rows += [[repr(step.draft_text[i]), "–", "–", "–", "–", "never judged (after a rejection)"]
             for i in range(len(step.decisions), len(step.drafted))]
    rows.append([repr(step.token_text), "–", "–", "–", "–",
                 f"{step.token_kind}: the target's own token"])
    return rows
