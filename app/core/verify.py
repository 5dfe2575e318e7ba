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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.core import sampling, transfer
from app.core.tree_shape import children, depths

# A proposal is a tree of drafts: node i holds token tokens[i] and hangs below node parents[i] (-1: below
# the last committed token); parents come before their children. A chain is the tree with parents
# [-1, 0, 1, ..]. p has a row per place a token is chosen: row 0 after the committed tokens, row i + 1
# after node i. Each rule gathers every node's figures at once (its token's p at its parent's row, its
# q), then walks down from the root: a node's children are judged in the order drafted until one is
# kept, and the walk ends below a node where none is.
#
# Sampling on a tree uses recursive rejection sampling without replacement (Jeon et al. 2024, the
# multi-draft rule SpecInfer's multi-step speculative sampling reduces to for one child): a node's
# children are judged in the order they were drafted, child j with the q it was drawn from given the
# children before it (q_j, for a draw without replacement q renormalised without them); it is kept with
# probability min(1, r_j(x) / q_j(x)), and on a rejection r_{j+1} = norm(max(0, r_j - q_j)), starting
# from r_1 = p. The token chosen there is exactly a draw from p, whatever the number of children; with
# one child a node it is the chain's rule, draw for draw.


@dataclass
class Verdict:
    path: list[int]  # the kept nodes, root to leaf (their tokens are the accepted drafts); a chain's 0..a-1
    token: int  # the target's own token after the path: a correction, or the bonus at a leaf
    judged: list[int]  # every node judged, in the order judged
    p_x: list[float | None]  # per judged node: r(x) (greedy: p(x) at T = 1 when teaching, else None)
    q_x: list[float]  # q_j(x)
    accept_prob: list[float]  # min(1, r/q); greedy and shared noise: 1 if x is the target's pick else 0
    u: list[float | None]  # the draws (None where nothing is random)
    residual: torch.Tensor  # (V,) the distribution the target's token was drawn from
    noise: torch.Tensor | None = None  # shared noise: (V,) E at the position the target's token was chosen

    @property
    def accepted(self) -> int:
        return len(self.path)


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
    if drafts:  # a queued copy of the ids: a plain one from the host would be a sync of its own
        q.scatter_(1, transfer.queued(torch.tensor(drafts)[:, None], device), 1.0)
    return q


def greedy(
    tokens: list[int],
    parents: list[int],
    p_logits: torch.Tensor,
    teach: bool = True,
    pending: torch.Tensor | None = None,
) -> Verdict:
    """Follow the target's argmax down the drafts. p_logits: (n + 1, V).

    All device work is queued first and read back in one transfer: one host sync per round. p(x)
    (softmax at T = 1) is teaching data: without teach it is None, and the (n, V) logsumexp that it
    needs, the largest cost of a greedy round outside the passes, is skipped. `pending`: a chain's n
    picks still on the device (Proposal.pending), read in the same transfer into the empty `tokens`.
    """
    n, logits = (len(tokens) if pending is None else len(pending)), p_logits.float()
    argmax = logits.argmax(-1)
    best: list[int]
    p_of: list[float | None]
    if pending is not None:  # the verdict and the drafts it judged, in one read
        assert not tokens and not teach, "picks on the device are a bare greedy chain's"
        host = torch.cat([argmax, pending.to(argmax.device, argmax.dtype)]).tolist()
        best, p_of = host[: n + 1], [None] * n
        tokens += host[n + 1 :]
    elif teach and n:  # exp(logit - logsumexp) needs no (n, V) softmax
        x, rows = _index(tokens, parents, logits.device)
        p_nodes = (logits[rows, x] - logits[:n].logsumexp(-1)[rows]).exp()  # a parent's row is below n
        host = torch.cat([argmax.double(), p_nodes.double()]).tolist()  # the one sync
        best, p_of = [int(b) for b in host[: n + 1]], host[n + 1 :]
    else:
        best, p_of = argmax.tolist(), [None] * n
    path, judged, ok = _follow(tokens, parents, best)
    row = path[-1] + 1 if path else 0
    pick = best[row]
    # The one-hot from the argmax still on the device: a host number written into a device tensor is a
    # copy from pageable memory, which would be a second sync a round.
    residual = torch.zeros(logits.shape[-1], device=logits.device).index_fill_(0, argmax[row].view(1), 1.0)
    m = len(judged)
    return Verdict(path, pick, judged, [p_of[j] for j in judged], [1.0] * m, ok, [None] * m, residual)


def speculative_sampling(
    tokens: list[int], parents: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator
) -> Verdict:
    """Lossless rejection sampling. p: (n + 1, V) target, q: (n, V) draft (node i's q_j), both processed.

    One transfer to the generator's device, the only host sync. The draws are made at once and the
    generator then left where drawing one per judged node leaves it: u for each judged node in turn,
    then one sample from the residual or, at a leaf, the bonus from p.
    """
    n = len(tokens)
    p, q = align(p, q)
    if p.device != gen.device:  # one transfer for the round; everything after runs on the host
        both = torch.cat([p, q]).to(gen.device)
        p, q = both[: n + 1], both[n + 1 :]
    p_x: list[float | None] = []
    q_x: list[float] = []
    accept: list[float] = []
    u: list[float] = []
    state = gen.get_state() if n else None
    if n:
        x, rows = _index(tokens, parents, p.device)
        p_t, q_t = p[rows, x].double(), q[torch.arange(n), x].double()  # double: min(1, p/q) as Python floats
        # A draft the target gives no mass is never kept, even where q gives it none either.
        a_t = torch.where(p_t == 0, torch.zeros_like(p_t), torch.where(p_t >= q_t, torch.ones_like(p_t), p_t / q_t))
        u_t = torch.rand(n, generator=gen, device=gen.device).double()  # = n draws of sampling.uniform
        p_x, q_x, accept, u = torch.stack([p_t, q_t, a_t, u_t]).tolist()
    residual: dict[int, torch.Tensor] = {}  # below a node whose child was rejected: r for the next child
    judged_u: list[float | None] = []

    def keep(node: int) -> bool:
        at, draw = parents[node], u[len(judged_u)]
        judged_u.append(draw)
        if at in residual:  # an earlier sibling was rejected: judged against r_j, not p
            rx, qx = float(residual[at][tokens[node]]), q_x[node]
            p_x[node], accept[node] = rx, 0.0 if rx == 0 else 1.0 if rx >= qx else rx / qx
        if draw < accept[node]:
            return True
        r = residual.get(at, p[at + 1])
        rest = (r - q[node]).clamp_min(0)
        mass = rest.sum()
        residual[at] = rest / mass if mass > 0 else r  # zero mass: r == q_j, where a rejection has probability 0
        return False

    path, judged = _walk(parents, keep)
    if state is not None and len(judged) < n:  # consume only the draws judged, as one at a time would
        gen.set_state(state)
        torch.rand(len(judged), generator=gen, device=gen.device)
    at = path[-1] if path else -1
    r = residual.get(at, p[at + 1])
    p_j, q_j, a_j = [p_x[j] for j in judged], [q_x[j] for j in judged], [accept[j] for j in judged]
    return Verdict(path, sampling.sample(r, gen), judged, p_j, q_j, a_j, judged_u, r)


def speculative_sampling_on_device(
    tokens: list[int], p: torch.Tensor, q: torch.Tensor, pending: torch.Tensor, gen: torch.Generator
) -> Verdict:
    """speculative_sampling for a chain whose n picks are still on the device (Proposal.pending), every
    step of the rule made there, read back in one transfer into the empty `tokens`. p: (n + 1, V), q:
    (n, V), both processed; gen on p's device.

    The rule is the same: draft i is kept with probability min(1, p(x)/q(x)), the first rejected one
    gives way to a draw from norm(max(0, p - q)), and after n accepts the bonus is drawn from p. The
    generator gives n uniforms and one race each round, judged or not, so its draws are not
    speculative_sampling's (which takes only the judged ones); the distribution is the same.
    """
    assert not tokens, "picks on the device fill an empty chain"
    n = len(pending)
    p, q = align(p, q)
    x, rows = pending.to(p.device, torch.long), torch.arange(n, device=p.device)
    p_t, q_t = p[rows, x].double(), q[rows, x].double()
    a_t = torch.where(p_t == 0, 0.0, torch.where(p_t >= q_t, 1.0, p_t / q_t))
    u_t = torch.rand(n, generator=gen, device=gen.device).to(p.device, torch.float64)
    # the first rejected draft, or n after n accepts (argmax gives the first of equal values); a NaN
    # acceptance rejects, as the host rule's `u < a` does
    at = torch.cat([~(u_t < a_t), torch.ones(1, dtype=torch.bool, device=p.device)]).int().argmax().view(1)
    below = torch.cat([q, q.new_zeros(1, q.shape[-1])]).index_select(0, at)[0]  # no q after n accepts
    p_at = p.index_select(0, at)[0]
    rest = (p_at - below).clamp_min(0)
    mass = rest.sum()
    # zero mass: p == q there, where a rejection has probability 0
    r = torch.where(mass > 0, rest / mass.clamp_min(torch.finfo(rest.dtype).tiny), p_at)
    token = sampling.draw_unread(r, gen).view(1)
    # multinomial refuses NaN or inf probabilities on the host path; here the check rides the one read
    finite = (torch.isfinite(p).all() & torch.isfinite(q).all()).double().view(1)
    host = torch.cat([finite, at.double(), token.double(), x.double(), p_t, q_t, a_t, u_t]).tolist()  # the one sync
    if not host.pop(0):
        raise RuntimeError("probability tensor contains either inf or nan")
    accepted, pick = int(host[0]), int(host[1])
    tokens += [int(t) for t in host[2 : 2 + n]]
    p_x, q_x, accept, u = (host[2 + n * (i + 1) : 2 + n * (i + 2)] for i in range(4))
    m = min(accepted + 1, n)
    path, judged = list(range(accepted)), list(range(m))
    return Verdict(path, pick, judged, p_x[:m], q_x[:m], accept[:m], u[:m], r)


def shared_noise(
    tokens: list[int],
    parents: list[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    seed: int,
    position: int,
    pending: torch.Tensor | None = None,
) -> Verdict:
    """Keep the drafts that win the target's race. p: (n + 1, V) processed, row 0 for the token at
    absolute position `position`; a node at depth d races at position + d. q: (n, V) or None
    (one-hot), read only for the teaching record. `pending`: a chain's n picks still on the device
    (Proposal.pending), read in the same transfer into the empty `tokens`.

    The race needs no draw from the run's generator: nothing here depends on what was drafted before.
    """
    n = len(tokens) if pending is None else len(pending)
    depth = [0, *depths(parents)]  # of each row of p
    # One noise row a depth, a row of p each picking its depth's on the host, moved in one queued copy.
    by_depth = torch.stack([sampling.race_noise(seed, position + d, p.shape[-1]) for d in range(max(depth) + 1)])
    noise = transfer.queued(by_depth[torch.tensor(depth)], p.device)
    winners = sampling.race(p, noise)
    if n:
        if pending is None:
            x, rows = _index(tokens, parents, p.device)
        else:  # a chain: node i is judged at row i
            assert not tokens, "picks on the device fill an empty chain"
            x, rows = pending.to(p.device, torch.long), torch.arange(n, device=p.device)
        p_t = p[rows, x]
        q_t = q.to(p.device)[torch.arange(n, device=p.device), x] if q is not None else torch.ones_like(p_t)
        read = [winners.double(), p_t.double(), q_t.double()] + ([] if pending is None else [x.double()])
        host = torch.cat(read).tolist()  # the one sync
        if pending is not None:
            tokens += [int(t) for t in host[3 * n + 1 :]]
    else:
        host = winners.double().tolist()
    best = [int(b) for b in host[: n + 1]]
    path, judged, ok = _follow(tokens, parents, best)
    row = path[-1] + 1 if path else 0
    p_x: list[float | None] = [host[n + 1 + j] for j in judged]
    q_x = [host[2 * n + 1 + j] for j in judged]
    # The token is a draw from p itself (the race), not from a residual.
    return Verdict(path, best[row], judged, p_x, q_x, ok, [None] * len(judged), p[row], noise[row])


def _index(tokens: list[int], parents: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) each node's token and (n,) the row of p it is judged at: its parent's, one past it."""
    both = transfer.queued(torch.tensor([tokens, parents], dtype=torch.long), device)  # one queued copy
    return both[0], both[1] + 1


def _follow(tokens: list[int], parents: list[int], best: list[int]) -> tuple[list[int], list[int], list[float]]:
    """(path, judged, ok) of a walk that keeps a node where its token is the one its parent's row picked
    (`best`: each row's pick): greedy's argmax, shared noise's race winner."""
    path, judged = _walk(parents, lambda node: tokens[node] == best[parents[node] + 1])
    return path, judged, [1.0 if node in path else 0.0 for node in judged]


def _walk(parents: list[int], keep: Callable[[int], bool]) -> tuple[list[int], list[int]]:
    """Down the tree from the committed text: each node's children judged by keep, in the order drafted,
    until one is kept, whose children come next. Returns (the kept path, every node judged, in order)."""
    below = children(parents)
    path: list[int] = []
    judged: list[int] = []
    at = -1
    while True:
        for child in below[at]:
            judged.append(child)
            if keep(child):
                path.append(child)
                at = child
                break
        else:
            return path, judged
