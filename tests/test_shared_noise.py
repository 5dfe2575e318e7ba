"""The shared-noise sampling rule: for a seed, speculative output is plain sampled output, token for
token, whatever drafts it and however k is chosen; and every token is still a sample from p."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from conftest import ADD_PROMPT, char_tokenizer, noisy_copy, run, tiny_llama
from test_feature_head import random_windows
from test_sampling import N, exact_distribution, tv, tv_bound

from app import models
from app.core import sampling, verify
from app.core.config import REJECTION, SHARED_NOISE, SamplingConfig
from app.drafts.cross_tokenizer import CrossTokenizerProposer, TokenBridge
from app.drafts.feature import FeatureProposer
from app.drafts.lookup import PromptLookup
from app.drafts.model import ModelProposer, early_exit
from app.training import train
from app.views import check, plots, render

SEEDS = range(20)
# Top-k, top-p and a repetition control too: each must be applied before the race, on both sides.
SAMPLED = dict(temperature=0.9, top_k=12, top_p=0.95, repetition_penalty=1.1, rule=SHARED_NOISE)
KS = [dict(k=1, k_policy="fixed"), dict(k=4, k_policy="fixed"), dict(k=8, k_policy="fixed"), dict(k_policy="adaptive")]
NEW = 16


@pytest.fixture(scope="module")
def head(target, tokenizer):
    torch.manual_seed(0)
    h, _ = train.train_feature_head(target, random_windows(len(tokenizer), 8, 48), steps=60, lr=5e-3)
    return h


@pytest.fixture(scope="module")
def plain(target, tokenizer):
    """Plain sampled output for each seed: the reference every speculative run must equal."""
    return {seed: run(target, tokenizer, ADD_PROMPT, seed=seed, max_new_tokens=NEW, **SAMPLED)[0] for seed in SEEDS}


def sources(target, near_draft, head):
    return {
        "draft model": lambda: ModelProposer(near_draft, "near"),
        "prompt lookup": lambda: PromptLookup(3, 1),
        "early exit": lambda: early_exit(target, 2),
        "feature head": lambda: FeatureProposer(target, head),
    }


@pytest.mark.parametrize("source", ["draft model", "prompt lookup", "early exit", "feature head"])
def test_speculative_equals_plain_for_every_seed_k_and_policy(target, near_draft, tokenizer, head, plain, source):
    make = sources(target, near_draft, head)[source]
    accepted = 0
    for seed in SEEDS:
        for ks in KS:
            got, steps = run(target, tokenizer, ADD_PROMPT, make(), seed=seed, max_new_tokens=NEW, **SAMPLED, **ks)
            assert got == plain[seed], (source, seed, ks)
            accepted += sum(s.accepted for s in steps)
    assert accepted > 0, "drafts must be kept sometimes, or the identity is only plain decoding's"
    assert len({tuple(v) for v in plain.values()}) > len(SEEDS) // 2, "the seeds must give different texts"


@pytest.mark.parametrize("n_threads", [1, 2])
def test_thread_count_does_not_change_the_text(target, near_draft, tokenizer, plain, n_threads):
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        for seed in list(SEEDS)[:5]:
            got, _ = run(
                target, tokenizer, ADD_PROMPT, ModelProposer(near_draft, "near"), seed=seed, max_new_tokens=NEW,
                k_policy="adaptive", **SAMPLED,
            )  # fmt: skip
            assert got == plain[seed]
    finally:
        torch.set_num_threads(before)


def test_a_draft_with_another_tokenizer_keeps_the_identity():
    target_tok, draft_tok = char_tokenizer("ab"), char_tokenizer("bcdefa")
    p_model = tiny_llama(len(target_tok), layers=2, hidden=16, seed=11, scale=8.0)
    q_model = tiny_llama(len(draft_tok), layers=1, hidden=16, seed=12, scale=8.0)
    bridge = TokenBridge(target_tok, draft_tok)
    cfg = dict(temperature=1.0, rule=SHARED_NOISE, max_new_tokens=12)
    accepted = 0
    for seed in SEEDS:
        reference, _ = run(p_model, target_tok, "abba", seed=seed, **cfg)
        for k in (1, 4):
            proposer = CrossTokenizerProposer(q_model, bridge, "q")
            got, steps = run(p_model, target_tok, "abba", proposer, seed=seed, k=k, k_policy="fixed", **cfg)
            assert got == reference
            accepted += sum(s.accepted for s in steps)
    assert accepted > 0


def test_each_token_is_a_sample_from_p(small_pair):
    tok, p_model, q_model = small_pair
    cfg = SamplingConfig(temperature=0.6, rule=SHARED_NOISE)
    prompt = tok("abba")["input_ids"]
    exact = exact_distribution(p_model, prompt, cfg)
    got = _empirical(p_model, tok, prompt, q_model)
    assert tv(got, exact) < tv_bound(exact)


def test_a_broken_race_fails_the_same_bound(small_pair, monkeypatch):
    # Keeping a draft the target's race did not pick (as though agreement were not needed) emits q's
    # choices, not p's: the bound must catch it.
    tok, p_model, q_model = small_pair
    honest = verify.shared_noise

    def broken(drafts, parents, p, q, seed, position, pending=None):
        v = honest(drafts, parents, p, q, seed, position, pending)
        if v.accepted < len(drafts):
            v.token = drafts[v.accepted]
        return v

    monkeypatch.setattr(verify, "shared_noise", broken)
    cfg = SamplingConfig(temperature=0.6, rule=SHARED_NOISE)
    prompt = tok("abba")["input_ids"]
    exact = exact_distribution(p_model, prompt, cfg)
    assert tv(_empirical(p_model, tok, prompt, q_model), exact) > 1.5 * tv_bound(exact)


def test_the_race_alone_draws_from_p():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    counts = torch.zeros(5)
    for position in range(20000):
        counts[int(sampling.race(p, sampling.race_noise(3, position, 5)))] += 1
    assert counts[4] == 0  # a token p excludes never wins
    assert (counts / counts.sum() - p).abs().max() < 0.015


def test_the_noise_depends_on_seed_and_position_only():
    a = sampling.race_noise(7, 40, 1000)
    assert torch.equal(a, sampling._race_noise.__wrapped__(7, 40, 1000)), "a fresh draw, not the memo's"
    assert not torch.equal(a, sampling.race_noise(7, 41, 1000))
    assert not torch.equal(a, sampling.race_noise(8, 40, 1000))
    assert torch.equal(sampling.race_noise(7, 40, 300), a[:300])  # a narrower vocabulary races the same noise
    assert bool((a > 0).all()) and bool(torch.isfinite(a).all())


def test_each_position_s_noise_is_drawn_once_for_the_draft_and_the_verify(target, near_draft, tokenizer):
    sampling._race_noise.cache_clear()
    ids, steps = run(
        target,
        tokenizer,
        ADD_PROMPT,
        ModelProposer(near_draft, "near"),
        k=4,
        k_policy="fixed",
        max_new_tokens=40,
        temperature=0.8,
        seed=5,
        rule=SHARED_NOISE,
    )
    info = sampling._race_noise.cache_info()
    # Positions read: every emitted one, plus at most the k past the end that the last verify raced.
    assert info.misses <= len(ids) + 4 + 1 and info.hits >= sum(len(s.drafted) for s in steps)


@pytest.fixture(scope="module")
def small_pair():
    tok = char_tokenizer("ab")
    return (
        tok,
        tiny_llama(len(tok), layers=2, hidden=16, seed=11, scale=8.0),
        tiny_llama(len(tok), layers=1, hidden=16, seed=12, scale=8.0),
    )


def _empirical(p_model, tok, prompt, q_model) -> dict:
    counts: dict = {}
    for seed in range(N):
        ids, _ = run(
            p_model, tok, prompt, ModelProposer(q_model, "q"), temperature=0.6, rule=SHARED_NOISE, seed=seed, k=2,
            k_policy="fixed", max_new_tokens=3,
        )  # fmt: skip
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    return {s: c / N for s, c in counts.items()}


@pytest.mark.slow
def test_two_processes_under_adaptive_k_give_the_same_text():
    """Each process calibrates its own costs, so adaptive k chooses other rounds in each: the text
    must not move with them."""
    cmd = [
        sys.executable, "-m", "app", "generate", "--target", models.TINY_TARGET, "--prompt", "def parse(line):\n",
        "--temperature", "0.8", "--seed", "7", "--max-new-tokens", "48", "--rule", SHARED_NOISE, "--json",
    ]  # fmt: skip
    plain_cmd = cmd + ["--mode", "autoregressive"]
    env = dict(os.environ, SPECDEC_THREADS="1")
    # All three at once: each calibrates while the others load the machine, so their costs differ more.
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True, env=env) for c in (cmd, cmd, plain_cmd)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    docs = [json.loads(out) for out in outs]
    texts = [d["text"] for d in docs]
    assert texts[0] == texts[1] == texts[2]
    assert docs[0]["stats"]["accepted"] > 0


def test_a_draft_equal_to_the_target_races_the_same_noise(target, tokenizer):
    """Where q = p the draft must pick exactly the target's winner at every position: it reads the
    noise at the absolute positions the target does. Every draft is then kept."""
    for seed in range(3):
        _, steps = run(
            target, tokenizer, ADD_PROMPT, ModelProposer(target, "itself"), seed=seed, k=4, k_policy="fixed",
            max_new_tokens=NEW, **SAMPLED,
        )  # fmt: skip
        assert all(s.accepted == len(s.drafted) for s in steps)


def test_the_teaching_view_shows_both_races_and_who_won(target, tokenizer):
    draft = noisy_copy(target, 0.3)
    steps = []
    for seed in range(4):  # rounds of both kinds: some with a rejection, some with every draft kept
        steps += run(
            target, tokenizer, ADD_PROMPT, ModelProposer(draft, "d"), seed=seed, k=4, k_policy="fixed",
            max_new_tokens=24, **SAMPLED,
        )[1]  # fmt: skip
    rejected = [s for s in steps if s.accepted < len(s.drafted)]
    kept = [s for s in steps if s.drafted and s.accepted == len(s.drafted)]
    assert rejected and kept
    for s in rejected:
        by_p, by_q = max(s.race, key=lambda r: r[4]), max(s.race, key=lambda r: r[5])
        assert by_p[0] == s.token and by_q[0] == s.drafted[s.accepted] != s.token
        assert "different winners" in render.race_markdown(s)
        assert render.decision_rows(s, SHARED_NOISE)[s.accepted][3] == "no"
    assert "Every draft was kept" in render.race_markdown(kept[0])
    # The plot names the race's p, not the rejection rule's residual.
    assert plots.decision_figure(rejected[0], shared_noise=True).data[-1].name.startswith("p: its race's winner")
    assert render.headers_for(SHARED_NOISE) == render.SHARED_HEADERS


def test_the_side_by_side_check_under_each_rule(target, near_draft, tokenizer):
    _, spec = run(target, tokenizer, ADD_PROMPT, ModelProposer(near_draft, "n"), seed=0, max_new_tokens=NEW, **SAMPLED)
    ar_ids, ar = run(target, tokenizer, ADD_PROMPT, seed=0, max_new_tokens=NEW, **SAMPLED)
    assert "Same-seed check (shared noise) passed" in check.identity_check(spec, ar, SHARED_NOISE)
    other_ids, other = run(target, tokenizer, ADD_PROMPT, seed=1, max_new_tokens=NEW, **SAMPLED)
    assert other_ids != ar_ids and "failed" in check.identity_check(spec, other, SHARED_NOISE)
    assert "distribution" in check.identity_check(spec, ar, REJECTION)


def test_a_cross_tokenizer_draft_races_at_the_targets_positions(monkeypatch):
    """The target itself as a cross-tokenizer draft (one tokenizer on both sides, so q = p on the
    shared ids): it picks the target's winners, and keeps most drafts; racing one position off, as a
    planted bug does, keeps few."""
    from app.drafts import cross_tokenizer

    tok = char_tokenizer("ab")
    model = tiny_llama(len(tok), layers=2, hidden=16, seed=11, scale=8.0)
    bridge = TokenBridge(tok, tok)

    def kept() -> float:
        accepted = drafted = 0
        for seed in range(10):
            proposer = CrossTokenizerProposer(model, bridge, "itself")
            _, steps = run(
                model, tok, "abba", proposer, seed=seed, k=4, k_policy="fixed", temperature=1.0, rule=SHARED_NOISE,
                max_new_tokens=12,
            )  # fmt: skip
            accepted += sum(s.accepted for s in steps)
            drafted += sum(len(s.drafted) for s in steps)
        return accepted / drafted

    assert kept() > 0.75
    # The draft's own view of the sampling module, shifted: the verifier keeps racing the true positions.
    shifted = types.SimpleNamespace(**vars(sampling))
    shifted.race_noise = lambda seed, at, width, device=None: sampling.race_noise(seed, at + 1, width, device)
    monkeypatch.setattr(cross_tokenizer, "sampling", shifted)
    assert kept() < 0.5
