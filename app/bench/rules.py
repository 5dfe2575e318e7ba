"""`python -m app bench --rules`: acceptance of each sampling rule, the same drafts on the same prompts.

Per-token α (drafts kept over drafts judged) at a fixed k under sampling, pooled over a suite's
held-out prompts with a bootstrap interval over prompts, for rejection sampling and for shared
noise. Prompt i is sampled with seed --seed + i under both rules. Nothing is timed: the figures
depend on the models and the prompts alone, so they are the same on any machine.
"""

from __future__ import annotations

import sys

from app import models, request
from app.bench import progress
from app.bench.card import family
from app.core.config import RULES, RunConfig, SamplingConfig, Settings, SpecConfig
from app.core.metrics import alpha_interval

DEFAULT_TEMPERATURE = 0.7  # when --temperature asks for greedy, which has one rule


def rules(args) -> dict:
    """{draft: {rule: {alpha, alpha_ci95, accepted, judged}}} for the family's model-backed drafts."""
    target_id, drafts, prompts, chat = family(args)
    prompts = prompts[: args.limit or None]
    temperature = args.temperature or DEFAULT_TEMPERATURE
    k = args.k or 4
    out = dict(target=target_id, suite=args.suite, k=k, temperature=temperature, top_k=args.top_k, top_p=args.top_p)
    for i, path in enumerate(drafts, start=1):
        progress.say("rules", f"draft {i}/{len(drafts)}: {path}")
        pair = models.load_pair(target_id, path, args.device, args.dtype)
        out[models.public_name(path)] = {
            rule: _alpha(pair, prompts, chat, rule, temperature, k, args) for rule in RULES
        }
        print(models.public_name(path), out[models.public_name(path)], file=sys.stderr)
    return out


def _alpha(pair, prompts: list[str], chat: bool, rule: str, temperature: float, k: int, args) -> dict:
    counts = []
    for i, prompt in enumerate(progress.counted(prompts, f"prompt ({rule})")):
        s = SamplingConfig(temperature, args.top_k, args.top_p, args.seed + i, rule=rule)
        settings = Settings(s, SpecConfig(k=k, k_policy="fixed"), RunConfig(args.max_new_tokens, chat=chat))
        steps = list(request.start(pair, pair.encode(prompt, chat), settings, calibrated=False).steps())
        accepted = sum(s.accepted for s in steps)
        counts.append((accepted, sum(s.accepted < len(s.drafted) for s in steps)))
    accepted, rejections = sum(a for a, _ in counts), sum(r for _, r in counts)
    return dict(
        alpha=accepted / (accepted + rejections) if accepted + rejections else None,
        alpha_ci95=alpha_interval(counts),
        accepted=accepted,
        rejections=rejections,
    )
