"""`make demo`, the README's first command, run as written: it makes its own repository,
snapshots the sample job twice, kills it, restores it and finds the uninterrupted result."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import PY, ROOT

pytestmark = pytest.mark.criu


def test_demo_restores_the_sample_job_with_the_uninterrupted_result(tmp_path):
    r = subprocess.run([PY, "-m", "gpusnap.samples.demo", "--mb", "16", "--steps", "150",
                        "--repo", str(tmp_path / "demo-repo")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                            "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    expected = re.search(r"uninterrupted run: result (\w+)", r.stdout).group(1)
    finished = re.search(r"restored job finished: result (\w+)… identical", r.stdout)
    assert finished and finished.group(1) == expected, r.stdout
    # the repository it made is a real one, holding both snapshots
    ls = subprocess.run([PY, "-m", "gpusnap", "ls", "--json", "--repo", str(tmp_path / "demo-repo")],
                        cwd=ROOT, capture_output=True, text=True)
    assert ls.returncode == 0, ls.stderr
    assert ls.stdout.count('"demo-') >= 2, ls.stdout
