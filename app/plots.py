"""Pure Plotly figure builders from Step records: no gradio, no torch."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from app import metrics
from app.events import Step

COLOURS = {"accepted": "#2e9d57", "corrected": "#d9534f", "bonus": "#3a74c9", "rejected": "#9aa0a6",
           "target": "#555555", "speculative": "#2e9d57", "autoregressive": "#888888"}


def _layout(fig: go.Figure, title: str, x: str, y: str) -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0.02, font=dict(size=14)), height=260,
                      margin=dict(l=45, r=10, t=40, b=40), xaxis_title=x, yaxis_title=y,
                      template="plotly_white", legend=dict(orientation="h", y=1.02, x=1, xanchor="right",
                                                          yanchor="bottom"))
    return fig


def k_per_round(steps: Sequence[Step]) -> go.Figure:
    fig = go.Figure(go.Scatter(x=[s.round for s in steps], y=[s.k for s in steps], mode="lines+markers",
                               line_shape="hv", name="k", marker_color=COLOURS["bonus"]))
    return _layout(fig, "k per round", "round", "k")


def acceptance_per_round(steps: Sequence[Step]) -> go.Figure:
    rounds = [s.round for s in steps if s.drafted]
    per = [s.accepted / len(s.drafted) for s in steps if s.drafted]
    acc = drafted = 0
    running = []
    for s in steps:
        if s.drafted:
            acc, drafted = acc + s.accepted, drafted + len(s.drafted)
            running.append(acc / drafted)
    fig = go.Figure([
        go.Bar(x=rounds, y=per, name="accepted / drafted this round", marker_color=COLOURS["accepted"], opacity=0.5),
        go.Scatter(x=rounds, y=running, name="running acceptance rate", mode="lines",
                   line=dict(color=COLOURS["corrected"], width=2)),
    ])
    fig.update_yaxes(range=[0, 1.05])
    return _layout(fig, "acceptance per round", "round", "accepted / drafted")


def tokens_vs_time(spec: Sequence[Step], ar: Sequence[Step]) -> go.Figure:
    """Cumulative tokens against each pane's own elapsed time: the gap is the speedup."""
    fig = go.Figure()
    for name, steps in (("speculative", spec), ("autoregressive", ar)):
        total, xs, ys = 0, [0.0], [0]
        for s in steps:
            total += len(s.emitted)
            xs.append(s.elapsed), ys.append(total)
        fig.add_trace(go.Scatter(x=xs, y=ys, name=name, mode="lines", line=dict(color=COLOURS[name], width=2)))
    return _layout(fig, "tokens generated over time", "seconds", "tokens")


def acceptance_by_position(steps: Sequence[Step]) -> go.Figure:
    rates = metrics.acceptance_by_position(steps)
    fig = go.Figure(go.Bar(x=list(range(1, len(rates) + 1)), y=rates, marker_color=COLOURS["accepted"]))
    fig.update_yaxes(range=[0, 1.05])
    return _layout(fig, "acceptance by draft position", "position in the draft (1..k)", "share accepted")


def tokens_per_round(steps: Sequence[Step]) -> go.Figure:
    counts = [len(s.emitted) for s in steps]
    fig = go.Figure(go.Histogram(x=counts, xbins=dict(start=0.5, end=max(counts, default=1) + 0.5, size=1),
                                 marker_color=COLOURS["bonus"]))
    return _layout(fig, "tokens per round (per target pass)", "tokens emitted", "rounds")


def decision_figure(step: Step) -> go.Figure:
    """p, q and the residual norm(max(0, p - q)) over the top tokens where the target chose."""
    labels = []
    for t in step.top:  # whitespace made visible, and never two bars under one label
        label = visible(t[1]) or f"#{t[0]}"
        labels.append(label if label not in labels else f"{label} #{t[0]}")
    fig = go.Figure([
        go.Bar(x=labels, y=[t[2] for t in step.top], name="p (target)", marker_color=COLOURS["accepted"]),
        go.Bar(x=labels, y=[t[3] for t in step.top], name="q (draft)", marker_color=COLOURS["rejected"]),
        go.Bar(x=labels, y=[t[4] for t in step.top],
               name="norm(max(0, p - q))" if step.token_kind == "corrected" else "p at the bonus position",
               marker_color=COLOURS["corrected"] if step.token_kind == "corrected" else COLOURS["bonus"]),
    ])
    fig.update_layout(barmode="group")
    return _layout(fig, f"round {step.round}: where the target's token “{visible(step.token_text)}” came from",
                   "token", "probability")


def visible(piece: str) -> str:
    """Token text with spaces, tabs and newlines drawn, for axis labels."""
    return piece.replace(" ", "␣").replace("\t", "⇥").replace("\n", "↵")


def bench_figure(doc: dict) -> go.Figure:
    """Per-prompt speedup of a benchmark document (and HF assisted when measured)."""
    rows = doc["prompts"]
    xs = [f"prompt {r['prompt']}" for r in rows]
    fig = go.Figure(go.Bar(x=xs, y=[r["speedup"] for r in rows], name="ours: speculative / autoregressive",
                           marker_color=COLOURS["speculative"]))
    if any("hf" in r for r in rows):
        fig.add_trace(go.Bar(x=xs, y=[r.get("hf", {}).get("assisted_speedup") for r in rows],
                             name="transformers assisted / plain", marker_color=COLOURS["bonus"]))
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(barmode="group")
    return _layout(fig, f"speedup on {doc['suite']} prompts: {doc['target']} + {doc['draft']}", "", "speedup (x)")
