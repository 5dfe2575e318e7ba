"""The answer writer's rate against batches through generate(), on the training command's own
instructions, in one run: answer positions a second of each, and their ratio.

    python dev/writer_rate.py [--n 464] [--new 224] [--dtype bf16|fp32] [--threads 2]

The baseline is what the writer replaced: left-padded batches of 48 through the target's
generate(), each batch running until its longest answer ends, the final norm's output kept by the
same hook. Both write greedy answers with the features the drafts train on; neither builds rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from app.data import instructions  # noqa: E402
from app.models import gguf_target  # noqa: E402
from app.training import answer_writer  # noqa: E402
from app.training.target_text import chat_prompt  # noqa: E402


def generate_batches(target, prompts: list[list[int]], eos: int, new: int, batch: int) -> int:
    """Answer positions written by left-padded batches through generate(), features kept."""
    hook, written = answer_writer.FinalNorm(target), 0
    try:
        for start in range(0, len(prompts), batch):
            part = prompts[start : start + batch]
            width = max(map(len, part))
            ids = torch.tensor([[eos] * (width - len(p)) + p for p in part], device=target.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part], device=target.device)
            out = target.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=eos,
                eos_token_id=eos,
            )
            hook.take()
            # counted as the writer counts: the end token fed, a capped answer's last token never fed
            for answer in out[:, width:].tolist():
                written += answer.index(eos) + 1 if eos in answer else len(answer) - 1
    finally:
        hook.close()
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=464, help="instructions (the command answers 464)")
    ap.add_argument("--new", type=int, default=224, help="the answer cap, in tokens")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    source = gguf_target.converted_dir()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    eos = tokenizer.eos_token_id
    prompts = [chat_prompt(tokenizer, text) for _, text in instructions.training_instructions(0)[: args.n]]
    rates = {}
    with torch.inference_mode():
        t = time.perf_counter()
        answers = answer_writer.write(target, prompts, eos, args.new)
        written = sum(len(a.ids) - len(p) for a, p in zip(answers, prompts, strict=True))
        rates["continuous batching"] = (written, time.perf_counter() - t)
        t = time.perf_counter()
        written = generate_batches(target, prompts, eos, args.new, answer_writer.SLOTS)
        rates[f"generate() batches of {answer_writer.SLOTS}"] = (written, time.perf_counter() - t)
    for name, (written, seconds) in rates.items():
        print(f"{name}: {written} answer positions in {seconds:.1f} s, {written / seconds:.1f} a second")
    (a, sa), (b, sb) = rates.values()
    setup = f"{args.n} instructions, cap {args.new}, {args.dtype}, {args.threads} threads"
    print(f"ratio {a / sa / (b / sb):.2f}x ({setup})")


if __name__ == "__main__":
    main()
