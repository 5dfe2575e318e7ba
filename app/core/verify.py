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

# A proposal is a tree of drafts: node i holds token tokens[i] and hangs below node parents[i] (-1: below
# the last committed token); parents come before their children. A chain is the tree with parents
# [-1, 0, 1, ..], and each rule below takes a vectorised path for it. p has a row per place a token is
# chosen: row 0 after the committed tokens, row i + 1 after node i.
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


def chain(n: int) -> list[int]:
    """The parents of n drafts in a chain: [-1, 0, 1, .., n - 2]."""
    return list(range(-1, n - 1))


def is_chain(parents: list[int] | None) -> bool:
    """True for no parents or a chain's: one child a node."""
    return parents is None or all(parent == i - 1 for i, parent in enumerate(parents))


def _chain_verdict(a: int, judged: int, token: int, p_x, q_x, accept_prob, u, residual, noise=None) -> Verdict:
    return Verdict(list(range(a)), token, list(range(judged)), p_x, q_x, accept_prob, u, residual, noise)


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


def greedy(tokens: list[int], p_logits: torch.Tensor, teach: bool = True, parents: list[int] | None = None) -> Verdict:
    """Follow the target's argmax down the drafts (a chain when parents is None). p_logits: (n + 1, V).

    All device work is queued first and read back in one transfer: one host sync per round. p(x)
    (softmax at T = 1) is teaching data: without teach it is None, and the (n, V) logsumexp that it
    needs, the largest cost of a greedy round outside the passes, is skipped.
    """
    if is_chain(parents):
        return _chain_greedy(tokens, p_logits, teach)
    assert parents is not None
    return _tree_greedy(tokens, parents, p_logits, teach)


def speculative_sampling(
    tokens: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator, parents: list[int] | None = None
) -> Verdict:
    """Lossless rejection sampling. p: (n + 1, V) target, q: (n, V) draft (a tree's: node i's q_j),
    both processed. One transfer to the generator's device, the only host sync; a chain's drafts are
    judged at once, with the same draws as one at a time: u_1.. up to the first rejection, then one
    sample from the residual or, after n accepts, the bonus from p.
    """
    p, q = align(p, q)
    if p.device != gen.device:  # one transfer for the round; everything after runs on the host
        both = torch.cat([p, q]).to(gen.device)
        p, q = both[: len(tokens) + 1], both[len(tokens) + 1 :]
    if is_chain(parents):
        return _chain_sampling(tokens, p, q, gen)
    assert parents is not None
    return _tree_sampling(tokens, parents, p, q, gen)


def shared_noise(
    tokens: list[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    seed: int,
    position: int,
    parents: list[int] | None = None,
) -> Verdict:
    """Keep the drafts that win the target's race. p: (n + 1, V) processed, row 0 for the token at
    absolute position `position`; a node at depth d races at position + d. q: (n, V) or None
    (one-hot), read only for the teaching record.

    The race needs no draw from the run's generator: nothing here depends on what was drafted before.
    """
    if is_chain(parents):
        return _chain_shared_noise(tokens, p, q, seed, position)
    assert parents is not None
    return _tree_shared_noise(tokens, parents, p, q, seed, position)


def _chain_greedy(drafts: list[int], p_logits: torch.Tensor, teach: bool) -> Verdict:
    """The chain's greedy rule: keep the longest prefix equal to the target's argmax."""
    n = len(drafts)
    logits = p_logits.float()
    argmax = logits.argmax(-1)
    best: list[int]
    p_x: list[float | None]
    if teach:  # exp(logit - logsumexp) needs no (n, V) softmax
        x = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        p_drafts = (logits[:n].gather(-1, x[:, None])[:, 0] - logits[:n].logsumexp(-1)).exp()
        host = torch.cat([argmax.double(), p_drafts.double()]).tolist()  # the one sync
        best, p_x = [int(b) for b in host[: n + 1]], host[n + 1 :]
    else:
        best, p_x = argmax.tolist(), [None] * n
    a = 0
    while a < n and drafts[a] == best[a]:
        a += 1
    judged = min(a + 1, n)
    residual = torch.zeros(logits.shape[-1], device=logits.device)
    residual[best[a]] = 1.0
    ok = [1.0] * a + [0.0] * (judged - a)
    return _chain_verdict(a, judged, best[a], p_x[:judged], [1.0] * judged, ok, [None] * judged, residual)


def _chain_sampling(drafts: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> Verdict:
    """The chain's rejection sampling, every draft judged at once (p and q on the generator's device)."""
    n = len(drafts)
    i = n  # index of the first rejected draft; n when all are accepted
    # The judged drafts' p(x), q(x), min(1, p/q) and draws, as Python floats.
    p_x: list[float | None] = []
    q_x: list[float] = []
    accept_prob: list[float] = []
    u_x: list[float | None] = []
    if n:
        rows, x = torch.arange(n), torch.tensor(drafts, dtype=torch.long, device=p.device)
        p_t, q_t = p[rows, x].double(), q[rows, x].double()  # double: the same min(1, p/q) as Python floats
        # A draft the target gives no mass is never kept, even where q gives it none either.
        accept = torch.where(p_t == 0, torch.zeros_like(p_t), torch.where(p_t >= q_t, torch.ones_like(p_t), p_t / q_t))
        state = gen.get_state()
        u = torch.rand(n, generator=gen, device=gen.device).double()  # = n draws of sampling.uniform
        rejected = (u >= accept).nonzero()
        if len(rejected):
            i = int(rejected[0, 0])
        if i + 1 < n:  # consume only the draws that were judged, as a one-by-one loop would
            gen.set_state(state)
            torch.rand(i + 1, generator=gen, device=gen.device)
        judged = min(i + 1, n)
        p_x, q_x, accept_prob, u_x = torch.stack([p_t, q_t, accept, u])[:, :judged].tolist()
    if i < n:
        residual = (p[i] - q[i]).clamp_min(0)
        mass = residual.sum()
        # Zero mass means p == q where rejection had probability 0: only rounding gets here.
        residual = residual / mass if mass > 0 else p[i]
    else:
        residual = p[n]
    return _chain_verdict(i, min(i + 1, n), sampling.sample(residual, gen), p_x, q_x, accept_prob, u_x, residual)


def _chain_shared_noise(
    drafts: list[int], p: torch.Tensor, q: torch.Tensor | None, seed: int, position: int
) -> Verdict:
    """Keep the drafts of a chain that win the target's race (shared_noise)."""
    n = len(drafts)
    noise = torch.stack([sampling.race_noise(seed, position + j, p.shape[-1]) for j in range(n + 1)])
    winners = sampling.race(p, noise.to(p.device))
    if n:
        x = torch.tensor(drafts, dtype=torch.long, device=p.device)
        p_t = p[torch.arange(n), x]
        q_t = q.to(p.device)[torch.arange(n), x] if q is not None else torch.ones_like(p_t)
        host = torch.cat([winners.double(), p_t.double(), q_t.double()]).tolist()  # the one sync
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
    return _chain_verdict(a, judged, best[a], p_x, q_x, ok, [None] * judged, p[a], noise[a])


# ---- the tree walks --------------------------------------------------------------------------


def children(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children (and -1's: the first level), in drafting order."""
    out: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} hangs below {parent}: a parent must come before its children")
        out.setdefault(parent, []).append(i)
        out.setdefault(i, [])
    return out


def depths(parents: list[int]) -> list[int]:
    """Depth of each node: 1 for the first level."""
    d: list[int] = []
    for parent in parents:
        d.append(1 if parent < 0 else d[parent] + 1)
    return d


def _tree_greedy(tokens: list[int], parents: list[int], p_logits: torch.Tensor, teach: bool) -> Verdict:
    """Follow the target's argmax down the tree. p_logits: (n + 1, V). One host sync."""
    kids, n = children(parents), len(tokens)
    logits = p_logits.float()
    best = logits.argmax(-1)
    if teach:
        x = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        rows = torch.tensor([parent + 1 for parent in parents], dtype=torch.long, device=logits.device)
        p_nodes = (logits[rows].gather(-1, x[:, None])[:, 0] - logits[rows].logsumexp(-1)).exp() if n else x.float()
        host = torch.cat([best.double(), p_nodes.double()]).tolist()
        argmax, p_of = [int(b) for b in host[: n + 1]], host[n + 1 :]
    else:
        argmax, p_of = best.tolist(), [None] * n
    path: list[int] = []
    judged: list[int] = []
    ok: list[float] = []
    at = -1
    while True:
        pick = argmax[at + 1]
        for child in kids[at]:
            judged.append(child)
            ok.append(1.0 if tokens[child] == pick else 0.0)
            if tokens[child] == pick:
                break
        else:
            residual = torch.zeros(logits.shape[-1], device=logits.device)
            residual[pick] = 1.0
            p_x: list[float | None] = [p_of[j] for j in judged]
            return Verdict(path, pick, judged, p_x, [1.0] * len(judged), ok, [None] * len(judged), residual)
        path.append(judged[-1])
        at = judged[-1]


def _tree_sampling(
    tokens: list[int], parents: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator
) -> Verdict:
    """Recursive rejection sampling down the tree (see above). p: (n + 1, V), q: (n, V) node i's q_j."""
    kids = children(parents)
    path: list[int] = []
    judged: list[int] = []
    p_x: list[float | None] = []
    q_x: list[float] = []
    accept_prob: list[float] = []
    u_x: list[float | None] = []
    at = -1
    while True:
        r = p[at + 1]
        kept = None
        for child in kids[at]:
            x = tokens[child]
            rx, qx = float(r[x]), float(q[child, x])
            a = 0.0 if rx == 0 else 1.0 if rx >= qx else rx / qx
            u = sampling.uniform(gen)
            judged.append(child)
            p_x.append(rx)
            q_x.append(qx)
            accept_prob.append(a)
            u_x.append(u)
            if u < a:
                kept = child
                break
            rest = (r - q[child]).clamp_min(0)
            mass = rest.sum()
            r = rest / mass if mass > 0 else r  # zero mass: r == q_j, where a rejection has probability 0
        if kept is None:
            return Verdict(path, sampling.sample(r, gen), judged, p_x, q_x, accept_prob, u_x, r)
        path.append(kept)
        at = kept


def _tree_shared_noise(
    tokens: list[int], parents: list[int], p: torch.Tensor, q: torch.Tensor | None, seed: int, position: int
) -> Verdict:
    """At each depth keep the child that is the winner of the target's race there (shared_noise)."""
    kids, n = children(parents), len(tokens)
    depth = [0] + depths(parents)  # of each row of p
    noise = torch.stack([sampling.race_noise(seed, position + d, p.shape[-1]) for d in range(max(depth) + 1)])
    winners = sampling.race(p, noise[depth].to(p.device))
    if n:
        x = torch.tensor(tokens, dtype=torch.long, device=p.device)
        rows = torch.tensor([parent + 1 for parent in parents], dtype=torch.long, device=p.device)
        p_t = p[rows, x]
        q_t = q.to(p.device)[torch.arange(n), x] if q is not None else torch.ones_like(p_t)
        host = torch.cat([winners.double(), p_t.double(), q_t.double()]).tolist()
    else:
        host = winners.double().tolist()
    best = [int(b) for b in host[: n + 1]]
    path: list[int] = []
    judged: list[int] = []
    ok: list[float] = []
    at = -1
    while True:
        for child in kids[at]:
            judged.append(child)
            ok.append(1.0 if tokens[child] == best[at + 1] else 0.0)
            if ok[-1]:
                break
        else:
            p_x: list[float | None] = [host[n + 1 + j] for j in judged]
            q_x = [host[2 * n + 1 + j] for j in judged]
            noise_at = noise[depth[at + 1]]
            return Verdict(path, best[at + 1], judged, p_x, q_x, ok, [None] * len(judged), p[at + 1], noise_at)
        path.append(judged[-1])
        at = judged[-1]
