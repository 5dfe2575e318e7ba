"""The feature-level draft (EAGLE-1): a one-layer head that reads the target's own hidden states.

At position t the head takes the embedding of token x_{t+1} and the target's last-layer
feature f_t, fuses them (concat, then linear), runs one decoder layer at the target's width and
predicts f_{t+1}. The target's own LM head turns that feature into q. The target's features are
post-norm (what its LM head reads), as in EAGLE-1, so no extra norm sits between.

On disk a head is the EAGLE-1 layout: `config.json` (a one-layer Llama config, plus `bias` for
the fusion layer and `qkv_bias` for Qwen2 heads) and `model.safetensors` with `fc.*` and
`layers.0.*` tensors; `embed_tokens.weight` may be present and is ignored (the target's is used).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, DynamicCache, PreTrainedModel

from app.core.config import UserError
from app.core.decoder_layers import through_layers, through_masked
from app.kv import growing_cache

FUSION_KEYS = ("fc.weight",)  # a safetensors file with these is an EAGLE-style head
SUPPORTED = ("llama", "qwen2")  # target architectures whose decoder layer a head can reuse
HEAD_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_theta",
    "hidden_act",
    "max_position_embeddings",
    "head_dim",
)


class FeatureHead(nn.Module):
    """fc(cat(embed(x_{t+1}), f_t)) -> one decoder layer -> predicted f_{t+1}, (B, T, H)."""

    def __init__(self, target_config, head_config: dict | None = None, bias: bool = True):
        super().__init__()
        if target_config.model_type not in SUPPORTED:
            raise UserError(
                f"a feature-level (EAGLE) head needs a Llama or Qwen2 target; "
                f"this target is {target_config.model_type!r}"
            )
        config = copy.deepcopy(target_config)
        for key in HEAD_FIELDS:
            if head_config and head_config.get(key) is not None:
                setattr(config, key, head_config[key])
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):  # a full-attention layer, as in EAGLE, whatever the target's first
            config.layer_types = ["full_attention"]
        if getattr(config, "use_sliding_window", False):
            config.use_sliding_window = False
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        # The decoder stack of the target's own architecture, one layer deep. Its embedding table
        # is dropped (the target's is used), and so are layer 0's input norm and the final norm,
        # as in EAGLE-1: the fused input and the predicted feature live in the target's post-norm space.
        self.body = AutoModel.from_config(config)
        self.body.embed_tokens = None
        self.body.layers[0].input_layernorm = nn.Identity()
        self.body.norm = nn.Identity()
        # Target ids the head may draft (sorted), or None for the whole vocabulary. With a subset
        # q is 0 outside it (FR-Spec, EAGLE-3's reduced draft vocabulary); verification stays exact.
        self.draft_vocab: torch.Tensor | None = None
        self._draft_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # the draft vocabulary's scores as one layer where the target's precision gives one (models/exact.py)
        self.rows_linear: nn.Module | None = None

    def draft_rows(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, LM-head rows) of the draft vocabulary on the LM head's device, gathered once per head
        and shared by every request; None when the head drafts over the whole vocabulary."""
        if self.draft_vocab is None:
            return None
        weight = cast(torch.Tensor, lm_head.weight)  # nn.Module's attribute lookup types it Tensor | Module
        if self._draft_rows is None or self._draft_rows[0] is not weight:
            ids = self.draft_vocab.to(weight.device)
            self._draft_rows = (weight, ids, weight[ids].detach())
        return self._draft_rows[1:]

    def score(self, readout: torch.Tensor, w_sub: torch.Tensor) -> torch.Tensor:
        """(..., len(draft_vocab)) logits over the draft vocabulary from what the LM head reads."""
        if self.rows_linear is not None:
            return self.rows_linear(readout)
        return torch.nn.functional.linear(readout, w_sub)

    def new_cache(self) -> DynamicCache:
        return growing_cache.new_cache(self.config)  # drafted pairs are rolled back every round

    feature_layers: tuple[int, ...] = ()  # the target's last layer, normed: what its LM head reads

    def readout(self, feature: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the predicted feature itself (it lives in the target's post-norm space)."""
        return feature

    def fuse(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The decoder layer's (B, T, H) input: fc of the embeddings beside the features."""
        return self.fc(torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1))

    def forward(
        self,
        token_embeds: torch.Tensor,
        features: torch.Tensor,
        cache: DynamicCache | None = None,
        mask: torch.Tensor | None = None,
        position: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """token_embeds, features: (B, T, H) for pairs (x_{t+1}, f_t); returns (B, T, H) f_{t+1}.
        A tree's pairs come with their own mask and positions (decoder_layers.tree_pass)."""
        fused = self.fuse(token_embeds, features)
        if cache is None:  # training: whole windows, no cache
            return self.body(inputs_embeds=fused, use_cache=False).last_hidden_state
        return through_head(self.config, self.body, fused, cache, mask, position)

    # ---- the EAGLE-1 file layout -------------------------------------------------------------
    def state_for_disk(self) -> dict[str, torch.Tensor]:
        """Tensors named as EAGLE-1 names them: fc.*, layers.0.* (contiguous, for safetensors)."""
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith("body.rotary_emb"):
                continue
            out[name.removeprefix("body.")] = t.detach().contiguous()
        return out

    def save(self, out: Path, info: dict | None = None, dtype: torch.dtype = torch.float16) -> None:
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "bias": self.fc.bias is not None,
            "vocab_size": self.config.vocab_size,
            "feature_head": "eagle-1",
        }
        config |= {k: getattr(self.config, k, None) for k in HEAD_FIELDS}
        tensors = {k: v.to(dtype) for k, v in self.state_for_disk().items()}
        if self.draft_vocab is not None:  # EAGLE-3's convention: target id = i + d2t[i]
            tensors["d2t"] = (self.draft_vocab - torch.arange(len(self.draft_vocab))).long().contiguous()
            config["draft_vocab_size"] = len(self.draft_vocab)
        (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        if info is not None:
            (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")


def through_head(
    config, body, fused: torch.Tensor, cache: DynamicCache, mask: torch.Tensor | None, position: torch.Tensor | None
) -> torch.Tensor:
    """A head's fused pairs through its decoder layer itself, appending to `cache`, without its final
    norm. Skipping the model wrapper (its argument merging and output capture) is a large share of a
    head's drafting step on CPU. A tree's pairs come with their own mask and positions; a single new
    position attends to every cached one, so it needs no mask; several get transformers' own causal
    mask, as the wrapper builds it."""
    if mask is not None:
        return through_masked(config, body.layers, body.rotary_emb, fused, cache, mask, position)
    if fused.shape[1] == 1:
        return through_layers(body.layers, body.rotary_emb, fused, cache)
    return through_masked(config, body.layers, body.rotary_emb, fused, cache)


def is_head_dir(path: str | Path) -> bool:
    """Whether a local directory holds an EAGLE-style head rather than a full causal LM."""
    weights = Path(path) / "model.safetensors"
    if not weights.is_file():
        return False
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        keys = set(f.keys())
    return all(k in keys for k in FUSION_KEYS) and not any(k.startswith("model.") for k in keys)


def load_head(path: str | Path, target: PreTrainedModel) -> FeatureHead:
    """A head from an EAGLE-1 directory, checked against the target it must read."""
    path = Path(path)
    weights = path / "model.safetensors"
    if not weights.is_file():
        bins = [p.name for p in path.glob("*.bin")]
        hint = " (it has pickled .bin weights, which this app never loads: convert them to safetensors)" if bins else ""
        raise UserError(f"feature head {path.name!r} has no model.safetensors{hint}")
    head_config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    tensors = load_file(str(weights))
    tensors.pop("embed_tokens.weight", None)
    d2t = tensors.pop("d2t", None)
    hidden = target.config.hidden_size
    if tensors["fc.weight"].shape != (hidden, 2 * hidden):
        raise UserError(
            f"feature head {path.name!r} fuses width {tensors['fc.weight'].shape[0]}, "
            f"but the target's features have width {hidden}: it was trained for another target"
        )
    target_config = target.config
    if head_config.get("qkv_bias") and target_config.model_type == "llama":
        target_config = copy.deepcopy(target_config)
        target_config.attention_bias = True  # a Llama head with q/k/v biases (rare); o_proj bias stays zero
    head = FeatureHead(target_config, head_config, bias="fc.bias" in tensors)
    expected = head.state_for_disk()
    missing = [k for k in expected if k not in tensors and not k.endswith("o_proj.bias")]
    unknown = [k for k in tensors if k not in expected]
    if missing or unknown:
        raise UserError(
            f"feature head {path.name!r} does not match the EAGLE-1 layout for a "
            f"{target.config.model_type} target: missing {missing[:3]}, unexpected {unknown[:3]}"
        )
    state = {("body." + k if not k.startswith("fc.") else k): v for k, v in tensors.items()}
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("o_proj.bias") and name not in state:
                param.zero_()
    head.load_state_dict(state, strict=False)
    if d2t is not None:
        vocab = d2t.long() + torch.arange(len(d2t))
        if len(vocab) == 0 or int(vocab.max()) >= target.config.vocab_size or int(vocab.min()) < 0:
            raise UserError(f"feature head {path.name!r} drafts ids outside the target's vocabulary")
        head.draft_vocab = vocab
    device = cast(torch.Tensor, target.get_input_embeddings().weight).device
    return head.to(device=device, dtype=cast(torch.Tensor, target.get_input_embeddings().weight).dtype).eval()
