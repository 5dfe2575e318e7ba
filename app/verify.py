"""Pure verification rules: how many drafts the target keeps, and its own next token.

Sampling follows Leviathan et al. 2023 / Chen et al. 2023: accept x with probability
min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)); after k accepts draw a
bonus token from p. Greedy is the same rule with one-hot p and q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app import sampling


@dataclass
class Verdict:
    accepted: int  # length of the kept prefix of drafts
    token: int  # the target's own token: a correction, or the bonus
    p_x: list[float]  # p(x_i) for each draft judged
    q_x: list[float]  # q(x_i)
    accept_prob: list[float]  # min(1, p/q)
    u: list[float | None]  # the draws (None under greedy)
    residual: torch.Tensor  # (V,) the distribution the target's token was drawn from


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


def greedy(drafts: list[int], p_logits: torch.Tensor) -> Verdict:
    """Keep the longest prefix equal to the target's argmax. p_logits: (n+1, V)."""
    best = p_logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    judged = drafts[: n + 1]
    soft = p_logits.float().softmax(-1)
    p_x = [float(soft[i, x]) for i, x in enumerate(judged)]
    ok = [1.0 if x == best[i] else 0.0 for i, x in enumerate(judged)]
    residual = torch.zeros_like(soft[n]).scatter_(-1, torch.tensor([best[n]], device=soft.device), 1.0)
    return Verdict(n, best[n], p_x, [1.0] * len(judged), ok, [None] * len(judged), residual)


def speculative_sampling(
    drafts: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator
) -> Verdict:
    """Lossless rejection sampling. p: (n+1, V) target, q: (n, V) draft, both processed."""
    p, q = align(p, q)
    p_x, q_x, a_x, u_x = [], [], [], []
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i, x])
        a = 1.0 if px >= qx else px / qx
        u = sampling.uniform(gen)
        p_x.append(px), q_x.append(qx), a_x.append(a), u_x.append(u)
        if u >= a:
            residual = (p[i] - q[i]).clamp_min(0)
            mass = residual.sum()
            # Zero mass means p == q where rejection had probability 0: only rounding gets here.
            residual = residual / mass if mass > 0 else p[i]
            return Verdict(i, sampling.sample(residual, gen), p_x, q_x, a_x, u_x, residual)
    n = len(drafts)
    return Verdict(n, sampling.sample(p[n], gen), p_x, q_x, a_x, u_x, p[n])
