"""What the panes, the check line, the summary, the teaching table and the plots say, from real records."""

import dataclasses

from conftest import ADD_PROMPT, run

from app.core import metrics
from app.core.config import REJECTION, SHARED_NOISE
from app.core.events import BONUS, CORRECTED, KIND_LABELS, TARGET, Decision, Step
from app.drafts.model import ModelProposer
from app.views import check, plots, render

PROMPT = ADD_PROMPT
EMOJI = "✅⏳❌"


def _step(**kw) -> Step:
    """A hand-made round: two drafts, the second rejected, then the target's correction."""
    base = dict(
        round=3,
        k=2,
        drafted=[5, 6],
        draft_text=["        ", "\n"],
        accepted=1,
        token=7,
        token_kind=CORRECTED,
        token_text="else",
        rejected=[6],
        emitted=[5, 7],
        text="        else",
        draft_time=0.0,
        verify_time=0.0,
        elapsed=0.0,
        decisions=[Decision(5, "        ", 0.49, 1.0, 1.0, None, True), Decision(6, "\n", 0.2, 1.0, 0.0, None, False)],
        top=[(5, "        ", 0.49, 1.0, 0.0), (7, "else", 0.3, 0.0, 1.0)],
    )
    return Step(**(base | kw))


def test_greedy_table_shows_the_rule_applied_and_visible_whitespace():
    rows = render.decision_rows(_step(), render.GREEDY)
    assert "draft == argmax p" in render.GREEDY_HEADERS and "min(1, p/q)" not in render.GREEDY_HEADERS
    assert rows[0][:4] == ["········", 1.0, 0.49, "yes"] and rows[0][-1] == "accept"
    assert rows[1][0] == "↵" and rows[1][3] == "no" and rows[1][-1] == "reject"
    assert rows[-1][0] == "else" and rows[-1][-1].startswith("corrected")
    sampled = render.decision_rows(_step(decisions=[Decision(5, " ", 0.3, 0.6, 0.5, 0.2, True)]), REJECTION)
    assert sampled[0][3] == 0.5 and sampled[0][4] == 0.2


def test_rejected_drafts_render_inline_with_visible_whitespace():
    html = render.pane_html("x", [_step()])
    rejected = html.split('class="tok rej"')[1].split("</span>")[0]
    assert "↵" in rejected and "\n" not in rejected
    accepted = html.split('class="tok acc"')[1].split("</span>")[0]
    assert accepted.endswith("        "), "kept text keeps its real layout"


def test_draftless_rounds_are_target_tokens_in_pane_legend_stats_and_plots(target, tokenizer, near_draft):
    # Fixed k = 4 with 6 new tokens: after a fully accepted first round, one token is left and
    # the last round drafts nothing. Try a few lengths so one of them ends that way.
    steps = next(
        s
        for n in range(5, 12)
        for _, s in [
            run(target, tokenizer, PROMPT, ModelProposer(near_draft, "near"), k=4, k_policy="fixed", max_new_tokens=n)
        ]
        if any(x.token_kind == TARGET for x in s)
    )
    last = next(s for s in steps if s.token_kind == TARGET)
    assert last.drafted == [] and last.accepted == 0
    assert "target token (no drafts)" in render.LEGEND and "bonus (every draft before it kept)" in render.LEGEND
    assert 'class="tok tgt"' in render.pane_html(PROMPT, steps)
    assert render.decision_rows(last)[-1][-1].startswith("target: ")
    stats = metrics.summarize(steps)
    assert stats["rounds_by_kind"][TARGET] == sum(s.token_kind == TARGET for s in steps) > 0
    assert stats["rounds_by_kind"][BONUS] == sum(s.token_kind == BONUS for s in steps)
    names = [t.name for t in plots.tokens_per_round(steps).data]
    assert any(KIND_LABELS[TARGET] in n for n in names)
    summary = render.summary_markdown(steps, steps)
    assert "rounds that drafted nothing" in summary
    # mean k is over the rounds that drafted (as the formulas take it), and says so beside the plain rounds
    drafting = [s for s in steps if s.drafted]
    assert stats["mean_k"] == sum(len(s.drafted) for s in drafting) / len(drafting) > stats["drafted"] / len(steps)
    assert f"| mean k of the rounds that drafted | {stats['mean_k']:.2f} |" in summary


def test_residual_plot_draws_p_once_for_bonus_and_target_rounds():
    fig = plots.decision_figure(_step())
    assert [t.name for t in fig.data] == ["p (target)", "q (draft)", plots.RESIDUAL_NAME]
    assert list(fig.data[0].x) == ["········", "else"]
    for kind in (BONUS, TARGET):
        fig = plots.decision_figure(_step(token_kind=kind))
        assert len(fig.data) == 1 and list(fig.data[0].y) == [0.49, 0.3]
    missing = plots.decision_figure(_step(token=99))
    assert "not in the top tokens" in missing.layout.title.text


def test_the_teaching_view_draws_its_rounds_whitespace_and_the_main_pane_keeps_the_text():
    """A bonus space or newline is blank in a pane: the teaching view's round draws it (· and ↵, the
    line still broken after ↵); other rounds, and the main pane, keep the text as written."""
    space = _step(drafted=[5], draft_text=["x"], accepted=1, token_kind=BONUS, token_text=" ", rejected=[])
    newline = dataclasses.replace(space, round=4, token_text="\n", emitted=[5, 8])
    taught = render.pane_html("", [space, newline], drawn_round=4)
    bonus = [piece.split("</span>")[0].split(">")[-1] for piece in taught.split('class="tok bon"')[1:]]
    assert bonus == [" ", "↵\n"]
    assert render.pane_html("", [space], drawn_round=3).count(">·</span>") == 1
    main = render.pane_html("", [space, newline])
    assert "·" not in main and "↵" not in main


def test_the_residual_and_the_greedy_q_are_said_in_words_before_any_formula():
    """The residual's legend says what it is in words, the formula after; a greedy table's q column
    says why it is 1 and the note beside it says so in full; the tree's rows are labelled."""
    words, formula = plots.RESIDUAL_NAME.split(":")
    assert "p" in words and "q" in words and formula.strip() == "norm(max(0, p - q))"
    assert "= 1" in render.headers_for(render.GREEDY)[1] and render.headers_for(REJECTION)[1] == "q(x)"
    assert "most likely token" in render.GREEDY_Q_NOTE and "argmax p" in render.GREEDY_Q_NOTE
    tree = _step(drafted=[5, 6], draft_text=["a", "b"], decisions=[], accepted=0)
    tree.parents = [-1, -1]
    assert plots.tree_figure(tree).layout.yaxis.title.text == plots.TREE_Y != ""


def test_check_line_while_running_after_stop_and_done(records):
    spec, ar = records
    n = sum(len(s.emitted) for s in ar[:-3])
    running = check.identity_check(spec, ar[:-3], render.GREEDY, done=False)
    assert "identical so far" in running
    stopped = check.identity_check(spec, ar[:-3], render.GREEDY, done=False, stopped=True)
    assert f"Stopped</span> after {n} tokens" in stopped and "so far" not in stopped
    assert "Greedy check passed" in check.identity_check(spec, ar, render.GREEDY)
    assert "Stopped" in check.identity_check(spec, ar, REJECTION, done=False, stopped=True)
    for text in (running, stopped, check.identity_check(spec, ar, render.GREEDY), render.LEGEND):
        assert not set(EMOJI) & set(text), "no emoji: Debian's Chromium draws them as empty boxes"
    assert 'class="mark ok"' in check.identity_check(spec, ar, render.GREEDY)


def test_outputs_that_part_read_checking_until_the_verdict(records):
    """A class watching the lossless demo sees no "failed" before the verdict: while both runs go on,
    and after Stop, parted outputs read neutral; only finished runs without a near-tie verdict fail."""
    spec, ar = records
    parted = [dataclasses.replace(s, emitted=[t + 1 for t in s.emitted]) if i == 1 else s for i, s in enumerate(ar)]
    first = len(ar[0].emitted)
    for rule in (render.GREEDY, SHARED_NOISE):
        running = check.identity_check(spec, parted, rule, done=False)
        assert f"checking</span>: identical up to token {first}" in running and "fail" not in running
        stopped = check.identity_check(spec, parted, rule, done=False, stopped=True)
        assert "Stopped" in stopped and "fail" not in stopped and "no verdict" in stopped
        assert 'class="mark fail"' in check.identity_check(spec, parted, rule)


def test_summary_waits_for_rounds_and_says_partial_after_stop(records):
    spec, ar = records
    early = render.summary_markdown(spec[:3], ar[:3], done=False)
    assert "measuring" in early and "×" not in early.split("\n")[0]
    assert "so far (live)" in render.summary_markdown(spec, ar, done=False)
    assert "partial" in render.summary_markdown(spec[:3], ar[:3], done=False, stopped=True)
    assert "achieved" in render.summary_markdown(spec, ar)
    assert "unequal lengths" not in render.summary_markdown(spec, ar)
    # a run that ended sooner (an end-of-turn one side reached first) is a rate over a shorter text
    n = sum(len(s.emitted) for s in ar[:-2])
    shorter = render.summary_markdown(spec, ar[:-2])
    assert "unequal lengths" in shorter and f"wrote {sum(len(s.emitted) for s in spec)} and {n} tokens" in shorter


def test_context_full_is_said_where_the_run_ends(target, tokenizer):
    # The tiny target's context is 256 positions: asking for more ends the run there.
    _, steps = run(target, tokenizer, PROMPT, max_new_tokens=400)
    assert steps[-1].stop_reason == "context_full"
    assert "stopped: context full" in check.identity_check(steps, steps, render.GREEDY)
    assert "stopped: context full" in render.summary_markdown(steps, steps)
    assert "context full" not in check.identity_check(steps[:-1], steps[:-1], render.GREEDY)


def test_capped_last_round_is_marked_in_the_k_plot(records):
    spec, _ = records
    capped = dataclasses.replace(spec[-1], k=1, stop_reason="max_new_tokens")
    fig = plots.k_per_round([*spec[:-1], capped])
    assert any(t.name.startswith("last round") for t in fig.data)
    assert not any(t.name.startswith("last round") for t in plots.k_per_round(spec[:-1]).data)


def test_greedy_correction_plot_shows_argmax_p_not_a_residual_draw():
    fig = plots.decision_figure(_step(), greedy=True)
    names = [t.name for t in fig.data]
    assert plots.RESIDUAL_NAME not in names and names[-1] == "argmax p: the greedy token (no draw)"
    assert list(fig.data[-1].y) == [0.0, 1.0]  # on the target's token ("else") alone
    assert plots.decision_figure(_step()).data[-1].name == plots.RESIDUAL_NAME, "sampling keeps its residual"


def test_the_sampling_chart_always_holds_the_rejected_draft_token(target, near_draft, tokenizer):
    """However unlikely under p, the draft token the target turned down is among the bars, and marked."""
    import torch

    from app.core import teaching_tables, verify
    from app.core.contracts import Proposal

    vocab = 64
    p = torch.zeros(2, vocab)
    p[:, :10] = torch.linspace(1, 0.1, 10)
    p[:, 50] = 1e-4  # the rejected draft: far below p's top tokens
    p = p / p.sum(-1, keepdim=True)
    q = torch.zeros(2, vocab)
    q[0, 3], q[1, 50] = 1.0, 1.0
    residual = (p[1] - q[1]).clamp(min=0)
    v = verify.Verdict([0], 0, [0, 1], [0.1], [1.0], [0.1], [0.5], residual / residual.sum())
    names = type("Names", (), {"decode": staticmethod(lambda ids: f"t{ids[0]}")})  # a tokenizer's decode alone
    top = teaching_tables.top_table(names, Proposal([3, 50], q), torch.log(p), p, v)
    ids = [t[0] for t in top]
    assert 50 in ids and 0 in ids and len(ids) == teaching_tables.TOP_N
    fig = plots.decision_figure(_step(drafted=[3, 50], rejected=[50], token=0, top=top))
    assert "t50" + plots.REJECTED_MARK in list(fig.data[0].x)
    # And in real sampled rounds: every corrected round plots its rejected draft.
    _, steps = run(target, tokenizer, ADD_PROMPT, ModelProposer(near_draft, "near"), temperature=1.0, seed=1, k=4)
    corrected = [s for s in steps if s.token_kind == CORRECTED]
    assert corrected and all(s.rejected[0] in [t[0] for t in s.top] for s in corrected)


def test_summary_names_mean_acceptance_length_and_why_the_two_expected_speedups_differ(records):
    from app.core.costs import Costs

    spec, ar = records
    steep = Costs(tuple(1 + 0.25 * i for i in range(17)), 0.0, 0.05, 0.0, 1.0)
    text = render.summary_markdown(spec, ar, costs=steep)
    assert "tokens per target pass (mean acceptance length)" in text
    assert "a verify pass over k + 1 tokens costed as a one-token pass" in text
    st = metrics.summarize(spec, steep)
    assert st["theoretical_speedup"] > st["predicted_speedup"]
    assert f"{st['theoretical_speedup']:.2f}× Leviathan's idealised" in text
    assert "this run's α and c" in render.summary_markdown(spec, ar), "without measured costs: the formula"


def test_each_rounds_rejected_drafts_get_one_mark_and_the_kept_text_is_intact_in_both_views(records):
    """The page shows either the rejected drafts inline or the mark (style.css); the mark holds the
    drafts in its tooltip and has no text, so without the drafts the pane is the kept text exactly."""
    import html
    import re

    from app.core.events import REJECTED

    spec, _ = records
    page = render.pane_html("x", spec)
    rejected = [[p for p, k in s.spans() if k == REJECTED] for s in spec]
    rejected = [r for r in rejected if r]
    marks = re.findall(r'<span class="rej-mark" tabindex="0" role="note" data-drafts="([^"]*)"[^>]*></span>', page)
    assert len(rejected) > 0 and marks == [html.escape(render.visible("".join(r)), quote=True) for r in rejected]
    # Each mark sits right before its round's first rejected draft.
    assert len(re.findall(r'class="rej-mark"[^>]*></span><span class="tok rej"', page)) == len(marks)
    without_rejected = re.sub(r'<span class="tok rej"[^>]*>[^<]*</span>', "", page)
    shown = html.unescape(re.sub(r"<[^>]+>", "", without_rejected))
    assert shown == "x" + "".join(s.text for s in spec), "the kept text, newlines and indentation included"


def test_a_tree_rounds_thrown_away_branches_are_shown_branch_by_branch():
    """The pane lists a tree's discarded nodes depth first, a fork before each new branch, and the
    round's tooltip and rejected mark say what was thrown away; a chain's rejected drafts stay one run."""
    from app.core.events import CORRECTED, REJECTED, Step

    # Kept path a -> b; thrown away: c under a (with d under it), e at the root, f under b.
    drafted = [1, 2, 3, 4, 5, 6]
    texts = ["a", "b", "c", "d", "e", "f"]
    parents = [-1, 0, 0, 2, -1, 1]
    step = Step(3, 2, drafted, texts, 2, 9, CORRECTED, "X", [3, 4, 5, 6], [1, 2, 9], "abX", 0.0, 0.0, 0.0)
    step.parents = parents
    assert step.thrown_away() == [[5], [2, 3], [4]]
    assert [p for p, k in step.spans() if k == REJECTED] == ["f", "c", "d", "e"]
    page = render.pane_html("", [step])
    assert page.count('class="fork"') == 2 and 'data-drafts="f¦cd¦e"' in page
    assert "a tree of 6 drafts" in page and "3 branches thrown away" in page
    chain = Step(4, 3, [1, 2, 3], ["a", "b", "c"], 1, 9, CORRECTED, "X", [2, 3], [1, 9], "aX", 0.0, 0.0, 0.0)
    assert chain.thrown_away() == [[1, 2]] and 'class="fork"' not in render.pane_html("", [chain])


def test_token_text_is_readable_everywhere_and_a_tree_table_indents_by_depth():
    from app.serve.one_round import _round_note

    assert render.code("```") == "```` ``` ````" and render.code("a b") == "`a·b`"
    assert render.code("a|b", in_table=True) == "`a\\|b`", "a pipe would end a Markdown table cell"
    note = _round_note(_step(token_text="```", token_kind=BONUS))
    assert "the target's token: ```` ``` ```` (**" in note
    plain = _round_note(_step(drafted=[], draft_text=[], decisions=[], accepted=0, token_kind=TARGET))
    assert "no drafts this round" in plain and "target token" not in plain, "the kind is not named twice"
    # A tree three deep (a sibling below the first node): each depth sits further in than the one above it.
    tree = _step(
        drafted=[5, 6, 8, 9],
        draft_text=["a", "b", "c", "d"],
        decisions=[Decision(t, x, 0.5, 1.0, 1.0, None, True, node=i) for i, (t, x) in enumerate([(5, "a"), (6, "b")])],
        accepted=2,
    )
    tree.parents = [-1, 0, 1, 0]
    labels = [row[0] for row in render.decision_rows(tree, render.GREEDY)[:3]]
    assert labels[0] == "a" and labels[1].endswith("└\u2009b") and labels[2].endswith("└\u2009c")
    assert len(labels[2]) > len(labels[1]) > len(labels[0]) and labels[2].startswith("\u2003")


def test_a_kind_of_text_whose_texts_part_says_why():
    def entry(identical):
        side = dict(speedup=dict(median=1.2, min=1.0, max=1.4), tokens_per_pass=2.0, alpha=0.6, identical=identical)
        return {"questions": 2, "d": side}

    same = render.category_table({"code": entry(1.0), "overall": entry(1.0)}, ["d"])
    assert "100% |" in same and render.SAME_TEXT_NOTE not in same
    parted = render.category_table({"code": entry(0.0), "overall": entry(0.5)}, ["d"])
    assert "| 0% |" in parted and parted.endswith(render.SAME_TEXT_NOTE) and "int8" in render.SAME_TEXT_NOTE
