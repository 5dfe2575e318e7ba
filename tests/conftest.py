"""Tiny Llama models built in memory with a shared character vocabulary."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from app.models import threads

# Tests run in fp32, where greedy output is the target's bit for bit; --dtype auto is tested with a
# mocked probe (test_precision.py). Servers the tests start inherit it.
os.environ.setdefault("SPECDEC_DTYPE", "fp32")
# Each test measures as a first process would, and none reads or writes the user's kept calibrations
# (test_kept_costs.py keeps them in a folder of its own).
os.environ["SPECDEC_KEEP_COSTS"] = "0"
threads.apply()  # the app's thread policy (SPECDEC_THREADS overrides): tests stay fast on a busy machine

CHARS = "abcdefghijklmnopqrstuvwxyz .,:()=\n_0123456789"


def char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """One token per character, plus <s>, </s> and <pad>."""
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_llama(
    vocab: int, layers: int = 2, hidden: int = 32, seed: int = 0, scale: float = 1.0, ctx: int = 256
) -> LlamaForCausalLM:
    """Random Llama; `scale` sharpens its distributions by scaling the output layer."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=ctx,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 2
    return model


def _tree_outputs() -> dict[str, str] | None:
    """Changed or new non-source files in the git work tree, with a hash of each (None outside git)."""
    import hashlib
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    paths = [line[3:].split(" -> ")[-1] for line in out.splitlines()]
    # Source and docs are left out: people edit them while a suite runs; tests write neither.
    # So is the screenshot a run was asked to refresh (SPECDEC_SCREENSHOT, see README).
    asked = Path(os.environ.get("SPECDEC_SCREENSHOT") or root / "-").resolve()
    return {
        p: hashlib.sha1((root / p).read_bytes()).hexdigest() if (root / p).is_file() else "gone"
        for p in paths
        if not p.endswith((".py", ".md")) and (root / p).resolve() != asked
    }


# The files that take longest, longest first; the rest follow in collection order. The workers take
# whole files in this order (pytest.ini turns off xdist's own reordering by test count), so a long file
# left for the end would keep one worker busy while the other waits. A worker is handed its next file
# when two tests of its current one are left, so a file's longest test comes first in it.
LONGEST_FIRST = [
    "test_ui.py",
    "test_examples.py",
    "test_smollm2.py",
    "test_bench.py",
    "test_sampling.py",
    "test_load.py",
    "test_queue.py",
    "test_hosting.py",
    "test_boundary.py",
    "test_shared_noise.py",
    "test_docs.py",
    "test_exact.py",
    "test_gpucheck.py",
    "test_cli.py",
]


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    missing = [name for name in LONGEST_FIRST if not os.path.exists(os.path.join(here, name))]
    assert not missing, f"LONGEST_FIRST names files that are gone: {missing}"
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


def pytest_configure(config):
    # The quick tier for development is `python -m pytest -q -m "not slow"`; CI runs everything.
    config.addinivalue_line("markers", "slow: servers, browsers, benchmarks and bundled-model runs (seconds each)")


@pytest.fixture(scope="session", autouse=True)
def leaves_the_work_tree_alone():
    """The suite writes to temporary paths only: git status is the same before and after it."""
    before = _tree_outputs()
    yield
    after = _tree_outputs()
    assert before is None or after == before, f"tests changed files in the work tree: {after} (was {before})"


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer):
    return tiny_llama(len(tokenizer), layers=4, hidden=64, seed=1, scale=30.0)


@pytest.fixture(scope="session")
def draft(tokenizer):
    return tiny_llama(len(tokenizer), layers=1, hidden=32, seed=2, scale=30.0)


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int = 0) -> LlamaForCausalLM:
    """The model with Gaussian noise on every weight: a draft that agrees often, not always."""
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return out


@pytest.fixture(scope="session")
def near_draft(target):
    return noisy_copy(target, 0.05)


ADD_PROMPT = "def add(a, b):\n  return a"  # the render and UI tests' prompt
TINY_TARGET = "stdlib-code target (bundled)"  # the page's name for the bundled tiny target


def form_fields(complete: bool = False, **given) -> dict:
    """A click's fields by name, in the form's own order (form.fields(), the API's), for a handler or a
    client: those given and every field an API caller must send (the prompt and the picked pair given, a
    custom id blank, a setting at the page's start, knob_widgets.start_value, within its slider's range,
    an unticked box False). `complete`: every other field too, at its API default, as a raw call sends."""
    import inspect

    from app.core import knobs
    from app.serve import form, knob_widgets

    assert set(given) <= set(form.names()), f"not fields of the form: {set(given) - set(form.names())}"
    out = {}
    for name, default in form.fields():
        if name in given:
            out[name] = given[name]
        elif name in form.PAIR_FIELDS:
            assert name.startswith("custom_"), f"give the {name}"
            out[name] = ""
        elif default is inspect.Parameter.empty:
            start, widget = knob_widgets.start_value(knobs.by_name(name)), knob_widgets.WIDGETS[name]
            if widget.kind == "slider":
                start = min(max(start, widget.lo), widget.hi)
            out[name] = False if start is None else start
        elif complete:
            out[name] = default
    return out


@pytest.fixture(scope="module")
def records(target, near_draft, tokenizer):
    """Step records of one speculative run (a near draft, k = 4) and one plain run of ADD_PROMPT."""
    from app.drafts.model import ModelProposer

    _, spec = run(
        target, tokenizer, ADD_PROMPT, ModelProposer(near_draft, "near"), k=4, k_policy="fixed", max_new_tokens=40
    )
    _, ar = run(target, tokenizer, ADD_PROMPT, max_new_tokens=40)
    return spec, ar


def run(target, tokenizer, prompt, proposer=None, **kw):
    """Generated ids and the Step records of one engine run."""
    from app.core.config import RunConfig, SamplingConfig, SpecConfig
    from app.core.engine import generate
    from app.core.record import Recorder
    from app.kv.cache import DynamicRollbackCache

    sampling_keys = ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "no_repeat_ngram_size", "rule")
    sampling = SamplingConfig(**{k: kw.pop(k) for k in sampling_keys if k in kw})
    spec = SpecConfig(
        **{k: kw.pop(k) for k in ("k", "k_policy", "k_max", "ngram_max", "ngram_min", "tree", "tree_auto") if k in kw}
    )
    teach = kw.pop("teach", True)  # tests read the teaching table too
    display = kw.pop("display", True)
    policy = kw.pop("policy", None)
    cache = {"target_cache": kw.pop("target_cache", DynamicRollbackCache)}
    cfg = RunConfig(**kw)
    ids = prompt if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
    steps = list(
        generate(
            target,
            tokenizer,
            ids,
            proposer,
            sampling_cfg=sampling,
            spec=spec,
            run=cfg,
            recorder=Recorder(tokenizer, display=display, teach=teach),
            before_round=threads.match_load,  # the thread governor, as the request path passes it
            policy=policy,
            **cache,
        )
    )
    return [t for s in steps for t in s.emitted], steps


@pytest.fixture(scope="module")
def no_eos(target):
    """Random weights emit EOS at random; equality must hold over the full length."""
    saved = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = None
    yield
    target.generation_config.eos_token_id = saved


def hf_greedy_until_eos(model, tokenizer, prompt, n, **kw):
    """transformers' own greedy continuation, cut after the tokenizer's EOS as the engine stops there."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2, **kw)
    ref = out[0, ids.shape[1] :].tolist()
    return ref[: ref.index(1) + 1] if 1 in ref else ref


def pair_of(target, tokenizer, name: str, draft_model=None, draft_name: str = "near"):
    """A Pair built without the loader: a draft model sharing the target's tokenizer, or prompt
    lookup when draft_model is None."""
    from app.drafts import lookup, model
    from app.drafts.draft_spec import DraftSpec
    from app.models import Pair

    if draft_model is None:
        return Pair(target, tokenizer, name, lookup.KIND.load(DraftSpec(lookup.KIND), None))
    spec = DraftSpec(model.KIND, source=draft_name)
    return Pair(target, tokenizer, name, model.ModelDraft(model.KIND, spec, draft_name, model=draft_model))


def host_reads(
    target,
    tokenizer,
    prompt: str,
    proposer,
    target_cache,
    n: int,
    on_device: bool = True,
    sampling_cfg=None,
    tree: int = 0,
) -> tuple[list[int], list[tuple[list[int], list[str]]]]:
    """A bare engine run, greedy unless `sampling_cfg` says (fixed k = 4, a chain or a tree of `tree`
    nodes, nothing displayed or taught), and, for each round, its drafts and the reads of a device
    value to the host it made (each a wait for a GPU): .item(), a bool of a tensor or a data-dependent
    shape (ops a dispatch mode sees), and .tolist(), which on a CPU tensor reads without such an op.
    on_device=False: the drafts' picks are read as they are made (the path a run takes where the fast
    path is off), for comparison. Returns (ids, [(drafts, reads)])."""
    from unittest import mock

    from torch.utils._python_dispatch import TorchDispatchMode

    from app.core import engine
    from app.core.config import RunConfig, SamplingConfig, SpecConfig
    from app.core.record import Recorder

    reads: list[str] = []

    class HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero", "equal"):
                reads.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted(self):
        reads.append("tolist")
        return tolist(self)

    ids = tokenizer(prompt)["input_ids"]
    per_round, out = [], []
    with (
        mock.patch.object(engine._Loop, "takes_picks_on_device", return_value=False) if not on_device else nullcontext()
    ):
        steps = engine.generate(
            target,
            tokenizer,
            ids,
            proposer,
            target_cache=target_cache,
            sampling_cfg=sampling_cfg or SamplingConfig(),
            spec=SpecConfig(k=4, k_policy="fixed", tree=tree),
            run=RunConfig(n),
            recorder=Recorder(tokenizer, display=False, teach=False),
        )
        torch.Tensor.tolist = counted
        try:
            with HostReads():
                for step in steps:
                    per_round.append((list(step.drafted), list(reads)))
                    out += step.emitted
                    reads.clear()
        finally:
            torch.Tensor.tolist = tolist
    return out, per_round
