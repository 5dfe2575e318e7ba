"""Why a speculative text differs from plain decoding where they must be equal (greedy decoding, and
sampling under the shared-noise rule): a near-tie that low precision rounds the other way, or a bug.

A verify pass over several tokens runs other kernel shapes than a one-token pass, and in bf16 or
fp16 their sums round differently: where the target's top two logits are closer than that rounding,
the two runs can pick different tokens, and both are the target's greedy choice within rounding.
The noise floor is measured, never assumed: the largest logit difference between a wide pass and
one-token passes over the same positions (`noise_floor`).

Under shared noise the token at a position is the winner of a race, argmax p/E over noise E fixed
by the seed and the position, so the scores compared are log p − log E: a logit moved by d moves a
log-probability by at most 2d/T (the logit itself, and the normaliser), which is the floor there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.core import sampling
from app.core.config import SamplingConfig
from app.core.contracts import KVCache

IDENTICAL, NEAR_TIE, MISMATCH = "identical", "near-tie", "mismatch"


@dataclass(frozen=True)
class Divergence:
    """The verdict on two greedy outputs of the same target and prompt."""

    kind: str  # IDENTICAL, NEAR_TIE or MISMATCH
    position: int | None = None  # index in the outputs of the first differing token
    plain_token: int | None = None  # what plain decoding chose there (None: its output had ended)
    spec_token: int | None = None  # what the speculative run chose there (None: its output had ended)
    # The target's logits at the branch point, as a one-token pass computed them (plain decoding's)
    # and as a pass of the verify width did: (token, logit) of the leaders, the two candidates first.
    plain_row: list[tuple[int, float]] = field(default_factory=list)
    verify_row: list[tuple[int, float]] = field(default_factory=list)
    margin: float = 0.0  # the one-token pass's score of plain's token minus the speculative token's
    noise: float = 0.0  # the largest rounding difference measured between pass widths here, in scores
    # Teacher-forced over the whole speculative output: the most any of its tokens falls short of
    # the argmax of its row (0 when every token is the argmax), and where.
    worst_shortfall: float = 0.0
    worst_at: int | None = None
    dtype: str = ""  # the target's, as torch names it less the prefix (bfloat16, float32)
    # What decides a token: "logit" (greedy: the argmax) or "race" (shared noise: argmax of log p − log E).
    score: str = "logit"

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@torch.inference_mode()
def noise_floor(
    target, ids: list[int], width: int, target_cache: Callable[..., KVCache], end: int | None = None
) -> float:
    """Largest |logit| difference between one pass over `width` tokens and one-token passes over
    the same positions, the window ending at `end` (default: the end of ids)."""
    end = len(ids) if end is None else end
    start = max(1, end - width)
    lm = target_cache(target)
    try:
        lm.extend(ids[:start], keep=1)
        base = lm.length
        wide = lm.extend(ids[start:end], keep=end - start).float()
        lm.rollback(base)
        narrow = torch.stack([lm.extend([t], keep=1)[-1] for t in ids[start:end]]).float()
    finally:
        lm.close()
    return float((wide - narrow).abs().max())


@torch.inference_mode()
def explain(
    target,
    target_cache: Callable[..., KVCache],
    prompt_ids: list[int],
    spec_ids: list[int],
    plain_ids: list[int],
    width: int,
    noise: float = 0.0,
    cfg: SamplingConfig | None = None,
) -> Divergence:
    """The verdict on two outputs that must be equal: identical, a near-tie within the rounding noise,
    or a mismatch above it. width: the verify pass's width to compare one-token passes with; noise: a
    floor measured before (calibration), raised by what this text's own windows show; cfg: the
    run's sampling settings (None: plain greedy decoding). A greedy run with a repetition penalty or
    banned n-grams picks the argmax of the processed scores, so those are what each token is held to."""
    if spec_ids == plain_ids:
        return Divergence(IDENTICAL)
    score = _scorer(cfg)
    n = min(len(spec_ids), len(plain_ids))
    j = next((i for i in range(n) if spec_ids[i] != plain_ids[i]), n)
    text = prompt_ids + spec_ids
    at = len(prompt_ids) + j  # the position whose token differs; its logits come from at - 1
    noise = max(noise, noise_floor(target, text, width, target_cache, end=min(at + 1, len(text))))
    if cfg is not None and cfg.shared_noise:
        noise *= 2 / cfg.temperature
    shortfalls, verify_row = _teacher_forced(target, target_cache, prompt_ids, spec_ids, width, j, score)
    worst_at = max(range(len(shortfalls)), key=shortfalls.__getitem__) if shortfalls else None
    worst = shortfalls[worst_at] if worst_at is not None else 0.0
    plain_token = plain_ids[j] if j < len(plain_ids) else None
    spec_token = spec_ids[j] if j < len(spec_ids) else None
    history = prompt_ids + plain_ids[:j]
    plain_row = score(_one_token_row(target, target_cache, history), history)
    verify_row = score(verify_row, prompt_ids + spec_ids[:j])
    candidates = [t for t in (plain_token, spec_token) if t is not None]
    margin = float(plain_row[plain_token] - plain_row[spec_token]) if len(candidates) == 2 else float("inf")
    tie = len(candidates) == 2 and abs(margin) <= noise and worst <= noise
    return Divergence(
        NEAR_TIE if tie else MISMATCH,
        j,
        plain_token,
        spec_token,
        _leaders(plain_row, candidates),
        _leaders(verify_row, candidates),
        margin,
        noise,
        worst,
        worst_at,
        getattr(target, "specdec_precision", None) or str(target.dtype).removeprefix("torch."),
        "race" if cfg is not None and cfg.shared_noise else "logit",
    )


def explain_run(
    target,
    target_cache: Callable[..., KVCache],
    prompt_ids: list[int],
    spec_steps,
    plain_ids: list[int],
    noise: float,
    cfg: SamplingConfig | None = None,
) -> Divergence:
    """explain() for a speculative run's Steps, set against the widest pass its rounds verified."""
    spec_ids = [t for s in spec_steps for t in s.emitted]
    width = max((len(s.drafted) + 1 for s in spec_steps), default=1)
    return explain(target, target_cache, prompt_ids, spec_ids, plain_ids, width, noise, cfg)


def _scorer(cfg: SamplingConfig | None) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    """(logits row, the history it follows) -> the scores whose argmax picks the token: the logits
    under greedy decoding, processed by the run's repetition controls when it has them (the raw
    argmax is then not the token the run had to pick), and log p − log E under shared noise (p
    processed as the run's)."""
    if cfg is None or not cfg.penalised and not cfg.shared_noise:
        return lambda row, history: row

    def processed(row: torch.Tensor, history: list[int]) -> torch.Tensor:
        return sampling.penalise(row[None], history, [], cfg)[0]  # the row itself when unpenalised

    if not cfg.shared_noise:
        return processed

    def race_score(row: torch.Tensor, history: list[int]) -> torch.Tensor:
        p = sampling.probs(processed(row, history), cfg).double()
        e = sampling.race_noise(cfg.seed, len(history), p.shape[-1]).double()
        return (p.log() - e.log()).float()

    return race_score


def _one_token_row(target, target_cache, ids: list[int]) -> torch.Tensor:
    """The logits after ids as plain decoding computes them: the last token in a pass of its own."""
    lm = target_cache(target)
    try:
        lm.extend(ids[:-1], keep=1)
        return lm.extend(ids[-1:], keep=1)[-1].float()
    finally:
        lm.close()


def _teacher_forced(
    target, target_cache, prompt_ids: list[int], spec_ids: list[int], width: int, keep: int, score
) -> tuple[list[float], torch.Tensor]:
    """How far each speculative token's score falls short of its row's maximum, with the output fed
    in passes of the verify width after the prompt, as the verify passes fed it; and row `keep`
    (the logits that chose spec_ids[keep], or those after the whole output)."""
    lm = target_cache(target)
    out: list[float] = []
    j, fed_to = 0, 0  # row j chose spec_ids[j]
    try:
        rows = lm.extend(prompt_ids, keep=1)
        while True:
            for row in rows.float():
                if j == keep:
                    kept = row
                if j < len(spec_ids):
                    scores = score(row, prompt_ids + spec_ids[:j])
                    out.append(float(scores.max() - scores[spec_ids[j]]))
                j += 1
            if fed_to == len(spec_ids):
                return out, kept
            fed = spec_ids[fed_to : fed_to + width]
            fed_to += len(fed)
            rows = lm.extend(fed, keep=len(fed))
    finally:
        lm.close()


def _leaders(row: torch.Tensor, candidates: list[int], n: int = 4) -> list[tuple[int, float]]:
    """(token, logit) of the candidates, then the row's leaders up to n in all."""
    top = [int(t) for t in row.topk(n).indices]
    ids = list(dict.fromkeys(candidates + top))[: max(n, len(candidates))]
    return [(t, float(row[t])) for t in ids]
