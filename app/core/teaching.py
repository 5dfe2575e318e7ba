"""The teaching view's table for one round: p, q and the residual at the point where the target chose."""

from __future__ import annotations

import torch

from app.core import verify
from app.core.contracts import Proposal

TOP_N = 8  # tokens kept per round for the teaching view


def top_table(tokenizer, proposal: Proposal, p_logits, p, v: verify.Verdict, size: int = TOP_N) -> list[tuple]:
    """(id, text, p, q, residual) for the few tokens that matter where the target chose its token.

    p is None under greedy decoding; then softmax(logits) is shown so there is something to see.
    """
    n, drafts, residual = v.accepted, proposal.tokens, v.residual
    if n == len(drafts):
        q_row = torch.zeros(1, device=p_logits.device)
    elif proposal.q is not None:
        q_row = proposal.q[n]
    else:
        q_row = verify.one_hot_q(drafts[n : n + 1], p_logits.shape[-1], p_logits.device)[0]
    p_row = p_logits[n].float().softmax(-1) if p is None else p[n]
    width = max(len(p_row), len(q_row), len(residual))
    p_row, q_row, residual = (
        torch.nn.functional.pad(t.float().to(p_row.device), (0, width - len(t))) for t in (p_row, q_row, residual)
    )
    size = min(size, width)
    ids = torch.unique(torch.cat([p_row.topk(size).indices, residual.topk(size).indices]))
    ids = ids[p_row[ids].argsort(descending=True)].tolist()
    # Always plotted: the token the target chose and, after a rejection, the draft token it rejected.
    keep = list(dict.fromkeys([int(v.token)] + [int(x) for x in drafts[n : n + 1] if int(x) < width]))
    others = [i for i in ids if i not in keep][: max(size - len(keep), 0)]
    ids = sorted(keep + others, key=lambda i: -float(p_row[i]))
    return [(i, tokenizer.decode([i]), float(p_row[i]), float(q_row[i]), float(residual[i])) for i in ids]


RACE_N = 5  # tokens shown per side of the shared-noise race


def race_table(tokenizer, proposal: Proposal, p: torch.Tensor, v: verify.Verdict, size: int = RACE_N) -> list[tuple]:
    """(id, text, p, q, p/E, q/E) where the target chose under shared noise: the leaders of the
    target's race and of the draft's over the same noise E, the draft token judged there and the
    target's pick, by p/E. The draft's pick is kept exactly when both races have the same winner."""
    assert v.noise is not None, "a race table needs a shared-noise verdict"
    n, noise = v.accepted, v.noise.to(p.device)
    p_row = p[n].float()
    if n < len(proposal.tokens) and proposal.q is not None:
        q_row = proposal.q[n].float().to(p.device)
    elif n < len(proposal.tokens):
        q_row = verify.one_hot_q(proposal.tokens[n : n + 1], len(p_row), p.device)[0]
    else:  # every draft kept: the draft ran no race here
        q_row = torch.zeros_like(p_row)
    # A narrower q (a smaller draft vocabulary) is 0 beyond its width, as verify.align pads it.
    q_row = torch.nn.functional.pad(q_row, (0, max(0, len(p_row) - len(q_row))))[: len(p_row)]
    width = min(len(p_row), len(noise))
    p_score, q_score = p_row[:width] / noise[:width], q_row[:width] / noise[:width]
    k = min(size, width)
    ids = torch.cat([p_score.topk(k).indices, q_score.topk(k).indices]).tolist() + [int(v.token)]
    if n < len(proposal.tokens):
        ids.append(proposal.tokens[n])
    ids = sorted(set(i for i in ids if i < width), key=lambda i: -float(p_score[i]))
    return [
        (i, tokenizer.decode([i]), float(p_row[i]), float(q_row[i]), float(p_score[i]), float(q_score[i])) for i in ids
    ]
