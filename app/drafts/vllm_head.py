"""A feature head written the way vLLM's `eagle` method reads an EAGLE-1 draft.

vLLM's EAGLE-1 model for Llama targets is fc(cat(embed(x), f)) with no bias, then decoder layers
whose first has no input norm, and no final norm; it shares the target's embeddings and LM head
and reads `fc.weight` and `layers.N.*` from the checkpoint. This app's heads are the same network
(feature_head.py) with two extras vLLM has no place for: a fusion bias and a reduced draft
vocabulary. Both are left out of the written copy, and the notes say so: vLLM stays lossless with
it, and drafts with the head as it would run here with its bias at zero over the whole vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.core.config import UserError
from app.drafts.feature_head import HEAD_FIELDS, is_head_dir

DTYPE = torch.float16  # what EAGLE checkpoints ship in


def write(head_dir: str | Path, target_config, out: str | Path) -> list[str]:
    """Write the head in `head_dir` into `out` (config.json, model.safetensors); return what changed."""
    head_dir, out = Path(head_dir), Path(out)
    if not is_head_dir(head_dir):
        raise UserError(f"{head_dir.name!r} is not a feature head directory (fc.* and layers.0.* tensors)")
    config = json.loads((head_dir / "config.json").read_text())
    if target_config.model_type != "llama" or config.get("qkv_bias"):
        raise UserError(
            f"vLLM's EAGLE-1 model reads Llama-layout heads; this head is for a {target_config.model_type} target"
        )
    tensors = load_file(str(head_dir / "model.safetensors"))
    tensors.pop("embed_tokens.weight", None)  # vLLM shares the target's
    notes = []
    if "fc.bias" in tensors:
        bias = tensors.pop("fc.bias")
        notes.append(
            f"vLLM's EAGLE-1 fusion layer has no bias, so the head's (norm {float(bias.float().norm()):.3g}) "
            "is left out: vLLM drafts with the head as it would run here with that bias at zero"
        )
    if "d2t" in tensors:
        size = len(tensors.pop("d2t"))
        notes.append(
            f"vLLM's EAGLE-1 model drafts over the target's whole vocabulary with its LM head, so the head's "
            f"{size}-token draft vocabulary is left out (drafts are cheaper here, not different in kind)"
        )
    written = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "bias": False,
        "vocab_size": target_config.vocab_size,
        "torch_dtype": "float16",
    }
    written |= {k: config.get(k) if config.get(k) is not None else getattr(target_config, k, None) for k in HEAD_FIELDS}
    written["rope_theta"] = _rope_theta(target_config)  # a head's own config may hold null there
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(DTYPE).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(written, indent=1) + "\n")
    return notes


def _rope_theta(config) -> float | None:
    """The target's RoPE base, which transformers 5 keeps in rope_parameters and vLLM reads as rope_theta."""
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))
