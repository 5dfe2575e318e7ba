"""The benchmark's figures, from its documents rather than Step records: each prompt's speedup (bench)
and Spec-Bench's categories (specbench, and the app's by-kind panel). Pure Plotly, in plots.py's style."""

from __future__ import annotations

import plotly.graph_objects as go

from app.views.plots import COLOURS, TEMPLATE, laid_out_figure


def bench_figure(doc: dict) -> go.Figure:
    """Per-prompt speedup of a benchmark document (and HF assisted when measured)."""
    rows = doc["prompts"]
    xs = [f"prompt {r['prompt']}" for r in rows]
    data = [
        go.Bar(
            x=xs,
            y=[r["speedup"] for r in rows],
            name="ours: speculative / autoregressive",
            marker_color=COLOURS["speculative"],
        )
    ]
    if any("hf" in r for r in rows):
        data.append(
            go.Bar(
                x=xs,
                y=[r.get("hf", {}).get("assisted_speedup") for r in rows],
                name="transformers assisted / plain",
                marker_color=COLOURS["bonus"],
            )
        )
    title = f"speedup on {doc['suite']} prompts: {doc['target']} + {doc['draft']}"
    fig = laid_out_figure(data, title, "", "speedup (x)", barmode="group")
    fig.add_hline(y=1.0, line_dash="dot")
    return fig


def category_figure(doc: dict) -> go.Figure:
    """Spec-Bench's two figures by category, one colour per draft: the speedup over plain decoding
    (median over questions) above, mean tokens per target pass below."""
    from plotly.subplots import make_subplots

    categories = list(doc["summary"])
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=("speedup", "tokens per target pass"))
    palette = ["#2e9d57", "#3a74c9", "#d9534f", "#e0a030", "#7a5cc4", "#555555"]
    for i, draft in enumerate(doc["drafts"]):
        colour = palette[i % len(palette)]
        entries = [doc["summary"][c][draft] for c in categories]
        fig.add_trace(
            go.Bar(x=categories, y=[e["speedup"]["median"] for e in entries], name=draft, marker_color=colour),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Bar(
                x=categories,
                y=[e["tokens_per_pass"] for e in entries],
                name=draft,
                marker_color=colour,
                showlegend=False,
            ),
            row=2,
            col=1,
        )
    fig.update_layout(
        template=TEMPLATE,
        barmode="group",
        height=520,
        margin=dict(l=45, r=10, t=40, b=40),
        legend=dict(orientation="h", y=-0.12, x=0, xanchor="left", yanchor="top"),
    )
    return fig
