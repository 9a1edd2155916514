"""A job with a private huge-page mapping (MAP_PRIVATE|MAP_HUGETLB), with the real CRIU:
dumped, killed, restored, and it finishes with the result of an uninterrupted run.

Under `--stream` CRIU cannot restore such a mapping (its restorer preadv()s the pages image
at an offset: ESPIPE), so restore must choose image files, and must refuse `--via stream`
up front instead of failing inside CRIU.
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
from gpusnap.samples.job import steps_done

pytestmark = pytest.mark.criu

HUGE_MB = 8
JOB = r'''
import hashlib, mmap, os, sys, time
out, steps, step_ms, mb = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
n = mb << 20
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000)   # MAP_HUGETLB
for off in range(0, n, 4096):
    m[off:off + 8] = off.to_bytes(8, "little")
log = open(os.path.join(out, "job.log"), "a", buffering=1)   # O_APPEND: CRIU does not pin its size
with open(os.path.join(out, "pid"), "w") as f:
    f.write(str(os.getpid()))
for step in range(1, steps + 1):
    off = (step * 7 * 4096 + step * 64) % (n - 64)
    m[off:off + 32] = hashlib.sha256(m[off:off + 64] + step.to_bytes(4, "little")).digest()
    log.write(f"step {step}/{steps}\n")
    if step_ms:
        time.sleep(step_ms / 1000)
res = hashlib.sha256(m[:]).hexdigest()
with open(os.path.join(out, "result.tmp"), "w") as f:
    f.write(res)
os.rename(os.path.join(out, "result.tmp"), os.path.join(out, "result"))
'''


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


@pytest.fixture
def hugepages():
    """Reserve huge pages for the test (vm.nr_hugepages), give the old setting back after."""
    knob = Path("/proc/sys/vm/nr_hugepages")
    try:
        old = int(knob.read_text())
    except OSError as e:
        pytest.skip(f"no huge-page support here: {e}")
    size_kb = _meminfo("Hugepagesize") or 2048
    want = (2 * HUGE_MB * 1024) // size_kb + 4       # the job, the reference run, some slack
    try:
        knob.write_text(str(old + want))
    except OSError as e:
        pytest.skip(f"the kernel refuses to reserve huge pages (vm.nr_hugepages): {e}")
    try:
        if _meminfo("HugePages_Free") * size_kb < 2 * HUGE_MB * 1024:
            pytest.skip(f"the kernel reserved only {_meminfo('HugePages_Free')} free huge pages")
        yield old
    finally:
        knob.write_text(str(old))


def _start(out: Path, steps: int, step_ms: float) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    script = out.parent / "hugejob.py"
    script.write_text(JOB)
    return subprocess.Popen([sys.executable, str(script), str(out), str(steps), str(step_ms), str(HUGE_MB)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


@pytest.mark.slow
@pytest.mark.parametrize("via", ["auto", "lazy"])
def test_private_hugetlb_job_restores_and_finishes_identically(hugepages, tmp_path, repo, via):
    ref = _start(tmp_path / "reference", 400, 0)
    assert ref.wait(timeout=120) == 0
    expected = (tmp_path / "reference" / "result").read_text()

    out = tmp_path / "job"
    job = _start(out, 400, 20)
    try:
        wait_for(lambda: steps_done(out) >= 20, "the job's first steps")
        snap = run_json("dump", job.pid, "--repo", repo, "--name", "huge")["snapshot"]
        meta = json.loads((Path(snap) / "manifest").read_text().rsplit("\nblake3:", 1)[0])["meta"]
        assert meta["hugetlb_bytes"] >= HUGE_MB << 20
        assert not (out / "result").exists()
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
        wait_for(lambda: not Path(f"/proc/{job.pid}").exists(), "the killed job's PID to be free")

        # a stream cannot carry it: refused before CRIU runs, saying what to do
        r = run_gpusnap("restore", snap, "--repo", repo, "--via", "stream", "--json")
        assert r.returncode == 2, r.stdout + r.stderr
        err = json.loads(r.stdout)
        assert "huge pages" in err["message"] and "--via files" in err["hint"]
        assert not Path(f"/proc/{job.pid}").exists()

        # a pool too small: refused before CRIU runs (exit 26), saying how to reserve them
        knob = Path("/proc/sys/vm/nr_hugepages")
        reserved = int(knob.read_text())
        knob.write_text(str(hugepages))        # the setting before this test (others' pages stay)
        try:
            if _meminfo("HugePages_Free") * (_meminfo("Hugepagesize") or 2048) < HUGE_MB * 1024:
                r = run_gpusnap("restore", snap, "--repo", repo, "--json")
                assert r.returncode == 26, r.stdout + r.stderr
                assert "vm.nr_hugepages" in json.loads(r.stdout)["hint"]
                assert not Path(f"/proc/{job.pid}").exists()
        finally:
            knob.write_text(str(reserved))

        # auto: image files; lazy: image files too, the huge pages in them (CRIU never restores
        # hugetlb lazily), the rest of the job's memory filled while it runs
        restored = run_json("restore", snap, "--repo", repo, "--via", via)
        assert restored["via"] == ("files" if via == "auto" else "lazy") and restored["pid"] == job.pid
        if via == "lazy":
            assert restored["lazy"]["bytes"] > 0
        try:
            wait_for(lambda: (out / "result").exists(), "the restored job's result", timeout=120)
            assert (out / "result").read_text() == expected
        finally:
            kill_pids([job.pid])
        # the private image directory is gone
        leftovers = [p for d in (Path("/dev/shm"), Path(repo) / "tmp") if d.is_dir()
                     for p in d.iterdir() if p.name.startswith("gpusnap-images-")]
        assert not [p for p in leftovers if not Path(f"/proc/{p.name.split('-')[2]}").exists()], leftovers
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


MAPPER = r'''
import mmap, os, sys, time
kind, mb = sys.argv[1], int(sys.argv[2])
n = mb << 20
if kind == "huge":
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000)   # MAP_HUGETLB
else:
    m = mmap.mmap(-1, n)
    fd = os.open(sys.argv[3], os.O_RDWR | os.O_CREAT, 0o600)    # a tmpfs file: no block device
    os.ftruncate(fd, 1 << 20)
    shm = mmap.mmap(fd, 1 << 20)
for off in range(0, n, 4096):
    m[off] = 1
print("ready", flush=True)
time.sleep(60)
'''


def _mapper(tmp_path: Path, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", MAPPER, *args], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_hugetlb_bytes_without_huge_pages_reads_no_smaps(tmp_path):
    """Plain anonymous memory and a file on tmpfs (major 0, so smaps is read after all):
    no hugetlb bytes, the same answer as reading smaps for every process."""
    from gpusnap.ops import restore_needs

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    p = _mapper(tmp_path, "plain", "32", str(shm / f"gpusnap-test-{os.getpid()}"))
    try:
        assert restore_needs.hugetlb_bytes([p.pid]) == 0 == restore_needs._smaps_hugetlb(p.pid)
        # this interpreter maps only files on block devices and anonymous memory, unless its
        # files live on a major-0 filesystem (overlay, tmpfs): then the check reads smaps
        me = os.getpid()
        assert restore_needs.hugetlb_bytes([me]) == restore_needs._smaps_hugetlb(me)
        assert restore_needs._maybe_hugetlb(p.pid)      # the tmpfs mapping is a candidate
    finally:
        p.kill()
        p.wait()
        (shm / f"gpusnap-test-{os.getpid()}").unlink(missing_ok=True)


def test_hugetlb_bytes_counts_a_private_huge_page_mapping(hugepages, tmp_path):
    from gpusnap.ops import restore_needs

    p = _mapper(tmp_path, "huge", str(HUGE_MB))
    try:
        assert restore_needs._maybe_hugetlb(p.pid)
        assert restore_needs.hugetlb_bytes([p.pid]) == HUGE_MB << 20
    finally:
        p.kill()
        p.wait()
    assert restore_needs.hugetlb_bytes([p.pid]) == 0      # gone: counts as none
