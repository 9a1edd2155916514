"""Failure paths of GPU jobs (issue 12, issue 8 item 5), with the real CRIU and the fake driver.

Each test injects one failure the real driver can produce (a hung call, a failed restore or
unlock, a process in FAILED state, ranks that depend on each other) and checks what a user
would: the command's exit status and message, the fake driver's record of every call, and
that the job runs on (or, after a failed restore, does not run at all) and finishes with
exactly the result of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from jobs.cuda_like import expected_digest
from plugin_helpers import (CUDA_ERROR_UNKNOWN, JOB_PY, ROOT, FakeCuda, Job, criu_dump, criu_restore,
                            ensure_built, pid_alive, read_report, require_environment, thread_state, tracer_pid,
                            wait_for)

pytestmark = [pytest.mark.criu]

GPUSNAP = str(ROOT / ".venv" / "bin" / "gpusnap")


@pytest.fixture(autouse=True)
def _env():
    require_environment()
    ensure_built()


@pytest.fixture
def fake(tmp_path) -> FakeCuda:
    return FakeCuda(tmp_path / "fake")


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield started
    for j in started:
        j.kill()


def start(jobs, path, tree=False) -> Job:
    j = Job(path, tree=tree)
    jobs.append(j)
    return j


def env_for(fake: FakeCuda, tmp_path, **kw) -> dict:
    e = fake.env() | {"GPUSNAP_CUDA_REPORT": str(tmp_path / "report")}
    e.update({k: str(v) for k, v in kw.items()})
    return e


def running_free(job: Job, role: str = "root") -> None:
    pid = job.pid_of(role)
    assert pid_alive(pid)
    wait_for(lambda: tracer_pid(pid) == 0, 10, f"{role} untraced")
    wait_for(lambda: thread_state(pid, pid) not in "tT", 30, f"{role} not stopped")
    if job.tid_of(role):
        assert thread_state(pid, job.tid_of(role)) not in "tT"


def check_result(job: Job) -> None:
    res = job.finish_and_result()
    assert res["steps"] > 0
    assert res["digest"] == expected_digest(res["steps"])


def gpusnap(fake: FakeCuda, *args, **env) -> subprocess.CompletedProcess:
    if not os.path.exists(GPUSNAP):
        pytest.skip("gpusnap is not installed in .venv")
    e = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_CUDA_DIR")}
    e.update(fake.env())
    e.pop("GPUSNAP_PLUGIN_DIR", None)
    e.update({k: str(v) for k, v in env.items()})
    return subprocess.run([GPUSNAP, *map(str, args)], capture_output=True, text=True, env=e, timeout=300,
                          cwd=ROOT, stdin=subprocess.DEVNULL)


def hang(fake: FakeCuda, call: str, secs: int = 60, pid: int | None = None) -> None:
    name = call if pid is None else f"{call}.{pid}"
    (fake.dir / "fail" / name).write_text(f"hang {secs}\n")


def fail_once(fake: FakeCuda, call: str, rc: int, pid: int | None = None) -> None:
    name = call if pid is None else f"{call}.{pid}"
    (fake.dir / "fail" / name).write_text(f"{rc} times=1\n")


# ------------------------------------------------------------------ the plugin in raw CRIU


def test_hung_checkpoint_is_bounded_job_runs_on(tmp_path, fake, jobs):
    """A checkpoint call that never returns: the plugin gives up at its deadline, CRIU fails
    the dump and resumes the job, which is unlocked and finishes right."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    hang(fake, "cuCheckpointProcessCheckpoint", 120)
    r = criu_dump(job.pid, tmp_path / "img", env_for(fake, tmp_path, GPUSNAP_CALL_TIMEOUT_MS=1500),
                  leave_running=False, timeout=90)
    assert r.rc != 0
    assert "cuCheckpointProcessCheckpoint pid=%d did not return within 1500 ms" % job.pid in r.log
    # the hung call never finished; the lock was undone
    assert fake.transitions() == ["lock", "unlock"]
    assert fake.state(job.pid) == "running"
    assert [(x["final"], x["result"]) for x in read_report(tmp_path / "report")] == [("running", "ok")]
    running_free(job)
    check_result(job)


@pytest.mark.slow
def test_hung_lock_is_bounded_by_lock_timeout(tmp_path, fake, jobs):
    """A lock that ignores its own timeout is abandoned after lock timeout + grace."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    hang(fake, "cuCheckpointProcessLock", 120)
    r = criu_dump(job.pid, tmp_path / "img", env_for(fake, tmp_path, GPUSNAP_LOCK_TIMEOUT_MS=100), timeout=90)
    assert r.rc != 0
    assert "cuCheckpointProcessLock pid=%d did not return within 5100 ms" % job.pid in r.log
    assert fake.state(job.pid) == "running"
    running_free(job)
    check_result(job)


def test_failed_state_at_pause_refuses_untouched(tmp_path, fake, jobs):
    job = start(jobs, tmp_path / "job")
    fake.declare(job.pid, job.tid_of("root"), "failed")
    r = criu_dump(job.pid, tmp_path / "img", env_for(fake, tmp_path), leave_running=False)
    assert r.rc != 0
    assert "CUDA process in state failed cannot be dumped" in r.log
    assert fake.transitions() == []
    assert fake.state(job.pid) == "failed"
    running_free(job)
    check_result(job)


def test_second_lock_fails_after_first_locked(tmp_path, fake, jobs):
    """The tree's CUDA processes are locked one after the other; when the second lock fails
    the first is unlocked again and both run on."""
    job = start(jobs, tmp_path / "job", tree=True)
    job.declare_cuda(fake, roles=("root", "cuda-child"))
    root, child = job.pid_of("root"), job.pid_of("cuda-child")
    fake.fail("cuCheckpointProcessLock", CUDA_ERROR_UNKNOWN, pid=child)
    r = criu_dump(root, tmp_path / "img", env_for(fake, tmp_path), leave_running=False)
    assert r.rc != 0
    assert fake.transitions(root) == ["lock", "unlock"]
    assert fake.transitions(child) == ["lock"]
    assert fake.state(root) == fake.state(child) == "running"
    for role in ("root", "cuda-child", "plain-child"):
        running_free(job, role)
    check_result(job)


def _declare_peers(fake: FakeCuda, job: Job) -> tuple[int, int]:
    root, child = job.pid_of("root"), job.pid_of("cuda-child")
    (fake.dir / "procs" / str(root)).write_text(f"tid={job.tid_of('root')} state=running peer={child}\n")
    (fake.dir / "procs" / str(child)).write_text(f"tid={job.tid_of('cuda-child')} state=running peer={root}\n")
    return root, child


def test_ranks_that_need_each_other(tmp_path, fake, jobs):
    """Two ranks whose lock needs the other one running and whose unlock needs the other one
    restored (NCCL peers): every lock comes before CRIU freezes any process, every restore
    before any unlock, at dump and at restore."""
    job = start(jobs, tmp_path / "job", tree=True)
    root, child = _declare_peers(fake, job)
    img = tmp_path / "img"
    r = criu_dump(root, img, env_for(fake, tmp_path), leave_running=False)
    assert r.rc == 0, r.log[-3000:]
    assert [c.rc for c in fake.calls() if c.short == "lock"] == [0, 0]
    assert fake.state(root) == fake.state(child) == "checkpointed"
    job.reap()
    fake.reset_log()
    r = criu_restore(img, env_for(fake, tmp_path))
    assert r.rc == 0, r.log[-3000:]
    steps = [(c.short, c.pid, c.rc) for c in fake.calls() if c.short in ("restore", "unlock")]
    assert [s for s, _, _ in steps] == ["restore", "restore", "unlock", "unlock"], steps
    assert all(rc == 0 for *_, rc in steps)
    assert fake.state(root) == fake.state(child) == "running"
    # the restore threads were woken before the driver was asked for the state
    assert not [c for c in fake.calls() if c.fields.get("note") == "blocked-while-frozen"]
    for role in ("root", "cuda-child", "plain-child"):
        running_free(job, role)
    check_result(job)


def test_fake_get_state_blocks_on_a_frozen_process(tmp_path, fake, jobs):
    """The fake's model that the test above relies on: get-state on a stopped process blocks."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    os.kill(job.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: thread_state(job.pid, job.tid_of("root")) == "T", 10, "stopped")
        code = ("import ctypes,sys; l=ctypes.CDLL('libcuda.so.1'); s=ctypes.c_int(-1); "
                f"sys.exit(l.cuCheckpointProcessGetState({job.pid}, ctypes.byref(s)))")
        env = dict(os.environ) | fake.env() | {"FAKE_CUDA_BLOCK_S": "1"}
        assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
    finally:
        os.kill(job.pid, signal.SIGCONT)
    assert [c.fields.get("note") for c in fake.calls() if c.short == "state"] == ["blocked-while-frozen"]


def test_restore_failure_is_ignored_by_criu_but_reported(tmp_path, fake, jobs):
    """Why gpusnap reads the report: CRIU exits 0 though the GPU restore failed."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    img = tmp_path / "img"
    assert criu_dump(job.pid, img, env_for(fake, tmp_path), leave_running=False).rc == 0
    job.reap()
    fake.fail("cuCheckpointProcessRestore", CUDA_ERROR_UNKNOWN)
    r = criu_restore(img, env_for(fake, tmp_path))
    assert r.rc == 0
    rep = [x for x in read_report(tmp_path / "report") if x["op"] == "restore"]
    assert [(x["final"], x["result"]) for x in rep] == [("checkpointed", "fail")]
    os.kill(job.pid, 9)


# ------------------------------------------------------------------ through gpusnap


@pytest.mark.parametrize("call", ["cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"])
def test_gpusnap_restore_gpu_failure_exits_23_and_kills(tmp_path, fake, jobs, call):
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    repo = tmp_path / "repo"
    r = gpusnap(fake, "dump", job.pid, "--repo", repo, "--exit", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    snap = json.loads(r.stdout)["snapshot"]
    job.reap()
    fake.fail(call, CUDA_ERROR_UNKNOWN)
    r = gpusnap(fake, "restore", snap, "--repo", repo, "--json")
    assert r.returncode == 23, r.stdout + r.stderr
    err = json.loads(r.stdout)
    assert f"PID {job.pid}" in err["message"] and "killed" in err["message"]
    assert not Path(f"/proc/{job.pid}").exists() or not pid_alive(job.pid)
    wait_for(lambda: not Path(f"/proc/{job.pid}").exists(), 30, "restored job gone")
    # the snapshot is unchanged: once the driver works, it restores
    fake.clear_failures()
    r = gpusnap(fake, "restore", snap, "--repo", repo, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert fake.state(job.pid) == "running"
    running_free(job)
    check_result(job)


def test_gpusnap_post_dump_failure_with_exit(tmp_path, fake, jobs):
    """CRIU hands the plugin the dump's own status, not the post-dump script's: the plugin
    leaves the process checkpointed, CRIU resumes it; gpusnap must restore and unlock it."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    r = gpusnap(fake, "dump", job.pid, "--repo", tmp_path / "repo", "--exit", "--json",
                GPUSNAP_TEST_HOOK="gate-fails")
    assert r.returncode != 0, r.stdout
    rep = read_report_lines(fake, tmp_path)
    assert fake.transitions() == ["lock", "checkpoint", "restore", "unlock"]
    # the plugin's own undo did not happen (it was told the dump succeeded): gpusnap's did
    assert [c.fields["caller"] for c in fake.calls() if c.short == "restore"] != \
           [c.fields["caller"] for c in fake.calls() if c.short == "lock"]
    assert fake.state(job.pid) == "running", rep
    running_free(job)
    check_result(job)


def read_report_lines(fake, tmp_path) -> str:
    log = fake.dir / "calls.log"
    return log.read_text() if log.exists() else ""


def test_gpusnap_undo_failing_at_dump_end(tmp_path, fake, jobs):
    """A leave-running dump whose final unlock fails once: the snapshot is good and gpusnap
    unlocks the process itself."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    fail_once(fake, "cuCheckpointProcessUnlock", CUDA_ERROR_UNKNOWN)
    r = gpusnap(fake, "dump", job.pid, "--repo", tmp_path / "repo", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    unlocks = [c for c in fake.calls() if c.short == "unlock"]
    assert [c.rc for c in unlocks] == [CUDA_ERROR_UNKNOWN, 0]
    assert unlocks[0].fields["caller"] != unlocks[1].fields["caller"]  # CRIU's plugin, then gpusnap
    assert fake.state(job.pid) == "running"
    running_free(job)
    check_result(job)


def test_gpusnap_failed_dump_whose_undo_fails(tmp_path, fake, jobs):
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    fake.fail("cuCheckpointProcessCheckpoint", CUDA_ERROR_UNKNOWN)
    fail_once(fake, "cuCheckpointProcessUnlock", CUDA_ERROR_UNKNOWN)
    r = gpusnap(fake, "dump", job.pid, "--repo", tmp_path / "repo", "--exit", "--json")
    assert r.returncode == 12, r.stdout + r.stderr
    assert [c.rc for c in fake.calls() if c.short == "unlock"] == [CUDA_ERROR_UNKNOWN, 0]
    assert fake.state(job.pid) == "running"
    running_free(job)
    check_result(job)


def test_gpusnap_hung_checkpoint_gives_up(tmp_path, fake, jobs):
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    hang(fake, "cuCheckpointProcessCheckpoint", 120)
    r = gpusnap(fake, "dump", job.pid, "--repo", tmp_path / "repo", "--exit", "--json",
                GPUSNAP_CALL_TIMEOUT_MS=1500)
    assert r.returncode == 12, r.stdout + r.stderr
    assert "did not return within 1500 ms" in json.loads(r.stdout).get("hint", "")
    assert fake.state(job.pid) == "running"
    running_free(job)
    check_result(job)


def kill_dump_at(fake: FakeCuda, tmp_path, point: str, *args) -> int:
    """Runs `gpusnap dump ARGS` held at `point` (GPUSNAP_TEST_HOLD), SIGKILLs it there (as the
    OOM killer could) and returns its exit status."""
    if not os.path.exists(GPUSNAP):
        pytest.skip("gpusnap is not installed in .venv")
    hold = tmp_path / f"hold-{point}.json"
    e = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_CUDA_DIR")}
    e.update(fake.env() | {"GPUSNAP_TEST_HOLD": f"{point}:{hold}"})
    e.pop("GPUSNAP_PLUGIN_DIR", None)
    p = subprocess.Popen([GPUSNAP, *map(str, args)], env=e, cwd=ROOT, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(hold.exists, 120, f"the dump held at {point}")
        assert json.loads(hold.read_text())["pid"] == p.pid
        os.kill(p.pid, signal.SIGKILL)
        return p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("cuda", [False, True])
def test_exit_dump_sigkilled_after_criu_job_runs_on(tmp_path, fake, jobs, cuda):
    """Issue 8 item 5: gpusnap killed (SIGKILL, as by the OOM killer) after CRIU left the tree
    stopped and checkpointed: the guardian resumes it, restores and unlocks the GPU side."""
    job = start(jobs, tmp_path / "job")
    if cuda:
        job.declare_cuda(fake)
    repo = tmp_path / "repo"
    rc = kill_dump_at(fake, tmp_path, "after-gate", "dump", job.pid, "--repo", repo, "--exit")
    assert rc == -signal.SIGKILL
    running_free(job)
    if cuda:
        wait_for(lambda: fake.state(job.pid) == "running", 120, "GPU side running")
        assert fake.transitions() == ["lock", "checkpoint", "restore", "unlock"]
    check_result(job)
    log = repo / "logs" / "guardian.log"
    wait_for(log.exists, 30, "guardian log")
    assert "job resumed" in log.read_text()
    ls = gpusnap(fake, "ls", "--repo", repo, "--json")
    assert ls.returncode == 0 and json.loads(ls.stdout)["snapshots"] == [], ls.stdout + ls.stderr


# ------------------------------------------------------------------ device files without a CUDA context


@pytest.fixture
def nvidia_file():
    """A stand-in for /dev/nvidia0 that a process can hold open (a regular file under /dev;
    the scan goes by path)."""
    path = Path(f"/dev/nvidia-gpusnap-test-{uuid.uuid4().hex[:8]}")
    path.write_text("")
    yield path
    path.unlink(missing_ok=True)


def test_device_files_without_context_refused(tmp_path, fake, jobs, nvidia_file):
    code = (f"import os,time; f=open({str(nvidia_file)!r}); open({str(tmp_path / 'ready')!r},'w').close(); "
            "time.sleep(600)")
    holder = subprocess.Popen([JOB_PY, "-c", code], start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        wait_for((tmp_path / "ready").exists, 30, "holder ready")
        r = gpusnap(fake, "dump", holder.pid, "--repo", tmp_path / "repo", "--json")
        assert r.returncode == 24, r.stdout + r.stderr
        err = json.loads(r.stdout)
        assert f"PID {holder.pid}" in err["message"] and str(nvidia_file) in err["message"]
        assert tracer_pid(holder.pid) == 0 and thread_state(holder.pid, holder.pid) not in "tT"
        d = gpusnap(fake, "doctor", holder.pid, "--json")
        checks = [c for c in json.loads(d.stdout)["checks"] if c["status"] == "fail"]
        assert any(f"PID {holder.pid}" in c["detail"] and "without a CUDA context" in c["detail"] for c in checks)
        # the same process known to the driver as a CUDA process is fine
        tid = holder.pid
        fake.declare(holder.pid, tid)
        d = gpusnap(fake, "doctor", holder.pid, "--json")
        assert not any("without a CUDA context" in c["detail"] for c in json.loads(d.stdout)["checks"])
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ GPU pairs per process


def test_each_process_restored_with_its_own_gpu_pairs(tmp_path, fake, jobs):
    u1, u2, u3 = (f"GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f{i}" for i in (1, 2, 3))
    job = start(jobs, tmp_path / "job", tree=True)
    job.declare_cuda(fake, roles=("root", "cuda-child"))
    root, child = job.pid_of("root"), job.pid_of("cuda-child")
    img = tmp_path / "img"
    assert criu_dump(root, img, env_for(fake, tmp_path), leave_running=False).rc == 0
    job.reap()
    fake.reset_log()
    r = criu_restore(img, env_for(fake, tmp_path, GPUSNAP_GPU_MAP=f"{u1}={u2}",
                                  **{f"GPUSNAP_GPU_MAP_{child}": f"{u1}={u3}"}))
    assert r.rc == 0, r.log[-3000:]
    gpus = {c.pid: c.fields["gpus"] for c in fake.calls() if c.short == "restore"}
    assert gpus == {root: f"{u1}={u2}", child: f"{u1}={u3}"}
    for role in ("root", "cuda-child", "plain-child"):
        running_free(job, role)
    check_result(job)


def test_exit_dump_sigkilled_after_commit_job_is_killed_and_restores(tmp_path, fake, jobs):
    """The other side of the guardian: told the snapshot is committed, it finishes --exit's
    work (the job must not stay stopped for ever), and the snapshot restores."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    repo = tmp_path / "repo"
    rc = kill_dump_at(fake, tmp_path, "after-commit", "dump", job.pid, "--repo", repo, "--exit")
    assert rc == -signal.SIGKILL
    job.reap()
    log = repo / "logs" / "guardian.log"
    wait_for(log.exists, 30, "guardian log")
    assert "job killed" in log.read_text()
    snaps = json.loads(gpusnap(fake, "ls", "--repo", repo, "--json").stdout)["snapshots"]
    assert len(snaps) == 1
    fake.reset_log()
    r = gpusnap(fake, "restore", snaps[0]["path"], "--repo", repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert fake.transitions() == ["restore", "unlock"]
    running_free(job)
    check_result(job)


def test_sigterm_during_a_hung_driver_call(tmp_path, fake, jobs):
    """SIGTERM while the driver hangs: gpusnap no longer waits for CRIU for ever; it ends
    (130) once the plugin has abandoned the call, and the job runs on, unlocked."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    hang(fake, "cuCheckpointProcessCheckpoint", 120)
    e = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_CUDA_DIR")}
    e.update(fake.env() | {"GPUSNAP_CALL_TIMEOUT_MS": "3000"})
    e.pop("GPUSNAP_PLUGIN_DIR", None)
    p = subprocess.Popen([GPUSNAP, "dump", str(job.pid), "--repo", str(tmp_path / "repo"), "--exit"], env=e,
                         cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: any(c.fields.get("note") == "hanging" for c in fake.calls()), 60, "the hung call")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=90)
    assert p.returncode == 130, out + err
    assert fake.state(job.pid) == "running"
    running_free(job)
    check_result(job)


def test_interrupt_only_mode_requested_from_criu(tmp_path, fake, jobs):
    """Item 9: the plugin finds CRIU's exported set_compel_interrupt_only_mode and calls it, so
    a --freeze-cgroup dump would still seize with ptrace (the restore thread must run)."""
    import shutil as _sh
    criu_bin = Path(_sh.which("criu", path="/usr/local/sbin:/usr/sbin:/sbin") or "criu").resolve()
    nm = _sh.which("nm")
    assert criu_bin.is_file() and nm, "the set-up installs CRIU (/usr/local/sbin/criu) and binutils (nm)"
    syms = subprocess.run([nm, "-D", str(criu_bin)], capture_output=True, text=True, check=True).stdout
    assert " set_compel_interrupt_only_mode" in syms
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    r = criu_dump(job.pid, tmp_path / "img", env_for(fake, tmp_path))
    assert r.rc == 0, r.log[-3000:]
    assert "CRIU seizes with ptrace interrupts only (set_compel_interrupt_only_mode)" in r.log
    check_result(job)
