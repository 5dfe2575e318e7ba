"""The target's answers to many prompts, written by continuous batching: a row whose answer has ended
leaves the batch and the next prompt takes its place, so no step is spent on answers already over.

A batch of generate() calls runs every row until its longest answer ends: with one answer in a batch
running to the cap, most of the batch's row-steps were spent on answers that had ended. Here each row
is one request with its own position, its own place in the KV cache (left-padded to the longest row,
trimmed as rows leave) and, when sampling, its own generator seeded from (seed, request), so what a
request writes does not depend on which requests share its steps.

In the exact int8 precision (models/exact.py) a row's numbers do not depend on the batch either, so the
text is token for token what the request written alone would be; in fp32 or bf16 batched rows can
differ in the last bits, as in any batched generation.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

SLOTS = 48  # rows a step at most
TRIM = 32  # leading cache positions no row reads any more, cut once this many have gathered


@dataclass
class Answer:
    """One request written: its ids (the prompt, then the answer as fed: its end-of-turn token
    included when it ended, the last token left out when it ran to the cap, as it was never fed) and
    (len(ids), H) what the target's LM head read at each of them."""

    ids: list[int]
    features: torch.Tensor


@dataclass
class _Row:
    request: int
    next: int  # the token the next step feeds
    position: int
    fed: list[int]
    features: list[torch.Tensor]
    generator: torch.Generator | None
    written: int = 0
    ending: bool = False  # its end-of-turn token is fed this step, for its features, and then it leaves
    done: bool = field(default=False)


class _FinalNorm:
    """What the LM head reads (the final norm's output) during each forward."""

    def __init__(self, target):
        self.out: torch.Tensor | None = None
        self.handle = target.model.norm.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.out = output.detach()

    def take(self) -> torch.Tensor:
        assert self.out is not None
        out, self.out = self.out, None
        return out


def seed_of(seed: int, request: int) -> int:
    """A request's own sampling seed: the same whichever rows share its steps."""
    return (seed * 1_000_003 + request) % (2**63)


@torch.inference_mode()
def write(
    target,
    prompts: list[list[int]],
    eos: int,
    new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    slots: int = SLOTS,
    log: Callable[[dict], None] | None = None,
) -> list[Answer]:
    """Each prompt's answer (greedy at temperature 0, else sampled), in the order of `prompts`."""
    device = target.device
    hook = _FinalNorm(target)
    try:
        return _Writer(target, prompts, eos, new_tokens, temperature, seed, slots, hook, device, log).run()
    finally:
        hook.handle.remove()


class _Writer:
    def __init__(self, target, prompts, eos, new_tokens, temperature, seed, slots, hook, device, log):
        self.target, self.prompts, self.eos, self.new_tokens = target, prompts, eos, new_tokens
        self.temperature, self.seed, self.slots, self.hook, self.device, self.log = (
            temperature,
            seed,
            max(1, slots),
            hook,
            device,
            log,
        )
        self.rows: list[_Row] = []
        self.cache = DynamicCache()
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.answers: dict[int, Answer] = {}
        self.began, self.row_steps, self.steps = time.perf_counter(), 0, 0

    def run(self) -> list[Answer]:
        waiting = deque(range(len(self.prompts)))
        while waiting or self.rows:
            while waiting and len(self.rows) < self.slots:
                self._admit(waiting.popleft())
            self._step()
        return [self.answers[i] for i in range(len(self.prompts))]

    def _admit(self, request: int) -> None:
        """The request's prompt but its last token, run alone, then placed as a new row of the cache."""
        prompt = self.prompts[request]
        if len(prompt) < 2:  # a chat prompt is dozens of tokens; one token would leave nothing to place
            raise ValueError(f"prompt {request} has {len(prompt)} tokens: the writer takes at least 2")
        generator = None
        if self.temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(seed_of(self.seed, request))
        row = _Row(request, prompt[-1], len(prompt) - 1, list(prompt[:-1]), [], generator)
        n = len(prompt) - 1
        alone = DynamicCache()
        self.target(input_ids=torch.tensor([prompt[:-1]], device=self.device), cache=alone, use_cache=True)
        row.features.append(self.hook.take()[0])
        if not self.rows:  # the batch starts again from this row alone
            self.cache, self.mask = alone, torch.ones(1, n, dtype=torch.long, device=self.device)
            self.rows = [row]
            return
        held = self.mask.shape[1]
        if n > held:  # every row moves right, so the new one fits
            self._pad_left(n - held)
            held = n
        for layer, new in zip(self.cache.layers, alone.layers, strict=True):
            for name in ("keys", "values"):
                old = getattr(layer, name)
                place = old.new_zeros(1, *old.shape[1:])
                place[:, :, held - n :] = getattr(new, name)
                setattr(layer, name, torch.cat([old, place]))
        line = torch.zeros(1, held, dtype=torch.long, device=self.device)
        line[:, held - n :] = 1
        self.mask = torch.cat([self.mask, line])
        self.rows.append(row)

    def _pad_left(self, n: int) -> None:
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                setattr(layer, name, torch.cat([old.new_zeros(*old.shape[:2], n, old.shape[3]), old], dim=2))
        self.mask = torch.cat([self.mask.new_zeros(self.mask.shape[0], n), self.mask], dim=1)

    def _step(self) -> None:
        rows = self.rows
        ids = torch.tensor([[r.next] for r in rows], device=self.device)
        position = torch.tensor([[r.position] for r in rows], device=self.device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        out = self.target(
            input_ids=ids, attention_mask=self.mask, position_ids=position, cache=self.cache, use_cache=True
        )
        features = self.hook.take()[:, -1]
        logits = out.logits[:, -1].float()
        self.steps += 1
        self.row_steps += len(rows)
        for b, row in enumerate(rows):
            row.fed.append(row.next)
            row.features.append(features[b : b + 1])
            row.position += 1
            if row.ending:
                row.done = True
                continue
            token = self._next_token(logits[b], row.generator)
            row.written += 1
            if token == self.eos:
                row.next, row.ending = token, True
            elif row.written == self.new_tokens:
                row.done = True  # the cap: its last token is never fed, so it has no features
            else:
                row.next = token
        if any(r.done for r in rows):
            self._leave([b for b, r in enumerate(rows) if not r.done])
        self._trim()

    def _next_token(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if generator is None:
            return int(logits.argmax())
        p = torch.softmax(logits / self.temperature, dim=-1)
        return int(torch.multinomial(p, 1, generator=generator))

    def _leave(self, keep: list[int]) -> None:
        for row in self.rows:
            if row.done:
                self.answers[row.request] = Answer(row.fed, torch.cat(row.features))
        self.rows = [self.rows[b] for b in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self.mask = self.mask.index_select(0, index)
        if self.log is not None:
            elapsed = time.perf_counter() - self.began
            done = len(self.answers)
            self.log(
                dict(
                    phase="answers",
                    done=done,
                    of=len(self.prompts),
                    rows_per_s=round(self.row_steps / elapsed, 1),
                    eta_s=round(elapsed / done * (len(self.prompts) - done)),
                )
            )

    def _trim(self) -> None:
        """Cut the leading positions that no row reads any more (every row's mask is 0 there)."""
        if not self.rows:
            return
        unread = int((self.mask.cumsum(dim=1) == 0).all(dim=0).sum())
        if unread < TRIM:
            return
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, unread:], layer.values[:, :, unread:]
        self.mask = self.mask[:, unread:]
