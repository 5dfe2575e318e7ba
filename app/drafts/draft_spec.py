"""Where drafts come from, as one typed value parsed once from CLI, UI or API text.

"prompt-lookup", "early-exit:2", "eagle:<head id or dir>", a directory holding a feature head,
or a model's Hub id or directory. Loading, compatibility, presets and the bench read the kind
and its parameters, never the string again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.core.config import UserError


class Kind:
    """What a draft is; compared by these names, never by string literals."""

    MODEL = "model"  # a separate draft model
    PROMPT_LOOKUP = "prompt_lookup"  # n-gram matches in the context, no model
    EARLY_EXIT = "early_exit"  # the target's first layers, its final norm and LM head
    FEATURE_HEAD = "feature_head"  # an EAGLE-style head over the target's hidden states
    ALL = (MODEL, PROMPT_LOOKUP, EARLY_EXIT, FEATURE_HEAD)


# How users type the drafts that are not a model id.
LOOKUP_TEXT = "prompt-lookup"
EARLY_EXIT_PREFIX = "early-exit:"
EAGLE_PREFIX = "eagle:"


@dataclass(frozen=True)
class DraftSpec:
    kind: str  # Kind.MODEL, Kind.PROMPT_LOOKUP, Kind.EARLY_EXIT or Kind.FEATURE_HEAD
    source: str = ""  # Kind.MODEL and Kind.FEATURE_HEAD: the Hub id or local directory to load
    layers: int = 0  # Kind.EARLY_EXIT: how many of the target's layers draft

    def __post_init__(self) -> None:
        if self.kind not in Kind.ALL:
            raise UserError(f"unknown draft kind {self.kind!r}")
        if self.kind in (Kind.MODEL, Kind.FEATURE_HEAD) and not self.source:
            raise UserError("no draft model given: pick a preset, a Hub id or a local directory")
        if self.kind == Kind.EARLY_EXIT and self.layers < 1:
            raise UserError(f"early exit needs at least one layer, like early-exit:2; got {self.layers}")

    @classmethod
    def parse(cls, text: str, probe: bool = True) -> DraftSpec:
        """The spec a user's text names; a directory is a feature head when it holds one.

        probe=False reads the text alone and never the filesystem: a directory is then a model,
        which is how the hosting rules read an id before anything touches the disk.
        """
        text = (text or "").strip()
        if text.lower() in (LOOKUP_TEXT, "prompt_lookup", "prompt lookup"):
            return cls(Kind.PROMPT_LOOKUP)
        if text.lower().startswith(EARLY_EXIT_PREFIX):
            count = text[len(EARLY_EXIT_PREFIX) :].strip()
            if not (count.isascii() and count.isdigit() and len(count) <= 4):
                raise UserError(f"early exit needs a layer count, like early-exit:2; got {text[:40]!r}")
            return cls(Kind.EARLY_EXIT, layers=int(count))
        if text.lower().startswith(EAGLE_PREFIX):
            return cls(Kind.FEATURE_HEAD, source=text[len(EAGLE_PREFIX) :].strip())
        if probe and text and Path(text).is_dir() and _holds_head(text):
            return cls(Kind.FEATURE_HEAD, source=text)
        return cls(Kind.MODEL, source=text)

    @property
    def loads_model(self) -> bool:
        """Whether this draft has weights of its own to load (a model or a head)."""
        return self.kind in (Kind.MODEL, Kind.FEATURE_HEAD)

    def __str__(self) -> str:
        """The canonical text, which parses back to this spec."""
        if self.kind == Kind.PROMPT_LOOKUP:
            return LOOKUP_TEXT
        if self.kind == Kind.EARLY_EXIT:
            return f"{EARLY_EXIT_PREFIX}{self.layers}"
        if self.kind == Kind.FEATURE_HEAD and not (Path(self.source).is_dir() and _holds_head(self.source)):
            return EAGLE_PREFIX + self.source
        return self.source


def _holds_head(path: str) -> bool:
    from app.drafts import feature_head

    return feature_head.is_head_dir(path)
