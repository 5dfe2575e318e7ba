"""Greedy speculative output is token for token the target's own greedy output."""

import pytest
from conftest import run, tiny_llama

from app.drafts.lookup import PromptLookup
from app.drafts.model import ModelProposer, early_exit

PROMPTS = ["def add(a, b):\n  return a", "the cat sat on the mat. the cat"]


def hf_greedy(model, tokenizer, prompt, n):
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, ids.shape[1] :].tolist()


def sources(target, near_draft):
    return {
        "draft-model": lambda: ModelProposer(near_draft, "near"),
        "prompt-lookup": lambda: PromptLookup(3, 1),
        "early-exit": lambda: early_exit(target, 2),
    }


@pytest.mark.parametrize("source", ["draft-model", "prompt-lookup", "early-exit"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equals_autoregressive_and_generate(target, near_draft, tokenizer, source, k):
    for prompt in PROMPTS:
        ar, _ = run(target, tokenizer, prompt, max_new_tokens=40)
        ref = hf_greedy(target, tokenizer, prompt, 40)
        ref = ref[: ref.index(1) + 1] if 1 in ref else ref  # the engine stops at the tokenizer's EOS
        assert ar == ref
        spec, steps = run(
            target, tokenizer, prompt, sources(target, near_draft)[source](), k=k, k_policy="fixed", max_new_tokens=40
        )
        assert spec == ar
        assert all(s.k <= k for s in steps)


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "adaptive"])
@pytest.mark.parametrize("source", ["draft-model", "prompt-lookup", "early-exit"])
def test_greedy_equality_for_every_k_policy(target, near_draft, tokenizer, policy, source):
    ar, _ = run(target, tokenizer, PROMPTS[0], max_new_tokens=60)
    spec, steps = run(
        target,
        tokenizer,
        PROMPTS[0],
        sources(target, near_draft)[source](),
        k=3,
        k_policy=policy,
        k_max=8,
        max_new_tokens=60,
    )
    assert spec == ar
    if policy != "fixed" and source != "prompt-lookup":
        assert len({s.k for s in steps[:-1]}) > 1, "an adaptive policy should move k"


def test_drafts_are_both_accepted_and_rejected(target, near_draft, tokenizer):
    # The equality tests above only mean something if the draft is sometimes right, sometimes wrong.
    _, steps = run(
        target, tokenizer, PROMPTS[0], ModelProposer(near_draft, "near"), k=4, k_policy="fixed", max_new_tokens=60
    )
    accepted = sum(s.accepted for s in steps)
    drafted = sum(len(s.drafted) for s in steps)
    assert 0.2 < accepted / drafted < 0.95
    assert {s.token_kind for s in steps if s.drafted} == {"corrected", "bonus"}
    # A round that drafted nothing (here the last, clamped one) is the target's own token, not a bonus.
    assert all(s.token_kind == "target" for s in steps if not s.drafted)


def test_padded_vocabulary_draft_works(target, tokenizer):
    # Same tokenizer, embedding matrix padded by 16 rows: must still be lossless.
    padded = tiny_llama(len(tokenizer) + 16, layers=1, hidden=32, seed=5, scale=30.0)
    ar, _ = run(target, tokenizer, PROMPTS[1], max_new_tokens=30)
    spec, _ = run(
        target, tokenizer, PROMPTS[1], ModelProposer(padded, "padded"), k=4, k_policy="fixed", max_new_tokens=30
    )
    assert spec == ar


def test_stops_at_eos_like_generate(target, near_draft, tokenizer):
    ar, _ = run(target, tokenizer, PROMPTS[0], max_new_tokens=40)
    eos = ar[7]  # make a token the model emits early count as EOS
    saved = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = eos
    try:
        spec, steps = run(
            target, tokenizer, PROMPTS[0], ModelProposer(near_draft, "near"), k=8, k_policy="fixed", max_new_tokens=40
        )
        ids = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
        ref = target.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=2, eos_token_id=[eos, 1])[
            0, ids.shape[1] :
        ].tolist()
    finally:
        target.generation_config.eos_token_id = saved
    assert spec == ref[: ref.index(eos) + 1] == ar[: ar.index(eos) + 1]
    assert steps[-1].stop_reason == "eos"


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_never_more_than_max_new_tokens(target, tokenizer, n, no_eos):
    same = target  # the target as its own draft accepts everything, the hardest case
    spec, steps = run(
        target, tokenizer, PROMPTS[0], ModelProposer(same, "self"), k=8, k_policy="fixed", max_new_tokens=n
    )
    assert len(spec) == n
    assert steps[-1].stop_reason == "max_new_tokens"


def test_stop_string_ends_the_text(target, near_draft, tokenizer, no_eos):
    ar, steps = run(target, tokenizer, PROMPTS[0], max_new_tokens=40)
    text = "".join(s.text for s in steps)
    stop = text[10:12]
    _, spec_steps = run(
        target,
        tokenizer,
        PROMPTS[0],
        ModelProposer(near_draft, "near"),
        k=4,
        k_policy="fixed",
        max_new_tokens=40,
        stop=(stop,),
    )
    out = "".join(s.text for s in spec_steps)
    assert out == text[: text.index(stop) + len(stop)]
    assert spec_steps[-1].stop_reason == "stop_string"


def test_streamed_text_matches_full_decode():
    # Byte-level BPE splits multi-byte characters across tokens; streaming must not.
    from app.core.text import Detokenizer
    from app.data.corpus import train_tokenizer

    tok = train_tokenizer(["def f(x):\n    return 'héllo wörld ✓ 日本'\n"] * 20, 300)
    text = "    s = 'naïve café ✓ 日本語'  # ok\n\tx = 1\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tok, [tok.bos_token_id])
    assert "".join(detok.push(t) for t in ids) == text
    assert len(ids) > len(text.split())  # it really was split into many pieces


def test_peek_spells_each_draft_and_the_targets_token_without_committing():
    from app.core.text import Detokenizer
    from app.data.corpus import train_tokenizer

    tok = train_tokenizer(["def f(x):\n    return 'héllo wörld ✓ 日本'\n"] * 20, 300)
    ids = tok("x = 'café ✓'\ny = '日本語' + x\n", add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tok, [tok.bos_token_id])
    assert detok.backend is not None  # the Rust backend's decode is what is checked against the wrapper's
    for t in ids[:4]:
        detok.push(t)
    before = (list(detok.ids), detok.prefix, detok.read)
    drafts, token = ids[4:10], ids[12]
    pieces, token_text = detok.peek(drafts, 3, token)
    window = detok.ids[detok.prefix :]
    dec = lambda x: tok.decode(x, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa: E731
    # Each piece is what its draft adds to the text before it; the token is read after drafts[:3].
    assert pieces == [dec(window + drafts[: i + 1])[len(dec(window + drafts[:i])) :] for i in range(len(drafts))]
    assert token_text == dec(window + drafts[:3] + [token])[len(dec(window + drafts[:3])) :]
    assert (detok.ids, detok.prefix, detok.read) == before


def test_without_display_the_tokens_are_the_same_and_no_draft_text_is_made(target, near_draft, tokenizer):
    from conftest import ADD_PROMPT

    shown, with_text = run(
        target, tokenizer, ADD_PROMPT, ModelProposer(near_draft, "n"), k=4, k_policy="fixed", max_new_tokens=24
    )
    bare, without = run(
        target, tokenizer, ADD_PROMPT, ModelProposer(near_draft, "n"), k=4, k_policy="fixed", max_new_tokens=24,
        display=False,
    )  # fmt: skip
    assert bare == shown and "".join(s.text for s in without) == "".join(s.text for s in with_text)
    assert any(s.draft_text for s in with_text) and all(t == "" for s in without for t in s.draft_text + [s.token_text])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_with_a_shorter_window_drafts_less_and_the_target_still_runs_to_its_own_end(tokenizer, temperature):
    """The target's context ends the run, as in plain decoding; past the draft's window, plain steps."""
    import copy

    from conftest import noisy_copy

    target = tiny_llama(len(tokenizer), layers=2, hidden=32, seed=5, scale=30.0, ctx=96)
    target.generation_config.eos_token_id = None
    draft = noisy_copy(target, 0.02)
    draft.config = copy.deepcopy(draft.config)
    draft.config.max_position_embeddings = 40
    prompt = "def add(a, b):\n  return a"
    kw = dict(max_new_tokens=200, temperature=temperature, seed=3, rule="shared-noise")
    ar, ar_steps = run(target, tokenizer, prompt, **kw)
    spec, steps = run(target, tokenizer, prompt, ModelProposer(draft, "short"), k=4, k_policy="fixed", **kw)
    assert spec == ar and steps[-1].stop_reason == ar_steps[-1].stop_reason == "context_full"
    assert any(s.drafted for s in steps), "it drafts while the draft's window has room"
    assert all(s.k == 0 for s in steps if s.context + 1 >= 40), "and takes plain steps after"
