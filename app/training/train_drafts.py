"""Drafts for a pretrained target (the offline default, SmolLM2-135M-Instruct): a feature head
(EAGLE-style, reading the target's own hidden states, with a frequency-ranked draft vocabulary as
in FR-Spec and EAGLE-3) and a small draft model with the target's tokenizer, distilled from it.

    python -m app train --target smollm2                        # both, into assets/models/smollm2
    python -m app train --target smollm2 --only draft-feature   # the feature head alone

The training text is the target's own answers to the instructions in `instructions.py`
(self-distillation: the text the drafts will be asked to predict), plus windows of standard
library code. The target runs once over all of it; its last-layer features and its top-k next
token distributions are kept, so the drafts train without running the target again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from app.models.precision import native_bf16
from app.training.steps import (
    EAGLE1_WEIGHTS,
    TTT_DECAY,
    TTT_DEPTH,
    log_step,
    optimiser,
    soft_ce,
    unrolled,
    update,
    write_whole,
)
from app.training.target_text import (
    ANSWER_TOKENS,
    SAMPLE_TEMPERATURE,
    TINY_SLICE,
    TOP_K,
    Row,
    build_rows,
    sampled_passes,
)

DRAFT_VOCAB = 8192  # the feature head drafts among the target's most frequent tokens only
HEAD_STEPS, HEAD_LR, HEAD_BATCH = 2000, 1e-3, 8
HEAD_NOISE = 0.1  # uniform noise on input features, in units of their standard deviation
TEACHER_TOKENS = 4_000_000  # teacher-forced positions (teacher_forcing.py), beside the target's answers
CHECKPOINT_EVERY = 100  # head steps between checkpoints in the work folder (a stopped run resumes there)
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


def batches(rows: list[Row], batch: int, gen: torch.Generator, crop: int = 0, device: torch.device | None = None):
    """Endless batches of rows (each a random window of at most `crop` tokens when crop > 0), padded on
    the right and moved to `device`: ids, features, top-k, and a mask of real positions."""
    while True:
        pick = [rows[i] for i in torch.randint(0, len(rows), (batch,), generator=gen).tolist()]
        if crop:
            pick = [_crop(r, crop, gen) for r in pick]
        t = max(len(r.ids) for r in pick)

        def pad(x, value=0, t=t):
            return torch.stack([F.pad(r, (0, 0) * (r.dim() - 1) + (0, t - len(r)), value=value) for r in x])

        b = dict(
            ids=pad([r.ids for r in pick]).long(),
            features=pad([r.features for r in pick]).float(),
            top_ids=pad([r.top_ids for r in pick]).long(),
            top_logp=pad([r.top_logp for r in pick]).float(),
            mask=pad([torch.ones(len(r.ids)) for r in pick]),
        )
        yield {name: t.to(device) for name, t in b.items()}


def head_loss(head, embed, w_sub, to_draft, b, noise_scale: float, depth: int = 1) -> tuple[torch.Tensor, dict]:
    """EAGLE-1's loss (SmoothL1 on the next feature plus CE to the target's top-k, on the draft vocabulary)
    at each depth of the training-time test, weighted TTT_DECAY ** j; top1 is depth 0's, top1_deep the last's."""
    f, ids, mask = b["features"], b["ids"], b["mask"]
    valid = mask[:, 1:] * mask[:, :-1]
    inputs = f[:, :-1] + (torch.rand_like(f[:, :-1]) * 2 - 1) * noise_scale
    top = to_draft[b["top_ids"][:, 1:]]  # target ids -> draft-vocabulary rows, -1 where absent
    w_reg, w_ce = EAGLE1_WEIGHTS
    total, weights, parts = 0.0, 0.0, {}
    for j, pred in enumerate(unrolled(head, embed(ids[:, 1:]).detach(), inputs, depth)):
        v = valid.clone()
        v[:, :j] = 0  # depth j drafts from position j on
        reg = (F.smooth_l1_loss(pred, f[:, 1:], reduction="none").mean(-1) * v).sum() / v.sum()
        q_logits = pred @ w_sub.T
        ce = soft_ce(q_logits, top, b["top_logp"][:, 1:], v)
        hit = ((q_logits.argmax(-1) == top[..., 0]).float() * v).sum() / v.sum()
        total = total + TTT_DECAY**j * (w_reg * reg + w_ce * ce)
        weights += TTT_DECAY**j
        parts |= dict(reg=reg.item(), ce=ce.item(), top1=hit.item()) if j == 0 else dict(top1_deep=hit.item())
    return total / weights, parts


def train_head(target, rows: list[Row], vocab: torch.Tensor, steps: int, seed: int, log, work: Path | None = None):
    """A FeatureHead for the target, trained on its stored features; returns (head, info).
    With `work`, a checkpoint is kept there every CHECKPOINT_EVERY steps, and a run with the same
    settings resumes from it."""
    from app.drafts.feature_head import FeatureHead

    torch.manual_seed(seed)
    target.requires_grad_(False)
    device = target.device
    head = FeatureHead(target.config).to(device)
    embed = target.get_input_embeddings()
    rows_of_vocab = vocab.to(device)
    w_sub = target.get_output_embeddings().weight[rows_of_vocab].detach()
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long, device=device)
    to_draft[rows_of_vocab] = torch.arange(len(vocab), device=device)
    noise = HEAD_NOISE * float(torch.cat([r.features[:64].float() for r in rows[:256]]).std())
    opt, sched = optimiser(head, HEAD_LR, steps, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    data, start, first, spent = batches(rows, HEAD_BATCH, gen, device=device), time.time(), 0, 0.0
    settings = dict(steps=steps, depth=TTT_DEPTH, rows=len(rows), vocab=len(vocab), seed=seed)
    checkpoint = work / "head-checkpoint.pt" if work is not None else None
    if checkpoint is not None and checkpoint.is_file():
        first, spent = _resume_head(checkpoint, settings, head, opt, sched, gen, device, log)
    head.train()
    for step in tqdm(range(first, steps), desc="feature head", mininterval=10, initial=first, total=steps):
        b = next(data)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" or native_bf16()):
            loss, parts = head_loss(head, embed, w_sub, to_draft, b, noise, TTT_DEPTH)
        update(head, opt, sched, loss)
        if step % 50 == 0 or step == steps - 1:
            rate = (time.time() - start) / (step + 1 - first)
            log_step(log, "feature head", step, loss, parts | dict(eta_s=rate * (steps - step - 1)), start)
        if checkpoint is not None and (step + 1) % CHECKPOINT_EVERY == 0 and step + 1 < steps:
            state = dict(settings=settings, step=step + 1, head=head.state_dict(), opt=opt.state_dict())
            state |= dict(seconds=spent + time.time() - start)  # a resumed run reports all its steps' time
            state |= dict(sched=sched.state_dict(), gen=gen.get_state(), rng=torch.get_rng_state())
            if device.type == "cuda":  # the input noise is drawn on the GPU
                state["cuda_rng"] = torch.cuda.get_rng_state(device)
            write_whole(checkpoint, lambda tmp, state=state: torch.save(state, tmp))
    head.eval()
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return head, _head_info(head, vocab, steps, spent, start, parts)


def _resume_head(checkpoint: Path, settings: dict, head, opt, sched, gen, device, log) -> tuple[int, float]:
    """(first step, seconds spent) from a checkpoint of the same settings, every state restored; else (0, 0.0)."""
    saved = torch.load(checkpoint, weights_only=False, map_location="cpu")  # load_state_dict moves it
    if saved["settings"] != settings:
        return 0, 0.0
    head.load_state_dict(saved["head"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    gen.set_state(saved["gen"])
    torch.set_rng_state(saved["rng"])
    if device.type == "cuda" and "cuda_rng" in saved:
        torch.cuda.set_rng_state(saved["cuda_rng"], device)
    first, spent = saved["step"], saved.get("seconds", 0.0)
    log(dict(model="feature head", resumed_at=first))
    return first, spent


def _head_info(head, vocab: torch.Tensor, steps: int, spent: float, start: float, parts: dict) -> dict:
    """The head's training record: its settings, seconds spent, size and the last step's losses."""
    return dict(
        steps=steps,
        lr=HEAD_LR,
        batch=HEAD_BATCH,
        loss_weights=EAGLE1_WEIGHTS,
        noise=HEAD_NOISE,
        ttt_depth=TTT_DEPTH,
        ttt_decay=TTT_DECAY,
        draft_vocab=len(vocab),
        train_seconds=round(spent + time.time() - start, 1),
        params=sum(p.numel() for p in head.parameters()),
        last=parts,
    )


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
    model = small_model(target, tokenizer).to(target.device)
    opt, sched = optimiser(model, SMALL_LR, steps, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 7)
    data, start = batches(rows, SMALL_BATCH, gen, SMALL_CROP, target.device), time.time()
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


def writing_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU that has it, or where this CPU has native bf16 (AVX512-BF16 or AMX), else fp32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if native_bf16() else torch.float32


ALIASES = {
    "draft-feature": "feature-head",
    "draft-small": "small",
    "draft-eagle3": "eagle3",
}  # --only takes the folders' names too


def measured_acceptance(target_dir, head_dir: Path, scale: float, device: str | None = None) -> dict:
    """Greedy α at k = 4 in decoding on every held-out suite (acceptance.py); a small --scale (the
    tests', below TINY_SLICE) measures one short request a suite, as a smoke check of the written head."""
    from app import models
    from app.training import acceptance

    # fp32, as the card's `bench --card --dtype fp32`: under the auto dtype a bf16 CPU's near-ties
    # would make the recorded α depend on the machine that trained.
    pair = models.load_pair(str(target_dir), str(head_dir), device, dtype="fp32")
    if scale >= TINY_SLICE:
        return acceptance.suites(pair)
    return acceptance.suites(pair, new_tokens=16, limit=1)


def _by_kind(rows: list[Row]) -> dict[str, int]:
    """Tokens of the rows, by kind (code, chat, writing, ..)."""
    return {k: sum(len(r.ids) for r in rows if r.kind == k) for k in sorted({r.kind for r in rows})}


def teacher_data(source, tokenizer, work: Path, args, device: torch.device, log) -> dict:
    """The teacher-forced shards (teacher_forcing.py) in work/teacher: --text-tokens (by default
    TEACHER_TOKENS times --scale) of text, and the target's own answers (build_rows, shared with the
    EAGLE-1 head and kept in work/), through the fp32 target, whose features the drafts train against."""
    from app.training import teacher_forcing

    dtype = writing_dtype(device)
    writer = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, use_safetensors=True).to(device).eval()
    # The EAGLE-1 head's answers: the target's own text moves α, where human-written text did not.
    rows = build_rows(writer, tokenizer, work, args.seed, args.scale, log)
    chats = [r.ids for r in rows]
    if dtype == torch.float32:  # the writer is the fp32 target already: no second load
        target = writer
    else:
        del writer
        target = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, use_safetensors=True)
        target = target.to(device).eval()
    tokens = args.text_tokens if args.text_tokens is not None else round(TEACHER_TOKENS * args.scale)
    about = dict(
        sampled_passes=sampled_passes(args.scale),
        tokens_by_kind=_by_kind(rows),
        instructions="app/data/instructions.py",
    )
    return teacher_forcing.build(target, tokenizer, work / "teacher", tokens, args.seed, log, chats, about)


def main(args, command: str) -> dict:
    """Build the rows once, then train the members asked for (`--only`: feature-head, small)."""
    from transformers import AutoTokenizer

    from app.models import gguf_target

    out, results = args.out, {}
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "training_log.jsonl").open("a")

    def log(record: dict) -> None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    source = gguf_target.converted_dir() if args.target in ("smollm2", gguf_target.NAME) else args.target
    tokenizer = AutoTokenizer.from_pretrained(source)
    work = args.work or out / "work"
    # The target writes its answers in bf16 where the CPU computes bf16 natively (about twice fp32's
    # speed there); the features it keeps then differ from fp32's by rounding, well below the noise the
    # head trains with. The drafts train against the fp32 target, as the app runs it.
    device = torch.device(args.device)
    only = {ALIASES.get(name, name) for name in args.only or ("feature-head", "small")}
    if "teacher-data" in only:
        results["teacher-data"] = teacher_data(source, tokenizer, work, args, device, log)
    if "eagle3" in only:
        from app.training import eagle3_training

        results["draft-eagle3"] = eagle3_training.build(
            source, tokenizer, work, out, args, command, log, measured_acceptance
        )
    if not only & {"feature-head", "small"}:
        log_file.close()
        return results
    writer = AutoModelForCausalLM.from_pretrained(source, dtype=writing_dtype(device), use_safetensors=True)
    writer = writer.to(device).eval()
    rows = build_rows(writer, tokenizer, work, args.seed, args.scale, log)
    del writer
    target = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, use_safetensors=True)
    target = target.to(device).eval()
    kinds = _by_kind(rows)
    log(dict(rows=len(rows), tokens=kinds))
    data = dict(
        rows=len(rows),
        tokens=kinds,
        instructions="app/data/instructions.py",
        top_k=TOP_K,
        answer_tokens=ANSWER_TOKENS,
        sampled_answers=sampled_passes(args.scale),
        sample_temperature=SAMPLE_TEMPERATURE,
    )
    if "feature-head" in only:
        results["draft-feature"] = _feature_head(source, target, tokenizer, rows, data, args, command, work, log)
    if "small" in only:
        results["draft-small"] = _small_draft(target, tokenizer, rows, data, args, command, log)
    log_file.close()
    return results


def _feature_head(source, target, tokenizer, rows: list[Row], data: dict, args, command: str, work: Path, log) -> dict:
    """Train the feature head, write it to OUT/draft-feature with its acceptance; returns its record."""
    special = [i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if i is not None]
    vocab = draft_vocabulary(rows, min(DRAFT_VOCAB, target.config.vocab_size), target.config.vocab_size, special)
    steps = args.head_steps if args.head_steps is not None else max(1, round(HEAD_STEPS * args.scale))
    head, info = train_head(target, rows, vocab, steps, args.seed, log, work)
    info |= dict(data=data, reads=args.target, command=command, scale=args.scale, device=args.device)
    head.cpu()
    head.draft_vocab = vocab
    head.save(args.out / "draft-feature", info)
    info["acceptance"] = measured_acceptance(source, args.out / "draft-feature", args.scale, args.device)
    head.save(args.out / "draft-feature", info)
    log(dict(model="feature head", acceptance=info["acceptance"]))
    return info


def _small_draft(target, tokenizer, rows: list[Row], data: dict, args, command: str, log) -> dict:
    """Distil the small draft and write it to OUT/draft-small in fp16; returns its record."""
    model, info = train_small(target, tokenizer, rows, max(1, round(SMALL_STEPS * args.scale)), args.seed, log)
    info |= dict(data=data, teacher=args.target, command=command, scale=args.scale, device=args.device)
    dest = args.out / "draft-small"
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=target.config.pad_token_id,
        do_sample=False,
    )
    model.cpu().to(torch.float16).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    (dest / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    return info
