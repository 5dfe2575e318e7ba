"""Loading a target/draft pair: device and dtype choice, compatibility checks, presets.

The only module that knows about accelerate's device_map. Models are cached and
shared read-only between requests; everything per request lives in the engine.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from app import text
from app.config import SpecConfig, SpecError
from app.proposers import ModelProposer, PromptLookup, Proposer, early_exit

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "assets" / "models"
DEFAULT_TARGET = str(BUNDLED / "target")
DEFAULT_DRAFT = str(BUNDLED / "draft-distilled")
PROMPT_LOOKUP = "prompt-lookup"
EARLY_EXIT = "early-exit:"

# Label -> id. Hub pairs share a tokenizer within each family.
TARGET_PRESETS = {
    "stdlib-code target (bundled)": DEFAULT_TARGET,
    "Qwen2.5-1.5B-Instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B-Instruct": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct",
    "SmolLM2-1.7B-Instruct": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
DRAFT_PRESETS = {
    "distilled draft (bundled)": DEFAULT_DRAFT,
    "small draft (bundled)": str(BUNDLED / "draft-small"),
    "weak draft (bundled)": str(BUNDLED / "draft-weak"),
    "Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "SmolLM2-360M-Instruct": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "distilgpt2": "distilbert/distilgpt2",
    "gpt2": "openai-community/gpt2",
    "prompt lookup (n-grams)": PROMPT_LOOKUP,
    "early exit after 2 layers": EARLY_EXIT + "2",
    "early exit after 4 layers": EARLY_EXIT + "4",
}


def choose_device(device: str | None = None, dtype: str | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA with bf16 (fp16 without bf16 support), then MPS fp16, then CPU fp32; overridable."""
    if device:
        dev = torch.device(device)
    elif torch.cuda.is_available():
        dev = torch.device("cuda", 0)
    elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        dev = torch.device("mps")
    else:
        dev = torch.device("cpu")
    if dtype:
        try:
            return dev, getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype))
        except AttributeError:
            raise SpecError(f"unknown dtype {dtype!r}: use fp32, fp16 or bf16") from None
    if dev.type == "cuda":
        return dev, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return dev, torch.float16 if dev.type == "mps" else torch.float32


def _resolve(model_id: str) -> str:
    model_id = (model_id or "").strip()
    model_id = TARGET_PRESETS.get(model_id) or DRAFT_PRESETS.get(model_id) or model_id
    path = Path(model_id).expanduser()
    return str(path.resolve()) if model_id and path.exists() else model_id


def allowlist() -> set[str] | None:
    """Ids a public server may load, from SPECDEC_ALLOWED_MODELS: a comma list, or 'presets'."""
    raw = os.environ.get("SPECDEC_ALLOWED_MODELS", "").strip()
    if not raw:
        return None
    if raw == "presets":
        return {_resolve(x) for x in (*TARGET_PRESETS.values(), *DRAFT_PRESETS.values())}
    return {_resolve(x) for x in raw.split(",") if x.strip()}


def resolve(model_id: str) -> str:
    """A preset label, a local directory or a Hub id, as the string from_pretrained gets."""
    name = _resolve(model_id)
    if not name:
        raise SpecError("no model given: pick a preset, a Hub id or a local directory")
    allowed = allowlist()
    if allowed is not None and name not in allowed and name != PROMPT_LOOKUP and not name.startswith(EARLY_EXIT):
        raise SpecError(f"{name!r} is not on this server's model allowlist: pick one of the presets")
    return name


_cache: dict[tuple, tuple[PreTrainedModel, object]] = {}
_lock = threading.Lock()
MAX_CACHED = 4  # models kept loaded at once; the oldest is dropped first


def load(model_id: str, device: str | None = None, dtype: str | None = None, spread: bool = False):
    """(model, tokenizer) for a Hub id or local dir, loaded once and shared read-only.

    spread=True places a CUDA model over all visible GPUs with device_map="auto".
    """
    name = resolve(model_id)
    dev, torch_dtype = choose_device(device, dtype)
    key = (name, str(dev), torch_dtype, spread)
    with _lock:
        if key in _cache:
            return _cache[key]
        multi = spread and dev.type == "cuda" and torch.cuda.device_count() > 1
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=torch_dtype, trust_remote_code=False, use_safetensors=True,
                device_map="auto" if multi else {"": str(dev)},
            )
        except (OSError, ValueError, KeyError) as e:
            raise SpecError(
                f"could not load {name!r} as a causal LM with safetensors weights: {_first_line(e)}. "
                "Give a local directory or a Hub id (network access needed for Hub ids)."
            ) from None
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise SpecError(f"out of memory loading {name!r}: pick a smaller model") from None
        model.eval()
        if len(_cache) >= MAX_CACHED:
            _cache.pop(next(iter(_cache)))
        _cache[key] = (model, tokenizer)
        return model, tokenizer


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def check_compatible(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Refuse a draft whose vocabulary differs from the target's.

    Identical vocabularies pass even when the embedding matrices differ in padded rows;
    so does one that only adds a few special tokens at the end.
    """
    vt, vd = target_tok.get_vocab(), draft_tok.get_vocab()
    if vt == vd:
        return
    small, large = (vt, vd) if len(vt) <= len(vd) else (vd, vt)
    shared = all(large.get(tok) == i for tok, i in small.items())
    extra = set(large) - set(small)
    if shared and len(extra) <= 8 and all(large[t] >= len(small) for t in extra):
        return
    raise SpecError(
        f"draft {draft_name!r} has a different vocabulary ({len(vd)} tokens, "
        f"{type(draft_tok).__name__}) from target {target_name!r} ({len(vt)} tokens, "
        f"{type(target_tok).__name__}): pick a draft from the target's model family"
    )


def context_length(*models: PreTrainedModel) -> int:
    """Tokens the smallest model can attend to (a large default when a config is silent)."""
    return min(getattr(m.config, "max_position_embeddings", None) or 1 << 20 for m in models)


@dataclass
class Pair:
    target: PreTrainedModel
    tokenizer: object
    target_name: str
    draft_name: str
    draft_model: PreTrainedModel | None  # None for prompt lookup and early exit

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """The prompt's ids (through the chat template when asked), checked against the context."""
        return text.prompt_ids(self.tokenizer, prompt, chat, context_length(self.target))

    def proposer(self, spec: SpecConfig = SpecConfig()) -> Proposer:
        """A fresh proposer for one request (its cache and ids are that request's own)."""
        if self.draft_name == PROMPT_LOOKUP:
            return PromptLookup(spec.ngram_max, spec.ngram_min)
        if self.draft_name.startswith(EARLY_EXIT):
            return early_exit(self.target, int(self.draft_name[len(EARLY_EXIT):]))
        return ModelProposer(self.draft_model, self.draft_name)


def load_pair(target_id: str | None = None, draft_id: str | None = None,
              device: str | None = None, dtype: str | None = None, draft: bool = True) -> Pair:
    """Target plus a draft source: a model, 'prompt-lookup' or 'early-exit:N'.

    The target may spread over several GPUs; the draft sits on the target's first device.
    draft=False loads the target alone, for plain autoregressive decoding.
    """
    target, tokenizer = load(target_id or DEFAULT_TARGET, device, dtype, spread=True)
    target_name = resolve(target_id or DEFAULT_TARGET)
    if not draft:
        return Pair(target, tokenizer, target_name, "", None)
    draft_name = resolve(draft_id or DEFAULT_DRAFT)
    if draft_name == PROMPT_LOOKUP:
        return Pair(target, tokenizer, target_name, draft_name, None)
    if draft_name.startswith(EARLY_EXIT):
        try:
            n = int(draft_name[len(EARLY_EXIT):])
        except ValueError:
            raise SpecError(f"early exit needs a layer count, like early-exit:2; got {draft_name!r}") from None
        early_exit(target, n)  # validates n against the target's depth
        return Pair(target, tokenizer, target_name, f"{EARLY_EXIT}{n}", None)
    first = target.get_input_embeddings().weight.device
    draft, draft_tok = load(draft_name, str(first), dtype)
    check_compatible(tokenizer, draft_tok, target_name, draft_name)
    return Pair(target, tokenizer, target_name, draft_name, draft)
