"""How k, the number of drafts per round, is chosen."""

from __future__ import annotations

from app.config import SpecConfig
from app.metrics import expected_speedup


class KPolicy:
    """Fixed k. Subclasses adapt it from what each round shows."""

    def __init__(self, spec: SpecConfig):
        self.spec = spec
        self.k = spec.k

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_time: float, verify_time: float) -> None:
        """Learn from one round: drafts offered and kept, and the two measured times."""


class HeuristicK(KPolicy):
    """+2 after a round where every draft was kept, -1 otherwise (as in transformers)."""

    def __init__(self, spec: SpecConfig):
        super().__init__(spec)
        self.k = min(spec.k, spec.k_max)

    def update(self, drafted, accepted, draft_time, verify_time):
        if drafted:
            self.k = min(self.k + 2, self.spec.k_max) if accepted == drafted else max(self.k - 1, 1)


class AdaptiveK(KPolicy):
    """Pick the k that maximises (1 - a^(k+1)) / ((1 - a)(k c + 1)) for running a and c.

    a is Leviathan's per-token acceptance (accepted / (accepted + rejections)) and c the
    measured cost of one draft token over one target pass; both decay so they track
    the text as it changes.
    """

    DECAY = 0.8  # weight kept by the past each round

    def __init__(self, spec: SpecConfig):
        super().__init__(spec)
        self.accepted, self.rejected = 3.0, 1.0  # a weak prior of a = 0.75
        self.draft_time, self.verify_time = 0.0, 0.0
        self.rounds = 0
        self.k = min(spec.k, spec.k_max)

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def c(self) -> float:
        return self.draft_time / self.verify_time if self.verify_time > 0 else 0.1

    def update(self, drafted, accepted, draft_time, verify_time):
        self.rounds += 1
        if not drafted:
            return
        d = self.DECAY
        self.accepted = d * self.accepted + accepted
        self.rejected = d * self.rejected + (accepted < drafted)
        if self.rounds > 1:  # round 1 includes both prefills, which says nothing about c
            self.draft_time = d * self.draft_time + draft_time / drafted
            self.verify_time = d * self.verify_time + verify_time
        a, c = min(self.alpha, 0.999), self.c
        self.k = max(range(1, self.spec.k_max + 1), key=lambda k: expected_speedup(a, c, k))


def make_policy(spec: SpecConfig) -> KPolicy:
    return {"fixed": KPolicy, "heuristic": HeuristicK, "adaptive": AdaptiveK}[spec.k_policy](spec)
