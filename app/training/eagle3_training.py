"""Training an EAGLE-3 head (drafts/eagle3_head.py) on teacher-forced shards (teacher_forcing.py).

Each batch is rows of text with the target's fused features and its top-k next tokens at every
position. The loss is EAGLE-3's: soft cross-entropy of q against the target's top-k, at each depth of
the training-time test (depth j reads depth j-1's own h, one position on, as drafting does). On request
(`--feature-regression`) EAGLE-1's feature regression joins it. A checkpoint every CHECKPOINT_EVERY
steps lets a stopped run resume.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from app.models.precision import native_bf16
from app.training import teacher_forcing
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

LR = 1e-3
BATCH = 8  # rows a step
CROP = 128  # tokens a row a step: a random window of each shard row
CHECKPOINT_EVERY = 100
STEPS = 4000  # about one pass over 4M teacher-forced positions; --scale multiplies it
DRAFT_VOCAB = 8192
CHAT_REPEATS = 3
# (feature regression, token cross-entropy). EAGLE-3's own loss has no regression: h is free to be
# whatever drafts best. With regression, what the head's LM head reads (readout(h)) is pulled onto the
# target's last-layer feature at the position it drafts for, weighted as the EAGLE-1 head's loss is.
# On equal answers the EAGLE-1 head, which keeps the term, accepted more than this head without it;
# the term is the difference under test.
EAGLE3_WEIGHTS = (0.0, 1.0)


def vocabulary(folder: Path, size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The `size` ids the target most often puts first in the shards (ties by id), plus `always`, sorted."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for path in teacher_forcing.shards(folder):
        counts += torch.bincount(teacher_forcing.read(path)["top_ids"][..., 0].reshape(-1).long(), minlength=vocab)
    counts[always] = counts.max() + 1
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order))


def batches(folder: Path, batch: int, crop: int, gen: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of `crop`-token windows of shard rows, a shard at a time in a seeded order; each
    chat shard comes CHAT_REPEATS times a pass over the text shards."""
    chats, texts = teacher_forcing.shards(folder, "chat"), teacher_forcing.shards(folder, "text")
    # The chats are the text a head drafts in the app, and a small part of the positions.
    paths = chats * CHAT_REPEATS + texts
    if not paths:
        raise SystemExit(f"no teacher-forced shards in {folder}: build them first (--only teacher-data)")
    while True:
        for i in torch.randperm(len(paths), generator=gen).tolist():
            shard = teacher_forcing.read(paths[i])
            rows = len(shard["ids"])
            for first in range(0, rows - batch + 1, batch):
                pick = torch.randperm(rows, generator=gen)[first : first + batch]
                t = shard["ids"].shape[1]
                start = int(torch.randint(0, max(1, t - crop + 1), (), generator=gen))
                window = slice(start, start + crop)
                yield {k: v[pick][:, window] for k, v in shard.items()}


def loss(
    head,
    embed,
    to_draft: torch.Tensor,
    b: dict,
    depth: int = TTT_DEPTH,
    loss_weights: tuple[float, float] = EAGLE3_WEIGHTS,
) -> tuple[torch.Tensor, dict]:
    """The loss on one batch, at each depth weighted TTT_DECAY ** j: soft CE of q to the target's top-k,
    and with a regression weight, SmoothL1 of readout(h) to the target's next feature; top1 is depth 0's
    agreement with the target's argmax, top1_deep the last depth's."""
    ids, fused = b["ids"].long(), b["fused"].float()
    top = to_draft[b["top_ids"][:, 1:].long()]  # target ids -> draft-vocabulary rows, -1 where absent
    top_logp = b["top_logp"][:, 1:].float()
    w_reg, w_ce = loss_weights
    total, weights, parts = 0.0, 0.0, {}
    for j, h in enumerate(unrolled(head, embed(ids[:, 1:]).detach(), fused[:, :-1], depth)):
        valid = torch.ones(h.shape[:2], device=h.device)
        valid[:, :j] = 0  # depth j drafts from position j on
        read = head.readout(h)
        q_logits = head.lm_head(read)
        ce = soft_ce(q_logits, top, top_logp, valid)
        hit = ((q_logits.argmax(-1) == top[..., 0]).float() * valid).sum() / valid.sum()
        term, step_parts = w_ce * ce, dict(ce=ce.item(), top1=hit.item())
        if w_reg:
            gap = F.smooth_l1_loss(read.float(), b["features"][:, 1:].float(), reduction="none").mean(-1)
            reg = (gap * valid).sum() / valid.sum()
            term = term + w_reg * reg
            step_parts["reg"] = reg.item()
        total = total + TTT_DECAY**j * term
        weights += TTT_DECAY**j
        parts |= step_parts if j == 0 else dict(top1_deep=hit.item())
    return total / weights, parts


def train(
    target,
    folder: Path,
    vocab: torch.Tensor,
    steps: int,
    seed: int,
    log,
    work: Path | None = None,
    regression: bool = False,
):
    """An Eagle3Head for the target from the shards in `folder`, with EAGLE-1's feature regression if
    `regression`; returns (head, info). With `work`, a checkpoint is kept there and a run with the
    same settings resumes from it."""
    from app.drafts.eagle3_head import Eagle3Head

    torch.manual_seed(seed)
    target.requires_grad_(False)
    device = target.device
    # bf16 only where the CPU computes it natively or on a GPU: emulated on AVX-512, it is slower than fp32
    autocast = device.type == "cuda" or native_bf16()
    head = Eagle3Head(target.config, vocab).to(device)
    with torch.no_grad():  # q starts as the target's own LM head over the draft vocabulary
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab])
        head.body.norm.weight.copy_(target.model.norm.weight)
    embed = target.get_input_embeddings()
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))
    to_draft = to_draft.to(device)
    opt, sched = optimiser(head, LR, steps, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    loss_weights = EAGLE1_WEIGHTS if regression else EAGLE3_WEIGHTS
    settings = dict(
        steps=steps,
        loss_weights=list(loss_weights),
        depth=TTT_DEPTH,
        vocab=len(vocab),
        seed=seed,
        shards=len(teacher_forcing.shards(folder)),
        chat_repeats=CHAT_REPEATS,
    )
    checkpoint = work / "eagle3-checkpoint.pt" if work is not None else None
    first, spent = _resume(checkpoint, settings, head, opt, sched, log)
    data, start = batches(folder, BATCH, CROP, gen), time.time()
    for _ in range(first):  # a resumed run replays the seeded order past the batches it has seen
        next(data)
    head.train()
    for step in tqdm(range(first, steps), desc="eagle-3 head", mininterval=10, initial=first, total=steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            b = {k: v.to(device) for k, v in next(data).items()}
            value, parts = loss(head, embed, to_draft, b, loss_weights=loss_weights)
        update(head, opt, sched, value)
        if step % 50 == 0 or step == steps - 1:
            log_step(log, "eagle-3 head", step, value, parts, start)
        if checkpoint is not None and (step + 1) % CHECKPOINT_EVERY == 0 and step + 1 < steps:
            _save(checkpoint, settings, step + 1, head, opt, sched, spent, start)
    head.eval()
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return head, _info(head, vocab, steps, spent, start, parts, loss_weights)


def _resume(checkpoint: Path | None, settings: dict, head, opt, sched, log) -> tuple[int, float]:
    """(first step, seconds spent): from a checkpoint of a run with the same settings, loaded into the
    head, optimiser and schedule; (0, 0.0) where there is none."""
    first, spent = 0, 0.0
    if checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=False)
        if saved["settings"] == settings:
            head.load_state_dict(saved["head"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
            first, spent = saved["step"], saved["seconds"]
            log(dict(model="eagle-3 head", resumed_at=first))
        else:  # another run's (other steps, loss or shards): it is overwritten at the first checkpoint
            log(dict(model="eagle-3 head", started_anew=True, checkpoint_of=saved["settings"]))
    return first, spent


def _save(checkpoint: Path, settings: dict, step: int, head, opt, sched, spent: float, start: float) -> None:
    """Write the checkpoint to resume at `step`: to a .tmp file first, so a stop mid-write keeps the last one."""
    state = dict(settings=settings, step=step, head=head.state_dict(), opt=opt.state_dict())
    state |= dict(sched=sched.state_dict(), seconds=spent + time.time() - start)
    write_whole(checkpoint, lambda tmp: torch.save(state, tmp))


def _info(
    head, vocab: torch.Tensor, steps: int, spent: float, start: float, parts: dict, loss_weights: tuple[float, float]
) -> dict:
    """The training record written with the head: settings, seconds spent, size and the last step's losses."""
    return dict(
        steps=steps,
        lr=LR,
        batch=BATCH,
        crop=CROP,
        chat_repeats=CHAT_REPEATS,
        loss_weights=list(loss_weights),
        ttt_depth=TTT_DEPTH,
        ttt_decay=TTT_DECAY,
        draft_vocab=len(vocab),
        feature_layers=list(head.feature_layers),
        train_seconds=round(spent + time.time() - start, 1),
        params=sum(p.numel() for p in head.parameters()),
        last=parts,
    )


def build(source, tokenizer, work: Path, out: Path, args, command: str, log, measure) -> dict:
    """`train --target T --only eagle3`: the head from the shards in work/teacher, written to
    out/draft-eagle3 in vLLM's EAGLE-3 layout with its training record and acceptance (`measure`)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, use_safetensors=True)
    target = target.to(torch.device(args.device)).eval()
    folder = work / "teacher"
    special = [i for i in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if i is not None]
    size = min(DRAFT_VOCAB, target.config.vocab_size)
    vocab = vocabulary(folder, size, target.config.vocab_size, special)
    steps = args.head_steps if args.head_steps is not None else max(1, round(STEPS * args.scale))
    head, info = train(target, folder, vocab, steps, args.seed, log, work, args.feature_regression)
    head = head.cpu()  # written from the host (measured on --device below)
    manifest = folder / "manifest.json"
    info |= dict(reads=args.target, command=command, scale=args.scale)
    info["data"] = json.loads(manifest.read_text()) if manifest.is_file() else None
    info["trained_on"] = teacher_forcing.built(folder)  # positions by kind: a build may have stopped early
    dest = out / "draft-eagle3"
    head.save(dest, info)
    info["acceptance"] = measure(source, dest, args.scale, args.device)  # on --device, as the steps ran
    head.save(dest, info)
    log(dict(model="eagle-3 head", acceptance=info["acceptance"]))
    return info
