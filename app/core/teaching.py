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
    ids = ids[p_row[ids].argsort(descending=True)][:size]
    if int(v.token) not in ids.tolist():  # the token the target drew is always plotted
        ids = torch.cat([ids[: size - 1], torch.tensor([int(v.token)], device=ids.device)])
    return [(int(i), tokenizer.decode([int(i)]), float(p_row[i]), float(q_row[i]), float(residual[i])) for i in ids]
