"""Step one round: the teaching view's handler."""

from __future__ import annotations

import gradio as gr

from app import request
from app.core.config import UserError
from app.core.events import KIND_LABELS, TARGET
from app.serve import heap, sessions
from app.serve.form import Form, takes_form
from app.serve.handlers import LOADING, MEASURING, as_user_error, guarded, measuring, prepared
from app.serve.texts import EXAMPLES, example_row  # noqa: F401 - the API's examples
from app.serve.zerogpu import gpu
from app.views import plots, render


@gpu
@guarded
@takes_form(before=("session",), after=(("control", None), ("progress", gr.Progress())))
def step_round(session, form: Form, control=None, progress=gr.Progress()):
    """Teaching mode: run exactly one more speculative round of a stepping session."""
    if not form.seed_given and session is not None and not session.done:
        # An API caller's blank seed continues the run it is stepping through (whose seed was filled
        # on round 1) instead of drawing a fresh one, which would restart it every round.
        _prompt, _target, _draft, _chat, previous, *_ = session.key
        form = form.with_seed(previous.seed)
    s, sp, r = form.settings.sampling, form.settings.spec, form.settings.run
    try:
        # The filled seed, not the box: a session resumes only the very run it showed (sessions.py).
        key = (form.prompt, form.target, form.draft, r.chat, s, sp, r)
        progress(0.0, desc=LOADING)
        # Step's last handler: the click's check prepared it
        ready = prepared(form, control, last=True, progress=progress)
        pair, ids = ready.pair, ready.ids
        progress(0.0, desc=MEASURING)
        run = request.start(pair, ids, form.settings, report=measuring(progress))  # the policy Generate's runs have
        session, steps, step = sessions.advance(session, key, lambda policy: run.steps(policy, teach=True), run.policy)
    except UserError as e:
        raise as_user_error(e) from None
    finally:
        heap.release()  # what the round allocated and freed goes back to the OS
    if step is None:
        return session, gr.skip(), gr.skip(), "Generation finished: press Step to start again.", gr.skip()
    return (session, *_shown(pair, ids, steps, step, s))


def _shown(pair, ids, steps, step, s) -> tuple:
    """The step pane, the decision table, the round's note and the plot of one stepped round."""
    session_prompt = pair.tokenizer.decode(ids, skip_special_tokens=True)
    note = _round_note(step) + _no_draft_note(pair, step) + _feature_note(pair, ids, steps, step)
    note += render.race_markdown(step)
    rule = render.GREEDY if s.greedy else s.rule
    return (
        render.pane_html(session_prompt, steps),
        {"headers": render.headers_for(rule), "data": render.decision_rows(step, rule)},
        note,
        plots.decision_figure(step, s.greedy, s.shared_noise),
    )


def _round_note(step) -> str:
    return (
        f"**Round {step.round}** · k = {step.k} · drafted {len(step.drafted)} · accepted {step.accepted} · "
        f"the target's token: {render.code(step.token_text)} "
        + ("(no drafts this round)" if step.token_kind == TARGET else f"(**{KIND_LABELS[step.token_kind]}**)")
        + (f" · stopped: {step.stop_reason.replace('_', ' ')}" if step.stop_reason else "")
    )


def _no_draft_note(pair, step) -> str:
    """Why a round drafted nothing: a round with no drafts is a plain step, and it is worth saying why."""
    if step.drafted:
        return ""
    if step.k == 0:
        why = (
            "k = 0, a plain step: adaptive k takes one where its cost model predicts that any draft would "
            "lose on this machine (it probes again after a few), and no round drafts past the last token "
            "or the draft's context window."
        )
    else:
        why = pair.draft.idle_note(step)
    return "\n\n" + why if why else ""


def _feature_note(pair, ids, steps, step) -> str:
    """For a feature draft: which of the target's features the head read to start this round."""
    if step.feature_position is None:
        return ""
    committed = ids + [t for s in steps[:-1] for t in s.emitted]
    pos = step.feature_position
    read = render.code(pair.tokenizer.decode(committed[pos : pos + 1]))
    newest = render.code(pair.tokenizer.decode(committed[pos + 1 : pos + 2]))
    return (
        f"\n\nThe head read the target's last-layer feature at position {pos} (its state after {read}) "
        f"together with the embedding of the newest token {newest}, then drafted on its own predicted features."
    )
