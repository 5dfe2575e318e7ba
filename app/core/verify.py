"""Pure verification rules: how many drafts the target keeps, and its own next token.

Sampling follows Leviathan et al. 2023 / Chen et al. 2023: accept x with probability
min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)); after k accepts draw a
bonus token from p. Greedy is the same rule with one-hot p and q.

Shared noise follows Daliri, Musco and Suresh 2024 ("drafter-invariant speculative decoding"): the
token at position i is argmax(p_i / E_i) for noise E_i keyed by (seed, i), a draft is kept when it
is that token, and the first one that is not gives way to it. Every token is then the one plain
sampling with the same seed picks, whatever drafted it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.core import sampling


@dataclass
class Verdict:
    accepted: int  # length of the kept prefix of drafts
    token: int  # the target's own token: a correction, or the bonus
    p_x: list[float | None]  # p(x_i) for each draft judged (None: greedy, not asked for)
    q_x: list[float]  # q(x_i)
    accept_prob: list[float]  # min(1, p/q)
    u: list[float | None]  # the draws (None under greedy)
    residual: torch.Tensor  # (V,) the distribution the target's token was drawn from
    noise: torch.Tensor | None = None  # shared noise: (V,) E at the position the target's token was chosen


def align(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the narrower of (.., Vp) and (.., Vq) with zero probability.

    Padded embedding rows (e.g. a 151936 vs 152064 vocabulary) are ids that the other
    model can never produce, so zero mass there is exact, not an approximation.
    """
    width = max(p.shape[-1], q.shape[-1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1]))  # noqa: E731
    return pad(p), pad(q.to(p.device))


def one_hot_q(drafts: list[int], width: int, device) -> torch.Tensor:
    """q for a draft source with no distribution: all mass on the proposed token."""
    q = torch.zeros(len(drafts), width, device=device)
    if drafts:
        q[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
    return q


def greedy(drafts: list[int], p_logits: torch.Tensor, teach: bool = True) -> Verdict:
    """Keep the longest prefix equal to the target's argmax. p_logits: (n+1, V).

    All device work is queued first and read back in one transfer: one host sync per round.
    p(x) (softmax at T = 1) is teaching data: without teach it is None, and the (n, V)
    logsumexp that it needs, the largest cost of a greedy round outside the passes, is skipped.
    """
    n = len(drafts)
    logits = p_logits.float()
    best = logits.argmax(-1)
    if teach:  # exp(logit - logsumexp) needs no (n, V) softmax
        x = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        p_x = (logits[:n].gather(-1, x[:, None])[:, 0] - logits[:n].logsumexp(-1)).exp()
        host = torch.cat([best.double(), p_x.double()]).tolist()  # the one sync
        best, p_x = [int(b) for b in host[: n + 1]], host[n + 1 :]
    else:
        best, p_x = best.tolist(), [None] * n
    a = 0
    while a < n and drafts[a] == best[a]:
        a += 1
    judged = min(a + 1, n)
    residual = torch.zeros(logits.shape[-1], device=logits.device)
    residual[best[a]] = 1.0
    ok = [1.0] * a + [0.0] * (judged - a)
    return Verdict(a, best[a], p_x[:judged], [1.0] * judged, ok, [None] * judged, residual)


def speculative_sampling(drafts: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> Verdict:
    """Lossless rejection sampling. p: (n+1, V) target, q: (n, V) draft, both processed.

    Vectorised over the drafts with one transfer to the generator's device (the only host
    sync), and the same draws as judging one draft at a time: u_1.. up to the first
    rejection, then one sample from the residual or, after n accepts, the bonus from p.
    """
    p, q = align(p, q)
    n = len(drafts)
    if p.device != gen.device:  # one transfer for the round; everything below runs on the host
        both = torch.cat([p, q]).to(gen.device)
        p, q = both[: n + 1], both[n + 1 :]
    i = n  # index of the first rejected draft; n when all are accepted
    lists: list[list[float]] = [[], [], [], []]
    if n:
        rows, x = torch.arange(n), torch.tensor(drafts, dtype=torch.long, device=p.device)
        p_x, q_x = p[rows, x].double(), q[rows, x].double()  # double: the same min(1, p/q) as Python floats
        accept = torch.where(p_x >= q_x, torch.ones_like(p_x), p_x / q_x)
        state = gen.get_state()
        u = torch.rand(n, generator=gen, device=gen.device).double()  # = n draws of sampling.uniform
        rejected = (u >= accept).nonzero()
        if len(rejected):
            i = int(rejected[0, 0])
        if i + 1 < n:  # consume only the draws that were judged, as a one-by-one loop would
            gen.set_state(state)
            torch.rand(i + 1, generator=gen, device=gen.device)
        judged = min(i + 1, n)
        lists = torch.stack([p_x, q_x, accept, u])[:, :judged].tolist()
    if i < n:
        residual = (p[i] - q[i]).clamp_min(0)
        mass = residual.sum()
        # Zero mass means p == q where rejection had probability 0: only rounding gets here.
        residual = residual / mass if mass > 0 else p[i]
    else:
        residual = p[n]
    return Verdict(i, sampling.sample(residual, gen), *lists, residual)


def shared_noise(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None, seed: int, position: int) -> Verdict:
    """Keep the drafts that win the target's race. p: (n+1, V) processed, row j for the token at
    absolute position `position + j`; q: (n, V) or None (one-hot), read only for the teaching record.

    The race needs no draw from the run's generator: nothing here depends on what was drafted before.
    """
    n = len(drafts)
    noise = torch.stack([sampling.race_noise(seed, position + j, p.shape[-1]) for j in range(n + 1)])
    winners = sampling.race(p, noise.to(p.device))
    if n:
        x = torch.tensor(drafts, dtype=torch.long, device=p.device)
        p_x = p[torch.arange(n), x]
        q_x = q.to(p.device)[torch.arange(n), x] if q is not None else torch.ones_like(p_x)
        host = torch.cat([winners.double(), p_x.double(), q_x.double()]).tolist()  # the one sync
    else:
        host = winners.double().tolist()
    best = [int(b) for b in host[: n + 1]]
    a = 0
    while a < n and drafts[a] == best[a]:
        a += 1
    judged = min(a + 1, n)
    p_x, q_x = host[n + 1 : 2 * n + 1][:judged], host[2 * n + 1 :][:judged]
    ok = [1.0] * a + [0.0] * (judged - a)
    # The token is a draw from p[a] itself (the race), not from a residual.
    return Verdict(a, best[a], p_x, q_x, ok, [None] * judged, p[a], noise[a])
