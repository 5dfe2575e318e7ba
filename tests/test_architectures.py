"""Every supported architecture, proven: greedy output equals generate(), rollback never re-prefills.

Each model is tiny and random, built from a config, saved with the bundled tokenizer to a
local directory and loaded the way a user's Hub id would be. Window models are run well
past their sliding window, where a cache that cannot be cropped used to fail mid-run.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import noisy_copy
from transformers import AutoTokenizer
from transformers.cache_utils import DynamicSlidingWindowLayer

from app import models
from app.core.config import RunConfig, SamplingConfig, SpecConfig, UserError
from app.core.engine import generate
from app.drafts.model import decoder_layers
from app.kv.cache import DynamicRollbackCache

TOKENIZER = models.BUNDLED / "target"
WINDOW = 16  # sliding window of the window models: the prompt alone is longer
PROMPT = "def main(argv=None):\n    parser = argparse.ArgumentParser()\n"
NEW = 40
SCALE = 30.0
SPECIAL = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
LLAMA_LIKE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
HYBRID = ["sliding_attention", "full_attention"] * 2  # Gemma's alternating local/global layers
GEMMA = dict(head_dim=8, sliding_window=WINDOW, layer_types=HYBRID, tie_word_embeddings=False)

CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**LLAMA_LIKE),
    "qwen2": lambda: tf.Qwen2Config(**LLAMA_LIKE),
    "qwen3": lambda: tf.Qwen3Config(**LLAMA_LIKE, head_dim=8),
    "mistral": lambda: tf.MistralConfig(**LLAMA_LIKE, sliding_window=WINDOW),
    # Untied: a random Gemma's scaled-up input embedding otherwise makes every token predict itself.
    "gemma2": lambda: tf.Gemma2Config(**LLAMA_LIKE, **GEMMA),
    "gemma3": lambda: tf.Gemma3TextConfig(**LLAMA_LIKE, **GEMMA),
    "phi3": lambda: tf.Phi3Config(**LLAMA_LIKE),
    # Tied embeddings cannot be scaled alone (the input would grow too): larger weights sharpen them instead.
    "gpt2": lambda: tf.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=256, initializer_range=0.2),
    "gpt_neox": lambda: tf.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256
    ),
    "opt": lambda: tf.OPTConfig(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=32,
        init_std=0.2,
    ),
}
WINDOWED = {"mistral", "gemma2", "gemma3"}


def build(arch: str, vocab: int, seed: int) -> torch.nn.Module:
    """A random model whose output layer is scaled up, so greedy never meets a near-tie."""
    config = CONFIGS[arch]()
    for key, value in (SPECIAL | {"vocab_size": vocab}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(SCALE)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch_dirs(request, tmp_path_factory):
    """(arch, target dir, draft dir): saved like any local model a user brings."""
    arch = request.param
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    root = tmp_path_factory.mktemp(arch)
    target = build(arch, len(tok), seed=0)
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.1, seed=1))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return arch, str(root / "target"), str(root / "draft")


def reference(pair: models.Pair, ids: list[int]) -> list[int]:
    """The target's own greedy continuation, by transformers' generate(), with no near-ties in it."""
    out = pair.target.generate(
        torch.tensor([ids]),
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=2,
        return_dict_in_generate=True,
        output_logits=True,
    )
    top2 = torch.cat(out.logits).topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "a near-tie would make the comparison depend on rounding"
    return out.sequences[0, len(ids) :].tolist()


def speculate(pair: models.Pair, ids: list[int], sampling: SamplingConfig = SamplingConfig()):
    """(emitted ids, steps, proposer) of one speculative run with a fixed k = 4."""
    spec = SpecConfig(k=4, k_policy="fixed")
    proposer = pair.proposer(spec)
    steps = list(
        generate(
            pair.target,
            pair.tokenizer,
            ids,
            proposer,
            sampling_cfg=sampling,
            spec=spec,
            run=RunConfig(NEW),
            target_cache=DynamicRollbackCache,
        )
    )
    return [t for s in steps for t in s.emitted], steps, proposer


def count_target_tokens(model: torch.nn.Module) -> tuple[list[int], object]:
    """Tokens per target pass, as its last decoder layer sees them: the model's own forward and a
    direct pass (direct_pass.py) both run that layer, and an early-exit draft, which shares the
    target's first layers, never does."""
    seen: list[int] = []
    last = model.get_submodule(decoder_layers(model))[-1]
    hook = last.register_forward_pre_hook(
        lambda m, a, kw: seen.append((a[0] if a else kw["hidden_states"]).shape[1]), with_kwargs=True
    )
    return seen, hook


def assert_no_reprefill(seen: list[int], steps, prompt_len: int, proposer) -> None:
    """Target: the prompt once, then per round the pending token plus the drafts. Draft: each
    committed position once, plus the drafts it fed that were then rejected."""
    assert len(seen) == len(steps), "one target pass per round"
    assert sum(seen) == prompt_len + sum(len(s.drafted) for s in steps) + len(steps) - 1
    discarded = sum(max(0, len(s.drafted) - 1 - s.accepted) for s in steps)
    assert proposer.lm.tokens_processed == proposer.lm.length + discarded


@pytest.mark.parametrize("draft", ["model", "early-exit:2"])
def test_greedy_equals_generate_and_never_reprefills(arch_dirs, draft):
    arch, target_dir, draft_dir = arch_dirs
    pair = models.load_pair(target_dir, draft_dir if draft == "model" else draft)
    ids = pair.encode(PROMPT)
    if arch in WINDOWED:  # the prompt and output together span the window several times over
        assert len(ids) > WINDOW and len(ids) + NEW > 3 * WINDOW
        assert any(
            isinstance(layer, DynamicSlidingWindowLayer) for layer in DynamicRollbackCache(pair.target).cache.layers
        )
    expected = reference(pair, ids)
    seen, hook = count_target_tokens(pair.target)
    try:
        got, steps, proposer = speculate(pair, ids)
    finally:
        hook.remove()
    assert got == expected, f"{arch} with draft {draft}: speculative output differs from generate()"
    assert any(s.accepted < len(s.drafted) for s in steps), "some rollback must have happened"
    assert any(s.accepted > 0 for s in steps), "some drafts must have been kept"
    assert_no_reprefill(seen, steps, len(ids), proposer)
    for layer in proposer.lm.cache.layers:  # recording the past for rollback must not grow the window
        if isinstance(layer, DynamicSlidingWindowLayer):
            assert layer.keys.shape[-2] <= WINDOW - 1 + 4


def test_sampling_runs(arch_dirs):
    arch, target_dir, draft_dir = arch_dirs
    pair = models.load_pair(target_dir, draft_dir)
    got, steps, _ = speculate(pair, pair.encode(PROMPT), SamplingConfig(temperature=0.8, top_p=0.95, seed=3))
    assert len(got) == NEW or steps[-1].stop_reason == "eos"
    assert all(0 <= t < len(pair.tokenizer) for t in got)


def test_a_recurrent_cache_is_refused_when_the_pair_loads(tmp_path):
    # Mamba's state cannot be rewound by a crop: refused before anyone waits, naming the architecture.
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tf.MambaForCausalLM(
        tf.MambaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, state_size=4, **SPECIAL)
    ).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"MambaForCausalLM \(mamba\) is not supported: .*cannot be cropped"):
        models.load_pair(str(tmp_path), "prompt-lookup")
    plain = models.load_pair(str(tmp_path), draft=False)  # plain decoding never rolls back: it still runs
    ids = plain.encode(PROMPT)
    steps = list(
        generate(plain.target, plain.tokenizer, ids, None, run=RunConfig(12), target_cache=DynamicRollbackCache)
    )
    expected = plain.target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert [t for s in steps for t in s.emitted] == expected[0, len(ids) :].tolist()


@pytest.mark.parametrize("rows", [3000, 4096 + 64], ids=["smaller", "larger"])
def test_draft_with_another_embedding_size(tmp_path, rows):
    """A draft whose embedding table is smaller or larger than the target's vocabulary: no IndexError,
    never an id the target cannot have, and the target's own output."""
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    target = build("llama", len(tok), seed=0)
    draft = noisy_copy(target, 0.1, seed=1)
    draft.resize_token_embeddings(rows, mean_resizing=False)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    pair = models.load_pair(str(tmp_path / "target"), str(tmp_path / "draft"))
    assert pair.draft.model.get_input_embeddings().weight.shape[0] == rows
    ids = pair.encode(PROMPT + tok.decode([3100, 3500, 4000]))
    assert max(ids) >= 3000, "the prompt must hold ids the smaller draft cannot embed"
    got, steps, _ = speculate(pair, ids)
    assert got == reference(pair, ids)
    assert any(s.accepted > 0 for s in steps)
    got, _, _ = speculate(pair, ids, SamplingConfig(temperature=1.0, seed=0))
    assert max(got) < len(tok)
