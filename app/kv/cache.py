"""A causal LM plus its KV cache: extend by tokens, roll back to a length."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import cast

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DummyLayer, DynamicLayer

from app.core import decoder_layers, transfer, tree_shape
from app.core.config import UserError
from app.kv import direct_pass, growing_cache

# Before 5.24 a model's forward took past_key_values and silently ignored cache=, so every pass
# would run without its context: refuse to start rather than decode garbage.
if Version(transformers.__version__) < Version("5.24"):
    raise ImportError(
        f"transformers {transformers.__version__} is installed; this app needs >= 5.24 "
        "(pip install -r requirements.txt)"
    )

# Layer caches whose crop is exact (DynamicSlidingWindowLayer is a DynamicLayer); DummyLayer holds nothing.
CROPPABLE = (DynamicLayer, DummyLayer)


class RollbackCache(abc.ABC):
    """What every KV cache of a model shares: the embedding guard, the counters, and close().

    `length` is how many tokens the cache holds; `tokens_processed` counts every token
    fed through the model, so tests can prove that rollback never re-prefills.
    """

    device_steps = False  # whether step() takes a token still on the device (a draft's pick, never read)

    def __init__(self, model: PreTrainedModel, feature_layers: tuple[int, ...] = ()):
        self.model = model
        # The features a pass returns: () for the last layer's normed states (EAGLE-1), else the
        # states entering these decoder layers, concatenated (EAGLE-3's fused features).
        self.feature_layers = feature_layers
        self.length = 0
        self.tokens_processed = 0
        # (nn.Module's attribute lookup types a weight as Tensor | Module.)
        self.device = cast(torch.Tensor, model.get_input_embeddings().weight).device
        # A draft with a smaller embedding table than the target's vocabulary cannot embed the
        # target's top ids: it sees a stand-in instead (its guesses get worse, the output stays exact).
        self.rows = cast(torch.Tensor, model.get_input_embeddings().weight).shape[0]
        self.stand_in = _stand_in(model.config, self.rows)

    def _embeddable(self, ids: list[int]) -> list[int]:
        return ids if max(ids, default=0) < self.rows else [i if i < self.rows else self.stand_in for i in ids]

    def _features(self, out, features: bool) -> torch.Tensor | None:
        """The (T, H) or fused (T, len(layers) H) features of a wrapper pass's output, if asked for."""
        return decoder_layers.entering(out.hidden_states, self.feature_layers)[0] if features else None

    def close(self) -> None:  # noqa: B027 (a pooled cache overrides it; nothing to give back here)
        """Nothing is pooled here; a static cache goes back to its pool."""

    def tree_rows(self, m: int, parents: Sequence[int], pad: int = 0) -> tuple[list[int], list[int], list[list[int]]]:
        """Each row's position, prefix and own slots in a tree pass that feeds m committed ids then n
        nodes (then `pad` padding rows) after the cached ones: row r sees slots [0, prefix[r]) and the
        slots in sees[r]. Node i sits at the position of its depth and sees the committed text and its
        own ancestors only; a padding row sees the committed text and itself (its outputs are thrown away)."""
        cached, n = self.length, len(parents)
        base = cached + m  # node i's slot is base + i
        sees: list[list[int]] = [[] for _ in range(m)]
        prefix = [cached + r + 1 for r in range(m)]
        for i, parent in enumerate(parents):
            sees.append((sees[m + parent] if parent >= 0 else []) + [base + i])
            prefix.append(base)
        sees += [[base + n + j] for j in range(pad)]
        prefix += [base] * pad
        ahead = [base - 1 + d for d in tree_shape.depths(parents)] + [base] * pad
        return list(range(cached, base)) + ahead, prefix, sees

    def tree_layout(self, m: int, parents: Sequence[int], kv: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The (1, m + n + pad) positions and the (1, 1, m + n + pad, kv) mask of a tree pass (tree_rows)."""
        position, prefix, sees = self.tree_rows(m, parents, pad)
        mask = decoder_layers.tree_pass(sees, prefix, kv, self.model.config, self.device)
        return transfer.queued(torch.tensor([position]), self.device), mask

    def move_path(self, layers, base: int, path: Sequence[int]) -> None:
        """The kept nodes' keys and values, from their slots base + path[j], to slots base + j."""
        if list(path) == list(range(len(path))):  # a chain's path is in place
            return
        src = transfer.queued(torch.tensor([base + i for i in path]), self.device)  # behind the pass, no wait
        dst = torch.arange(base, base + len(path), device=self.device)
        for layer in layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            assert keys is not None and values is not None  # the pass just filled every layer
            keys[..., dst, :] = keys[..., src, :]
            values[..., dst, :] = values[..., src, :]
            if isinstance(layer, growing_cache.GrowingLayer):
                layer.rewritten(base)

    @torch.inference_mode()
    def extend(
        self, ids: list[int], keep: int = 0, parents: Sequence[int] = (), on_device: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Feed ids after the cached ones; return the (keep, V) logits of the last `keep` (0: all).

        The last len(parents) ids are drafts (node i below node parents[i], -1: below the last committed
        id). A tree of them is fed in the same pass, each node at the position of its depth and seeing
        the committed text and its own ancestors only; the logits are then the (1 + n, V) after the last
        committed id and after each node. A chain takes the plain pass. `on_device`: where device_steps
        (the static cache) only.
        """
        return self._pass(ids, keep, parents, False, on_device)[0]

    @torch.inference_mode()
    def extend_with_features(
        self, ids: list[int], keep: int = 0, parents: Sequence[int] = (), on_device: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As extend, plus the features of every fed position: (len(ids), H) last-layer states, or the
        fused states entering feature_layers."""
        logits, hidden = self._pass(ids, keep, parents, True, on_device)
        assert hidden is not None  # asked for with features=True
        return logits, hidden

    def _pass(self, ids: list[int], keep: int, parents: Sequence[int], features: bool, on_device=None):
        if on_device is not None and not self.device_steps:
            raise ValueError(f"{type(self).__name__} takes no ids on the device (device_steps is False)")
        if not tree_shape.is_tree(parents):
            return self._forward(ids, keep, features, on_device)
        m = len(ids) - len(parents)
        if m < 1:
            raise ValueError("a tree pass feeds at least the newest committed token, whose logits choose the root")
        if on_device is None:
            return self._tree_forward(ids[:m], ids[m:], parents, features)
        if len(on_device) != len(parents):
            raise ValueError("picks on the device are the tree's nodes, one for each")
        return self._tree_forward(ids[:m], ids[m:], parents, features, on_device)

    @abc.abstractmethod
    def _forward(
        self, ids: list[int], keep: int, features: bool, on_device: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A causal pass over ids after the cached ones: (keep, V) logits, and the features if asked;
        `on_device` (where device_steps): the last ids' values, on the device."""

    def _tree_forward(
        self,
        ids: list[int],
        tokens: list[int],
        parents: Sequence[int],
        features: bool,
        on_device: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Committed ids, then a tree of drafts, in one pass (DynamicRollbackCache, StaticRollbackCache);
        `on_device` (where device_steps): the nodes' ids, on the device."""
        raise UserError("this KV cache cannot verify a draft tree: run it as a chain")

    @torch.inference_mode()
    def rollback(self, length: int, path: Sequence[int] = ()) -> None:
        """Forget every cached position at or after `length`: a crop, never a recompute.

        With path, after a pass whose drafts sit from slot `length`: the kept nodes' keys and values
        move to slots length, length + 1, .. in order first (their positions are their depths, so they
        are the text's own), and they stay. A chain's path, 0..a-1, is already in place.
        """
        if path:
            self.move_path(self._layers(), length, path)
            length += len(path)
        self._crop(length)

    def _layers(self) -> list:
        raise UserError("this KV cache cannot verify a draft tree: run it as a chain")

    @abc.abstractmethod
    def _crop(self, length: int) -> None:
        """Forget the cached positions at or after `length`."""


class DynamicRollbackCache(RollbackCache):
    """One request's view of a shared model on a dynamic cache: the cache is private, the weights are not."""

    def __init__(self, model: PreTrainedModel, feature_layers: tuple[int, ...] = (), room: int = growing_cache.ROOM):
        super().__init__(model, feature_layers)
        # Passes without the wrapper where they give the wrapper's own bits (direct_pass.py).
        self.direct = direct_pass.parts(model)
        # Direct passes append in place (growing_cache.py), with `room` spare positions; the probe that
        # admitted them ran on one too.
        self.cache = growing_cache.new_cache(model.config, room) if self.direct else DynamicCache(config=model.config)
        # Sliding-window layers drop keys older than the window as they go; recording the past
        # keeps them until the next crop, so a rejected draft can be removed past the window too.
        # Only they record: a recurrent layer (a plain run of a Mamba target, which never rolls back)
        # told to record keeps no count of states, which transformers 5.25's Mamba cannot read.
        self.windowed = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)
        if self.windowed:
            self.cache.activate_past_recording()

    def step(self, token: int) -> torch.Tensor:
        """(V,) logits of one more token."""
        if self.direct is None:
            return self.extend([token], keep=1)[-1]
        self.length += 1
        self.tokens_processed += 1
        return direct_pass.step(self.direct, self.cache, self._embeddable([token])[0])

    def _forward(
        self, ids: list[int], keep: int, features: bool, on_device: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Only the kept rows are computed, so a long prefill never holds a (len, V) tensor.
        if self.direct is not None:
            fed = self._embeddable(ids)
            logits, hidden = direct_pass.forward(
                self.direct, self.cache, fed, keep, features, layers=self.feature_layers
            )
        else:
            x = torch.tensor([self._embeddable(ids)], dtype=torch.long, device=self.device)
            out = self.model(
                input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep, output_hidden_states=features
            )
            logits, hidden = out.logits[0], self._features(out, features)
        self.length += len(ids)
        self.tokens_processed += len(ids)
        return logits, hidden

    def _tree_forward(
        self,
        ids: list[int],
        tokens: list[int],
        parents: Sequence[int],
        features: bool,
        on_device: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert on_device is None, "no device steps here (_pass refuses them)"
        if self.windowed:
            raise UserError("draft trees need full-attention layers: this model has sliding windows")
        m, n = len(ids), len(tokens)
        position, mask = self.tree_layout(m, parents, self.length + m + n)
        fed = self._embeddable(list(ids) + list(tokens))
        if self.direct is not None:
            logits, hidden = direct_pass.forward(
                self.direct, self.cache, fed, n + 1, features, mask, position, self.feature_layers
            )
        else:
            x = torch.tensor([fed], dtype=torch.long, device=self.device)
            out = self.model(
                input_ids=x,
                position_ids=position,
                attention_mask=mask,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=n + 1,
                output_hidden_states=features,
            )
            logits, hidden = out.logits[0], self._features(out, features)
        self.length += m + n
        self.tokens_processed += m + n
        return logits, hidden

    def _layers(self) -> list:
        return self.cache.layers

    def _crop(self, length: int) -> None:
        # A windowed cache is cropped even by 0: that trims its sliding layers back to the window.
        if self.length and (length < self.length or self.windowed):
            self.cache.crop(min(0, length - self.length))
            self.length = min(length, self.length)


def _stand_in(config, rows: int) -> int:
    """The id fed in place of one the model cannot embed: its pad token, else its EOS, else 0."""
    eos = getattr(config, "eos_token_id", None)
    eos = (eos or [None])[0] if isinstance(eos, (list, tuple)) else eos
    return next((i for i in (getattr(config, "pad_token_id", None), eos) if i is not None and 0 <= i < rows), 0)


def refuse_uncroppable(model: PreTrainedModel, cache: DynamicCache | None = None) -> None:
    """Raise UserError, naming the architecture, if a rejected draft could not be removed from its cache.

    Attention layers (full, sliding, chunked) crop exactly. Recurrent state (linear attention, SSMs)
    cannot be rewound, and re-running the whole prefix every round would defeat the point.
    """
    cache = cache if cache is not None else DynamicCache(config=model.config)
    bad = sorted(
        {
            type(layer).__name__
            for layer in cache.layers
            if not isinstance(layer, CROPPABLE) or hasattr(layer, "is_recurrent_states_initialized")
        }
    )
    if bad:
        raise UserError(
            f"{type(model).__name__} ({model.config.model_type}) is not supported: its cache layers "
            f"({', '.join(bad)}) cannot be cropped back after a rejected draft (recurrent or convolution "
            "state, or a layer type this app does not know)"
        )
