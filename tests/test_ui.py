"""The app: Blocks build, records become the right spans and figures, and a real server
answers gradio_client and a real browser with the bundled models."""

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run

from app import plots, render
from app.events import ACCEPTED, BONUS, CORRECTED, REJECTED
from app.proposers import ModelProposer

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def add(a, b):\n  return a"


@pytest.fixture(scope="module")
def records(target, near_draft, tokenizer):
    _, spec = run(target, tokenizer, PROMPT, ModelProposer(near_draft, "near"), k=4, k_policy="fixed",
                  max_new_tokens=40)
    _, ar = run(target, tokenizer, PROMPT, max_new_tokens=40)
    return spec, ar


def test_blocks_build_without_launching():
    import gradio as gr

    from app.ui import build_ui

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
    # Accepted + corrected + bonus spans are exactly the output; rejected ones are extra.
    kept = sum(counts.get(k, 0) for k in (ACCEPTED, CORRECTED, BONUS))
    assert kept == sum(len(s.emitted) for s in spec)
    step = next(s for s in spec if s.accepted < len(s.drafted))
    kinds = [kind for _, kind in step.spans()]
    assert kinds == [ACCEPTED] * step.accepted + [REJECTED] * len(step.rejected) + [CORRECTED]
    assert html.count('class="round r') == len(spec)


def test_summary_and_greedy_check(records):
    spec, ar = records
    text = render.summary_markdown(spec, ar)
    assert "Speedup" in text and "theoretical" in text and "α per token" in text
    assert render.greedy_check(spec, ar, greedy=True).startswith("✅")
    assert render.greedy_check(spec, ar[:-1], greedy=True, done=False).startswith("⏳")
    assert render.greedy_check(spec, ar[:-1], greedy=True).startswith("❌")
    other = [dataclasses.replace(s, emitted=[t + 1 for t in s.emitted]) for s in ar]
    assert "differ at token 0" in render.greedy_check(spec, other, greedy=True)


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
    assert sorted(plots.tokens_per_round(spec).data[0].x) == sorted(len(s.emitted) for s in spec)
    corrected = next(s for s in spec if s.token_kind == CORRECTED)
    fig = plots.decision_figure(corrected)
    assert list(fig.data[2].y) == [t[4] for t in corrected.top]
    top_ids = [t[0] for t in corrected.top]
    assert corrected.token in top_ids, "the token drawn must be in the plotted residual"
    assert corrected.top[top_ids.index(corrected.token)][4] > 0
    rows = render.decision_rows(corrected)
    assert rows[-1][-1].startswith("corrected") and rows[corrected.accepted][-1] == "reject"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """python app.py on localhost with the bundled models, as a user starts it."""
    port = _free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(proc.stdout.read())
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_gradio_client_greedy_generation(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    presets = client.predict(api_name="/presets")
    assert "stdlib-code target (bundled)" in presets["targets"]
    out = client.predict(PROMPT.replace("  ", "    "), "stdlib-code target (bundled)", "",
                         "distilled draft (bundled)", "", False, "greedy", 0.8, 0, 1.0, 0, 64, "adaptive", 4,
                         api_name="/generate")
    spec_html, ar_html, check, summary, *figs, doc = out
    spec, ar = doc["speculative"], doc["autoregressive"]
    assert spec["text"] == ar["text"] and spec["token_ids"] == ar["token_ids"] and len(spec["token_ids"]) > 0
    assert check.startswith("✅")
    kinds = {s["token_kind"] for s in spec["steps"]}
    assert "accepted" in spec_html and kinds <= {"corrected", "bonus"} and kinds
    assert spec["stats"]["accepted"] > 0 and 'class="tok acc"' in spec_html
    assert "Speedup" in summary
    for fig in figs:
        assert '"x"' in str(fig) and '"y"' in str(fig), "each figure carries data"
    status = client.predict("stdlib-code target (bundled)", "", "weak draft (bundled)", "", api_name="/load_pair")
    assert "Loaded target" in status
    with pytest.raises(Exception, match="could not load"):
        client.predict("stdlib-code target (bundled)", "/no/such/model", "distilled draft (bundled)", "",
                       api_name="/load_pair")
    again = client.predict(PROMPT, "stdlib-code target (bundled)", "", "prompt lookup (n-grams)", "", False,
                           "greedy", 0.8, 0, 1.0, 0, 16, "fixed", 3, api_name="/generate")
    assert again[-1]["speculative"]["token_ids"] == again[-1]["autoregressive"]["token_ids"]


def test_gradio_client_steps_one_round_at_a_time(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    args = (PROMPT, "stdlib-code target (bundled)", "", "distilled draft (bundled)", "", False, "sampling", 0.9,
            0, 1.0, 3, 32, "fixed", 4)
    notes = []
    for _ in range(3):
        pane, table, note, fig = client.predict(*args, api_name="/step")
        notes.append(note)
        rows = table["data"]
        assert rows[-1][-1].split(":")[0] in ("corrected", "bonus")
        judged = [r for r in rows if r[-1] in ("accept", "reject")]
        for _token, q, p, a, u, decision in judged:
            assert a == pytest.approx(min(1.0, p / q), rel=0.02, abs=2e-3)
            assert (u < a) == (decision == "accept")
    assert [n.split("**")[1] for n in notes] == ["Round 1", "Round 2", "Round 3"]


CHROMIUM = "/usr/bin/chromium"
needs_browser = pytest.mark.skipif(not Path(CHROMIUM).exists() and not os.environ.get("REQUIRE_BROWSER"),
                                   reason="Debian's chromium is not installed (.ci/run installs it)")


@pytest.fixture
def page(server):
    """A headless Debian Chromium page on the app, launched the way this machine allows."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1700})
        page.goto(server, wait_until="domcontentloaded")
        yield page
        browser.close()


@needs_browser
def test_browser_shows_tokens_plots_and_speedup(page):
    page.get_by_role("button", name="Generate", exact=True).click()
    page.wait_for_selector("#spec-pane .tok.acc", timeout=120_000)
    page.wait_for_selector("#greedy-check :text('token for token')", timeout=180_000)
    page.wait_for_selector("#plot-time .js-plotly-plot", timeout=60_000)
    assert page.locator("#spec-pane .tok.acc").count() > 0
    assert page.locator("#spec-pane .tok.bon, #spec-pane .tok.cor").count() > 0
    assert page.locator(".js-plotly-plot").count() >= 5
    summary = page.locator("#summary").inner_text()
    assert "Speedup" in summary and "×" in summary
    page.wait_for_timeout(500)
    page.screenshot(path=str(ROOT / "assets" / "screenshot.png"), full_page=True)


@needs_browser
def test_browser_stop_button_cancels_both_panes(page):
    page.get_by_text("Decoding", exact=True).click()
    box = page.get_by_label("number input for Max new tokens")
    box.fill("2000")
    box.press("Enter")
    page.get_by_role("button", name="Generate", exact=True).click()
    page.wait_for_selector("#spec-pane .tok", timeout=120_000)
    page.get_by_role("button", name="Stop", exact=True).click()

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
    assert "token for token" not in page.locator("#greedy-check").inner_text(), "the run never finished"
