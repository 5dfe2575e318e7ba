"""The benchmark's prompt suites. For an instruct target (chat): held-out code tasks and held-out writing
requests (instructions.py). For the tiny stdlib family: a def line of each held-out stdlib file, and its
examples' prose (assets/prompts-tiny.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from app.data import instructions
from app.data.corpus import HELD_OUT, stdlib_files

TINY_PROMPTS_FILE = Path(__file__).resolve().parents[2] / "assets" / "prompts-tiny.json"


def held_out_prompts(n_chars: int = 700) -> list[str]:
    """One prompt per held-out stdlib file: the code up to and including a `def` line."""
    prompts = []
    for path in stdlib_files():
        if path.name not in HELD_OUT or not path.parent.name.startswith("python"):
            continue
        src = path.read_text(encoding="utf-8")
        defs = [m.end() for m in re.finditer(r"^ *def [^\n]*:\n", src, re.M) if m.start() > 1500]
        if defs:
            end = defs[len(defs) // 2]
            prompts.append(src[max(0, end - n_chars) : end])
    return prompts


def suite(name: str, chat: bool = False) -> list[str]:
    """Prompts of a suite: held-out code, prose, or both; instructions when the target chats, where
    code-40 is the larger held-out code suite."""
    if chat:
        code, prose = instructions.held_out_code(), instructions.held_out_prose()
        return {"code": code, "prose": prose, "code-40": instructions.held_out_code_suite()}.get(name, code + prose)
    examples = json.loads(TINY_PROMPTS_FILE.read_text())
    if name == "code":
        return held_out_prompts()
    if name == "prose":
        return [e["prompt"] for e in examples if e["kind"] == "open-ended"]
    return held_out_prompts() + [e["prompt"] for e in examples if e["kind"] == "open-ended"]
