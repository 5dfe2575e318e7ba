"""The EAGLE-3 feature head: fused features from three of the target's layers, and a head of its own.

The target's states entering a low, a middle and a high layer (decoder_layers.fused_layers) are concatenated
to 3H and `fc` maps them to H: g_t. One decoder layer reads the token's embedding beside g (its
attention projections take 2H: cat(input_norm(embed(x_{t+1})), hidden_norm(g_t))), with g as the
residual, and returns h_{t+1}. A drafted step feeds h back as the next g, with no fc. q comes from the
head's own final norm and LM head over its draft vocabulary (EAGLE-3 trains both).

On disk it is vLLM's EAGLE-3 layout: `config.json` (a one-layer Llama config with
`eagle_aux_hidden_state_layer_ids`, `draft_vocab_size` and `target_hidden_size`) and
`model.safetensors` with `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` and `t2d`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, DynamicCache, PreTrainedModel

from app.core.config import UserError
from app.core.decoder_layers import fused_layers
from app.drafts.feature_head import HEAD_FIELDS, SUPPORTED, FeatureHead, through_head
from app.kv import growing_cache

ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's name for this layout
FUSED_KEYS = ("fc.weight", "midlayer.hidden_norm.weight")  # a safetensors file with these is an EAGLE-3 head


class FusedLayer(nn.Module):
    """A decoder layer whose attention reads cat(input_norm(embedding), hidden_norm(g)), (B, T, 2H),
    with g as its residual; called as the target's own layers are (decoder_layers.through_masked)."""

    def __init__(self, layer: nn.Module, hidden_norm: nn.Module, hidden: int):
        super().__init__()
        self.layer, self.hidden_norm, self.hidden = layer, hidden_norm, hidden

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        embeds, g = hidden_states.split(self.hidden, dim=-1)
        layer: Any = self.layer  # a decoder layer of the target's family
        x = torch.cat([layer.input_layernorm(embeds), self.hidden_norm(g)], dim=-1)
        attended, _ = layer.self_attn(hidden_states=x, **kwargs)
        h = g + attended
        return h + layer.mlp(layer.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """g = fc(f) for the target's (B, T, 3H) fused features (or g = h for the head's own (B, T, H)),
    then the fused layer over cat(embed(x_{t+1}), g): (B, T, H) h_{t+1}; readout(h) is what its LM head reads."""

    def __init__(self, target_config, vocab: torch.Tensor, head_config: dict | None = None):
        super().__init__()
        if target_config.model_type not in SUPPORTED:
            raise UserError(
                "a feature-level (EAGLE) head needs a Llama or Qwen2 target; "
                f"this target is {target_config.model_type!r}"
            )
        config = copy.deepcopy(target_config)
        for key in HEAD_FIELDS:
            if head_config and head_config.get(key) is not None:
                setattr(config, key, head_config[key])
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None):
            config.layer_types = ["full_attention"]
        if getattr(config, "use_sliding_window", False):
            config.use_sliding_window = False
        self.config = config
        hidden = config.hidden_size
        layers = (head_config or {}).get("eagle_aux_hidden_state_layer_ids")
        self.feature_layers = tuple(layers or fused_layers(target_config.num_hidden_layers))
        self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        self.body = AutoModel.from_config(config)
        self.body.embed_tokens = None
        attention = self.body.layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads the embedding and g side by side
            old = getattr(attention, name)
            setattr(attention, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        hidden_norm = type(self.body.norm)(hidden, eps=config.rms_norm_eps)
        self.body.layers[0] = FusedLayer(self.body.layers[0], hidden_norm, hidden)
        # The draft vocabulary (sorted target ids) and the head's own LM head over it.
        self.draft_vocab = vocab.long()
        self.lm_head = nn.Linear(hidden, len(vocab), bias=False)
        self.rows_linear: nn.Module | None = None  # the scores in int8 (exact_model.convert_head)

    def draft_rows(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, LM-head rows) of the draft vocabulary: the head's own LM head, not the target's."""
        return self.draft_vocab.to(self.lm_head.weight.device), self.lm_head.weight

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """What the head's LM head reads: its final norm of h."""
        return self.body.norm(h)

    score = FeatureHead.score  # the draft vocabulary's logits, in int8 where rows_linear is set

    def new_cache(self) -> DynamicCache:
        return growing_cache.new_cache(self.config)

    def fuse(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The fused layer's (B, T, 2H) input: the embeddings beside g (fc of the target's fused
        features, or the head's own h as they are)."""
        width = features.shape[-1]
        if width == self.fc.in_features:
            g = self.fc(features.to(token_embeds.dtype))
        elif width == token_embeds.shape[-1]:
            g = features
        else:
            raise ValueError(
                f"an EAGLE-3 head reads {self.fc.in_features}-wide fused features or its own h, not {width}"
            )
        return torch.cat([token_embeds, g.to(token_embeds.dtype)], dim=-1)

    def forward(
        self,
        token_embeds: torch.Tensor,
        features: torch.Tensor,
        cache: DynamicCache | None = None,
        mask: torch.Tensor | None = None,
        position: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """token_embeds: (B, T, H); features: (B, T, 3H) fused, or (B, T, H) the head's own h."""
        fused = self.fuse(token_embeds, features)
        # Whole windows (no cache) run on a fresh one: the model wrapper would apply the final norm,
        # which is readout's here.
        return through_head(
            self.config, self.body, fused, cache if cache is not None else DynamicCache(), mask, position
        )

    def save(self, out: Path, info: dict | None = None, dtype: torch.dtype = torch.float16) -> None:
        """vLLM's EAGLE-3 layout."""
        out.mkdir(parents=True, exist_ok=True)
        config = {k: getattr(self.config, k, None) for k in HEAD_FIELDS}
        config |= {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "vocab_size": self.config.vocab_size,
            "draft_vocab_size": len(self.draft_vocab),
            "target_hidden_size": self.config.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.feature_layers),
            "feature_head": "eagle-3",
        }
        tensors = {k: v.to(dtype) for k, v in _layout(self).items()}
        vocab = self.draft_vocab.cpu()
        tensors["d2t"] = (vocab - torch.arange(len(vocab))).long()  # target id = i + d2t[i]
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[vocab] = True
        tensors["t2d"] = t2d
        (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
        if info is not None:
            (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")


def _layout(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's tensors under vLLM's EAGLE-3 names."""
    state = head.state_dict()
    return {vllm: state[name].detach() for name, vllm in _names(head).items()}


def is_eagle3_dir(path: str | Path) -> bool:
    weights = Path(path) / "model.safetensors"
    if not weights.is_file():
        return False
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        return all(k in f.keys() for k in FUSED_KEYS)


def load_eagle3(path: str | Path, target: PreTrainedModel) -> Eagle3Head:
    """An EAGLE-3 head from vLLM's layout, checked against the target it must read."""
    path = Path(path)
    head_config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    tensors = load_file(str(path / "model.safetensors"))
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    tensors.pop("embed_tokens.weight", None)
    hidden = target.config.hidden_size
    layers = head_config.get("eagle_aux_hidden_state_layer_ids") or fused_layers(target.config.num_hidden_layers)
    if tensors["fc.weight"].shape != (hidden, len(layers) * hidden):
        raise UserError(
            f"EAGLE-3 head {path.name!r} fuses {tuple(tensors['fc.weight'].shape)}, but the target's fused features "
            f"are {len(layers)} x {hidden} wide: it was trained for another target"
        )
    if max(layers) >= target.config.num_hidden_layers:
        raise UserError(f"EAGLE-3 head {path.name!r} reads layer {max(layers)}, past the target's last")
    rows = tensors["lm_head.weight"].shape[0]
    vocab = (d2t.long() + torch.arange(rows)) if d2t is not None else torch.arange(rows)
    if int(vocab.max()) >= target.config.vocab_size or int(vocab.min()) < 0:
        raise UserError(f"EAGLE-3 head {path.name!r} drafts ids outside the target's vocabulary")
    head = Eagle3Head(target.config, vocab, head_config | {"eagle_aux_hidden_state_layer_ids": list(layers)})
    expected = _layout(head)
    missing = [k for k in expected if k not in tensors]
    unknown = [k for k in tensors if k not in expected]
    if missing or unknown:
        raise UserError(
            f"EAGLE-3 head {path.name!r} does not match vLLM's layout: missing {missing[:3]}, unexpected {unknown[:3]}"
        )
    names = {v: k for k, v in _names(head).items()}
    head.load_state_dict({names[k]: v for k, v in tensors.items()}, strict=False)
    weight = cast(torch.Tensor, target.get_input_embeddings().weight)
    return head.to(device=weight.device, dtype=weight.dtype).eval()


def _names(head: Eagle3Head) -> dict[str, str]:
    """The head's own state names -> vLLM's."""
    out = {}
    for name in head.state_dict():
        if "rotary_emb" in name:
            continue
        vllm = name.replace("body.layers.0.layer.", "midlayer.").replace("body.layers.0.", "midlayer.")
        out[name] = vllm.replace("body.", "")
    return out
