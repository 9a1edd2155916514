"""The CUDA plugin through `gpusnap dump` / `gpusnap restore` (CRIU --stream), fake driver.

The fake driver reaches CRIU through gpusnap's environment (LD_LIBRARY_PATH,
FAKE_CUDA_DIR); gpusnap sets the plugin's own variables (docs/plugin.md).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from gpusnap.errors import GpuCheckpointFailed

from jobs.cuda_like import expected_digest
from plugin_helpers import (CUDA_ERROR_TIMEOUT, CUDA_ERROR_UNKNOWN, ROOT, FakeCuda, Job, ensure_built,
                            require_environment, thread_state, tracer_pid, wait_for)

pytestmark = [pytest.mark.criu]

GPUSNAP = [str(ROOT / ".venv" / "bin" / "gpusnap")]


@pytest.fixture(autouse=True)
def _env():
    require_environment()
    if not os.path.exists(GPUSNAP[0]):
        pytest.skip("gpusnap is not installed in .venv")
    ensure_built()


@pytest.fixture
def fake(tmp_path) -> FakeCuda:
    return FakeCuda(tmp_path / "fake")


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path / "job")
    yield j
    j.kill()


def gpusnap(fake: FakeCuda, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_CUDA_DIR")}
    env.update(fake.env())
    env.pop("GPUSNAP_PLUGIN_DIR", None)
    return subprocess.run([*GPUSNAP, *map(str, args)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT, stdin=subprocess.DEVNULL)


def running_free(job: Job) -> None:
    wait_for(lambda: tracer_pid(job.pid) == 0, 10, "untraced")
    assert thread_state(job.pid, job.pid) not in "tT"
    assert thread_state(job.pid, job.tid_of("root")) not in "tT"


def check_result(job: Job) -> None:
    res = job.finish_and_result()
    assert res["digest"] == expected_digest(res["steps"])


def test_gpusnap_dump_leave_running(tmp_path, fake, job):
    job.declare_cuda(fake)
    r = gpusnap(fake, "dump", job.pid, "--repo", tmp_path / "repo", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["cuda_pids"] == [job.pid]
    assert fake.transitions() == ["lock", "checkpoint", "restore", "unlock"]
    assert fake.state(job.pid) == "running"
    running_free(job)
    check_result(job)


def test_gpusnap_exit_dump_then_restore(tmp_path, fake, job):
    job.declare_cuda(fake)
    repo = tmp_path / "repo"
    r = gpusnap(fake, "dump", job.pid, "--repo", repo, "--exit", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    snap = json.loads(r.stdout)["snapshot"]
    assert fake.transitions() == ["lock", "checkpoint"]
    job.reap()
    fake.reset_log()
    r = gpusnap(fake, "restore", snap, "--repo", repo, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["pid"] == job.pid
    assert fake.transitions() == ["restore", "unlock"]
    assert fake.state(job.pid) == "running"
    running_free(job)
    check_result(job)


@pytest.mark.parametrize("call,rc", [("cuCheckpointProcessLock", CUDA_ERROR_TIMEOUT),
                                     ("cuCheckpointProcessCheckpoint", CUDA_ERROR_UNKNOWN)])
@pytest.mark.parametrize("exit_", [False, True])
def test_gpusnap_dump_gpu_failure(tmp_path, fake, job, call, rc, exit_):
    job.declare_cuda(fake)
    fake.fail(call, rc)
    repo = tmp_path / "repo"
    r = gpusnap(fake, "dump", job.pid, "--repo", repo, "--json", *(["--exit"] if exit_ else []))
    assert r.returncode == GpuCheckpointFailed.exit_code, r.stdout + r.stderr
    err = json.loads(r.stdout)
    assert err["message"].startswith("the CUDA plugin could not checkpoint a GPU process; the job was left "
                                     "running and unlocked"), err
    assert fake.state(job.pid) == "running"
    ls = gpusnap(fake, "ls", "--repo", repo, "--json")
    assert ls.returncode == 0 and json.loads(ls.stdout)["snapshots"] == [], ls.stdout + ls.stderr
    running_free(job)
    check_result(job)
