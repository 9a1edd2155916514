"""While a dump holds its staging memory, the OOM killer's first choice is gpusnap, never the job
(gpusnap/system/oom.py): gpusnap runs with oom_score_adj 1000 from before its arena is faulted
in, CRIU and the guardian of --exit are put back to the value gpusnap started with. The end to
end test runs a real job and a real dump in a memory cgroup too small for both: the kernel
kills the dump, the job runs on and, dumped again with room, restores to the uninterrupted
result."""

from __future__ import annotations

import contextlib
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

    def __init__(self, name: str, parent: "MemoryCgroup | None" = None):
        v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
        if parent is not None:
            self.path, self.v2 = parent.path / name, parent.v2
            if self.v2:     # a v2 child has a memory controller only where its parent hands it down
                (parent.path / "cgroup.subtree_control").write_text("+memory")
        elif (v1 / "memory.limit_in_bytes").exists():
            self.path, self.v2 = v1 / name, False
        elif "memory" in _read(v2 / "cgroup.subtree_control").split():
            self.path, self.v2 = v2 / name, True
        else:
            raise OSError("no memory cgroup controller to make a cgroup in")
        self.path.mkdir()

    @property
    def name(self) -> str:
        """As /proc/PID/cgroup names it (the hierarchy mounted at its root, as here)."""
        top = Path("/sys/fs/cgroup") if self.v2 else Path("/sys/fs/cgroup/memory")
        return "/" + str(self.path.relative_to(top))

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


def _tasks(pids: list[int]) -> dict[str, str]:
    """Every thread of the processes: its state and where it sleeps in the kernel."""
    got = {}
    for p in pids:
        for t in sorted(os.listdir(f"/proc/{p}/task")) if os.path.isdir(f"/proc/{p}/task") else []:
            st = proc.read_stat(int(t))
            got[f"{p}/{t}"] = f"{st.state if st else 'X'} {_read(Path(f'/proc/{p}/task/{t}/wchan'))}"
    return got


def _unfrozen(pids: list[int]) -> bool:
    """Alive, and no thread stopped (CRIU seizes and stops every thread, not only the leader)."""
    states = _tasks(pids)
    return all(_running(p) for p in pids) and all(v[0] not in "TtZX" for v in states.values())


@contextlib.contextmanager
def _job_in_a_cgroup(where: Path, kw: dict | None = None, step_ms: int = 20):
    """A sample job (CGROUP_JOB, or `kw`) started inside a memory cgroup of its own: (cgroup,
    job, its pids, out), once it made 3 steps."""
    try:
        cg = MemoryCgroup(f"gpusnap-oom-{os.getpid()}-{where.name}")
    except OSError as e:
        pytest.skip(str(e))
    out = where / "job"
    out.mkdir(parents=True)
    args = [str(out), "--seed", "1234", "--step-ms", str(step_ms)]
    for k, v in (kw or CGROUP_JOB).items():
        args += [f"--{k}", str(v)]
    job = subprocess.Popen(cg.argv([sys.executable, "-m", "gpusnap.samples.job", *args]), cwd=ROOT,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    pids = [job.pid]
    try:
        from gpusnap.samples.job import steps_done

        wait_for(lambda: steps_done(out) >= 3, "the job to start")
        pids[:] = [int(x) for x in (out / "pid").read_text().split()]
        yield cg, job, pids, out
    finally:
        kill_pids(pids)
        for p in map(int, filter(str.isdigit, os.listdir("/proc"))):
            if str(out) in proc.cmdline(p):
                kill_pids([p])
        cg.remove()


@pytest.fixture
def cgroup_job(tmp_path):
    with _job_in_a_cgroup(tmp_path) as got:
        yield got


CGROUP_JOB = dict(mb=160, steps=400, threads=2)
# the OOM scene's job writes its log every half second, not every 20 ms: a write into the page
# cache the OOM had just emptied is what made the kernel's second kill (test below) likely
OOM_JOB = dict(mb=160, steps=60, threads=2)


def _restores_to_the_reference(info: dict, cg_job, repo, reference, kw: dict = CGROUP_JOB) -> None:
    cg, job, pids, out = cg_job
    kill_pids(pids)
    job.wait(timeout=30)
    run_json("restore", info["snapshot"], "--repo", repo)
    wait_for(lambda: (out / "result").exists(), "the restored job to finish", timeout=120)
    assert (out / "result").read_text().strip() == reference(**kw)


@pytest.mark.criu
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and CRIU")
def test_out_of_memory_during_a_dump_kills_the_dump_not_the_job(repo, reference, tmp_path):
    """A job and its dump in a memory cgroup with room for the job and not for the staging
    budget set (larger than the room the cgroup leaves, which the default would have taken),
    the arena's guard off (with it, the next test: the arena stops short and the rest spills):
    the kernel's OOM killer takes gpusnap; the job runs on, unfrozen, nothing is committed; with
    room again, a dump commits and restores to the uninterrupted result.
    The kernel may kill twice in one episode: a job that allocates while gpusnap's memory is
    being reaped can be its next victim (seen in CI, in dmesg: "Killed process <gpusnap>" then
    "Killed process <job>" in the same second, the second invoked by the job's page-cache
    write; the job here writes twice a second rather than every 20 ms). That is the kernel's
    choice, made after gpusnap's: a try with a second kill (the cgroup holds only gpusnap and
    the job, CRIU not started yet) is played again, up to 3 times. A job killed without gpusnap
    killed, or left frozen, fails at once."""
    from gpusnap.samples.job import steps_done

    run_json("init", "--repo", repo)    # (a kill inside a first dump's creation: test_repo_init.py)
    seen = []
    for attempt in range(3):
        with _job_in_a_cgroup(tmp_path / f"try{attempt}", OOM_JOB, step_ms=500) as cg_job:
            cg, job, pids, out = cg_job
            # room for the job and gpusnap's interpreter, not for a staging arena the job's size
            cg.limit(cg.usage() + (120 << 20))
            dump = subprocess.run(cg.argv([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--json"]),
                                  cwd=ROOT, capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "GPUSNAP_DUMP_OOM_SCORE_ADJ": "", "GPUSNAP_STAGING_BUDGET": "176M",
                                       "GPUSNAP_ARENA_GUARD": "0"})
            assert dump.returncode == -signal.SIGKILL, (dump.returncode, dump.stdout, dump.stderr)
            kills = cg.oom_kills()
            assert kills >= 1
            if kills >= 2:      # (a killed leader may still show R while it exits)
                seen.append(f"try {attempt}: {kills} OOM kills, the job's processes {_tasks(pids)}")
                continue        # the kernel's second victim: play the scene again
            assert _unfrozen(pids), _tasks(pids)
            # The job's own progress inside a cgroup squeezed to its limit is the kernel's
            # business (its page-cache writes wait on reclaim there): with the limit lifted, a
            # job that any thread of the dump had left frozen would still not move.
            cg.limit(None)
            before = steps_done(out)
            wait_for(lambda: steps_done(out) > before + 5, f"the job to run on ({before} steps; {_tasks(pids)})")
            assert run_json("ls", "--repo", repo)["snapshots"] == []
            info = run_json("dump", job.pid, "--repo", repo)
            _restores_to_the_reference(info, cg_job, repo, reference, OOM_JOB)
            return
    pytest.fail("the kernel killed the job after gpusnap in every try: " + "; ".join(seen))


@pytest.mark.criu
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and CRIU")
def test_a_budget_above_the_room_stops_the_arena_short_of_the_oom_killer(cgroup_job, repo, reference):
    """The scene above with the arena's guard on, as users run it: a staging budget set by
    hand above what the cgroup leaves (here 160 MiB: more than a dump needs beside a part of
    its arena, less than the whole). The arena's threads stop short of the limit and say so;
    the staging holds what was faulted in and spills the rest; the dump commits with no OOM
    kill, the job runs on, and the snapshot restores to the uninterrupted result."""
    cg, job, pids, out = cg_job = cgroup_job
    cg.limit(cg.usage() + (160 << 20))       # room for some of the arena, not for the budget
    dump = subprocess.run(cg.argv([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--json",
                                   "--staging-budget", "176M"]),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert dump.returncode == 0, (dump.returncode, dump.stdout, dump.stderr)
    assert cg.oom_kills() == 0
    staging = json.loads(dump.stdout)["staging"]
    assert staging["budget"] == 176 << 20, staging
    assert f"memory cgroup {cg.name} leaves" in (staging["arena_short"] or ""), staging
    assert 0 < staging["arena_bytes"] < 160 << 20 and staging["memory_peak"] <= staging["arena_bytes"] + (4 << 20)
    assert staging["spilled_bytes"] >= (160 << 20) - staging["arena_bytes"], staging
    assert _unfrozen(pids), _tasks(pids)
    _restores_to_the_reference(json.loads(dump.stdout), cg_job, repo, reference)


@pytest.mark.criu
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and CRIU")
def test_a_dump_in_a_tight_memory_cgroup_stages_within_the_room_it_leaves(cgroup_job, repo, reference):
    """The same job and cgroup with the default budget: gpusnap sizes its staging by what the
    cgroup leaves, not by the machine's memory, spills the rest and commits, with no OOM kill;
    the snapshot restores to the uninterrupted result."""
    cg, job, pids, out = cg_job = cgroup_job
    cg.limit(cg.usage() + (120 << 20))
    dump = subprocess.run(cg.argv([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--json"]),
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "GPUSNAP_STAGING_BUDGET"})
    assert dump.returncode == 0, (dump.returncode, dump.stdout, dump.stderr)
    assert cg.oom_kills() == 0
    info = json.loads(dump.stdout)
    staging = info["staging"]
    assert f"memory cgroup {cg.name} leaves" in staging["budget_choice"], staging
    assert staging["budget"] < 120 << 20 and staging["spilled_bytes"] > 0, staging
    assert _unfrozen(pids), _tasks(pids)
    _restores_to_the_reference(info, cg_job, repo, reference)


@pytest.mark.criu
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and CRIU")
def test_a_restore_in_a_tight_memory_cgroup_writes_its_images_to_disk(sample_job, repo, reference):
    """`restore --via files` puts the image files on tmpfs when memory allows: outside any
    limit it does; inside a cgroup whose room is less than twice the images (tmpfs pages are
    charged to it and cannot be reclaimed, and the job comes back beside them) it writes them
    under the repository instead. Both restores finish with the uninterrupted result."""
    try:
        cg = MemoryCgroup(f"gpusnap-restore-{os.getpid()}")
    except OSError as e:
        pytest.skip(str(e))
    try:
        kw = dict(mb=160, steps=300)
        job = sample_job(**kw, step_ms=20)
        job.wait_steps(10)
        snap = run_json("dump", job.pid, "--repo", repo)["snapshot"]
        for where, argv in (("tmpfs", lambda c: c), ("disk", cg.argv)):
            job.kill()      # the job, then the first restored one (gone by itself once finished)
            wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in job.pids), "the job's PIDs to be free")
            (job.out / "result").unlink(missing_ok=True)
            cg.limit(None)
            cg.limit(cg.usage() + (400 << 20))
            got = subprocess.run(argv([*GPUSNAP, "restore", snap, "--repo", str(repo), "--via", "files", "--json"]),
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert got.returncode == 0, got.stderr
            assert json.loads(got.stdout)["images"] == where, got.stdout
            assert job.result() == reference(**kw)
        assert cg.oom_kills() == 0
    finally:
        cg.remove()


@pytest.mark.skipif(os.geteuid() != 0, reason="makes cgroups")
def test_the_tightest_memory_cgroup_above_a_process_bounds_what_it_may_take(tmp_path):
    """A limit on a parent cgroup binds its child: memcg.room() reads every level up to the
    root, available() takes it where it is less than the machine's MemAvailable, and so do the
    staging budget given that and a restore's choice of tmpfs; with no limit left, the machine's figure again."""
    try:
        parent = MemoryCgroup(f"gpusnap-room-{os.getpid()}")
    except OSError as e:
        pytest.skip(str(e))
    child = None
    try:
        child = MemoryCgroup("inner", parent)
        parent.limit(256 << 20)
        code = ("import json; from gpusnap.system import memcg; from gpusnap.staging import budget; "
                "from gpusnap.repo import materialize; r = memcg.room(); "
                "print(json.dumps([r and [r.bytes, r.cgroup, r.limit], memcg.available(), "
                "budget.choose_budget(None, memcg.available()), materialize.mem_available()]))")

        def inside():
            got = subprocess.run(child.argv([sys.executable, "-c", code]), cwd=ROOT, capture_output=True,
                                 text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                             if k != "GPUSNAP_STAGING_BUDGET"})
            assert got.returncode == 0, got.stderr
            return json.loads(got.stdout)

        room, (avail, where), (budget, why), shm_avail = inside()
        assert room is not None and room[1] == parent.name and room[2] == 256 << 20, room
        assert 128 << 20 < room[0] <= 256 << 20 and abs(avail - room[0]) < 16 << 20
        assert where.startswith(f"the {avail >> 20} MiB its memory cgroup {parent.name} leaves (limit 256 MiB)")
        assert abs(budget - avail // 2) < 16 << 20 and why.startswith("half the ") and parent.name in why
        # a restore's image files on tmpfs are charged to the cgroup too: it weighs the same room
        assert abs(shm_avail - avail) < 16 << 20
        parent.limit(None)
        room, (avail, where), (budget, why), shm_avail = inside()
        assert room is None and shm_avail > 256 << 20 and where.endswith(" MiB available") and avail > 256 << 20
    finally:
        if child is not None:
            child.remove()
        parent.remove()


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
