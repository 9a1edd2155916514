"""Docker through the container mode (issue 36): `gpusnap dump --container` drives Docker's own
checkpoint and stores it deduplicated, `restore` starts the stopped container from it, and a
Python job in the container (tests/container_job.py) ends with exactly the digest of an
uninterrupted run.

The test starts its own dockerd (Debian's docker.io, scripts/test-deps.sh) in experimental
mode, on a socket, data root and exec root of its own, with no bridge and without touching
iptables (other tests check the firewall rules); gpusnap finds it through DOCKER_HOST, which
it passes on to the docker CLI. Containers run with runc, which calls the first `criu` on
the daemon's PATH (CRIU 4.2.1 in /usr/local/sbin here), and no network. The daemon is stopped
and its containers removed at the end of the module; its data root (with the job's image) is
kept for the next run. A daemon that cannot start fails these tests, unless DOCKER=0 leaves
them out."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import container_job
from conftest import GPUSNAP, ROOT, run_gpusnap, run_json, wait_for
from gpusnap.errors import Interrupted, NotDumpable, ProcessNotFound, UsageError
from gpusnap.ops import schedule
from test_container_pyjob import done_digest, progress
from test_schedule import _run_as_cron, installed_gpusnap, sched_env  # noqa: F401 - fixtures

STEPS, DELAY = 500, 0.02
DATA = Path("/var/tmp/gpusnap-docker")          # kept between runs: the job's image stays imported
EXEC = Path("/run/gpusnap-docker")
SOCK = "/run/gpusnap-docker.sock"
PIDFILE = Path("/run/gpusnap-docker.pid")
LOCK = Path("/var/tmp/gpusnap-docker.lock")      # one such daemon at a time on this machine
RUN_OPTS = ["--runtime", "runc", "--network", "none"]


def _docker(*args, timeout=120, check=False) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", "-H", f"unix://{SOCK}", *args], capture_output=True, text=True, timeout=timeout)
    assert not check or r.returncode == 0, r.stderr
    return r


def _firewall() -> str:
    r = subprocess.run(["iptables", "-S"], capture_output=True, text=True) if shutil.which("iptables") else None
    return "\n".join(ln for ln in (r.stdout if r else "").splitlines() if "DOCKER" in ln)


def _stop_stale_daemon() -> None:
    """A dockerd a killed run left on these paths (the lock is ours now, so it is no one's)."""
    try:
        pid = int(PIDFILE.read_text())
        if Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd":
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: not Path(f"/proc/{pid}").exists(), "a stale dockerd to stop", timeout=60)
    except (OSError, ValueError):
        pass


@pytest.fixture(scope="module")
def dockerd():
    """Our own dockerd, DOCKER_HOST naming it for gpusnap; stopped at the end."""
    if os.environ.get("DOCKER") == "0":
        pytest.skip("DOCKER=0: the Docker tests are switched off")
    assert shutil.which("dockerd") and shutil.which("docker"), \
        "scripts/test-deps.sh installs docker.io (DOCKER=0 leaves these tests out)"
    lock = open(LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    _stop_stale_daemon()
    firewall = _firewall()
    # runc finds CRIU on the daemon's PATH
    env = {**os.environ, "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    log = open("/var/tmp/gpusnap-dockerd.log", "w")
    d = subprocess.Popen(["dockerd", "--experimental", "--iptables=false", "--ip-masq=false", "--ip-forward=false",
                          "--bridge=none", "--data-root", str(DATA), "--exec-root", str(EXEC), "-H", f"unix://{SOCK}",
                          "--pidfile", str(PIDFILE)], stdout=log, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)
    old = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = f"unix://{SOCK}"
    try:
        deadline = time.monotonic() + 60
        while _docker("version", timeout=30).returncode != 0:
            assert d.poll() is None and time.monotonic() < deadline, \
                "dockerd did not start (DOCKER=0 leaves these tests out):\n" + Path(log.name).read_text()[-2000:]
            time.sleep(0.3)
        assert _firewall() == firewall, "dockerd changed the firewall rules"
        yield
    finally:
        ids = _docker("ps", "-aq").stdout.split()
        if ids:
            _docker("rm", "-f", *ids)
        d.terminate()
        try:
            d.wait(60)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()
        shutil.rmtree(EXEC, ignore_errors=True)
        if old is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = old
        log.close()
        lock.close()


@pytest.fixture(scope="module")
def image(dockerd):
    return container_job.ensure_image(["docker", "-H", f"unix://{SOCK}"])


@pytest.fixture
def ctr(image):
    """A running container of the Python job; (its name, its job's PID)."""
    name = f"gpusnap-dk-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    _docker("run", "-d", "--name", name, *RUN_OPTS, image, *container_job.command(STEPS, DELAY), check=True)
    pid = _pid(name)
    wait_for(lambda: progress(pid) >= 20, "the Python job to make progress")
    yield name, pid
    _docker("rm", "-f", name)


def _pid(name: str) -> int:
    return int(_docker("inspect", "-f", "{{.State.Pid}}", name).stdout.strip() or 0)


def _running(name: str) -> bool:
    return _docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() == "true"


def _no_checkpoints(name: str) -> None:
    """Docker keeps nothing of gpusnap's checkpoints once a dump or a restore is over."""
    cid = _docker("inspect", "-f", "{{.Id}}", name).stdout.strip()
    left = list((DATA / "containers" / cid / "checkpoints").glob("*"))
    assert not left, left


def _ends_with_the_uninterrupted_digest(name: str) -> None:
    assert _docker("wait", name, timeout=180).stdout.strip() == "0"
    logs = _docker("logs", name).stdout
    assert done_digest(logs) == container_job.run(STEPS, 0), logs


def test_a_python_job_in_a_docker_container_killed_and_restored_ends_with_the_uninterrupted_digest(ctr, tmp_path):
    name, pid = ctr
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    one = run_json("dump", "--container", name, "--repo", repo)
    two = run_json("dump", "--container", name, "--repo", repo)
    assert one["name"] == name and one["job_running"] and two["job_running"], (one, two)
    assert one["pages_total"] >= container_job.PAGES and two["pages_dedup"] >= container_job.PAGES // 2, (one, two)
    assert two["bytes_stored"] < one["bytes_stored"] // 4, (one, two)
    assert _running(name) and progress(pid) < STEPS
    _no_checkpoints(name)
    ins = run_json("inspect", two["snapshot"], "--repo", repo)
    assert ins["container"]["engine"] == "docker" and ins["container"]["name"] == name, ins["container"]
    assert run_gpusnap("verify", "--repo", repo).returncode == 0
    _docker("kill", name, check=True)                                  # the crash: the container stays, stopped
    r = run_json("restore", two["snapshot"], "--repo", repo)
    assert r["via"] == "docker" and r["job"] == name and r["fork_of"] is None and r["pid"] == _pid(name) > 0, r
    _no_checkpoints(name)
    _ends_with_the_uninterrupted_digest(name)
    print(f"docker, Python job: dump {one['seconds']} s then {two['seconds']} s, "
          f"stored {one['bytes_stored']} then {two['bytes_stored']} bytes, restore {r['seconds']} s")


def test_dump_exit_then_a_removed_container_is_made_again_by_the_user_and_restored(ctr, image, tmp_path):
    """--exit leaves the container stopped. Removed, it cannot come back from the checkpoint
    alone: the restore says how to make it again, and restores into the one made so."""
    name, _ = ctr
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    d = run_json("dump", "--container", name, "--exit", "--repo", repo)
    assert not d["job_running"] and not _running(name)
    _docker("rm", name, check=True)
    r = run_gpusnap("restore", d["snapshot"], "--repo", repo, "--json")
    err = json.loads(r.stdout)
    assert r.returncode == UsageError.exit_code and f"docker create --name {name}" in err["hint"], err
    assert image in err["hint"], err
    _docker("create", "--name", name, *RUN_OPTS, image, *container_job.command(STEPS, DELAY), check=True)
    r = run_json("restore", d["snapshot"], "--repo", repo)
    assert r["via"] == "docker" and r["job"] == name, r
    _ends_with_the_uninterrupted_digest(name)


def test_a_running_container_is_not_replaced_by_a_restore(ctr, tmp_path):
    name, pid = ctr
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    d = run_json("dump", "--container", name, "--repo", repo)
    r = run_gpusnap("restore", d["snapshot"], "--repo", repo, "--json")
    assert r.returncode == UsageError.exit_code and f"docker stop {name}" in json.loads(r.stdout)["hint"], r.stdout
    assert _pid(name) == pid and _running(name)
    r = run_gpusnap("restore", d["snapshot"], "--repo", repo, "--via", "files", "--json")
    assert r.returncode == UsageError.exit_code and "Docker restores it" in r.stdout, r.stdout


def test_the_preflight_names_the_docker_container_and_the_command_that_works(ctr, tmp_path):
    name, pid = ctr
    cid = _docker("inspect", "-f", "{{.Id}}", name).stdout.strip()
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    r = run_gpusnap("dump", pid, "--repo", repo, "--json")
    assert r.returncode == NotDumpable.exit_code, r.stdout + r.stderr
    err = json.loads(r.stdout)
    assert f"the docker container {cid[:12]}" in err["message"], err
    cmd = re.search(r"`gpusnap (dump --container [^`]+)`", err["hint"]).group(1)
    before = progress(pid)
    d = run_json(*cmd.split(), "--repo", repo)
    assert d["job_running"] and d["pages_total"] > 0, d
    wait_for(lambda: progress(pid) > before + 2, "the job to go on")


def test_the_engine_is_the_one_that_knows_the_container_or_the_one_given(ctr, tmp_path):
    name, _ = ctr
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    r = run_gpusnap("dump", "--container", name, "--engine", "podman", "--repo", repo, "--json")
    assert r.returncode == ProcessNotFound.exit_code and "no Podman container" in r.stdout, r.stdout
    d = run_json("dump", "--container", name, "--engine", "docker", "--repo", repo)
    assert d["name"] == name
    r = run_gpusnap("dump", "--engine", "docker", "123", "--repo", repo, "--json")
    assert r.returncode == UsageError.exit_code and "--engine only says" in r.stdout, r.stdout


def test_a_schedule_of_a_docker_container_runs_from_cron_without_docker_host(ctr, sched_env, installed_gpusnap,
                                                                            tmp_path):
    """The cron line runs with cron's bare environment: the schedule recorded the engine and
    the daemon's DOCKER_HOST when it was added."""
    name, pid = ctr
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    p = run_gpusnap("schedule", "add", "--container", name, "--name", "dksched", "--every", "5m",
                    "--keep-last", "2", "--repo", repo, "--json", env=sched_env)
    assert p.returncode == 0, p.stdout + p.stderr
    s = schedule.load("dksched")
    assert s.engine == "docker" and s.docker_host == f"unix://{SOCK}", s
    for _ in range(2):
        r = _run_as_cron(s.path)
        assert r.returncode == 0, r.stdout + r.stderr
    recs = [json.loads(ln) for ln in open(s.log).read().splitlines()]
    assert [x["outcome"] for x in recs] == ["ok", "ok"] and recs[1]["pages_dedup"] > 0 and recs[0]["pid"] == pid, recs
    st = run_json("schedule", "ls", env=sched_env)["schedules"][0]
    assert st["container"] == name and st["job_pid"] == pid, st
    run_gpusnap("schedule", "rm", "dksched", env=sched_env, check=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_dump_interrupted_while_docker_checkpoints_keeps_nothing_and_the_container_runs(ctr, tmp_path, sig):
    name, pid = ctr
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    p = subprocess.Popen([*GPUSNAP, "dump", "--container", name, "--repo", str(repo), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def checkpointing() -> bool:
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split() if p.poll() is None else []
        return any(b"checkpoint\0create" in Path(f"/proc/{k}/cmdline").read_bytes() for k in kids
                   if Path(f"/proc/{k}/cmdline").exists())

    wait_for(lambda: checkpointing() or p.poll() is not None, "docker's checkpoint to start")
    assert p.poll() is None, p.communicate()
    p.send_signal(sig)
    out, err = p.communicate(timeout=300)
    assert p.returncode == Interrupted.exit_code, out + err
    assert "left to Docker and no snapshot was kept" in json.loads(out)["message"]
    assert not any((repo / "snapshots").iterdir())
    _no_checkpoints(name)
    before = progress(pid)
    wait_for(lambda: progress(pid) > before + 2, "the job to go on")
