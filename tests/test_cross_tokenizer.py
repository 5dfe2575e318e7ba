"""A draft with another tokenizer: greedy output is the target's own; sampling drafts shared tokens only.

The target uses the bundled tokenizer; the draft uses one this file trains on a small text,
so the two split words (and multi-byte characters) at different places.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from app import models as app_models
from app.core.config import RunConfig, SamplingConfig, SpecConfig
from app.core.engine import generate
from app.drafts.cross_tokenizer import CrossTokenizerProposer, TokenBridge
from app.kv.cache import DynamicRollbackCache

CORPUS = (
    """
def main(argv=None):
    parser = argparse.ArgumentParser(description="café naïve 日本語 — ünïcödé")
    for item in items:
        if item is None:
            return {'key': value, 'other': [1, 2, 3]}
    hello world, hello there; helpful helpers help
"""
    * 4
)
PROMPTS = [
    "def main(argv=None):\n    parser = argparse.",
    "    for item in items:\n        if item",
    "x = 'café naïve 日本",
]


def trained_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on CORPUS: small, so it splits words unlike the bundled one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def target_tok():
    return AutoTokenizer.from_pretrained(app_models.BUNDLED / "target")


@pytest.fixture(scope="module")
def draft_tok():
    return trained_tokenizer()


@pytest.fixture(scope="module")
def bridge(target_tok, draft_tok):
    return TokenBridge(target_tok, draft_tok)


def test_the_two_tokenizers_split_differently(target_tok, draft_tok):
    for prompt in PROMPTS:
        t = target_tok.convert_ids_to_tokens(target_tok(prompt, add_special_tokens=False)["input_ids"])
        d = draft_tok.convert_ids_to_tokens(draft_tok(prompt, add_special_tokens=False)["input_ids"])
        assert t != d


@pytest.mark.parametrize(
    "committed, text",
    [
        ("def main(argv=None):\n    parser = argparse.Arg", "umentParser(description"),  # a word the target began
        ("def hel", "lo world"),
        ("if item is None:\n", "        return {'key'"),  # indentation after a newline
        ("    x =  ", " y"),  # runs of spaces on both sides of the seam
        ("s = 'caf", "é naïve'"),  # a multi-byte character right after the seam
        ("s = '日本", "語 — ü'"),
    ],
)
def test_seam_spells_exactly_the_draft_text(bridge, target_tok, committed, text):
    proposer = _proposer(bridge)
    proposer.ids = target_tok(committed)["input_ids"]
    drafts = proposer._seam(text)
    assert drafts, "a seam that can be continued must be"
    assert target_tok.decode(proposer.ids + drafts, skip_special_tokens=True) == committed + text


def test_seam_inside_a_character(bridge, target_tok):
    # The committed tokens end with the first byte of 'é': the drafts must begin with its second byte.
    ids = target_tok("s = 'café'")["input_ids"]
    cut = next(i for i in range(1, len(ids)) if target_tok.decode(ids[:i]).endswith("\ufffd"))
    proposer = _proposer(bridge)
    proposer.ids = ids[:cut]
    drafts = proposer._seam("é'")
    assert target_tok.decode(proposer.ids + drafts, skip_special_tokens=True) == "s = 'café'"


def _proposer(bridge):
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(bridge.draft),
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
        )
    )
    proposer = CrossTokenizerProposer(model, bridge, "d")
    proposer.begin([], len(bridge.target))
    return proposer


class OracleDraft(nn.Module):
    """A draft in the other tokenizer that knows the target's answer, but misses every `miss`-th token.

    It keeps its context in the KV cache it is given (token ids stored as keys), so the
    proposer's rollbacks and re-feeds are what it sees: a wrong rollback shows up as wrong text.
    """

    def __init__(self, tokenizer, answer: str, miss: int = 5):
        super().__init__()
        self.config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=4096,
        )
        self.embed = nn.Embedding(len(tokenizer), 1)
        self.tok, self.answer, self.miss = tokenizer, answer, miss

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, cache, logits_to_keep=0, **_):
        keys = input_ids[:, None, :, None].float()
        seen = cache.update(keys, keys, 0)[0][0, 0, :, 0].long().tolist()
        n = input_ids.shape[1]
        rows = [self._next(seen[: len(seen) - n + i + 1]) for i in range(n)][-logits_to_keep if logits_to_keep else 0 :]
        logits = torch.zeros(len(rows), len(self.tok))
        logits[torch.arange(len(rows)), torch.tensor(rows)] = 10.0
        return SimpleNamespace(logits=logits[None], hidden_states=None)

    def _next(self, context: list[int]) -> int:
        text = self.tok.decode(context, skip_special_tokens=True)
        rest = self.answer[len(text) :] if self.answer.startswith(text) else " "
        ids = self.tok(rest[:24], add_special_tokens=False)["input_ids"] or [self.tok.eos_token_id]
        return (ids[0] + 1) % len(self.tok) if len(context) % self.miss == 0 else ids[0]


def greedy_reference(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
    return out[0, len(ids) :].tolist()


def run(target, tok, ids, proposer, n, sampling=SamplingConfig()):
    spec = SpecConfig(k=4, k_policy="fixed")
    steps = list(
        generate(
            target,
            tok,
            ids,
            proposer,
            sampling_cfg=sampling,
            spec=spec,
            run=RunConfig(n),
            target_cache=DynamicRollbackCache,
        )
    )
    return [t for s in steps for t in s.emitted], steps


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_the_target_with_the_bundled_target(bridge, target_tok, prompt):
    target, _ = app_models.load(app_models.TINY_TARGET)
    ids = target_tok(prompt)["input_ids"]
    expected = greedy_reference(target, ids, 40)
    answer = target_tok.decode(ids + expected, skip_special_tokens=True)
    proposer = CrossTokenizerProposer(OracleDraft(bridge.draft, answer), bridge, "oracle")
    got, steps = run(target, target_tok, ids, proposer, 40)
    assert got == expected
    drafted = sum(len(s.drafted) for s in steps)
    accepted = sum(s.accepted for s in steps)
    assert accepted >= 0.4 * drafted and len(steps) < 30, "re-tokenised drafts must mostly be accepted"
    assert any(s.accepted < len(s.drafted) for s in steps), "the oracle's misses must be rejected"
    # The draft's cache followed the text by crops and short re-feeds, never by re-reading the prompt.
    assert proposer.lm.tokens_processed < proposer.lm.length + 3 * drafted


def test_greedy_random_target_with_partial_characters(bridge, target_tok):
    # A random target writes arbitrary byte-level tokens, bytes of split characters included.
    torch.manual_seed(3)
    target = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(target_tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        )
    ).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(30.0)
    ids = target_tok(PROMPTS[2])["input_ids"]
    expected = greedy_reference(target, ids, 40)
    answer = target_tok.decode(ids + expected, skip_special_tokens=True)
    assert sum("\ufffd" in target_tok.decode([t]) for t in expected) >= 2, "the run must hit partial characters"
    proposer = CrossTokenizerProposer(OracleDraft(bridge.draft, answer, miss=4), bridge, "oracle")
    got, steps = run(target, target_tok, ids, proposer, 40)
    assert got == expected
    assert sum(s.accepted for s in steps) > 0


def test_pair_with_another_tokenizer_loads_and_samples(tmp_path, target_tok, draft_tok):
    """load_pair accepts the pair and says so; sampling drafts only shared tokens, with an exact q."""
    torch.manual_seed(0)
    for name, tok, layers in (("target", target_tok, 2), ("draft", draft_tok, 1)):
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tok),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        ).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    pair = app_models.load_pair(str(tmp_path / "target"), str(tmp_path / "draft"))
    assert pair.note == "different tokenizers: drafts are re-tokenised"
    proposer = pair.proposer()
    assert isinstance(proposer, CrossTokenizerProposer)
    ids = pair.encode(PROMPTS[0])
    got, steps = run(pair.target, pair.tokenizer, ids, proposer, 30, SamplingConfig(temperature=1.0, seed=1))
    assert len(got) == 30 or steps[-1].stop_reason == "eos"
    shared = pair.draft.bridge.shared()
    targets = set(shared[shared >= 0].tolist())
    assert any(s.drafted for s in steps)
    assert all(x in targets for s in steps for x in s.drafted)
    # q of one proposal: a distribution over target ids, zero outside the shared tokens.
    proposer.begin(ids, len(pair.tokenizer))
    proposal = proposer.propose(4, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert torch.allclose(proposal.q.sum(-1), torch.ones(len(proposal.tokens)))
    outside = torch.ones(proposal.q.shape[-1], dtype=torch.bool)
    outside[list(targets)] = False
    assert proposal.q[:, outside].sum() == 0
    # The first row is the draft's own distribution renormalised over the shared tokens, at target ids.
    context, _ = proposer._context()
    with torch.no_grad():
        logits = pair.draft.model(torch.tensor([context])).logits[0, -1].float()
    allowed = shared >= 0
    expected = torch.zeros(proposal.q.shape[-1])
    expected[shared[allowed]] = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)[allowed]
    assert torch.allclose(proposal.q[0], expected, atol=1e-6)


def test_sampling_with_another_tokenizer_keeps_the_target_distribution():
    """Exact by enumeration vs 2000 seeded runs: the draft's vocabulary orders the letters differently
    and has letters the target lacks, so both the id mapping and the renormalisation over shared tokens bite."""
    from conftest import char_tokenizer, tiny_llama
    from test_sampling import N, exact_distribution, tv, tv_bound

    target_tok, draft_tok = char_tokenizer("ab"), char_tokenizer("bcdefa")
    p_model = tiny_llama(len(target_tok), layers=2, hidden=16, seed=11, scale=8.0)
    q_model = tiny_llama(len(draft_tok), layers=1, hidden=16, seed=12, scale=8.0)
    bridge = TokenBridge(target_tok, draft_tok)
    assert bridge.shared().tolist() == [0, 1, 2, 4, -1, -1, -1, -1, 3]  # b -> 4, c..f -> none, a -> 3
    cfg = SamplingConfig(temperature=1.0)
    prompt = target_tok("abba")["input_ids"]
    exact = exact_distribution(p_model, prompt, cfg)
    counts: dict = {}
    for seed in range(N):
        got, _ = run(
            p_model,
            target_tok,
            prompt,
            CrossTokenizerProposer(q_model, bridge, "q"),
            3,
            SamplingConfig(temperature=1.0, seed=seed),
        )
        counts[tuple(got)] = counts.get(tuple(got), 0) + 1
    assert tv({s: c / N for s, c in counts.items()}, exact) < tv_bound(exact)
