"""`restore --via lazy` with the real CRIU: the job runs while gpusnap fills its memory through
userfaultfd (gpusnap/criu/lazypages.py). It must end exactly as an uninterrupted run, also
when it forks, mremaps, unmaps and madvises during the fill; a gpusnap killed mid-fill must
take the job with it (never leave it running on zero-filled memory); a signal mid-fill is
deferred; a damaged page kills the job and fails the restore. The bookkeeping of what is
still pending (Mm) is checked on its own at the end."""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import PY, ROOT, kill_pids, run_gpusnap, run_json
from gpusnap.criu.lazyplan import Mm, _cut
from gpusnap.errors import UsageError
from gpusnap.ops.restore import choose_via
from gpusnap.repo.parallel_read import _inside
from gpusnap.system import proc

JOB = dict(steps=120, mb=24, threads=2)
CHURN = Path(__file__).parent / "jobs" / "churn.py"


def _running_with_arg(arg: str) -> list[int]:
    """The running processes whose command line holds `arg` as one of its words."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and _running(int(d.name)):
            try:
                words = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if arg.encode() in words:
                out.append(int(d.name))
    return out


def _running(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return st[st.rindex(")") + 2] not in "ZX"


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


class Churn:
    """tests/jobs/churn.py, dumped and killed: ready to be restored."""

    def __init__(self, out: Path, repo: Path, mb: int = 16):
        self.mb = mb
        self.out = out
        self.repo = repo
        out.mkdir(parents=True)
        self.popen = subprocess.Popen([PY, str(CHURN), str(out), "--mb", str(mb)], cwd=ROOT,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=open(out.parent / f"{out.name}.err", "wb"), start_new_session=True)
        _wait(lambda: (out / "ready").exists(), 60, "the churn job did not start")
        self.pids = [int(p) for p in (out / "pids").read_text().split()]
        self.expected = (out / "expected").read_text().strip()
        self.snap = run_json("dump", self.pids[0], "--repo", repo)["snapshot"]
        kill_pids(self.pids)
        self.popen.wait(timeout=30)
        _wait(lambda: not any(Path(f"/proc/{p}").exists() for p in self.pids), 30, "the job's PIDs stayed taken")

    def restore(self, pause: float, *args: str, fault: str | None = None) -> subprocess.Popen:
        env = {**os.environ, "GPUSNAP_LAZY_PAUSE": str(pause), **({"GPUSNAP_FAULT": fault} if fault else {})}
        return subprocess.Popen([PY, "-m", "gpusnap", "restore", self.snap, "--via", "lazy", "--json", *args],
                                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def go(self, what: str = "go") -> None:
        """Start churning (or, with "orphan-go", make a process that leaves the tree) as soon
        as the restored job exists (it acts once it runs)."""
        _wait(lambda: Path(f"/proc/{self.pids[0]}").exists(), 60, "the restored job never appeared")
        (self.out / what).touch()

    def rounds(self) -> int:
        try:
            return int((self.out / "rounds").read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def finish(self) -> dict:
        (self.out / "finish").touch()
        _wait(lambda: (self.out / "result").exists(), 120, "the restored job gave no result")
        return json.loads((self.out / "result").read_text())


@pytest.fixture
def churn(tmp_path):
    jobs: list[Churn] = []

    def make(**kw) -> Churn:
        jobs.append(Churn(tmp_path / f"churn{len(jobs)}", tmp_path / "repo", **kw))
        return jobs[-1]

    yield make
    for j in jobs:
        kill_pids(j.pids)


pytestmark = pytest.mark.criu


def test_lazy_restore_finishes_like_an_uninterrupted_run(sample_job, repo, reference):
    job = sample_job(**JOB)
    job.wait_steps(10)
    snap = run_json("dump", job.pid, "--repo", repo)["snapshot"]
    job.kill()
    restored = run_json("restore", snap, "--repo", repo, "--via", "lazy")
    try:
        assert restored["via"] == "lazy" and restored["pid"] == job.pid
        assert 0 < restored["running_seconds"] <= restored["seconds"]
        assert restored["lazy"]["bytes"] >= JOB["mb"] << 20           # the job's buffers came lazily
        assert "fill" in restored["phases"]
        assert job.result() == reference(**JOB)
    finally:
        kill_pids(job.pids)


def test_forks_remaps_unmaps_and_madvise_during_the_fill(churn):
    job = churn()
    r = job.restore(0.03)
    job.go("orphan-go")
    job.go()
    out, err = r.communicate(timeout=300)
    rounds_during_fill = job.rounds()
    assert r.returncode == 0, err
    info = json.loads(out)
    _wait(lambda: (job.out / "orphan-ok").exists(), 60, "the process that left the tree never hashed its memory")
    assert (job.out / "orphan-ok").read_text().strip() == "1", "the process that left the tree read wrong memory"
    orphan = int((job.out / "orphan").read_text())
    res = job.finish()
    _wait(lambda: not _running(orphan), 30, "the process that left the tree did not end with the job")
    assert res["mismatches"] == []
    assert res["digest"] == job.expected, "the restored job's memory differs from the dumped job's"
    assert res["keeper"] == job.expected, "the second process of the tree came back different"
    # the churn overlapped the fill, and the daemon followed every kind of event
    assert rounds_during_fill >= 1
    ev = info["lazy"]
    assert ev["forks"] >= 1 and ev["remaps"] >= 1 and ev["unmaps"] >= 1 and ev["faults"] >= 1, ev


@pytest.fixture
def private_tmpdir(monkeypatch):
    """A TMPDIR of the test's own: any other restore on the machine removes the work
    directories that dead restores left in a shared one (what a test may look for). Short:
    CRIU's and gpusnap's unix sockets live in it."""
    d = tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", d)
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_gpusnap_killed_mid_fill_takes_the_job_with_it(churn, private_tmpdir):
    """Without the watcher the kernel would zero-fill what was not copied yet and the job
    would run on with wrong memory; with it, the job dies, and the snapshot restores again."""
    job = churn()
    r = job.restore(0.2)
    job.go()
    _wait(lambda: job.rounds() >= 1 or r.poll() is not None, 60, "the restored job never ran")
    assert r.poll() is None, "the fill ended before the test could interrupt it"
    r.kill()
    r.wait()
    _wait(lambda: not any(_running(p) for p in job.pids), 30,
          "the job kept running after gpusnap died in the middle of filling its memory")
    _wait(lambda: not any(Path(f"/proc/{p}").exists() for p in job.pids), 30, "the job's PIDs stayed taken")
    # what the killed gpusnap could not clean up: its work directory (and its image files)
    left = _leftovers(r.pid, job.repo)
    assert any(p.name.startswith("gpusnap-restore-") for p in left), left
    # nothing lost: the same snapshot restores (eagerly this time) and ends right, and that
    # run removes the leftovers of the dead one
    restored = run_json("restore", job.snap)
    assert restored["via"] != "lazy"
    assert _leftovers(r.pid, job.repo) == []
    res = job.finish()
    assert res["digest"] == job.expected and res["keeper"] == job.expected


def _leftovers(pid: int, repo: Path) -> list[Path]:
    """Restore work and image directories of gpusnap process `pid`, wherever they go."""
    import tempfile

    places = [Path(tempfile.gettempdir()), Path("/dev/shm"), repo / "tmp"]
    return [p for d in places if d.is_dir() for p in d.iterdir()
            if p.name.startswith((f"gpusnap-restore-{pid}-", f"gpusnap-images-{pid}-"))]


def test_a_signal_mid_fill_is_deferred_until_every_page_is_in(churn):
    job = churn()
    r = job.restore(0.1)
    job.go()
    _wait(lambda: job.rounds() >= 1 or r.poll() is not None, 60, "the restored job never ran")
    assert r.poll() is None, "the fill ended before the test could interrupt it"
    r.send_signal(signal.SIGTERM)
    r.send_signal(signal.SIGINT)
    out, err = r.communicate(timeout=300)
    assert r.returncode == 0, err
    info = json.loads(out)
    assert info["lazy"]["signals_deferred"] == 2
    assert any("signal" in n for n in info["notes"])
    res = job.finish()
    assert res["digest"] == job.expected and res["mismatches"] == []


def _damage_page_of_c(job: Churn) -> None:
    """Flip one bit of a page in the second half of the churn job's buffer C (which only the
    fill touches, late enough for the test to act first): its random bytes are stored raw, so
    the page is found in the packs by its content."""
    import numpy as np

    n = job.mb << 20
    rng = np.random.default_rng(5)              # tests/jobs/churn.py's seed and order: A, B, C
    c = [rng.bytes(n) for _ in range(3)][2]
    page = c[3 * n // 4: 3 * n // 4 + 4096]
    for pack in (p for p in (job.repo / "packs").rglob("*") if p.is_file()):
        data = bytearray(pack.read_bytes())
        at = data.find(page)
        if at >= 0:
            data[at + 100] ^= 0x40
            os.chmod(pack, 0o600)
            pack.write_bytes(bytes(data))
            return
    raise AssertionError("the page to damage is in no pack")


def test_damaged_page_fails_the_restore_and_kills_the_job(churn, tmp_path):
    job = churn()
    # a page only the fill reads (a page the image files carry is found before the job
    # runs, as on the files path)
    _damage_page_of_c(job)
    r = run_gpusnap("restore", job.snap, "--via", "lazy", "--json")
    assert r.returncode == 9, r.stdout + r.stderr
    msg = json.loads(r.stdout)["message"]
    # found while filling (the job had run): the job is killed, and the message says so
    assert "damaged" in msg and "the restored job was killed" in msg, msg
    _wait(lambda: not any(_running(p) for p in job.pids), 30, "a job restored from a damaged snapshot kept running")


@pytest.mark.parametrize("end", ["gpusnap killed", "damaged page"])
def test_a_process_that_left_the_tree_mid_fill_is_killed_too(churn, tmp_path, end):
    """A double fork while the memory is filled (the middle process exits at once, so the
    grandchild is reparented out of the tree, with pages still pending): when the restore
    fails (a damaged page: gpusnap kills the job) or gpusnap dies (its watcher does), that
    process dies with the rest instead of running on with zero-filled memory."""
    job = churn()
    if end == "damaged page":
        _damage_page_of_c(job)
    # gpusnap killed: by itself (the fault hook, docs/faults.md) the moment it has told its
    # watcher about the process that left the tree, while the fill goes on
    r = job.restore(0.3, fault="lazy:watcher-told-adopted:KILL" if end == "gpusnap killed" else None)
    job.go("orphan-go")
    _wait(lambda: (job.out / "orphan").exists() or r.poll() is not None, 60, "no process left the tree")
    if end == "gpusnap killed":
        # the hook fired, so a process had left the tree (its parent: gpusnap, the subreaper)
        # mid-fill; it may have been killed before it could write its PID: every process of
        # the job, whatever its PID, must end (a restored process keeps the job's command line)
        assert r.wait(timeout=120) == -signal.SIGKILL, r.communicate()
        _wait(lambda: not _running_with_arg(str(job.out)), 30, "a process of the job kept running")
        return
    assert r.poll() is None, "the fill ended before a process of the job left the tree"
    orphan = int((job.out / "orphan").read_text())
    try:
        st = proc.read_stat(orphan)
        assert st is not None and st.ppid not in job.pids, "the grandchild is still in the job's tree"
        out, _ = r.communicate(timeout=300)
        assert r.returncode == 9 and "the restored job was killed" in json.loads(out)["message"], out
        _wait(lambda: not _running(orphan), 30, "the process that had left the tree kept running")
        _wait(lambda: not any(_running(p) for p in job.pids), 30, "the job kept running")
    finally:
        kill_pids([orphan])


@pytest.mark.parametrize("via", ["lazy", "files", "stream"])
def test_criu_failing_mid_restore_says_why_and_leaves_nothing_behind(tmp_path, repo, via):
    """CRIU fails mid-restore (the job's port is taken; for lazy, after the daemon and its
    watcher started): exit 8 with the port named (not "PIDs taken", which the processes CRIU
    had begun and killed seemed to say), no process of the job, no watcher and no image
    directory left; freed, the snapshot restores lazily and serves."""
    import socket

    from test_sockets import PAGE, HttpServer, wait_answering

    server = HttpServer(tmp_path)
    restored = None
    try:
        snap = run_json("dump", server.pid, "--repo", repo)["snapshot"]
        server.kill()
        blocker = socket.socket()
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", server.port))
        blocker.listen(1)
        try:
            r = run_gpusnap("restore", snap, "--repo", repo, "--via", via, "--json")
        finally:
            blocker.close()
        assert r.returncode == 8, r.stdout + r.stderr
        assert "port" in json.loads(r.stdout)["hint"]
        assert not _running(server.pid)
        watchers = [p for p in os.listdir("/proc") if p.isdigit() and _running(int(p))
                    and "lazywatch" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert not watchers
        assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith("gpusnap-images-")
                    and not Path(f"/proc/{p.name.split('-')[2]}").exists()]
        restored = run_json("restore", snap, "--repo", repo, "--via", "lazy")["pid"]
        assert wait_answering(server.port, restored) == (200, PAGE)
    finally:
        kill_pids([p for p in (server.pid, restored) if p])
        server.close()


# -- what is pending, on its own ---------------------------------------------------------------

def _mm() -> Mm:
    # two pieces of one pages image: image bytes [0, 16K) at 0x10000, [16K, 24K) at 0x40000
    return Mm(-1, {"p": [[0, 0x10000, 0x4000], [0x4000, 0x40000, 0x2000]]})


def test_take_cuts_pieces_to_the_job_and_keeps_the_rest():
    mm = _mm()
    assert mm.take("p", 0x1000, 0x5000) == [[0x1000, 0x11000, 0x3000], [0x4000, 0x40000, 0x1000]]
    assert mm.pending["p"] == [[0, 0x10000, 0x1000], [0x5000, 0x41000, 0x1000]]
    assert mm.take("p", 0x8000, 0x9000) == [] and mm.take("q", 0, 1 << 30) == []
    mm.put("p", [0x1000, 0x11000, 0x1000])
    assert [p[0] for p in mm.pending["p"]] == [0, 0x1000, 0x5000]
    assert mm.bytes_pending() == 0x3000


def test_unmapped_ranges_are_dropped_and_remapped_ones_follow():
    mm = _mm()
    mm.drop(0x11000, 0x12000)                      # a hole in the first piece
    assert mm.pending["p"] == [[0, 0x10000, 0x1000], [0x2000, 0x12000, 0x2000], [0x4000, 0x40000, 0x2000]]
    mm.remap(0x12000, 0x90000, 0x1000)             # half of a piece moves
    assert mm.find(0x90000) == ("p", 0x2000) and mm.find(0x12000) is None
    assert mm.find(0x13000) == ("p", 0x3000)
    child = mm.clone(-2)
    mm.drop(0, 1 << 47)
    assert mm.bytes_pending() == 0 and child.bytes_pending() == 0x1000 + 0x2000 + 0x2000


def test_cut_splits_a_piece_around_a_range():
    p = [0, 0x1000, 0x4000]
    assert _cut(p, 0x2000, 0x3000) == ([0, 0x1000, 0x1000], [0x1000, 0x2000, 0x1000], [0x2000, 0x3000, 0x2000])
    assert _cut(p, 0x8000, 0x9000) == (p, None, None)
    assert _cut(p, 0, 0x800) == (None, None, p)


def test_materialize_leaves_out_only_jobs_wholly_inside_a_lazy_range():
    holes = [(0, 8 << 20), (12 << 20, 20 << 20)]
    assert _inside(holes, 0, 4 << 20) and _inside(holes, 12 << 20, 16 << 20)
    assert not _inside(holes, 6 << 20, 10 << 20) and not _inside(holes, 8 << 20, 12 << 20)
    assert not _inside(None, 0, 1)


def test_gpu_snapshots_are_refused_for_lazy_restore():
    snap = SimpleNamespace(path="/r/snapshots/s", manifest={"meta": {"cuda_pids": [42]}})
    with pytest.raises(UsageError):
        choose_via("lazy", snap, 0)
    assert choose_via("lazy", SimpleNamespace(path="/r/s", manifest={"meta": {}}), 0) == "lazy"
