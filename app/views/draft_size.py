"""The draft-size figure: speedup over plain decoding against the draft's cost per token, one colour
per kind of text, measured points joined in order of cost and Leviathan's prediction from the same α
and c dashed beside them, its best draft marked. Pure Plotly, from a sweep's document (bench/sizes.py)."""

from __future__ import annotations

import plotly.graph_objects as go

from app.views.plots import TEMPLATE

PALETTE = ["#2e9d57", "#3a74c9", "#d9534f", "#e0a030", "#7a5cc4", "#555555", "#1b9aaa", "#b5651d"]
KEY = "#7f8790"  # the style key's grey: a line style, not a kind of text


def figure(doc: dict) -> go.Figure:
    """One legend entry per kind of text (a click hides its three traces together) and two that
    key the styles, so the legend stays short however many drafts run; each point's hover names its draft."""
    fig = go.Figure()
    for i, (category, curve) in enumerate(doc["sizes"].items()):
        fig.add_traces(_category(category, curve, PALETTE[i % len(PALETTE)]))
    fig.add_trace(_key("measured (a dot per draft)", None, "circle"))
    fig.add_trace(_key("predicted from α and c (Leviathan); ★ its best draft", "dash", "star"))
    fig.add_hline(y=1.0, line=dict(color="#9aa0a6", width=1))
    fig.update_layout(
        template=TEMPLATE,
        height=460,
        xaxis_title="draft cost per token, over one target pass (c)",
        yaxis_title="speedup over plain decoding",
        margin=dict(l=55, r=10, t=20, b=50),
        legend=dict(orientation="h", y=-0.2, x=0, xanchor="left", yanchor="top"),
    )
    return fig


def _category(category: str, curve: dict, colour: str) -> list[go.Scatter]:
    """A kind of text's measured curve (its legend entry), its predicted curve and its predicted best."""
    points = curve["points"]
    scored = [p for p in points if p["predicted"] is not None]
    group = dict(legendgroup=category, line=dict(color=colour))
    traces = [
        go.Scatter(
            x=[p["c"] for p in points],
            y=[p["speedup"] for p in points],
            name=category,
            mode="lines+markers",
            text=[_label(p) for p in points],
            hovertemplate=f"{category}: %{{text}}<br>c %{{x:.3f}}<br>measured %{{y:.2f}}×<extra></extra>",
            **group,
        ),
        go.Scatter(
            x=[p["c"] for p in scored],
            y=[p["predicted"] for p in scored],
            name=f"{category}: predicted",
            mode="lines",
            showlegend=False,
            text=[_label(p) for p in scored],
            hovertemplate=f"{category}: %{{text}}<br>c %{{x:.3f}}<br>predicted %{{y:.2f}}×<extra></extra>",
            legendgroup=category,
            line=dict(color=colour, dash="dash"),
        ),
    ]
    best = next((p for p in scored if p["draft"] == curve["fastest_predicted"]), None)
    if best is not None:
        hover = f"{category}: {_label(best)}, predicted best: %{{y:.2f}}× at k = {best['predicted_k']}<extra></extra>"
        traces.append(
            go.Scatter(
                x=[best["c"]],
                y=[best["predicted"]],
                mode="markers",
                marker=dict(symbol="star", size=13, color=colour),
                name=f"{category}: predicted best",
                showlegend=False,
                legendgroup=category,
                hovertemplate=hover,
            )
        )
    return traces


def _key(name: str, dash: str | None, symbol: str) -> go.Scatter:
    """A legend entry that draws nothing: it explains a line style once for every kind of text."""
    return go.Scatter(
        x=[None],
        y=[None],
        name=name,
        mode="lines+markers",
        legendgroup="key",
        line=dict(color=KEY, dash=dash),
        marker=dict(symbol=symbol, size=9, color=KEY),
        hoverinfo="skip",
    )


def _label(point: dict) -> str:
    """The draft as the page names it (the sweep's label; a document from before labels: its id)."""
    return point.get("label") or point["draft"]
