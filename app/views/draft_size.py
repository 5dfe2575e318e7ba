"""The draft-size figure: speedup over plain decoding against the draft's cost per token, one colour
per kind of text, measured points joined in order of cost and Leviathan's prediction from the same α
and c dashed beside them, its best draft marked. Pure Plotly, from a sweep's document (bench/sizes.py)."""

from __future__ import annotations

import plotly.graph_objects as go

from app.views.plots import TEMPLATE

PALETTE = ["#2e9d57", "#3a74c9", "#d9534f", "#e0a030", "#7a5cc4", "#555555", "#1b9aaa", "#b5651d"]


def figure(doc: dict) -> go.Figure:
    fig = go.Figure()
    for i, (category, curve) in enumerate(doc["sizes"].items()):
        colour = PALETTE[i % len(PALETTE)]
        points = curve["points"]
        fig.add_trace(
            _series(
                points,
                "speedup",
                f"{category}: measured",
                colour,
                mode="lines+markers",
                text=[_label(p["draft"]) for p in points],
                hovertemplate="%{text}<br>c %{x:.3f}<br>speedup %{y:.2f}×<extra></extra>",
            )
        )
        scored = [p for p in points if p["predicted"] is not None]
        fig.add_trace(
            _series(scored, "predicted", f"{category}: predicted", colour, "dash", mode="lines", hoverinfo="skip")
        )
        best = next((p for p in scored if p["draft"] == curve["fastest_predicted"]), None)
        if best is not None:
            hover = f"{_label(best['draft'])}: predicted %{{y:.2f}}× at k = {best['predicted_k']}<extra></extra>"
            fig.add_trace(
                go.Scatter(
                    x=[best["c"]],
                    y=[best["predicted"]],
                    mode="markers",
                    marker=dict(symbol="star", size=13, color=colour),
                    name=f"{category}: predicted best ({_label(best['draft'])})",
                    hovertemplate=hover,
                )
            )
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


def _series(points: list[dict], key: str, name: str, colour: str, dash: str | None = None, **style) -> go.Scatter:
    """One line of the figure: `key` of each point against its draft cost c."""
    xs, ys = [p["c"] for p in points], [p[key] for p in points]
    return go.Scatter(x=xs, y=ys, name=name, line=dict(color=colour, dash=dash), **style)


def _label(draft: str) -> str:
    if draft.startswith("early-exit:"):
        return "exit " + draft.split(":")[1]
    return draft.rstrip("/").rsplit("/", 1)[-1]
