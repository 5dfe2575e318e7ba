"""The training loop's shared parts: bf16 logits, greedy continuations, held-out loss, AdamW with warm-up
and cosine decay, one clipped update, and files (checkpoints, phases, shards) written whole."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaForCausalLM

from app.core.decoder_layers import through_masked


def next_logits(model, x: torch.Tensor) -> torch.Tensor:
    """fp32 logits for every next token of x[:, 1:], computed under bf16 autocast as in training."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=x[:, :-1]).logits.float()


def greedy(model, x: torch.Tensor, new: int) -> torch.Tensor:
    """x followed by exactly `new` greedy tokens of the model (no early stop at EOS)."""
    return model.generate(
        x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=model.config.pad_token_id
    )


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, stream: torch.Tensor, ctx: int, max_windows: int = 24) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping held-out windows."""
    model.eval()
    losses = []
    for i in range(min(max_windows, (len(stream) - 1) // ctx)):
        x = stream[i * ctx : (i + 1) * ctx + 1].long().unsqueeze(0)
        losses.append(F.cross_entropy(next_logits(model, x)[0], x[0, 1:]).item())
    model.train()
    return sum(losses) / max(len(losses), 1)


def row_batches(rows: torch.Tensor, batch: int, gen: torch.Generator):
    while True:
        yield rows[torch.randint(0, len(rows), (batch,), generator=gen)]


def optimiser(module, lr: float, steps: int, weight_decay: float):
    """AdamW with a 5% linear warm-up, then cosine decay to a tenth of lr at `steps`."""
    warmup = max(1, steps // 20)
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    return opt, sched


def update(module, opt, sched, loss: torch.Tensor) -> None:
    """One optimiser step with gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    sched.step()


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`write` a file to a .tmp beside `path`, then rename it: a stop mid-write leaves the file that was
    there, or none, never a part that a resumed run would read as the whole."""
    tmp = path.with_suffix(".tmp")
    write(tmp)
    tmp.replace(path)


def log_step(log, model: str, step: int, loss: torch.Tensor, parts: dict[str, float], start: float) -> None:
    """One training-log record: the loss, its parts, and seconds since `start`."""
    parts = {k: round(v, 4) for k, v in parts.items()}
    log(dict(model=model, step=step, loss=round(loss.item(), 4), **parts, elapsed_s=round(time.time() - start, 1)))


# EAGLE-3's training-time test: the head is unrolled on its own predicted features, each depth seeing
# what drafting shows it (the target's features up to the round's start, its own ones after), so it
# learns to draft deep and not only the first token. Depth j's loss weighs TTT_DECAY ** j.
TTT_DEPTH, TTT_DECAY = 3, 0.8
# (feature regression, token cross-entropy): EAGLE-1's weights, the EAGLE-1 head's loss and, on
# request, the EAGLE-3 head's.
EAGLE1_WEIGHTS = (1.0, 0.1)


def soft_ce(q_logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of q against the target's top-k distribution, at valid positions; (N, V), (N, K)."""
    lq = q_logits.log_softmax(-1).gather(-1, top_ids.clamp(min=0))
    p = top_logp.exp() * (top_ids >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    return (-(p * lq).sum(-1) * valid).sum() / valid.sum().clamp(min=1)


def ttt_mask(t: int, depth: int, device=None) -> torch.Tensor:
    """(1, 1, t, (depth + 1) t) additive mask of depth `depth`'s queries over the keys of depths 0..depth.

    A pair drafted at depth j and position u sees the pairs of the target's features at positions up to
    u - j, and at each depth i in 1..j the one pair at u - j + i: exactly what a drafting round's cache
    holds. Depth 0 is the causal mask."""
    u = torch.arange(t, device=device)[:, None]
    s = torch.arange(t, device=device)[None]
    allowed = torch.cat([s <= u - depth] + [s == u - depth + i for i in range(1, depth + 1)], dim=-1)
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def unrolled(head, token_embeds: torch.Tensor, features: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The head's (B, T, H) outputs at depths 0..depth-1 under the training-time test: depth 0 reads
    `features` (the target's), each later depth the depth before's outputs, one position on, through
    the same decoder layer (head.fuse puts a token's embedding beside what it reads)."""
    position = torch.arange(features.shape[1], device=features.device)[None]
    cache, f, out = DynamicCache(), features, []
    for j in range(depth):
        mask = ttt_mask(features.shape[1], j, features.device)
        fused = head.fuse(token_embeds, f)
        h = through_masked(head.config, head.body.layers, head.body.rotary_emb, fused, cache, mask, position)
        out.append(h)
        f = F.pad(h[:, :-1], (0, 0, 1, 0))  # the pair at u reads the output made at u - 1
    return out
