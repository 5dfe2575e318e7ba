"""The page's own style sheet on the markup Gradio and render.py produce, in a real browser: the status
line makes room for a first request's phase, and a tree's inline rejected drafts wrap inside the pane."""

import os
from pathlib import Path

import pytest

from app.core.events import CORRECTED, Step
from app.serve.texts import CSS
from app.views import render

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists() and not os.environ.get("REQUIRE_BROWSER"),
    reason="Debian's chromium is not installed (.ci/run installs it)",
)
# The status line as Gradio 6 draws it while a request loads: a block of no height of its own, its
# progress overlay absolutely placed inside it (the class list loses "hide" while it shows).
STATUS = """<div id="run-status" class="block padded hide-container" style="min-height: 0px; position: relative">
<div data-testid="status-tracker" class="wrap center full {state}" style="position: absolute; padding: 0px;">
<div class="progress-level">loading models (the first request for a pair) - 0.0%</div></div>
<div data-testid="markdown-wrapper"><span class="md prose"></span></div></div>
<p id="below">Timing: both panes run on the same device.</p>"""


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        yield browser.new_page(viewport={"width": 1000, "height": 800})
        browser.close()


def _box(page, selector: str) -> dict:
    return page.evaluate(
        f"(() => {{ const r = document.querySelector('{selector}').getBoundingClientRect(); "
        "return {top: r.top, bottom: r.bottom}; })()"
    )


def test_a_loading_phase_is_not_drawn_over_the_text_below(page):
    page.set_content(f"<style>{CSS}</style>" + STATUS.format(state=""))
    phase, below = _box(page, "[data-testid=status-tracker] .progress-level"), _box(page, "#below")
    assert phase["bottom"] <= below["top"], "the phase's text lies on the paragraph below"
    page.set_content(f"<style>{CSS}</style>" + STATUS.format(state="hide"))
    assert _box(page, "#run-status")["bottom"] - _box(page, "#run-status")["top"] == 0, "no gap when idle"


def test_a_trees_inline_rejected_drafts_wrap_inside_the_pane(page):
    # A tree round whose thrown-away branches are long runs of tokens with no space among them.
    texts = ["def", "(", "x"] + ["very_long_identifier_of_a_thrown_away_branch"] * 12
    drafted = list(range(1, len(texts) + 1))
    parents = [-1, 0, 1] + [-1 if i % 3 == 0 else 2 + i for i in range(12)]
    step = Step(3, 2, drafted, texts, 2, 99, CORRECTED, "y", drafted[2:], [1, 2, 99], "def(y", 0.0, 0.0, 0.0)
    step.parents = parents
    html = render.pane_html("", [step])
    page.set_content(f"<style>{CSS}</style><div id='pane-box' style='width: 420px'>{html}</div>")
    width = page.evaluate(
        "(() => { const p = document.querySelector('.pane'); return [p.scrollWidth, p.clientWidth]; })()"
    )
    assert width[0] <= width[1], f"the pane's text runs {width[0] - width[1]}px past its edge"
