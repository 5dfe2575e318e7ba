"""The verification rules give exactly the one-draft-at-a-time results and draws."""

import pytest
import torch

from app.core import sampling, tree_shape, verify


def reference_sampling(drafts, p, q, gen):
    """The rule judged one draft at a time, as first written (the specification)."""
    p, q = verify.align(p, q)
    p_x, q_x, a_x, u_x = [], [], [], []
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i, x])
        a = 1.0 if px >= qx else px / qx
        u = sampling.uniform(gen)
        p_x.append(px), q_x.append(qx), a_x.append(a), u_x.append(u)
        if u >= a:
            residual = (p[i] - q[i]).clamp_min(0)
            mass = residual.sum()
            residual = residual / mass if mass > 0 else p[i]
            return i, sampling.sample(residual, gen), p_x, q_x, a_x, u_x, residual
    n = len(drafts)
    return n, sampling.sample(p[n], gen), p_x, q_x, a_x, u_x, p[n]


def random_case(seed: int, n: int, width: int = 12, q_width: int | None = None):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(n + 1, width, generator=g), -1)
    q = torch.softmax(3 * torch.randn(n, q_width or width, generator=g), -1)
    if seed % 3 == 0:  # top-k style zeros in p: rejections with certainty
        p[:, : width // 3] = 0
        p = p / p.sum(-1, keepdim=True)
    if seed % 2 and q.shape[-1] == width:  # a draft close to the target: long accepted runs
        p[:n] = 0.9 * q + 0.1 * p[:n]
    drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(n)]
    return drafts, p, q


@pytest.mark.parametrize("n", [0, 1, 3, 8])
def test_vectorised_sampling_equals_one_by_one(n):
    outcomes = set()
    for seed in range(300):
        drafts, p, q = random_case(seed, n, q_width=10 if seed % 4 == 1 else None)
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        ref = reference_sampling(drafts, p, q, g1)
        v = verify.speculative_sampling(drafts, tree_shape.chain(n), p, q, g2)
        assert (v.accepted, v.token, v.p_x, v.q_x, v.accept_prob, v.u) == ref[:6]
        assert torch.equal(v.residual, ref[6])
        # The generator is left where the one-by-one loop leaves it: later rounds draw the same.
        assert torch.equal(g1.get_state(), g2.get_state())
        outcomes.add(v.accepted)
    assert len(outcomes) == n + 1, "every number of accepts should occur, or the test proves little"


@pytest.mark.parametrize("n", [0, 1, 4, 8])
def test_vectorised_greedy_keeps_the_argmax_prefix(n):
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(n + 1, 20, generator=g)
        best = logits.argmax(-1).tolist()
        cut = seed % (n + 1)  # agree on `cut` drafts, then (if any are left) differ
        drafts = best[:cut] + [(b + 1) % 20 for b in best[cut:n]]
        v = verify.greedy(drafts, tree_shape.chain(n), logits)
        assert (v.accepted, v.token) == (cut, best[cut])
        judged = min(cut + 1, n)
        soft = logits.softmax(-1)
        assert v.p_x == pytest.approx([float(soft[i, x]) for i, x in enumerate(drafts[:judged])], rel=1e-5)
        assert v.accept_prob == [1.0] * cut + [0.0] * (judged - cut)
        assert v.residual.tolist() == torch.nn.functional.one_hot(torch.tensor(best[cut]), 20).float().tolist()
