"""A chain is the tree [-1, 0, 1, ..]: each rule's one walk, given a chain, gives the verdict and the draws
of the vectorised chain rules it replaced (frozen below as they were), for every k up to 16."""

from __future__ import annotations

import pytest
import torch

from app.core import sampling, tree_shape, verify
from app.core.verify import Verdict

V = 64
SEEDS = 60


# ---- the chain rules as they were, frozen: the reference ---------------------------------------


def _chain_verdict(a: int, judged: int, token: int, p_x, q_x, accept_prob, u, residual, noise=None) -> Verdict:
    return Verdict(list(range(a)), token, list(range(judged)), p_x, q_x, accept_prob, u, residual, noise)


def chain_greedy(drafts: list[int], p_logits: torch.Tensor, teach: bool) -> Verdict:
    n = len(drafts)
    logits = p_logits.float()
    argmax = logits.argmax(-1)
    best: list[int]
    p_x: list[float | None]
    if teach:
        x = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        p_drafts = (logits[:n].gather(-1, x[:, None])[:, 0] - logits[:n].logsumexp(-1)).exp()
        host = torch.cat([argmax.double(), p_drafts.double()]).tolist()
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


def chain_sampling(drafts: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> Verdict:
    p, q = verify.align(p, q)
    if p.device != gen.device:
        both = torch.cat([p, q]).to(gen.device)
        p, q = both[: len(drafts) + 1], both[len(drafts) + 1 :]
    n = len(drafts)
    i = n
    p_x: list[float | None] = []
    q_x: list[float] = []
    accept_prob: list[float] = []
    u_x: list[float | None] = []
    if n:
        rows, x = torch.arange(n), torch.tensor(drafts, dtype=torch.long, device=p.device)
        p_t, q_t = p[rows, x].double(), q[rows, x].double()
        accept = torch.where(p_t == 0, torch.zeros_like(p_t), torch.where(p_t >= q_t, torch.ones_like(p_t), p_t / q_t))
        state = gen.get_state()
        u = torch.rand(n, generator=gen, device=gen.device).double()
        rejected = (u >= accept).nonzero()
        if len(rejected):
            i = int(rejected[0, 0])
        if i + 1 < n:
            gen.set_state(state)
            torch.rand(i + 1, generator=gen, device=gen.device)
        judged = min(i + 1, n)
        p_x, q_x, accept_prob, u_x = torch.stack([p_t, q_t, accept, u])[:, :judged].tolist()
    if i < n:
        residual = (p[i] - q[i]).clamp_min(0)
        mass = residual.sum()
        residual = residual / mass if mass > 0 else p[i]
    else:
        residual = p[n]
    return _chain_verdict(i, min(i + 1, n), sampling.sample(residual, gen), p_x, q_x, accept_prob, u_x, residual)


def chain_shared_noise(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None, seed: int, position: int) -> Verdict:
    n = len(drafts)
    noise = torch.stack([sampling.race_noise(seed, position + j, p.shape[-1]) for j in range(n + 1)])
    winners = sampling.race(p, noise.to(p.device))
    if n:
        x = torch.tensor(drafts, dtype=torch.long, device=p.device)
        p_t = p[torch.arange(n), x]
        q_t = q.to(p.device)[torch.arange(n), x] if q is not None else torch.ones_like(p_t)
        host = torch.cat([winners.double(), p_t.double(), q_t.double()]).tolist()
    else:
        host = winners.double().tolist()
    best = [int(b) for b in host[: n + 1]]
    a = 0
    while a < n and drafts[a] == best[a]:
        a += 1
    judged = min(a + 1, n)
    p_x, q_x = host[n + 1 : 2 * n + 1][:judged], host[2 * n + 1 :][:judged]
    ok = [1.0] * a + [0.0] * (judged - a)
    return _chain_verdict(a, judged, best[a], p_x, q_x, ok, [None] * judged, p[a], noise[a])


# ---- the cases ---------------------------------------------------------------------------------


def same(new: Verdict, old: Verdict) -> None:
    """Field for field, bit for bit."""
    fields = ("path", "token", "judged", "p_x", "q_x", "accept_prob", "u")
    assert [getattr(new, f) for f in fields] == [getattr(old, f) for f in fields]
    assert torch.equal(new.residual, old.residual)
    assert (new.noise is None) == (old.noise is None)
    assert new.noise is None or old.noise is None or torch.equal(new.noise, old.noise)


def sampled_case(seed: int, k: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """p (k + 1, V) and q (k, V') with drafts from q: p with top-k zeros, q near p (long runs kept), a
    narrower q (a smaller vocabulary) or a one-hot q (prompt lookup), by seed."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(k + 1, V, generator=g), -1)
    q = torch.softmax(3 * torch.randn(k, V - 8 if seed % 5 == 1 else V, generator=g), -1)
    if seed % 3 == 0:
        p[:, : V // 3] = 0
        p = p / p.sum(-1, keepdim=True)
    if seed % 2 and q.shape[-1] == V:
        p[:k] = 0.95 * q + 0.05 * p[:k]
    drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
    if seed % 7 == 3:
        q = verify.one_hot_q(drafts, V, p.device)
    return drafts, p, q


@pytest.mark.parametrize("k", range(17))
def test_sampling_on_a_chain_is_the_chain_rule_draw_for_draw(k):
    kept = set()
    for seed in range(SEEDS):
        drafts, p, q = sampled_case(seed, k)
        g_old, g_new = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        old = chain_sampling(drafts, p, q, g_old)
        same(verify.speculative_sampling(drafts, tree_shape.chain(k), p, q, g_new), old)
        assert torch.equal(g_old.get_state(), g_new.get_state()), "the same draws consumed"
        kept.add(old.accepted)
    assert 0 in kept and (k == 0 or k in kept), f"a rejection and a full accept should occur: {sorted(kept)}"


@pytest.mark.parametrize("k", range(17))
def test_greedy_on_a_chain_is_the_chain_rule(k):
    for seed in range(SEEDS):
        g = torch.Generator().manual_seed(seed)
        logits = 2 * torch.randn(k + 1, V, generator=g)
        if seed % 4 == 1:
            logits = logits.bfloat16()  # a CUDA target's logits
        best = logits.float().argmax(-1).tolist()
        cut = seed % (k + 1)
        drafts = best[:cut] + [(b + 1 + seed) % V for b in best[cut:k]]
        for teach in (True, False):
            same(verify.greedy(drafts, tree_shape.chain(k), logits, teach), chain_greedy(drafts, logits, teach))


@pytest.mark.parametrize("k", range(17))
def test_shared_noise_on_a_chain_is_the_chain_rule(k):
    kept = set()
    for seed in range(SEEDS):
        _, p, q = sampled_case(seed, k)
        position = 3 + seed
        if seed % 2:  # drafts that win the race up to a cut
            noise = torch.stack([sampling.race_noise(seed, position + j, V) for j in range(k + 1)])
            winners = sampling.race(p, noise).tolist()
            cut = seed % (k + 1)
            drafts = winners[:cut] + [(w + 1) % V for w in winners[cut:k]]
        else:
            drafts = [int(x) for x in torch.randint(0, V, (k,), generator=torch.Generator().manual_seed(seed))]
        q_or_none = None if seed % 3 == 0 else verify.align(p, q)[1][:k]
        old = chain_shared_noise(drafts, p, q_or_none, seed, position)
        same(verify.shared_noise(drafts, tree_shape.chain(k), p, q_or_none, seed, position), old)
        kept.add(old.accepted)
    assert len(kept) >= min(k + 1, 3), sorted(kept)
