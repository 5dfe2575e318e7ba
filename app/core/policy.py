"""How k, the number of drafts per round, is chosen."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

from app.core import tree_shape
from app.core.config import SpecConfig
from app.core.costs import Costs


class KPolicy(Protocol):
    """Chooses each round's k from the rounds before it, never from a clock."""

    def next_k(self) -> int:
        """The draft length of the next round."""

    def next_nodes(self) -> int:
        """The node budget of the next round's draft tree (0: a chain of next_k drafts)."""

    def update(
        self,
        drafted: int,
        accepted: int,
        context: int | None = None,
        parents: Sequence[int] = (),
        path: Sequence[int] = (),
    ) -> None:
        """Learn from one round: drafts offered and kept, the context length the next round starts
        from, the drafts' parents (a chain's: [-1, 0, 1, ..]) and the kept path (node indices as proposed)."""


class FixedK:
    """The same k every round."""

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.k = spec.k

    def next_k(self) -> int:
        return self.k

    def next_nodes(self) -> int:
        return self.spec.tree

    def update(self, drafted, accepted, context=None, parents=(), path=()) -> None:
        pass


class HeuristicK(FixedK):
    """+2 after a round where every draft was kept, -1 otherwise (as in transformers)."""

    def __init__(self, spec: SpecConfig):
        super().__init__(spec)
        self.k = min(spec.k, spec.k_max)

    def update(self, drafted, accepted, context=None, parents=(), path=()):
        if drafted:
            self.k = min(self.k + 2, self.spec.k_max) if accepted == drafted else max(self.k - 1, 1)


class AdaptiveK(FixedK):
    """Pick the k with the most expected tokens per second: E(a, k) / round_seconds(k).

    a is Leviathan's per-token acceptance (accepted / (accepted + rejections)), decayed so it
    tracks the text as it changes. round_seconds comes from `costs`, the machine's measured
    curve (calibrate.py) at the context the next round starts from, which the records fix too; without
    one, Leviathan's idealised costs. No clock is read here: the same records give the same k, so
    the same seed gives the same sampled text.

    k = 0, a plain step, is chosen where the costs say that every k that drafts loses to it. Plain
    steps say nothing about the draft, so after PROBE_EVERY of them in a row one round drafts again
    (the best k that drafts) to learn whether the text has become easier to draft.
    """

    DECAY = 0.8  # weight kept by the past each round
    # Plain steps in a row before a round drafts again to measure a, doubled after each probe that kept
    # nothing (up to PROBE_MAX) and reset by one that kept a draft. A probe costs a verify pass of two
    # tokens and a drafted token beside a plain step (about a third more on the int8 CPU pass) and pays
    # whenever a > 0.3 there; the decayed a of a hard stretch stays low until a probe, so probing soon
    # keeps a good draft drafting once the text turns easy (the first example: 24% of its rounds
    # drafted with a probe every 8 plain steps, 93% with one every 2), while a useless draft's probes
    # grow rare.
    PROBE_EVERY = 2
    PROBE_MAX = 16

    def __init__(self, spec: SpecConfig, costs: Costs | None = None):
        super().__init__(spec)
        self.costs = costs or Costs.idealised(k_max=spec.k_max)
        self.accepted, self.rejected = 3.0, 1.0  # a weak prior of a = 0.75
        self.k = min(spec.k, spec.k_max)
        self.plain = 0  # plain steps in a row since k fell to 0
        self.wait = self.PROBE_EVERY  # plain steps before the next probe
        self.probing = False  # the round asked for is a probe

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def next_nodes(self) -> int:
        return 0

    def update(self, drafted, accepted, context=None, parents=(), path=()):
        alpha = min(self.alpha, 0.999)
        if not drafted:
            # Only a chosen plain step counts: a k > 0 round can draft nothing (prompt lookup without
            # a match, the run's last token), and that is no reason to probe.
            if self.k == 0:
                self.plain += 1
                if self.plain >= self.wait:
                    self.plain = 0
                    self.probing = True
                    self.k = self.costs.best_k(alpha, self.spec.k_max, context)
            return
        if self.probing:
            self.wait = self.PROBE_EVERY if accepted else min(2 * self.wait, self.PROBE_MAX)
            self.probing = False
        d = self.DECAY
        self.accepted = d * self.accepted + accepted
        self.rejected = d * self.rejected + (accepted < drafted)
        self.plain = 0
        self.k = self.costs.best_k(min(self.alpha, 0.999), self.spec.k_max, context, k_min=0)


class TreeShape(FixedK):
    """Pick each round's shape, a plain step, a chain of k or a tree of n nodes k deep, with the
    most expected tokens per second (Costs.best_shape) at the context the round starts from.

    The acceptance model is a hazard per child rank: h_r, the chance that a node's r-th child is kept
    once the r - 1 drafted before it were not, learnt from every judged node (children are tried in
    the order drafted, by every rule), decayed per rank as AdaptiveK decays a. h_1 is AdaptiveK's a.
    Ranks past the first are only seen in tree rounds, so after PROBE_EVERY rounds without a tree one
    round drafts the best tree, and after as many plain steps one round drafts again. No clock is read.
    """

    DECAY = AdaptiveK.DECAY
    PROBE_EVERY = 8  # rounds without a tree before a tree probe (and plain steps before a chain probe)
    RANKS = 8  # hazards kept per rank; later children share the last
    # Weak priors: the first child kept 3 times in 4 (AdaptiveK's), a later one once in 5.
    PRIOR = ((3.0, 1.0),) + ((0.25, 1.0),) * (RANKS - 1)

    def __init__(self, spec: SpecConfig, costs: Costs | None = None):
        super().__init__(spec)
        self.costs = costs or Costs.idealised(k_max=spec.tree + 1)
        self.kept, self.missed = [list(x) for x in zip(*self.PRIOR, strict=True)]
        self.k, self.nodes = min(spec.k, spec.k_max), 0
        self.without_tree = self.plain = 0

    @property
    def hazards(self) -> list[float]:
        return [min(a / (a + b), 0.999) for a, b in zip(self.kept, self.missed, strict=True)]

    def next_nodes(self) -> int:
        return self.nodes if self.nodes > self.k else 0

    def update(self, drafted, accepted, context=None, parents=(), path=()):
        if drafted:
            self._learn(parents, path)
            self.plain = 0
        elif self.k == 0:
            self.plain += 1
        self.without_tree = 0 if self.nodes > self.k else self.without_tree + 1
        shape = functools.partial(self.costs.best_shape, self.hazards, self.spec.k_max, self.spec.tree, context)
        k, nodes = shape()
        if k == 0 and self.plain >= self.PROBE_EVERY:  # a probe: the best shape that drafts
            (k, nodes), self.plain = shape(plain=False), 0
        elif k and nodes == k and self.without_tree >= self.PROBE_EVERY:  # a probe: the best tree
            k, nodes = shape(plain=False, trees_only=True)
        self.k, self.nodes = k, nodes

    def _learn(self, parents: Sequence[int], path: Sequence[int]) -> None:
        """Count, per child rank, the children judged and the one kept at each depth the round reached."""
        assert parents, "a round that drafted has its parents (a chain's too)"
        children = tree_shape.children(parents)
        seen = [0] * self.RANKS
        kept = [0] * self.RANKS
        for depth, at in enumerate([-1, *path]):
            tried = children.get(at, [])
            chosen = path[depth] if depth < len(path) else None
            for rank, node in enumerate(tried):
                r = min(rank, self.RANKS - 1)
                seen[r] += 1
                if node == chosen:
                    kept[r] += 1
                    break
        d = self.DECAY
        for r in range(self.RANKS):
            if seen[r]:
                self.kept[r] = d * self.kept[r] + kept[r]
                self.missed[r] = d * self.missed[r] + seen[r] - kept[r]


def make_policy(spec: SpecConfig, costs: Costs | None = None) -> KPolicy:
    """The policy that spec names; `costs` (this machine's, from calibrate.py) guides adaptive k and
    the shape of trees chosen by the cost model."""
    if spec.tree_auto:
        return TreeShape(spec, costs)
    if spec.k_policy == "adaptive":
        return AdaptiveK(spec, costs)
    return {"fixed": FixedK, "heuristic": HeuristicK}[spec.k_policy](spec)
