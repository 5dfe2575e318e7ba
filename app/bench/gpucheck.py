"""python -m app gpucheck: time the GPU fast path on random-weight models, offline, in minutes.

Builds models with the shapes of Qwen2.5-7B (target) and Qwen2.5-0.5B (draft) in bf16 with
random weights (no download), then times a plain step, verify over k+1 tokens and a draft
step, eager (dynamic cache) and compiled (static cache + CUDA graphs), and runs the engine
with the target as its own draft (alpha = 1) to measure what a round costs outside the
model's passes. Then, unless --no-equality, it runs the bundled family on the same device and
dtype through each cache kind and checks every greedy output against the target's own
generate(), and every shared-noise output against plain decoding with the same seed, with the
tokens/s of each. Prints one JSON report. `--shapes tiny` runs the same
on CPU in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
import warnings
from contextlib import contextmanager

import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from app import args as generation_args
from app import models, request
from app.bench import gpu_equality, progress
from app.bench.gpu_equality import _reported
from app.core import engine, knobs
from app.core.config import SHARED_NOISE, RunConfig, SamplingConfig, Settings, SpecConfig, UserError
from app.drafts import model as model_draft
from app.drafts.draft_spec import DraftSpec
from app.kv import cuda_graphs, static_cache
from app.kv.cache import DynamicRollbackCache, RollbackCache
from app.models import threads
from app.models.pair import Pair

SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, True),
    "smollm2-2-layers": (576, 1536, 2, 9, 3, 49152, True),
    "tiny-target": (64, 128, 4, 4, 2, 512, False),
    "tiny-draft": (32, 64, 2, 4, 2, 512, True),
}
PAIRS = {
    "qwen": ("qwen2.5-7b", "qwen2.5-0.5b"),
    "smollm2": ("smollm2-135m", "smollm2-2-layers"),  # the default target's shape (Qwen2 layers)
    "tiny": ("tiny-target", "tiny-draft"),
}


def build(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight Qwen2 causal LM with the named shape, built directly on the device."""
    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
        rope_theta=1e6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def id_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose every id decodes to a short word, so the engine can stream any id."""
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _median_ms(fn, n: int, device) -> float:
    """Median milliseconds of fn() over n calls, after two warm-up calls, device-synchronised."""
    times = []
    for i in range(n + 2):
        engine.sync(device)
        start = time.perf_counter()
        fn()
        engine.sync(device)
        if i >= 2:
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.inference_mode()
def step_times(model, context: list[int], ks: list[int], n: int, cache) -> dict:
    """Plain step and verify(k+1) times of `model` after `context`, with the given cache kind."""
    lm = cache(model)
    lm.extend(context, keep=1)
    base = lm.length

    def width(m: int):
        def go():
            lm.extend(context[:m], keep=m)
            lm.rollback(base)

        return go

    out = {"step_ms": _median_ms(width(1), n, lm.device)}
    out["verify_ms"] = {str(k): _median_ms(width(k + 1), n, lm.device) for k in ks}
    return out


class _OpCount(TorchDispatchMode):
    """Counts the operators a pass dispatches, views aside: about the kernels a GPU launches for it."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def ops_a_step(model, context: list[int], max_len: int) -> dict[str, int]:
    """Operators in one plain step as a CUDA graph captures it (the pass, with its mask built from the
    input buffer), with fused_pass's layers where they run the model and with transformers' own. A
    graph replays each as a kernel, and a small one costs a few microseconds however few bytes it
    moves, so this count, not the weights' size, sets a small model's step on a GPU."""
    out = {}
    for name, fused in (("fused", True), ("transformers", False)):
        lm = static_cache.StaticRollbackCache(model, max_len, graphs=True, fused=fused)
        try:
            if fused and lm.fused is None:
                continue
            lm.extend(context, keep=1)
            step = lm.width_pass(1, False)
            step.eager = True  # run as the graph would capture it, on any device
            with _OpCount() as count:
                step(cuda_graphs.chain(context[-1:], lm.length))
            out[name] = count.ops
        finally:
            lm.close()
    return out


def self_pair(target, tok) -> Pair:
    """The target drafting for itself with a full-depth model draft: a round's every pass is the target's,
    so its overhead is read off the target's own step and verify times."""
    spec = DraftSpec(model_draft.KIND, source="self")
    return Pair(target, tok, "gpucheck", model_draft.ModelDraft(model_draft.KIND, spec, "self", model=target))


@contextmanager
def pass_clock(device: torch.device):
    """Seconds spent inside KV-cache passes (every pass of a round: the draft's steps and the verify),
    device-synchronised, as a one-item list. The caches' entry points are wrapped for the run, outside
    any compiled or captured forward, so the clock times a graph's replay as it does an eager pass."""
    total, depth = [0.0], [0]

    def timed(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if depth[0]:  # a pass made of passes (step via extend) counts once
                return fn(*args, **kwargs)
            engine.sync(device)
            start = time.perf_counter()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                engine.sync(device)
                total[0] += time.perf_counter() - start

        return run

    owners = [RollbackCache, *_subclasses(RollbackCache)]
    names = ("extend", "extend_with_features", "step")
    saved = [(cls, name, cls.__dict__[name]) for cls in owners for name in names if name in cls.__dict__]
    for cls, name, fn in saved:
        setattr(cls, name, timed(fn))
    try:
        yield total
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def _subclasses(cls) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


def engine_run(pair: Pair, prompt: list[int], k: int, new_tokens: int, cache, speculative: bool = True) -> dict:
    """One run through the request path (greedy, fixed k) on one cache kind: tokens/s, alpha, a round's
    mean busy time split into the model's passes and the rest, and that rest's share of the busy time
    (read off the pass clock in the timed run itself, so it holds whichever passes the round chose)."""
    settings = Settings(SamplingConfig(), SpecConfig(k=k, k_policy="fixed"), RunConfig(new_tokens))
    run = request.start(pair, prompt, settings, speculative=speculative, calibrated=False, caches=cache)
    list(run.steps())  # the first run warms up (and captures graphs); the second is timed
    with pass_clock(pair.target.device) as inside:
        steps = list(run.steps())
    tokens = sum(len(s.emitted) for s in steps)
    accepted = sum(s.accepted for s in steps)
    rejections = sum(s.accepted < len(s.drafted) for s in steps)
    busy = steps[-1].elapsed
    return dict(
        tokens_per_s=tokens / busy,
        tokens_per_round=tokens / len(steps),
        alpha=accepted / (accepted + rejections) if accepted + rejections else None,
        round_ms=1000 * busy / len(steps),
        model_ms=1000 * inside[0] / len(steps),
        overhead_ms=1000 * (busy - inside[0]) / len(steps),
        overhead_share=(busy - inside[0]) / busy,
    )


RULES = {
    "greedy": SamplingConfig(),
    "shared_noise": SamplingConfig(temperature=0.8, seed=1, rule=SHARED_NOISE),
    "rejection": SamplingConfig(temperature=0.8, seed=1),
}


TREE_NODES = 8  # the greedy tree round_syncs counts beside the chains: 4 deep, 4 siblings


def round_syncs(pair: Pair, prompt: list[int], new_tokens: int, cache) -> dict:
    """Host syncs a round under each sampling rule, the target drafting for itself at k = 4 on a CUDA
    cache kind, and under greedy for a tree of TREE_NODES nodes: CUDA's sync debug mode warns at each
    (a read, a plain copy to the GPU, a stream wait). The fast path's promise is one a round, the
    verdict's; the prompt's first round adds its own. (A drawn tree reads its siblings as it draws them.)"""
    out = {}
    shapes = {name: (cfg, 0) for name, cfg in RULES.items()}
    shapes[f"greedy_tree_{TREE_NODES}"] = (RULES["greedy"], TREE_NODES)
    for name, (cfg, nodes) in shapes.items():
        settings = Settings(cfg, SpecConfig(k=4, k_policy="fixed", tree=nodes), RunConfig(new_tokens))
        run = request.start(pair, prompt, settings, speculative=True, calibrated=False, caches=cache)
        list(run.steps(display=False))  # the first run captures the graphs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                steps = list(run.steps(display=False))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        out[name] = dict(rounds=len(steps), syncs=syncs, per_round=syncs / len(steps))
    return out


def _kind_times(target, draft, tok, prompt, ks, n, new_tokens, cache) -> dict:
    """Step times and engine runs with one cache kind (KINDS)."""
    t0 = time.perf_counter()
    times = dict(
        target=step_times(target, prompt, ks, n, cache),
        draft_step_ms=step_times(draft, prompt, [], n, cache)["step_ms"],
    )
    pair = self_pair(target, tok)
    times["engine_autoregressive"] = engine_run(pair, prompt, 1, new_tokens, cache, speculative=False)
    times["engine_self_draft"] = {str(k): engine_run(pair, prompt, k, new_tokens, cache) for k in ks}
    times["seconds"] = time.perf_counter() - t0
    return times


def check(
    shapes: str,
    device: torch.device,
    dtype: torch.dtype,
    ks: list[int],
    n: int,
    context: int,
    new_tokens: int,
    compile_mode: str,
) -> dict:
    """The whole report: step times and engine runs for each cache kind (eager, static, compiled)."""
    start = time.perf_counter()
    target_shape, draft_shape = PAIRS[shapes]
    progress.say("gpucheck", f"building random-weight {target_shape} and {draft_shape} models on {device}")
    target, draft = build(target_shape, device, dtype, 0), build(draft_shape, device, dtype, 1)
    tok = id_tokenizer(target.config.vocab_size)
    prompt = torch.randint(0, draft.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    max_len = static_cache.cache_length(context, new_tokens + max(ks) + 2)
    compiled_on = compile_mode == "on" or (compile_mode == "auto" and device.type == "cuda")
    # The dynamic cache (--fast-path off), the static cache's plain passes, its CUDA graphs (on a CPU,
    # the graphs' buffers and in-pass mask run eagerly) and torch.compile's graphs.
    kinds = {
        "eager": DynamicRollbackCache,
        "static_eager": static_cache.StaticCachePool(max_len),
        "graphs": static_cache.StaticCachePool(max_len, graphs=True),
        "graphs_transformers": static_cache.StaticCachePool(max_len, graphs=True, fused=False),
    } | ({"compiled": static_cache.StaticCachePool(max_len, compile=True)} if compiled_on else {})
    report = dict(
        device=str(device),
        dtype=str(dtype),
        torch=torch.__version__,
        shapes=[target_shape, draft_shape],
        params=dict(target=target.num_parameters(), draft=draft.num_parameters()),
        context=context,
        ks=ks,
        compiled="timed" if compiled_on else "skipped: CUDA only (--compile on forces it)",
    )
    # Whether the target's rows on fixed-width passes are the same bits wherever they sit (the exact
    # choice on the fast path, runs.py), at the widths k = 4 and 8 need.
    report["rows_exact"] = {str(w): _reported(static_cache.rows_exact, target, w) for w in (8, 16)}
    models_built = {target_shape: target, draft_shape: draft}
    report["ops_a_step"] = {name: _reported(ops_a_step, lm, prompt, max_len) for name, lm in models_built.items()}
    if device.type == "cuda":  # the sync debug mode is CUDA's
        syncs = {  # a few rounds a rule is enough to count by
            name: _reported(round_syncs, self_pair(target, tok), prompt, min(new_tokens, 32), kinds[name])
            for name in ("eager", "graphs")
        }
        report["syncs_per_round"] = syncs
        print(f"gpucheck: host syncs a round {json.dumps(syncs)}", file=sys.stderr)
    for name, cache in kinds.items():
        progress.say("gpucheck", f"timing the {name} cache ({list(kinds).index(name) + 1}/{len(kinds)})")
        report[name] = _reported(_kind_times, target, draft, tok, prompt, ks, n, new_tokens, cache)
        if "error" not in report[name]:  # the JSON so far goes to stderr too: a run cut short keeps it
            print(
                f"gpucheck: {name} done in {report[name]['seconds']:.1f}s {json.dumps(report[name])}", file=sys.stderr
            )
    report["seconds"] = time.perf_counter() - start
    return report


def float_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The models' precision: --dtype where it names a float one, else bf16 on CUDA and fp32 elsewhere.
    Random weights have no int8 copy and give auto nothing to probe, so those are refused."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in models.loading.DTYPE_NAMES.values():
        raise UserError(f"gpucheck builds random-weight models in {_floats()}, got --dtype {name}")
    return models.choose_device(str(device), name)[1]


def _floats() -> str:
    return ", ".join(models.loading.DTYPE_NAMES.values())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m app gpucheck", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shapes",
        choices=list(PAIRS),
        default="qwen",
        help="qwen: 7B and 0.5B shapes; smollm2: the default target's shape; tiny: seconds on CPU",
    )
    ap.add_argument("--device", help="default: cuda if available, else cpu")
    # The declared precision setting (core/knobs.py), with the default and the choices random weights leave.
    precision = dataclasses.replace(knobs.by_name("dtype"), help=f"{_floats()} (default: bf16 on CUDA, fp32 on CPU)")
    generation_args.add_knob(ap, precision)
    ap.add_argument("--k", default="1,2,4,8", help="draft lengths to time, comma-separated")
    ap.add_argument("--steps", type=int, default=20, help="timed calls per measurement (median kept)")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per engine run")
    ap.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="time torch.compile's graphs too (auto: on CUDA)",
    )
    ap.add_argument("--threads", type=threads.cli_value, help="torch threads on CPU: N or auto (default: see README)")
    ap.add_argument("--no-timing", action="store_true", help="skip the random-weight timings")
    ap.add_argument("--no-equality", action="store_true", help="skip the bundled family's equality check")
    ap.add_argument("--equality-prompts", type=int, default=3, help="code examples per draft (each run twice)")
    ap.add_argument("--equality-tokens", type=int, default=96, help="new tokens per equality run")
    args = ap.parse_args(argv)
    threads.apply(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = float_dtype(args.dtype, device)
    ks = sorted({int(k) for k in args.k.split(",")})
    doc = (
        {}
        if args.no_timing
        else check(args.shapes, device, dtype, ks, args.steps, args.context, args.new_tokens, args.compile)
    )
    if not args.no_equality:
        compiled_on = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
        name = models.loading.DTYPE_NAMES[dtype]
        doc["equality"] = dict(
            dtype=name, **gpu_equality.equality(device, name, args.equality_prompts, args.equality_tokens, compiled_on)
        )
    json.dump(doc, sys.stdout, indent=1)
    print()
    return 0
