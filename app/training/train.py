"""How the bundled model family is made: tokenizer, target and four drafts.

The corpus is the running interpreter's standard library plus the Python sources of the
packages this project installs (tests, vendored and generated files excluded), so the
whole family can be rebuilt offline, on any machine that runs the app, with one command:

    python -m app train --out assets/models
"""

from __future__ import annotations

import argparse
import json
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

from app.data.corpus import Corpus, build_corpus
from app.training.feature_training import (  # noqa: F401 - the family's command and tests read them here
    FEATURE_HEAD,
    FEATURE_LR,
    FEATURE_NOISE,
    FEATURE_ON_POLICY_STEPS,
    FEATURE_STEPS,
    FEATURE_WEIGHTS,
    train_feature_head,
)
from app.training.steps import greedy, held_out_loss, next_logits, optimiser, row_batches, update
from app.training.unlikelihood import repeated_ngrams, train_unlikelihood, unlikelihood_loss  # noqa: F401


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
    # One layer, not two: alpha falls a little, but a draft token costs much less (model card).
    Shape("draft-distilled", 1, 192, 512, 4, 2, steps=1500, lr=2e-3, distill=True),
    Shape("draft-small", 1, 128, 384, 4, 2, steps=1500, lr=2e-3, distill=False),
    Shape("draft-weak", 1, 64, 128, 2, 1, steps=60, lr=2e-3, distill=False),
)
KD_WEIGHT = 0.7  # share of the distilled draft's loss that is KL to the target
# A GPU has the throughput for more of the target's own text and more steps than 2 cores can give in
# a session, so --target there defaults to four times the steps and the sampled answers.
GPU_SCALE = 4.0
# On-policy distillation (as in DistillSpec): after the corpus phase, the distilled draft
# also learns on the target's own greedy continuations, the text it will be asked to predict.
ON_POLICY_BATCHES = 80  # generation batches of the target
ON_POLICY_BATCH, ON_POLICY_PREFIX, ON_POLICY_NEW = 64, 128, 128
ON_POLICY_STEPS = 1500  # extra optimiser steps on those continuations


def build_model(shape: Shape, tokenizer: PreTrainedTokenizerFast, ctx: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=ctx,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


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


def train_one(shape, model, data, args, log, teacher=None, corpus=None, steps=None, hard=False) -> dict:
    """Train one model; the distilled draft also matches the teacher's distribution.

    hard=True adds cross-entropy to the teacher's argmax, which is what greedy acceptance needs.
    """
    steps = max(1, round((steps or shape.steps) * args.scale))
    opt, sched = optimiser(model, shape.lr, steps, weight_decay=0.1)
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
                F.log_softmax(logits, -1).flatten(0, 1),
                F.log_softmax(p_logits, -1).flatten(0, 1),
                log_target=True,
                reduction="batchmean",
            )
            if hard:
                ce = F.cross_entropy(logits.flatten(0, 1), p_logits.argmax(-1).flatten())
            loss = (1 - KD_WEIGHT) * ce + KD_WEIGHT * kl
        update(model, opt, sched, loss)
        if step % 50 == 0 or step == steps - 1:
            bar.set_postfix(ce=f"{ce.item():.3f}")
            log(
                dict(
                    model=shape.name,
                    step=step,
                    ce=round(ce.item(), 4),
                    loss=round(loss.item(), 4),
                    lr=sched.get_last_lr()[0],
                    elapsed_s=round(time.time() - start, 1),
                )
            )
    result = dict(
        model=shape.name,
        steps=steps,
        tokens_trained=steps * args.batch * args.ctx,
        train_seconds=round(time.time() - start, 1),
        held_out_loss=round(held_out_loss(model, corpus.held, args.ctx), 4) if corpus else None,
        held_out_loss_packages=round(held_out_loss(model, corpus.held_packages, args.ctx), 4) if corpus else None,
        params=sum(p.numel() for p in model.parameters()),
    )
    log(dict(done=result))
    return result


def save(model: LlamaForCausalLM, tokenizer, out: Path, info: dict) -> None:
    """Hugging Face format, fp16 safetensors: the loader upcasts to fp32 on CPU."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.to(torch.float16).save_pretrained(out)
    model.float()
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m app train",
        description=__doc__.splitlines()[0] + " With --target, a pretrained target's drafts instead: a feature "
        "head and a small draft, from the target's own answers (resumable: run it again to go on).",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the models are written (default assets/models, with --target smollm2 assets/models/smollm2)",
    )
    _add_training_args(ap)
    ap.add_argument("--max-files", type=int, default=0, help="use only the first N corpus files (0: all)")
    ap.add_argument(
        "--no-packages",
        dest="packages",
        action="store_false",
        help="train on the standard library alone (family v1's corpus)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    ap.add_argument(
        "--unlikelihood-steps",
        type=int,
        default=0,
        help="end the target's training with this many steps of sequence-level unlikelihood "
        "against greedy loops, half of them on its own continuations (model card, Repetition; "
        "not multiplied by --scale; 0: none, as shipped)",
    )
    _add_member_args(ap)
    return ap.parse_args(argv)


def _add_training_args(ap: argparse.ArgumentParser) -> None:
    """Add how every model trains: the seed, the tiny family's sizes, the step count and the device."""
    ap.add_argument("--seed", type=int, default=0, help="seed of the data's order, sampled answers and weights")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512, help="training context length")
    ap.add_argument("--batch", type=int, default=4, help="the tiny family's batch size")
    ap.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiplies every model's step count; with --target its whole part multiplies the sampled "
        "answers too (default 1; with --target on a GPU, 4)",
    )
    ap.add_argument(
        "--device",
        default=None,
        help="with --target: where the target writes and the drafts train (default cuda when present, else cpu)",
    )


def _add_member_args(ap: argparse.ArgumentParser) -> None:
    """Add which members are trained, for which target, and where that target's data is kept."""
    ap.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="train only these members (distillation reads the saved target; with --target: draft-feature, "
        "draft-small, teacher-data (the teacher-forced shards alone), draft-eagle3)",
    )
    ap.add_argument(
        "--target",
        default=None,
        help="train drafts for this pretrained target instead of the tiny family: 'smollm2' (the "
        "wheel's SmolLM2-135M-Instruct) or a local model directory",
    )
    ap.add_argument(
        "--text-tokens",
        type=int,
        default=None,
        help="with --only teacher-data: the teacher-forced positions of text beside the target's answers "
        "(default 4M times --scale; 0: the answers alone)",
    )
    ap.add_argument(
        "--head-steps",
        type=int,
        default=None,
        help="with --target: the feature head's and EAGLE-3 head's optimiser steps, whatever --scale "
        "(default their own count times --scale; more data wants more steps than the scale gives on a CPU)",
    )
    ap.add_argument(
        "--feature-regression",
        action="store_true",
        help="with --only eagle3: add EAGLE-1's feature regression to EAGLE-3's loss (what the head's LM "
        "head reads, pulled onto the target's next last-layer feature; weights 1.0 and 0.1 as the "
        "EAGLE-1 head's)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=None,
        help="with --target: where the target's answers and features are kept (default OUT/work)",
    )


class _Family:
    """One run of the family's command: the corpus, the log, and the target's continuations (made once)."""

    def __init__(self, args, command: str):
        self.args, self.command = args, command
        args.out.mkdir(parents=True, exist_ok=True)
        self.log_file = (args.out / "training_log.jsonl").open("a" if args.only else "w")
        self.corpus = build_corpus(args, self.log)
        self.continuations: torch.Tensor | None = None  # the target's greedy rows, read by both students

    def log(self, record: dict) -> None:
        self.log_file.write(json.dumps(record) + "\n")
        self.log_file.flush()

    def on_policy(self, teacher):
        """Batches of the target's greedy continuations, as many tokens a step as a corpus batch."""
        args = self.args
        if self.continuations is None:
            gen = torch.Generator().manual_seed(args.seed)
            self.continuations = greedy_continuations(teacher, self.corpus, args, gen)
            self.log(dict(on_policy_rows=len(self.continuations), on_policy_tokens=self.continuations.numel()))
        per_step = max(1, args.batch * args.ctx // self.continuations.shape[1])
        return row_batches(self.continuations, per_step, torch.Generator().manual_seed(args.seed))

    def member(self, shape: Shape) -> dict:
        """Train and save one model of FAMILY; its training.json record."""
        args, corpus = self.args, self.corpus
        torch.manual_seed(args.seed)
        model = build_model(shape, corpus.tokenizer, args.ctx)
        data = corpus.batches(args.batch, args.ctx, torch.Generator().manual_seed(args.seed))
        # The teacher is the target as shipped (fp16 on disk, fp32 in memory), the one the app runs.
        teacher = load_teacher(args.out / "target") if shape.distill else None
        info = train_one(shape, model, data, args, self.log, teacher=teacher, corpus=corpus)
        if shape.unlikelihood and args.unlikelihood_steps:
            phase = train_unlikelihood(model, corpus, args, self.log, args.unlikelihood_steps)
            # The saved model's losses are the phase's; the corpus phase's record stays beside them.
            info = info | dict(
                corpus_phase=info,
                unlikelihood=phase,
                held_out_loss=phase["held_out_loss"],
                held_out_loss_packages=phase["held_out_loss_packages"],
                train_seconds=info["train_seconds"] + phase["train_seconds"],
            )
        if teacher is not None:
            phase = train_one(
                shape,
                model,
                self.on_policy(teacher),
                args,
                self.log,
                teacher=teacher,
                corpus=corpus,
                steps=ON_POLICY_STEPS,
                hard=True,
            )
            info = phase | dict(
                corpus_phase=info,
                on_policy_rows=len(self.continuations),
                tokens_trained=info["tokens_trained"] + phase["tokens_trained"],
            )
        info |= dict(shape=asdict(shape), corpus=corpus.manifest, command=self.command)
        save(model, corpus.tokenizer, args.out / shape.name, info)
        return info

    def feature_head(self) -> dict:
        """Train and save the feature head on the saved target."""
        args, corpus = self.args, self.corpus
        torch.manual_seed(args.seed)
        target = load_teacher(args.out / "target")
        data = corpus.batches(args.batch, args.ctx, torch.Generator().manual_seed(args.seed))
        steps = max(1, round(FEATURE_STEPS * args.scale)), max(1, round(FEATURE_ON_POLICY_STEPS * args.scale))
        head, info = train_feature_head(
            target,
            data,
            steps[0],
            log=self.log,
            held=corpus.held,
            ctx=args.ctx,
            on_policy=self.on_policy(target),
            on_policy_steps=steps[1],
        )
        info |= dict(
            lr=FEATURE_LR,
            noise=FEATURE_NOISE,
            loss_weights=FEATURE_WEIGHTS,
            batch=args.batch,
            on_policy_rows=len(self.continuations),
            tokens_trained=sum(steps) * args.batch * args.ctx,
            corpus=corpus.manifest,
            reads="target",
            layout="EAGLE-1 (fc + one decoder layer)",
            command=self.command,
        )
        head.save(args.out / FEATURE_HEAD, info)
        return info


def main(argv=None) -> dict:
    args = parse_args(argv)
    # The exact command, so each model's training.json says how it was made.
    command = " ".join(["python -m app train", *map(shlex.quote, sys.argv[2:] if argv is None else argv)])
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.out is None:
        args.out = Path("assets/models/smollm2" if args.target == "smollm2" else "assets/models")
    if args.target:
        from app.training import train_drafts

        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            raise SystemExit(f"--device {args.device!r}: {e}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: this torch build sees no CUDA device")
        if args.scale is None:
            args.scale = GPU_SCALE if device.type == "cuda" else 1.0
        if args.head_steps is not None and args.head_steps < 1:
            raise SystemExit(f"--head-steps must be at least 1, got {args.head_steps}")
        return train_drafts.main(args, command)
    args.scale = 1.0 if args.scale is None else args.scale
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    family = _Family(args, command)
    results = {shape.name: family.member(shape) for shape in FAMILY if not args.only or shape.name in args.only}
    if not args.only or FEATURE_HEAD in args.only:
        results[FEATURE_HEAD] = family.feature_head()
    family.log_file.close()
    return results


def load_teacher(path: Path) -> LlamaForCausalLM:
    if not path.exists():
        raise SystemExit(f"the drafts need the target at {path}: train it first (omit --only)")
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


if __name__ == "__main__":
    main()
