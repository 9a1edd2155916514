"""While a dump holds its staging memory, the OOM killer's first choice is gpusnap, never the job
(gpusnap/system/oom.py): gpusnap runs with oom_score_adj 1000 from before its arena is faulted
in, CRIU and the guardian of --exit are put back to the value gpusnap started with. The end to
end test runs a real job and a real dump in a memory cgroup too small for both: the kernel
kills the dump, the job runs on and, dumped again with room, restores to the uninterrupted
result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, run_json, wait_for
from gpusnap.errors import UsageError
from gpusnap.system import oom, proc


@pytest.fixture
def own_score():
    """This process's oom_score_adj, put back after the test whatever it did."""
    before = oom.read()
    yield before
    oom.write(before)


def test_a_dump_is_expendable_inside_and_as_before_after(own_score, monkeypatch):
    monkeypatch.delenv("GPUSNAP_DUMP_OOM_SCORE_ADJ", raising=False)
    with oom.expendable() as got:
        assert got == 1000 and oom.read() == 1000 and oom.inherited() == own_score
        with oom.expendable() as inner:          # an outer dump already raised it: left alone
            assert inner is None and oom.read() == 1000
        assert oom.read() == 1000
    assert oom.read() == own_score and oom.inherited() is None


def test_the_value_is_put_back_when_the_dump_fails(own_score, monkeypatch):
    monkeypatch.delenv("GPUSNAP_DUMP_OOM_SCORE_ADJ", raising=False)
    with pytest.raises(RuntimeError):
        with oom.expendable():
            raise RuntimeError("the dump failed")
    assert oom.read() == own_score


def test_the_setting_chooses_the_value_or_keeps_it(own_score, monkeypatch):
    monkeypatch.setenv("GPUSNAP_DUMP_OOM_SCORE_ADJ", "500")
    with oom.expendable() as got:
        assert got == 500 and oom.read() == 500
    monkeypatch.setenv("GPUSNAP_DUMP_OOM_SCORE_ADJ", "keep")
    with oom.expendable() as got:
        assert got is None and oom.read() == own_score and oom.inherited() is None
    for bad in ("1001", "lots"):
        monkeypatch.setenv("GPUSNAP_DUMP_OOM_SCORE_ADJ", bad)
        with pytest.raises(UsageError, match="GPUSNAP_DUMP_OOM_SCORE_ADJ"):
            with oom.expendable():
                pass
        assert oom.read() == own_score


@pytest.mark.skipif(os.geteuid() != 0, reason="writes another process's oom_score_adj")
def test_a_process_started_meanwhile_is_spared(own_score, monkeypatch):
    """A child inherits 1000 at fork; spare() puts it back to gpusnap's starting value."""
    monkeypatch.delenv("GPUSNAP_DUMP_OOM_SCORE_ADJ", raising=False)
    with oom.expendable():
        child = subprocess.Popen(["sleep", "30"])
        try:
            assert oom.read(child.pid) == 1000
            oom.spare(child.pid)
            assert oom.read(child.pid) == own_score
        finally:
            child.kill()
            child.wait()
    spare_after = subprocess.Popen(["sleep", "30"])     # outside a dump: nothing to put back
    try:
        oom.spare(spare_after.pid)
        assert oom.read(spare_after.pid) == own_score
    finally:
        spare_after.kill()
        spare_after.wait()


def _state(pid: int) -> str:
    st = proc.read_stat(pid)
    return st.state if st is not None else "X"


def _stopped(pid: int) -> bool:
    return _state(pid) in "Tt"


def _running(pid: int) -> bool:
    """Alive and not stopped (a process the OOM killer took is a zombie until reaped)."""
    return _state(pid) not in "TtZX"


@pytest.mark.criu
@pytest.mark.slow
def test_during_a_real_dump_gpusnap_is_expendable_and_criu_is_not(sample_job, repo, reference, tmp_path):
    """gpusnap stops itself right after starting CRIU (test hook): there gpusnap's value is
    1000 and CRIU's the starting one; let go, the dump commits and the snapshot restores to
    the uninterrupted result."""
    kw = dict(mb=96, steps=300)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(20)
    start = oom.read()
    dump = subprocess.Popen([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "GPUSNAP_FAULT": "dump:criu-running:STOP"})
    try:
        wait_for(lambda: dump.poll() is not None or _stopped(dump.pid), "gpusnap to stop at CRIU's start")
        assert dump.poll() is None, dump.communicate()
        criu = [p for p in proc.children(dump.pid) if Path(f"/proc/{p}/comm").read_text().strip() == "criu"]
        assert len(criu) == 1, proc.children(dump.pid)
        assert oom.read(dump.pid) == 1000
        assert oom.read(criu[0]) == start
        os.kill(dump.pid, signal.SIGCONT)
        out, err = dump.communicate(timeout=300)
    finally:
        if dump.poll() is None:
            dump.kill()
            dump.wait()
    assert dump.returncode == 0, (out, err)
    info = json.loads(out)
    assert info["staging"]["oom_score_adj"] == 1000
    snap = info["snapshot"]
    job.kill()
    run_json("restore", snap, "--repo", repo)
    assert job.result() == reference(**kw)


@pytest.mark.criu
@pytest.mark.slow
def test_the_guardian_of_an_exit_dump_is_not_expendable(sample_job, repo, reference, tmp_path):
    """`dump --exit` held after CRIU stopped the job: gpusnap at 1000, the guardian at the
    starting value; gpusnap killed there (as the OOM killer would), the guardian resumes the
    job, which finishes with the uninterrupted result."""
    kw = dict(mb=64, steps=300)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(20)
    start = oom.read()
    hold = tmp_path / "hold.json"
    dump = subprocess.Popen([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--exit"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "GPUSNAP_TEST_HOLD": f"after-gate:{hold}"})
    try:
        wait_for(lambda: hold.exists() or dump.poll() is not None, "the dump to reach the hold")
        assert dump.poll() is None, "the dump ended before the hold"
        guardians = [p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                     if "gpusnap.ops.guardian" in proc.cmdline(p)]
        assert len(guardians) == 1
        assert oom.read(dump.pid) == 1000
        assert oom.read(guardians[0]) == start
        assert _stopped(job.pid)
        os.kill(dump.pid, signal.SIGKILL)
        dump.wait()
        wait_for(lambda: not _stopped(job.pid), "the guardian to resume the job", timeout=60)
    finally:
        if dump.poll() is None:
            dump.kill()
            dump.wait()
    assert job.result() == reference(**kw)
    assert run_json("ls", "--repo", repo)["snapshots"] == []


class MemoryCgroup:
    """A memory cgroup of our own (v1 memory controller, or v2 with memory enabled), removed after."""

    def __init__(self, name: str):
        v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
        if (v1 / "memory.limit_in_bytes").exists():
            self.path, self.v2 = v1 / name, False
        elif "memory" in _read(v2 / "cgroup.subtree_control").split():
            self.path, self.v2 = v2 / name, True
        else:
            raise OSError("no memory cgroup controller to make a cgroup in")
        self.path.mkdir()

    def limit(self, nbytes: int | None) -> None:
        if self.v2:
            (self.path / "memory.max").write_text("max" if nbytes is None else str(nbytes))
        else:
            (self.path / "memory.limit_in_bytes").write_text("-1" if nbytes is None else str(nbytes))

    def usage(self) -> int:
        return int(_read(self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes")))

    def oom_kills(self) -> int:
        text = _read(self.path / ("memory.events" if self.v2 else "memory.oom_control"))
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def argv(self, cmd: list[str]) -> list[str]:
        """cmd, started inside this cgroup (so its memory is charged here from the start)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *cmd]

    def remove(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.2)


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


@pytest.mark.criu
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and CRIU")
def test_out_of_memory_during_a_dump_kills_the_dump_not_the_job(repo, reference, tmp_path):
    """A job and its dump in a memory cgroup with room for the job and not for the dump's
    staging: the kernel's OOM killer takes gpusnap; the job runs on, unfrozen, nothing is
    committed; with room again, a dump commits and restores to the uninterrupted result."""
    try:
        cg = MemoryCgroup(f"gpusnap-oom-{os.getpid()}")
    except OSError as e:
        pytest.skip(str(e))
    kw = dict(mb=160, steps=400, threads=2)
    out = tmp_path / "job"
    out.mkdir()
    args = [str(out), "--steps", "400", "--mb", "160", "--threads", "2", "--step-ms", "20", "--seed", "1234"]
    job = subprocess.Popen(cg.argv([sys.executable, "-m", "gpusnap.samples.job", *args]), cwd=ROOT,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    pids = [job.pid]
    try:
        from gpusnap.samples.job import steps_done

        wait_for(lambda: steps_done(out) >= 10, "the job to start")
        pids = [int(x) for x in (out / "pid").read_text().split()]
        # room for the job and gpusnap's interpreter, not for a staging arena the job's size
        cg.limit(cg.usage() + (120 << 20))
        dump = subprocess.run(cg.argv([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--json"]),
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "GPUSNAP_DUMP_OOM_SCORE_ADJ": ""})
        assert dump.returncode == -signal.SIGKILL, (dump.returncode, dump.stdout, dump.stderr)
        assert cg.oom_kills() >= 1
        assert all(_running(p) for p in pids), {p: _state(p) for p in pids}
        before = steps_done(out)
        wait_for(lambda: steps_done(out) > before + 5, "the job to run on")
        assert run_json("ls", "--repo", repo)["snapshots"] == []
        cg.limit(None)
        info = run_json("dump", job.pid, "--repo", repo)
        kill_pids(pids)
        job.wait(timeout=30)
        run_json("restore", info["snapshot"], "--repo", repo)
        wait_for(lambda: (out / "result").exists(), "the restored job to finish", timeout=120)
        assert (out / "result").read_text().strip() == reference(**kw)
    finally:
        kill_pids(pids)
        for p in map(int, filter(str.isdigit, os.listdir("/proc"))):
            if str(out) in proc.cmdline(p):
                kill_pids([p])
        cg.remove()


def test_slurm_run_says_a_killed_dump_was_killed(tmp_path):
    """slurm-run runs `gpusnap dump` as a child: one SIGKILLed (the OOM killer's choice) is
    reported as killed, naming the OOM killer, not as a bare `exit -9`."""
    from gpusnap.ops.slurm_run import Options, Supervisor

    sup = Supervisor(Options(name="j", repo=tmp_path / "repo", command=["true"]),
                     gpusnap_argv=["sh", "-c", 'kill -9 $$', "gpusnap"])
    rc, data = sup._gpusnap("dump", "1")
    assert rc == -signal.SIGKILL
    assert data["message"].startswith("gpusnap dump was killed by SIGKILL") and "OOM killer" in data["message"]
    sup.gpusnap = ["sh", "-c", 'kill -TERM $$', "gpusnap"]
    assert sup._gpusnap("dump", "1")[1]["message"] == "gpusnap dump was killed by SIGTERM"
