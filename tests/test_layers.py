"""The package layout's rules, read from the source: imports flow one way, with no cycles.

core <- kv <- drafts <- models <- runs <- calibrate <- kept_costs <- request <- (args, export, category_runner)
<- sweep <- (serve, bench, training) <- cli. views (render, plots) reads only core.
data (the training and held-out text) imports nothing of the app. Only serve/ imports gradio, and
nothing but the CLI imports bench/ or training/. Lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK = {
    "core": 0,
    "data": 0,
    "kv": 1,
    "drafts": 2,
    "models": 3,
    "views": 1,
    "runs": 4,
    "calibrate": 5,
    "kept_costs": 5.5,
    "request": 6,
    "category_runner": 7,
    "args": 7,
    "export": 8,
    "sweep": 8,
    "serve": 9,
    "bench": 9,
    "training": 9,
    "cli": 10,
    "__main__": 11,
    "__init__": 0,
}


def unit(module: str) -> str:
    """The layer a dotted module name belongs to: its package, or the top-level module itself."""
    return module.split(".")[1] if module.count(".") >= 1 else "__init__"


def app_imports(path: Path) -> list[tuple[str, int]]:
    """(imported app module, line) for every import in a file, including those inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] in ("app", "gradio")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            if base == "app" or base.startswith("app."):
                # `from app.kv import cache` imports the submodule app.kv.cache
                found += [
                    (f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base, node.lineno) for a in node.names
                ]
            elif base.split(".")[0] == "gradio":
                found.append((base, node.lineno))
    return found


def _is_module(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / "app").rglob("*.py"))}


def test_imports_flow_one_way():
    wrong = []
    for name, path in sources().items():
        here = unit(name)
        for imported, line in app_imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
            if imported.split(".")[0] == "gradio":
                if here != "serve":
                    wrong.append(where + " (only serve/ imports gradio)")
                continue
            there = unit(imported)
            if there == here or imported == "app":
                continue
            if there in ("bench", "training") and here != "cli":
                wrong.append(where + " (only the CLI imports bench/ and training/)")
            elif RANK[there] >= RANK[here]:
                wrong.append(where + f" ({here} may not import {there})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {
        name: {m for m, _ in app_imports(path) if m in sources() and m != name} for name, path in sources().items()
    }
    # A package's __init__ re-exporting its own modules is not a cycle of the architecture.
    for name in graph:
        graph[name] = {m for m in graph[name] if not (name.endswith(m.rsplit(".", 1)[0]) and m.startswith(name + "."))}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_the_checks_see_a_planted_violation(tmp_path):
    """The walker finds lazy imports, so a wrong-way import inside a function would fail the test."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from app.serve import ui\n    import gradio\n")
    assert [m for m, _ in app_imports(planted)] == ["app.serve.ui", "gradio"]
