"""The teaching view's handlers: Step one round, Step back, Auto-play and Reset."""

from __future__ import annotations

import functools

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

PLAY, PAUSE = "Auto-play", "Pause auto-play"  # the Auto-play button's two labels
AUTOPLAY_S = 1.5  # seconds between auto-played rounds: time to read a round before the next
INTRO = "Press **Step one round** to draft, verify and decide one round."


@gpu
@guarded
@takes_form(before=("session",), after=(("control", None), ("progress", gr.Progress())))
def step_round(session, form: Form, control=None, progress=gr.Progress()):
    """Teaching mode: show the next round of a stepping session, run now unless it is on record."""
    return _step(session, form, control, progress)


@gpu
@guarded
@takes_form(before=("session",), after=(("control", None), ("progress", gr.Progress())))
def play_round(session, form: Form, control=None, progress=gr.Progress()):
    """Auto-play's tick: one more round, as Step; the timer stops at the end, on Stop or on the
    generation's last round. Its last two outputs are the timer and the Auto-play button."""
    if isinstance(control, dict) and control.get("stop"):
        return session, gr.skip(), gr.skip(), gr.skip(), gr.skip(), *paused()
    shown = _step(session, form, control, progress)
    return (*shown, *(paused() if shown[0].ended else (gr.skip(), gr.skip())))


def paused() -> tuple:
    """The timer off and the Auto-play button back to its first label."""
    return gr.Timer(active=False), gr.Button(PLAY)


def toggle_play(label: str) -> tuple:
    """The Auto-play button: start the timer (its label becomes Pause), or pause it."""
    return paused() if label == PAUSE else (gr.Timer(AUTOPLAY_S, active=True), gr.Button(PAUSE))


@guarded
@takes_form(before=("session",), after=(("control", None),))
def step_back(session, form: Form, control=None):
    """Teaching mode: the round before the one on screen again, from the session's records (nothing is
    recomputed). Round 1, a finished or changed request, or a round past sessions.KEEP_BACK stays put."""
    form = _continued(session, form)
    if session is None or session.key != _key(form) or not session.shown:
        return session, gr.skip(), gr.skip(), "Nothing to step back to: press **Step one round** first.", gr.skip()
    try:
        ready = prepared(form, control, last=True)
    except UserError as e:
        raise as_user_error(e) from None
    moved = sessions.back(session)
    if moved is not None:
        return _view(ready.pair, ready.ids, *moved, form.settings.sampling)
    # The round on screen stays, saying why.
    last = f"Step back reaches only the last {sessions.KEEP_BACK} rounds computed."
    why = "Round 1 is the first round." if session.shown == 1 else last
    session, pane, table, note, figure = _view(ready.pair, ready.ids, *sessions.at(session), form.settings.sampling)
    return session, pane, table, f"{why} {note}", figure


def reset(session) -> tuple:
    """Reset: the stepping session ends, the view clears, and the next Step starts again at round 1."""
    sessions.forget(session)  # its live run goes now, not at the state's expiry
    return None, render.STEP_PLACEHOLDER, None, INTRO, None, *paused()


def _continued(session, form: Form) -> Form:
    """An API caller's blank seed continues the run it is stepping through (whose seed was filled on
    round 1) instead of drawing a fresh one, which would restart it every round."""
    if not form.seed_given and session is not None and not session.ended:
        _prompt, _target, _draft, _chat, previous, *_ = session.key
        form = form.with_seed(previous.seed)
    return form


def _key(form: Form) -> tuple:
    """The filled seed, not the box: a session resumes only the very run it showed (sessions.py)."""
    s, sp, r = form.settings.sampling, form.settings.spec, form.settings.run
    return (form.prompt, form.target, form.draft, r.chat, s, sp, r)


def _step(session, form: Form, control, progress) -> tuple:
    """Step's work: the next kept round, or one round run now; the engine starts only for the latter."""
    form = _continued(session, form)
    try:
        progress(0.0, desc=LOADING)
        # Step's last handler: the click's check prepared it
        ready = prepared(form, control, last=True, progress=progress)
        pair, ids = ready.pair, ready.ids

        @functools.cache
        def run():  # started only when a round is computed; the policy is the one Generate's runs have
            progress(0.0, desc=MEASURING)
            return request.start(pair, ids, form.settings, report=measuring(progress))

        session, steps, step = sessions.advance(
            session, _key(form), lambda policy: run().steps(policy, teach=True, paused=True), lambda: run().policy()
        )
    except UserError as e:
        raise as_user_error(e) from None
    finally:
        heap.release()  # what the round allocated and freed goes back to the OS
    if step is None:
        return session, gr.skip(), gr.skip(), "Generation finished: press Step to start again.", gr.skip()
    return _view(pair, ids, session, steps, step, form.settings.sampling)


def _view(pair, ids, session, steps, step, s) -> tuple:
    """The session and what the view shows of its round on screen."""
    pane, table, note, figure = _shown(pair, ids, steps, step, s)
    if session.shown < session.rounds:
        note += f"\n\nRounds 1–{session.rounds} are on record: Step shows round {session.shown + 1} again."
    return session, pane, table, note, figure


def _shown(pair, ids, steps, step, s) -> tuple:
    """The step pane, the decision table, the round's note and the plot of one stepped round."""
    session_prompt = pair.tokenizer.decode(ids, skip_special_tokens=True)
    note = _round_note(step) + _no_draft_note(pair, step) + _feature_note(pair, ids, steps, step)
    note += render.race_markdown(step)
    note += "\n\n" + render.GREEDY_Q_NOTE if s.greedy and step.decisions else ""
    rule = render.GREEDY if s.greedy else s.rule
    return (
        render.pane_html(session_prompt, steps, drawn_round=step.round),
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
        f"\n\nThe head read the target's own summary of the text up to {read}: the vector of numbers its last "
        f"layer computed there, from which the target picks its next token (the last-layer feature at position "
        f"{pos}). With the newest token {newest} it guessed the next token, then drafted on from its own guesses "
        "of the next such summaries."
    )
