"""A draft model with a different tokenizer from the target's.

The draft reads the committed text in its own tokens. Under greedy decoding it proposes
text, which the target's tokenizer re-tokenises at the seam with the committed tokens;
verification is the usual greedy match, lossless because q is one-hot on target tokens.
Under sampling it drafts only tokens both vocabularies share (token-level intersection,
Timor et al. 2025, arXiv 2502.05202), so q is a true distribution over target tokens and
rejection sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from app.core import sampling
from app.core.config import SamplingConfig
from app.core.contracts import KVCache
from app.drafts.draw import Proposal, draw
from app.kv.cache import DynamicRollbackCache

LOOKBEHIND = 4  # committed target tokens re-tokenised together with the draft's text at the seam
PARTIAL = "\ufffd"  # what decode() shows for the bytes of a character that a token split


class TokenBridge:
    """The two tokenizers of a pair, and (built on first use) the tokens both vocabularies share."""

    def __init__(self, target_tokenizer, draft_tokenizer) -> None:
        self.target, self.draft = target_tokenizer, draft_tokenizer
        self._shared: torch.Tensor | None = None

    def shared(self) -> torch.Tensor:
        """(V_draft,) the target id of each draft token with the same string in both vocabularies, else -1.

        Tokenizers mark a leading space differently (Ġ in byte-level BPE, ▁ in SentencePiece):
        the draft's mark is rewritten to the target's before comparing, as transformers does.
        """
        if self._shared is None:
            t_vocab, d_vocab = self.target.get_vocab(), self.draft.get_vocab()
            t_mark, d_mark = _space_mark(self.target), _space_mark(self.draft)
            table = torch.full((max(d_vocab.values()) + 1,), -1, dtype=torch.long)
            taken: set[int] = set()
            for tok, i in sorted(d_vocab.items(), key=lambda kv: kv[1]):
                if t_mark and d_mark and t_mark != d_mark and tok.startswith(d_mark):
                    tok = t_mark + tok[len(d_mark) :]
                j = t_vocab.get(tok)
                if j is not None and j not in taken:  # one to one, or q would double-count a target token
                    table[i] = j
                    taken.add(j)
            self._shared = table
        return self._shared


def _space_mark(tokenizer) -> str:
    ids = tokenizer(" ", add_special_tokens=False)["input_ids"]
    return tokenizer.convert_ids_to_tokens(ids)[0][0] if ids else ""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class CrossTokenizerProposer:
    """Drafts from a model whose tokenizer differs from the target's; see the module docstring."""

    wants_features = False
    cache_factory: Callable[[Any], KVCache] | None = None  # its cache is rebuilt from text each round: the dynamic one

    def __init__(self, model: PreTrainedModel, bridge: TokenBridge, name: str):
        self.model, self.bridge, self.name = model, bridge, name
        self.limit = getattr(model.config, "max_position_embeddings", None) or 1 << 20
        self.context_limit: int | None = None  # the draft counts in its own tokens: propose() checks its window

    def begin(self, prompt_ids: list[int], vocab_size: int) -> None:
        self.ids = list(prompt_ids)  # committed target ids
        self.vocab_size = vocab_size
        self.lm = DynamicRollbackCache(self.model)
        self.fed: list[int] = []  # the draft-token ids in the draft's cache, in order
        self._drafts: list[int] = []

    def _context(self) -> tuple[list[int], str]:
        """The committed text in draft tokens, and that text as the draft decodes it.

        Bytes of a character the target has only begun are held back: the draft sees whole characters.
        """
        text = self.bridge.target.decode(self.ids, skip_special_tokens=True).rstrip(PARTIAL)
        ids = self.bridge.draft(text)["input_ids"]
        return ids, self.bridge.draft.decode(ids, skip_special_tokens=True)

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Bring the draft's cache to `ids`: keep the common prefix, feed the rest; return the last logits."""
        keep = min(common_prefix(self.fed, ids), len(ids) - 1)  # at least one token fed, for the logits
        self.lm.rollback(keep)
        self.fed = list(ids)
        return self.lm.extend(ids[keep:], keep=1)[-1]

    def propose(self, k: int, cfg: SamplingConfig, gen: torch.Generator, nodes: int = 0) -> Proposal:
        self._drafts = []
        if k == 0:
            return Proposal([], None)
        context, seen = self._context()
        # The draft counts the same text in its own tokens, which may be more than the target's.
        if not context or len(context) + k > self.limit:
            return Proposal([], None)
        logits = self._feed(context)
        if cfg.greedy:
            self._drafts = self._propose_text(k, context, seen, logits, cfg)
            return Proposal(list(self._drafts), None)
        self._drafts, q = self._propose_shared(k, context, logits, cfg, gen)
        return Proposal(list(self._drafts), q)

    def _propose_text(
        self, k: int, context: list[int], seen: str, logits: torch.Tensor, cfg: SamplingConfig
    ) -> list[int]:
        """Greedy: k draft tokens, their text, re-tokenised by the target after the committed ids."""
        new: list[int] = []
        for i in range(k):
            x, _ = draw(logits, context + new, cfg, None)
            new.append(x)
            if i < k - 1:
                logits = self.lm.step(x)
                self.fed.append(x)
        full = self.bridge.draft.decode(context + new, skip_special_tokens=True)
        # The text after the context; a final character the draft has only begun is dropped.
        text = full[len(seen) :] if full.startswith(seen) else self.bridge.draft.decode(new, skip_special_tokens=True)
        return [t for t in self._seam(text.rstrip(PARTIAL)) if t < self.vocab_size][:k]

    def _seam(self, text: str) -> list[int]:
        """Target ids that continue the committed ids with `text`.

        The last few committed tokens are re-tokenised together with the text, so a word the
        target began ("hel" + "lo") or a character it split ends as the target would end it;
        the longest such tail that re-tokenises to exactly the committed ids wins. Failing that
        (the text would merge into a committed token), the text is tokenised alone, unless the
        committed tokens end inside a character: no text-level token can follow, so no drafts.
        """
        tok = self.bridge.target
        if not text:
            return []
        for n in range(min(LOOKBEHIND, len(self.ids)), 0, -1):
            tail = self.ids[-n:]
            again = tok(tok.decode(tail, skip_special_tokens=True).rstrip(PARTIAL) + text, add_special_tokens=False)[
                "input_ids"
            ]
            if again[:n] == tail:
                return again[n:]
        if tok.decode(self.ids[-LOOKBEHIND:], skip_special_tokens=True).endswith(PARTIAL):
            return []
        return tok(text, add_special_tokens=False)["input_ids"]

    def _propose_shared(
        self, k: int, context: list[int], logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator
    ) -> tuple[list[int], torch.Tensor | None]:
        """Sampling: draft only shared tokens, with q the draft's processed distribution over them,
        moved to the target's ids. Drafts are target tokens one for one: no seam to re-tokenise."""
        table = self.bridge.shared().to(logits.device)
        tokens: list[int] = []
        new: list[int] = []
        qs = []
        for i in range(k):
            row = sampling.penalise(logits[None], context + new, [], cfg)[0].float()
            width = min(len(row), len(table))
            allowed = torch.zeros_like(row, dtype=torch.bool)
            allowed[:width] = (table[:width] >= 0) & (table[:width] < self.vocab_size)
            if not allowed.any():
                break
            row = row.masked_fill(~allowed, float("-inf"))
            q_draft: torch.Tensor | None
            if cfg.shared_noise:
                q_draft = sampling.probs(row, cfg)
            else:
                x, q_draft = draw(row, None, cfg, gen)
            assert q_draft is not None  # a sampled draw's q
            q = torch.zeros(self.vocab_size, device=row.device)
            q[table[:width][allowed[:width]]] = q_draft[:width][allowed[:width]]
            if cfg.shared_noise:  # the race is run in the target's ids, at the target's position
                noise = sampling.race_noise(cfg.seed, len(self.ids) + i, self.vocab_size, q.device)
                x = int((table[:width] == sampling.race(q, noise)).logical_and(allowed[:width]).nonzero()[0, 0])
            qs.append(q)
            tokens.append(int(table[x]))
            new.append(x)
            if i < k - 1:
                logits = self.lm.step(x)
                self.fed.append(x)
        return tokens, torch.stack(qs) if qs else None

    def commit(self, path: list[int], token: int, features: torch.Tensor | None = None) -> None:
        # The draft's cache is brought back in line with the committed text at the next propose.
        self.ids += [self._drafts[i] for i in path] + [token]
        self._drafts = []

    def end(self) -> None:
        self.lm.close()
