"""The target's answers to many prompts, written by continuous batching: a row whose answer has ended
is freed and the next prompt is written into it, so no step is spent on answers already over.

A batch of generate() calls runs every row until its longest answer ends: with one answer in a batch
running to the cap, most of the batch's row-steps were spent on answers that had ended. Here each row
is one request with its own position, its own row of the KV cache (left-padded to the longest row,
its unread positions trimmed) and, when sampling, its own generator seeded from (seed, request), so what a
request writes does not depend on which requests share its steps.

The prompts' shared beginning (a chat template's system turn: about half of each prompt) is run once,
and each request's prompt starts from a copy of its keys and values, as servers' prefix caches do.

In the exact int8 precision (models/exact.py) a row's numbers do not depend on the batch either, so the
text is token for token what the request written alone would be; in fp32 or bf16 batched rows can
differ in the last bits, as in any batched generation.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SLOTS = 48  # rows a step at most
TRIM = 32  # leading cache positions no row reads any more, cut once this many have gathered
ROOM = 512  # positions a cache buffer holds beyond its rows' when it is (re)allocated
SHRINK = 4  # with no request waiting, free rows leave once they are this fraction of the batch


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
    next: int  # the token the next step feeds, at position len(fed)
    fed: list[int]
    features: list[torch.Tensor]
    generator: torch.Generator | None
    written: int = 0
    ending: bool = False  # its end-of-turn token is fed this step, for its features, and then it leaves
    first: int = 0  # the mask's column of its first position: it reads every column from there on


class FinalNorm:
    """Collects what the target's LM head reads (the final norm's output) during any forward."""

    def __init__(self, target):
        self.out: list[torch.Tensor] = []
        self.handle = target.model.norm.register_forward_hook(lambda m, i, o: self.out.append(o.detach()))

    def take(self) -> torch.Tensor:
        f = torch.cat(self.out, dim=1)
        self.out = []
        return f

    def close(self) -> None:
        self.handle.remove()


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
    hook = FinalNorm(target)
    try:
        return _Writer(target, prompts, eos, new_tokens, temperature, seed, slots, hook, device, log).run()
    finally:
        hook.close()


class _SlotLayer(DynamicLayer):
    """One layer of the writer's cache: a buffer of (slots, heads, room, dim) whose positions
    [start, end) are held, so a step writes its column in place (no copy of the whole cache, as
    DynamicLayer's cat makes), a new request is written into a freed row, and trimming the positions
    no row reads moves `start` only."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots: int):
        super().__init__()
        self.is_initialized, self.device = True, k.device
        self.buffers = [x.new_zeros(slots, x.shape[1], ROOM, x.shape[3]) for x in (k, v)]
        self.start = self.end = ROOM // 2  # room on both sides: a longer prompt extends to the left
        self._views()

    def _views(self) -> None:
        self.keys, self.values = (b[:, :, self.start : self.end] for b in self.buffers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[-2]
        if self.end + t > self.buffers[0].shape[2]:
            self._move(0, self.end - self.start + t + ROOM)
        for buffer, new in zip(self.buffers, (key_states, value_states), strict=True):
            buffer[:, :, self.end : self.end + t] = new
        self.end += t
        self._views()
        return self.keys, self.values

    def _move(self, left: int, size: int) -> None:
        """The held positions copied into a new buffer of `size`, `left` free positions before them."""
        held = self.end - self.start
        moved = []
        for buffer in self.buffers:
            new = buffer.new_zeros(buffer.shape[0], buffer.shape[1], size, buffer.shape[3])
            new[:, :, left : left + held] = buffer[:, :, self.start : self.end]
            moved.append(new)
        self.buffers, self.start, self.end = moved, left, left + held
        self._views()

    def extend_left(self, n: int) -> None:
        if self.start < n:
            self._move(n + ROOM // 2, n + ROOM // 2 + self.end - self.start + ROOM)
        self.start -= n
        self._views()

    def place(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        for buffer, new in zip(self.buffers, (k, v), strict=True):
            buffer[row, :, self.end - n : self.end] = new[0]

    def trim(self, n: int) -> None:
        self.start += n
        self._views()

    def keep_rows(self, index: torch.Tensor) -> None:
        """The kept rows' held positions alone move, into buffers with ROOM after them."""
        held, rows = self.end - self.start, len(index)
        self.buffers = [
            torch.cat(
                [
                    b[:, :, self.start : self.end].index_select(0, index),
                    b.new_zeros(rows, b.shape[1], ROOM, b.shape[3]),
                ],
                2,
            )
            for b in self.buffers
        ]
        self.start, self.end = 0, held
        self._views()


def shared_prefix(prompts: list[list[int]]) -> list[int]:
    """The tokens every prompt begins with, short of each prompt's last token (which a step feeds)."""
    if not prompts:
        return []
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return first[: max(0, n)]


class _Prefix:
    """The shared prefix's keys, values and features, computed once; each request starts from a copy."""

    def __init__(self, target, ids: list[int], hook: FinalNorm):
        self.ids, self.cache, self.features = ids, DynamicCache(), []
        if ids:
            target(input_ids=torch.tensor([ids], device=target.device), cache=self.cache, use_cache=True)
            self.features = [hook.take()[0]]

    def copy(self) -> DynamicCache:
        return DynamicCache(ddp_cache_data=[(layer.keys, layer.values) for layer in self.cache.layers])


class _Writer:
    def __init__(self, target, prompts, eos, new_tokens, temperature, seed, slots, hook, device, log):
        self.target, self.prompts, self.eos, self.new_tokens = target, prompts, eos, new_tokens
        self.temperature, self.seed, self.slots = temperature, seed, max(1, slots)
        self.hook, self.device, self.log = hook, device, log
        self.prefix: _Prefix | None = None  # made at the first admission, inside the writer's inference mode
        self.rows: list[_Row | None] = []  # a cache row each; None: free, its positions masked
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.answers: dict[int, Answer] = {}
        self.began, self.row_steps = time.perf_counter(), 0

    def run(self) -> list[Answer]:
        waiting = deque(range(len(self.prompts)))
        while waiting or any(self.rows):
            while waiting and (None in self.rows or len(self.rows) < self.slots):
                self._admit(waiting.popleft())
            if not waiting:
                self._shrink()
            self._step()
        return [self.answers[i] for i in range(len(self.prompts))]

    def _admit(self, request: int) -> None:
        """The request's prompt but its last token, run alone from the shared prefix's copy, then written
        into a free row of the cache."""
        prompt = self.prompts[request]
        if len(prompt) < 2:  # a chat prompt is dozens of tokens; one token would leave nothing to place
            raise ValueError(f"prompt {request} has {len(prompt)} tokens: the writer takes at least 2")
        generator = None
        if self.temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(seed_of(self.seed, request))
        if self.prefix is None:
            self.prefix = _Prefix(self.target, shared_prefix(self.prompts), self.hook)
        row = _Row(request, prompt[-1], list(prompt[:-1]), list(self.prefix.features), generator)
        n = len(prompt) - 1
        alone, rest = self.prefix.copy(), prompt[len(self.prefix.ids) : -1]
        if rest:
            self.target(input_ids=torch.tensor([rest], device=self.device), cache=alone, use_cache=True)
            row.features.append(self.hook.take()[0])
        if self.cache is None:  # the first request: the cache's rows are laid out from its layers
            self.cache = DynamicCache()
            self.cache.layers = [_SlotLayer(x.keys, x.values, self.slots) for x in alone.layers]
            self.rows = [None] * self.slots
            self.mask = torch.zeros(self.slots, 0, dtype=torch.long, device=self.device)
        held = self.mask.shape[1]
        if n > held:  # the held positions extend to the left, so the new row fits
            for layer in self.cache.layers:
                layer.extend_left(n - held)
            self.mask = torch.cat([self.mask.new_zeros(self.mask.shape[0], n - held), self.mask], dim=1)
            for other in self.rows:
                if other is not None:
                    other.first += n - held
            held = n
        slot = self.rows.index(None)
        for layer, new in zip(self.cache.layers, alone.layers, strict=True):
            layer.place(slot, new.keys, new.values)
        self.mask[slot] = 0
        self.mask[slot, held - n :] = 1
        row.first = held - n
        self.rows[slot] = row

    def _step(self) -> None:
        assert self.cache is not None
        rows = self.rows
        # a free row feeds a token too (the batch keeps its shape); its output is not read
        ids = torch.tensor([[r.next if r else self.eos] for r in rows], device=self.device)
        position = torch.tensor([[len(r.fed) if r else 0] for r in rows], device=self.device)
        live = torch.tensor([[1 if r else 0] for r in rows], device=self.device, dtype=torch.long)
        # a free row sees only its own new position, so its attention has a key to read
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        out = self.target(
            input_ids=ids, attention_mask=self.mask, position_ids=position, cache=self.cache, use_cache=True
        )
        self.mask[:, -1:] *= live
        features = self.hook.take()[:, -1]
        logits = out.logits[:, -1].float()
        self.row_steps += sum(r is not None for r in rows)
        # greedy rows take every row's argmax in one call (one read of the device, not one a row)
        picks = logits.argmax(dim=-1).tolist() if self.temperature <= 0 else None
        for b, row in enumerate(rows):
            if row is None:
                continue
            row.fed.append(row.next)
            row.features.append(features[b : b + 1])
            done = row.ending
            if not done:
                token = picks[b] if picks is not None else self._sampled(logits[b], row.generator)
                row.written += 1
                if token == self.eos:
                    row.next, row.ending = token, True
                elif row.written == self.new_tokens:
                    done = True  # the cap: its last token is never fed, so it has no features
                else:
                    row.next = token
            if done:
                self._leave(b)
        self._trim()

    def _sampled(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        p = torch.softmax(logits / self.temperature, dim=-1)
        return int(torch.multinomial(p, 1, generator=generator))

    def _leave(self, b: int) -> None:
        row = self.rows[b]
        assert row is not None
        self.answers[row.request] = Answer(row.fed, torch.cat(row.features))
        self.rows[b] = None
        self.mask[b] = 0
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

    def _shrink(self) -> None:
        """With no request waiting, the free rows leave the batch once they are 1/SHRINK of it: a free
        row costs a step nearly what a live one does, and leaving copies the cache once."""
        free = self.rows.count(None)
        if not free or free < len(self.rows) // SHRINK or self.cache is None:
            return
        keep = [b for b, r in enumerate(self.rows) if r is not None]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.keep_rows(index)
        self.mask = self.mask.index_select(0, index)
        self.rows = [self.rows[b] for b in keep]

    def _trim(self) -> None:
        """Cut the leading positions that no row reads any more: before every live row's first (kept
        on the host, so a step on a GPU reads the device once, for its picks)."""
        live = [r for r in self.rows if r is not None]
        if self.cache is None or not live:
            return
        unread = min(r.first for r in live)
        if unread < TRIM:
            return
        for layer in self.cache.layers:
            layer.trim(unread)
        self.mask = self.mask[:, unread:]
        for r in live:
            r.first -= unread
