"""Fault injection through real dumps, real CRIU, real signals, a real full disk.

Signals land at exact points of a dump through the product's test hook
(GPUSNAP_FAULT=POINT:SIG, gpusnap/system/faults.py, docs/faults.md): before CRIU starts, while
CRIU streams pages, and at every step of the commit; a second signal during the unwinding
too. A full disk is a small tmpfs, filled (while gpusnap is held at a point by SIGSTOP
through the same hook) to leave exactly N bytes free, N stepping through the whole window
of the commit. Prune is killed at each of its steps. After every fault: the job runs,
`verify` is clean, the next dump exits 0; at the end every snapshot still listed is
restored and finishes with the result of an uninterrupted run.

The job is tests/jobs/workloads.py's "relocate" kind (8 MiB): its memory changes only on a
relocate event (2 % of it, so every dump has new pages to commit), and its result after
generation g is known (expected_digest), so each snapshot's restore is checked against the
generation it was taken at. The figures of a run are in docs/faults.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, PY, ROOT, kill_pids, run_gpusnap, run_json
from jobs.workloads import expected_digest

pytestmark = [pytest.mark.criu, pytest.mark.slow]

WORKLOAD = ROOT / "tests" / "jobs" / "workloads.py"
MB = 8

# Every point of a dump the hook knows, in the order a dump reaches them.
POINTS = ["writer:open",               # preflight done, repository locked; CRIU not started
          "pack:opened",               # CRIU streaming: the first new page reached a pack
          "commit:start",              # CRIU done, the stream drained
          "pack:renamed",              # the last pack fsynced and renamed
          "commit:packs-durable",      # packs' directories fsynced
          "commit:index-renamed",      # the dump's index is in index/ (the old bug's window)
          "commit:locations-written",
          "commit:manifest-written",
          "commit:snapshot-renamed",   # the commit point
          "commit:done"]
COMMITTED_AT = {"commit:snapshot-renamed", "commit:done"}
NAMED_NOT_COMMITTED = {"commit:index-renamed", "commit:locations-written", "commit:manifest-written"}

FIGURES = ROOT / "build" / "fault-figures.json"     # what a run measured (docs/faults.md)


def _figure(key: str, **values) -> None:
    FIGURES.parent.mkdir(exist_ok=True)
    try:
        data = json.loads(FIGURES.read_text())
    except (OSError, ValueError):
        data = {}
    data[key] = values
    FIGURES.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


class Job:
    """A running (or restored) relocate workload; gen = relocations it has seen."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self._stdio = open(out / "stdio.txt", "ab")
        self.popen = subprocess.Popen([PY, str(WORKLOAD), str(out), "--kind", "relocate", "--mb", str(MB)],
                                      stdin=subprocess.DEVNULL, stdout=self._stdio, stderr=self._stdio,
                                      cwd=ROOT, start_new_session=True)
        self.pid = self.popen.pid
        self.gen = 0
        self._wait_file("ready")

    def _wait_file(self, name: str, timeout: float = 60) -> str:
        path = self.out / name
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return path.read_text()
            if not self.alive():
                raise AssertionError(f"the job died: {(self.out / 'stdio.txt').read_text()[-2000:]}")
            time.sleep(0.02)
        raise AssertionError(f"{path} did not appear in {timeout} s")

    def state(self) -> str:
        try:
            st = Path(f"/proc/{self.pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # reaped between open and read: ESRCH
            return "gone"
        return st[st.rindex(")") + 2]

    def alive(self) -> bool:
        return self.state() not in ("gone", "Z", "X")

    def relocate(self) -> None:
        """A new generation; the acknowledgement also proves the job runs (not stopped)."""
        self.gen += 1
        (self.out / f"relocate.{self.gen}").touch()
        self._wait_file(f"relocated.{self.gen}")

    def kill(self) -> None:
        kill_pids([self.pid])
        if self.popen is not None:
            self.popen.wait(timeout=30)
            self.popen = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.state() != "gone":
            time.sleep(0.02)

    def reset_controls(self) -> None:
        for p in self.out.iterdir():
            if p.name in ("finish", "result") or p.name.startswith(("relocate.", "relocated.")):
                p.unlink()

    def finish(self, timeout: float = 60) -> str:
        (self.out / "finish").touch()
        return self._wait_file("result", timeout).strip()

    def close(self) -> None:
        kill_pids([self.pid])
        if self.popen is not None:
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._stdio.close()


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path / "job")
    yield j
    j.close()


_expected: dict[int, str] = {}


def expected(gen: int) -> str:
    if gen not in _expected:
        _expected[gen] = expected_digest("relocate", MB, 1, relocations=gen)
    return _expected[gen]


def criu_dumping(pid: int) -> list[int]:
    """PIDs of CRIU processes dumping `pid` (CRIU runs in its own session: gpusnap's death
    does not end it; it unwinds on the broken stream and resumes the job)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"criu") and b"dump" in argv and str(pid).encode() in argv:
            out.append(int(d))
    return out


def wait_criu_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while criu_dumping(pid):
        assert time.monotonic() < deadline, "CRIU did not finish after gpusnap died"
        time.sleep(0.05)


def listed(repo: Path) -> set[str]:
    d = repo / "snapshots"
    return {p.name for p in d.iterdir() if not p.name.startswith(".")} if d.exists() else set()


class Ledger:
    """Which snapshot holds which generation of the job; counts what happened."""

    def __init__(self, repo: Path, job: Job):
        self.repo, self.job = repo, job
        self.gen_of: dict[str, int] = {}
        self.faults = 0
        self.committed_victims = 0
        self.restored_next = 0

    def dump(self, *extra, name="job") -> dict:
        info = run_json("dump", self.job.pid, "--repo", self.repo, "--name", name, *extra)
        self.gen_of[Path(info["snapshot"]).name] = self.job.gen
        return info

    def faulted_dump(self, env: dict, name="job") -> subprocess.CompletedProcess:
        before = listed(self.repo)
        r = run_gpusnap("dump", self.job.pid, "--repo", self.repo, "--name", name, env=env)
        self.faults += 1
        for n in listed(self.repo) - before:
            self.gen_of[n] = self.job.gen
            self.committed_victims += 1
        return r

    def after_fault(self, what: str, restore: bool = False) -> None:
        """The job runs, verify is clean, the next dump exits 0 (and prunes, keeping 3);
        restore: the job is then killed and that next snapshot restored in its place, and
        the sequence goes on with the restored job (whose later snapshots restore_all()
        checks against the uninterrupted results)."""
        wait_criu_gone(self.job.pid)
        assert self.job.state() in ("S", "R"), (what, self.job.state())
        v = run_gpusnap("verify", "--repo", self.repo)
        assert v.returncode == 0, (what, v.stdout, v.stderr)
        info = self.dump("--keep-last", "3")
        if restore:
            self.job.kill()
            self.job.reset_controls()
            r = run_json("restore", info["snapshot"], "--repo", self.repo)
            assert r["pid"] == self.job.pid
            self.restored_next += 1

    def restore_all(self) -> int:
        """Restore every listed snapshot in turn; each finishes with its generation's result."""
        names = sorted(listed(self.repo))
        assert names
        for n in names:
            self.job.kill()
            self.job.reset_controls()
            r = run_json("restore", n, "--repo", self.repo)
            try:
                assert r["pid"] == self.job.pid
                assert self.job.finish() == expected(self.gen_of[n]), n
            finally:
                kill_pids(r.get("pids") or [self.job.pid])
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and self.job.state() != "gone":
                    time.sleep(0.02)
        return len(names)


SIGNAL_CASES = {
    "TERM": POINTS + ["commit:index-renamed:TERM,abort:start:INT", "commit:packs-durable:TERM,abort:packs-done:KILL"],
    # INT unwinds as TERM does (KeyboardInterrupt instead of dump.py's _Terminate): one
    # point per phase (before CRIU, streaming, drained, inside the commit, committed)
    "INT": ["writer:open", "pack:opened", "commit:start", "commit:index-renamed", "commit:manifest-written",
            "commit:done"],
    "KILL": POINTS,
    "HUP": ["pack:opened", "commit:index-renamed", "commit:manifest-written", "commit:snapshot-renamed"],
}


@pytest.mark.parametrize("sig", sorted(SIGNAL_CASES))
def test_signal_at_every_point_of_a_dump(job, tmp_path, sig):
    repo = tmp_path / "repo"
    led = Ledger(repo, job)
    led.dump()
    codes = {}
    for case in SIGNAL_CASES[sig]:
        spec = case if "," in case else f"{case}:{sig}"
        job.relocate()                      # new pages for the victim to commit
        r = led.faulted_dump({"GPUSNAP_FAULT": spec})
        assert r.returncode != 0, (spec, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, (spec, r.stderr)
        codes[spec] = r.returncode
        # where the victim's index stays in index/, the next dump reuses its pages: restore it
        led.after_fault(spec, restore=case in NAMED_NOT_COMMITTED)
    restored = led.restore_all()
    _figure(f"signal-{sig}", faults=led.faults, committed_victims=led.committed_victims,
            next_dumps_restored=led.restored_next, snapshots_restored=restored, exit_codes=codes)


def test_term_the_moment_the_index_appears_loses_nothing_named(job, tmp_path):
    """With real timing and no hook: SIGTERM to the dump the moment
    its index file shows up in index/. Wherever the signal lands, nothing named is lost:
    verify is clean, and the next dump, which reuses the victim's pages when its index
    stayed, restores to the right result."""
    repo = tmp_path / "repo"
    led = Ledger(repo, job)
    led.dump(name="good")
    job.relocate()
    n0 = len(os.listdir(repo / "index"))
    before = listed(repo)
    p = subprocess.Popen([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--name", "victim"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    while len(os.listdir(repo / "index")) == n0 and p.poll() is None:
        pass
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    p.communicate(timeout=300)
    for n in listed(repo) - before:           # the signal came after the commit point
        led.gen_of[n] = job.gen
    led.faults += 1
    led.after_fault("TERM when the index appeared", restore=True)
    restored = led.restore_all()
    assert restored >= 2
    _figure("issue-repro", faults=1, exit_code=p.returncode, committed_victims=len(listed(repo) - before) - 1,
            next_dumps_restored=1, snapshots_restored=restored)


def _stopped(p: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        st = Path(f"/proc/{p.pid}/stat").read_text()
        if st[st.rindex(")") + 2] == "T":
            return
        assert p.poll() is None and time.monotonic() < deadline, "gpusnap did not reach the fault point"
        time.sleep(0.01)


def _fill(fs: Path, free: int) -> Path:
    st = os.statvfs(fs)
    avail = st.f_bavail * st.f_frsize
    p = fs / "filler"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if avail > free:
            os.posix_fallocate(fd, 0, avail - free)
    finally:
        os.close(fd)
    return p


@pytest.fixture
def tmpfs(tmp_path):
    d = tmp_path / "fs"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m,mode=0700", "tmpfs", str(d)], check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_full_disk_at_every_write_of_a_dump(job, tmpfs):
    """gpusnap is held (SIGSTOP, through the hook) at a point, the tmpfs is filled to leave
    exactly N bytes, and gpusnap continues: N = a few sizes while CRIU streams, and every
    4 KiB through the commit's window (found by stepping until the dump commits)."""
    repo = tmpfs / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    led = Ledger(repo, job)
    led.dump()
    outcomes = {"exit 11, nothing named": 0, "exit 11, index kept": 0, "committed": 0}

    def attempt(point: str, free: int) -> bool:
        job.relocate()
        n_index = len(os.listdir(repo / "index"))
        before = listed(repo)
        kept = False
        env = dict(os.environ, GPUSNAP_FAULT=f"{point}:STOP")
        p = subprocess.Popen([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--name", "job"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        try:
            _stopped(p)
            filler = _fill(tmpfs, free)
            os.kill(p.pid, signal.SIGCONT)
            out, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        led.faults += 1
        os.unlink(filler)
        assert p.returncode in (0, 11), (point, free, p.returncode, err)
        assert "Traceback" not in err, err
        for n in listed(repo) - before:
            led.gen_of[n] = job.gen
        if p.returncode == 0:
            outcomes["committed"] += 1
        elif len(os.listdir(repo / "index")) > n_index:
            outcomes["exit 11, index kept"] += 1
            kept = True
        else:
            outcomes["exit 11, nothing named"] += 1
        led.after_fault(f"{point} with {free} bytes free", restore=p.returncode != 0 and kept)
        return p.returncode == 0

    for free in (0, 16 << 10, 64 << 10):        # while CRIU streams (page lists, packs)
        assert not attempt("writer:open", free)
    # the commit: coarse steps until it commits, then every 4 KiB below that
    free, step, ok_at = 0, 32 << 10, None
    while ok_at is None:
        assert free < 4 << 20, "the commit never fitted"
        if attempt("commit:start", free):
            ok_at = free
        free += step
    for free in range(max(0, ok_at - step) + 4096, ok_at, 4096):
        attempt("commit:start", free)
    assert outcomes["exit 11, index kept"] >= 1, outcomes     # the old bug's window was hit
    restored = led.restore_all()
    _figure("enospc", faults=led.faults, outcomes=outcomes, next_dumps_restored=led.restored_next,
            snapshots_restored=restored, commit_fits_with_bytes_free=ok_at)


PRUNE_STEPS = ["snapshot-renamed", "snapshots-deleted", "packs-rewritten", "index-written", "locations-one",
               "locations-written", "index-deleted-one", "index-replaced", "pack-deleted"]

_PRUNE_CRASH = """
import os, signal, sys
from gpusnap.repo import Repository
from gpusnap.repo.maint.prune import execute_prune, plan_prune
repo = Repository.open(sys.argv[1])
step, how = sys.argv[2], sys.argv[3]
def fault(s):
    if s == step:
        os.kill(os.getpid(), getattr(signal, "SIG" + how))
with repo.writer_lock(), repo.readers_lock(exclusive=True):
    execute_prune(repo, plan_prune(repo.snapshots(), 1), _fault=fault)
print("not reached", file=sys.stderr)
sys.exit(3)
"""


def test_crash_inside_prune(job, tmp_path):
    """The prune a dump's --keep-last runs, killed (or interrupted) at each of its steps."""
    repo = tmp_path / "repo"
    led = Ledger(repo, job)
    led.dump()
    reached = 0
    for step in PRUNE_STEPS:
        for how in ("KILL",) + (("INT",) if step in ("packs-rewritten", "index-written") else ()):
            job.relocate()                      # something to prune, with pages that moved
            led.dump()
            r = subprocess.run([PY, "-c", _PRUNE_CRASH, str(repo), step, how], capture_output=True, text=True,
                               cwd=ROOT, timeout=300)
            led.faults += 1
            if r.returncode in (-signal.SIGKILL, 1) or "KeyboardInterrupt" in r.stderr:
                reached += 1
            else:
                assert r.returncode == 0, (step, how, r.stderr)    # this prune had no such step
            for n in set(led.gen_of) - listed(repo):
                del led.gen_of[n]
            led.after_fault(f"prune {step} {how}", restore=step in ("index-deleted-one", "pack-deleted"))
    assert reached >= len(PRUNE_STEPS), reached
    restored = led.restore_all()
    _figure("prune", faults=led.faults, crashes_reached=reached, next_dumps_restored=led.restored_next,
            snapshots_restored=restored)
