"""The CUDA plugin inside real CRIU dumps and restores, against the fake driver.

Raw `criu dump` / `criu restore` with `--libdir build/plugins` and the
environment gpusnap sets (docs/plugin.md); the fake libcuda.so.1 is found
through LD_LIBRARY_PATH in CRIU's environment and records every call.
"""

from __future__ import annotations

import subprocess

import pytest

from plugin_helpers import (CUDA_ERROR_TIMEOUT, CUDA_ERROR_UNKNOWN, FAKE_LIB_DIR_R550, FakeCuda, Job, criu_dump,
                            criu_restore, ensure_built, hook_timings, pid_alive, read_report, require_environment,
                            thread_state, tracer_pid, wait_for)
from jobs.cuda_like import expected_digest

pytestmark = [pytest.mark.criu]

U1 = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
U2 = "GPU-11111111-2222-3333-4444-555555555555"


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


def assert_running_free(job: Job, role: str = "root") -> None:
    """The process runs on: not traced, not stopped, restore thread not stopped."""
    pid = job.pid_of(role)
    assert pid_alive(pid)
    wait_for(lambda: tracer_pid(pid) == 0, 10, f"{role} untraced")
    if job.tid_of(role):
        assert thread_state(pid, job.tid_of(role)) not in "tT"


def assert_result(job: Job) -> None:
    res = job.finish_and_result()
    assert res["steps"] > 0
    assert res["digest"] == expected_digest(res["steps"])


def env_for(fake: FakeCuda, tmp_path, **kw) -> dict:
    e = fake.env() | {"GPUSNAP_CUDA_REPORT": str(tmp_path / "report")}
    e.update({k: str(v) for k, v in kw.items()})
    return e


# ------------------------------------------------------------------ dumps


def test_leave_running_dump(tmp_path, fake, jobs):
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    r = criu_dump(job.pid, tmp_path / "img", env_for(fake, tmp_path, GPUSNAP_LOCK_TIMEOUT_MS=1234))
    assert r.rc == 0, r.log[-3000:]

    assert fake.transitions() == ["lock", "checkpoint", "restore", "unlock"]
    assert all(c.rc == 0 for c in fake.calls())
    assert {c.pid for c in fake.calls() if c.call != "cuInit"} == {job.pid}
    lock = [c for c in fake.calls() if c.short == "lock"][0]
    assert lock.fields["timeout"] == "1234"
    assert fake.state(job.pid) == "running"

    rep = read_report(tmp_path / "report")
    assert rep == [{"op": "dump", "pid": job.pid, "tid": job.tid_of("root"), "initial": "running",
                    "image": "checkpointed", "final": "running", "result": "ok"}]
    hooks = {h for h, *_ in hook_timings(r.log)}
    assert {"pause", "checkpoint", "resume"} <= hooks

    assert_running_free(job)
    assert_result(job)


def test_exit_dump_then_restore(tmp_path, fake, jobs):
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    img = tmp_path / "img"
    r = criu_dump(job.pid, img, env_for(fake, tmp_path), leave_running=False)
    assert r.rc == 0, r.log[-3000:]
    assert fake.transitions() == ["lock", "checkpoint"]
    assert fake.state(job.pid) == "checkpointed"
    assert read_report(tmp_path / "report")[0]["final"] == "checkpointed"
    job.reap()

    fake.reset_log()
    r = criu_restore(img, env_for(fake, tmp_path, GPUSNAP_GPU_MAP=f"{U1}={U2}"))
    assert r.rc == 0, r.log[-3000:]
    assert fake.transitions() == ["restore", "unlock"]
    calls = fake.calls()
    assert all(c.rc == 0 for c in calls)
    # cuInit comes before the restore that needs it
    names = [c.short for c in calls]
    assert names.index("init") < names.index("restore")
    restore = [c for c in calls if c.short == "restore"][0]
    assert restore.fields["gpus"] == f"{U1}={U2}"
    # the restore thread runs before the driver is asked for the state (a get-state on a
    # fully frozen process may block: the fake blocks then, and says so)
    assert [c.fields.get("note") for c in calls if c.short == "state"] == [None]
    assert fake.state(job.pid) == "running"
    rep = [x for x in read_report(tmp_path / "report") if x["op"] == "restore"]
    assert rep == [{"op": "restore", "pid": job.pid, "tid": job.tid_of("root"), "initial": "checkpointed",
                    "final": "running", "result": "ok"}]
    assert "restore pid=%d took" % job.pid in r.log

    assert_running_free(job)
    assert_result(job)


def test_leave_running_dump_kill_then_restore(tmp_path, fake, jobs):
    """The image of a leave-running dump holds a checkpointed process: restore brings it back."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    img = tmp_path / "img"
    assert criu_dump(job.pid, img, env_for(fake, tmp_path)).rc == 0
    assert fake.state(job.pid) == "running"
    job.kill(finish=False)
    job.reap()
    fake.reset_log()
    r = criu_restore(img, env_for(fake, tmp_path))
    assert r.rc == 0, r.log[-3000:]
    assert fake.transitions() == ["restore", "unlock"]
    assert [c.fields["gpus"] for c in fake.calls() if c.short == "restore"] == ["-"]
    assert_running_free(job)
    assert_result(job)


def test_driver_without_checkpoint_api_dumps_cpu_only(tmp_path, fake, jobs):
    """A driver older than the checkpoint API (the fake built as CUDA 12.4): the plugin
    disables itself, and the dump and restore are CPU-only and still correct."""
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    env = env_for(fake, tmp_path) | {"LD_LIBRARY_PATH": str(FAKE_LIB_DIR_R550)}
    img = tmp_path / "img"
    r = criu_dump(job.pid, img, env, leave_running=False)
    assert r.rc == 0, r.log[-3000:]
    assert any("lacks the checkpoint API" in ln for ln in r.plugin_lines()), r.plugin_lines()
    assert [c for c in fake.calls() if c.call != "cuInit"] == [] and fake.state(job.pid) == "running"
    job.reap()
    r = criu_restore(img, env)
    assert r.rc == 0, r.log[-3000:]
    assert [c for c in fake.calls() if c.call != "cuInit"] == []
    assert_running_free(job)
    assert_result(job)


@pytest.mark.parametrize("leave_running", [True, False])
def test_lock_timeout_fails_dump_job_runs(tmp_path, fake, jobs, leave_running):
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    fake.fail("cuCheckpointProcessLock", CUDA_ERROR_TIMEOUT)
    r = criu_dump(job.pid, tmp_path / "img", env_for(fake, tmp_path), leave_running=leave_running)
    assert r.rc != 0
    assert "cuCheckpointProcessLock (timeout 5000 ms) failed: CUDA_ERROR_TIMEOUT" in r.log
    # lock failed, so nothing was locked and nothing is undone
    assert fake.transitions() == ["lock"]
    assert fake.state(job.pid) == "running"
    rep = read_report(tmp_path / "report")
    assert [(x["final"], x["result"]) for x in rep] == [("running", "ok")]
    assert_running_free(job)
    assert_result(job)


@pytest.mark.parametrize("leave_running", [True, False])
def test_checkpoint_failure_fails_dump_job_unlocked(tmp_path, fake, jobs, leave_running):
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    fake.fail("cuCheckpointProcessCheckpoint", CUDA_ERROR_UNKNOWN)
    r = criu_dump(job.pid, tmp_path / "img", env_for(fake, tmp_path), leave_running=leave_running)
    assert r.rc != 0
    assert "cuCheckpointProcessCheckpoint failed" in r.log
    assert fake.transitions() == ["lock", "checkpoint", "unlock"]
    assert [c.rc for c in fake.calls() if c.short == "unlock"] == [0]
    assert fake.state(job.pid) == "running"
    assert_running_free(job)
    assert_result(job)


def test_tree_two_cuda_one_plain(tmp_path, fake, jobs):
    job = start(jobs, tmp_path / "job", tree=True)
    job.declare_cuda(fake, roles=("root", "cuda-child"))
    root, cchild, plain = job.pid_of("root"), job.pid_of("cuda-child"), job.pid_of("plain-child")

    r = criu_dump(root, tmp_path / "img1", env_for(fake, tmp_path))
    assert r.rc == 0, r.log[-3000:]
    for pid in (root, cchild):
        assert fake.transitions(pid) == ["lock", "checkpoint", "restore", "unlock"]
        assert fake.state(pid) == "running"
    assert fake.transitions(plain) == []
    # the plain process was only asked whether it is a CUDA process
    assert {c.short for c in fake.calls() if c.pid == plain} == {"tid"}
    assert sorted(x["pid"] for x in read_report(tmp_path / "report")) == sorted([root, cchild])
    for role in ("root", "cuda-child", "plain-child"):
        assert_running_free(job, role)

    # --exit-style dump of the whole tree, then restore
    fake.reset_log()
    img = tmp_path / "img2"
    r = criu_dump(root, img, env_for(fake, tmp_path), leave_running=False)
    assert r.rc == 0, r.log[-3000:]
    assert fake.state(root) == fake.state(cchild) == "checkpointed"
    job.reap()
    fake.reset_log()
    r = criu_restore(img, env_for(fake, tmp_path))
    assert r.rc == 0, r.log[-3000:]
    for pid in (root, cchild):
        assert fake.transitions(pid) == ["restore", "unlock"]
        assert fake.state(pid) == "running"
    assert fake.transitions(plain) == []
    for role in ("root", "cuda-child", "plain-child"):
        assert_running_free(job, role)
    assert_result(job)


def test_tree_second_checkpoint_fails_everything_undone(tmp_path, fake, jobs):
    """A failed --exit dump after one process was checkpointed: both come back RUNNING."""
    job = start(jobs, tmp_path / "job", tree=True)
    job.declare_cuda(fake, roles=("root", "cuda-child"))
    root, cchild = job.pid_of("root"), job.pid_of("cuda-child")
    fake.fail("cuCheckpointProcessCheckpoint", CUDA_ERROR_UNKNOWN, pid=cchild)
    r = criu_dump(root, tmp_path / "img", env_for(fake, tmp_path), leave_running=False)
    assert r.rc != 0
    assert fake.transitions(root) == ["lock", "checkpoint", "restore", "unlock"]
    assert fake.transitions(cchild) == ["lock", "checkpoint", "unlock"]
    assert fake.state(root) == fake.state(cchild) == "running"
    rep = {x["pid"]: x for x in read_report(tmp_path / "report")}
    assert rep[root]["image"] == "checkpointed" and rep[root]["final"] == "running"
    assert rep[cchild]["image"] == "locked" and rep[cchild]["final"] == "running"
    for role in ("root", "cuda-child", "plain-child"):
        assert_running_free(job, role)
    assert_result(job)


def test_already_locked_process_left_locked(tmp_path, fake, jobs):
    """A process someone else locked is checkpointed, restored, and left locked as found."""
    job = start(jobs, tmp_path / "job")
    fake.declare(job.pid, job.tid_of("root"), "locked")
    r = criu_dump(job.pid, tmp_path / "img", env_for(fake, tmp_path))
    assert r.rc == 0, r.log[-3000:]
    assert fake.transitions() == ["checkpoint", "restore"]
    assert fake.state(job.pid) == "locked"


# ------------------------------------------------------------------ no driver / bad input


def _system_has_libcuda() -> bool:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return "libcuda.so.1 " in out


def test_no_driver_cpu_dump_and_restore(tmp_path, jobs):
    if _system_has_libcuda():
        pytest.skip("this machine has a real libcuda.so.1")
    job = start(jobs, tmp_path / "job")
    r = criu_dump(job.pid, tmp_path / "img1", {})
    assert r.rc == 0, r.log[-3000:]
    lines = r.plugin_lines()
    assert len(lines) == 1 and "disabled" in lines[0] and "libcuda.so.1" in lines[0]
    assert_running_free(job)

    img = tmp_path / "img2"
    assert criu_dump(job.pid, img, {}, leave_running=False).rc == 0
    job.reap()
    r = criu_restore(img, {})
    assert r.rc == 0, r.log[-3000:]
    assert "disabled" in " ".join(r.plugin_lines())
    assert_running_free(job)
    assert_result(job)


def test_bad_gpu_map_refuses_restore(tmp_path, fake, jobs):
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    img = tmp_path / "img"
    assert criu_dump(job.pid, img, env_for(fake, tmp_path), leave_running=False).rc == 0
    job.reap()
    r = criu_restore(img, env_for(fake, tmp_path, GPUSNAP_GPU_MAP="0=1"))
    assert r.rc != 0
    assert "GPUSNAP_GPU_MAP: item 1: '0' is not a GPU UUID" in r.log
    assert not pid_alive(job.pid)
    # a good map restores it
    r = criu_restore(img, env_for(fake, tmp_path, GPUSNAP_GPU_MAP=f"{U1}={U2}"))
    assert r.rc == 0, r.log[-3000:]
    assert_result(job)


def test_bad_lock_timeout_refuses_dump(tmp_path, fake, jobs):
    job = start(jobs, tmp_path / "job")
    job.declare_cuda(fake)
    r = criu_dump(job.pid, tmp_path / "img", env_for(fake, tmp_path, GPUSNAP_LOCK_TIMEOUT_MS="soon"))
    assert r.rc != 0
    assert "GPUSNAP_LOCK_TIMEOUT_MS=soon" in r.log
    assert fake.transitions() == []
    assert_running_free(job)
