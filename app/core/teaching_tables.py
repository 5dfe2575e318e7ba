"""The teaching view's table for one round: p, q and the residual at the point where the target chose."""

from __future__ import annotations

import torch

from app.core import verify
from app.core.contracts import Proposal

TOP_N = 8  # tokens kept per round for the teaching view


def chosen_at(v: verify.Verdict) -> tuple[int, int | None]:
    """(the row of p where the target chose its token, the node it turned down there or None): the row
    after the kept path's last node, and the last node judged when it was not kept. A chain's are
    (a, a) after a rejection, and (n, None) when every draft was kept."""
    last = v.judged[-1] if v.judged and v.judged[-1] not in v.path else None
    return (v.path[-1] + 1 if v.path else 0), last


def top_table(tokenizer, proposal: Proposal, p_logits, p, v: verify.Verdict, size: int = TOP_N) -> list[tuple]:
    """(id, text, p, q, residual) for the few tokens that matter where the target chose its token.

    p is None under greedy decoding; then softmax(logits) is shown so there is something to see.
    """
    row, last = chosen_at(v)
    residual = v.residual
    rejected = [] if last is None else [proposal.tokens[last]]
    if last is None:
        q_row = torch.zeros(1, device=p_logits.device)
    elif proposal.q is not None:
        q_row = proposal.q[last]
    else:
        q_row = verify.one_hot_q(rejected, p_logits.shape[-1], p_logits.device)[0]
    p_row = p_logits[row].float().softmax(-1) if p is None else p[row]
    width = max(len(p_row), len(q_row), len(residual))
    p_row, q_row, residual = (
        torch.nn.functional.pad(t.float().to(p_row.device), (0, width - len(t))) for t in (p_row, q_row, residual)
    )
    size = min(size, width)
    ids = torch.unique(torch.cat([p_row.topk(size).indices, residual.topk(size).indices]))
    ids = ids[p_row[ids].argsort(descending=True)].tolist()
    # Always plotted: the token the target chose and, after a rejection, the draft token it rejected.
    keep = list(dict.fromkeys([int(v.token)] + [int(x) for x in rejected if int(x) < width]))
    others = [i for i in ids if i not in keep][: max(size - len(keep), 0)]
    ids = sorted(keep + others, key=lambda i: -float(p_row[i]))
    return [(i, tokenizer.decode([i]), float(p_row[i]), float(q_row[i]), float(residual[i])) for i in ids]


RACE_N = 5  # tokens shown per side of the shared-noise race


def race_table(tokenizer, proposal: Proposal, p: torch.Tensor, v: verify.Verdict, size: int = RACE_N) -> list[tuple]:
    """(id, text, p, q, p/E, q/E) where the target chose under shared noise: the leaders of the
    target's race and of the draft's over the same noise E, the draft token judged there and the
    target's pick, by p/E. The draft's pick is kept exactly when both races have the same winner."""
    assert v.noise is not None, "a race table needs a shared-noise verdict"
    (row, last), noise = chosen_at(v), v.noise.to(p.device)
    p_row = p[row].float()
    if last is not None and proposal.q is not None:
        q_row = proposal.q[last].float().to(p.device)
    elif last is not None:
        q_row = verify.one_hot_q([proposal.tokens[last]], len(p_row), p.device)[0]
    else:  # every draft on the path kept: the draft ran no race here
        q_row = torch.zeros_like(p_row)
    # A narrower q (a smaller draft vocabulary) is 0 beyond its width, as verify.align pads it.
    q_row = torch.nn.functional.pad(q_row, (0, max(0, len(p_row) - len(q_row))))[: len(p_row)]
    width = min(len(p_row), len(noise))
    p_score, q_score = p_row[:width] / noise[:width], q_row[:width] / noise[:width]
    k = min(size, width)
    ids = torch.cat([p_score.topk(k).indices, q_score.topk(k).indices]).tolist() + [int(v.token)]
    if last is not None:
        ids.append(proposal.tokens[last])
    ids = sorted(set(i for i in ids if i < width), key=lambda i: -float(p_score[i]))
    return [
        (i, tokenizer.decode([i]), float(p_row[i]), float(q_row[i]), float(p_score[i]), float(q_score[i])) for i in ids
    ]
