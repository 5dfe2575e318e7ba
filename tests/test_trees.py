"""Draft trees: the verify rules keep the target's own output (greedy), its distribution (recursive
rejection sampling without replacement) and its text for a seed (shared noise), whatever the tree."""

from __future__ import annotations

import itertools

import pytest
import torch

from app.core import sampling, verify

V = 5


def dist(seed: int, rows: int = 1, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, V, generator=g) * sharp).softmax(-1)


def p_of(context: tuple[int, ...]) -> torch.Tensor:
    """The toy target: a fixed distribution per context."""
    return dist(1000 + hash(context) % 997)[0]


def q_of(context: tuple[int, ...]) -> torch.Tensor:
    """The toy draft: near the target, not equal to it."""
    return 0.2 * p_of(context) + 0.8 * dist(7 + hash(context) % 991, sharp=2.5)[0]


def draft_tree(widths: tuple[int, ...], gen: torch.Generator, conditional: bool = True):
    """A full tree, widths[d] children per node at depth d, each node's children drawn without
    replacement from the draft; returns tokens, parents and each node's q_j (conditional=False: the
    plain q for every child, the planted bug)."""
    tokens, parents, q_rows = [], [], []
    frontier = [(-1, ())]
    for width in widths:
        nxt = []
        for parent, context in frontier:
            q = q_of(context)
            drawn, rows = sampling.draw_distinct(q, width, gen)
            for t, row in zip(drawn, rows, strict=True):
                tokens.append(t), parents.append(parent), q_rows.append(row if conditional else q)
                nxt.append((len(tokens) - 1, (*context, t)))
        frontier = nxt
    return tokens, parents, torch.stack(q_rows)


def contexts(tokens, parents) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for t, parent in zip(tokens, parents, strict=True):
        out.append((*(out[parent] if parent >= 0 else ()), t))
    return out


def two_tokens(rule, widths, trials: int, conditional: bool = True) -> dict[tuple[int, int], float]:
    """Empirical distribution of the first two tokens out, the second drawn from p when the round ends first."""
    draft_gen, gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    counts: dict[tuple[int, int], int] = {}
    for _ in range(trials):
        tokens, parents, q = draft_tree(widths, draft_gen, conditional)
        ctx = contexts(tokens, parents)
        p = torch.stack([p_of(())] + [p_of(c) for c in ctx])
        v = rule(tokens, parents, p, q, gen)
        out = [tokens[i] for i in v.path] + [v.token]
        if len(out) < 2:
            out.append(sampling.sample(p_of((out[0],)), gen))
        key = (out[0], out[1])
        counts[key] = counts.get(key, 0) + 1
    return {k: c / trials for k, c in counts.items()}


def exact_two() -> dict[tuple[int, int], float]:
    return {(a, b): float(p_of(())[a] * p_of((a,))[b]) for a, b in itertools.product(range(V), repeat=2)}


def tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


TRIALS = 6000
# Twice the expected total-variation distance of TRIALS honest samples over 25 outcomes, and a floor.
BOUND = 2 * 0.5 * sum((2 * p * (1 - p) / (torch.pi * TRIALS)) ** 0.5 for p in exact_two().values()) + 0.005


@pytest.mark.parametrize("widths", [(3, 2), (1, 1), (4,), (2, 3)])
def test_recursive_rejection_sampling_keeps_the_target_distribution(widths):
    assert tv(two_tokens(verify.speculative_sampling, widths, TRIALS), exact_two()) < BOUND


def test_the_distribution_check_bites():
    """Judging every child against the plain q (as if drawn with replacement) breaks the rule for
    children drawn without replacement: the same check fails."""
    assert tv(two_tokens(verify.speculative_sampling, (4, 2), TRIALS, conditional=False), exact_two()) > BOUND


def test_greedy_follows_the_argmax_down_any_branch():
    # Root children 0, 1, 2; below node 1 (token 3) children 3 (token 4) and 4 (token 0).
    tokens, parents = [0, 3, 2, 4, 0], [-1, -1, -1, 1, 1]
    p = torch.full((6, V), -5.0)
    for row, best in enumerate([3, 1, 0, 2, 0, 2]):  # argmax after the root, then after each node
        p[row, best] = 5.0
    v = verify.greedy(tokens, parents, p)
    assert v.path == [1, 4] and v.token == 2  # 3, then 0 (node 4), then the target's own 2 at a leaf
    assert v.judged == [0, 1, 3, 4]


def test_shared_noise_keeps_the_race_winner_at_every_depth():
    """Whatever the tree, each token out is argmax(p / E) at its position: plain sampling's own."""
    gen = torch.Generator().manual_seed(5)
    for seed in range(30):
        tokens, parents, q = draft_tree((3, 2), gen)
        ctx = contexts(tokens, parents)
        p = torch.stack([p_of(())] + [p_of(c) for c in ctx])
        v = verify.shared_noise(tokens, parents, p, q, seed, position=10)
        out, context = [tokens[i] for i in v.path] + [v.token], ()
        for depth, token in enumerate(out):
            assert token == int(sampling.race(p_of(context), sampling.race_noise(seed, 10 + depth, V)))
            context = (*context, token)


# ---- the engine on trees ----------------------------------------------------------------------
PROMPTS = ["def add(a, b):\n  return a", "the cat sat on the mat. the cat"]


@pytest.fixture(scope="module")
def head(target, tokenizer):
    from test_feature_head import random_windows

    from app.training import train

    torch.manual_seed(0)
    h, _ = train.train_feature_head(target, random_windows(len(tokenizer), 8, 48), steps=60, lr=5e-3)
    return h


def tree_sources(target, near_draft, head):
    from app.drafts.feature import FeatureProposer
    from app.drafts.lookup import PromptLookup
    from app.drafts.model import ModelProposer, early_exit

    return {
        "draft model": lambda: ModelProposer(near_draft, "near"),
        "prompt lookup": lambda: PromptLookup(3, 1),
        "early exit": lambda: early_exit(target, 2),
        "feature head": lambda: FeatureProposer(target, head),
    }


@pytest.mark.parametrize("source", ["draft model", "prompt lookup", "early exit", "feature head"])
def test_greedy_trees_give_the_targets_own_output(target, near_draft, tokenizer, head, no_eos, source):
    from conftest import hf_greedy_until_eos, run

    make = tree_sources(target, near_draft, head)[source]
    kept = {0: 0, 8: 0}  # accepted drafts at k = 4, chain against tree
    for prompt in PROMPTS:
        want = hf_greedy_until_eos(target, tokenizer, prompt, 40)
        for k, tree in ((4, 0), (1, 1), (4, 8), (4, 32)):
            got, steps = run(target, tokenizer, prompt, make(), k=k, k_policy="fixed", tree=tree, max_new_tokens=40)
            assert got == want, (source, prompt, k, tree)
            if tree in kept:
                kept[tree] += sum(s.accepted for s in steps) / len(steps)
    if source != "prompt lookup":
        assert kept[8] > kept[0], f"the tree must keep more a pass than the chain, or the test does not bite: {kept}"


@pytest.mark.parametrize("source", ["draft model", "feature head"])
def test_sampled_trees_keep_the_targets_distribution(source):
    """Trees (k = 2, 6 nodes) under rejection sampling, from a draft model and from a feature head
    (grown EAGLE-2's way): the first three tokens out have the target's exact distribution."""
    from conftest import char_tokenizer, run, tiny_llama
    from test_sampling import N, exact_distribution, tv_bound
    from test_sampling import tv as tv_seq

    from app.core.config import SamplingConfig
    from app.drafts.model import ModelProposer

    tok = char_tokenizer("ab")
    p_model = tiny_llama(len(tok), layers=2, hidden=16, seed=11, scale=8.0)
    q_model = tiny_llama(len(tok), layers=1, hidden=16, seed=12, scale=8.0)
    cfg = SamplingConfig(temperature=1.0)
    prompt = tok("abba")["input_ids"]
    exact = exact_distribution(p_model, prompt, cfg)
    if source == "feature head":
        from test_feature_head import random_windows

        from app.drafts.feature import FeatureProposer
        from app.training import train

        torch.manual_seed(0)
        head, _ = train.train_feature_head(p_model, random_windows(len(tok), 8, 16), steps=40, lr=5e-3)
        make = lambda: FeatureProposer(p_model, head)  # noqa: E731
    else:
        make = lambda: ModelProposer(q_model, "q")  # noqa: E731
    counts: dict = {}
    for seed in range(N):
        ids, _ = run(
            p_model, tok, prompt, make(), temperature=1.0, seed=seed, k=2, k_policy="fixed", tree=6, max_new_tokens=3
        )
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    got = {s: c / N for s, c in counts.items()}
    assert tv_seq(got, exact) < tv_bound(exact)


@pytest.mark.parametrize("source", ["draft model", "feature head", "prompt lookup"])
def test_shared_noise_trees_give_plain_samplings_text(target, near_draft, tokenizer, head, no_eos, source):
    from conftest import run

    sampled = dict(temperature=0.8, top_k=0, top_p=1.0, rule="shared-noise")
    make = tree_sources(target, near_draft, head)[source]
    for seed in (0, 1, 2):
        plain, _ = run(target, tokenizer, PROMPTS[0], seed=seed, max_new_tokens=24, **sampled)
        got, _ = run(
            target,
            tokenizer,
            PROMPTS[0],
            make(),
            seed=seed,
            k=3,
            k_policy="fixed",
            tree=8,
            max_new_tokens=24,
            **sampled,
        )
        assert got == plain, (source, seed)


@pytest.mark.parametrize("wrapper", [False, True])
def test_a_kept_path_equals_a_fresh_forward(target, wrapper):
    """After a tree pass and a rollback to its kept path, the cache is the committed text's own: the next logits are a
    fresh forward's, on the growing cache (direct passes) and on transformers' dynamic cache."""
    from transformers import DynamicCache

    from app.kv.cache import DynamicRollbackCache

    def cache():
        lm = DynamicRollbackCache(target)
        if wrapper:
            lm.direct, lm.cache = None, DynamicCache(config=target.config)
        return lm

    ids = list(range(3, 15))
    tokens, parents = [5, 6, 7, 8, 9, 10], [-1, -1, 0, 0, 3, 1]  # node 4 (9) below node 3 (8) below node 0
    lm = cache()
    lm.extend(ids[:-1])
    logits = lm.extend(ids[-1:] + tokens, parents=parents)
    fresh = cache()
    whole = fresh.extend(ids + [5, 8, 9])  # the branch 5 -> 8 -> 9
    for row, at in ((0, len(ids) - 1), (1, len(ids)), (4, len(ids) + 1), (5, len(ids) + 2)):
        assert (logits[row] - whole[at]).abs().max() < 1e-4, row
    lm.rollback(len(ids), path=[0, 3, 4])
    assert lm.length == len(ids) + 3
    after = lm.extend([11], keep=1)
    want = cache().extend(ids + [5, 8, 9, 11], keep=1)
    assert (after - want).abs().max() < 1e-4
