"""Generate: both runs streamed side by side, and Stop."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import gradio as gr
import torch

from app import kept_costs, models, request
from app.core import divergence, metrics
from app.core.config import UserError
from app.models import threads
from app.serve import heap, queue_limits
from app.serve.form import Form, fill_seed, takes_form
from app.serve.handlers import LOADING, MEASURING, as_user_error, guarded, measuring, new_click, prepared
from app.serve.texts import EXAMPLES, example_row  # noqa: F401 - the API's examples
from app.serve.zerogpu import gpu
from app.views import check as check_line
from app.views import plots, render

log = logging.getLogger(__name__)
UPDATE_EVERY = 0.25  # seconds between streamed text updates; rendering shares the CPU
PLOT_EVERY = 1.5  # seconds between plot updates: figures are heavier than text


def _interleave(spec_it: Iterator, ar_it: Iterator) -> Iterator[tuple[str, object]]:
    """Advance whichever run is behind on its own clock; yield ("spec"|"ar", step)."""
    clocks, its = {"spec": 0.0, "ar": 0.0}, {"spec": spec_it, "ar": ar_it}
    while its:
        side = min(its, key=clocks.get)
        step = next(its[side], None)
        if step is None:
            del its[side]
            continue
        clocks[side] = step.elapsed
        yield side, step


def _figures(spec, ar):
    return (
        plots.tokens_vs_time(spec, ar),
        plots.k_per_round(spec),
        plots.acceptance_per_round(spec),
        plots.acceptance_by_position(spec),
        plots.tokens_per_round(spec),
    )


@gpu
@guarded
@takes_form(after=(("control", None), ("progress", gr.Progress())))
def generate_both(form: Form, control=None, progress=gr.Progress()):
    """Stream both panes; the last update carries the full records of both runs.

    `control` is this session's {"stop": bool}: Stop sets it and the run ends after the current
    round with a final, partial update (cancelling the event instead would flag every output "Error").
    """
    try:
        yield from _stream(form, control, progress)
    except UserError as e:
        raise as_user_error(e) from None
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise as_user_error(
            UserError("out of memory: try a smaller model, fewer new tokens or a shorter prompt")
        ) from None
    finally:
        heap.release()  # a finished, failed or cancelled run leaves its freed memory to the OS


def _stream(form: Form, control, progress=None) -> Iterator[tuple]:
    """Both runs, interleaved, as screen updates; the last carries the full records."""
    target, draft, settings, dtype = form.target, form.draft, form.settings, form.dtype
    s = settings.sampling
    # A gr.Progress tracker is falsy (it has a length), so only None means "no tracker".
    progress = progress if progress is not None else (lambda *a, **k: None)
    # A first request loads the pair and measures this machine, which takes a while: each says so.
    progress(0.0, desc=LOADING)
    ready = prepared(form, control, progress=progress)
    pair, ids = ready.pair, ready.ids
    shown = pair.tokenizer.decode(ids, skip_special_tokens=True)
    progress(0.0, desc=MEASURING)
    speculative = request.start(pair, ids, settings, report=measuring(progress))  # once per pair and sampling kind
    precision = _precision(pair, dtype, s, getattr(speculative.target_cache, "width", None))
    costs = speculative.costs
    streams = _interleave(speculative.steps(), request.start(pair, ids, settings, speculative=False).steps())
    spec, ar = [], []
    last_text = last_plot = 0.0
    figures = _figures(spec, ar)
    stopped = False
    stop = queue_limits.stopper(control)  # a run past the run limit ends as if stopped
    for side, step in streams:
        (spec if side == "spec" else ar).append(step)
        if stop():
            stopped = True
            break
        now = time.monotonic()
        if now - last_text >= UPDATE_EVERY:
            if now - last_plot >= PLOT_EVERY:
                figures, last_plot = _figures(spec, ar), now
            last_text = now
            yield _outputs(shown, spec, ar, _rule(s), figures, None, done=False, costs=costs, precision=precision)
    # Models named as the visitor picked them: a resolved name can be an install path on this host.
    doc = {
        "speculative": metrics.report(spec, target, draft, settings.as_dict("speculative"), costs),
        "autoregressive": metrics.report(ar, target, None, settings.as_dict("autoregressive")),
    }
    doc["comparison"] = metrics.compare(doc["speculative"]["stats"], doc["autoregressive"]["stats"])
    doc["stopped"] = stopped  # True: Stop ended both runs early, so every figure is partial
    if costs is not None:
        doc["calibration"] = kept_costs.provenance(costs)
    if costs is not None and not stopped:
        doc["machine_drift"] = kept_costs.drift(costs, ar)  # not None: the next request measures again
    doc["threads"] = threads.key()  # "auto" or the fixed count (docs/threads.md)
    used = models.precision_of(pair.target)
    doc["dtype"] = dict(asked=dtype, used=used if used == "int8" else str(pair.target.dtype).removeprefix("torch."))
    must_match = s.greedy or s.shared_noise  # a seed fixes the text under shared noise
    verdict = None if stopped or not must_match else _verdict(pair, ids, spec, ar, costs, speculative.target_cache, s)
    if verdict is not None:
        doc["divergence"] = verdict.to_dict()
    yield _outputs(
        shown,
        spec,
        ar,
        _rule(s),
        _figures(spec, ar),
        doc,
        stopped=stopped,
        costs=costs,
        verdict=verdict,
        precision=precision,
        decode=lambda token: pair.tokenizer.decode([token]),
    )


def _verdict(pair, ids, spec, ar, costs, target_cache, s):
    """Why outputs that must match differ, when they do (core/divergence.py); None when identical."""
    plain = [t for x in ar for t in x.emitted]
    if plain == [t for x in spec for t in x.emitted]:
        return None
    noise = costs.logit_noise if costs is not None else 0.0
    return divergence.explain_run(pair.target, target_cache, ids, spec, plain, noise, s)


def _precision(pair, asked: str, s, width: int | None = None) -> str:
    """The precision line under the summary: the dtype in use, and why, for this run's decoding.
    `width`: the one pass width of a fast-path run whose rows the probe found exact (runs.py)."""
    used = models.precision_of(pair.target)
    why = " (auto: the fastest precision exact at every width here)" if asked == "auto" else ""
    if width is not None:  # the GPU's exact choice, in any precision
        why, rows = (
            "",
            (
                f": every round's pass is {width} tokens wide here and a row's logits are the same bits wherever it "
                "sits in one (probed)"
            ),
        )
    elif used == "int8":
        rows = ": a row's logits are the same bits at every verify width"
    elif used == "fp32":
        return (
            f"Target in **fp32** on {pair.target.device}{why}; its rows can differ in the last bits between widths, "
            "far below any but an exact tie."
        )
    else:
        return (
            f"Target in **{used}** on {pair.target.device}{why}; a verify pass can round a near-tie the other way: "
            "int8 (Models › Precision) is exact at every width."
        )
    if s.greedy:
        then = ", so greedy output is plain decoding's exactly"
    elif s.shared_noise:
        then = ", so with shared noise the text is plain decoding's for the same seed exactly"
    else:
        then = (
            ", so each sampled token has plain decoding's distribution exactly (the texts differ: the two runs draw "
            "differently)"
        )
    return f"Target in **{used}** on {pair.target.device}{why}{rows}{then}."


def _rule(s) -> str:
    """What decides whether both panes must match: greedy decoding, else the sampling rule."""
    return render.GREEDY if s.greedy else s.rule


def _outputs(
    prompt, spec, ar, rule, figures, doc, done=True, stopped=False, costs=None, verdict=None, precision="", decode=None
):
    summary = render.summary_markdown(spec, ar, done and not stopped, stopped, costs)
    summary += render.drift_note(doc.get("machine_drift") if doc else None)
    shown = verdict is not None and decode is not None and not stopped
    below = check_line.branch_point(verdict, decode) if shown else ""
    check = check_line.identity_check(spec, ar, rule, done and not stopped, stopped, verdict, below)
    return (
        render.pane_html(prompt, spec),
        render.pane_html(prompt, ar, kind_classes=False),
        check,
        f"{summary}\n\n{precision}" if precision else summary,
        *figures,
        doc if doc is not None else gr.skip(),
    )


@guarded
def start_run(seed, decoding, control) -> int:
    """A click on Generate or Step: clear an earlier Stop, fill a blank seed (shown back)."""
    control["stop"] = False
    new_click(control)
    return fill_seed(seed, decoding)


def request_stop(control) -> None:
    """Stop: the running generation sees this after its current round and ends with a partial update."""
    control["stop"] = True
