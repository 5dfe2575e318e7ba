"""The text a pretrained target's drafts learn from, with what the target computed on it: its answers to the
instructions (data/instructions.py), greedy and sampled, its second turns of a chat after its own first
answers, and windows of standard-library code, each with the target's last-layer features and its top-k
next-token distribution. Built once and kept on disk, one file a phase, so a stopped build resumes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from app.data import instructions
from app.data.corpus import split_corpus, stdlib_files
from app.training import answer_writer
from app.training.answer_writer import FinalNorm
from app.training.steps import write_whole

TOP_K = 16  # the target's next-token distribution is kept as its 16 likeliest tokens, renormalised
ANSWER_TOKENS = 224  # new tokens per answer (most answers end sooner, at the end-of-turn token)
SAMPLED_ANSWERS = 2  # per instruction, beside the greedy one: the drafts also see sampled text
CHAT_TURNS = 160  # first turns whose greedy answer gets a follow-up, answered as a second turn
SAMPLE_TEMPERATURE = 0.8
TINY_SLICE = 0.05  # a --scale below this is the tests' slice: short answers, a smoke check of the head
CODE_WINDOWS, CODE_CTX = 320, 256  # standard-library windows, for code outside a chat


@dataclass
class Row:
    """One training sequence: ids (T,), the target's features (T, H) fp16, and its top-k next tokens."""

    kind: str
    ids: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor  # (T, TOP_K) int32
    top_logp: torch.Tensor  # (T, TOP_K) fp16, renormalised over the k


def lm_head_fp32(target) -> torch.Tensor:
    """The target's LM head weight in fp32, read once per phase: top-k is computed in fp32 whatever
    the dtype the target writes in."""
    return target.get_output_embeddings().weight.detach().float()


def top_k_of(head: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, K) ids and renormalised log-probs of the target's likeliest next tokens at each position,
    from its (V, H) LM head weight."""
    out_ids, out_lp = [], []
    for chunk in features.split(512):
        logits = torch.nn.functional.linear(chunk.float(), head)
        lp, ids = logits.log_softmax(-1).topk(TOP_K, dim=-1)
        out_ids.append(ids.int())
        out_lp.append((lp - lp.logsumexp(-1, keepdim=True)).half())
    return torch.cat(out_ids), torch.cat(out_lp)


def row(kind: str, ids: torch.Tensor, features: torch.Tensor, head: torch.Tensor) -> Row:
    """One training row from what the target computed on its device, kept in the host's memory."""
    top_ids, top_logp = top_k_of(head, features)
    return Row(kind, ids.cpu().clone(), features.half().cpu(), top_ids.cpu(), top_logp.cpu())


def chat_prompt(tokenizer, turns: str | list[dict]) -> list[int]:
    """Ids of one instruction, or of a list of chat messages, through the chat template."""
    messages = [{"role": "user", "content": turns}] if isinstance(turns, str) else turns
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def answer_rows(
    target,
    tokenizer,
    todo: list[tuple[str, str | list[dict]]],
    sample: bool,
    seed: int,
    log,
    new_tokens: int = ANSWER_TOKENS,
) -> list[Row]:
    """The target's answers to instructions (or chats), with the features it computed while writing them,
    written by continuous batching (answer_writer.py); the log records rows a second as requests end."""
    eos = tokenizer.eos_token_id
    prompts = [chat_prompt(tokenizer, text) for _, text in todo]
    head = lm_head_fp32(target)
    temperature = SAMPLE_TEMPERATURE if sample else 0.0
    desc = "target answers (sampled)" if sample else "target answers (greedy)"
    with tqdm(total=len(todo), desc=desc, mininterval=10) as bar:

        def progress(entry: dict) -> None:
            bar.update(entry["done"] - bar.n)
            log(entry | dict(sampled=sample))

        answers = answer_writer.write(target, prompts, eos, new_tokens, temperature, seed, log=progress)
    return [row(kind, torch.tensor(a.ids), a.features, head) for (kind, _), a in zip(todo, answers, strict=True)]


@torch.inference_mode()
def code_rows(target, tokenizer, n: int, seed: int, ctx: int = CODE_CTX) -> list[Row]:
    """Windows of the standard library (its held-out files excluded), with the target's features."""
    train, _ = split_corpus(stdlib_files())
    rng = random.Random(seed)
    texts = rng.sample(train, min(len(train), 4 * n))
    windows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > ctx:
            s = rng.randrange(0, len(ids) - ctx)
            windows.append(ids[s : s + ctx])
        if len(windows) == n:
            break
    hook, rows, head = FinalNorm(target), [], lm_head_fp32(target)
    for start in tqdm(range(0, len(windows), 8), desc="target features (code)", mininterval=10):
        x = torch.tensor(windows[start : start + 8], device=target.device)
        target.model(input_ids=x)
        features = hook.take()
        rows += [row("stdlib", x[b], features[b], head) for b in range(len(x))]
    hook.close()
    return rows


def second_turns(tokenizer, todo: list[tuple[str, str]], first: list[Row], seed: int) -> list[tuple[str, list[dict]]]:
    """Chats of two turns: an instruction, the target's own greedy answer to it, and a follow-up."""
    eos = tokenizer.eos_token_id
    chats = []
    follow_ups = instructions.chat_follow_ups(todo, seed)
    for (_, instruction), (_, follow_up), row in zip(todo, follow_ups, first, strict=True):
        prompt = len(chat_prompt(tokenizer, instruction))
        answer = [t for t in row.ids[prompt:].tolist() if t != eos]
        said = tokenizer.decode(answer, skip_special_tokens=True).strip()
        turns = [
            {"role": "user", "content": instruction},
            {"role": "assistant", "content": said},
            {"role": "user", "content": follow_up},
        ]
        chats.append(("chat", turns))
    return chats


def _phase(out: Path, name: str, make) -> list[Row]:
    """One phase's rows, read from out/NAME.pt when an earlier build wrote it."""
    path = out / f"{name}.pt"
    if path.is_file():
        return [Row(**r) for r in torch.load(path)]
    rows = make()
    out.mkdir(parents=True, exist_ok=True)
    write_whole(path, lambda tmp: torch.save([r.__dict__ for r in rows], tmp))
    return rows


def sampled_passes(scale: float) -> int:
    """How many times each instruction is answered by sampling: a --scale of 2 or more (a GPU's
    default) multiplies them by its whole part, more of the target's own text; a tiny slice samples once."""
    return SAMPLED_ANSWERS * max(1, int(scale)) if scale >= 1 else 1


def build_rows(target, tokenizer, out: Path, seed: int, scale: float, log, sampled: int | None = None) -> list[Row]:
    """Every training row, computed once and kept in out/ one phase a file (reused when present);
    `sampled` sampled answer passes (None: sampled_passes(scale))."""
    todo = instructions.training_instructions(seed)
    todo = todo[: max(answer_writer.SLOTS // 4, round(len(todo) * min(scale, 1.0)))]
    # A tiny slice (the tests' --scale) also writes short answers and windows, so it runs in seconds.
    new, ctx = (ANSWER_TOKENS, CODE_CTX) if scale >= TINY_SLICE else (24, 64)
    greedy = _phase(out, "answers-greedy", lambda: answer_rows(target, tokenizer, todo, False, seed, log, new))
    rows = list(greedy)
    for i in range(sampled_passes(scale) if sampled is None else sampled):
        rows += _phase(
            out, f"answers-sampled-{i}", lambda i=i: answer_rows(target, tokenizer, todo, True, seed + 1 + i, log, new)
        )
    n_chat = max(2, round(CHAT_TURNS * min(scale, 1.0)))
    chats = second_turns(tokenizer, todo[:n_chat], greedy[:n_chat], seed)
    rows += _phase(out, "answers-chat", lambda: answer_rows(target, tokenizer, chats, False, seed, log, new))
    n_code = max(8, round(CODE_WINDOWS * min(scale, 1.0)))
    rows += _phase(out, "stdlib-windows", lambda: code_rows(target, tokenizer, n_code, seed, ctx))
    return rows
