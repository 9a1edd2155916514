"""docs/environment.md lists every GPUSNAP_* environment variable, and nothing else.

A name the product code (gpusnap/*.py, native/ *.c and *.h) mentions must have a row in the
doc's first table; a name with a row in any table of the doc must still appear somewhere in
gpusnap/, native/ or scripts/. Names ending in _H (include guards, preprocessor macros) are
not variables. A per-process name built from a prefix (GPUSNAP_GPU_MAP_<pid>, "..._%d",
f"..._{pid}") counts as NAME_<pid>. Read from the text, no import."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "environment.md"

# a name, optionally followed by a per-process suffix written one of the three ways the code does
NAME = re.compile(r"GPUSNAP_[A-Z0-9_]*[A-Z0-9](_(?:<pid>|%d|\{[^}]*\}))?")
ROW = re.compile(r"^\|\s*`(GPUSNAP_[A-Z0-9_<>a-z]+)`\s*\|", re.M)


def names_in(text: str) -> set[str]:
    out = set()
    for m in NAME.finditer(text):
        name = m.group(0)
        if m.group(1):
            name = name[: m.start(1) - m.start(0)] + "_<pid>"
        if not name.endswith("_H"):
            out.add(name)
    return out


def product_names() -> set[str]:
    files = [*(ROOT / "gpusnap").rglob("*.py"), *(ROOT / "native").rglob("*.c"), *(ROOT / "native").rglob("*.h")]
    return set().union(*(names_in(p.read_text(errors="replace")) for p in files))


def used_names() -> set[str]:
    files = [p for d in ("gpusnap", "native", "scripts") for p in (ROOT / d).rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    return set().union(*(names_in(p.read_text(errors="replace")) for p in files))


def documented(text: str) -> tuple[set[str], set[str]]:
    """(the first table's names, every table's names)."""
    sections = text.split("\n## ")
    first = next(s for s in sections[1:] if ROW.search(s))
    return set(ROW.findall(first)), set(ROW.findall(text))


def test_every_variable_the_product_reads_is_documented():
    product, _ = documented(DOC.read_text())
    missing = sorted(product_names() - product)
    assert not missing, f"read in gpusnap/ or native/ but not in {DOC.relative_to(ROOT)}'s first table: {missing}"


def test_every_documented_variable_is_still_read():
    _, every = documented(DOC.read_text())
    stale = sorted(every - used_names())
    assert not stale, f"in {DOC.relative_to(ROOT)} but no longer in gpusnap/, native/ or scripts/: {stale}"


def test_the_name_reader_sees_each_form():
    text = ('os.environ.get("GPUSNAP_ABC")  f"{GPU_MAP_ENV}_{pid}"  "GPUSNAP_X_MAP_%d"  '
            "GPUSNAP_X_MAP_<pid>  f\"GPUSNAP_Y_{pid}\"  #ifndef GPUSNAP_GS_TREE_H  GPUSNAP_*_DIR")
    assert names_in(text) == {"GPUSNAP_ABC", "GPUSNAP_X_MAP_<pid>", "GPUSNAP_Y_<pid>"}


def test_the_settings_gpusnap_reads_are_the_documented_user_and_test_only_ones():
    """gpusnap/settings.py NAMES (what the Python code reads, through settings.get) is exactly
    the first table's rows for users and tests; the internal ones are set for others."""
    first = DOC.read_text().split("\n## ")[1]          # gpusnap and its native parts
    rows = re.findall(r"^\|\s*`(GPUSNAP_[A-Z0-9_]+)`\s*\|\s*([^|]+?)\s*\|", first, re.M)
    read = {n for n, who in rows if not who.startswith("internal")}
    from gpusnap import settings

    assert set(settings.NAMES) == read and len(settings.NAMES) == len(set(settings.NAMES))


def test_no_module_reads_a_setting_from_the_environment_itself():
    """Settings are read in one place (gpusnap/settings.py): anything else asks settings.get."""
    direct = re.compile(r"""(environ(\.get)?\s*[\[(]\s*["']GPUSNAP_|getenv\(\s*["']GPUSNAP_|["']GPUSNAP_\w+["']\s+in\s+os\.environ)""")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "gpusnap").rglob("*.py")
                 if p.name != "settings.py" and direct.search(p.read_text())
                 and not all("GPUSNAP_RUN_INIT" in ln for ln in p.read_text().splitlines() if direct.search(ln))]
    assert not offenders, offenders
    assert direct.search('os.environ.get("GPUSNAP_X")') and direct.search('"GPUSNAP_X" in os.environ')
