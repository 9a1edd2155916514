"""docs/exit-codes.md lists exactly the error classes and codes of gpusnap/errors.py."""

import re
from pathlib import Path

from gpusnap.errors import all_error_classes

DOC = Path(__file__).resolve().parent.parent / "docs" / "exit-codes.md"


def test_doc_matches_the_hierarchy():
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", DOC.read_text(), re.M)
    documented = {name: int(code) for code, name in rows}
    actual = {c.__name__: c.exit_code for c in all_error_classes()}
    assert documented == actual


def test_codes_are_unique():
    codes = [c.exit_code for c in all_error_classes()]
    assert len(codes) == len(set(codes))
