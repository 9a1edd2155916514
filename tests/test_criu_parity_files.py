"""Deleted files and named semaphores, with the real CRIU: what plain CRIU restores with
--ghost-limit and --link-remap, gpusnap restores with no option given (issue 32).

(a) a job holding open a deleted 4 MiB file of known data, which it goes on writing into and
    whose digest it prints at the end: CRIU's default ghost limit (1 MiB) refused it;
(b) Python multiprocessing Pools with the `forkserver` and `spawn` start methods (named POSIX
    semaphores in /dev/shm, mapped through a removed name): CRIU needs --link-remap, and with
    the job left running it deletes the link files a later restore needs.

Each job is dumped in both modes (left running, then killed; and --exit), restored, and must
end with exactly the result of an uninterrupted run; `doctor PID` names what it found first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json, wait_for

pytestmark = pytest.mark.criu

GHOST_JOB = r'''
import hashlib, os, sys, time
out, steps, step_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
path = os.path.join(out, "scratch.bin")
f = open(path, "w+b")
f.write(hashlib.sha256(b"seed").digest() * (4 * 1024 * 1024 // 32))    # 4 MiB of known data
f.flush()
os.unlink(path)                     # open and deleted: CRIU's "ghost file"
with open(os.path.join(out, "pid"), "w") as p:
    p.write(str(os.getpid()))
for s in range(steps):
    f.seek((s * 4099) % (4 << 20))
    f.write(s.to_bytes(4, "little"))
    f.flush()
    with open(os.path.join(out, "progress"), "w") as p:
        p.write(str(s + 1))
    time.sleep(step_ms / 1000)
f.seek(0)
digest = hashlib.sha256(f.read()).hexdigest()
with open(os.path.join(out, "result.tmp"), "w") as r:
    r.write(digest)
os.rename(os.path.join(out, "result.tmp"), os.path.join(out, "result"))
'''

POOL_JOB = r'''
import hashlib, multiprocessing as mp, os, sys, time

def work(i):
    return hashlib.sha256(str(i).encode()).hexdigest()[:8]

if __name__ == "__main__":
    out, method, steps, step_ms = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    h = hashlib.sha256()
    with mp.get_context(method).Pool(2) as pool:
        for s in range(steps):
            for r in pool.map(work, range(s * 8, s * 8 + 8)):
                h.update(r.encode())
            with open(os.path.join(out, "progress"), "w") as f:
                f.write(str(s + 1))
            time.sleep(step_ms / 1000)
    with open(os.path.join(out, "result.tmp"), "w") as f:
        f.write(h.hexdigest())
    os.rename(os.path.join(out, "result.tmp"), os.path.join(out, "result"))
'''


def _start(out: Path, script: str, *args) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.py").write_text(script)
    return subprocess.Popen([sys.executable, str(out / "job.py"), str(out), *map(str, args)],
                            stdin=subprocess.DEVNULL, stdout=open(out / "stdio", "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=out)


def _reference(tmp_path: Path, script: str, *args) -> str:
    out = tmp_path / "reference"
    assert _start(out, script, *args).wait(timeout=120) == 0, (out / "stdio").read_text()
    return (out / "result").read_text()


def _progress(out: Path) -> int:
    try:
        return int((out / "progress").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _tree(pid: int) -> list[int]:
    from gpusnap.system import proc

    return proc.tree(pid)


def _kill(pids: list[int]) -> None:
    kill_pids(pids)
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids),
          "the killed job's processes to go")


def _state(pid: int) -> str:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return st[st.rindex(")") + 2]


def _doctor(pid: int, name: str) -> dict:
    r = run_gpusnap("doctor", pid, "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["ok"], r.stdout + r.stderr
    found = [c for c in report["checks"] if c["name"] == name]
    assert len(found) == 1 and found[0]["status"] == "info", report["checks"]
    return report


def _dump_kill_restore(job: subprocess.Popen, out: Path, repo: Path, leave_running: bool, at: int) -> dict:
    """Dump at step `at` (left running: let it go on, then kill it), restore, return restore's JSON."""
    wait_for(lambda: _progress(out) >= at, f"step {at}")
    pids = _tree(job.pid)
    res = run_json("dump", job.pid, "--repo", repo, *([] if leave_running else ["--exit"]))
    if leave_running:
        n = _progress(out)
        wait_for(lambda: _progress(out) >= n + 5, "the job to go on after the dump")
        _kill(pids)
    job.wait(timeout=30)
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), "the job's PIDs to be free")
    restored = run_json("restore", res["snapshot"], "--repo", repo)
    restored["dump"] = res
    return restored


@pytest.mark.parametrize("leave_running", [True, False], ids=["leave-running", "exit"])
def test_open_deleted_4mib_file_comes_back_with_its_contents(tmp_path, repo, leave_running):
    expected = _reference(tmp_path, GHOST_JOB, 200, 0)
    out = tmp_path / "job"
    job = _start(out, GHOST_JOB, 200, 30)
    restored = None
    try:
        wait_for(lambda: _progress(out) >= 3, "the job's first steps")
        report = _doctor(job.pid, "deleted files")
        detail = next(c["detail"] for c in report["checks"] if c["name"] == "deleted files")
        assert "1 deleted open file(s), 4.0 MiB" in detail and "--ghost-limit" in detail, detail
        restored = _dump_kill_restore(job, out, repo, leave_running, at=20)
        assert "--ghost-limit" in restored["dump"]["criu_options"]
        # the file's 4 MiB went through gpusnap's image stream into the repository
        shown = json.loads(run_gpusnap("inspect", restored["dump"]["snapshot"], "--repo", repo, "--json").stdout)
        ghosts = [i for i in shown["images"] if i["name"].startswith("ghost-file-")]
        assert len(ghosts) == 1 and ghosts[0]["size"] >= 4 << 20, shown["images"]
        wait_for(lambda: (out / "result").exists(), "the restored job's result", timeout=60)
        assert (out / "result").read_text() == expected
    finally:
        kill_pids(restored["pids"] if restored else [])
        if job.poll() is None:
            job.kill()
            job.wait()


@pytest.mark.parametrize("leave_running", [True, False], ids=["leave-running", "exit"])
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_multiprocessing_pool_with_named_semaphores_finishes_its_work(tmp_path, repo, method, leave_running):
    expected = _reference(tmp_path, POOL_JOB, method, 150, 0)
    out = tmp_path / "job"
    job = _start(out, POOL_JOB, method, 150, 40)
    restored = None
    try:
        wait_for(lambda: _progress(out) >= 3, "the pool's first steps")
        report = _doctor(job.pid, "link remap")
        assert "--link-remap" in report["plan"]["dump_options"]
        restored = _dump_kill_restore(job, out, repo, leave_running, at=30)
        assert "--link-remap" in restored["dump"]["criu_options"]
        snap = restored["dump"]["snapshot"]
        meta = json.loads(run_gpusnap("inspect", snap, "--repo", repo, "--json").stdout)["meta"]
        kept = [e["path"] for e in meta["link_remaps"]]
        # the link files CRIU made at the dump were kept in the snapshot, and are gone again:
        # CRIU removes them once the job is restored
        assert kept and all(os.path.basename(p).startswith("link_remap.") for p in kept)
        assert not [p for p in kept if os.path.lexists(p)]
        wait_for(lambda: (out / "result").exists(), "the restored pool's result", timeout=60)
        assert (out / "result").read_text() == expected
    finally:
        kill_pids(restored["pids"] if restored else [])
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def test_forkserver_pool_restored_after_it_finished_does_its_work_again(tmp_path, repo):
    """A scheduled dump's use: the job went on and ended (its semaphores unlinked, the
    forkserver's socket directory /tmp/pymp-* removed); restoring the snapshot brings back
    the semaphores and that directory, and the job ends as the uninterrupted run did."""
    expected = _reference(tmp_path, POOL_JOB, "forkserver", 100, 0)
    out = tmp_path / "job"
    job = _start(out, POOL_JOB, "forkserver", 100, 30)
    restored = None
    try:
        wait_for(lambda: _progress(out) >= 20, "step 20")
        snap = run_json("dump", job.pid, "--repo", repo)["snapshot"]
        assert job.wait(timeout=60) == 0 and (out / "result").read_text() == expected
        (out / "result").unlink()
        meta = json.loads(run_gpusnap("inspect", snap, "--repo", repo, "--json").stdout)["meta"]
        assert not [n for e in meta["link_remaps"] for n in e["names"] if os.path.lexists(n)]
        restored = run_json("restore", snap, "--repo", repo)
        wait_for(lambda: (out / "result").exists(), "the restored pool's result", timeout=60)
        assert (out / "result").read_text() == expected
    finally:
        kill_pids(restored["pids"] if restored else [])
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def test_pool_restored_beside_its_running_original_is_refused_then_restores_once_it_is_gone(tmp_path, repo):
    """A job started with `gpusnap run` may be restored beside its running original, but a Pool's
    named semaphores are found by name: the copy would share the original's locks. Refused
    (exit 25, naming the process), nothing restored; once the original is gone it restores."""
    expected = _reference(tmp_path, POOL_JOB, "forkserver", 150, 0)
    out = tmp_path / "job"
    out.mkdir()
    (out / "job.py").write_text(POOL_JOB)
    res = run_gpusnap("run", "--json", "--name", "pool", "--repo", repo, "--",
                      sys.executable, out / "job.py", out, "forkserver", 150, 40)
    assert res.returncode == 0, res.stdout + res.stderr
    pid = json.loads(res.stdout)["pid"]
    restored = None
    try:
        wait_for(lambda: _progress(out) >= 20, "step 20")
        snap = run_json("dump", pid, "--repo", repo)["snapshot"]
        r = run_gpusnap("restore", snap, "--repo", repo, "--json")
        assert r.returncode == 25, r.stdout + r.stderr
        err = json.loads(r.stdout)
        assert "/dev/shm/sem." in err["message"] and "in use by process" in err["message"], err
        assert _state(pid) in ("R", "S")        # the original runs on, untouched
        os.kill(pid, signal.SIGKILL)            # the namespace's init: the whole job goes
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the original job to go")
        restored = run_json("restore", snap, "--repo", repo)
        wait_for(lambda: (out / "result").exists(), "the restored pool's result", timeout=60)
        assert (out / "result").read_text() == expected
    finally:
        kill_pids(restored["pids"] if restored else [pid])
