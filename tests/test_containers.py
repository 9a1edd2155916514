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
import subprocess
from pathlib import Path

import pytest

from conftest import run_gpusnap, wait_for
from gpusnap.errors import NotDumpable
from gpusnap.system import containers

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


@pytest.fixture(scope="module")
def container():
    """(container id, PID of its job) for a running Podman container."""
    assert shutil.which("podman") and shutil.which("runc"), "scripts/test-deps.sh installs podman and runc"
    _image()
    name = f"gpusnap-test-{os.getpid()}"
    r = _podman("run", "-d", "--name", name, "--runtime", "runc", "--network", "none",
                "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", IMAGE, "/bin/sh", "-c", JOB)
    if r.returncode != 0:
        pytest.skip(f"podman cannot start a container on this machine: {r.stderr.strip()[-300:]}")
    cid = r.stdout.strip()
    try:
        pid = int(_podman("inspect", "-f", "{{.State.Pid}}", name).stdout.strip())
        wait_for(lambda: _count(pid) > 0, "the container's job to count")
        yield cid, pid
    finally:
        _podman("rm", "-f", "-t", "0", name)


def _count(pid: int) -> int:
    try:
        return int((Path(f"/proc/{pid}/root/tmp/count")).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


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
    assert f"podman container checkpoint --leave-running --export=FILE.tar.gz {cid[:12]}" in err["hint"], err
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


def test_the_command_the_refusal_names_snapshots_the_container(container, tmp_path):
    """The hint is no guess: the engine's checkpoint it names works here, and the job goes on."""
    cid, pid = container
    hint = run_gpusnap("dump", pid, "--json").stdout
    cmd = re.search(r"`(podman container checkpoint [^`]+)`", json.loads(hint)["hint"]).group(1)
    out = tmp_path / "ckpt.tar.gz"
    r = subprocess.run(cmd.replace("FILE.tar.gz", str(out)).split(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and out.stat().st_size > 0, r.stderr
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
