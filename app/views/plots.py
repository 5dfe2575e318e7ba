"""Pure Plotly figure builders from Step records: no gradio, no torch."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from app.core import metrics
from app.core.events import BONUS, CORRECTED, KIND_LABELS, TARGET, Step
from app.views import render
from app.views.render import visible

COLOURS = {
    "accepted": "#2e9d57",
    "corrected": "#d9534f",
    "bonus": "#3a74c9",
    "rejected": "#9aa0a6",
    "target": "#555555",
    "speculative": "#2e9d57",
    "autoregressive": "#888888",
}


# plotly_white's look for the cartesian plots drawn here, and nothing else: the full template
# is copied and validated into every figure, several times the cost of the figure itself, on
# every streamed update.
_AXIS = dict(
    gridcolor="#EBF0F8",
    linecolor="#EBF0F8",
    zerolinecolor="#EBF0F8",
    zerolinewidth=2,
    ticks="",
    automargin=True,
    title=dict(standoff=15),
)
TEMPLATE = go.layout.Template(
    layout=dict(
        font=dict(color="#2a3f5f"),
        paper_bgcolor="white",
        plot_bgcolor="white",
        hovermode="closest",
        hoverlabel=dict(align="left"),
        xaxis=_AXIS,
        yaxis=_AXIS,
    )
)


def laid_out_figure(data, title: str, x: str, y: str, y_range=None, **layout) -> go.Figure:
    """A figure with its whole layout given at construction (updating a layout afterwards costs more)."""
    # The legend sits under the plot, left-aligned: above it, it collides with the title on narrow screens.
    base = dict(
        template=TEMPLATE,
        title=dict(text=title, x=0.02, font=dict(size=14)),
        height=300,
        margin=dict(l=45, r=10, t=40, b=40),
        xaxis=dict(title=dict(text=x)),
        yaxis=dict(title=dict(text=y), **({} if y_range is None else {"range": y_range})),
        legend=dict(orientation="h", y=-0.38, x=0, xanchor="left", yanchor="top"),
    )
    return go.Figure(data, layout=base | layout)


def capped_last_round(steps: Sequence[Step]) -> Step | None:
    """The last round when its k was cut to the tokens (or context) left, not chosen by the policy."""
    if len(steps) < 2 or steps[-1].stop_reason not in ("max_new_tokens", "context_full"):
        return None
    return steps[-1] if steps[-1].k < steps[-2].k else None


def k_per_round(steps: Sequence[Step]) -> go.Figure:
    """k asked of the draft each round; draftless rounds and a capped last round are marked."""
    data = [
        go.Scatter(
            x=[s.round for s in steps],
            y=[s.k for s in steps],
            mode="lines+markers",
            line_shape="hv",
            name="k",
            marker_color=COLOURS["bonus"],
        )
    ]
    empty = [s for s in steps if not s.drafted and s.k > 0]
    if empty:  # asked for k, got nothing (prompt lookup without a match)
        data.append(
            go.Scatter(
                x=[s.round for s in empty],
                y=[s.k for s in empty],
                mode="markers",
                name=KIND_LABELS[TARGET],
                marker=dict(color=COLOURS["target"], symbol="x", size=9),
            )
        )
    last = capped_last_round(steps)
    if last is not None:
        data.append(
            go.Scatter(
                x=[last.round],
                y=[last.k],
                mode="markers",
                name="last round: k capped by tokens left",
                marker=dict(color=COLOURS["corrected"], symbol="diamond-open", size=11),
            )
        )
    trees = [s for s in steps if s.is_tree]
    if trees:  # a tree round's k is its depth; its width is how many nodes one pass verified
        data.append(
            go.Scatter(
                x=[s.round for s in trees],
                y=[len(s.drafted) for s in trees],
                mode="markers",
                name="nodes per round (a tree, k deep)",
                marker=dict(color=COLOURS["accepted"], symbol="triangle-up", size=9),
            )
        )
        return laid_out_figure(data, "k and nodes per round", "round", "k (depth) · nodes")
    return laid_out_figure(data, "k per round", "round", "k")


def acceptance_per_round(steps: Sequence[Step]) -> go.Figure:
    rounds = [s.round for s in steps if s.drafted]
    per = [s.accepted / len(s.drafted) for s in steps if s.drafted]
    acc = drafted = 0
    running = []
    for s in steps:
        if s.drafted:
            acc, drafted = acc + s.accepted, drafted + len(s.drafted)
            running.append(acc / drafted)
    return laid_out_figure(
        [
            go.Bar(
                x=rounds, y=per, name="accepted / drafted this round", marker_color=COLOURS["accepted"], opacity=0.5
            ),
            go.Scatter(
                x=rounds,
                y=running,
                name="running acceptance rate",
                mode="lines",
                line=dict(color=COLOURS["corrected"], width=2),
            ),
        ],
        "acceptance per round",
        "round",
        "accepted / drafted",
        y_range=[0, 1.05],
    )


def tokens_vs_time(spec: Sequence[Step], ar: Sequence[Step]) -> go.Figure:
    """Cumulative tokens against each pane's own elapsed time: the gap is the speedup."""
    data = []
    for name, steps in (("speculative", spec), ("autoregressive", ar)):
        total, xs, ys = 0, [0.0], [0]
        for s in steps:
            total += len(s.emitted)
            xs.append(s.elapsed), ys.append(total)
        data.append(go.Scatter(x=xs, y=ys, name=name, mode="lines", line=dict(color=COLOURS[name], width=2)))
    return laid_out_figure(data, "tokens generated over time", "seconds", "tokens")


def acceptance_by_position(steps: Sequence[Step]) -> go.Figure:
    rates = metrics.acceptance_by_position(steps)
    bars = go.Bar(x=list(range(1, len(rates) + 1)), y=rates, marker_color=COLOURS["accepted"])
    return laid_out_figure(
        bars, "acceptance by draft position", "position in the draft (1..k)", "share accepted", y_range=[0, 1.05]
    )


def tokens_per_round(steps: Sequence[Step]) -> go.Figure:
    """Histogram of tokens emitted per round, stacked by how the round's own token came about."""
    top = max((len(s.emitted) for s in steps), default=1)
    data = []
    for kind in (CORRECTED, BONUS, TARGET):
        counts = [len(s.emitted) for s in steps if s.token_kind == kind]
        if counts or kind != TARGET:
            data.append(
                go.Histogram(
                    x=counts,
                    xbins=dict(start=0.5, end=top + 0.5, size=1),
                    name=f"round ends with: {KIND_LABELS[kind]}",
                    marker_color=COLOURS[kind],
                )
            )
    return laid_out_figure(data, "tokens per round (per target pass)", "tokens emitted", "rounds", barmode="stack")


REJECTED_MARK = " (rejected draft)"  # the label of the draft token the target turned down
# The residual in words first, the formula after: what a rejection leaves the target to draw from.
RESIDUAL_NAME = "what p has beyond q, rescaled: norm(max(0, p - q))"
TREE_Y = "drafted tokens, kept path first"  # the y-axis: a row per node, depth first, under the text so far


def tree_figure(step: Step) -> go.Figure:
    """A tree round as drafted: one row per node, depth first and indented by depth (render.tree_order),
    an edge to its parent; the kept path and the target's own token in their colours, judged and
    rejected nodes grey, nodes never judged faint. Hover gives q, p and the decision."""
    order = render.tree_order(step.parents)
    row = {node: i + 1 for i, (node, _) in enumerate(order)}  # row 0: the committed text
    depth = dict(order)
    data = [_tree_edges(step.parents, row, depth), *_tree_nodes(step, order, row, depth), *_tree_ends(step, row)]
    width = max(depth.values(), default=1) + 2
    figure = laid_out_figure(
        data,
        f"round {step.round}: a tree of {len(step.drafted)} nodes, kept {step.accepted}",
        "depth",
        TREE_Y,
        y_range=[len(order) + 0.7, -1.2],  # the committed text on top, rows downwards
        # A row a label high, and the legend between the title and the plot: under the plot, as the
        # other figures have it, its lines would eat the rows of a narrow screen.
        height=max(370, 210 + 28 * len(order)),
        margin=dict(l=45, r=10, t=160, b=45),
        legend=dict(orientation="h", y=1.02, x=0, xanchor="left", yanchor="bottom"),
        xaxis=dict(range=[-0.3, width + 0.8], dtick=1, title=dict(text="depth")),
        showlegend=True,
    )
    # The title at the top, below where the page labels the plot, so the legend's lines (three on a
    # phone) fit between it and the plot.
    figure.update_layout(title=dict(y=1, yref="container", yanchor="top", pad=dict(t=40)))
    return figure


def _tree_edges(parents: list[int], row: dict, depth: dict) -> go.Scatter:
    """One grey line from each node to its parent; the committed text (-1) sits at depth 0, row 0."""
    xs, ys = [], []
    for node, parent in enumerate(parents):
        xs += [depth.get(parent, 0), depth[node], None]
        ys += [row.get(parent, 0), row[node], None]
    return go.Scatter(x=xs, y=ys, mode="lines", line=dict(color="#c8ccd2", width=1), hoverinfo="skip", showlegend=False)


def _tree_nodes(step: Step, order: list, row: dict, depth: dict) -> list[go.Scatter]:
    """One trace per group of nodes that has any (kept path, rejected, not judged), each node labelled by its text."""
    by_node = {d.node: d for d in step.decisions}
    groups: dict[str, list[int]] = {"kept path": [], "rejected": [], "not judged": []}
    for node, _ in order:
        d = by_node.get(node)
        group = "kept path" if node < step.accepted else "rejected" if d is not None else "not judged"
        groups[group].append(node)
    colours = {"kept path": COLOURS["accepted"], "rejected": COLOURS["rejected"], "not judged": "#dde0e4"}
    return [
        go.Scatter(
            x=[depth[n] for n in nodes],
            y=[row[n] for n in nodes],
            mode="markers+text",
            text=[visible(step.draft_text[n]) or f"#{step.drafted[n]}" for n in nodes],
            textposition="middle right",
            hovertext=[_node_hover(by_node.get(n)) for n in nodes],
            hoverinfo="text",
            marker=dict(size=10, color=colours[group]),
            name=group,
        )
        for group, nodes in groups.items()
        if nodes
    ]


def _node_hover(d) -> str:
    """A node's hover text: q, p and the decision where the target judged it, else "not judged"."""
    if d is None or d.p is None:
        return "not judged"
    return f"q {d.q:.3f} · p {d.p:.3f} · {'accept' if d.accepted else 'reject'}"


def _tree_ends(step: Step, row: dict) -> list[go.Scatter]:
    """The target's own token, one depth past the kept path, and the committed text the tree grows from."""
    token = go.Scatter(
        x=[step.accepted + 1],
        y=[row[step.accepted - 1] if step.accepted else 0],
        mode="markers+text",
        text=[visible(step.token_text)],
        textposition="middle right",
        marker=dict(size=12, symbol="diamond", color=COLOURS[step.token_kind]),
        name=f"the target's token ({KIND_LABELS[step.token_kind]})",
        hoverinfo="name",
    )
    committed = go.Scatter(
        x=[0],
        y=[0],
        mode="markers+text",
        text=["committed text"],
        textposition="top right",  # above its row: the target's token may sit right beside it
        marker=dict(size=10, color=COLOURS["target"]),
        showlegend=False,
        hoverinfo="skip",
    )
    return [token, committed]


def decision_figure(step: Step, greedy: bool = False, shared_noise: bool = False) -> go.Figure:
    """Where the target's own token came from, over the top tokens at that position.

    After a rejection: p, q and the residual it was drawn from (p's excess over q, rescaled), with the rejected
    draft token among the bars; under greedy nothing is drawn, and the token is argmax p; under shared
    noise the token wins p's race over the position's noise (the teaching note shows the race). A bonus or
    draftless token is drawn from p itself, so p is drawn once. A tree round draws its tree (tree_figure).
    """
    if step.is_tree:
        return tree_figure(step)
    labels = []
    rejected = step.rejected[0] if step.rejected else None
    for t in step.top:  # whitespace made visible, and never two bars under one label
        label = visible(t[1]) or f"#{t[0]}"
        label = label if label not in labels else f"{label} #{t[0]}"
        labels.append(label + (REJECTED_MARK if t[0] == rejected else ""))
    if step.token_kind == CORRECTED:
        # Under greedy the "residual" is a point mass on argmax p: nothing was drawn from p's excess over q.
        chosen = (
            dict(y=[float(t[0] == step.token) for t in step.top], name="argmax p: the greedy token (no draw)")
            if greedy
            # Under shared noise the token is the winner of p's race: p itself, no residual.
            else dict(y=[t[4] for t in step.top], name="p: its race's winner, argmax p/E (no residual)")
            if shared_noise
            else dict(y=[t[4] for t in step.top], name=RESIDUAL_NAME)
        )
        data = [
            go.Bar(
                x=labels,
                y=[t[2] for t in step.top],
                name="p (target, softmax at T = 1)" if greedy else "p (target)",
                marker_color=COLOURS["accepted"],
            ),
            go.Bar(x=labels, y=[t[3] for t in step.top], name="q (draft)", marker_color=COLOURS["rejected"]),
            go.Bar(x=labels, marker_color=COLOURS["corrected"], **chosen),
        ]
    else:
        data = go.Bar(
            x=labels,
            y=[t[2] for t in step.top],
            name=f"p: the {step.token_kind} token's source",
            marker_color=COLOURS[step.token_kind],
        )
    missing = step.token not in [t[0] for t in step.top]
    # A short title: plotly never wraps one, and the plot may be a phone's width.
    return laid_out_figure(
        data,
        f"round {step.round}: where “{visible(step.token_text)}” came from"
        + (" (not in the top tokens)" if missing else ""),
        "",
        "probability",
        barmode="group",
    )
