"""The tiny family's feature head (EAGLE-1), trained on the frozen target's features as it runs."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from app.training.steps import log_step, optimiser, update

# The feature-level draft (EAGLE-1) trains after the target, on the frozen target's features.
FEATURE_HEAD = "draft-feature"
FEATURE_STEPS, FEATURE_LR = 2000, 2e-3
FEATURE_NOISE = 0.1  # uniform noise on input features, as in EAGLE: drafting reads its own imperfect ones
# Then, as for the distilled draft, steps on the target's own greedy continuations: greedy
# drafting is scored on exactly that text, and first-position acceptance was the head's weak spot.
FEATURE_ON_POLICY_STEPS = 1000
# (feature regression, token cross-entropy), the paper's weights. Token weights of 0.5 and 1.0 agreed
# with the target more on held-out text but accepted less on its continuations (model card).
FEATURE_WEIGHTS = (1.0, 0.1)
# The head's MLP is half the target's: the LM head it shares already costs a third of a target layer
# stack's FLOPs at this width, and the cost per draft token must stay a small fraction of the target's.
# A full-width head (1.0) agreed with the target more on held-out text but drafted no faster here
# (model card).
FEATURE_FFN_SHARE = 0.5


@torch.no_grad()
def target_features(target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, H) last-layer features and (B, T, V) logits of the frozen target over x."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = target(input_ids=x, output_hidden_states=True)
    return out.hidden_states[-1].float(), out.logits.float()


def feature_head_loss(head, target, x: torch.Tensor, noise: float = 0.0) -> tuple[torch.Tensor, dict]:
    """EAGLE-1's loss on one batch: SmoothL1 on predicted features plus CE to the target's p."""
    f, p_logits = target_features(target, x)
    inputs = f[:, :-1]
    if noise:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
    embed = target.get_input_embeddings()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = head(embed(x[:, 1:]).detach(), inputs).float()
    q_logits = target.get_output_embeddings()(pred)
    reg = F.smooth_l1_loss(pred, f[:, 1:])
    p = p_logits[:, 1:].softmax(-1)
    ce = -(p * q_logits.log_softmax(-1)).sum(-1).mean()
    top1 = (q_logits.argmax(-1) == p_logits[:, 1:].argmax(-1)).float().mean()
    w_reg, w_ce = FEATURE_WEIGHTS
    return w_reg * reg + w_ce * ce, dict(reg=reg.item(), ce=ce.item(), top1=top1.item())


def train_feature_head(
    target,
    data,
    steps: int,
    lr: float = FEATURE_LR,
    log=lambda r: None,
    held: torch.Tensor | None = None,
    ctx: int = 512,
    on_policy=None,
    on_policy_steps: int = 0,
):
    """A FeatureHead for `target`, trained on its frozen features; returns (head, info).

    `steps` batches come from `data` (the corpus), then `on_policy_steps` from `on_policy` (the
    target's greedy continuations), one schedule over both phases.
    """
    from app.drafts.feature_head import FeatureHead

    target.eval().requires_grad_(False)
    ffn = max(32, int(target.config.intermediate_size * FEATURE_FFN_SHARE) // 32 * 32)
    head = FeatureHead(target.config, {"intermediate_size": ffn})
    total = steps + (on_policy_steps if on_policy is not None else 0)
    opt, sched = optimiser(head, lr, total, weight_decay=0.0)
    start = time.time()
    head.train()
    for step in tqdm(range(total), desc=FEATURE_HEAD, mininterval=5):
        loss, parts = feature_head_loss(head, target, next(data if step < steps else on_policy), FEATURE_NOISE)
        update(head, opt, sched, loss)
        if step % 50 == 0 or step == total - 1:
            log_step(log, FEATURE_HEAD, step, loss, parts, start)
    head.eval()
    info = dict(
        model=FEATURE_HEAD,
        steps=total,
        corpus_steps=steps,
        on_policy_steps=total - steps,
        train_seconds=round(time.time() - start, 1),
        params=sum(p.numel() for p in head.parameters()),
    )
    if held is not None and len(held) > ctx + 1:
        windows = [held[i * ctx : (i + 1) * ctx + 1].long() for i in range(min(8, (len(held) - 1) // ctx))]
        with torch.no_grad():
            parts = [feature_head_loss(head, target, w[None])[1] for w in windows]
        info |= {f"held_out_{k}": round(sum(p[k] for p in parts) / len(parts), 4) for k in parts[0]}
    log(dict(done=info))
    return head, info
