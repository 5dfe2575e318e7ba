"""`python -m app bench`'s command line: the suite and its contenders, the other modes, the output."""

from __future__ import annotations

import argparse
from pathlib import Path

from app.args import add_generation_args


def parser(description: str) -> argparse.ArgumentParser:
    """The bench's options, beside the generation options every command shares (args.py)."""
    ap = argparse.ArgumentParser(prog="python -m app bench", description=description)
    _suite(ap)
    _contenders(ap)
    _modes(ap)
    _output(ap)
    add_generation_args(ap)
    return ap


def _suite(ap: argparse.ArgumentParser) -> None:
    """What runs: the built-in suite or a question file, and how much of it."""
    ap.add_argument(
        "--suite",
        default="code",
        help="code, code-40 (40 held-out code requests, for chat targets), prose or all (held-out built-in "
        "suites), or a file: Spec-Bench's question.jsonl format "
        "(one {question_id, category, turns} a line; multi-turn through the chat template) or one prompt a line",
    )
    ap.add_argument("--categories", help="with a question file: only these categories (comma-separated)")
    ap.add_argument("--per-category", type=int, default=0, help="with a question file: at most N questions of each")
    ap.add_argument("--exits", type=int, default=8, help="with --sizes: early-exit depths, spread over the target")
    ap.add_argument("--drafts", help="several drafts (comma-separated): one interleaved run of the suite or file")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per prompt and contender (>= 1)")


def _contenders(ap: argparse.ArgumentParser) -> None:
    """Which contenders beside ours the default mode times."""
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers' generate")
    ap.add_argument(
        "--no-llama-cpp",
        dest="with_llama_cpp",
        action="store_false",
        help="skip llama.cpp's plain decoding of the wheel's GGUF (timed where llama-cpp-python imports)",
    )
    ap.add_argument(
        "--no-sweep",
        dest="sweep",
        action="store_false",
        help="skip the fixed-k sweep 1..8 (ours still runs at --k, the partner of transformers' constant-k run)",
    )
    ap.add_argument("--no-lookup", dest="lookup", action="store_false", help="skip the prompt lookup contenders")


def _modes(ap: argparse.ArgumentParser) -> None:
    """The other modes, each a different report."""
    ap.add_argument(
        "--card",
        action="store_true",
        help="model card figures for a family's drafts: the tiny family's, or SmolLM2's with --target smollm2",
    )
    ap.add_argument(
        "--passes",
        action="store_true",
        help="ms per target pass by width in fp32, bf16 and int8, beside the memory bandwidth (pass_costs.py)",
    )
    ap.add_argument(
        "--rules",
        action="store_true",
        help="alpha of each sampling rule at a fixed k (default 4, T = 0.7) for the family's drafts (rules.py)",
    )
    ap.add_argument(
        "--sizes",
        action="store_true",
        help="which draft is worth it: early exit at a spread of depths, the bundled drafts (or --drafts) and "
        "prompt lookup on each category of the Spec-Bench-format sample, speedup against draft cost (sizes.py)",
    )
    ap.add_argument(
        "--threads-check",
        action="store_true",
        help="tokens/s with 1 thread, every core and auto, idle and beside one busy process",
    )


def _output(ap: argparse.ArgumentParser) -> None:
    """Where the report goes, and in which form."""
    ap.add_argument("--out", type=Path, default=Path("runs/bench"), help="writes OUT.json and OUT.html")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON (default: a readable table)")
