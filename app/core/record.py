"""A round's result turned into the Step its readers see: the drafts' own text, the decisions, and the
teaching tables. The round loop (engine.py) only drafts, verifies and commits; what a view or a
benchmark reads of a round is built here, after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.core import teaching_tables, verify
from app.core.contracts import Proposal
from app.core.events import BONUS, CORRECTED, TARGET, Decision, Step
from app.core.text import Detokenizer


@dataclass
class Round:
    """What one round did: its drafts (with their parents), the verdict (the kept path and the target's
    token), what the output took of them, and its timings. p_logits and p are the target's rows, for
    the teaching tables; a Step keeps none of them."""

    number: int
    k: int  # the draft length asked for (0: plain decoding, or no room left)
    nodes: int  # the node budget the round's draft was given (0: a chain of k)
    tree: bool  # asked for a tree, and drafted one (whatever its shape: its branches may be empty)
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
        if r.tree:  # listed with its kept path first, so drafts[:n] are the accepted drafts
            drafts, parents, judged, texts, token_text = self._tree(proposal, v, r.window)
            bonus = not any(parent == (v.path[-1] if v.path else -1) for parent in proposal.parents)
        else:
            drafts, parents, judged = proposal.tokens, None, v.judged
            texts, token_text = self._peek(drafts, n, v.token, r.window)
            bonus = n == len(drafts)
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
            decisions=_decisions(drafts, texts, v, judged, parents is not None),
            top=top,
            stop_reason=r.stop_reason,
            feature_position=proposal.feature_position,
            context=r.base,
            race=race,
            parents=parents,
            nodes=r.nodes,
        )

    def _peek(self, drafts: list[int], accepted: int, token: int, window: list[int]) -> tuple[list[str], str]:
        if self.detok is None:
            return [""] * len(drafts), ""
        return self.detok.peek(drafts, accepted, token, window)

    def _tables(self, r: Round) -> tuple[list, list]:
        if not self.teach or r.plain:
            return [], []
        top = teaching_tables.top_table(self.tokenizer, r.proposal, r.p_logits, r.p, r.verdict)
        if r.verdict.noise is None:
            return top, []
        assert r.p is not None  # shared noise verifies on the processed p
        return top, teaching_tables.race_table(self.tokenizer, r.proposal, r.p, r.verdict)

    def _tree(self, proposal: Proposal, v: verify.Verdict, window: list[int]):
        """A tree round as its Step lists it: nodes reordered with the kept path first, their parents
        in that order, the judged nodes by their new index, and each node's text after its own branch."""
        tokens, parents, path = proposal.tokens, proposal.parents, v.path
        order = path + [i for i in range(len(tokens)) if i not in path]
        where = {node: j for j, node in enumerate(order)}
        shown_parents = [where[parents[i]] if parents[i] >= 0 else -1 for i in order]
        judged = [where[i] for i in v.judged]
        if self.detok is None:
            return [tokens[i] for i in order], shown_parents, judged, [""] * len(tokens), ""
        texts_by_node: dict[int, str] = {}
        path_texts, token_text = self.detok.peek([tokens[i] for i in path], len(path), v.token, window)
        texts_by_node.update(zip(path, path_texts, strict=True))
        for i in order[len(path) :]:
            branch: list[int] = []
            at = i
            while at >= 0:
                branch.insert(0, tokens[at])
                at = parents[at]
            texts_by_node[i] = self.detok.peek(branch, 0, branch[0], window)[0][-1]
        return [tokens[i] for i in order], shown_parents, judged, [texts_by_node[i] for i in order], token_text


def _decisions(drafts, texts, v: verify.Verdict, judged: list[int], tree: bool) -> list[Decision]:
    """One record per judged draft, in the order judged; judged[j] is its index in drafts."""
    return [
        Decision(drafts[i], texts[i], v.p_x[j], v.q_x[j], v.accept_prob[j], v.u[j], i < v.accepted, i if tree else None)
        for j, i in enumerate(judged)
    ]
