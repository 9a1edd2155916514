"""One rule for snapshot and job names, one list of codecs (gpusnap/ops/validate.py, from
gpusnap/repo/format/): what `dump`, `run` and `schedule add` accept is exactly what the
repository stores, through a real repository."""

from __future__ import annotations

import random

import pytest

from conftest import run_gpusnap
from gpusnap import completion
from gpusnap.errors import UsageError
from gpusnap.ops import validate
from gpusnap.repo import Repository
from repo_helpers import dump, read_all

LONGEST = "a" + "b" * 99


@pytest.mark.parametrize("name", ["a", "job-1.2_x", "v1+cuda12", LONGEST])
def test_a_name_the_rule_accepts_is_stored_by_the_repository(tmp_path, name):
    assert validate.check_name(name) == name
    repo = Repository.open(tmp_path / "r", create=True)
    snap, _ = dump(repo, {"core-1.img": b"x" * 100}, name=name)
    assert snap.name == name


@pytest.mark.parametrize("name", ["", "-x", ".x", "+x", "a/b", "../evil", "a b", "x\n", LONGEST + "c"])
def test_a_name_the_rule_refuses_is_refused_by_the_repository_too(tmp_path, name):
    with pytest.raises(UsageError):
        validate.check_name(name)
    repo = Repository.open(tmp_path / "r", create=True)
    with pytest.raises(UsageError):
        repo.new_snapshot(name)


@pytest.mark.parametrize("comm", ["python3", "my job!", "...", "+x", "ä" * 50, "a" * 200])
def test_a_default_name_follows_the_rule(comm):
    validate.check_name(validate.default_name(comm))


def test_the_rule_is_refused_by_dump_before_the_job_is_touched(tmp_path):
    proc = run_gpusnap("dump", "1", "--name", LONGEST + "c", "--repo", tmp_path / "r")
    assert proc.returncode == UsageError.exit_code
    assert "up to 100" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("codec", validate.COMPRESS_CHOICES)
def test_every_codec_a_user_may_pass_makes_a_snapshot_that_reads_back(tmp_path, codec):
    rnd = random.Random(7)
    data = bytes(rnd.getrandbits(8) for _ in range(8192)) + b"\0" * 4096 + b"abc" * 3000
    repo = Repository.open(tmp_path / "r", create=True)
    snap, _ = dump(repo, {"pages-1.img": data[:12288], "core-1.img": data}, compress=codec)
    assert read_all(snap, "core-1.img") == data
    assert read_all(snap, "pages-1.img") == data[:12288]


def test_dump_refuses_a_codec_outside_the_list(tmp_path):
    proc = run_gpusnap("dump", "1", "--compress", "gzip", "--repo", tmp_path / "r")
    assert proc.returncode == UsageError.exit_code
    assert all(c in proc.stderr for c in validate.COMPRESS_CHOICES)


def test_completions_offer_exactly_the_codecs_dump_accepts():
    assert list(completion.CODECS) == list(validate.COMPRESS_CHOICES)
