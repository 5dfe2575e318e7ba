"""Repetition controls stay lossless: p and q get generate()'s processors at every position."""

import pytest
import torch
from conftest import hf_greedy_until_eos as hf_greedy
from conftest import run
from test_sampling import N, empirical, exact_distribution, tv, tv_bound

from app.core import sampling
from app.core.config import SamplingConfig, UserError
from app.drafts.lookup import PromptLookup
from app.drafts.model import ModelProposer, early_exit

PROMPT = "the cat sat on the mat. the cat"
PENALTIES = [
    dict(repetition_penalty=1.5),
    dict(no_repeat_ngram_size=3),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
]


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("source", ["draft-model", "prompt-lookup", "early-exit"])
def test_greedy_with_penalties_equals_generate(target, near_draft, tokenizer, no_eos, penalty, source):
    ref = hf_greedy(target, tokenizer, PROMPT, 40, **penalty)
    assert ref != hf_greedy(target, tokenizer, PROMPT, 40), "the penalty must change the output to bite"
    proposer = {
        "draft-model": lambda: ModelProposer(near_draft, "near"),
        "prompt-lookup": lambda: PromptLookup(3, 1),
        "early-exit": lambda: early_exit(target, 2),
    }[source]()
    spec, steps = run(target, tokenizer, PROMPT, proposer, k=4, k_policy="fixed", max_new_tokens=40, **penalty)
    assert spec == ref
    if source != "prompt-lookup":  # lookup proposes repeats, which an n-gram ban may forbid
        assert sum(s.accepted for s in steps) > 0


def test_no_repeat_ngram_is_respected(target, near_draft, tokenizer, no_eos):
    ids, _ = run(
        target,
        tokenizer,
        PROMPT,
        ModelProposer(near_draft, "near"),
        k=4,
        k_policy="fixed",
        max_new_tokens=60,
        no_repeat_ngram_size=3,
    )
    prompt = tokenizer(PROMPT)["input_ids"]
    full = prompt + ids
    grams = [tuple(full[i : i + 3]) for i in range(len(full) - 2)]
    new = range(len(prompt) - 2, len(grams))  # every 3-gram that ends in generated text
    assert len(ids) > 10 and all(grams[i] not in grams[:i] for i in new)


def test_sampling_with_a_penalty_matches_the_processed_target(monkeypatch):
    from test_sampling import char_tokenizer, tiny_llama

    tok = char_tokenizer("ab")
    p_model = tiny_llama(len(tok), layers=2, hidden=16, seed=11, scale=8.0)
    q_model = tiny_llama(len(tok), layers=1, hidden=16, seed=12, scale=8.0)
    cfg = SamplingConfig(temperature=0.8, repetition_penalty=4.0)
    prompt = tok("abba")["input_ids"]
    # The exact distribution of the processed target, by enumeration with the same processors.
    real_probs = sampling.probs

    def walk_probs(model, ids, cfg_):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1:]
        return real_probs(sampling.penalise(logits, ids, [], cfg_), cfg_)[0]

    exact = {}

    def walk(prefix, mass):
        if len(prefix) == 3 or (prefix and prefix[-1] == 1):
            exact[tuple(prefix)] = exact.get(tuple(prefix), 0.0) + mass
            return
        for t, pt in enumerate(walk_probs(p_model, prompt + prefix, cfg).tolist()):
            if pt > 0:
                walk(prefix + [t], mass * pt)

    walk([], 1.0)
    plain = exact_distribution(p_model, prompt, SamplingConfig(temperature=0.8))
    assert tv(exact, plain) > 1.5 * tv_bound(exact), "the penalty must change the distribution to bite"
    counts = {}
    for seed in range(N):
        ids, _ = run(
            p_model,
            tok,
            prompt,
            ModelProposer(q_model, "q"),
            temperature=0.8,
            repetition_penalty=4.0,
            seed=seed,
            k=2,
            k_policy="fixed",
            max_new_tokens=3,
        )
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    got = {s: c / N for s, c in counts.items()}
    assert tv(got, exact) < tv_bound(exact)
    assert empirical  # the unpenalised helper stays importable for the shared bound


@pytest.mark.parametrize(
    "bad",
    [
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=float("nan")),
        dict(no_repeat_ngram_size=-1),
        dict(temperature=float("nan")),
    ],
)
def test_bad_repetition_settings_are_refused(bad):
    with pytest.raises(UserError):
        SamplingConfig(**bad).validate()


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_the_n_gram_ban_is_generates_own_on_every_history(n):
    """sampling.ban_repeated_ngrams bans exactly what transformers' NoRepeatNGramLogitsProcessor bans,
    on short and long histories over a small alphabet (many repeats) and a large one (few)."""
    import random

    from transformers import NoRepeatNGramLogitsProcessor

    from app.core.sampling import ban_repeated_ngrams

    rng = random.Random(n)
    processor = NoRepeatNGramLogitsProcessor(n)
    for trial in range(200):
        vocab = rng.choice([3, 7, 50])
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 80 if trial % 10 else 400))]
        row = torch.randn(1, 50, generator=torch.Generator().manual_seed(trial))
        ids = torch.tensor(history, dtype=torch.long)
        want = processor(ids[None], row.clone())
        assert torch.equal(ban_repeated_ngrams(ids, row.clone(), n), want), (n, history)


@pytest.mark.parametrize("n", [2, 3, 6])
def test_a_chains_rows_are_banned_at_once_as_generate_bans_each(n):
    """sampling.ban_prefix_ngrams, every row of a verify pass after its own prefix of one sequence at
    once, bans in each row exactly what transformers' NoRepeatNGramLogitsProcessor bans after that
    prefix: short prefixes (no n-gram yet) and long ones, small and large alphabets."""
    import random

    from transformers import NoRepeatNGramLogitsProcessor

    from app.core.sampling import ban_prefix_ngrams

    rng = random.Random(n)
    processor = NoRepeatNGramLogitsProcessor(n)
    for trial in range(100):
        vocab = rng.choice([3, 7, 50])
        full = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60 if trial % 10 else 300))]
        lengths = sorted(rng.randrange(0, len(full) + 1) for _ in range(rng.randrange(1, 6)))
        rows = torch.randn(len(lengths), 50, generator=torch.Generator().manual_seed(trial))
        want = torch.cat(
            [
                processor(torch.tensor([full[:m]], dtype=torch.long), rows[i : i + 1].clone())
                for i, m in enumerate(lengths)
            ]
        )
        got = rows.clone()
        ban_prefix_ngrams(got, torch.tensor(full, dtype=torch.long), lengths, n)
        assert torch.equal(got, want), (n, full, lengths)


@pytest.mark.parametrize(
    "settings",
    [dict(no_repeat_ngram_size=3), dict(repetition_penalty=1.3), dict(repetition_penalty=0.8, no_repeat_ngram_size=2)],
)
def test_a_draft_vocabularys_scores_are_penalised_as_the_full_rows_places(settings):
    """penalise_subset gives a draft vocabulary's places the numbers penalise() gives them in the full
    row (-inf elsewhere), so a greedy feature head picks the same token without building that row."""
    g = torch.Generator().manual_seed(4)
    vocab_size = 40
    vocab = torch.randperm(vocab_size, generator=g)[:15]
    slot_of = torch.full((vocab_size,), -1, dtype=torch.long)
    slot_of[vocab] = torch.arange(len(vocab))
    cfg = SamplingConfig(**settings)
    for trial in range(100):
        history = torch.randint(0, 6 if trial % 2 else vocab_size, (trial % 30,), generator=g).tolist()
        scores = torch.randn(len(vocab), generator=g) * 3
        full = torch.full((vocab_size,), float("-inf"))
        full[vocab] = scores
        want = sampling.penalise(full[None], history, [], cfg)[0][vocab]
        assert torch.equal(sampling.penalise_subset(scores, slot_of, history, cfg), want), (settings, history)


def test_one_penalise_call_gives_each_tree_row_its_own_branchs_history():
    """sampling.penalise over a round's rows with the drafts' parents: each row is what it is alone
    after the context and its own branch, for trees and chains (parents left out: a chain)."""
    import random

    rng = random.Random(1)
    for trial in range(300):
        cfg = SamplingConfig(repetition_penalty=1.3 if trial % 2 else 1.0, no_repeat_ngram_size=trial % 3 + 1)
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        n = rng.randrange(0, 8)
        parents = [-1 if i == 0 else rng.randrange(-1, i) for i in range(n)]
        tokens = [rng.randrange(6) for _ in range(n)]
        logits = torch.randn(n + 1, 6, generator=torch.Generator().manual_seed(trial))
        branches: list[list[int]] = []
        for i, parent in enumerate(parents):
            branches.append((branches[parent] if parent >= 0 else []) + [tokens[i]])
        alone = [
            sampling.penalise(logits[r : r + 1], h, [], cfg)
            for r, h in enumerate([context, *(context + b for b in branches)])
        ]
        together = sampling.penalise(logits, context, tokens, cfg, parents)
        assert torch.equal(together, torch.cat(alone)), parents
        if parents == list(range(-1, n - 1)):
            assert torch.equal(sampling.penalise(logits, context, tokens, cfg), together)
