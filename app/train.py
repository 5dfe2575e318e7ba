"""How the bundled model family is made: tokenizer, target and four drafts.

The corpus is the running interpreter's standard library plus the Python sources of the
packages this project installs (tests, vendored and generated files excluded), so the
whole family can be rebuilt offline, on any machine that runs the app, with one command:

    python -m app train --out assets/models
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from app.corpus import Corpus, build_corpus


@dataclass(frozen=True)
class Shape:
    """One member of the family: Llama shape plus how it is trained."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    steps: int  # optimiser steps at the default scale
    lr: float
    distill: bool  # loss adds KL(p_target || q_draft) to cross-entropy
    unlikelihood: bool = False  # --unlikelihood-steps ends its training with that phase (the target's)


FAMILY = (
    Shape("target", 8, 256, 704, 4, 2, steps=3500, lr=2e-3, distill=False, unlikelihood=True),
    # One layer, not two (ninth session): alpha at k = 4 fell from 0.85 to 0.83, but a draft token
    # costs 0.096 of a target token against 0.141, and the code suite went from 1.84x to 2.42x.
    Shape("draft-distilled", 1, 192, 512, 4, 2, steps=1500, lr=2e-3, distill=True),
    Shape("draft-small", 1, 128, 384, 4, 2, steps=1500, lr=2e-3, distill=False),
    Shape("draft-weak", 1, 64, 128, 2, 1, steps=60, lr=2e-3, distill=False),
)
KD_WEIGHT = 0.7  # share of the distilled draft's loss that is KL to the target
# On-policy distillation (as in DistillSpec): after the corpus phase, the distilled draft
# also learns on the target's own greedy continuations, the text it will be asked to predict.
ON_POLICY_BATCHES = 80  # generation batches of the target
ON_POLICY_BATCH, ON_POLICY_PREFIX, ON_POLICY_NEW = 64, 128, 128
ON_POLICY_STEPS = 1500  # extra optimiser steps on those continuations
# Sequence-level unlikelihood (Welleck et al. 2019), an optional last phase of the target's training
# (--unlikelihood-steps; the shipped target has none): the 7M target looped in 95% of greedy code
# continuations after 7.2M and after 17.9M training tokens alike (model card, Repetition), so more
# of the same objective does not cure it. The phase alternates corpus batches with batches of its
# own greedy continuations, in which every token of a 4-gram that already occurred earlier in the
# continuation is pushed down by -log(1 - p).
UL_NGRAM = 4
UL_BATCH, UL_PREFIX, UL_NEW = 8, 64, 128
UL_LR = 3e-4  # a fine-tune of a trained model: the corpus phase's 2e-3 would undo it
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
# (model card, eighth session).
FEATURE_FFN_SHARE = 0.5


def build_model(shape: Shape, tokenizer: PreTrainedTokenizerFast, ctx: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=ctx,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def next_logits(model, x: torch.Tensor) -> torch.Tensor:
    """fp32 logits for every next token of x[:, 1:], computed under bf16 autocast as in training."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=x[:, :-1]).logits.float()


def greedy(model, x: torch.Tensor, new: int) -> torch.Tensor:
    """x followed by exactly `new` greedy tokens of the model (no early stop at EOS)."""
    return model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=model.config.pad_token_id)


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


@torch.inference_mode()
def greedy_continuations(teacher, corpus: Corpus, args, gen: torch.Generator) -> torch.Tensor:
    """(N, prefix + new) rows: corpus prefixes followed by the teacher's greedy continuation."""
    n_batches = max(1, round(ON_POLICY_BATCHES * args.scale))
    prefix, new = min(ON_POLICY_PREFIX, args.ctx // 2), min(ON_POLICY_NEW, args.ctx // 2)
    prefixes = corpus.batches(ON_POLICY_BATCH, prefix - 1, gen)
    rows = []
    for _ in tqdm(range(n_batches), desc="target greedy continuations", mininterval=5):
        x = next(prefixes)
        rows.append(greedy(teacher, x, new))
    return torch.cat(rows)


def row_batches(rows: torch.Tensor, batch: int, gen: torch.Generator):
    while True:
        yield rows[torch.randint(0, len(rows), (batch,), generator=gen)]


def _optimiser(module, lr: float, steps: int, weight_decay: float):
    """AdamW with a 5% linear warm-up, then cosine decay to a tenth of lr at `steps`."""
    warmup = max(1, steps // 20)
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    return opt, sched


def _update(module, opt, sched, loss: torch.Tensor) -> None:
    """One optimiser step with gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    sched.step()


def train_one(shape, model, data, args, log, teacher=None, corpus=None, steps=None, hard=False) -> dict:
    """Train one model; the distilled draft also matches the teacher's distribution.

    hard=True adds cross-entropy to the teacher's argmax, which is what greedy acceptance needs.
    """
    steps = max(1, round((steps or shape.steps) * args.scale))
    opt, sched = _optimiser(model, shape.lr, steps, weight_decay=0.1)
    model.train()
    bar = tqdm(range(steps), desc=shape.name, mininterval=5)
    start = time.time()
    for step in bar:
        x = next(data)
        logits = next_logits(model, x)
        ce = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss = ce
        if teacher is not None:
            with torch.no_grad():
                p_logits = next_logits(teacher, x)
            kl = F.kl_div(
                F.log_softmax(logits, -1).flatten(0, 1), F.log_softmax(p_logits, -1).flatten(0, 1),
                log_target=True, reduction="batchmean",
            )
            if hard:
                ce = F.cross_entropy(logits.flatten(0, 1), p_logits.argmax(-1).flatten())
            loss = (1 - KD_WEIGHT) * ce + KD_WEIGHT * kl
        _update(model, opt, sched, loss)
        if step % 50 == 0 or step == steps - 1:
            bar.set_postfix(ce=f"{ce.item():.3f}")
            log(dict(model=shape.name, step=step, ce=round(ce.item(), 4), loss=round(loss.item(), 4),
                     lr=sched.get_last_lr()[0], elapsed_s=round(time.time() - start, 1)))
    result = dict(
        model=shape.name, steps=steps, tokens_trained=steps * args.batch * args.ctx,
        train_seconds=round(time.time() - start, 1),
        held_out_loss=round(held_out_loss(model, corpus.held, args.ctx), 4) if corpus else None,
        held_out_loss_packages=round(held_out_loss(model, corpus.held_packages, args.ctx), 4) if corpus else None,
        params=sum(p.numel() for p in model.parameters()),
    )
    log(dict(done=result))
    return result


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
    opt, sched = _optimiser(model, UL_LR, steps, weight_decay=0.1)
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
        _update(model, opt, sched, loss)
        if step % 50 == 1 or step == steps - 1:
            log(dict(model="target", phase="unlikelihood", step=step, loss=round(loss.item(), 4),
                     repeated_share=round(shares[-1], 4) if shares else None, elapsed_s=round(time.time() - start, 1)))
    info = dict(steps=steps, lr=UL_LR, ngram=UL_NGRAM, train_seconds=round(time.time() - start, 1),
                repeated_share_first=shares[0] if shares else None, repeated_share_last=shares[-1] if shares else None,
                held_out_loss=round(held_out_loss(model, corpus.held, args.ctx), 4),
                held_out_loss_packages=round(held_out_loss(model, corpus.held_packages, args.ctx), 4))
    log(dict(done=dict(model="target", phase="unlikelihood") | info))
    return info


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


def train_feature_head(target, data, steps: int, lr: float = FEATURE_LR, log=lambda r: None,
                       held: torch.Tensor | None = None, ctx: int = 512, on_policy=None, on_policy_steps: int = 0):
    """A FeatureHead for `target`, trained on its frozen features; returns (head, info).

    `steps` batches come from `data` (the corpus), then `on_policy_steps` from `on_policy` (the
    target's greedy continuations), one schedule over both phases.
    """
    from app.feature_head import FeatureHead

    target.eval().requires_grad_(False)
    ffn = max(32, int(target.config.intermediate_size * FEATURE_FFN_SHARE) // 32 * 32)
    head = FeatureHead(target.config, {"intermediate_size": ffn})
    total = steps + (on_policy_steps if on_policy is not None else 0)
    opt, sched = _optimiser(head, lr, total, weight_decay=0.0)
    start = time.time()
    head.train()
    for step in tqdm(range(total), desc=FEATURE_HEAD, mininterval=5):
        loss, parts = feature_head_loss(head, target, next(data if step < steps else on_policy), FEATURE_NOISE)
        _update(head, opt, sched, loss)
        if step % 50 == 0 or step == total - 1:
            log(dict(model=FEATURE_HEAD, step=step, loss=round(loss.item(), 4),
                     **{k: round(v, 4) for k, v in parts.items()}, elapsed_s=round(time.time() - start, 1)))
    head.eval()
    info = dict(model=FEATURE_HEAD, steps=total, corpus_steps=steps, on_policy_steps=total - steps,
                train_seconds=round(time.time() - start, 1),
                params=sum(p.numel() for p in head.parameters()))
    if held is not None and len(held) > ctx + 1:
        windows = [held[i * ctx : (i + 1) * ctx + 1].long() for i in range(min(8, (len(held) - 1) // ctx))]
        with torch.no_grad():
            parts = [feature_head_loss(head, target, w[None])[1] for w in windows]
        info |= {f"held_out_{k}": round(sum(p[k] for p in parts) / len(parts), 4) for k in parts[0]}
    log(dict(done=info))
    return head, info


def save(model: LlamaForCausalLM, tokenizer, out: Path, info: dict) -> None:
    """Hugging Face format, fp16 safetensors: the loader upcasts to fp32 on CPU."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False,
    )
    model.to(torch.float16).save_pretrained(out)
    model.float()
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m app train", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("assets/models"), help="where the family is written")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512, help="training context length")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every model's step count")
    ap.add_argument("--max-files", type=int, default=0, help="use only the first N corpus files (0: all)")
    ap.add_argument("--no-packages", dest="packages", action="store_false",
                    help="train on the standard library alone (family v1's corpus)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    ap.add_argument("--unlikelihood-steps", type=int, default=0,
                    help="end the target's training with this many steps of sequence-level unlikelihood "
                    "against greedy loops, half of them on its own continuations (model card, Repetition; "
                    "not multiplied by --scale; 0: none, as shipped)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="train only these members (distillation reads the saved target)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # The exact command, so each model's training.json says how it was made.
    command = " ".join(["python -m app train", *map(shlex.quote, sys.argv[2:] if argv is None else argv)])
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "training_log.jsonl"
    log_file = log_path.open("a" if args.only else "w")

    def log(record: dict) -> None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    corpus = build_corpus(args, log)
    tokenizer = corpus.tokenizer

    results = {}
    continuations: torch.Tensor | None = None  # the target's greedy rows: made once, read by both students

    def on_policy(teacher):
        """Batches of the target's greedy continuations, as many tokens a step as a corpus batch."""
        nonlocal continuations
        if continuations is None:
            continuations = greedy_continuations(teacher, corpus, args, torch.Generator().manual_seed(args.seed))
            log(dict(on_policy_rows=len(continuations), on_policy_tokens=continuations.numel()))
        per_step = max(1, args.batch * args.ctx // continuations.shape[1])
        return row_batches(continuations, per_step, torch.Generator().manual_seed(args.seed))

    for shape in FAMILY:
        if args.only and shape.name not in args.only:
            continue
        torch.manual_seed(args.seed)
        model = build_model(shape, tokenizer, args.ctx)
        data = corpus.batches(args.batch, args.ctx, torch.Generator().manual_seed(args.seed))
        # The teacher is the target as shipped (fp16 on disk, fp32 in memory), the one the app runs.
        teacher = load_teacher(args.out / "target") if shape.distill else None
        info = train_one(shape, model, data, args, log, teacher=teacher, corpus=corpus)
        if shape.unlikelihood and args.unlikelihood_steps:
            phase = train_unlikelihood(model, corpus, args, log, args.unlikelihood_steps)
            # The saved model's losses are the phase's; the corpus phase's record stays beside them.
            info = info | dict(corpus_phase=info, unlikelihood=phase, held_out_loss=phase["held_out_loss"],
                               held_out_loss_packages=phase["held_out_loss_packages"],
                               train_seconds=info["train_seconds"] + phase["train_seconds"])
        if teacher is not None:
            phase = train_one(shape, model, on_policy(teacher), args, log, teacher=teacher, corpus=corpus,
                              steps=ON_POLICY_STEPS, hard=True)
            info = phase | dict(corpus_phase=info, on_policy_rows=len(continuations),
                                tokens_trained=info["tokens_trained"] + phase["tokens_trained"])
        info |= dict(shape=asdict(shape), corpus=corpus.manifest,
                     command=command)
        save(model, tokenizer, args.out / shape.name, info)
        results[shape.name] = info
    if not args.only or FEATURE_HEAD in args.only:
        torch.manual_seed(args.seed)
        target = load_teacher(args.out / "target")
        data = corpus.batches(args.batch, args.ctx, torch.Generator().manual_seed(args.seed))
        steps = max(1, round(FEATURE_STEPS * args.scale)), max(1, round(FEATURE_ON_POLICY_STEPS * args.scale))
        head, info = train_feature_head(target, data, steps[0], log=log, held=corpus.held, ctx=args.ctx,
                                        on_policy=on_policy(target), on_policy_steps=steps[1])
        info |= dict(lr=FEATURE_LR, noise=FEATURE_NOISE, loss_weights=FEATURE_WEIGHTS, batch=args.batch,
                     on_policy_rows=len(continuations),
                     tokens_trained=sum(steps) * args.batch * args.ctx,
                     corpus=corpus.manifest, reads="target", layout="EAGLE-1 (fc + one decoder layer)",
                     command=command)
        head.save(args.out / FEATURE_HEAD, info)
        results[FEATURE_HEAD] = info
    log_file.close()
    return results


def load_teacher(path: Path) -> LlamaForCausalLM:
    if not path.exists():
        raise SystemExit(f"the drafts need the target at {path}: train it first (omit --only)")
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


if __name__ == "__main__":
    main()
