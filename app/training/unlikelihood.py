"""Sequence-level unlikelihood (Welleck et al. 2019): an optional last phase of the tiny target's training
that pushes down the tokens of n-grams its own greedy continuations repeat."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from app.data.corpus import Corpus
from app.training.steps import greedy, held_out_loss, next_logits, optimiser, update

# Sequence-level unlikelihood (Welleck et al. 2019), an optional last phase of the target's training
# (--unlikelihood-steps; the shipped target has none): the 7M target looped in 95% of greedy code
# continuations after 7.2M and after 17.9M training tokens alike (model card, Repetition), so more
# of the same objective does not cure it. The phase alternates corpus batches with batches of its
# own greedy continuations, in which every token of a 4-gram that already occurred earlier in the
# continuation is pushed down by -log(1 - p).
UL_NGRAM = 4
UL_BATCH, UL_PREFIX, UL_NEW = 8, 64, 128
UL_LR = 3e-4  # a fine-tune of a trained model: the corpus phase's 2e-3 would undo it


def repeated_ngrams(rows: torch.Tensor, n: int = UL_NGRAM) -> torch.Tensor:
    """(B, T) bool: the tokens of every n-gram that already occurred earlier in its row."""
    mask = torch.zeros_like(rows, dtype=torch.bool)
    for b, row in enumerate(rows.tolist()):
        seen = set()
        for t in range(n - 1, len(row)):
            gram = tuple(row[t - n + 1 : t + 1])
            if gram in seen:
                mask[b, t - n + 1 : t + 1] = True
            seen.add(gram)
    return mask


def unlikelihood_loss(model, rows: torch.Tensor, start: int) -> tuple[torch.Tensor, float]:
    """Mean -log(1 - p) over the repeated tokens of rows[:, start:] (the continuations), and the
    share of continuation tokens that repeat.

    The mean is over the repeated tokens, not over every continuation token as in Welleck et al.'s
    code, so the push stays as strong while repeats grow rare. log(1 - p) is the log-sum-exp of
    every other token's logit minus all of them: 1 - p itself rounds to 0 for a token the model is
    sure of, which is a loop's, and would give it no gradient.
    """
    new = rows[:, start:]
    mask = repeated_ngrams(new)
    logits = next_logits(model, rows)[:, start - 1 :]
    others = logits.scatter(-1, new[..., None], float("-inf"))
    log_not_p = others.logsumexp(-1) - logits.logsumexp(-1)
    loss = -(log_not_p * mask).sum() / mask.sum().clamp(min=1)
    return loss, mask.float().mean().item()


def train_unlikelihood(model, corpus: Corpus, args, log, steps: int) -> dict:
    """The unlikelihood phase: `steps` optimiser steps, every other one on the model's own greedy
    continuations of corpus prefixes, generated afresh as it learns."""
    gen = torch.Generator().manual_seed(args.seed + 1)  # not the corpus phase's batches again
    data = corpus.batches(args.batch, args.ctx, gen)
    prefix = min(UL_PREFIX, args.ctx // 2)
    prefixes = corpus.batches(UL_BATCH, prefix - 1, gen)
    opt, sched = optimiser(model, UL_LR, steps, weight_decay=0.1)
    start, shares = time.time(), []
    for step in tqdm(range(steps), desc="target unlikelihood", mininterval=5):
        if step % 2 == 0:
            x = next(data)
            loss = F.cross_entropy(next_logits(model, x).flatten(0, 1), x[:, 1:].flatten())
        else:
            model.eval()
            with torch.no_grad():
                rows = greedy(model, next(prefixes), min(UL_NEW, args.ctx - prefix))
            model.train()
            loss, share = unlikelihood_loss(model, rows, prefix)
            shares.append(share)
        update(model, opt, sched, loss)
        if step % 50 == 1 or step == steps - 1:
            log(
                dict(
                    model="target",
                    phase="unlikelihood",
                    step=step,
                    loss=round(loss.item(), 4),
                    repeated_share=round(shares[-1], 4) if shares else None,
                    elapsed_s=round(time.time() - start, 1),
                )
            )
    info = dict(
        steps=steps,
        lr=UL_LR,
        ngram=UL_NGRAM,
        train_seconds=round(time.time() - start, 1),
        repeated_share_first=shares[0] if shares else None,
        repeated_share_last=shares[-1] if shares else None,
        held_out_loss=round(held_out_loss(model, corpus.held, args.ctx), 4),
        held_out_loss_packages=round(held_out_loss(model, corpus.held_packages, args.ctx), 4),
    )
    log(dict(done=dict(model="target", phase="unlikelihood") | info))
    return info
