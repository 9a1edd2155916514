"""No silent repository at a typo (issue 30 items 7 and 9): `gpusnap init` makes a repository;
dump, run and import make one by themselves only at the default location ($GPUSNAP_REPO, else
/var/lib/gpusnap). Anywhere else a missing repository is one error (exit 14), the same in every
command, naming the path and `gpusnap init`, and nothing is made. `--repo` is accepted before
the command too. `gpusnap run` as a non-root user is the not-root error and leaves nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, require_nobody_can_run, run_gpusnap, run_json
from gpusnap.errors import NotRoot, RepositoryError

ENV_NO_DEFAULT = {"GPUSNAP_REPO": "/var/lib/gpusnap-test-default-is-elsewhere"}


def _typo_commands(typo: Path, pid: int, tmp_path: Path) -> list[list]:
    export = tmp_path / "some.gsx"
    export.write_bytes(b"not read: the repository is checked first")
    return [
        ["ls"], ["dump", pid, "--name", "x"], ["inspect", "x"], ["verify"], ["verify", "x"], ["repair"],
        ["prune", "--keep-last", "1"], ["forget", "x"], ["export", "x", "-o", tmp_path / "out.gsx"],
        ["import", export], ["restore", "x"],
        ["schedule", "add", "--name", "x", "--match", "no-such-job-xyz", "--every", "30m"],
        ["slurm-run", "--name", "x", "--", "true"], ["run", "--", "true"],
    ]


def test_a_typo_is_one_error_in_every_command_and_nothing_is_made(tmp_path):
    base = tmp_path / "data"
    base.mkdir()
    typo = base / "gpusnpa" / "repo"
    env = {**ENV_NO_DEFAULT, "GPUSNAP_SCHEDULE_DIR": str(tmp_path / "schedules"),
           "GPUSNAP_CRON_DIR": str(tmp_path / "cron.d"), "GPUSNAP_LOG_DIR": str(tmp_path / "log"),
           "GPUSNAP_SCHEDULER": "cron"}
    job = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        for cmd in _typo_commands(typo, job.pid, tmp_path):
            k = cmd.index("--") if "--" in cmd else len(cmd)   # run, slurm-run: options before the job's
            for args in ([*cmd[:k], "--repo", typo, *cmd[k:]], ["--repo", typo, *cmd]):
                p = run_gpusnap(*args, env=env)
                assert p.returncode == RepositoryError.exit_code, (args, p.returncode, p.stdout, p.stderr)
                assert p.stderr.startswith(f"gpusnap: no gpusnap repository at {typo}\n"), (args, p.stderr)
                assert f"gpusnap init --repo {typo}" in p.stderr, (args, p.stderr)
                assert os.listdir(base) == [], (args, os.listdir(base))
            if cmd[0] != "slurm-run":
                j = run_gpusnap(*cmd[:k], "--repo", typo, "--json", *cmd[k:], env=env)
                obj = json.loads(j.stdout)
                assert (j.returncode, obj["message"]) == (14, f"no gpusnap repository at {typo}"), cmd
        assert job.poll() is None                  # the dump refused before touching the job
        assert not (tmp_path / "schedules").exists() or os.listdir(tmp_path / "schedules") == []
    finally:
        job.kill()
        job.wait()


@pytest.mark.criu
def test_init_then_dump_and_ls(tmp_path, sample_job, monkeypatch):
    monkeypatch.setenv("GPUSNAP_REPO", ENV_NO_DEFAULT["GPUSNAP_REPO"])
    repo = tmp_path / "lab" / "snaps"
    old = os.umask(0)                 # whatever the umask: private
    try:
        made = run_json("init", "--repo", repo)
    finally:
        os.umask(old)
    assert made["repository"] == str(repo) and len(made["id"]) == 32
    assert (repo / "config").stat().st_mode & 0o777 == 0o600
    assert repo.stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "lab").stat().st_mode & 0o777 == 0o755      # made above it: writable by root only
    again = run_gpusnap("init", "--repo", repo)
    assert again.returncode == RepositoryError.exit_code and "already a gpusnap repository" in again.stderr
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    snap = run_json("dump", job.pid, "--repo", repo, "--name", "fold")
    assert Path(snap["snapshot"]).parent == repo / "snapshots"
    assert [s["name"] for s in run_json("--repo", repo, "ls")["snapshots"]] == ["fold"]
    assert run_gpusnap("verify", "fold", "--repo", repo).returncode == 0
    assert job.alive()


@pytest.mark.criu
def test_the_default_location_is_made_by_the_first_run(tmp_path, monkeypatch):
    """$GPUSNAP_REPO (the default location) needs no init: `run` makes it."""
    default = tmp_path / "default-repo"
    monkeypatch.setenv("GPUSNAP_REPO", str(default))
    p = run_gpusnap("run", "--json", "--name", "sleeper", "--", "sleep", "600", check=True)
    job = json.loads(p.stdout)
    try:
        assert (default / "config").is_file() and default.stat().st_mode & 0o777 == 0o700
        assert (default / "jobs" / "sleeper").is_dir()
    finally:
        kill_pids([job["pid"]])


def test_repo_before_the_command(tmp_path):
    repo = tmp_path / "r"
    run_gpusnap("--repo", repo, "init", check=True, env=ENV_NO_DEFAULT)
    after = run_json("ls", "--repo", repo, env=ENV_NO_DEFAULT)
    assert run_json("--repo", repo, "ls", env=ENV_NO_DEFAULT) == after
    assert run_json(f"--repo={repo}", "ls", env=ENV_NO_DEFAULT) == after
    assert after["repository"] == str(repo)
    # given after the command too, that one wins
    assert run_json("--repo", tmp_path / "elsewhere", "ls", "--repo", repo, env=ENV_NO_DEFAULT) == after
    top = run_gpusnap("--help")
    assert "--repo" in top.stdout and "init" in top.stdout
    assert "gpusnap --repo DIR" in run_gpusnap("ls", "--help").stdout.replace("\n", " ")
    p = run_gpusnap("--repo", repo)
    assert p.returncode == 2 and "needs a command" in p.stderr, p.stderr


def test_dump_into_a_directory_that_is_no_repository(tmp_path):
    """`dump --repo /proc` said "less than 64 MiB free" (exit 11)."""
    job = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        for where in ("/proc", tmp_path):
            (tmp_path / "keep").write_text("x")
            p = run_gpusnap("dump", job.pid, "--repo", where, env=ENV_NO_DEFAULT)
            assert p.returncode == RepositoryError.exit_code, (where, p.returncode, p.stderr)
            assert f"{where} is not a gpusnap repository" in p.stderr, p.stderr
            assert "gpusnap init" in p.stderr
        assert sorted(os.listdir(tmp_path)) == ["keep"]       # no tmp/ or locks/ made in it
        assert job.poll() is None
    finally:
        job.kill()
        job.wait()


def test_run_as_a_user_is_the_not_root_error_and_leaves_nothing():
    """It was exit 2 ("bad command line"), with a repository owned by that user left behind."""
    require_nobody_can_run()
    base = Path(tempfile.mkdtemp(prefix="gpusnap-run-user-", dir="/tmp"))
    try:
        os.chmod(base, 0o1777)          # as /tmp: anyone may make a directory in it
        for repo in (base / "repo", None):       # with --repo, and at the default location
            env = {"PATH": os.environ["PATH"], "GPUSNAP_REPO": str(base / "default"), "PYTHONPATH": str(ROOT)}
            args = [*GPUSNAP, "run", *(["--repo", str(repo)] if repo else []), "--", "sleep", "600"]
            p = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *args],
                               capture_output=True, text=True, cwd="/", env=env, timeout=120)
            assert p.returncode == NotRoot.exit_code, (p.returncode, p.stdout, p.stderr)
            assert "must run as root" in p.stderr and "Traceback" not in p.stderr
            assert os.listdir(base) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_completions_offer_init_and_read_the_repo_given_before_the_command(tmp_path):
    (tmp_path / "r" / "snapshots" / "train-20261130T101500Z").mkdir(parents=True)
    script = ROOT / "completions" / "gpusnap.bash"

    def bash(line: str) -> list[str]:
        probe = (f"source {script}; COMP_WORDS=({line}); COMP_CWORD=$((${{#COMP_WORDS[@]}}-1)); _gpusnap; "
                 "printf '%s\\n' \"${COMPREPLY[@]}\"")
        out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout
        return sorted(x for x in out.splitlines() if x)

    assert bash("gpusnap in") == ["init", "inspect"]
    assert bash(f"gpusnap --repo {tmp_path / 'r'} restore tr") == ["train", "train-20261130T101500Z"]
    [top] = re.findall(r'^ *""\) echo "([^"]*)"', (ROOT / "completions" / "_gpusnap").read_text(), re.M)
    assert "init" in top.split() and "--repo" in top.split()
    assert "complete -c gpusnap -n '__fish_use_subcommand' -a init\n" in (ROOT / "completions" / "gpusnap.fish").read_text()


@pytest.mark.criu
def test_a_creation_killed_before_its_config_is_finished_by_the_next(tmp_path, monkeypatch, sample_job):
    """The first dump at the default location makes the repository while its staging memory
    is faulted in, so the OOM killer (or kill -9) can stop it between the subdirectories and
    the config. Every command then names the cut-short creation (not "not a repository"), and
    the next dump there, or `init`, finishes it instead of refusing a directory not empty."""
    default = tmp_path / "default-repo"
    monkeypatch.setenv("GPUSNAP_REPO", str(default))
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    for finish in (["dump", job.pid, "--name", "first"], ["init", "--repo", default]):
        shutil.rmtree(default, ignore_errors=True)
        p = run_gpusnap(*finish, env={"GPUSNAP_FAULT": "repo:created-subdirs:KILL"})
        assert p.returncode == -9, p.stderr
        assert not (default / "config").exists() and sorted(os.listdir(default)) == sorted(
            ["packs", "index", "snapshots", "locks", "tmp"])
        ls = run_gpusnap("ls", "--repo", default)
        assert ls.returncode == RepositoryError.exit_code and "was cut short" in ls.stderr, ls.stderr
        assert "gpusnap init --repo" in ls.stderr
        (default / "tmp" / "w-0123456789abcdef.tmp").write_bytes(b"a config half written")
        run_json(*finish)
        assert (default / "config").is_file() and os.listdir(default / "tmp") == []
        names = [s["name"] for s in run_json("ls", "--repo", default)["snapshots"]]
        assert names == ([] if finish[0] == "init" else ["first"])
    assert job.alive()
    # what a killed creation cannot have left is still refused: a file of the user's beside it
    shutil.rmtree(default)
    assert run_gpusnap("init", "--repo", default, env={"GPUSNAP_FAULT": "repo:created-subdirs:KILL"}).returncode == -9
    (default / "index" / "notes.txt").write_text("mine")
    p = run_gpusnap("init", "--repo", default)
    assert p.returncode == RepositoryError.exit_code and "is not empty" in p.stderr, p.stderr
    assert (default / "index" / "notes.txt").read_text() == "mine"
