"""Drafts for a pretrained target (the offline default, SmolLM2-135M-Instruct): a feature head
(EAGLE-style, reading the target's own hidden states, with a frequency-ranked draft vocabulary as
in FR-Spec and EAGLE-3) and a small draft model with the target's tokenizer, distilled from it.

    python -m app train --target smollm2 --out assets/models/smollm2

The training text is the target's own answers to the instructions in `instructions.py`
(self-distillation: the text the drafts will be asked to predict), plus windows of standard
library code. The target runs once over all of it; its last-layer features and its top-k next
token distributions are kept, so the drafts train without running the target again.
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from app.training.steps import log_step, optimiser, update
from app.training.target_text import ANSWER_TOKENS, SAMPLE_TEMPERATURE, SAMPLED_ANSWERS, TOP_K, Row, build_rows

DRAFT_VOCAB = 8192  # the feature head drafts among the target's most frequent tokens only
HEAD_STEPS, HEAD_LR, HEAD_BATCH = 1500, 1e-3, 8
HEAD_WEIGHTS = (1.0, 0.1)  # (feature regression, token cross-entropy), EAGLE-1's weights
HEAD_NOISE = 0.1  # uniform noise on input features, in units of their standard deviation
SMALL = dict(hidden=192, layers=2, ffn=512, heads=3, kv_heads=1)
SMALL_STEPS, SMALL_LR, SMALL_BATCH = 600, 2e-3, 8
SMALL_CROP = 128  # tokens a row: the full-vocabulary softmax is the small draft's whole training cost
HARD_WEIGHT = 0.5  # share of the small draft's loss on the target's argmax (greedy acceptance's own test)


def draft_vocabulary(rows: list[Row], size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent ids of the training text (ties by id), plus `always`, sorted."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r.ids.long(), minlength=vocab)
        counts += torch.bincount(r.top_ids[:, 0].long(), minlength=vocab)
    counts[always] = counts.max() + 1
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order))


def _crop(r: Row, crop: int, gen: torch.Generator) -> Row:
    if len(r.ids) <= crop:
        return r
    s = int(torch.randint(0, len(r.ids) - crop + 1, (), generator=gen))
    return Row(r.kind, r.ids[s : s + crop], r.features[s : s + crop], r.top_ids[s : s + crop], r.top_logp[s : s + crop])


def batches(rows: list[Row], batch: int, gen: torch.Generator, crop: int = 0):
    """Endless batches of rows (each a random window of at most `crop` tokens when crop > 0), padded on
    the right: ids, features, top-k, and a mask of real positions."""
    while True:
        pick = [rows[i] for i in torch.randint(0, len(rows), (batch,), generator=gen).tolist()]
        if crop:
            pick = [_crop(r, crop, gen) for r in pick]
        t = max(len(r.ids) for r in pick)

        def pad(x, value=0, t=t):
            return torch.stack([F.pad(r, (0, 0) * (r.dim() - 1) + (0, t - len(r)), value=value) for r in x])

        yield dict(
            ids=pad([r.ids for r in pick]).long(),
            features=pad([r.features for r in pick]).float(),
            top_ids=pad([r.top_ids for r in pick]).long(),
            top_logp=pad([r.top_logp for r in pick]).float(),
            mask=pad([torch.ones(len(r.ids)) for r in pick]),
        )


def soft_ce(q_logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of q against the target's top-k distribution, at valid positions; (N, V), (N, K)."""
    lq = q_logits.log_softmax(-1).gather(-1, top_ids.clamp(min=0))
    p = top_logp.exp() * (top_ids >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    return (-(p * lq).sum(-1) * valid).sum() / valid.sum().clamp(min=1)


def head_loss(head, embed, w_sub, to_draft, b, noise_scale: float) -> tuple[torch.Tensor, dict]:
    """EAGLE-1's loss: SmoothL1 on the next feature plus CE to the target's top-k, on the draft vocabulary."""
    f, ids, mask = b["features"], b["ids"], b["mask"]
    valid = mask[:, 1:] * mask[:, :-1]
    inputs = f[:, :-1] + (torch.rand_like(f[:, :-1]) * 2 - 1) * noise_scale
    pred = head(embed(ids[:, 1:]).detach(), inputs)
    reg = (F.smooth_l1_loss(pred, f[:, 1:], reduction="none").mean(-1) * valid).sum() / valid.sum()
    q_logits = pred @ w_sub.T
    top = to_draft[b["top_ids"][:, 1:]]  # target ids -> draft-vocabulary rows, -1 where absent
    ce = soft_ce(q_logits, top, b["top_logp"][:, 1:], valid)
    hit = ((q_logits.argmax(-1) == top[..., 0]).float() * valid).sum() / valid.sum()
    w_reg, w_ce = HEAD_WEIGHTS
    return w_reg * reg + w_ce * ce, dict(reg=reg.item(), ce=ce.item(), top1=hit.item())


def train_head(target, rows: list[Row], vocab: torch.Tensor, steps: int, seed: int, log):
    """A FeatureHead for the target, trained on its stored features; returns (head, info)."""
    from app.drafts.feature_head import FeatureHead

    torch.manual_seed(seed)
    target.requires_grad_(False)
    head = FeatureHead(target.config)
    embed = target.get_input_embeddings()
    w_sub = target.get_output_embeddings().weight[vocab].detach()
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))
    noise = HEAD_NOISE * float(torch.cat([r.features[:64].float() for r in rows[:256]]).std())
    opt, sched = optimiser(head, HEAD_LR, steps, weight_decay=0.0)
    data, start = batches(rows, HEAD_BATCH, torch.Generator().manual_seed(seed)), time.time()
    head.train()
    for step in tqdm(range(steps), desc="feature head", mininterval=10):
        loss, parts = head_loss(head, embed, w_sub, to_draft, next(data), noise)
        update(head, opt, sched, loss)
        if step % 50 == 0 or step == steps - 1:
            log_step(log, "feature head", step, loss, parts, start)
    head.eval()
    info = dict(
        steps=steps,
        lr=HEAD_LR,
        batch=HEAD_BATCH,
        loss_weights=HEAD_WEIGHTS,
        noise=HEAD_NOISE,
        draft_vocab=len(vocab),
        train_seconds=round(time.time() - start, 1),
        params=sum(p.numel() for p in head.parameters()),
        last=parts,
    )
    return head, info


def small_model(target, tokenizer) -> LlamaForCausalLM:
    """The small draft, its embedding started from the target's projected onto its top principal axes."""
    s = SMALL
    config = LlamaConfig(
        vocab_size=target.config.vocab_size,
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=target.config.max_position_embeddings,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=target.config.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        w = target.get_input_embeddings().weight.float()
        centred = w - w.mean(0)
        _, _, v = torch.linalg.svd(centred[torch.randperm(len(w))[:8192]], full_matrices=False)
        e = centred @ v[: s["hidden"]].T
        model.get_input_embeddings().weight.copy_(e / e.std() * 0.05)
    return model


def train_small(target, tokenizer, rows: list[Row], steps: int, seed: int, log):
    """The small draft, distilled: soft CE to the target's top-k plus CE to its argmax."""
    torch.manual_seed(seed)
    model = small_model(target, tokenizer)
    opt, sched = optimiser(model, SMALL_LR, steps, weight_decay=0.0)
    data, start = batches(rows, SMALL_BATCH, torch.Generator().manual_seed(seed + 7), SMALL_CROP), time.time()
    model.train()
    for step in tqdm(range(steps), desc="small draft", mininterval=10):
        b = next(data)
        valid = b["mask"][:, :-1] * b["mask"][:, 1:]
        logits = model(input_ids=b["ids"][:, :-1], attention_mask=b["mask"][:, :-1].long()).logits
        top, lp = b["top_ids"][:, :-1], b["top_logp"][:, :-1]
        soft = soft_ce(logits, top, lp, valid)
        hard = (F.cross_entropy(logits.transpose(1, 2), top[..., 0], reduction="none") * valid).sum() / valid.sum()
        loss = HARD_WEIGHT * hard + (1 - HARD_WEIGHT) * soft
        update(model, opt, sched, loss)
        if step % 50 == 0 or step == steps - 1:
            hit = ((logits.argmax(-1) == top[..., 0]).float() * valid).sum() / valid.sum()
            log_step(log, "small draft", step, loss, dict(hard=hard.item(), top1=hit.item()), start)
    model.eval()
    info = dict(
        steps=steps,
        lr=SMALL_LR,
        batch=SMALL_BATCH,
        crop=SMALL_CROP,
        shape=SMALL,
        hard_weight=HARD_WEIGHT,
        train_seconds=round(time.time() - start, 1),
        params=sum(p.numel() for p in model.parameters()),
    )
    return model, info


def main(args, command: str) -> dict:
    """Build the rows once, then train the members asked for (`--only`: feature-head, small)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.models import gguf_target

    out, results = args.out, {}
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "training_log.jsonl").open("a")

    def log(record: dict) -> None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    source = gguf_target.converted_dir() if args.target in ("smollm2", gguf_target.NAME) else args.target
    target = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    work = args.work or out / "work"
    rows = build_rows(target, tokenizer, work, args.seed, args.scale, log)
    kinds = {k: sum(len(r.ids) for r in rows if r.kind == k) for k in sorted({r.kind for r in rows})}
    log(dict(rows=len(rows), tokens=kinds))
    data = dict(
        rows=len(rows),
        tokens=kinds,
        instructions="app/instructions.py",
        top_k=TOP_K,
        answer_tokens=ANSWER_TOKENS,
        sampled_answers=SAMPLED_ANSWERS,
        sample_temperature=SAMPLE_TEMPERATURE,
    )
    only = set(args.only or ("feature-head", "small"))
    if "feature-head" in only:
        special = [i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if i is not None]
        vocab = draft_vocabulary(rows, min(DRAFT_VOCAB, target.config.vocab_size), target.config.vocab_size, special)
        head, info = train_head(target, rows, vocab, max(1, round(HEAD_STEPS * args.scale)), args.seed, log)
        info |= dict(data=data, reads=args.target, command=command)
        head.draft_vocab = vocab
        head.save(out / "draft-feature", info)
        results["draft-feature"] = info
    if "small" in only:
        model, info = train_small(target, tokenizer, rows, max(1, round(SMALL_STEPS * args.scale)), args.seed, log)
        info |= dict(data=data, teacher=args.target, command=command)
        dest = out / "draft-small"
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=target.config.pad_token_id,
            do_sample=False,
        )
        model.to(torch.float16).save_pretrained(dest)
        tokenizer.save_pretrained(dest)
        (dest / "training.json").write_text(json.dumps(info, indent=1) + "\n")
        results["draft-small"] = info
    log_file.close()
    return results
