"""Speculative sampling has exactly the target's distribution."""

import pytest
import torch
from conftest import char_tokenizer, run, tiny_llama

from app.core import sampling, verify
from app.core.config import SamplingConfig
from app.core.sampling import probs
from app.drafts.lookup import PromptLookup
from app.drafts.model import ModelProposer

SETTINGS = {
    "temperature": SamplingConfig(temperature=0.6),
    "top-k": SamplingConfig(temperature=1.0, top_k=3),
    "top-p": SamplingConfig(temperature=1.3, top_p=0.7),
}
N = 2000  # samples per setting


def tv_bound(exact: dict) -> float:
    """1.5x the expected total-variation distance of N honest samples from `exact`, plus 0.01.

    E|p_hat - p| is about sqrt(2 p (1 - p) / (pi N)) per outcome; the broken rule below
    and the draft's own distribution both land well above the bound.
    """
    noise = 0.5 * sum((2 * p * (1 - p) / (torch.pi * N)) ** 0.5 for p in exact.values())
    return 1.5 * noise + 0.01


@pytest.fixture(scope="module")
def small():
    tok = char_tokenizer("ab")  # 5 ids with the 3 special ones
    p_model = tiny_llama(len(tok), layers=2, hidden=16, seed=11, scale=8.0)
    q_model = tiny_llama(len(tok), layers=1, hidden=16, seed=12, scale=8.0)
    return tok, p_model, q_model


def exact_distribution(model, prompt_ids, cfg, n=3, eos=1):
    """P(first n tokens) by enumeration, EOS ending a sequence early."""
    out = {}

    def walk(prefix, mass):
        if len(prefix) == n or (prefix and prefix[-1] == eos):
            out[tuple(prefix)] = out.get(tuple(prefix), 0.0) + mass
            return
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + prefix])).logits[0, -1]
        for t, pt in enumerate(probs(logits, cfg).tolist()):
            if pt > 0:
                walk(prefix + [t], mass * pt)

    walk([], 1.0)
    return out


def empirical(model, tok, prompt_ids, cfg, proposer_fn, k=2):
    counts = {}
    for seed in range(N):
        ids, _ = run(
            model,
            tok,
            prompt_ids,
            proposer_fn(),
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            seed=seed,
            k=k,
            k_policy="fixed",
            max_new_tokens=3,
        )
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    return {s: c / N for s, c in counts.items()}


def tv(a, b):
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_draft_model_sampling_matches_target_distribution(small, name):
    tok, p_model, q_model = small
    cfg = SETTINGS[name]
    prompt = tok("abba")["input_ids"]
    exact = exact_distribution(p_model, prompt, cfg)
    draft_exact = exact_distribution(q_model, prompt, cfg)
    assert tv(exact, draft_exact) > 3 * tv_bound(exact), "the draft must differ from the target to bite"
    got = empirical(p_model, tok, prompt, cfg, lambda: ModelProposer(q_model, "q"))
    assert tv(got, exact) < tv_bound(exact)


def test_prompt_lookup_sampling_matches_target_distribution(small):
    tok, p_model, _ = small
    cfg = SETTINGS["temperature"]
    prompt = tok("abbabbab")["input_ids"]  # lookup proposes "b", "a", ... with a one-hot q
    exact = exact_distribution(p_model, prompt, cfg)
    got = empirical(p_model, tok, prompt, cfg, lambda: PromptLookup(3, 1))
    assert tv(got, exact) < tv_bound(exact)


def test_a_broken_rule_fails_the_same_bound(small, monkeypatch):
    # Resampling from p instead of norm(max(0, p - q)) after a rejection is a classic bug.
    tok, p_model, q_model = small
    cfg = SETTINGS["temperature"]
    prompt = tok("abba")["input_ids"]
    honest = verify.speculative_sampling

    def broken(drafts, parents, p, q, gen):
        v = honest(drafts, parents, p, q, gen)
        if v.accepted < len(drafts):
            v.token = int(torch.multinomial(p[v.accepted], 1, generator=gen))
        return v

    monkeypatch.setattr(verify, "speculative_sampling", broken)
    got = empirical(p_model, tok, prompt, cfg, lambda: ModelProposer(q_model, "q"))
    exact = exact_distribution(p_model, prompt, cfg)
    assert tv(got, exact) > 1.5 * tv_bound(exact)


def test_one_round_rule_is_exact_for_fixed_p_and_q():
    # The rule alone, many draws: the first emitted token is distributed as p, not q.
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25] * 4])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20000):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        v = verify.speculative_sampling([x], [-1], p, q, gen)
        counts[x if v.accepted else v.token] += 1
    assert (counts / counts.sum() - p[0]).abs().max() < 0.015


def test_the_rule_on_the_device_emits_p_for_fixed_p_and_q():
    """The rule with the picks still on the device (one read a round): the three tokens a round of two
    drafts can emit (the bonus too) are distributed as p's rows, not q's; a rule that keeps every
    draft, or draws the bonus from the last draft's row, is caught."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]])
    far = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    near = torch.tensor([[0.45, 0.3, 0.17, 0.08], [0.12, 0.2, 0.3, 0.38]])  # both kept most rounds
    exact = p[0][:, None, None] * p[1][None, :, None] * p[2][None, None, :]

    def tv_from_exact(rule_p, rule_q, q) -> float:
        gen, counts = torch.Generator().manual_seed(0), torch.zeros(4, 4, 4)
        for _ in range(20000):
            picks = torch.stack([sampling.race(q[i], sampling.fresh_noise(4, gen)) for i in range(2)])
            tokens: list[int] = []
            v = verify.speculative_sampling_on_device(tokens, rule_p, rule_q, picks, gen)
            out = tokens[: v.accepted] + [v.token]
            assert v.judged == list(range(min(v.accepted + 1, 2))) and len(v.u) == len(v.judged)
            while len(out) < 3:  # later tokens come from later rounds: p's rows alone here
                out.append(int(torch.multinomial(p[len(out)], 1, generator=gen)))
            counts[tuple(out)] += 1
        return float((counts / counts.sum() - exact).abs().sum() / 2)

    assert tv_from_exact(p, far, far) < 0.04 and tv_from_exact(p, near, near) < 0.04  # about 0.02
    assert tv_from_exact(p, torch.zeros_like(far), far) > 0.2  # a = 1: every draft kept
    assert tv_from_exact(torch.cat([p[:2], p[1:2]]), near, near) > 0.2  # the bonus from the row before


def test_the_rule_on_the_device_refuses_nan_as_multinomial_does():
    p = torch.tensor([[0.5, 0.5, 0.0], [float("nan"), 0.5, 0.5]])
    q = torch.tensor([[0.2, 0.3, 0.5]])
    with pytest.raises(RuntimeError, match="inf or nan"):
        verify.speculative_sampling_on_device([], p, q, torch.tensor([0]), torch.Generator().manual_seed(0))


def test_draft_model_sampling_on_the_fast_path_matches_the_target_distribution(small):
    """A sampled chain whose draws stay on the device until the verdict (static caches, nothing
    taught): the text has the target's distribution."""
    from app.kv.static_cache import StaticCachePool, cache_length

    tok, p_model, q_model = small
    cfg = SETTINGS["temperature"]
    prompt = tok("abba")["input_ids"]
    pool = StaticCachePool(cache_length(len(prompt), 3))
    counts: dict = {}
    for seed in range(N):
        ids, _ = run(
            p_model, tok, prompt, ModelProposer(q_model, "q", pool), temperature=cfg.temperature, seed=seed, k=2,
            k_policy="fixed", max_new_tokens=3, target_cache=pool, teach=False, display=False,
        )  # fmt: skip
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    exact = exact_distribution(p_model, prompt, cfg)
    assert tv({s: c / N for s, c in counts.items()}, exact) < tv_bound(exact)


def test_same_seed_repeats_exactly_and_other_seeds_differ(small):
    tok, p_model, q_model = small
    prompt = tok("abba")["input_ids"]
    runs = [
        run(
            p_model,
            tok,
            prompt,
            ModelProposer(q_model, "q"),
            temperature=1.0,
            seed=s,
            k=3,
            k_policy="fixed",
            max_new_tokens=30,
        )
        for s in (7, 7, 8)
    ]
    assert runs[0][0] == runs[1][0]
    assert [d.u for s in runs[0][1] for d in s.decisions] == [d.u for s in runs[1][1] for d in s.decisions]
    assert runs[0][0] != runs[2][0]


def test_processing_is_identical_for_p_and_q():
    # top-k and top-p zero out the same tokens whichever model the logits come from.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    pk = probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (pk > 0).tolist() == [True, True, False, False, False]
    pp = probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    full = logits.softmax(-1)
    kept = (pp > 0).sum().item()
    assert full[:kept].sum() >= 0.8 > full[: kept - 1].sum()
    assert torch.allclose(pp[:kept], full[:kept] / full[:kept].sum())


def test_top_p_from_the_likeliest_candidates_drops_exactly_what_a_full_sort_drops(monkeypatch):
    """On CPU top-p ranks only the likeliest TOP_P_CANDIDATES tokens when their mass reaches top_p,
    and sorts the whole row otherwise: the dropped set must be the full sort's either way, and a row
    must get the same set alone as beside other rows (p's rows are filtered together, q's one by
    one), also where bf16-rounded logits tie at the cut."""
    from app.core import sampling

    def full_sort(logits, top_p):
        p = logits.softmax(-1)
        ranked = torch.sort(p, dim=-1, descending=True).values
        before = torch.cat([torch.zeros_like(ranked[..., :1]), ranked.cumsum(-1)[..., :-1]], dim=-1)
        cut = ranked.gather(-1, (before < top_p).sum(-1, keepdim=True).clamp_min(1) - 1)
        return p < cut

    sorts = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **kw: sorts.append(1) or real_sort(*a, **kw))
    gen = torch.Generator().manual_seed(0)
    for scale, top_p, sorted_whole in ((4.0, 0.95, False), (8.0, 0.5, False), (0.3, 0.95, True), (4.0, 0.9999, True)):
        logits = torch.randn(9, 4096, generator=gen) * scale
        sorts.clear()
        dropped = sampling.top_p_drop(logits, top_p)
        assert torch.equal(dropped, full_sort(logits, top_p))
        assert (len(sorts) == 2) == sorted_whole  # the reference sorts once; the fast path does not
        assert not dropped.all(-1).any()  # the likeliest token always stays
    flat = torch.randn(1, 4096, generator=gen) * 0.3
    for dtype in (torch.float32, torch.bfloat16):
        peaked = (torch.randn(8, 4096, generator=gen) * 4).to(dtype).float()  # bf16: ties at the cut
        alone = torch.cat([sampling.top_p_drop(row[None], 0.9) for row in peaked])
        beside = sampling.top_p_drop(torch.cat([peaked, flat]), 0.9)[:-1]  # takes the full sort
        assert torch.equal(alone, full_sort(peaked, 0.9)) and torch.equal(beside, alone)
