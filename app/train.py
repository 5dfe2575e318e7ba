"""How the bundled model family is made: tokenizer, target and three drafts.

The corpus is the running interpreter's standard library (tests excluded), so the
whole family can be rebuilt offline with one command:

    python -m app train --out assets/models
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|endoftext|>", "<|pad|>"

# Files never seen in training: the model card's held-out figures come from these.
HELD_OUT = (
    "textwrap.py", "heapq.py", "fnmatch.py", "colorsys.py", "shlex.py",
    "glob.py", "calendar.py", "sched.py", "queue.py", "bisect.py",
)


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


FAMILY = (
    Shape("target", 8, 384, 1024, 6, 2, steps=3000, lr=1e-3, distill=False),
    Shape("draft-distilled", 2, 192, 512, 4, 2, steps=1500, lr=2e-3, distill=True),
    Shape("draft-small", 1, 128, 384, 4, 2, steps=1500, lr=2e-3, distill=False),
    Shape("draft-weak", 1, 64, 128, 2, 1, steps=60, lr=2e-3, distill=False),
)
KD_WEIGHT = 0.7  # share of the distilled draft's loss that is KL to the target
# On-policy distillation (as in DistillSpec): after the corpus phase, the distilled draft
# also learns on the target's own greedy continuations, the text it will be asked to predict.
ON_POLICY_BATCHES = 80  # generation batches of the target
ON_POLICY_BATCH, ON_POLICY_PREFIX, ON_POLICY_NEW = 64, 128, 128
ON_POLICY_STEPS = 1500  # extra optimiser steps on those continuations


def stdlib_files(root: Path | None = None) -> list[Path]:
    """All .py files of the standard library except tests and site-packages, sorted."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] == "site-packages" or any(
            p in ("test", "tests", "idle_test") or p.startswith("test_") for p in parts
        ):
            continue
        files.append(path)
    return files


def split_corpus(files: list[Path]) -> tuple[list[str], list[str]]:
    """Read files as text; return (train texts, held-out texts)."""
    train, held = [], []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        is_held = len(path.parts) >= 2 and path.name in HELD_OUT and path.parent.name.startswith("python")
        (held if is_held else train).append(text)
    return train, held


def pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # A newline and the indentation after it must stay separate tokens: merged, "\n"
    # at the end of a prompt would rarely be followed by the indented body in training.
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), "isolated"),
        pre_tokenizers.Split(Regex(r"^[ \t]+"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE whose special tokens are <|bos|>, <|endoftext|> (EOS) and <|pad|>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=1024, clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One long 1-D stream: BOS file EOS BOS file EOS ..."""
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += [tokenizer.bos_token_id, *enc, tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def build_model(shape: Shape, tokenizer: PreTrainedTokenizerFast, ctx: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=ctx,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def batches(stream: torch.Tensor, batch: int, ctx: int, gen: torch.Generator):
    """Endless random windows of ctx+1 tokens, reproducible from gen."""
    while True:
        starts = torch.randint(0, len(stream) - ctx - 1, (batch,), generator=gen)
        yield torch.stack([stream[s : s + ctx + 1] for s in starts.tolist()])


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, stream: torch.Tensor, ctx: int, max_windows: int = 24) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping held-out windows."""
    model.eval()
    losses = []
    for i in range(min(max_windows, (len(stream) - 1) // ctx)):
        x = stream[i * ctx : (i + 1) * ctx + 1].unsqueeze(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits.float()
        losses.append(F.cross_entropy(logits[0], x[0, 1:]).item())
    model.train()
    return sum(losses) / max(len(losses), 1)


@torch.inference_mode()
def greedy_continuations(teacher, stream: torch.Tensor, args, gen: torch.Generator) -> torch.Tensor:
    """(N, prefix + new) rows: corpus prefixes followed by the teacher's greedy continuation."""
    n_batches = max(1, round(ON_POLICY_BATCHES * args.scale))
    prefix, new = min(ON_POLICY_PREFIX, args.ctx // 2), min(ON_POLICY_NEW, args.ctx // 2)
    rows = []
    for _ in tqdm(range(n_batches), desc="target greedy continuations", mininterval=5):
        starts = torch.randint(0, len(stream) - prefix, (ON_POLICY_BATCH,), generator=gen).tolist()
        x = torch.stack([stream[s : s + prefix] for s in starts])
        rows.append(teacher.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     pad_token_id=teacher.config.pad_token_id))
    return torch.cat(rows)


def row_batches(rows: torch.Tensor, batch: int, gen: torch.Generator):
    while True:
        yield rows[torch.randint(0, len(rows), (batch,), generator=gen)]


def train_one(shape, model, data, args, log, teacher=None, held=None, steps=None, hard=False) -> dict:
    """Train one model; the distilled draft also matches the teacher's distribution.

    hard=True adds cross-entropy to the teacher's argmax, which is what greedy acceptance needs.
    """
    steps = max(1, round((steps or shape.steps) * args.scale))
    warmup = max(1, steps // 20)
    opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    model.train()
    bar = tqdm(range(steps), desc=shape.name, mininterval=5)
    start = time.time()
    for step in bar:
        x = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits.float()
        ce = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss = ce
        if teacher is not None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                p_logits = teacher(input_ids=x[:, :-1]).logits.float()
            kl = F.kl_div(
                F.log_softmax(logits, -1).flatten(0, 1), F.log_softmax(p_logits, -1).flatten(0, 1),
                log_target=True, reduction="batchmean",
            )
            if hard:
                ce = F.cross_entropy(logits.flatten(0, 1), p_logits.argmax(-1).flatten())
            loss = (1 - KD_WEIGHT) * ce + KD_WEIGHT * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            bar.set_postfix(ce=f"{ce.item():.3f}")
            log(dict(model=shape.name, step=step, ce=round(ce.item(), 4), loss=round(loss.item(), 4),
                     lr=sched.get_last_lr()[0], elapsed_s=round(time.time() - start, 1)))
    result = dict(
        model=shape.name, steps=steps, tokens_trained=steps * args.batch * args.ctx,
        train_seconds=round(time.time() - start, 1),
        held_out_loss=round(held_out_loss(model, held, args.ctx), 4) if held is not None else None,
        params=sum(p.numel() for p in model.parameters()),
    )
    log(dict(done=result))
    return result


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
    ap.add_argument("--only", nargs="*", default=None,
                    help="train only these members (distillation reads the saved target)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "training_log.jsonl"
    log_file = log_path.open("a" if args.only else "w")

    def log(record: dict) -> None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    files = stdlib_files()
    if args.max_files:
        files = files[: args.max_files] + [f for f in files if f.name in HELD_OUT][:2]
    train_texts, held_texts = split_corpus(files)
    log(dict(corpus_files=len(train_texts), held_out_files=len(held_texts), args=vars(args) | {"out": str(args.out)}))
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_stream = encode_stream(tokenizer, train_texts)
    held_stream = encode_stream(tokenizer, held_texts)
    log(dict(train_tokens=len(train_stream), held_out_tokens=len(held_stream), vocab=len(tokenizer)))

    results = {}
    for shape in FAMILY:
        if args.only and shape.name not in args.only:
            continue
        torch.manual_seed(args.seed)
        model = build_model(shape, tokenizer, args.ctx)
        data = batches(train_stream, args.batch, args.ctx, torch.Generator().manual_seed(args.seed))
        # The teacher is the target as shipped (fp16 on disk, fp32 in memory), the one the app runs.
        teacher = load_teacher(args.out / "target") if shape.distill else None
        info = train_one(shape, model, data, args, log, teacher=teacher, held=held_stream)
        if teacher is not None:
            rows = greedy_continuations(teacher, train_stream, args, torch.Generator().manual_seed(args.seed))
            log(dict(on_policy_rows=len(rows), on_policy_tokens=rows.numel()))
            per_step = max(1, args.batch * args.ctx // rows.shape[1])  # same tokens per step as before
            data = row_batches(rows, per_step, torch.Generator().manual_seed(args.seed))
            on_policy = train_one(shape, model, data, args, log, teacher=teacher, held=held_stream,
                                  steps=ON_POLICY_STEPS, hard=True)
            info = on_policy | dict(corpus_phase=info, on_policy_rows=len(rows),
                                    tokens_trained=info["tokens_trained"] + on_policy["tokens_trained"])
        info |= dict(shape=asdict(shape), command=f"python -m app train --out {args.out} --seed {args.seed}")
        save(model, tokenizer, args.out / shape.name, info)
        results[shape.name] = info
    log_file.close()
    return results


def load_teacher(path: Path) -> LlamaForCausalLM:
    if not path.exists():
        raise SystemExit(f"distillation needs the target at {path}: train it first (omit --only)")
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


if __name__ == "__main__":
    main()
