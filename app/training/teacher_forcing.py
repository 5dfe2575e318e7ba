"""Teacher-forced training data for a feature head: text already on the machine, run through the target.

Rows of text (the standard library's source, the installed packages' source and their descriptions)
pass through the frozen target in batched forward passes, and every position yields the fused features
a head reads (the states entering EAGLE-3's layers, decoder_layers.fused_layers) and the target's top-k
next-token distribution, the head's soft label. Beside them, the target's own chat answers
(target_text.build_rows, the rows the EAGLE-1 head trains on) are run through it once more for their
fused features: the text a head drafts in the app. Shards are written one at a time, so a stopped build
resumes at the next shard. The manifest records each source, its version and licence; no text is kept,
only ids of rows, and none of it is committed.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from app.core.config import UserError
from app.core.decoder_layers import entering, fused_layers
from app.data.corpus import HELD_OUT, HELD_OUT_PACKAGES, keep_package_file, package_closure, stdlib_files
from app.training.steps import write_whole
from app.training.target_text import TOP_K, lm_head_fp32, top_k_of

ROW = 256  # tokens a row: the attention a head learns spans the contexts it drafts in
BATCH = 4  # rows a forward pass
SHARD_ROWS = 256  # rows a shard file (65k tokens)
PYTHON_LICENCE = "PSF-2.0"


def licence(dist) -> str:
    """A distribution's licence as its metadata states it (SPDX expression, licence field, or classifier)."""
    meta = dist.metadata
    expression = meta.get("License-Expression")
    if expression:
        return expression
    field = (meta.get("License") or "").strip()
    if field and len(field) < 80:
        return field
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    return "; ".join(classifiers) or "unstated"


def documents() -> list[tuple[str, dict, Path | str]]:
    """(source name, its record, a file or the text itself) of every document: the standard library's
    modules, and each installed package's modules and its description, held-out files excluded."""
    version = sysconfig.get_python_version()
    stdlib = dict(version=version, licence=PYTHON_LICENCE)
    found: list[tuple[str, dict, Path | str]] = [
        ("python-stdlib", stdlib, path) for path in stdlib_files() if path.name not in HELD_OUT
    ]
    held = {path for _, path in HELD_OUT_PACKAGES}
    for dist in package_closure():
        name = dist.metadata["Name"]
        record = dict(version=dist.version, licence=licence(dist))
        description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""  # type: ignore[attr-defined]
        if len(description) > 500:
            found.append((name, record, description))
        found += [
            (name, record, Path(dist.locate_file(rel)))
            for rel in sorted(f for f in dist.files or [] if f.suffix == ".py")
            if Path(rel).as_posix() not in held
        ]
    return found


def _text(doc: Path | str) -> str | None:
    if isinstance(doc, str):
        return doc
    try:
        text = doc.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    is_package = "site-packages" in doc.parts or "dist-packages" in doc.parts
    return text if not is_package or keep_package_file(Path(doc.name), text) else None


def rows(tokenizer, limit: int, seed: int) -> tuple[torch.Tensor, dict]:
    """(n, ROW) ids of documents drawn in a seeded order and packed, about `limit` tokens in all, and
    the manifest: each source's record with its documents and tokens. Duplicates are read once. A
    `limit` of 0 reads no text: the chats alone."""
    if limit <= 0:
        return torch.zeros(0, ROW, dtype=torch.int32), dict(sources={}, documents=0, row=ROW)
    limit = max(limit, ROW)  # at least one whole row
    docs = documents()
    random.Random(seed).shuffle(docs)  # sources mix within every shard
    seen: set[str] = set()
    per_source: dict[str, dict] = {}
    stream: list[int] = []
    eos = tokenizer.eos_token_id
    for name, record, doc in docs:
        text = _text(doc)
        digest = hashlib.sha256(text.encode()).hexdigest() if text else ""
        if not text or digest in seen:
            continue
        seen.add(digest)
        ids = tokenizer(text)["input_ids"] + ([eos] if eos is not None else [])
        entry = per_source.setdefault(name, record | dict(documents=0, tokens=0))
        entry["documents"] += 1
        entry["tokens"] += len(ids)
        stream += ids
        if len(stream) >= limit:
            break
    n = max(1, min(len(stream), limit) // ROW)
    packed = torch.tensor(stream[: n * ROW], dtype=torch.int32).view(n, ROW)
    return packed, dict(sources=dict(sorted(per_source.items())), documents=len(seen), row=ROW)


@torch.inference_mode()
def label(target, ids: torch.Tensor, layers: tuple[int, ...], head: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the target computes on (B, T) ids: fused features (B, T, len(layers) H) fp16, its last-layer
    features (B, T, H) fp16, and its top-k next tokens (B, T, TOP_K), renormalised log-probs."""
    out = target.model(input_ids=ids.long(), output_hidden_states=True)
    fused = entering(out.hidden_states, layers)
    last = out.hidden_states[-1]
    b, t, h = last.shape
    top_ids, top_logp = top_k_of(head, last.reshape(b * t, h))
    return dict(
        ids=ids.int(),
        fused=fused.half(),
        features=last.half(),
        top_ids=top_ids.view(b, t, TOP_K),
        top_logp=top_logp.view(b, t, TOP_K),
    )


def packed_chats(chats: list[torch.Tensor], seed: int) -> torch.Tensor:
    """(n, ROW) ids of the chats (prompt and answer each) in a seeded order, packed end to end."""
    order = list(range(len(chats)))
    random.Random(seed).shuffle(order)
    stream = [t for i in order for t in chats[i].tolist()]
    n = max(1, len(stream) // ROW)
    stream += [stream[-1]] * (n * ROW - len(stream))  # a stream shorter than a row fills one
    return torch.tensor(stream[: n * ROW], dtype=torch.int32).view(n, ROW)


def _write(target, packed: torch.Tensor, out: Path, prefix: str, log) -> None:
    """Label `packed` a shard at a time into out/PREFIX-NNNN.safetensors, skipping finished shards."""
    layers = fused_layers(target.config.num_hidden_layers)
    head, start = lm_head_fp32(target), time.time()
    for s, first in enumerate(range(0, len(packed), SHARD_ROWS)):
        path = out / f"{prefix}-{s:04d}.safetensors"
        if path.is_file():
            continue
        block = packed[first : first + SHARD_ROWS]
        parts = [label(target, block[i : i + BATCH], layers, head) for i in range(0, len(block), BATCH)]
        tensors = {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}
        write_whole(path, lambda tmp, tensors=tensors: save_file(tensors, str(tmp)))
        done = first + len(block)
        log({f"{prefix}_rows": done, "of": len(packed), "seconds": round(time.time() - start, 1)})


def build(target, tokenizer, out: Path, tokens: int, seed: int, log=print, chats=(), about: dict | None = None) -> dict:
    """Shards of teacher-forced rows in out/: `tokens` of text, and the target's own `chats` (ids of
    prompt and answer each) as chat shards, `about` them in the manifest. Existing shards are kept (a
    resume). Returns the manifest, also written to out/manifest.json."""
    out.mkdir(parents=True, exist_ok=True)
    packed, manifest = rows(tokenizer, tokens, seed)
    talk = packed_chats(list(chats), seed) if chats else None
    layers = fused_layers(target.config.num_hidden_layers)
    manifest |= dict(layers=list(layers), top_k=TOP_K, rows=len(packed), tokens=packed.numel(), seed=seed)
    manifest["chat"] = (
        dict(chats=len(chats), rows=len(talk), tokens=talk.numel()) | (about or {}) if talk is not None else None
    )
    _check_resume(out / "manifest.json", manifest)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if talk is not None:  # first: the smaller part, and the one nearest the app's text
        _write(target, talk, out, "chat", log)
    _write(target, packed, out, "text", log)
    return manifest


def _plan(manifest: dict) -> dict:
    """What decides a build's shards: a resumed build keeps those already written only if it is the same."""
    chat = manifest.get("chat") or {}
    return {k: manifest.get(k) for k in ("layers", "top_k", "rows", "tokens", "seed")} | dict(
        chat_rows=chat.get("rows"), chat_tokens=chat.get("tokens")
    )


def _check_resume(path: Path, manifest: dict) -> None:
    """Refuse to add to a build planned otherwise: its finished shards would be trained on beside the new."""
    if not path.is_file():
        return
    old, new = _plan(json.loads(path.read_text())), _plan(manifest)
    if old != new:
        differ = ", ".join(f"{k} {old[k]} -> {new[k]}" for k in new if old[k] != new[k])
        raise UserError(
            f"{path.parent} holds teacher data planned otherwise ({differ}): remove that folder, or give "
            "another --work, to build it anew"
        )


def shards(folder: Path, prefix: str = "*") -> list[Path]:
    """The finished shard files of a build (chat shards, then text), or those of one `prefix`, in order."""
    return sorted(folder.glob(f"{prefix}-[0-9]*.safetensors"))


def built(folder: Path) -> dict[str, int]:
    """The positions the finished shards hold, by kind (chat, text): what a stopped build got to."""
    out: dict[str, int] = {}
    for path in shards(folder):
        with safe_open(str(path), "pt") as f:
            rows, width = f.get_slice("ids").get_shape()
        kind = path.name.split("-")[0]
        out[kind] = out.get(kind, 0) + rows * width
    return out


def read(path: Path) -> dict[str, torch.Tensor]:
    """One shard's tensors (ids, fused, features, top_ids, top_logp), each with rows first."""
    return load_file(str(path))
