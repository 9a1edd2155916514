"""The layout docs/architecture.md describes, kept: imports run one way (the layers below the
commands never import the CLI, the renderers or the commands), and no module is much over
400 lines unless its docstring says why. Read from the source with ast, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpusnap

ROOT = Path(gpusnap.__file__).parent
MAX_LINES = 420

# The layers, top down (docs/architecture.md): cli -> ops -> {criu | repo | gpu} ->
# {staging, system} -> errors, with render beside cli. A module imports its own package and
# the layers below its own, never one beside it or above; the only arrows within a layer are
# these (the command line hands results to render; completions are made from the command tree).
LAYER = {"cli": 5, "render": 5, "completion": 5, "samples": 5, "__main__": 5,
         "ops": 4,
         "criu": 3, "repo": 3, "gpu": 3,
         "staging": 2, "system": 2,
         "errors": 1, "settings": 1, "gpusnap": 0}
ACROSS = {("cli", "render"), ("completion", "cli"), ("__main__", "cli")}


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


def _package(module: str) -> str | None:
    """The layer package of a dotted gpusnap module name ('gpusnap' itself for its root)."""
    parts = module.split(".")
    if parts[0] != "gpusnap":
        return None
    if len(parts) == 1 or parts[1] not in LAYER:
        return "gpusnap"
    return parts[1]


def _own_package(path: Path) -> str:
    first = path.relative_to(ROOT).parts[0]
    return first[:-3] if first.endswith(".py") else first


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_down_the_layers(path):
    """Every import, lazy ones included (issue 34: the full matrix, no exceptions)."""
    me = _own_package(path)
    assert me in LAYER or path.name == "__init__.py", f"{path.relative_to(ROOT)} is in no layer"
    me = me if me in LAYER else "gpusnap"
    bad = sorted({m for m in _imported(path)
                  if (to := _package(m)) and to != me and to != "gpusnap"
                  and not (LAYER[to] < LAYER[me] or (me, to) in ACROSS)})
    assert not bad, f"{path.relative_to(ROOT)} ({me}) imports {bad}"


def test_the_checker_sees_an_upward_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from gpusnap.render.output import OUTPUT\n")
    assert "gpusnap.render.output" in _imported(p)
    assert _package("gpusnap.render.output") == "render" and not LAYER["render"] < LAYER["repo"]


def test_the_checker_sees_a_sideways_import():
    """criu and repo stand side by side: an arrow between them is one the test refuses."""
    assert LAYER["criu"] == LAYER["repo"] and ("criu", "repo") not in ACROSS and ("repo", "criu") not in ACROSS


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small_or_say_why(path):
    n = len(path.read_text().splitlines())
    if n <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "400 lines" in doc, f"{path.relative_to(ROOT)} has {n} lines and its docstring gives no reason"


# commands whose whole work is one call into a lower layer: no operation of their own
_NO_OPERATION = {"init": "Repository.init (repo/repository.py) is the command",
                 "ps": "gpu/procs.py gpu_processes() is the command"}


def _commands() -> list[str]:
    from gpusnap.cli import _COMMANDS

    return sorted({group or name for group, name, _, _ in _COMMANDS})


@pytest.mark.parametrize("command", _commands())
def test_each_command_has_its_operation_module_named_after_it(command):
    """ops/ has one naming rule (issue 34): the module of `gpusnap CMD` is ops/CMD.py, or the
    package ops/CMD/ ('-' as '_'; `import` is a keyword, so import_.py as PEP 8 says)."""
    if command in _NO_OPERATION:
        assert not (ROOT / "ops" / f"{command}.py").exists()
        return
    stem = command.replace("-", "_") + ("_" if command == "import" else "")
    assert (ROOT / "ops" / f"{stem}.py").is_file() or (ROOT / "ops" / stem / "__init__.py").is_file(), \
        f"`gpusnap {command}` has no ops/{stem}.py"


def test_one_materialize():
    assert sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("materialize.py")) == ["repo/materialize.py"]


MAX_OPS_FUNCTION = 80


@pytest.mark.parametrize("path", _modules("ops"), ids=lambda p: str(p.relative_to(ROOT)))
def test_operations_are_made_of_short_functions(path):
    """No function in ops/ over about 80 lines (issue 34): a dump and a restore are objects
    and plans whose steps are their own functions, not one long body with its own unwinding."""
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_OPS_FUNCTION]
    assert not long, f"{path.relative_to(ROOT)}: {', '.join(long)}"


def _not_run(path: Path) -> set[str]:
    """Modules imported only for type checking (`if TYPE_CHECKING:`), or on a line that says it
    is a lazy import and why ("# lazy: ..."): no part of an import cycle at run time."""
    lines = path.read_text().splitlines()
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and getattr(b.test, "id", "") == "TYPE_CHECKING"
                   for n in ast.walk(b)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                id(node) in typing_only or "# lazy:" in lines[node.lineno - 1]):
            out.add(node.module)
    return out


def test_no_import_cycle_but_a_lazy_import_that_says_why():
    """No circle among gpusnap's modules (issue 34), lazy imports included, other than one
    closed by an import whose line says it is lazy and why."""
    mods = {}
    for p in _modules():
        name = ".".join(("gpusnap", *p.relative_to(ROOT).with_suffix("").parts))
        mods[name.removesuffix(".__init__")] = p
    graph = {m: {i for i in _imported(p) if i in mods and i != m} - _not_run(p) for m, p in mods.items()}
    seen, cycles = set(), []

    def walk(m, path):
        if m in path:
            cycles.append(path[path.index(m):] + [m])
            return
        if m in seen:
            return
        for n in sorted(graph[m]):
            walk(n, path + [m])
        seen.add(m)

    for m in sorted(graph):
        walk(m, [])
    assert not cycles, cycles[:3]
