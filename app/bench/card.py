"""`python -m app bench --card`: the model card's figures for every bundled draft.

Greedy acceptance at k = 4 (pooled, with a bootstrap interval over prompts) and with adaptive k on
the held-out code prompts, the same draft as a tree of CARD_TREE nodes (or --tree N) k = 4 deep beside
its chain, and each draft's decode cost per token against the target's.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

from app import models, request
from app.bench import progress
from app.core import metrics, text
from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig, UserError
from app.core.metrics import alpha_interval
from app.data.prompts import held_out_prompts, suite
from app.drafts.model import decode_seconds_per_token


def run_one(pair, prompt: str, s: SamplingConfig, sp: SpecConfig, r: RunConfig, mode: str, calibrated: bool = False):
    """One run through the request path; calibrated=True guides adaptive k by this machine's costs."""
    ids = pair.encode(prompt, r.chat)
    run = request.start(pair, ids, Settings(s, sp, r), speculative=mode == "speculative", calibrated=calibrated)
    return ids, list(run.steps())


def aggregate(rows: list[dict]) -> dict:
    """The card's medians over prompts, and pooled acceptance over every round."""

    def med(f):
        vals = [f(r) for r in rows if f(r) is not None]
        return statistics.median(vals) if vals else None

    acc = sum(r["speculative"]["accepted"] for r in rows)
    drafted = sum(r["speculative"]["drafted"] for r in rows)
    rej = sum(r["speculative"]["rejections"] for r in rows)
    return dict(
        prompts=len(rows),
        median_speedup=med(lambda r: r["speedup"]),
        alpha=acc / (acc + rej) if acc + rej else None,
        alpha_ci95=alpha_interval([(r["speculative"]["accepted"], r["speculative"]["rejections"]) for r in rows]),
        acceptance_rate=acc / drafted if drafted else None,
        median_tokens_per_pass=med(lambda r: r["speculative"]["tokens_per_pass"]),
        median_cost_ratio_c=med(lambda r: r["speculative"]["cost_ratio_c"]),
        median_theoretical_speedup=med(lambda r: r["speculative"]["theoretical_speedup"]),
    )


COST_REPS = 5  # odd, so the median ratio is one real pair of timings


def cost_ratio(t_draft, t_target, reps: int = COST_REPS) -> tuple[float, float, float]:
    """(draft seconds, target seconds, draft / target) per token, each a median over `reps`
    alternations: the ratio of each draft timing to the target timing right beside it, so a host
    that drifts between models (this one drifts by a tenth within minutes) moves both alike."""
    pairs = [(t_draft(), t_target()) for _ in range(reps)]
    return (
        statistics.median(d for d, _ in pairs),
        statistics.median(t for _, t in pairs),
        statistics.median(d / t for d, t in pairs),
    )


CARD_TREE = 16  # the card's tree: nodes, k = 4 deep (--tree N picks another)


def _prompt_row(pair, prompt: str, s: SamplingConfig, r: RunConfig, tree: int = CARD_TREE) -> dict:
    """One prompt: plain, fixed k = 4, the tree of `tree` nodes k = 4 deep (None where the draft
    cannot branch) and adaptive runs, and their speedups."""
    _, ar = run_one(pair, prompt, s, SpecConfig(), r, "autoregressive")
    _, spec = run_one(pair, prompt, s, SpecConfig(k=4, k_policy="fixed"), r, "speculative")
    _, adaptive = run_one(pair, prompt, s, SpecConfig(k_policy="adaptive"), r, "speculative", calibrated=True)
    a, b, c = (metrics.summarize(x) for x in (ar, spec, adaptive))
    try:
        _, tree_steps = run_one(pair, prompt, s, SpecConfig(k=4, k_policy="fixed", tree=tree), r, "speculative")
        t = metrics.summarize(tree_steps)
    except UserError:  # a draft that re-tokenises its drafts drafts chains only
        t = None
    return dict(
        autoregressive=a,
        speculative=b,
        tree=t,
        speedup=metrics.compare(b, a)["achieved_speedup"],
        adaptive_speedup=metrics.compare(c, a)["achieved_speedup"],
        tree_speedup=metrics.compare(t, a)["achieved_speedup"] if t else None,
    )


def _tree_summary(rows: list[dict], nodes: int) -> dict | None:
    """The tree beside the chain (both k = 4): medians over prompts, and the tree's over the chain's."""
    trees = [r for r in rows if r["tree"] is not None and r["tree_speedup"] and r["speedup"]]
    if not trees:
        return None

    def med(f):
        return statistics.median(f(r) for r in trees)

    per_pass = med(lambda r: r["tree"]["tokens_per_pass"])
    chain_per_pass = med(lambda r: r["speculative"]["tokens_per_pass"])
    return dict(
        nodes=nodes,
        k=4,
        median_speedup=med(lambda r: r["tree_speedup"]),
        median_tokens_per_pass=per_pass,
        tokens_per_pass_over_chain=per_pass / chain_per_pass if chain_per_pass else None,
        speed_over_chain=med(lambda r: r["tree_speedup"] / r["speedup"]),
    )


def family(args) -> tuple[str, list[str], list[str], bool]:
    """(target, its drafts, prompts, chat): SmolLM2's drafts on held-out chat requests with --target
    smollm2 (--suite picks code or prose), else the tiny family on held-out stdlib code; --draft
    cards that draft alone."""
    if models.presets.id_of(args.target or "") == models.SMOLLM2:
        prompts = suite(args.suite, chat=True)
        drafts = [models.SMOLLM2_FEATURE, models.SMOLLM2_SMALL]
        return models.SMOLLM2, [args.draft] if args.draft else drafts, prompts, True
    names = ("draft-distilled", "draft-feature", "draft-small", "draft-weak")
    drafts = [args.draft] if args.draft else [str(models.BUNDLED / n) for n in names]
    return models.TINY_TARGET, drafts, held_out_prompts(), False


def card(args) -> dict:
    """Model card figures: greedy acceptance at k=4 on held-out prompts, and decode cost ratios."""
    target_id, drafts, prompts, chat = family(args)
    prompts = prompts[: args.limit or None]
    progress.say("card", f"loading {target_id}")
    target, tok = models.load(target_id, args.device, args.dtype)
    probe = text.prompt_ids(tok, prompts[0], chat, 1 << 20)[-200:]
    target_times = []

    def t_target() -> float:
        target_times.append(decode_seconds_per_token(target, probe))
        return target_times[-1]

    out = {"target": dict(params=target.num_parameters())}
    s, r = SamplingConfig(), RunConfig(args.max_new_tokens, chat=chat)
    tree = args.tree if isinstance(args.tree, int) and args.tree > 0 else CARD_TREE
    for i, path in enumerate(drafts, start=1):
        name = Path(path).name
        progress.say("card", f"draft {i}/{len(drafts)}: {name}")
        pair = models.load_pair(target_id, path, args.device, args.dtype)
        timed = functools.partial(pair.draft.seconds_per_token, pair.target, probe)
        t_draft, t_beside, cost = cost_ratio(timed, t_target)
        rows = [_prompt_row(pair, prompt, s, r, tree) for prompt in progress.counted(prompts, "prompt")]
        summary = aggregate(rows)
        summary["median_adaptive_speedup"] = statistics.median(r["adaptive_speedup"] for r in rows)
        summary["tree"] = _tree_summary(rows, tree)
        out[name] = dict(
            params=pair.draft.params(),
            decode_ms=1000 * t_draft,
            target_decode_ms=1000 * t_beside,
            cost_per_token_vs_target=cost,
            **summary,
        )
        print(name, json.dumps(out[name]), file=sys.stderr)
    out["target"]["decode_ms"] = 1000 * statistics.median(target_times)
    return out
