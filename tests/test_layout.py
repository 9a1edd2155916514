"""The layout docs/architecture.md describes, kept: imports run one way (the layers below the
commands never import the CLI, the renderers or the commands), and no module is much over
400 lines unless its docstring says why. Read from the source with ast, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpusnap

ROOT = Path(gpusnap.__file__).parent
LOWER = ("repo", "criu", "gpu", "system")          # may not import the layers above them
UPPER = ("gpusnap.cli", "gpusnap.render", "gpusnap.ops")
MAX_LINES = 420


def _modules(*subdirs: str) -> list[Path]:
    dirs = [ROOT / d for d in subdirs] if subdirs else [ROOT]
    return sorted(p for d in dirs for p in d.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("path", _modules(*LOWER), ids=lambda p: str(p.relative_to(ROOT)))
def test_lower_layers_never_import_the_commands(path):
    up = sorted(m for m in _imported(path) if any(m == u or m.startswith(u + ".") for u in UPPER))
    assert not up, f"{path.relative_to(ROOT)} imports {up}"


def test_the_checker_sees_an_upward_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from gpusnap.render.output import OUTPUT\n")
    assert "gpusnap.render.output" in _imported(p)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small_or_say_why(path):
    n = len(path.read_text().splitlines())
    if n <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "400 lines" in doc, f"{path.relative_to(ROOT)} has {n} lines and its docstring gives no reason"
