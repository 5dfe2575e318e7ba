"""The registry of draft kinds, in the order their text is tried: a new kind is its module plus one
line here (or, for a throwaway kind, one call of `register`). A model id is the last resort, since
any text can name one."""

from __future__ import annotations

from app.core.config import UserError
from app.drafts import feature, lookup, model
from app.drafts.draft_spec import DraftKind, DraftSpec

KINDS: list[DraftKind] = [lookup.KIND, model.EARLY_EXIT, feature.KIND, model.KIND]


def get(name: str) -> DraftKind:
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise UserError(f"unknown draft kind {name!r}")


def parse(text: str, probe: bool = True) -> DraftSpec:
    """The spec of the first kind that claims `text` (stripped)."""
    text = (text or "").strip()
    for kind in KINDS:
        spec = kind.parse(text, probe)
        if spec is not None:
            return spec
    raise UserError(f"no draft kind reads {text[:40]!r}")


def register(kind: DraftKind) -> None:
    """Add a kind, tried before the model-id fallback; its name must be new."""
    if any(k.name == kind.name for k in KINDS):
        raise ValueError(f"a draft kind named {kind.name!r} is registered already")
    KINDS.insert(len(KINDS) - 1, kind)


def unregister(kind: DraftKind) -> None:
    KINDS.remove(kind)
