"""What a trained draft accepts in decoding: greedy α at fixed k = 4 on the held-out requests of every
kind (code, prose, translation-like rewriting, two-turn chats), through the app's own request path.
Not timed, so it is the same on any machine; the training command writes it into the draft's record."""

from __future__ import annotations

from app import request
from app.core import metrics
from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig
from app.data import instructions
from app.models.pair import Pair

K = 4
NEW_TOKENS = 128


def _chat_ids(pair: Pair, turns: list[dict]) -> list[int]:
    text = pair.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return pair.tokenizer(text, add_special_tokens=False)["input_ids"]


def _run(pair: Pair, ids: list[int], new_tokens: int) -> tuple[dict, list[int]]:
    settings = Settings(SamplingConfig(), SpecConfig(k=K, k_policy="fixed"), RunConfig(new_tokens, chat=True))
    steps = list(request.start(pair, ids, settings, calibrated=False).steps(display=False))
    return metrics.summarize(steps), [t for s in steps for t in s.emitted]


def _pooled(rows: list[dict]) -> dict:
    """Pooled α over the prompts, and its bootstrap interval resampling prompts (as the card's)."""
    accepted, rejections = sum(r["accepted"] for r in rows), sum(r["rejections"] for r in rows)
    alpha = accepted / (accepted + rejections) if accepted + rejections else None
    ci = metrics.alpha_interval([(r["accepted"], r["rejections"]) for r in rows])
    return dict(
        prompts=len(rows),
        alpha=alpha and round(alpha, 3),
        alpha_ci95=ci and [round(x, 3) for x in ci],
        accepted=accepted,
        rejections=rejections,
    )


def suites(pair: Pair, new_tokens: int = NEW_TOKENS, limit: int = 0) -> dict:
    """{suite: pooled α} over the held-out requests; a chat's second turn follows the target's own
    (greedy, so speculative and plain alike) answer to its first, and only the second turn counts."""
    singles = {
        "code": instructions.held_out_code(),
        "code-40": instructions.held_out_code_suite(),
        "prose": instructions.held_out_prose(),
        "rewrite": instructions.held_out_rewrite(),
    }
    out = {}
    for name, prompts in singles.items():
        rows = [_run(pair, pair.encode(p, chat=True), new_tokens)[0] for p in prompts[: limit or None]]
        out[name] = _pooled(rows)
    rows = []
    for first, follow_up in instructions.held_out_chat()[: limit or None]:
        _, answer = _run(pair, pair.encode(first, chat=True), new_tokens)
        said = pair.tokenizer.decode(answer, skip_special_tokens=True).strip()
        turns = [{"role": "user", "content": first}, {"role": "assistant", "content": said}]
        rows.append(_run(pair, _chat_ids(pair, turns + [{"role": "user", "content": follow_up}]), new_tokens)[0])
    out["chat"] = _pooled(rows)
    return out
