"""`gpusnap run` makes its job directory and files private whatever the umask, and never
follows a link planted there: under umask 000 today's main made REPO/jobs 0777 and the job's
files 0666, and user nobody could plant `jobs/NAME/stdout.log` and `jobs/NAME/job.json.tmp` as
links to root files, which the next `run --name NAME` truncated and overwrote as root.
Real `gpusnap run`, a real attacker (setpriv to nobody).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, ROOT, require_nobody_can_run, run_gpusnap

AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
SECRET = b"root's file\n" * 100

PLANT = r'''
import os, sys
jobs, victim = sys.argv[1], sys.argv[2]
os.rename(os.path.join(jobs, "j1"), os.path.join(jobs, "j1.old"))
os.mkdir(os.path.join(jobs, "j1"), 0o777)
for name in ("stdout.log", "stderr.log", "job.json.tmp", "job.json", "exit"):
    os.symlink(victim, os.path.join(jobs, "j1", name))
'''


@pytest.fixture
def world():
    """/tmp/X (0755): a repository directory made beforehand (0755, as an admin's mkdir makes
    it), and a root file (0600) for the attacker to aim at."""
    require_nobody_can_run()
    top = Path(tempfile.mkdtemp(prefix="gpusnap-run-", dir="/tmp"))
    os.chmod(top, 0o755)
    repo = top / "repo"
    repo.mkdir(mode=0o755)
    run_gpusnap("init", "--repo", repo, check=True)     # (not the default location: no run makes it)
    os.chmod(repo, 0o755)
    victim = top / "victim"
    victim.write_bytes(SECRET)
    os.chmod(victim, 0o600)
    yield repo, victim
    shutil.rmtree(top, ignore_errors=True)


def _run_umask000(repo: Path, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", 'umask 000 && exec "$@"', "sh", *GPUSNAP, "run", "--name", "j1",
                           "--repo", str(repo), "--", *cmd], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def _wait_exit(d: Path) -> None:
    deadline = time.monotonic() + 60
    while not (d / "exit").exists():
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.05)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _victim_intact(victim: Path) -> None:
    st = os.stat(victim)
    assert victim.read_bytes() == SECRET, "a root file was overwritten through a planted link"
    assert (st.st_uid, _mode(victim)) == (0, 0o600)


def test_run_under_umask_000_makes_private_job_files_and_a_planted_link_hurts_nothing(world):
    repo, victim = world
    r = _run_umask000(repo, "sh", "-c", "echo first run")
    assert r.returncode == 0, r.stdout + r.stderr
    d = repo / "jobs" / "j1"
    _wait_exit(d)
    assert (_mode(repo / "jobs"), _mode(d)) == (0o700, 0o700)
    assert {p.name: _mode(p) for p in d.iterdir()} == {
        "stdout.log": 0o600, "stderr.log": 0o600, "job.json": 0o600, "exit": 0o600}
    assert (d / "stdout.log").read_text() == "first run\n"
    # the attacker tries to swap the job directory for one full of links to the root file
    plant = subprocess.run([*AS_NOBODY, "/usr/bin/python3", "-I", "-c", PLANT, str(repo / "jobs"), str(victim)],
                           capture_output=True, text=True, timeout=60)
    assert plant.returncode != 0 and "Permission denied" in plant.stderr, plant.stderr
    r = _run_umask000(repo, "sh", "-c", "echo second run")
    assert r.returncode == 0, r.stdout + r.stderr
    _wait_exit(d)
    assert (d / "stdout.log").read_text() == "first run\nsecond run\n"
    _victim_intact(victim)


def test_run_refuses_a_job_directory_another_user_could_have_planted_links_in(world):
    repo, victim = world
    r = _run_umask000(repo, "sh", "-c", "echo first run")
    assert r.returncode == 0, r.stdout + r.stderr
    _wait_exit(repo / "jobs" / "j1")
    os.chmod(repo / "jobs", 0o777)      # as an older gpusnap left it under umask 000
    plant = subprocess.run([*AS_NOBODY, "/usr/bin/python3", "-I", "-c", PLANT, str(repo / "jobs"), str(victim)],
                           capture_output=True, text=True, timeout=60)
    assert plant.returncode == 0, plant.stderr
    r = _run_umask000(repo, "sh", "-c", "echo run")
    _victim_intact(victim)
    assert r.returncode == 14, r.stdout + r.stderr
    assert f"{repo / 'jobs'} is writable by group and others" in r.stderr
    assert os.path.islink(repo / "jobs" / "j1" / "stdout.log")     # left for the admin to see
