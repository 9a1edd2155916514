"""The repository package has no import circle: every module of gpusnap.repo imports (at
module level or inside a function) only modules that do not import it back, directly or
through others. Read from the source with ast, so a lazy import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import gpusnap.repo

PKG = Path(gpusnap.repo.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """The gpusnap.repo modules `path` imports (a package import counts as its __init__;
    `from pkg import mod` as mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n in mods)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    g = {}
    for m, p in mods.items():
        # a package's __init__ re-exports its modules: importing a module runs its package's
        # __init__ first, which is not a circle of the module's own making
        g[m] = {d for d in _imports(p, mods) if d != m and not m.startswith(d + ".") and not d.startswith(m + ".")}
    return g


def _cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                c = visit(d)
                if c:
                    return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state:
            c = visit(m)
            if c:
                return c
    return None


def test_no_import_cycle_in_the_repository_package():
    g = _graph()
    assert "gpusnap.repo.reader" in g and "gpusnap.repo.store" in g["gpusnap.repo.reader"]
    assert _cycle(g) is None, " -> ".join(_cycle(g))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
