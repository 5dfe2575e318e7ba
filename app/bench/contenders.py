"""What the benchmarks time: our engine (through the one request path) and transformers' generate, as
contenders with one signature: (prompt ids, new tokens) -> (ids, seconds, Steps or None)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from app import category_runner
from app.core import engine
from app.core.config import RunConfig, SamplingConfig, Settings, SpecConfig, k_cap
from app.core.costs import Costs
from app.models import threads

SWEEP = range(1, 9)  # fixed k values timed beside adaptive
TREE = "tree"  # the contender that drafts a tree (--tree N), beside the chain at the same fixed k
TREE_AUTO = "tree_auto"  # each round shaped by the cost model (--tree auto), beside adaptive k's chain
# transformers' assisted generation held to exactly k drafts a round: by default it also stops
# drafting early when the assistant's confidence drops below a threshold it tunes as it goes.
CONSTANT = dict(num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0)


@dataclass
class Contender:
    name: str  # short key in the JSON
    label: str  # what it is, for the report
    run: Callable[[list[int], int], tuple[list[int], float, list | None]]  # (prompt ids, n) -> ids, s, Steps
    ours: bool = True


def ours(pair, s: SamplingConfig, sp: SpecConfig, r: RunConfig, speculative: bool, costs: Costs | None):
    """Our engine as a contender; the wall clock covers everything from prompt ids to the last token."""
    return category_runner.timed(pair, Settings(s, sp, r), speculative, costs)


def hf(target, assistant=None, assistant_settings: dict | None = None, lookup: dict | None = None):
    """transformers' greedy generate: plain, assisted (settings on the assistant's generation
    config, where transformers reads them, restored afterwards) or prompt lookup."""

    def run(ids: list[int], n: int):
        x = torch.tensor([ids], device=target.get_input_embeddings().weight.device)
        kw = dict(
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=target.generation_config.pad_token_id,
            stopping_criteria=StoppingCriteriaList([_FollowThreads()]),
        )
        saved = {}
        if assistant is not None:
            cfg = assistant.generation_config
            saved = {key: getattr(cfg, key, None) for key in assistant_settings or {}}
            for key, value in (assistant_settings or {}).items():
                setattr(cfg, key, value)
            kw["assistant_model"] = assistant
        kw |= lookup or {}
        threads.match_load()  # its prefill too runs at the threads of now; _FollowThreads covers its rounds
        try:
            with torch.inference_mode():
                engine.sync(target.device)
                start = time.perf_counter()
                out = target.generate(x, **kw)
                engine.sync(target.device)
                seconds = time.perf_counter() - start
        finally:
            for key, value in saved.items():
                setattr(assistant.generation_config, key, value)
        return out[0, len(ids) :].tolist(), seconds, None

    return run


class _FollowThreads(StoppingCriteria):
    """Never stops generate(); it gives transformers' rounds the same auto threads as ours (engine.py)."""

    def __call__(self, input_ids, scores, **kwargs):
        threads.match_load()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def adaptive_k(sp: SpecConfig) -> SpecConfig:
    return SpecConfig(
        k=sp.k, k_policy="adaptive", k_max=max(sp.k_max, max(SWEEP)), ngram_max=sp.ngram_max, ngram_min=sp.ngram_min
    )


def fixed_k(sp: SpecConfig, k: int) -> SpecConfig:
    cap = k_cap("fixed", k, sp.k_max)
    return SpecConfig(k=k, k_policy="fixed", k_max=cap, ngram_max=sp.ngram_max, ngram_min=sp.ngram_min)


LLAMA_CPP = "llama_cpp"  # llama.cpp's plain decoding of the wheel's GGUF, where llama-cpp-python imports


def llama_cpp(target_name: str, eos: int | None) -> tuple[Contender | None, str]:
    """(llama.cpp's greedy decoding of the same GGUF at our thread count, '') where the target is the
    wheel's SmolLM2 and `llama_cpp` imports; else (None, why it is skipped)."""
    from app.models import gguf_target

    path = gguf_target.gguf_path()
    if path is None or target_name != str(gguf_target.converted_dir()):
        return None, "llama.cpp: skipped, the target is not the wheel's GGUF"
    try:
        import llama_cpp as lc  # optional: pip install llama-cpp-python (it builds llama.cpp)
    except ImportError:
        return None, "llama.cpp: skipped, llama_cpp does not import here (pip install llama-cpp-python)"
    # the most threads ours may use: under auto threads, torch's count of the moment may be one
    count = threads.ceiling() if threads.key() == threads.AUTO else torch.get_num_threads()
    llm = lc.Llama(model_path=str(path), n_ctx=4096, n_threads=count, n_threads_batch=count, verbose=False)

    def run(ids: list[int], n: int):
        start = time.perf_counter()
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if token == eos or len(out) >= n:
                break
            out.append(int(token))
        return out, time.perf_counter() - start, None

    label = f"llama.cpp: plain decoding of the same GGUF (Q4_1), {count} threads"
    return Contender(LLAMA_CPP, label, run, ours=False), ""
