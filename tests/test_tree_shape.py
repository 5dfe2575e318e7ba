"""--tree auto: the cost model picks each round's shape (a plain step, a chain or a tree) from this
machine's pass curve and the per-rank hazards it learns, and the text stays the target's own."""

from __future__ import annotations

import dataclasses
import random

import pytest
from conftest import hf_greedy_until_eos, pair_of, run

from app import calibrate
from app.core import cost_fit, tree_shape
from app.core.config import SpecConfig, UserError
from app.core.costs import Costs, expected_tokens_per_pass
from app.core.policy import TreeShape, make_policy
from app.drafts.model import ModelProposer

# A pass as wide as 65 tokens costs one step (a GPU, or bf16 with AMX up to its knee).
FLAT = Costs(verify_s=(1.0,) * 65, draft_round_s=0.0, draft_token_s=0.05, overhead_s=0.0, plain_round_s=1.0)
# Each token more in a pass costs a quarter of a step (fp32 on a small CPU).
STEEP = dataclasses.replace(FLAT, verify_s=tuple(1 + 0.25 * i for i in range(65)))


def simulate(hazards: list[float], k: int, nodes: int, trials: int = 20000) -> float:
    """Tokens per pass of a chain with sibling leaves, drawn round by round under the hazard model."""
    rng, total = random.Random(0), 0
    for _ in range(trials):
        kept = 1  # the target's own token
        for extra in tree_shape.siblings_per_depth(k, nodes):
            ranks = [r for r in range(1 + extra) if rng.random() < hazards[min(r, len(hazards) - 1)]]
            if not ranks:
                break
            kept += 1
            if ranks[0] != 0:  # a sibling leaf was kept: nothing below it was drafted
                break
        total += kept
    return total / trials


def test_expected_tokens_is_leviathans_for_a_chain_and_the_simulated_mean_for_a_tree():
    h = [0.6, 0.3, 0.2]
    for k in (1, 4, 8):
        assert tree_shape.expected_tokens(h, k, k) == pytest.approx(expected_tokens_per_pass(0.6, k))
    for k, nodes in ((2, 5), (4, 16), (3, 30)):
        assert tree_shape.expected_tokens(h, k, nodes) == pytest.approx(simulate(h, k, nodes), abs=0.03)
    assert tree_shape.expected_tokens(h, 4, 12) > tree_shape.expected_tokens(h, 4, 4)


def test_the_cost_model_picks_a_tree_where_width_is_free_and_a_chain_where_it_is_dear():
    hazards = [0.6, 0.35, 0.25]
    k, nodes = FLAT.best_shape(hazards, 8, 64)
    assert nodes > k > 1, "a flat pass: the widest useful tree"
    k, nodes = STEEP.best_shape(hazards, 8, 64)
    assert nodes == k, f"a steep pass: a chain ({k}, {nodes})"
    losing = dataclasses.replace(STEEP, draft_token_s=1.0, draft_round_s=1.0)
    assert losing.best_shape(hazards, 8, 64) == (0, 0), "where every draft loses, a plain step"
    # Never a shape the model itself rates below the chain's.
    for costs in (FLAT, STEEP):
        k, nodes = costs.best_shape(hazards, 8, 64)
        verify = costs.verify_curve()
        chosen = tree_shape.expected_tokens(hazards, k, nodes) / costs.tree_round_s(k, nodes, verify)
        best_chain = max(expected_tokens_per_pass(0.6, j) / costs.round_s(j) for j in range(1, 9))
        assert chosen >= best_chain


def feed(policy: TreeShape, rounds: int, sibling_kept: bool) -> list[tuple[int, int]]:
    """Rounds where a chain keeps its first draft, and a tree's first child at the root is rejected,
    then the second is kept (sibling_kept) or every one is rejected; returns each round's (k, nodes)."""
    shapes = []
    for _ in range(rounds):
        k, nodes = policy.next_k(), policy.next_nodes()
        shapes.append((k, nodes))
        if not k:
            policy.update(0, 0)
            continue
        if not nodes:  # a chain: the first draft kept, the second missed
            policy.update(k, 1, parents=tree_shape.chain(k), path=[0])
            continue
        parents, chain = [], -1  # the chain with sibling leaves, as draw.Branches lists it
        for extra in tree_shape.siblings_per_depth(k, nodes):
            parents += [chain] * (1 + extra)
            chain = len(parents) - 1 - extra
        kept = sibling_kept and parents.count(-1) > 1
        policy.update(nodes, int(kept), parents=parents, path=[1] if kept else [])
    return shapes


def test_the_policy_learns_each_ranks_hazard_and_drafts_trees_only_while_siblings_pay():
    spec = SpecConfig(k_max=8, tree=32, tree_auto=True)
    trees = TreeShape(spec, FLAT)
    feed(trees, 30, sibling_kept=True)
    assert trees.hazards[1] > 0.6 and trees.next_nodes() > trees.next_k()
    chains = TreeShape(spec, dataclasses.replace(FLAT, verify_s=tuple(1 + 0.02 * i for i in range(65))))
    shapes = feed(chains, 40, sibling_kept=False)
    assert chains.hazards[1] < 0.1
    later = shapes[20:]
    assert sum(1 for _, n in later if n) <= len(later) // TreeShape.PROBE_EVERY + 1, "trees only as probes"
    assert any(n for _, n in later), "a tree now and then, to see whether siblings pay again"
    assert isinstance(make_policy(spec), TreeShape)


def test_tree_auto_needs_adaptive_k_and_a_node_ceiling():
    with pytest.raises(UserError, match="leave k adaptive"):
        SpecConfig(k=4, k_policy="fixed", tree=32, tree_auto=True).validate()
    with pytest.raises(UserError, match="1 to 64"):
        SpecConfig(tree=0, tree_auto=True).validate()


def test_greedy_auto_trees_give_the_targets_own_output(target, near_draft, tokenizer, no_eos):
    """Without a calibration the policy reads Leviathan's flat costs, so rounds switch between chains
    and trees of several sizes; every text is the target's own."""
    prompt = "def add(a, b):\n  return a"
    want = hf_greedy_until_eos(target, tokenizer, prompt, 40)
    got, steps = run(
        target, tokenizer, prompt, ModelProposer(near_draft, "near"), tree=16, tree_auto=True, max_new_tokens=40
    )
    assert got == want
    widths = {len(s.drafted) for s in steps if s.is_tree}
    assert widths and any(not s.is_tree and s.drafted for s in steps) or len(widths) > 1, widths


def test_calibration_with_trees_prices_a_node_and_times_the_wide_passes(target, near_draft, tokenizer, monkeypatch):
    pair = pair_of(target, tokenizer, "tiny", near_draft)
    sizes, real = [], cost_fit.tree_seconds
    monkeypatch.setattr(
        cost_fit, "tree_seconds", lambda trees, *a: sizes.extend(len(s.drafted) for s, _ in trees) or real(trees, *a)
    )
    costs = calibrate.measure(pair, 4, tree=24)
    assert set(sizes) == {6, 24}, "tree rounds of a small and the widest tree, k_max deep"
    assert len(costs.verify_s) == 25 and costs.tree_fixed_s >= 0 and costs.draft_node_s >= 0
    assert list(costs.verify_s) == sorted(costs.verify_s)
    assert costs.verify_time(25) >= costs.verify_time(5) > 0  # a tiny model's pass can be flat out to 25
    assert calibrate.wide_widths(5, 25) == [12, 16, 24, 25]
    # A budget no wider than k_max is measured too, with trees half as deep: the model chooses them.
    sizes.clear()
    costs = calibrate.measure(pair, 4, tree=4)
    assert set(sizes) == {4}, sizes
