"""This machine's cost model of a round, from measured seconds (no torch, no clock).

Leviathan et al.'s speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)) assumes a target pass over
k+1 tokens costs one plain step and drafting costs c per token. Measured here, a pass over
9 tokens costs well over one step, and a draft round has a fixed part too (prompt lookup
is all fixed part). The same expected tokens per round over the *measured* round time is
the figure labelled "predicted for this machine".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from app.core.tree_shape import expected_from, misses, tree_budgets


def by_width(values: Sequence[float], width: int) -> float:
    """values[width - 1] of a per-width list, whose last entry stands for every wider pass."""
    return values[min(width, len(values)) - 1]


def expected_tokens_per_pass(alpha: float, k: float) -> float:
    """E = (1 - a^(k+1)) / (1 - a): tokens per target pass for k drafts (Leviathan et al., eq. 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(frozen=True)
class Costs:
    """Measured seconds of one round's parts; calibrate.py measures them when a pair loads."""

    # [n - 1]: verifying n new tokens, n = 1..k_max+1 (non-decreasing): the target's pass with the
    # verify rule, rollback and the draft's commit, as rounds spend it
    verify_s: tuple[float, ...]
    draft_round_s: float  # fixed seconds of one draft call (all of prompt lookup's cost)
    draft_token_s: float  # seconds per drafted token on top of that
    overhead_s: float  # seconds per round outside verifying and drafting (the k policy, detokenizing, output)
    plain_round_s: float  # one round of plain autoregressive decoding, all included
    # [k]: seconds to draft k tokens, k = 0..k_max, interpolated between the lengths measured; empty:
    # the line above. A draft's first steps after a target pass are dearer than its later ones, so a
    # least-squares line through short and long rounds undercounts the ones between.
    draft_s: tuple[float, ...] = ()
    # A pass reads every cached position, so it costs more as the context grows, a wide pass the most.
    # verify_s and plain_round_s hold at `context` tokens; [n - 1]: seconds more per context token for
    # a pass over n new tokens. Empty: no dependence measured, every context costs the same.
    verify_per_context_s: tuple[float, ...] = ()
    context: int = 0
    # What a tree round costs beyond drafting its k-deep chain and a pass of its width: a fixed part
    # (the tree's mask, moving the kept path into place) and a part per node past the chain (siblings'
    # draws, a feature head's wider passes); measured only when a run lets the cost model choose trees.
    tree_fixed_s: float = 0.0
    draft_node_s: float = 0.0
    # Not a time: the largest logit difference between a pass over k_max + 1 tokens and one-token
    # passes over the same positions, the rounding noise a greedy check is judged against (divergence.py).
    logit_noise: float = 0.0

    def draft_time(self, k: int) -> float:
        """Seconds of one draft call of k tokens."""
        return self.draft_s[k] if k < len(self.draft_s) else self.draft_round_s + k * self.draft_token_s

    def verify_time(self, width: int, context: int | None = None) -> float:
        """Seconds of a pass over `width` new tokens after `context` tokens (None: the measured one)."""
        return by_width(self.verify_curve(context), width)

    def verify_curve(self, context: int | None = None) -> list[float]:
        """verify_time for every width at one context, never less for a wider pass.

        Below the measured context the line is extrapolated, a wide pass's furthest; it must reach
        neither 0 nor below a narrower pass.
        """
        if context is None or not self.verify_per_context_s:
            return list(self.verify_s)
        shifted = (
            max(t + by_width(self.verify_per_context_s, n) * (context - self.context), t / 2)
            for n, t in enumerate(self.verify_s, start=1)
        )
        return list(itertools.accumulate(shifted, max))

    def plain_s(self, context: int | None = None) -> float:
        """Seconds of one plain round after `context` tokens."""
        return self._plain_s(self.verify_curve(context))

    def _plain_s(self, verify: Sequence[float]) -> float:
        return self.plain_round_s - self.verify_s[0] + verify[0]

    def round_s(self, k: int, context: int | None = None) -> float:
        """Seconds of a round that drafts k tokens and verifies k + 1, after `context` tokens."""
        return self._round_s(k, self.verify_curve(context))

    def _round_s(self, k: int, verify: Sequence[float]) -> float:
        return self.draft_time(k) + by_width(verify, k + 1) + self.overhead_s

    def tree_round_s(self, k: int, nodes: int, verify: Sequence[float]) -> float:
        """Seconds of a round that drafts a tree of `nodes` nodes, k deep, and verifies nodes + 1."""
        if nodes <= k:  # a chain
            return self._round_s(k, verify)
        drafting = self.draft_time(k) + self.tree_fixed_s + (nodes - k) * self.draft_node_s
        return drafting + by_width(verify, nodes + 1) + self.overhead_s

    def best_shape(
        self,
        hazards: Sequence[float],
        k_max: int,
        nodes_max: int,
        context: int | None = None,
        plain: bool = True,
        trees_only: bool = False,
    ) -> tuple[int, int]:
        """(k, nodes) with the most expected tokens per second, among a plain step (0, 0) unless not
        `plain`, chains (k, k) unless `trees_only`, and trees of up to nodes_max nodes up to k_max deep
        (tree_shape.expected_tokens); on a tie the shallower and smaller shape. (1, 1) where nothing
        is left to weigh."""
        verify = self.verify_curve(context)
        missed, h1 = misses(hazards, nodes_max), hazards[0]  # once: the policy asks every round
        best, best_rate = ((0, 0), 1.0 / self._plain_s(verify)) if plain else ((1, 1), float("-inf"))
        for k in range(1, k_max + 1):
            for nodes in tree_budgets(k, nodes_max):
                if trees_only and nodes == k:
                    continue
                rate = expected_from(missed, h1, k, nodes) / self.tree_round_s(k, nodes, verify)
                if rate > best_rate:
                    best, best_rate = (k, nodes), rate
        return best

    def tokens_per_s(self, alpha: float, k: int, context: int | None = None) -> float:
        return self._tokens_per_s(alpha, k, self.verify_curve(context))

    def _tokens_per_s(self, alpha: float, k: int, verify: Sequence[float]) -> float:
        return expected_tokens_per_pass(alpha, k) / self._round_s(k, verify)

    def speedup(self, alpha: float, k: int, context: int | None = None) -> float:
        """Expected speedup over plain decoding at acceptance alpha with k drafts per round."""
        return self.tokens_per_s(alpha, k, context) * self.plain_s(context)

    def best_k(self, alpha: float, k_max: int, context: int | None = None, k_min: int = 1) -> int:
        """The k in k_min..k_max with the most expected tokens per second (the smallest on a tie).

        k = 0 is a round that drafts nothing: one token for what this model says such a round costs
        (as predicted_speedup counts it), so it wins where every k that drafts loses to it.
        """
        verify = self.verify_curve(context)  # once: adaptive k asks every round
        return max(range(k_min, k_max + 1), key=lambda k: (self._tokens_per_s(alpha, k, verify), -k))

    def predicted_speedup(
        self,
        alpha: float,
        draft_lengths: Sequence[int],
        first_round_s: float = 0.0,
        contexts: Sequence[int | None] | None = None,
    ) -> float:
        """Speedup this model expects for rounds that drafted these many tokens, at acceptance alpha.

        first_round_s: a first round that both modes pay alike (the prompt's prefill, measured in the
        run), added to both sides as real runs add it: a long prompt dilutes the gain of the rounds.
        contexts: each round's context length, which plain decoding of the same tokens shares.
        """
        return self._speedup(alpha, draft_lengths, first_round_s, contexts, width_free=False)

    def idealised_speedup(
        self,
        alpha: float,
        draft_lengths: Sequence[int],
        first_round_s: float = 0.0,
        contexts: Sequence[int | None] | None = None,
    ) -> float:
        """predicted_speedup on the same inputs under Leviathan's assumption that a verify pass over
        k + 1 tokens costs what a one-token pass costs. Pass times never fall as the width grows
        (verify_curve), so this is never below predicted_speedup; they are equal where width is free."""
        return self._speedup(alpha, draft_lengths, first_round_s, contexts, width_free=True)

    def _speedup(self, alpha, draft_lengths, first_round_s, contexts, width_free: bool) -> float:
        plain = seconds = 0.0
        for k, context in zip(draft_lengths, contexts or [None] * len(draft_lengths), strict=True):
            verify = self.verify_curve(context)  # once per round: both sides read it
            plain += expected_tokens_per_pass(alpha, k) * self._plain_s(verify)
            seconds += self._round_s(k, verify[:1] if width_free else verify)
        return (first_round_s + plain) / (first_round_s + seconds)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def idealised(cls, c: float = 0.1, k_max: int = 16) -> Costs:
        """Leviathan's assumptions (a pass over any width costs one step, c per draft token)."""
        return cls(verify_s=(1.0,) * (k_max + 1), draft_round_s=0.0, draft_token_s=c, overhead_s=0.0, plain_round_s=1.0)
