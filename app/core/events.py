"""The per-round `Step` record that every reader (UI, CLI, benchmark, tests) consumes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from app.core.tree_shape import chain, is_tree

ACCEPTED, CORRECTED, BONUS, REJECTED, TARGET = "accepted", "corrected", "bonus", "rejected", "target"
# TARGET marks a token the target chose with no drafts before it: every token of plain
# autoregressive decoding, and a speculative round that drafted nothing (prompt lookup
# without a match, or a last round with no room left to draft).
KIND_LABELS = {  # how the legend, the plots and the CLI name each kind
    ACCEPTED: "accepted draft",
    CORRECTED: "corrected by the target",
    BONUS: "bonus (every draft before it kept)",
    TARGET: "target token (no drafts)",
    REJECTED: "rejected draft",
}


@dataclass
class Decision:
    """How one drafted token x was judged: accepted when u < min(1, p(x)/q(x))."""

    token: int
    text: str
    p: float | None  # p(x): target probability after processing (greedy: softmax at T=1, when teaching)
    q: float  # q(x): draft probability after processing (1.0 for prompt lookup's one-hot q)
    accept_prob: float  # min(1, p/q); greedy: 1 if x is the target's argmax else 0
    u: float | None  # the uniform draw; None under greedy, where nothing is random
    accepted: bool
    node: int | None = None  # a tree round: the draft's index in Step.drafted (a chain's are in order)


@dataclass
class Step:
    """One round: k drafts, one target pass, the accepted prefix plus the target's own token."""

    round: int
    k: int  # draft length asked of the proposer (0 for autoregressive)
    drafted: list[int]  # what the proposer returned (may be shorter than k for prompt lookup)
    draft_text: list[str]
    accepted: int  # how many drafts were kept
    token: int  # the target's own token this round
    token_kind: str  # CORRECTED, BONUS, or TARGET when nothing was drafted this round
    token_text: str
    rejected: list[int]  # drafts after the first rejection, all thrown away
    emitted: list[int]  # tokens appended to the output this round, after stop truncation
    text: str  # text appended to the output this round
    draft_time: float  # seconds, device-synchronised
    verify_time: float  # seconds of the target pass, verify rule, rollback and draft commit, synchronised
    elapsed: float  # this run's own busy seconds at the end of the round (paused while consumers run)
    decisions: list[Decision] = field(default_factory=list)
    # Teaching data, top tokens only so a record never holds a full vocabulary:
    # [(token_id, text, p, q, residual)] for the position where the target's token was chosen.
    top: list[tuple[int, str, float, float, float]] = field(default_factory=list)
    stop_reason: str | None = None  # eos | stop_string | max_new_tokens | context_full, on the last step
    feature_position: int | None = None  # feature drafts: the position of the target feature the head read
    context: int | None = None  # len(prompt + output) when the round began, which its cost grows with
    # Shared noise, when teaching: [(token_id, text, p, q, p/E, q/E)] of both races where the target chose.
    race: list[tuple[int, str, float, float, float, float]] = field(default_factory=list)
    # Each listed draft's parent (an index into drafted; -1: below the committed text); left out, a
    # chain's [-1, 0, 1, ..]. The kept path is listed first, so drafted[:accepted] are the accepted drafts.
    parents: list[int] = field(default_factory=list)
    nodes: int = 0  # the node budget the round's draft was given (0: a chain of k)

    def __post_init__(self) -> None:
        if not self.parents:
            self.parents = chain(len(self.drafted))

    @property
    def is_tree(self) -> bool:
        """True when some node (or the committed text) has more than one child (tree_shape.is_tree)."""
        return is_tree(self.parents)

    def thrown_away(self) -> list[list[int]]:
        """The drafts thrown away (indices into drafted), branch by branch (see thrown_away)."""
        return thrown_away(self.parents, self.accepted)

    def spans(self) -> list[tuple[str, str]]:
        """(text, kind) pieces in display order, rejected drafts where they were proposed (a tree's
        thrown-away branches one after another, as thrown_away lists them).

        After a stop rule cut the round short, only what was emitted is shown.
        """
        kept = len(self.emitted)
        out = [(self.draft_text[i], ACCEPTED) for i in range(min(self.accepted, kept))]
        if kept > self.accepted:
            out += [(self.draft_text[i], REJECTED) for branch in self.thrown_away() for i in branch]
            out.append((self.token_text, self.token_kind))
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def thrown_away(parents: list[int], kept: int) -> list[list[int]]:
    """The nodes after the kept path (listed first: nodes 0..kept - 1), branch by branch: depth first, a
    new branch wherever a node does not hang under the one listed before it. The branches off the end of
    the kept path come first (a chain's rejected drafts are that one branch), then those forking nearer
    the committed text."""
    n = len(parents)
    children: dict[int, list[int]] = {}
    for i in range(kept, n):
        if parents[i] >= kept:
            children.setdefault(parents[i], []).append(i)
    roots = sorted((i for i in range(kept, n) if parents[i] < kept), key=lambda i: (-parents[i], i))
    branches: list[list[int]] = []
    stack = list(reversed(roots))
    while stack:
        i = stack.pop()
        if branches and parents[i] == branches[-1][-1]:
            branches[-1].append(i)
        else:
            branches.append([i])
        stack += reversed(children.get(i, []))
    return branches
