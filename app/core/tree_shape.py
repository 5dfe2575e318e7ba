"""The shape of a draft tree: its parents, how a node budget spreads over a k-deep chain, and what it is
expected to keep."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence


# A draft is a tree: node i hangs below node parents[i] (-1: below the last committed token), parents
# before their children. A chain is the tree [-1, 0, 1, ..]: every rule, pass and record takes it as one.
def chain(n: int) -> list[int]:
    """The parents of n drafts in a chain: [-1, 0, 1, .., n - 2]."""
    return list(range(-1, n - 1))


def is_tree(parents: Sequence[int]) -> bool:
    """True when some node (or the committed text) has more than one child: any parents but a chain's."""
    return any(parent != i - 1 for i, parent in enumerate(parents))


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Each node's children (and -1's: the first level), in drafting order."""
    out: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} hangs below {parent}: a parent must come before its children")
        out.setdefault(parent, []).append(i)
        out.setdefault(i, [])
    return out


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for the first level."""
    d: list[int] = []
    for parent in parents:
        d.append(1 if parent < 0 else d[parent] + 1)
    return d


@functools.lru_cache(maxsize=4096)  # the cost model weighs the same shapes every round
def _siblings(k: int, nodes: int) -> tuple[int, ...]:
    return tuple(_spread(k, nodes))


def siblings_per_depth(k: int, nodes: int) -> list[int]:
    """Extra children at each depth of a k-deep chain, for a tree of `nodes` nodes. The budget past
    the chain goes first where a branch is reached most often, near the root: sibling s at depth d
    ranks d + s. The shape depends on k and the budget alone, never on what was drafted, which keeps
    the sampling rule exact (verify.speculative_sampling)."""
    return list(_siblings(k, nodes))


def _spread(k: int, nodes: int) -> list[int]:
    """The budget spread itself (siblings_per_depth, cached)."""
    extra = max(0, nodes - k)
    ranked = sorted((d + s, d) for d in range(k) for s in range(1, extra + 1))[:extra]
    counts = [0] * k
    for _, d in ranked:
        counts[d] += 1
    return counts


@functools.lru_cache(maxsize=1024)
def tree_budgets(k: int, nodes_max: int) -> tuple[int, ...]:
    """The node budgets a cost model weighs for a k-deep draft: the chain (k), each extra sibling up
    to k + 8, then every eighth budget up to nodes_max."""
    wide = range(16, nodes_max + 1, 8)
    return tuple(sorted({n for n in (*range(k, k + 9), *wide, nodes_max) if k <= n <= nodes_max}))


def expected_tokens(hazards: Sequence[float], k: int, nodes: int) -> float:
    """Expected tokens per target pass of a k-deep chain with sibling leaves (siblings_per_depth),
    where hazards[r - 1] is the chance that a node's r-th child is kept once the r - 1 before it were
    not; the last entry stands for every later child.

    A depth keeps a token if any of its children is kept, and the round goes deeper only through
    the chain's child: E = 1 + sum over depths d of h1^d (1 - prod over the depth's children of
    (1 - h_r)). With no siblings this is Leviathan's (1 - a^(k+1)) / (1 - a) with a = h1. A tree the
    feature head grows EAGLE-2's way puts its siblings where they are likelier kept, so it does at
    least this well in expectation.
    """
    return expected_from(misses(hazards, nodes), hazards[0], k, nodes)


def misses(hazards: Sequence[float], nodes: int) -> list[float]:
    """[s]: the chance that a node's first s + 1 children are all rejected, s = 0..nodes - 1."""
    h = [hazards[min(r, len(hazards) - 1)] for r in range(max(nodes, 1))]
    return list(itertools.accumulate((1.0 - x for x in h), lambda a, b: a * b))


def expected_from(missed: Sequence[float], h1: float, k: int, nodes: int) -> float:
    """expected_tokens from misses() computed once for many shapes, as the cost model weighs them."""
    total, reach = 1.0, 1.0
    for extra in _siblings(k, nodes):
        total += reach * (1.0 - missed[extra])
        reach *= h1
    return total
