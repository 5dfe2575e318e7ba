"""How k, the number of drafts per round, is chosen."""

from __future__ import annotations

from typing import Protocol

from app.core.config import SpecConfig
from app.core.costs import Costs


class KPolicy(Protocol):
    """Chooses each round's k from the rounds before it, never from a clock."""

    def next_k(self) -> int:
        """The draft length of the next round."""

    def update(self, drafted: int, accepted: int, context: int | None = None) -> None:
        """Learn from one round: drafts offered and kept, and the context length the next round starts from."""


class FixedK:
    """The same k every round."""

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.k = spec.k

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, context: int | None = None) -> None:
        pass


class HeuristicK(FixedK):
    """+2 after a round where every draft was kept, -1 otherwise (as in transformers)."""

    def __init__(self, spec: SpecConfig):
        super().__init__(spec)
        self.k = min(spec.k, spec.k_max)

    def update(self, drafted, accepted, context=None):
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
    PROBE_EVERY = 8  # plain steps in a row before a round drafts again to measure a

    def __init__(self, spec: SpecConfig, costs: Costs | None = None):
        super().__init__(spec)
        self.costs = costs or Costs.idealised(k_max=spec.k_max)
        self.accepted, self.rejected = 3.0, 1.0  # a weak prior of a = 0.75
        self.k = min(spec.k, spec.k_max)
        self.plain = 0  # plain steps in a row since k fell to 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, drafted, accepted, context=None):
        alpha = min(self.alpha, 0.999)
        if not drafted:
            # Only a chosen plain step counts: a k > 0 round can draft nothing (prompt lookup without
            # a match, the run's last token), and that is no reason to probe.
            if self.k == 0:
                self.plain += 1
                if self.plain >= self.PROBE_EVERY:
                    self.plain = 0
                    self.k = self.costs.best_k(alpha, self.spec.k_max, context)
            return
        d = self.DECAY
        self.accepted = d * self.accepted + accepted
        self.rejected = d * self.rejected + (accepted < drafted)
        self.plain = 0
        self.k = self.costs.best_k(min(self.alpha, 0.999), self.spec.k_max, context, k_min=0)


def make_policy(spec: SpecConfig, costs: Costs | None = None) -> KPolicy:
    """The policy that spec names; `costs` (this machine's, from calibrate.py) guides adaptive k."""
    if spec.k_policy == "adaptive":
        return AdaptiveK(spec, costs)
    return {"fixed": FixedK, "heuristic": HeuristicK}[spec.k_policy](spec)
