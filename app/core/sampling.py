"""Logits to probabilities (repetition controls, temperature, top-k, top-p) and seeded sampling."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from app.core import transfer
from app.core.config import K_MAX, SamplingConfig


def penalise(
    logits: torch.Tensor, context: list[int], drafts: list[int], cfg: SamplingConfig, parents: Sequence[int] = ()
) -> torch.Tensor:
    """(n, V) logits through generate()'s own processors: row 0 after the context, row i + 1 after the
    context and the drafts on the branch to draft i (parents: each draft's parent, -1 for the context;
    none given, the drafts are a chain).

    Speculation stays lossless because the target's rows and the draft's rows at the same
    position see the same history, so p and q get identical processing.
    """
    if not cfg.penalised:
        return logits
    penalty = RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty) if cfg.repetition_penalty != 1.0 else None
    full = torch.tensor(context + drafts, dtype=torch.long, device=logits.device)
    branches: list[list[int]] = [[]]  # the drafts before each row, in order
    for node, parent in enumerate(parents or range(-1, len(drafts) - 1)):
        branches.append(branches[parent + 1] + [node])
    # One copy of every row, which the processors then change in place: a (1, V) copy a row and a join
    # of them after cost more than the processors themselves on a CPU.
    out = logits.float().clone()
    n = cfg.no_repeat_ngram_size
    branches = branches[: out.shape[0]]
    on_chain = [branch == list(range(len(branch))) for branch in branches]  # a prefix of the drafts
    at_once = n > 1 and all(on_chain)  # every row's history a prefix of one sequence: its bans all at once
    if penalty is not None or (n > 0 and not at_once):
        for i, branch in enumerate(branches):
            if on_chain[i]:  # one slice of the tensor
                history = full[: len(context) + len(branch)]
            else:
                history = torch.cat([full[: len(context)], full[len(context) :][branch]])
            row = out[i : i + 1]
            if penalty is not None:
                row.copy_(penalty(history[None], row))
            if n > 0 and not at_once:
                ban_repeated_ngrams(history, row, n)
    if at_once:
        ban_prefix_ngrams(out, full, [len(context) + len(branch) for branch in branches], n)
    return out


def ban_repeated_ngrams(history: torch.Tensor, row: torch.Tensor, n: int) -> torch.Tensor:
    """generate()'s NoRepeatNGramLogitsProcessor on one (1, V) row after a 1-D history: -inf for every
    token that would end an n-gram already in the history. The same banned set, found in a few tensor
    operations instead of a Python pass over every n-gram of the history, which for a few hundred
    tokens cost a verify row and a draft token about a tenth of a one-token pass each."""
    row[0, repeated_ngram_ends(history, n)] = float("-inf")
    return row


def ban_prefix_ngrams(rows: torch.Tensor, full: torch.Tensor, lengths: list[int], n: int) -> None:
    """ban_repeated_ngrams (n > 1) on every row of (R, V) `rows` in place, row i after the history
    full[:lengths[i]]: the same bans, found for all rows in a few tensor operations (and on a GPU one
    read, where a row at a time read once a row)."""
    longest = max(lengths)
    if longest < n:  # no n-gram ends in a next token yet
        return
    windows = full[:longest].unfold(0, n - 1, 1)[: longest - n + 1]  # window j was followed by full[j + n - 1]
    ends = torch.tensor(lengths)[:, None]
    last = ends - (n - 1) + torch.arange(n - 1)  # each row's last n - 1 positions (negative: too short)
    suffix = full[transfer.queued(last.clamp_min(0), full.device)]  # (R, n - 1)
    inside = torch.arange(len(windows))[None] <= ends - n  # windows whose next token is in the row's history
    match = (windows[None] == suffix[:, None]).all(-1) & transfer.queued(inside, full.device)
    r, j = match.nonzero(as_tuple=True)
    rows[r, full[j + n - 1]] = float("-inf")


def repeated_ngram_ends(history: torch.Tensor, n: int) -> torch.Tensor:
    """The token ids that would end an n-gram already in the 1-D history (with repeats)."""
    length = history.numel()
    if length < n:  # no n-gram ends in a next token yet (the processor's own early return)
        return history[:0]
    if n == 1:
        return history
    windows = history.unfold(0, n - 1, 1)[: length - n + 1]  # every (n-1)-gram that a token followed
    return history[n - 1 :][(windows == history[length - n + 1 :]).all(dim=-1)]


def penalise_subset(scores: torch.Tensor, slot_of: torch.Tensor, history: list[int], cfg: SamplingConfig):
    """penalise() for the (S,) scores of a subset of the vocabulary, -inf elsewhere (a draft vocabulary):
    slot_of maps a token id to its place in scores, -1 outside. The same numbers on those places as the
    full row's, without building the full row (a greedy draft token's whole cost otherwise)."""
    scores = scores.float().clone()
    ids = torch.tensor(history, dtype=torch.long, device=scores.device)
    if cfg.repetition_penalty != 1.0:  # generate()'s own processor, on the places of the seen tokens
        seen = slot_of[ids]
        penalty = RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty)
        scores = penalty(seen[seen >= 0][None], scores[None])[0]
    if cfg.no_repeat_ngram_size > 0:
        banned = slot_of[repeated_ngram_ends(ids, cfg.no_repeat_ngram_size)]
        scores[banned[banned >= 0]] = float("-inf")
    return scores


def probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after the same processing for p and q.

    Greedy gives a one-hot on the argmax, so greedy verification is the sampling rule's limit.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        logits = logits.masked_fill(top_p_drop(logits, cfg.top_p), float("-inf"))
    return logits.softmax(-1)


# A sampled round filters a row per draft and per verified position, and a full sort of each row is
# a visible share of a CPU round. The top-p set is almost always among a row's few hundred likeliest
# tokens, and topk finds those far faster than a sort.
TOP_P_CANDIDATES = 256


def top_p_drop(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., V) bool: the tokens top-p sampling drops, those less likely than the last token needed
    for the likelier tokens' mass to reach top_p (the likeliest always stays).

    The cut is a probability, not a rank, so tokens tied at it all stay, and the set depends only on
    the row's sorted values, never on how a sort orders ties: a row gets the same set alone or
    beside others, as p's rows and q's do. Those values come from a full sort, or on CPU from the
    TOP_P_CANDIDATES likeliest when their mass reaches top_p in every row, since no token outside
    them is then needed. On a GPU the sort is cheap, and checking that mass would wait for the device.
    """
    p = logits.softmax(-1)
    ranked = None
    if p.device.type == "cpu":
        ranked = torch.topk(p, min(TOP_P_CANDIDATES, p.shape[-1]), dim=-1).values
        mass = ranked.cumsum(-1)  # summed in rank order, exactly as the full sort's first ones are
        if not bool((mass[..., -1] >= top_p).all()):
            ranked = None
    if ranked is None:
        ranked = torch.sort(p, dim=-1, descending=True).values
        mass = ranked.cumsum(-1)
    before = torch.cat([torch.zeros_like(mass[..., :1]), mass[..., :-1]], dim=-1)  # never falls, unlike mass - ranked
    needed = (before < top_p).sum(-1, keepdim=True).clamp_min(1)
    return p < ranked.gather(-1, needed - 1)


def sample(p: torch.Tensor, gen: torch.Generator) -> int:
    """One token id from a (V,) distribution, using the run's generator."""
    return int(torch.multinomial(p.to(gen.device), 1, generator=gen).item())


def uniform(gen: torch.Generator) -> float:
    """The draw u in [0, 1) that decides one acceptance."""
    return float(torch.rand((), generator=gen, device=gen.device).item())


def fresh_noise(width: int, gen: torch.Generator) -> torch.Tensor:
    """(width,) Exp(1) draws from the run's generator, on its device: the race against them is a draw."""
    return torch.empty(width, dtype=torch.float64, device=gen.device).exponential_(generator=gen)


def draw_unread(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A token drawn from a (V,) p, as a 0-d tensor left on gen's device: multinomial's one-sample path
    (the race against fresh noise) without its check that reads the host."""
    return race(p, fresh_noise(p.shape[-1], gen))


def race_noise(seed: int, position: int, width: int, device=None) -> torch.Tensor:
    """(width,) Exp(1) draws keyed by (seed, position) alone: the shared noise at one position.

    Drawn on the CPU from a generator of their own, so every reader (the target's verify, any draft,
    plain decoding) gets the same values on any device, in any process, whatever came before.
    The tensor may be shared with other readers: never change it in place.
    """
    e = _race_noise(seed, position, width)
    return e if device is None else transfer.queued(e, device)  # a round's noise never waits


# A round's draft reads positions i..i+k-1 and its verify i..i+k: kept, each draw is made once.
# Room for two requests' rounds at the largest k.
@functools.lru_cache(maxsize=2 * (K_MAX + 1))
def _race_noise(seed: int, position: int, width: int) -> torch.Tensor:
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    # E = -log U. U is kept above 0 so E stays finite (an infinite E would never win);
    # E is never 0, as U < 1, so p / E is never NaN. (torch's exponential_ is several times slower.)
    # Drawn in float64: in float32 every win probability would sit on a 2^-24 grid, and a token far
    # less likely than that would almost never win, a bias of up to V * 2^-24 in all.
    e = torch.rand(width, generator=gen, dtype=torch.float64).clamp_min_(torch.finfo(torch.float64).tiny)
    return e.log_().neg_()


def race(p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) over the last axis: with E i.i.d. Exp(1), a token drawn from p (the exponential
    race, Gumbel-max in another form), and one that depends on the noise alone for a given p."""
    return (p.double() / noise[..., : p.shape[-1]].to(p.device, torch.float64)).argmax(-1)


def draw_distinct(q: torch.Tensor, m: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """m distinct tokens drawn one after another without replacement from a (V,) q (the Gumbel-top-k
    trick gives the same order), and the (m', V) distribution each was drawn from: q renormalised
    without the tokens before it. m' <= m where q has fewer tokens with mass."""
    m = min(m, int((q > 0).sum()))
    gumbel = -torch.empty(q.shape, dtype=torch.float64, device=gen.device).exponential_(generator=gen).log()
    keys = q.to(gen.device, torch.float64).log() + gumbel  # where the run's generator draws
    tokens = keys.topk(m).indices.tolist()
    rows, left = [], q.clone()
    for t in tokens:
        rows.append(left / left.sum())
        left = left.clone()
        left[t] = 0
    return tokens, torch.stack(rows) if rows else q.new_zeros(0, q.shape[-1])
