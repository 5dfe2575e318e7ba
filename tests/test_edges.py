"""Edge cases re-expressed from vLLM's and transformers' own tests: each is a clear error or the right result."""

from __future__ import annotations

import pytest
import torch
from conftest import run

from app.core import verify
from app.core.config import RunConfig, SamplingConfig, SpecConfig, UserError
from app.core.contracts import Proposal
from app.drafts.lookup import PromptLookup


@pytest.mark.parametrize(
    "cfg, message",
    [
        (SamplingConfig(temperature=1e-40), "temperature must be 0"),
        (SamplingConfig(temperature=float("inf")), "temperature must be 0"),
        (SamplingConfig(seed=2**70), "seed must be a whole number"),
        (SamplingConfig(seed=float("nan")), "seed must be a whole number"),
        (SpecConfig(k=2.5, k_policy="fixed"), "k must be a whole number"),
        (RunConfig(stop=("",)), "a stop string must be non-empty"),
        (RunConfig(max_new_tokens=3.5), "max new tokens must be a whole number"),
    ],
)
def test_bad_settings_are_refused_in_words(cfg, message):
    with pytest.raises(UserError, match=message):
        cfg.validate()


@pytest.mark.parametrize(
    "prompt, message",
    [([], "the prompt has no tokens"), ([5, -1], "prompt ids must be"), ([5, 10**6], "prompt ids must be")],
)
def test_the_engine_refuses_prompts_the_target_cannot_read(target, tokenizer, prompt, message):
    with pytest.raises(UserError, match=message):
        run(target, tokenizer, prompt, max_new_tokens=4)
    window = target.config.max_position_embeddings
    with pytest.raises(UserError, match="shorten the prompt"):
        run(target, tokenizer, [5] * window, max_new_tokens=4)


class Proposes:
    """A broken draft source that proposes fixed ids."""

    name, wants_features, context_limit, cache_factory, tree = "broken", False, None, None, 0

    def __init__(self, ids):
        self.ids = ids

    def begin(self, prompt_ids, vocab_size): ...
    def propose(self, k, cfg, gen, nodes=0):
        return Proposal(list(self.ids), None)

    def commit(self, path, token, features=None): ...
    def end(self): ...


@pytest.mark.parametrize("ids", [[-1], [10**6], [1.5]])
def test_a_draft_id_outside_the_vocabulary_is_a_clear_error_not_output(target, tokenizer, ids):
    with pytest.raises(ValueError, match="not an id from 0 to"):
        run(target, tokenizer, "def f", Proposes(ids), k=2, k_policy="fixed", max_new_tokens=4)


def test_a_draft_the_target_gives_no_mass_is_never_kept():
    """p = q = 0 at the drafted id: min(1, p/q) would read 1; the rule must reject it."""
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.4, 0.4]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    for seed in range(20):
        v = verify.speculative_sampling([0], [-1], p, q, torch.Generator().manual_seed(seed))
        assert v.accepted == 0 and v.token != 0


def test_an_empty_stop_string_is_refused_before_a_run(target, tokenizer):
    with pytest.raises(UserError, match="stop string"):
        run(target, tokenizer, "def f", PromptLookup(), max_new_tokens=8, stop=("",))


def test_prompt_lookup_stops_its_drafts_before_an_end_of_text_id():
    context = [5, 6, 7, 9, 5, 6, 2, 8, 5, 6]  # "5 6" was last followed by the end of a text (2)
    chain = PromptLookup(2, 1, eos=(2,))
    chain.begin(context, 16)
    greedy = SamplingConfig()
    assert chain.propose(4, greedy, torch.Generator()).tokens == [7, 9, 5, 6], "the older match, not an empty draft"
    tree = PromptLookup(2, 1, eos=(2,))
    tree.begin(context, 16)
    assert tree.propose(4, greedy, torch.Generator(), nodes=8).tokens == [7, 9, 5, 6]
    unaware = PromptLookup(2, 1)  # a target without an end-of-text id
    unaware.begin(context, 16)
    assert unaware.propose(4, greedy, torch.Generator()).tokens == [2, 8, 5, 6]
