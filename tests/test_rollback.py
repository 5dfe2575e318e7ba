"""Rollback is exact, and nobody re-prefills."""

import torch
from conftest import run
from test_architectures import count_target_tokens

from app.drafts.model import ModelProposer, early_exit, early_exit_view
from app.kv.cache import DynamicRollbackCache

PROMPT = "def add(a, b):\n  return a"


def fresh(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_rollback_then_extend_equals_a_fresh_forward(target):
    ids = list(range(3, 40))
    lm = DynamicRollbackCache(target)
    lm.extend(ids[:20])
    lm.extend(ids[20:30] + [5, 6, 7])  # three drafts the target will reject
    lm.rollback(30)
    assert lm.length == 30
    got = lm.extend(ids[30:])
    assert torch.allclose(got, fresh(target, ids)[30:], atol=1e-5)
    assert lm.tokens_processed == 20 + 13 + 7


def test_early_exit_view_is_the_first_layers_plus_head(target):
    ids = list(range(3, 30))
    view = early_exit_view(target, 2)
    with torch.no_grad():
        hidden = target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[2]
        ref = target.lm_head(target.model.norm(hidden))[0]
    lm = DynamicRollbackCache(view)
    lm.extend(ids[:10]), lm.extend(ids[10:25]), lm.rollback(12)
    assert torch.allclose(lm.extend(ids[12:]), ref[12:], atol=1e-5)
    assert len(target.model.layers) == 4, "the view must not change the shared target"


def test_target_processes_each_token_once(target, near_draft, tokenizer):
    seen, handle = count_target_tokens(target)
    try:
        _, steps = run(
            target, tokenizer, PROMPT, ModelProposer(near_draft, "near"), k=4, k_policy="fixed", max_new_tokens=50
        )
    finally:
        handle.remove()
    prompt_len = len(tokenizer(PROMPT)["input_ids"])
    assert len(seen) == len(steps), "one target pass per round"
    # Prompt once, then per round: the one pending token plus the drafts. Nothing is re-fed.
    assert sum(seen) == prompt_len + sum(len(s.drafted) for s in steps) + len(steps) - 1
    assert any(s.accepted < len(s.drafted) for s in steps), "some rollback must have happened"


def test_draft_cache_matches_fresh_forward_after_full_accepts(target, tokenizer):
    # The target as its own draft: every draft accepted, every round ends with a bonus.
    # The draft must still see its own last draft, or its cache silently drifts.
    proposer = ModelProposer(target, "self")
    _, steps = run(target, tokenizer, PROMPT, proposer, k=4, k_policy="fixed", max_new_tokens=30)
    assert all(s.token_kind == "bonus" for s in steps)
    assert proposer.lm.length < len(proposer.ids)
    got = proposer.lm.extend(proposer.ids[proposer.lm.length :])
    assert torch.allclose(got[-1], fresh(target, proposer.ids)[-1], atol=1e-5)


def test_draft_cache_matches_fresh_forward_after_rejections(target, near_draft, tokenizer):
    proposer = early_exit(target, 2)
    _, steps = run(target, tokenizer, PROMPT, proposer, k=4, k_policy="fixed", max_new_tokens=30)
    assert any(s.accepted < len(s.drafted) for s in steps)
    got = proposer.lm.extend(proposer.ids[proposer.lm.length :])
    assert torch.allclose(got[-1], fresh(proposer.model, proposer.ids)[-1], atol=1e-5)
