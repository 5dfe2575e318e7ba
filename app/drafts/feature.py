"""EAGLE-style drafting: a feature head over the target's own hidden states (the head itself:
feature_head.py), and its draft kind."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from app.core import sampling
from app.core.config import SamplingConfig, SpecConfig
from app.core.contracts import KVCache, Proposer
from app.core.tree_shape import siblings_per_depth
from app.drafts import head_passes
from app.drafts.draft_spec import BaseDraft, BaseKind, Draft, DraftInfo, DraftSpec, Loading
from app.drafts.draw import Branches, Proposal, draw, draw_siblings, pick_on_device, stacked, tree_paths

BATCHED_GREEDY = True  # greedy trees: each depth's parents in one product over the draft vocabulary


class FeatureProposer:
    """EAGLE-1 drafting: a one-layer head over the target's own features, with its own KV cache.

    Its cache holds one entry per pair (x_{j+1}, f_j) whose feature came from the target; drafted
    pairs use the head's predicted features and are rolled back at commit, then re-fed with the
    target's true features (as EAGLE does). Before the target's first pass there are no features,
    so the first round drafts nothing.
    """

    branches = True  # EAGLE-2's tree, grown by expected value

    wants_features = True
    cache_factory: Callable[[Any], KVCache] | None = None  # the head keeps its own growing cache
    # Set by the engine after begin() where it verifies a chain's picks on the device
    # (engine.generate): the host then reads them once, with the verdict.
    picks_on_device = False
    # The head's own cache: None, a growing one; on the fast path (runs.py) a static one of this many
    # pairs, its passes replayed as CUDA graphs (head_passes.py).
    static_len: int | None = None

    def __init__(self, target: PreTrainedModel, head, name: str = "feature-head"):
        self.target, self.head, self.name = target, head, name
        self.context_limit: int | None = getattr(head.config, "max_position_embeddings", None)
        # Looked up once: transformers' accessors walk the module tree on every call.
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        # A head with a reduced draft vocabulary scores only those rows of the LM head (q = 0 elsewhere).
        self.vocab: torch.Tensor | None
        self.w_sub: torch.Tensor | None
        self.slot_of: torch.Tensor | None  # token id -> its place among the draft vocabulary's scores, -1 outside
        self.use_vocab(*(head.draft_rows(self.lm_head) or (None, None)))
        # The target's features the head reads: its last layer (EAGLE-1), or three layers fused (EAGLE-3).
        self.feature_layers: tuple[int, ...] = head.feature_layers

    def use_vocab(self, vocab: torch.Tensor | None, w_sub: torch.Tensor | None) -> None:
        """Draft over these ids (their LM-head rows w_sub), or over the whole vocabulary (None)."""
        self.vocab, self.w_sub, self.slot_of = vocab, w_sub, None
        if vocab is not None:
            size = max(int(self.lm_head.weight.shape[0]), int(vocab.max()) + 1)
            self.slot_of = torch.full((size,), -1, dtype=torch.long, device=vocab.device)
            self.slot_of[vocab] = torch.arange(len(vocab), device=vocab.device)

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        self.ids = list(prompt_ids)
        self.vocab_size = vocab_size
        self.passes = (
            head_passes.EagerHeadPasses(self.head, self.embed)
            if self.static_len is None
            else head_passes.GraphedHeadPasses(self.head, self.embed, self.static_len)
        )
        self.pairs = 0  # true pairs in the head's cache
        # (m, H) blocks of the target's features not yet fed to the head: f_pairs .. f_{len(ids)-2}.
        # Fed ones are dropped, so a round never copies the whole history.
        self.features: list[torch.Tensor] = []
        self.n_features = 0  # features received in all
        self.tokens_processed = 0  # pairs fed through the head, so tests can prove rollback never re-feeds
        self._drafts = Branches(0)
        self._tree: _Tree | None = None
        self.read_feature: int | None = None  # position of the target feature the last draft round read
        self.picks_on_device = False
        self._pending: Proposal | None = None

    def _step(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """Feed pairs (tokens[i], features[i]); return the (n, H) predicted next features."""
        self.tokens_processed += len(tokens)
        return self.passes.causal(tokens, features)

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator, nodes: int = 0) -> Proposal:
        self._drafts, self._tree = Branches(k), None
        if k == 0 or self.n_features == 0:
            return Proposal([], None)
        with torch.inference_mode():  # one context for the round, not one per step
            return self._propose_tree(k, nodes, cfg, gen) if nodes else self._propose(k, cfg, gen)

    def _propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        f = self.features[0] if len(self.features) == 1 else torch.cat(self.features)
        self.features = []
        # Pairs j = pairs+1 .. len(ids)-1: token x_j with the target's feature f_{j-1}.
        predicted = self._step(self.ids[self.pairs + 1 :], f)
        self.pairs = len(self.ids) - 1
        self.read_feature = len(self.ids) - 2
        drafts, feature = self._drafts, predicted[-1]
        if self.picks_on_device and cfg.picks_stay_on_device:
            return self._chain_on_device(feature, k, cfg, gen)
        for i in range(k):
            history = self.ids + drafts.chain
            x, q = self._draw(feature, history, cfg, gen)
            drafts.add(x, q, None, history, cfg, gen)
            if i < k - 1:  # EAGLE drafts on its own predicted feature
                feature = self._step([x], feature[None])[-1]
        return drafts.proposal(self.read_feature)

    def _chain_on_device(self, feature: torch.Tensor, k: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        """A chain (greedy, a race or a draw) whose every pick feeds the head's next step on the
        device: no step waits for the device, and the host reads the picks once, with the target's
        verdict (Proposal.pending)."""
        picks, qs = [], []
        for i in range(k):
            pick, q = self._pick(feature, cfg, len(self.ids) + i, gen)
            picks.append(pick)
            qs.append(q)
            if i < k - 1:
                self.tokens_processed += 1
                feature = self.passes.causal(pick, feature[None])[-1]
        self._pending = Proposal([], stacked(qs), self.read_feature, pending=torch.stack(picks))
        return self._pending

    def _pick(
        self, feature: torch.Tensor, cfg: SamplingConfig, position: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """_draw's (token, q) of a predicted feature, the token a 0-d tensor on the device, unread."""
        if cfg.greedy and self.vocab is not None:  # the subset's argmax: no full row
            assert self.w_sub is not None  # gathered with the draft vocabulary
            return self.vocab[self.head.score(self.head.readout(feature), self.w_sub).argmax()], None
        return pick_on_device(self._logits(feature), cfg, position, gen)

    def _propose_tree(self, k: int, nodes: int, cfg: SamplingConfig, gen: torch.Generator) -> Proposal:
        """EAGLE-2's tree: depth by depth, the budget of that depth (siblings_per_depth) goes to the
        children with the highest expected value, a parent's path probability times its j-th best
        draft probability; each parent's children are then drawn (the best under greedy, without
        replacement under sampling, race order under shared noise), and one head pass over the new
        nodes, each seeing the true pairs and its own ancestors, gives their features. Who gets
        children depends on the parents alone, never on the children drawn, so every rule stays exact."""
        f = self.features[0] if len(self.features) == 1 else torch.cat(self.features)
        self.features = []
        predicted = self._step(self.ids[self.pairs + 1 :], f)
        self.pairs = len(self.ids) - 1
        self.read_feature = len(self.ids) - 2
        tree = _Tree()
        # The frontier: (node, path probability, the feature its children are drawn from); -1 is the root.
        frontier = [(-1, 1.0, predicted[-1])]
        widths = [1 + n for n in siblings_per_depth(k, nodes)]
        batched = BATCHED_GREEDY and cfg.greedy and not cfg.penalised and self.vocab is not None
        for depth, width in enumerate(widths):
            if batched:
                new = self._greedy_depth(tree, frontier, width)
            else:
                new = self._drawn_depth(tree, frontier, width, cfg, gen)
            if depth == len(widths) - 1 or not new:
                break
            features = self._tree_step(tree, new)
            frontier = [(node, tree.scores[node], features[j]) for j, node in enumerate(new)]
        self._tree = tree
        return Proposal(list(tree.tokens), tree.q(), self.read_feature, list(tree.parents))

    def _drawn_depth(self, tree: _Tree, frontier: list, width: int, cfg: SamplingConfig, gen) -> list[int]:
        """One depth of the tree, parent by parent: the `width` best offers (path probability times a
        child's draft probability) decide how many children each parent gets, then they are drawn."""
        rows = [self._logits(feature) for _, _, feature in frontier]
        scored = [row.float().softmax(-1) if cfg.greedy else sampling.probs(row, cfg) for row in rows]
        best = [row.topk(min(width, row.shape[-1])).values.tolist() for row in scored]
        counts = _children(frontier, best, width)
        new: list[int] = []
        for (node, score, feature), logits, probs, count in zip(frontier, rows, scored, counts, strict=True):
            if count:
                history = self.ids + tree.branch(node)
                x, q = draw(logits, history, cfg, gen)
                more, more_q = draw_siblings(logits, history, cfg, gen, x, count - 1)
                for t, row in zip([x, *more], [q, *more_q], strict=True):
                    new.append(tree.add(t, node, row, score * float(probs[t]), feature))
        return new

    def _greedy_depth(self, tree: _Tree, frontier: list, width: int) -> list[int]:
        """One depth of the greedy tree over the draft vocabulary, every parent at once: the same
        offers and children as drawing each parent's row (its best tokens, by path probability)
        without a full-vocabulary row per node."""
        assert self.w_sub is not None and self.vocab is not None  # gathered with the draft vocabulary
        features = torch.stack([feature for _, _, feature in frontier])
        probs = self.head.score(self.head.readout(features), self.w_sub).float().softmax(-1)
        top = probs.topk(min(width, probs.shape[-1]), dim=-1)
        # one read for both (ids are exact in float64): each read from a GPU waits for it
        values, ids = torch.stack([top.values.double(), self.vocab[top.indices].double()]).tolist()
        tokens = [[int(t) for t in row] for row in ids]
        counts = _children(frontier, values, width)
        new: list[int] = []
        for i, ((node, score, feature), count) in enumerate(zip(frontier, counts, strict=True)):
            for r in range(count):
                new.append(tree.add(tokens[i][r], node, None, score * values[i][r], feature))
        return new

    def _tree_step(self, tree: _Tree, new: list[int]) -> torch.Tensor:
        """The (len(new), H) features of one depth's new nodes: one head pass over the pairs (node
        token, its parent's feature) at that depth's position, each seeing the true pairs and its
        own ancestors (the nodes before sit in the head's cache after the true pairs)."""
        start = self.passes.length
        for j, node in enumerate(new):
            tree.slots[node] = start + j
        sees = [[tree.slots[a] for a in tree.ancestry(node)] for node in new]
        pairs = torch.stack([tree.feeds[i] for i in new])
        self.tokens_processed += len(new)
        tokens = [tree.tokens[i] for i in new]
        return self.passes.tree(tokens, pairs, self.pairs - 1 + len(sees[0]), self.pairs, sees)

    def _logits(self, feature: torch.Tensor) -> torch.Tensor:
        """(V,) logits from a predicted feature: the LM head, or its draft-vocabulary rows (-inf elsewhere)."""
        feature = self.head.readout(feature)
        if self.vocab is None:
            return self.lm_head(feature)[: self.vocab_size]
        assert self.w_sub is not None  # gathered with the draft vocabulary
        scores = self.head.score(feature, self.w_sub)
        logits = torch.full((self.vocab_size,), float("-inf"), device=scores.device, dtype=scores.dtype)
        logits[self.vocab] = scores
        return logits

    def _draw(self, feature: torch.Tensor, history: list[int], cfg: SamplingConfig, gen: torch.Generator):
        """A draft token from a predicted feature, through the LM head (or its draft-vocabulary rows)."""
        if self.vocab is not None and cfg.greedy:  # the subset's argmax: no full row
            assert self.w_sub is not None and self.slot_of is not None
            scores = self.head.score(self.head.readout(feature), self.w_sub)
            if cfg.penalised:
                scores = sampling.penalise_subset(scores, self.slot_of, history, cfg)
                if not bool(torch.isfinite(scores).any()):  # every draft token banned: the full row's pick
                    return draw(self._logits(feature), history, cfg, gen)
            return int(self.vocab[scores.argmax()]), None
        return draw(self._logits(feature), history, cfg, gen)

    def commit(self, path: list[int], token: int, features: torch.Tensor | None = None) -> None:
        if self._pending is not None:  # a chain of picks on the device, read with the verdict by now
            assert self._pending.pending is None, "the verdict reads the picks before anything commits"
            self._drafts, self._pending = Branches.chain_of(self._pending.tokens), None
        kept = [self._tree.tokens[i] for i in path] if self._tree is not None else self._drafts.kept(path)[0]
        self._tree = None
        if features is None:
            raise ValueError("a feature head needs the target's features at every commit")
        # Pairs built on predicted features go: the target's true ones replace them.
        self.passes.crop(self.pairs)
        self.ids += kept + [token]
        self.features.append(features.detach())
        self.n_features += features.shape[0]
        self._drafts = Branches(0)

    def end(self) -> None:
        self.passes.close()


EAGLE_PREFIX = "eagle:"  # how users type a head by id or path: eagle:<head>


class FeatureKind(BaseKind):
    """A feature head: eagle:<Hub id or directory>, or a directory that holds one."""

    name = "feature_head"
    described = "a feature-head (EAGLE) draft"

    def parse(self, text: str, probe: bool) -> DraftSpec | None:
        from app.drafts.feature_head import is_head_dir

        if text.lower().startswith(EAGLE_PREFIX):
            return DraftSpec(self, source=text[len(EAGLE_PREFIX) :].strip())
        if probe and text and Path(text).is_dir() and is_head_dir(text):
            return DraftSpec(self, source=text)
        return None

    def show(self, spec: DraftSpec) -> str:
        from app.drafts.feature_head import is_head_dir

        return spec.source if Path(spec.source).is_dir() and is_head_dir(spec.source) else EAGLE_PREFIX + spec.source

    def load(self, spec: DraftSpec, loading: Loading) -> Draft:
        return HeadDraft(self, spec, loading.name, head=loading.head(spec.source))

    def vllm(self, info: DraftInfo, k: int, spec: SpecConfig) -> tuple[dict | None, list[str]]:
        from app.drafts.eagle3_head import is_eagle3_dir

        notes = []
        method = "eagle3" if Path(info.spec.source).is_dir() and is_eagle3_dir(info.spec.source) else "eagle"
        if method == "eagle" and trained_here(info.spec.source):
            notes.append(
                "this head has a fusion bias and a draft vocabulary vLLM's EAGLE-1 model has no place for: "
                "--head-out DIR writes the copy vLLM reads"
            )
        config: dict = {"method": method, "model": info.spec.source, "num_speculative_tokens": k}
        if spec.tree:
            paths = tree_paths(k, spec.tree)
            config |= dict(num_speculative_tokens=len(paths), speculative_token_tree=str(paths))
            notes.append(
                "vLLM's token tree is static: this is the tree's shape with its budget spread over the depths "
                "(docs/how-it-works.md); the app grows the feature head's tree EAGLE-2's way, as SGLang does"
            )
        return config, notes

    def sglang(self, info: DraftInfo, k: int, spec: SpecConfig) -> tuple[list[str] | None, list[str]]:
        """SGLang's EAGLE path: its dynamic tree, k steps deep, up to the widest depth's children a
        parent, and the tree's node count as its draft tokens."""
        widths = [1 + n for n in siblings_per_depth(k, spec.tree)] if spec.tree else [1] * k
        argv = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", info.spec.source]
        argv += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", str(max(widths))]
        argv += ["--speculative-num-draft-tokens", str(spec.tree or k)]
        return argv, []


def trained_here(source: str) -> bool:
    """Whether a head directory is in this app's own layout (python -m app train writes it)."""
    config = Path(source) / "config.json"
    try:
        return config.is_file() and "feature_head" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


@dataclass
class HeadDraft(BaseDraft):
    head: torch.nn.Module | None = None

    def proposer(self, target, spec: SpecConfig) -> Proposer:
        return FeatureProposer(target, self.head, self.name)

    def idle_note(self, step) -> str:
        if step.feature_position is not None:
            return ""
        return (
            "The feature head drafts from the target's own features, and the target has not run yet: this "
            "round is its first pass over the prompt (the prefill), which gives the first token and the "
            "features the head starts from next round."
        )

    def modules(self) -> list[torch.nn.Module]:
        assert self.head is not None, "a loaded head draft holds its head"
        return [self.head]


KIND = FeatureKind()


def _children(frontier: list, best: list[list[float]], width: int) -> list[int]:
    """How many children each parent of a depth gets: the `width` best offers, a parent's path
    probability times one of its best draft probabilities (best[i], in falling order)."""
    offers = sorted(((score * value, i) for i, (_, score, _) in enumerate(frontier) for value in best[i]), reverse=True)
    counts = [0] * len(frontier)
    for _, i in offers[:width]:
        counts[i] += 1
    return counts


class _Tree:
    """One round's tree of drafts as the feature head grows it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.rows: list[torch.Tensor | None] = []  # the q each node was drawn from
        self.scores: list[float] = []  # path probability under the draft
        self.feeds: list[torch.Tensor] = []  # the feature each node's pair reads: its parent's
        self.slots: dict[int, int] = {}  # node -> its slot in the head's cache, once fed

    def add(self, token: int, parent: int, q: torch.Tensor | None, score: float, feed: torch.Tensor) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.rows.append(q)
        self.scores.append(score)
        self.feeds.append(feed)
        return len(self.tokens) - 1

    def ancestry(self, node: int) -> list[int]:
        """The node and its ancestors, root side last."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out

    def branch(self, node: int) -> list[int]:
        """The tokens from the root down to the node."""
        return [self.tokens[i] for i in reversed(self.ancestry(node))]

    def q(self) -> torch.Tensor | None:
        rows = [r for r in self.rows if r is not None]
        return torch.stack(rows) if rows and len(rows) == len(self.rows) else None
