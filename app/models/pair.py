"""A target and its draft as one pair: the draft loaded by its kind, checked against the target's
vocabulary, and the prompt encoded within the pair's context.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from app.core import text
from app.core.config import SpecConfig, UserError
from app.core.contracts import Proposer
from app.drafts import kinds
from app.drafts.draft_spec import Draft, DraftSpec
from app.kv.cache import refuse_uncroppable
from app.models.loading import cached_head, load, precision_of, resolve
from app.models.presets import DEFAULT_TARGET, default_draft

# Text any draft tokenizer must spell back exactly before it may draft for another tokenizer.
SPELLING_PROBE = "def main(argv=None):\n    return {'a': 1, 'B': [2.5]}  # Hello, world!"


def check_compatible(target_tok, draft_tok, target_name: str, draft_name: str) -> bool:
    """True when the draft shares the target's vocabulary, False when its drafts must be re-tokenised.

    Identical vocabularies count as shared even when the embedding matrices differ in padded rows;
    so does one that only adds a few special tokens at the end. A different tokenizer is refused
    only if it cannot spell ordinary text, since the draft reads the committed text in its tokens.
    """
    vt, vd = target_tok.get_vocab(), draft_tok.get_vocab()
    if vt == vd:
        return True
    small, large = (vt, vd) if len(vt) <= len(vd) else (vd, vt)
    shared = all(large.get(tok) == i for tok, i in small.items())
    extra = set(large) - set(small)
    if shared and len(extra) <= 8 and all(large[t] >= len(small) for t in extra):
        return True
    back = draft_tok.decode(draft_tok(SPELLING_PROBE, add_special_tokens=False)["input_ids"])
    if back != SPELLING_PROBE:
        raise UserError(
            f"draft {draft_name!r} has a different vocabulary ({len(vd)} tokens, "
            f"{type(draft_tok).__name__}) from target {target_name!r} ({len(vt)} tokens, "
            f"{type(target_tok).__name__}), and its tokenizer cannot spell ordinary text "
            f"({SPELLING_PROBE[:20]!r} comes back as {back[:20]!r}): pick a draft whose tokenizer covers the text"
        )
    return False


def context_length(*models: PreTrainedModel) -> int:
    """Tokens the smallest model can attend to (a large default when a config is silent)."""
    return min(getattr(m.config, "max_position_embeddings", None) or 1 << 20 for m in models)


@dataclass
class Pair:
    target: PreTrainedModel
    tokenizer: object
    target_name: str
    draft: Draft | None = None  # None: the target alone, for plain autoregressive decoding

    @property
    def draft_name(self) -> str:
        return self.draft.name if self.draft is not None else ""

    @property
    def draft_spec(self) -> DraftSpec:
        """The draft's kind and parameters, parsed once when it loaded."""
        if self.draft is None:
            raise UserError("this pair has no draft")
        return self.draft.spec

    @property
    def note(self) -> str:
        """One line for the UI about how this pair drafts ('' when there is nothing to say)."""
        return self.draft.note if self.draft is not None else ""

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """The prompt's ids (through the chat template when asked), checked against the context."""
        return text.prompt_ids(self.tokenizer, prompt, chat, context_length(self.target))

    def proposer(self, spec: SpecConfig = SpecConfig()) -> Proposer:
        """A fresh proposer for one request (its cache and ids are that request's own)."""
        if self.draft is None:
            raise UserError("this pair has no draft")
        return self.draft.proposer(self.target, spec)


@dataclass
class _Loading:
    """What a draft kind's load may ask for, for one pair: the draft as typed (the hosting rules read
    the typed id), on the target's first device."""

    target: PreTrainedModel
    tokenizer: object
    target_name: str
    name: str  # resolved
    typed: str
    dtype: str | None

    def model(self):
        first = self.target.get_input_embeddings().weight.device
        return load(self.typed, str(first), self.dtype, role="draft")

    def head(self, source: str):
        return cached_head(source, self.target)

    def shares_vocabulary(self, draft_tokenizer) -> bool:
        return check_compatible(self.tokenizer, draft_tokenizer, self.target_name, self.name)


def load_pair(
    target_id: str | None = None,
    draft_id: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    draft: bool = True,
) -> Pair:
    """Target plus a draft of any registered kind (drafts/kinds.py): a model, a feature head,
    'prompt-lookup', 'early-exit:N', ...

    The target may spread over several GPUs; the draft sits on the target's first device.
    draft=False loads the target alone, for plain autoregressive decoding.
    """
    target, tokenizer = load(target_id or DEFAULT_TARGET, device, dtype, spread=True)
    target_name = resolve(target_id or DEFAULT_TARGET)
    if not draft:
        return Pair(target, tokenizer, target_name)
    refuse_uncroppable(target)  # before the user waits: speculation needs a cache that rolls back
    draft_id = draft_id or default_draft(target_id)
    draft_name = resolve(draft_id, "draft")
    spec = kinds.parse(draft_name)  # the one place a draft's text is read
    # A draft model runs in the target's dtype, as the auto choice found it: one probe a pair, not two.
    loading = _Loading(target, tokenizer, target_name, draft_name, draft_id, precision_of(target))
    return Pair(target, tokenizer, target_name, spec.kind.load(spec, loading))
