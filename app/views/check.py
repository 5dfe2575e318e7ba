"""The check line under the panes: whether speculative and plain decoding gave the same tokens, and
where they part, a verdict that says in one sentence whether that is rounding (a near-tie within the
precision's noise) or a bug, with the branch point's scores one click below. Pure functions."""

from __future__ import annotations

import html
from collections.abc import Sequence

from app.core.config import SHARED_NOISE
from app.core.divergence import IDENTICAL, NEAR_TIE, Divergence
from app.core.events import Step
from app.views.render import GREEDY, cell_text, status_mark, stop_note


def _tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def identity_check(
    spec: Sequence[Step],
    ar: Sequence[Step],
    rule: str,
    done: bool = True,
    stopped: bool = False,
    divergence: Divergence | None = None,
    below: str = "",
) -> str:
    """Whether both panes hold the same tokens, where they must: under greedy decoding, and under the
    shared-noise rule, where a seed fixes the text (rule: GREEDY, or the sampling rule of the run).
    divergence: the verdict on greedy outputs that differ (core/divergence.py), which says whether
    it is rounding or a bug."""
    a = [t for s in ar for t in s.emitted]
    b = [t for s in spec for t in s.emitted]
    if rule not in (GREEDY, SHARED_NOISE):
        text = (
            "Sampling with the rejection rule: the drafts' tests read the seed's draws too, so the two "
            "panes' texts differ, and each has exactly the target's distribution. The shared-noise rule "
            "gives the same text on both sides."
        )
        if stopped:
            stop = status_mark("stop", "Stopped")
            return f"{stop} after {len(b)} speculative and {len(a)} autoregressive tokens. {text}"
        return text + (stop_note(spec, ar) if done else "")
    name = "Greedy check" if rule == GREEDY else "Same-seed check (shared noise)"
    n = min(len(a), len(b))
    if divergence is not None and divergence.kind != IDENTICAL:
        return divergence_line(name, divergence, below)
    if a[:n] != b[:n]:
        first = next(i for i in range(n) if a[i] != b[i])
        # no verdict before both runs have ended: a branch may be a near-tie within the precision's rounding
        if stopped:
            return (
                f"{status_mark('stop', 'Stopped')} after {_tokens(n)}: the outputs were identical up to token "
                f"{first}; a stopped run gets no verdict on where they part."
            )
        if not done:
            return (
                f"{status_mark('run', name + ' checking')}: identical up to token {first}, where the two runs part; "
                "the verdict comes once both have ended."
            )
        return f"{status_mark('fail', name + ' failed')}: the outputs differ at token {first}."
    if stopped:
        return (
            f"{status_mark('stop', 'Stopped')} after {_tokens(n)}: the outputs were identical up to there "
            f"(speculative {len(b)}, autoregressive {len(a)})."
        )
    if not done:
        return f"{status_mark('run', name + ' running')}: identical so far ({n} tokens)."
    if len(a) != len(b):
        return f"{status_mark('fail', name + ' failed')}: {len(b)} speculative tokens against {len(a)} autoregressive."
    return (
        f"{status_mark('ok', name + ' passed')}: the two outputs are identical, token for token "
        f"({n} tokens){stop_note(spec, ar)}."
    )


def branch_point(d: Divergence, decode) -> str:
    """The branch point under the check line: the target's leading scores there as a one-token pass
    (plain decoding's) and as the verify-width pass computed them, the two candidates marked, and their
    margin against the measured rounding. `decode(token_id)` gives a token's text."""
    if d.kind == IDENTICAL or not d.plain_row:
        return ""
    wide = dict(d.verify_row)
    score = "race score log p − log E" if d.score == "race" else "logit"
    rows = [f"| token | {score}, one-token pass | {score}, verify-width pass | |", "|---|---:|---:|---|"]
    for token, value in d.plain_row:
        who = "plain decoding's" if token == d.plain_token else "speculative's" if token == d.spec_token else ""
        other = wide.get(token)
        shown = "–" if other is None else f"{other:.3f}"
        text = html.escape(cell_text(decode(token))).replace("|", "&#124;")
        rows.append(f"| {text} | {value:.3f} | {shown} | {who} |")
    return (
        f"**Branch point, token {d.position}**: top two {abs(d.margin):.3g} apart in the one-token pass; "
        f"{d.dtype} rounding between pass widths here reaches {d.noise:.3g}.\n\n" + "\n".join(rows)
    )


def divergence_line(name: str, d: Divergence, below: str = "") -> str:
    """The check's line for outputs that must match and differ: a near-tie within rounding, or a bug.
    Under shared noise the scores are the race's, log p − log E."""
    where = f"the outputs differ from token {d.position}"
    race = d.score == "race"
    if d.kind == NEAR_TIE:
        scores = "race scores log p − log E of the top two" if race else "top two"
        choice = "the race's winner" if race else "the target's greedy choice"
        best = "its race's winner" if race else "the target's argmax"
        tied = "two best race scores" if race else "two best tokens"
        # one plain sentence first, for a class; the figures one click below
        lead = (
            f"Identical up to token {d.position}. There the target's {tied} were almost tied "
            f"({abs(d.margin):.2g} apart), closer than {d.dtype} rounding reaches ({d.noise:.2g}), so the "
            f"two runs tipped different ways. Both are {choice}. Pick Precision › int8, whose passes "
            "give a row the same logits at every width, for runs that never part."
        )
        detail = (
            f"{where}: a near-tie ({scores} {abs(d.margin):.3g} apart; {d.dtype} rounding here reaches "
            f"{d.noise:.3g}), both continuations are {choice} within rounding. Every speculative token is "
            f"{best} within that noise."
        )
        return (
            f"{status_mark('ok', name + ': rounding')}: {lead}"
            f"<details><summary>The figures</summary>\n\n{detail}\n\n{below}\n\n</details>"
        )
    if d.plain_token is None or d.spec_token is None:
        detail = "one output ends where the other goes on"
    elif abs(d.margin) > d.noise:
        detail = (
            f"the target's {'race scores' if d.score == 'race' else 'logits'} of the two tokens are "
            f"{abs(d.margin):.3g} apart, above the {d.noise:.3g} rounding reaches"
        )
    else:
        best = "its race's winner" if d.score == "race" else "the target's argmax"
        detail = (
            f"token {d.worst_at} of the speculative output is {d.worst_shortfall:.3g} below {best}, "
            f"above the {d.noise:.3g} rounding reaches"
        )
    line = f"{status_mark('fail', name + ' failed')}: {where}, and {detail} ({d.dtype}): a bug, not rounding."
    return line + (f"\n\n{below}" if below else "")
