"""A round's result turned into the Step its readers see: the drafts' own text, the decisions, and the
teaching tables. The round loop (engine.py) only drafts, verifies and commits; what a view or a
benchmark reads of a round is built here, after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.core import teaching_tables, verify
from app.core.contracts import Proposal
from app.core.events import BONUS, CORRECTED, TARGET, Decision, Step, thrown_away
from app.core.text import Detokenizer


@dataclass
class Round:
    """What one round did: its drafts (with their parents), the verdict (the kept path and the target's
    token), what the output took of them, and its timings. p_logits and p are the target's rows, for
    the teaching tables; a Step keeps none of them."""

    number: int
    k: int  # the draft length asked for (0: plain decoding, or no room left)
    nodes: int  # the node budget the round's draft was given (0: a chain of k)
    proposal: Proposal
    verdict: verify.Verdict
    base: int  # committed tokens when the round began
    emitted: list[int]  # what the output took, after the stop rules
    text: str
    stop_reason: str | None
    draft_time: float
    verify_time: float
    p_logits: torch.Tensor
    p: torch.Tensor | None  # None under greedy
    plain: bool  # plain decoding: no draft source at all
    window: list[int]  # the output's decode window when the round began: its drafts' text follows it


class Recorder:
    """Builds each round's Step. display=False leaves each draft's and the target token's own text
    empty (only a view reads them), so a benchmark decodes nothing beyond the output; teach fills the
    teaching tables (p, q and the residual where the target chose; the shared-noise race)."""

    def __init__(self, tokenizer, *, display: bool = True, teach: bool = False) -> None:
        self.tokenizer, self.teach = tokenizer, teach
        # Decodes only, after each round's window (Round.window): the output's own state moves on.
        self.detok = Detokenizer(tokenizer, []) if display else None

    def step(self, r: Round) -> Step:
        v, proposal, n = r.verdict, r.proposal, r.verdict.accepted
        drafts, parents, judged, texts, token_text = self._listed(proposal, v, r.window)
        bonus = all(parent != n - 1 for parent in parents[n:])  # nothing was drafted below the kept path's end
        top, race = self._tables(r)
        return Step(
            round=r.number,
            k=r.k,
            drafted=drafts,
            draft_text=texts,
            accepted=n,
            token=v.token,
            token_kind=TARGET if not drafts else (BONUS if bonus else CORRECTED),
            token_text=token_text,
            rejected=drafts[n:],
            emitted=r.emitted,
            text=r.text,
            draft_time=r.draft_time,
            verify_time=r.verify_time,
            elapsed=0.0,
            decisions=_decisions(drafts, texts, v, judged),
            top=top,
            stop_reason=r.stop_reason,
            feature_position=proposal.feature_position,
            context=r.base,
            race=race,
            parents=parents,
            nodes=r.nodes,
        )

    def _tables(self, r: Round) -> tuple[list, list]:
        if not self.teach or r.plain:
            return [], []
        top = teaching_tables.top_table(self.tokenizer, r.proposal, r.p_logits, r.p, r.verdict)
        if r.verdict.noise is None:
            return top, []
        assert r.p is not None  # shared noise verifies on the processed p
        return top, teaching_tables.race_table(self.tokenizer, r.proposal, r.p, r.verdict)

    def _listed(self, proposal: Proposal, v: verify.Verdict, window: list[int]):
        """The round's drafts as its Step lists them: the kept path first (a chain keeps its order),
        their parents in that order, the judged nodes by their new index, and each node's text after
        its own branch: the path and the branch below its end in one decode, each other branch in one."""
        tokens, parents, path = proposal.tokens, proposal.parents, v.path
        order = path + [i for i in range(len(tokens)) if i not in path]
        where = {node: j for j, node in enumerate(order)}
        shown = [where[parents[i]] if parents[i] >= 0 else -1 for i in order]
        drafts, judged, a = [tokens[i] for i in order], [where[i] for i in v.judged], len(path)
        if self.detok is None:
            return drafts, shown, judged, [""] * len(drafts), ""
        branches = thrown_away(shown, a)
        first = branches.pop(0) if branches and shown[branches[0][0]] == a - 1 else []
        texts = [""] * len(drafts)
        head, token_text = self.detok.peek(drafts[:a] + [drafts[i] for i in first], a, v.token, window)
        for i, text in zip([*range(a), *first], head, strict=True):
            texts[i] = text
        for branch in branches:
            above: list[int] = []
            at = shown[branch[0]]
            while at >= 0:
                above.insert(0, at)
                at = shown[at]
            ids = [drafts[i] for i in above + branch]
            for i, text in zip(branch, self.detok.peek(ids, 0, ids[0], window)[0][len(above) :], strict=True):
                texts[i] = text
        return drafts, shown, judged, texts, token_text


def _decisions(drafts, texts, v: verify.Verdict, judged: list[int]) -> list[Decision]:
    """One record per judged draft, in the order judged; judged[j] is its index in drafts."""
    return [
        Decision(drafts[i], texts[i], v.p_x[j], v.q_x[j], v.accept_prob[j], v.u[j], i < v.accepted, i)
        for j, i in enumerate(judged)
    ]
