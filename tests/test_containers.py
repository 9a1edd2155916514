"""A job in a container is seen, and never half-dumped (issue 36, item 1): the preflight names
the container and the engine's own checkpoint, refuses before the job is touched, and `doctor`
says the same. With a real Podman from Debian (scripts/test-deps.sh), a container from an image
the test builds out of the host's own `sh`, `sleep` and libc (cached as a local image), run
with runc, no network and the limits this machine lets root set."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, ROOT, run_gpusnap, run_json, wait_for
from gpusnap.errors import Interrupted, NotDumpable, ProcessNotFound, UsageError
from gpusnap.ops import schedule
from gpusnap.system import containers
from test_schedule import _run_as_cron, installed_gpusnap, sched_env  # noqa: F401 - fixtures

IMAGE = "localhost/gpusnap-test-mini:1"
# a counter the test reads through /proc/PID/root: it moves only while the job runs
JOB = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done"


def _podman(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def _image() -> None:
    if _podman("image", "exists", IMAGE).returncode == 0:
        return
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for f in ("/bin/sh", "/usr/bin/sleep"):
            (root / "bin").mkdir(exist_ok=True)
            shutil.copy2(f, root / "bin" / Path(f).name)
        for lib in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
            dst = root / lib.lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib, dst)
        (root / "tmp").mkdir(mode=0o1777)
        tar = subprocess.run(["tar", "-C", str(root), "-c", "."], capture_output=True, check=True).stdout
        r = subprocess.run(["podman", "import", "-", IMAGE], input=tar, capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr


def _start(name: str) -> tuple[str, int]:
    """A running container `name` counting; (its id, its job's PID)."""
    assert shutil.which("podman") and shutil.which("runc"), "scripts/test-deps.sh installs podman and runc"
    _image()
    r = _podman("run", "-d", "--name", name, "--runtime", "runc", "--network", "none",
                "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", IMAGE, "/bin/sh", "-c", JOB)
    if r.returncode != 0:
        pytest.skip(f"podman cannot start a container on this machine: {r.stderr.strip()[-300:]}")
    pid = _pid(name)
    wait_for(lambda: _count(pid) > 0, "the container's job to count")
    return r.stdout.strip(), pid


def _pid(name: str) -> int:
    return int(_podman("inspect", "-f", "{{.State.Pid}}", name).stdout.strip() or 0)


def _remove(*names: str) -> None:
    for n in names:
        _podman("rm", "-f", "-t", "0", n)


@pytest.fixture(scope="module")
def container():
    """(container id, PID of its job) for a running Podman container."""
    name = f"gpusnap-test-{os.getpid()}"
    try:
        yield _start(name)
    finally:
        _remove(name)


@pytest.fixture(scope="module")
def engine_checkpoints(container, tmp_path_factory):
    """Podman's own checkpoint works on this machine (CRIU from inside the container's view):
    what the container mode drives. Where the engine itself cannot, those tests say so and
    skip; the refusal tests above need no checkpoint."""
    out = tmp_path_factory.mktemp("engine") / "probe.tar"
    r = _podman("container", "checkpoint", "--leave-running", "--compress", "none", f"--export={out}",
                container[0], timeout=300)
    if r.returncode != 0:
        pytest.skip(f"podman cannot checkpoint a container on this machine: {r.stderr.strip()[-300:]}")


@pytest.fixture
def ctr_name(engine_checkpoints):
    """A container name for one test; whatever the test made under it (and its forks) goes."""
    name = f"gpusnap-ctr-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    yield name
    _remove(name, f"{name}-fork1")


def _count(pid: int) -> int:
    """The job's counter; the shell truncates the file before each write, so an empty read is
    read again."""
    for _ in range(200):
        try:
            text = Path(f"/proc/{pid}/root/tmp/count").read_text().strip()
        except OSError:
            return 0
        if text:
            return int(text)
        time.sleep(0.005)
    return 0


def _counts_on_from(pid: int, before: int) -> None:
    """The restored shell's counter lives in its memory: its next values follow the dump's
    (a fresh start would write 1, 2, ... over the file the archive brought back)."""
    first = _count(pid)
    wait_for(lambda: _count(pid) != first, "the restored container to count")
    now = _count(pid)
    assert first >= before and now > first, (before, first, now)


def _runs_on(pid: int) -> None:
    """The job was not touched: not stopped, and its counter still moves."""
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state != "T", f"the container's job was left stopped ({state})"
    before = _count(pid)
    wait_for(lambda: _count(pid) > before + 2, "the container's job to go on counting", timeout=30)


@pytest.mark.parametrize("mode", ["leave-running", "exit"])
def test_a_dump_of_a_container_job_is_refused_before_the_job_is_touched(container, tmp_path, mode):
    cid, pid = container
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    r = run_gpusnap("dump", pid, "--repo", repo, "--json", *(["--exit"] if mode == "exit" else []))
    assert r.returncode == NotDumpable.exit_code, r.stdout + r.stderr
    err = json.loads(r.stdout)
    assert f"the podman container {cid[:12]}" in err["message"], err
    assert f"gpusnap dump --container {cid[:12]}" in err["hint"], err
    _runs_on(pid)
    assert not any((repo / "snapshots").iterdir()), "a refused dump left a snapshot"
    assert not list((repo / "logs").glob("failed-dump-*")), "a refused dump ran CRIU"


def test_doctor_says_the_same_as_the_refusal(container):
    cid, pid = container
    r = run_gpusnap("doctor", pid, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    c = checks["container"]
    assert c["status"] == "fail" and f"the podman container {cid[:12]}" in c["detail"], c
    assert c["exit_code"] == NotDumpable.exit_code
    _runs_on(pid)


def test_the_command_the_refusal_names_snapshots_the_container(container, engine_checkpoints, tmp_path):
    """The hint is no guess: the command it names works here, and the job goes on."""
    cid, pid = container
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    hint = run_gpusnap("dump", pid, "--repo", repo, "--json").stdout
    cmd = re.search(r"`gpusnap (dump --container [^`]+)`", json.loads(hint)["hint"]).group(1)
    d = run_json(*cmd.split(), "--repo", repo)
    assert d["job_running"] and d["pages_total"] > 0, d
    _runs_on(pid)


def test_a_private_mount_namespace_on_the_hosts_root_is_no_container(tmp_path):
    """Jobs in namespaces of their own that share the host's root (`gpusnap run`'s PID and IPC
    namespaces, `unshare --mount`) are no container: nothing is refused for it."""
    p = subprocess.Popen(["unshare", "--mount", "--pid", "--ipc", "--fork", "sleep", "120"], start_new_session=True)
    try:
        wait_for(lambda: any(Path(f"/proc/{c}/comm").read_text().strip() == "sleep"
                             for c in _children(p.pid)), "the unshared job to start")
        job = next(c for c in _children(p.pid) if Path(f"/proc/{c}/comm").read_text().strip() == "sleep")
        assert containers.container_of(job) is None
        assert containers.container_of(p.pid) is None
    finally:
        p.kill()
        p.wait()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize("text, want", [
    ("0::/machine.slice/libpod-" + "a" * 64 + ".scope/container", ("podman", "a" * 64)),
    ("9:name=systemd:/libpod_parent/libpod-" + "b" * 64, ("podman", "b" * 64)),
    ("0::/system.slice/docker-" + "c" * 64 + ".scope", ("docker", "c" * 64)),
    ("12:memory:/docker/" + "d" * 64, ("docker", "d" * 64)),
    ("0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + "e" * 64 + ".scope", ("containerd", "e" * 64)),
    ("0::/kubepods/crio-" + "f" * 64 + ".scope", ("cri-o", "f" * 64)),
    ("0::/lxc.payload.web1", ("lxc", "web1")),
    ("0::/user.slice/user-1000.slice/session-3.scope", None),
    ("0::/docker-tools.service", None),
])
def test_the_engines_cgroup_marks(text, want):
    assert containers.cgroup_mark(text) == want


def test_a_gpusnap_inside_the_same_container_sees_a_host():
    """Judged against gpusnap's own cgroup: the same mark on both sides is no container."""
    job = "0::/machine.slice/libpod-" + "a" * 64 + ".scope/container"
    assert containers.foreign_mark(job, "0::/user.slice") == ("podman", "a" * 64)
    assert containers.foreign_mark(job, job) is None
    assert containers.foreign_mark(job, "0::/machine.slice/libpod-" + "b" * 64 + ".scope") == ("podman", "a" * 64)


# -- `dump --container`: through Podman's checkpoint, stored and deduplicated as any snapshot --

def test_a_container_dumped_killed_and_restored_counts_on_from_where_it_was(ctr_name, tmp_path):
    cid, pid = _start(ctr_name)
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    before = _count(pid)
    # Podman writes the archive by its path, as root: never in REPO/tmp, which the repository's
    # owner (maybe another user) could fill with links
    seen, stop = set(), threading.Event()

    def watch():
        while not stop.is_set():
            seen.update(os.listdir(repo / "tmp"))
            time.sleep(0.002)

    w = threading.Thread(target=watch)
    w.start()
    try:
        d = run_json("dump", "--container", ctr_name, "--repo", repo)
    finally:
        stop.set()
        w.join()
    assert not [n for n in seen if n.startswith("container") or n.endswith(".tar")], seen
    assert d["name"] == ctr_name and d["job_running"] and d["pages_total"] > 0, d
    _runs_on(pid)                                    # --leave-running: it went on
    _remove(ctr_name)                                # the crash
    r = run_json("restore", d["snapshot"], "--repo", repo)
    assert r["via"] == "podman" and r["job"] == ctr_name and r["fork_of"] is None, r
    new = _pid(ctr_name)
    assert new == r["pid"] and new > 0
    _counts_on_from(new, before)


def test_a_second_dump_of_a_container_stores_only_what_changed(ctr_name, tmp_path):
    _start(ctr_name)
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    one = run_json("dump", "--container", ctr_name, "--repo", repo)
    two = run_json("dump", "--container", ctr_name, "--repo", repo)
    assert two["pages_dedup"] > 0 and two["bytes_stored"] < one["bytes_stored"], (one, two)
    v = run_gpusnap("verify", "--repo", repo)
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_restore_beside_the_running_container_is_a_fork(ctr_name, tmp_path):
    _, pid = _start(ctr_name)
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    d = run_json("dump", "--container", ctr_name, "--repo", repo)
    r = run_json("restore", d["snapshot"], "--repo", repo)
    assert r["job"] == f"{ctr_name}-fork1" and r["fork_of"] == ctr_name, r
    _runs_on(pid)                                    # the original keeps running and its name
    _runs_on(_pid(f"{ctr_name}-fork1"))
    assert _pid(ctr_name) == pid


def test_dump_exit_stops_the_container_and_an_export_restores_it_elsewhere(ctr_name, tmp_path):
    """--exit leaves the container stopped; the snapshot travels by export/import like any
    other and restores from the second repository."""
    _, pid = _start(ctr_name)
    repo, other = tmp_path / "repo", tmp_path / "other"
    for r in (repo, other):
        run_gpusnap("init", "--repo", r, check=True)
    before = _count(pid)
    d = run_json("dump", "--container", ctr_name, "--exit", "--repo", repo)
    assert not d["job_running"]
    state = _podman("inspect", "-f", "{{.State.Running}}", ctr_name).stdout.strip()
    assert state == "false", state
    run_gpusnap("export", d["snapshot"], "--repo", repo, "-o", tmp_path / "c.gsx", check=True)
    imp = run_json("import", tmp_path / "c.gsx", "--repo", other)
    _remove(ctr_name)
    r = run_json("restore", imp["snapshot"], "--repo", other)
    new = _pid(ctr_name)
    assert r["pid"] == new > 0
    _counts_on_from(new, before)


def test_container_mode_refusals_say_why(tmp_path):
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    r = run_gpusnap("dump", "--container", "no-such-container-here", "--repo", repo, "--json")
    assert r.returncode == ProcessNotFound.exit_code and re.search(r"no Podman (or Docker )?container", r.stdout), r.stdout
    r = run_gpusnap("dump", "123", "--container", "x", "--repo", repo, "--json")
    assert r.returncode == UsageError.exit_code and "--container takes no PID" in r.stdout, r.stdout


def test_a_container_snapshot_is_restored_by_podman_only(ctr_name, tmp_path):
    _start(ctr_name)
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    d = run_json("dump", "--container", ctr_name, "--repo", repo)
    r = run_gpusnap("restore", d["snapshot"], "--repo", repo, "--via", "files", "--json")
    assert r.returncode == UsageError.exit_code and "Podman restores it" in r.stdout, r.stdout
    assert not _podman("container", "exists", f"{ctr_name}-fork1").returncode == 0


def test_a_schedule_snapshots_a_container_and_follows_it_after_a_restore(ctr_name, sched_env, installed_gpusnap,
                                                                       tmp_path):
    """The exact cron line, run as cron runs it: each run dumps the container (pages already
    stored are not stored again) and keeps the newest 2; with the container gone a run says
    no-job (exit 5); once `gpusnap restore` brings it back under its name, the runs find it."""
    _start(ctr_name)
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    p = run_gpusnap("schedule", "add", "--container", ctr_name, "--name", "ctrsched", "--every", "5m",
                    "--keep-last", "2", "--repo", repo, "--json", env=sched_env)
    assert p.returncode == 0, p.stdout + p.stderr
    s = schedule.load("ctrsched")
    assert s.container == ctr_name and s.uid == 0 and s.job == f"the container {ctr_name}"
    for _ in range(3):
        r = _run_as_cron(s.path)
        assert r.returncode == 0, r.stdout + r.stderr
    recs = [json.loads(ln) for ln in open(s.log).read().splitlines()]
    assert [r["outcome"] for r in recs] == ["ok"] * 3 and all(r["pages_dedup"] > 0 for r in recs[1:]), recs
    snaps = run_json("ls", "--repo", repo)["snapshots"]
    assert len(snaps) == 2
    _remove(ctr_name)
    r = _run_as_cron(s.path)
    assert r.returncode == ProcessNotFound.exit_code, r.stdout + r.stderr
    assert json.loads(open(s.log).read().splitlines()[-1])["outcome"] == "no-job"
    run_json("restore", snaps[-1]["dir"], "--repo", repo)
    r = _run_as_cron(s.path)
    assert r.returncode == 0, r.stdout + r.stderr
    last = json.loads(open(s.log).read().splitlines()[-1])
    assert last["outcome"] == "ok" and last["pid"] == _pid(ctr_name), last
    st = run_json("schedule", "ls", env=sched_env)["schedules"][0]
    assert st["container"] == ctr_name and st["job_pid"] == _pid(ctr_name) and not st["job_gone"], st
    run_gpusnap("schedule", "rm", "ctrsched", env=sched_env, check=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_container_dump_interrupted_while_podman_checkpoints_keeps_nothing_and_the_container_runs(
        ctr_name, tmp_path, sig):
    """The signal lands while Podman checkpoints: gpusnap lets Podman finish (never kills it in
    the middle), keeps nothing, leaves no archive behind, and says so (exit 130)."""
    _, pid = _start(ctr_name)
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    p = subprocess.Popen([*GPUSNAP, "dump", "--container", ctr_name, "--repo", str(repo), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def checkpointing() -> bool:
        kids = _children(p.pid)
        return any(b"checkpoint" in Path(f"/proc/{k}/cmdline").read_bytes() for k in kids
                   if Path(f"/proc/{k}/cmdline").exists())

    wait_for(lambda: checkpointing() or p.poll() is not None, "podman's checkpoint to start")
    assert p.poll() is None, p.communicate()
    p.send_signal(sig)
    out, err = p.communicate(timeout=300)
    assert p.returncode == Interrupted.exit_code, out + err
    assert "no snapshot was kept" in json.loads(out)["message"]
    assert not any((repo / "snapshots").iterdir())
    assert not [f for f in (repo / "tmp").iterdir() if f.name.startswith("container-")]
    _runs_on(pid)


def test_a_failed_podman_restore_says_what_criu_said(tmp_path):
    """Podman's failed restore names only its restore.log, which goes with the container:
    the message carries CRIU's last errors from it, read at once; without the log it is as
    Podman said."""
    from gpusnap.errors import ContainerEngineFailed
    from gpusnap.system import podman

    log = tmp_path / "restore.log"
    log.write_text("(00.01) Warn (criu/x.c:1): nothing\n"
                   "(00.02) Error (criu/files-reg.c:1): Can't open file tmp/x on restore: No such file\n"
                   "(00.03) Error (criu/cr-restore.c:2): Restoring FAILED.\n")
    e = podman.with_restore_log(ContainerEngineFailed(f"podman could not restore the container: log file: {log}"))
    assert e.message.endswith("; CRIU: (00.02) Error (criu/files-reg.c:1): Can't open file tmp/x on restore: "
                              "No such file | (00.03) Error (criu/cr-restore.c:2): Restoring FAILED."), e.message
    gone = ContainerEngineFailed(f"podman could not restore the container: log file: {tmp_path / 'gone.log'}")
    assert podman.with_restore_log(gone).message == f"podman could not restore the container: log file: {tmp_path / 'gone.log'}"
