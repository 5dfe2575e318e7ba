"""gpucheck's second half: the bundled family's outputs on a device, each cache kind (the dynamic
cache, the fast path's graphs, torch.compile's) against generate() and against the engine's own plain
decoding, every difference judged (core/divergence.py), with the speeds of each kind."""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from app import models, request
from app.bench import progress
from app.core import divergence
from app.core.config import SHARED_NOISE, RunConfig, SamplingConfig, Settings, SpecConfig


def _reported(fn, *args):
    """fn(*args)'s figures, or its error: one part failing (a compile error, say) leaves the others'."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, and the check goes on
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


EQUALITY_DRAFTS = (models.FEATURE_DRAFT, models.DISTILLED_DRAFT, models.PROMPT_LOOKUP)
EQUALITY_SPECS = (
    ("k=1", SpecConfig(k=1, k_policy="fixed")),
    ("k=4", SpecConfig(k=4, k_policy="fixed")),
    ("tree of 8", SpecConfig(k=4, k_policy="fixed", tree=8)),  # a draft that cannot branch skips it
    ("adaptive", SpecConfig(k_policy="adaptive")),
)


FAST_PATH = {"eager": "off", "graphs": "graphs", "compiled": "compile"}  # equality's cache kinds


def equality(device: torch.device, dtype: str, n_prompts: int, new_tokens: int, compiled_on: bool) -> dict:
    """The bundled family's outputs on this device, each cache kind against its reference.

    Each prompt runs bare greedy and with its example's repetition settings, against generate(),
    and shared-noise sampling against the engine's plain decoding with the same seed. Every
    difference gets the app's verdict (core/divergence.py): under bf16 a verify pass over k+1 tokens
    and a one-token step may round a near-tie differently, which is numerics, while a margin above
    the measured noise is a mismatch, a bug.
    """
    examples = [
        e for e in json.loads((models.ROOT / "assets" / "prompts-tiny.json").read_text()) if e["kind"] == "code"
    ]
    out = {}
    for i, draft in enumerate(EQUALITY_DRAFTS, start=1):
        name = Path(draft).name if draft != models.PROMPT_LOOKUP else draft
        progress.say("gpucheck", f"equality {i}/{len(EQUALITY_DRAFTS)}: {name} against generate()")
        pair = models.load_pair(models.TINY_TARGET, draft, str(device), dtype)
        rows = out[name] = {}
        kinds = ("eager", "graphs") if device.type == "cuda" else ("eager",)
        for kind in kinds + (("compiled",) if compiled_on else ()):
            row = rows[kind] = _reported(_equal_runs, pair, examples[:n_prompts], new_tokens, FAST_PATH[kind])
            print(
                f"gpucheck: equality {name} {kind}: "
                + (
                    row.get("error")
                    or f"{row['identical']}/{row['checked']} identical, {row['near_ties']} near-ties within "
                    f"rounding, {row['bugs']} mismatches, speculative as plain {row['speculative_as_plain']} "
                    f"(width {row['width']}), {row['speedup']:.2f}x"
                ),
                file=sys.stderr,
            )
        del pair
    return out


def _cases(pair, ids: list[int], example: dict, new_tokens: int, fast_path: str):
    """(what is set, the sampling settings, the reference, whether plain decoding is checked too).

    Greedy, bare and with the example's repetition controls, is checked against generate().
    Shared-noise sampling has no generate() counterpart: its reference is the engine's own plain
    decoding on this cache kind, which a seed fixes, so the speculative runs are held to it.
    """
    penalty = {key: example["settings"][key] for key in ("repetition_penalty", "no_repeat_ngram_size")}
    for extra in ({}, penalty):
        ref = pair.target.generate(
            torch.tensor([ids], device=pair.target.device), do_sample=False, max_new_tokens=new_tokens, **extra
        )[0, len(ids) :].tolist()
        yield extra, SamplingConfig(**extra), ref, True
    noise = dict(temperature=0.8, seed=11, rule=SHARED_NOISE)
    settings = Settings(SamplingConfig(**noise), SpecConfig(), RunConfig(new_tokens))
    plain = request.start(pair, ids, settings, speculative=False, fast_path=fast_path)
    yield noise, settings.sampling, [t for step in plain.steps() for t in step.emitted], False


def _equal_runs(pair, examples: list[dict], new_tokens: int, fast_path: str) -> dict:
    """Every run of one draft and cache kind, against its reference: counts, the verdict on each
    difference (core/divergence.py: a near-tie within rounding, or a mismatch, a bug), speeds; and
    how many speculative runs gave the engine's own plain decoding on this cache kind bit for bit (the
    app's promise, which holds where the passes are exact at every width: int8, or the fast path's
    fixed width), with the width those runs took (None: the bucket widths)."""
    checked = matched = speculative = as_plain = 0
    width = None
    verdicts = {divergence.NEAR_TIE: 0, divergence.MISMATCH: 0}
    mismatches, speeds = [], {"autoregressive": [], "speculative": []}
    for example in examples:
        ids = pair.encode(example["prompt"])
        for shown, s, ref, with_plain in _cases(pair, ids, example, new_tokens, fast_path):
            plain = None if with_plain else ref  # shared noise's reference is the engine's plain decoding
            for label, sp in ((("autoregressive", None),) if with_plain else ()) + EQUALITY_SPECS:
                if sp is not None and sp.tree and not getattr(pair.proposer(sp), "branches", False):
                    continue
                settings = Settings(s, sp or SpecConfig(), RunConfig(new_tokens))
                # Only adaptive k reads the machine's costs; a fixed k's output needs no calibration.
                adaptive = sp is not None and sp.k_policy == "adaptive"
                run = request.start(
                    pair, ids, settings, speculative=sp is not None, fast_path=fast_path, calibrated=adaptive
                )
                t0 = time.perf_counter()
                steps = list(run.steps())
                seconds = time.perf_counter() - t0
                got = [t for step in steps for t in step.emitted]
                width = getattr(run.target_cache, "width", None)
                if sp is None:
                    plain = got
                else:
                    speculative += 1
                    as_plain += got == plain
                checked += 1
                matched += got == ref
                if got != ref:
                    noise = run.costs.logit_noise if run.costs is not None else 0.0
                    d = divergence.explain_run(pair.target, run.target_cache, ids, steps, ref, noise, s)
                    verdicts[d.kind] += 1
                    mismatches.append(
                        dict(
                            prompt=example["prompt"][:30],
                            run=label,
                            settings=shown,
                            position=d.position,
                            verdict=d.kind,
                            margin=d.margin,
                            noise=d.noise,
                        )
                    )
                if s.greedy and label in ("autoregressive", "adaptive"):
                    speeds["autoregressive" if sp is None else "speculative"].append(len(got) / seconds)
    # The first runs include warm-up (and graph capture when compiled): the median discounts them.
    ar, spec = (statistics.median(v) for v in speeds.values())
    return dict(
        checked=checked,
        identical=matched,
        near_ties=verdicts[divergence.NEAR_TIE],
        bugs=verdicts[divergence.MISMATCH],
        mismatches=mismatches[:8],
        speculative_as_plain=f"{as_plain}/{speculative}",
        width=width,
        tokens_per_s=dict(autoregressive=ar, speculative_adaptive=spec),
        speedup=spec / ar,
    )
