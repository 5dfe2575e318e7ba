"""The registry of draft kinds, in the order their text is tried: a new kind is its module plus one
line here (or, for a throwaway kind, one call of `register`). A model id is the last resort, since
any text can name one.

Each line says how a user types the kind and where it lives. The CLI's help lists the first without
importing the second: the kinds need torch, and `--help` must not wait for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from app.core.config import UserError

if TYPE_CHECKING:
    from app.drafts.draft_spec import DraftKind, DraftSpec

# (how it is typed, "module:attribute" of the kind, or the kind itself once registered at run time)
REGISTRY: list[tuple[str, Any]] = [
    ("prompt-lookup", "app.drafts.lookup:KIND"),
    ("early-exit:N", "app.drafts.model:EARLY_EXIT"),
    ("eagle:DIR", "app.drafts.feature:KIND"),
    ("a Hub id or local dir", "app.drafts.model:KIND"),
]


def _load(where: Any) -> DraftKind:
    if not isinstance(where, str):
        return where
    module, attribute = where.split(":")
    return getattr(importlib.import_module(module), attribute)


def all_kinds() -> list[DraftKind]:
    """The registered kinds, in the order their text is tried (imports their modules)."""
    return [_load(where) for _, where in REGISTRY]


def typed() -> list[str]:
    """How each registered kind is typed, in order, without importing any of them."""
    return [text for text, _ in REGISTRY]


def __getattr__(name: str) -> Any:
    if name == "KINDS":  # read as a list, as before the registry loaded lazily
        return all_kinds()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(name: str) -> DraftKind:
    for kind in all_kinds():
        if kind.name == name:
            return kind
    raise UserError(f"unknown draft kind {name!r}")


def parse(text: str, probe: bool = True) -> DraftSpec:
    """The spec of the first kind that claims `text` (stripped)."""
    text = (text or "").strip()
    for kind in all_kinds():
        spec = kind.parse(text, probe)
        if spec is not None:
            return spec
    raise UserError(f"no draft kind reads {text[:40]!r}")


def register(kind: DraftKind, typed: str | None = None) -> None:
    """Add a kind, tried before the model-id fallback; its name must be new. `typed`: how a user types
    it, for the help (default: its name)."""
    if any(k.name == kind.name for k in all_kinds()):
        raise ValueError(f"a draft kind named {kind.name!r} is registered already")
    REGISTRY.insert(len(REGISTRY) - 1, (typed or kind.name, kind))


def unregister(kind: DraftKind) -> None:
    REGISTRY[:] = [(text, where) for text, where in REGISTRY if _load(where) is not kind]
