#!/usr/bin/env python3
"""gpusnap against raw CRIU, side by side in one run (design.md section 7). Needs root.

    python scripts/bench.py [--mb 512] [--reps 4] [--kinds fp32,inference,random,relocate]
                            [--dir /var/tmp/gpusnap-bench] [--json FILE] [--no-verify]
                            [--settle 2]
    python scripts/bench.py --sizes 0.5,1,2,4,8 [--kinds random,fp32] ...
                            (the growth curve: scripts/bench_growth.py)

For every workload of tests/jobs/workloads.py and every repetition, on a fresh job that
ticks every 2 ms in a thread of its own (--tick-ms):
  1. raw  `criu dump -t PID -D RAW --leave-running`  and  `gpusnap dump PID --repo R --json`
     (the order alternates between repetitions; `sync` before each timed step, so neither
     pays for the other's writeback; RAW and R are on the same filesystem, under --dir).
     Each is followed by `sync`: "until committed" is the command's wall time plus that
     sync (raw CRIU does not fsync its images; gpusnap fsyncs its packs). The freeze is the
     longest gap between two ticks that the job itself saw during the command.
  1b. CRIU's --stream mode alone (scripts/stream_floor.py): the same dump into a capture
     server that drops every byte; the floor under gpusnap's 'criu' phase.
  2. relocate only: the job moves its weights to a new allocation, and a second gpusnap
     dump gives the incremental size (bytes stored by the second / by the first dump).
  3. the job is killed (reaped, PID free); then, first from a warm page cache and then from a
     cold one (`sync; echo 3 > /proc/sys/vm/drop_caches` before each restore), raw
     `criu restore -d -D RAW` and `gpusnap restore --via stream` are timed, each restored
     job killed before the next; warm and cold too, `criu restore --stream` fed unchanged
     from RAW (stream_floor.py): the floor under the stream path. Then `gpusnap restore --via lazy`
     (the job runs while its memory is filled; timed until it runs again, which is the
     command's wall time less the fill after that, and until every page is in: the wall
     time), warm and cold; then `--via files`, warm and cold, and one untimed raw restore. Last, `gpusnap restore` (auto, cold)
     of the last gpusnap snapshot is timed, and that job must finish with the digest of an
     uninterrupted run.
Every timed step starts after --settle seconds idle (after the `sync`), so that none pays
for the previous one's writeback. On the VMs measured here, memory the guest has not used
lately is slow to fault in (the host backs it on first touch), and memory freed a moment ago
is fast. gpusnap frees its staging arena after its dump and writes its packs around the
page cache, but raw CRIU's images stayed in the page cache after its dump: a gpusnap dump
after raw CRIU's found no recently freed memory (its 544 MiB staging arena took 0.4-0.7 s
to fault in, against 0.06-0.11 s when it dumped first), raw CRIU after gpusnap always did.
So raw CRIU's images are dropped from the page cache once synced (evict_files), and the
order alternates, so an even --reps (the default, 4) gives each side the same share.
For the warm restores both sides' files are read once first. That read also puts them in
the host's cache (drop_caches empties only the guest's), so the cold restores read both
sides' files from there alike; before evict_files, raw CRIU's images were still in the
guest's cache at that point, never reached the host's, and were read from the host's disk
(1.10 s against 0.45-0.56 s for the same restore once read).
A cold restore right after one through files (which frees its tmpfs images and the job at
once) took ~0.2 s longer here (a stream restore of 512 MiB, 5 pairs: median 0.877 s after a
files restore, 0.686 s after a raw one). The files path used to be timed between the
others, so raw CRIU's cold restore and gpusnap's auto restore came right after one and the
stream restore did not; now the files path comes after the raw and stream restores, and an
untimed raw restore separates it from the last, auto, restore.
Wall times are the whole command as a user runs it (process start-up included). gpusnap's
own peak RSS is the VmHWM of the gpusnap Python process alone (polled from /proc while it
runs; CRIU, its child, is not counted), next to its staging budget (--staging-budget). Page
cache for dumps: warm for both.

On a VM that hands freed memory back to its host (free page reporting), the run holds that
off and faults the free memory in once (scripts/host_memory.py; put back at the end, and
--leave-page-reporting measures the VM as it is): otherwise which side pays for memory the
host took back depends on what ran just before (the arena above; raw CRIU's page cache,
inside its freeze).

Medians over the repetitions are printed as a table of ratios against the targets, and
written with every sample to --json; with matplotlib installed (`make bench` installs
it) the ratios are drawn into --chart (docs/benchmark.png).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
import host_memory  # noqa: E402
from jobs.workloads import expected_digest  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
WORKLOAD = ROOT / "tests" / "jobs" / "workloads.py"
KINDS = ("fp32", "inference", "random", "relocate")
SIZE_TARGET = {"fp32": 0.88, "inference": 0.2, "random": 1.01, "relocate": None}
DUMP_TARGET = RESTORE_TARGET = 1.0
RESTORE_WARM_TARGET = 1.2
INCR_TARGET = 0.05
FREEZE_TARGET = 1.0       # issue 10: the job stands frozen no longer than under raw CRIU
COMMITTED_TARGET = 1.3    # dump until committed (both followed by sync), on 2 cores
TICK_MS = 2
SETTLE = 2.0              # --settle: seconds idle before every timed step


def criu_path() -> str:
    return shutil.which("criu") or "/usr/sbin/criu"


def pid_alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return st[st.rindex(")") + 2] not in "ZX"


def wait_pid_free(pid: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.01)
    raise RuntimeError(f"PID {pid} still exists after {timeout} s")


def kill(pid: int, popen: subprocess.Popen | None = None) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if popen is not None:
        popen.wait(timeout=30)   # our own child: reap it
    wait_pid_free(pid)           # a restored job is not our child: init reaps it


def wait_file(path: Path, timeout: float = 300, pid: int | None = None) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        if pid is not None and not pid_alive(pid):
            raise RuntimeError(f"job {pid} died before {path} appeared")
        time.sleep(0.02)
    raise RuntimeError(f"{path} did not appear in {timeout} s")


def dir_bytes(d: Path) -> tuple[int, int]:
    """(sum of file sizes, bytes of pages-*.img)."""
    total = pages = 0
    for p in d.rglob("*"):
        if p.is_file() and p.suffix == ".img":
            n = p.stat().st_size
            total += n
            if p.name.startswith("pages-"):
                pages += n
    return total, pages


def timed(cmd: list[str], poll_hwm: bool = False, **kw) -> dict:
    """Run cmd; wall time, rc, stdout, and (poll_hwm) the process's own VmHWM in KiB."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    hwm = 0
    status = Path(f"/proc/{p.pid}/status")
    if poll_hwm:
        while p.poll() is None:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        hwm = max(hwm, int(line.split()[1]))
                        break
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
            time.sleep(0.005)
    out, err = p.communicate()
    wall = time.monotonic() - t0
    return {"wall": wall, "rc": p.returncode, "stdout": out.decode(errors="replace"),
            "stderr": err.decode(errors="replace")[-3000:], "hwm_kib": hwm or None}


def check(res: dict, what: str) -> dict:
    if res["rc"] != 0:
        raise RuntimeError(f"{what} failed (rc {res['rc']}):\n{res['stdout'][-2000:]}\n{res['stderr']}")
    return res


class Job:
    def __init__(self, out: Path, kind: str, mb: int):
        self.out, self.kind, self.mb = out, kind, mb
        out.mkdir(parents=True)
        self.stdio = open(out / "stdio.txt", "ab")
        self.popen = subprocess.Popen([PY, str(WORKLOAD), str(out), "--kind", kind, "--mb", str(mb),
                                       "--tick-ms", str(TICK_MS)],
                                      stdin=subprocess.DEVNULL, stdout=self.stdio, stderr=self.stdio,
                                      start_new_session=True)
        self.pid = self.popen.pid
        self.gen = 0
        self.gaps = 0
        wait_file(out / "ready", pid=self.pid)

    def gap(self) -> float:
        """The longest gap between the job's ticks since the previous call (seconds)."""
        self.gaps += 1
        (self.out / f"gap.{self.gaps}").touch()
        return json.loads(wait_file(self.out / f"gapped.{self.gaps}", pid=self.pid))["max_gap"]

    def relocate(self) -> dict:
        self.gen += 1
        (self.out / f"relocate.{self.gen}").touch()
        return json.loads(wait_file(self.out / f"relocated.{self.gen}", pid=self.pid))

    def finish(self) -> str:
        (self.out / "finish").touch()
        return wait_file(self.out / "result", pid=self.pid).strip()


def settle() -> None:
    """sync, then --settle seconds idle: the timed step starts on a quiet machine."""
    os.sync()
    time.sleep(SETTLE)


def cache_files(*dirs: Path) -> None:
    """Read every file under dirs once (untimed): a warm page cache for both sides."""
    for d in dirs:
        for dp, _, fns in os.walk(d):
            for fn in fns:
                try:
                    with open(os.path.join(dp, fn), "rb") as f:
                        while f.read(8 << 20):
                            pass
                except OSError:
                    pass


def evict_files(*dirs: Path) -> None:
    """Drop raw CRIU's synced images from the page cache (untimed), so that both dumps leave
    the memory as they found it: gpusnap writes its packs around the page cache and frees
    its staging arena, while raw CRIU's images would stay cached and hold the recently freed
    memory that the other side's dump then needs (see the top of this file)."""
    for d in dirs:
        for dp, _, fns in os.walk(d):
            for fn in fns:
                try:
                    fd = os.open(os.path.join(dp, fn), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _synced(r: dict) -> dict:
    t0 = time.monotonic()
    os.sync()
    r["sync"] = time.monotonic() - t0
    r["committed"] = r["wall"] + r["sync"]
    return r


def gpusnap_dump(pid: int, repo: Path, job: "Job | None" = None, budget: str | None = None) -> dict:
    settle()
    if job is not None:
        job.gap()
    extra = ["--staging-budget", budget] if budget else []
    if not repo.exists():       # (a dump no longer creates its repository: `gpusnap init` does)
        check(timed([PY, "-m", "gpusnap", "init", "--repo", str(repo)], cwd=ROOT), "gpusnap init")
    r = check(timed([PY, "-m", "gpusnap", "dump", str(pid), "--repo", str(repo), "--name", "bench", "--json", *extra],
                    poll_hwm=True, cwd=ROOT), "gpusnap dump")
    if job is not None:
        r["freeze"] = job.gap()
    r["info"] = json.loads(r["stdout"].strip().splitlines()[-1])
    return _synced(r)


def raw_dump(pid: int, raw: Path, job: "Job | None" = None) -> dict:
    settle()
    raw.mkdir(parents=True)
    if job is not None:
        job.gap()
    r = check(timed([criu_path(), "dump", "-t", str(pid), "-D", str(raw), "--leave-running",
                     "-o", "dump.log", "-v2"]), "criu dump")
    if job is not None:
        r["freeze"] = job.gap()
    _synced(r)
    evict_files(raw)
    r["bytes"], r["pages_bytes"] = dir_bytes(raw)
    return r


def stream_floor(*args: str, cold: bool = False) -> float:
    """CRIU's own seconds in --stream mode (scripts/stream_floor.py); cold: from a cold page
    cache (`drop_caches` first), as the cold restores are timed."""
    settle()
    if cold:
        drop_caches()
    r = check(timed([PY, str(ROOT / "scripts" / "stream_floor.py"), *args], cwd=ROOT), "stream floor")
    return json.loads(r["stdout"].strip().splitlines()[-1])["criu_s"]


def drop_caches() -> None:
    """A cold page cache: what a restore after a reboot (or on a busy machine) reads."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def restore_timed(cmd: list[str], cold: bool, **kw) -> dict:
    settle()
    if cold:
        drop_caches()
    return check(timed(cmd, **kw), " ".join(cmd[:4]))


def restore_side(s: dict, job: "Job", raw: Path, repo: Path, snapshot: str, verify: bool, expected: dict,
                 kind: str, mb: int) -> None:
    """Step 3: raw CRIU, CRIU's --stream floor, and gpusnap by both paths (--via stream,
    --via files), each from a warm and from a cold page cache; the last restore (gpusnap,
    auto, cold) must finish with the uninterrupted digest."""
    raw_cmd = [criu_path(), "restore", "-d", "-D", str(raw), "-o", "restore.log", "-v2"]

    def gs_cmd(via: str) -> list[str]:
        return [PY, "-m", "gpusnap", "restore", snapshot, "--repo", str(repo), "--json", "--via", via]

    def gs(key: str, via: str, cold: bool, last: bool = False) -> None:
        r = restore_timed(gs_cmd(via), cold, poll_hwm=True, cwd=ROOT)
        r["info"] = json.loads(r["stdout"].strip().splitlines()[-1])
        s[key] = r
        if not last:
            kill(job.pid)

    for cold in (False, True):
        sfx = "_cold" if cold else ""
        if not cold:
            cache_files(raw, repo)
        s["raw_restore" + sfx] = restore_timed(raw_cmd, cold)
        if not pid_alive(job.pid):
            raise RuntimeError("raw CRIU restore did not bring the job back")
        kill(job.pid)
        s["floor_restore" + sfx] = stream_floor("restore", str(raw), cold=cold)
        kill(job.pid)
        gs("gs_restore_stream" + sfx, "stream", cold)
    # The lazy path (userfaultfd): its command returns once every page is in; the job ran
    # again `seconds - running_seconds` before that (summarize: "until running").
    cache_files(raw, repo)
    gs("gs_restore_lazy", "lazy", False)
    gs("gs_restore_lazy_cold", "lazy", True)
    # The files path last, and an untimed raw restore after it: a cold restore right after
    # one through files took ~0.2 s longer here (its tmpfs images and job freed at once), so
    # whichever restore came next was slowed (see the top of this file).
    cache_files(raw, repo)
    gs("gs_restore_files", "files", False)
    gs("gs_restore_files_cold", "files", True)
    restore_timed(raw_cmd, False)
    kill(job.pid)
    # what a user gets by default, cold, and the restored job must finish identically
    gs("gs_restore", "auto", True, last=True)
    if verify:
        got = job.finish()
        key = (kind, job.gen)
        if key not in expected:
            expected[key] = expected_digest(kind, mb, 1, relocations=job.gen)
        s["digest_ok"] = got == expected[key]
        if not s["digest_ok"]:
            print(f"  !! {kind}: restored job's digest differs from an uninterrupted run", file=sys.stderr)


def compile_bytecode() -> None:
    """Write gpusnap's .pyc files before anything is timed, as a pip install does: with
    PYTHONDONTWRITEBYTECODE set (or a read-only checkout), an editable install compiles
    every module from source at every start (~0.1 s of each command here), which is not
    what a user's installed gpusnap pays."""
    import compileall

    compileall.compile_dir(str(ROOT / "gpusnap"), quiet=1)


def one_rep(kind: str, mb: int, base: Path, rep: int, verify: bool, expected: dict, budget: str | None = None) -> dict:
    d = base / f"{kind}-{rep}"
    job = Job(d / "job", kind, mb)
    raw, repo = d / "raw", d / "repo"
    s: dict = {"kind": kind, "rep": rep, "pid": job.pid, "loadavg": os.getloadavg()[0]}
    try:
        if rep % 2 == 0:
            s["raw_dump"] = raw_dump(job.pid, raw, job)
            s["gs_dump"] = gpusnap_dump(job.pid, repo, job, budget)
        else:
            s["gs_dump"] = gpusnap_dump(job.pid, repo, job, budget)
            s["raw_dump"] = raw_dump(job.pid, raw, job)
        snapshot = s["gs_dump"]["info"]["snapshot"]
        s["floor_dump"] = stream_floor("dump", str(job.pid))
        if kind == "relocate":
            moved = job.relocate()
            assert moved["old"] != moved["new"], moved
            s["gs_dump2"] = gpusnap_dump(job.pid, repo, job, budget)
            snapshot = s["gs_dump2"]["info"]["snapshot"]
        kill(job.pid, job.popen)

        restore_side(s, job, raw, repo, snapshot, verify, expected, kind, mb)
        kill(job.pid)
    finally:
        if pid_alive(job.pid):
            kill(job.pid, job.popen if job.popen.poll() is None else None)
        job.popen.poll()
        job.stdio.close()
        shutil.rmtree(d, ignore_errors=True)
    for k in ("raw_dump", "gs_dump", "gs_dump2", "raw_restore", "gs_restore", "raw_restore_cold",
              "gs_restore_stream", "gs_restore_files", "gs_restore_stream_cold", "gs_restore_files_cold",
              "gs_restore_lazy", "gs_restore_lazy_cold"):
        if k in s:
            s[k].pop("stdout", None)
            if s[k].get("rc") == 0:
                s[k].pop("stderr", None)
    return s


def ratio(key: str, gs: list[float], raw: list[float]) -> dict:
    """{key: the median of the per-repetition ratios gs/raw, key_range: [lowest, highest] of
    them (how much this machine's noise moved the median)}."""
    rs = [g / r for g, r in zip(gs, raw)]
    return {key: statistics.median(rs) if rs else None, key + "_range": [min(rs), max(rs)] if rs else None}


def summarize(kind: str, samples: list[dict]) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    raw_d = [s["raw_dump"]["wall"] for s in samples]
    raw_ds = [s["raw_dump"]["wall"] + s["raw_dump"]["sync"] for s in samples]
    gs_d = [s["gs_dump"]["wall"] for s in samples]
    gs_in = [s["gs_dump"]["info"]["seconds"] for s in samples]
    raw_r = [s["raw_restore"]["wall"] for s in samples]
    raw_rc = [s["raw_restore_cold"]["wall"] for s in samples]
    gs_r = [s["gs_restore"]["wall"] for s in samples]          # auto, cold
    rs = {f"{via}{sfx}": [s[f"gs_restore_{via}{sfx}"]["wall"] for s in samples]
          for via in ("stream", "files") for sfx in ("", "_cold")}
    for sfx in ("", "_cold"):          # lazy: until the job runs again, and until every page is in
        lz = [s[f"gs_restore_lazy{sfx}"] for s in samples]
        rs[f"lazy{sfx}_running"] = [x["wall"] - (x["info"]["seconds"] - x["info"]["running_seconds"]) for x in lz]
        rs[f"lazy{sfx}"] = [x["wall"] for x in lz]
    raw_b = [s["raw_dump"]["bytes"] for s in samples]
    gs_b = [s["gs_dump"]["info"]["bytes_stored"] for s in samples]
    gs_raw = [s["gs_dump"]["info"]["bytes_raw"] for s in samples]
    m = {
        "kind": kind, "reps": len(samples),
        "raw_dump_s": med(raw_d), "raw_dump_sync_s": med(raw_ds), "gpusnap_dump_s": med(gs_d),
        "gpusnap_dump_internal_s": med(gs_in),
        "dump_ratio": med([g / r for g, r in zip(gs_d, raw_d)]),
        "dump_ratio_vs_raw_sync": med([g / r for g, r in zip(gs_d, raw_ds)]),
        "raw_restore_s": med(raw_r), "raw_restore_cold_s": med(raw_rc), "gpusnap_restore_s": med(gs_r),
        "gpusnap_restore_via": samples[-1]["gs_restore"]["info"].get("via"),
        **ratio("restore_ratio", gs_r, raw_rc),
        **{f"gpusnap_restore_{k}_s": med(v) for k, v in rs.items()},
        **{kv: x for k, v in rs.items()
           for kv, x in ratio(f"restore_{k}_ratio", v, raw_rc if "_cold" in k else raw_r).items()},
        "gpusnap_materialize_s": med([s["gs_restore_files"]["info"]["phases"].get("materialize", 0)
                                      for s in samples]),
        "gpusnap_files_criu_phase_s": med([s["gs_restore_files"]["info"]["phases"].get("criu", 0)
                                           for s in samples]),
        "raw_bytes": med(raw_b), "criu_stream_bytes": med(gs_raw), "gpusnap_bytes": med(gs_b),
        "size_ratio": med([g / r for g, r in zip(gs_b, raw_b)]),
        "gpusnap_dump_MBps": med([b / t / 1e6 for b, t in zip(gs_raw, gs_d)]),
        "raw_dump_MBps": med([b / t / 1e6 for b, t in zip(raw_b, raw_d)]),
        "dump_peak_rss_mib": med([s["gs_dump"]["hwm_kib"] / 1024 for s in samples]),
        "restore_peak_rss_mib": med([s["gs_restore"]["hwm_kib"] / 1024 for s in samples]),
        "stream_dump_floor_s": med([s["floor_dump"] for s in samples]),
        "gpusnap_dump_criu_phase_s": med([s["gs_dump"]["info"].get("phases", {}).get("criu", 0) for s in samples]),
        "stream_restore_floor_s": med([s["floor_restore"] for s in samples]),
        "gpusnap_restore_criu_phase_s": med([s["gs_restore_stream"]["info"].get("phases", {}).get("criu", 0)
                                             for s in samples]),
        "stream_restore_floor_cold_s": med([s["floor_restore_cold"] for s in samples]),
        "gpusnap_restore_criu_phase_cold_s": med([s["gs_restore_stream_cold"]["info"].get("phases", {}).get("criu", 0)
                                                  for s in samples]),
        "digest_ok": all(s.get("digest_ok", True) for s in samples),
        "verified": all("digest_ok" in s for s in samples),
    }
    m.update(summarize_dump(samples))
    if kind == "relocate":
        m["incremental_ratio"] = med([s["gs_dump2"]["info"]["bytes_stored"] / s["gs_dump"]["info"]["bytes_stored"]
                                      for s in samples])
        m["gpusnap_dump2_s"] = med([s["gs_dump2"]["wall"] for s in samples])
        m["dump2_ratio"] = med([s["gs_dump2"]["wall"] / r for s, r in zip(samples, raw_d)])
    return m


def summarize_dump(samples: list[dict]) -> dict:
    """The dump side of issue 10: freeze and until-committed ratios, staging."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    raw, gs = [s["raw_dump"] for s in samples], [s["gs_dump"] for s in samples]
    st = [g["info"].get("staging", {}) for g in gs]
    return {
        "raw_freeze_s": med([r["freeze"] for r in raw]), "gpusnap_freeze_s": med([g["freeze"] for g in gs]),
        **ratio("freeze_ratio", [g["freeze"] for g in gs], [r["freeze"] for r in raw]),
        "raw_freeze_samples": [r["freeze"] for r in raw], "gpusnap_freeze_samples": [g["freeze"] for g in gs],
        "gpusnap_frozen_seconds": med([g["info"].get("frozen_seconds") or 0 for g in gs]),
        "raw_committed_s": med([r["committed"] for r in raw]), "gpusnap_committed_s": med([g["committed"] for g in gs]),
        **ratio("committed_ratio", [g["committed"] for g in gs], [r["committed"] for r in raw]),
        "gpusnap_storing_s": med([g["info"].get("phases", {}).get("storing", 0) for g in gs]),
        "staging_budget_mib": med([x.get("budget", 0) / 2**20 for x in st]),
        "staging_memory_peak_mib": med([x.get("memory_peak", 0) / 2**20 for x in st]),
        "staging_spilled_mib": med([x.get("spilled_bytes", 0) / 2**20 for x in st]),
        "staging_overlap": any(x.get("overlap") for x in st),
    }


def ratio_cell(m: dict, key: str) -> str:
    """A median ratio, and the per-repetition range behind it when there is one."""
    r = m.get(key + "_range")
    return f"{m[key]:.2f}" + (f" [{r[0]:.2f}-{r[1]:.2f}]" if r and len(r) == 2 else "")


def dump_rows(m: dict) -> list[tuple]:
    ok = lambda v, t: "" if v is None else ("ok" if v <= t else "MISSED")  # noqa: E731
    return [
        ("", "freeze (longest tick gap) s", f"{m['raw_freeze_s']:.3f}", f"{m['gpusnap_freeze_s']:.3f}",
         ratio_cell(m, "freeze_ratio"), f"<= {FREEZE_TARGET}", ok(m["freeze_ratio"], FREEZE_TARGET)),
        ("", "  gpusnap's frozen_seconds (CRIU's figure)", "", f"{m['gpusnap_frozen_seconds']:.3f}", "", "", ""),
        ("", "dump until committed (+ sync) s", f"{m['raw_committed_s']:.2f}", f"{m['gpusnap_committed_s']:.2f}",
         ratio_cell(m, "committed_ratio"), f"<= {COMMITTED_TARGET}", ok(m["committed_ratio"], COMMITTED_TARGET)),
        ("", "  storing after the job resumed s", "", f"{m['gpusnap_storing_s']:.2f}", "", "", ""),
        ("", "staging budget / memory peak / spilled MiB", "",
         f"{m['staging_budget_mib']:.0f} / {m['staging_memory_peak_mib']:.0f} / {m['staging_spilled_mib']:.0f}",
         "", "", ""),
    ]


def draw_chart(summaries: list[dict], mb: int, path: Path) -> bool:
    """Ratios against raw CRIU per workload as grouped bars, targets as ticks; peak memory
    beside. False when matplotlib is missing (it is a bench-only dependency)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    measures = [("freeze", "freeze_ratio", FREEZE_TARGET),
                ("dump until committed", "committed_ratio", COMMITTED_TARGET),
                ("restore, cold cache (auto)", "restore_ratio", RESTORE_TARGET),
                ("restore, warm cache (stream)", "restore_stream_ratio", RESTORE_WARM_TARGET),
                ("restore, cold, --via lazy: until running", "restore_lazy_cold_running_ratio", RESTORE_TARGET),
                ("size", "size_ratio", None)]
    kinds = [m["kind"] for m in summaries]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(measures)
    for i, (label, key, target) in enumerate(measures):
        vals = []
        for m in summaries:
            v = m.get(key)
            if v is None and key == "size_ratio" and "incremental_ratio" in m:
                v = m["incremental_ratio"]
            vals.append(v if v is not None else 0)
        xs = [k + (i - (len(measures) - 1) / 2) * width for k in range(len(kinds))]
        rng = [m.get(key + "_range") or [v, v] for m, v in zip(summaries, vals)]
        err = [[max(0, v - r[0]) for v, r in zip(vals, rng)], [max(0, r[1] - v) for v, r in zip(vals, rng)]]
        bars = ax.bar(xs, vals, width, yerr=err, capsize=2, error_kw={"elinewidth": 0.7},
                      label=label + (f" (target <= {target})" if target else ""))
        for x, v, r in zip(xs, vals, rng):
            if v:
                ax.text(x, max(v, r[1]), f"{v:.2f}", ha="center", va="bottom", fontsize=7)
            if target:
                ax.hlines(target, x - width / 2, x + width / 2, colors=bars.patches[0].get_facecolor(),
                          linestyles="dashed", linewidth=1)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("gpusnap / raw CRIU (lower is better)")
    ax.set_title(f"gpusnap against raw CRIU, {mb} MiB jobs, medians (whiskers: lowest and highest repetition)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.35)     # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    rss = [m.get("dump_peak_rss_mib") or 0 for m in summaries]
    budget = [m.get("staging_budget_mib") or 0 for m in summaries]
    ax2.bar(range(len(kinds)), rss, 0.6, label="gpusnap peak RSS (dump)")
    ax2.plot(range(len(kinds)), budget, "k_", markersize=20, label="staging budget")
    ax2.set_xticks(range(len(kinds)), kinds, rotation=30)
    ax2.set_ylabel("MiB")
    ax2.set_title("memory")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def table(summaries: list[dict], mb: int) -> str:
    rows = []
    hdr = ("workload", "measure", "raw CRIU", "gpusnap", "ratio", "target", "")
    def fmt_ok(v, t):
        return "" if t is None or v is None else ("ok" if v <= t else "MISSED")
    for m in summaries:
        k = m["kind"]
        rows.append((k, "dump wall s", f"{m['raw_dump_s']:.2f}", f"{m['gpusnap_dump_s']:.2f}",
                     f"{m['dump_ratio']:.2f}", f"<= {DUMP_TARGET}", fmt_ok(m["dump_ratio"], DUMP_TARGET)))
        rows.append(("", "  (raw + sync) s", f"{m['raw_dump_sync_s']:.2f}", "",
                     f"{m['dump_ratio_vs_raw_sync']:.2f}", "", ""))
        rows.extend(dump_rows(m))
        rows.append(("", "  (gpusnap's own 'seconds')", "", f"{m['gpusnap_dump_internal_s']:.2f}",
                     f"{m['gpusnap_dump_internal_s'] / m['raw_dump_s']:.2f}", "", ""))
        rows.append(("", "  CRIU --stream alone / gpusnap's 'criu' phase", f"{m['stream_dump_floor_s']:.2f}",
                     f"{m['gpusnap_dump_criu_phase_s']:.2f}", "", "", ""))
        rows.append(("", "  MB/s (CRIU stream bytes)", f"{m['raw_dump_MBps']:.0f}", f"{m['gpusnap_dump_MBps']:.0f}",
                     "", "", ""))
        rows.append(("", f"restore cold s (auto: {m['gpusnap_restore_via']})", f"{m['raw_restore_cold_s']:.2f}",
                     f"{m['gpusnap_restore_s']:.2f}", ratio_cell(m, "restore_ratio"), f"<= {RESTORE_TARGET}",
                     fmt_ok(m["restore_ratio"], RESTORE_TARGET)))
        for via in ("files", "stream", "lazy_running", "lazy"):
            for sfx, raw_k, tgt in (("_cold", "raw_restore_cold_s", RESTORE_TARGET),
                                    ("", "raw_restore_s", RESTORE_WARM_TARGET)):
                key = f"{via[:4]}{sfx}{via[4:]}" if via == "lazy_running" else via + sfx
                label = {"lazy_running": "lazy, until running", "lazy": "lazy, every page in"}.get(via, via)
                r = m[f"restore_{key}_ratio"]
                rows.append(("", f"  --via {label}, {'cold' if sfx else 'warm'}", f"{m[raw_k]:.2f}",
                             f"{m[f'gpusnap_restore_{key}_s']:.2f}", ratio_cell(m, f"restore_{key}_ratio"),
                             f"<= {tgt}" if via != "lazy" else "", fmt_ok(r, tgt) if via != "lazy" else ""))
        rows.append(("", "  --via files warm: materialize + criu s", "", f"{m['gpusnap_materialize_s']:.2f} + "
                     f"{m['gpusnap_files_criu_phase_s']:.2f}", "", "", ""))
        rows.append(("", "  CRIU --stream restore alone / gpusnap's 'criu' phase", f"{m['stream_restore_floor_s']:.2f}",
                     f"{m['gpusnap_restore_criu_phase_s']:.2f}",
                     f"{m['stream_restore_floor_s'] / m['raw_restore_s']:.2f}", "", ""))
        rows.append(("", "    the same, cold", f"{m['stream_restore_floor_cold_s']:.2f}",
                     f"{m['gpusnap_restore_criu_phase_cold_s']:.2f}",
                     f"{m['stream_restore_floor_cold_s'] / m['raw_restore_cold_s']:.2f}", "", ""))
        t = SIZE_TARGET[k]
        rows.append(("", "size MiB", f"{m['raw_bytes'] / 2**20:.1f}", f"{m['gpusnap_bytes'] / 2**20:.1f}",
                     f"{m['size_ratio']:.3f}", f"<= {t}" if t else "", fmt_ok(m["size_ratio"], t)))
        if "incremental_ratio" in m:
            rows.append(("", "incremental size", "", f"{m['gpusnap_dump2_s']:.2f} s",
                         f"{m['incremental_ratio']:.4f}", f"<= {INCR_TARGET}",
                         fmt_ok(m["incremental_ratio"], INCR_TARGET)))
        if "dump2_ratio" in m:
            rows.append(("", "second dump wall s", "", f"{m['gpusnap_dump2_s']:.2f}", f"{m['dump2_ratio']:.2f}",
                         "", ""))
        rows.append(("", "peak RSS MiB d/r", "", f"{m['dump_peak_rss_mib']:.0f} / {m['restore_peak_rss_mib']:.0f}",
                     "", "bounded", ""))
        rows.append(("", "digest after restore", "", "same" if m["digest_ok"] and m["verified"]
                     else ("not checked" if not m["verified"] else "DIFFERS"), "", "", ""))
    widths = [max(len(str(r[i])) for r in [hdr, *rows]) for i in range(len(hdr))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([f"gpusnap vs raw CRIU, {mb} MiB workloads, medians [lowest-highest ratio of the repetitions]",
                      line(hdr),
                      line(["-" * w for w in widths]), *map(line, rows)])


def main() -> int:
    global SETTLE
    if any(a == "--sizes" or a.startswith("--sizes=") for a in sys.argv[1:]):
        import bench_growth     # the growth curve (issue 33): its own options, see its docstring

        return bench_growth.main(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/gpusnap-bench"))
    ap.add_argument("--json", type=Path, help="write medians and every sample here")
    ap.add_argument("--no-verify", action="store_true", help="skip checking the restored job's digest")
    ap.add_argument("--settle", type=float, default=SETTLE, help="seconds idle before every timed step")
    ap.add_argument("--staging-budget", help="gpusnap dump --staging-budget (default: gpusnap's own)")
    ap.add_argument("--chart", type=Path, default=ROOT / "docs" / "benchmark.png",
                    help="draw the ratios here (needs matplotlib); '' for none")
    ap.add_argument("--leave-page-reporting", action="store_true",
                    help="measure with the VM's free page reporting as it is (scripts/host_memory.py)")
    args = ap.parse_args()
    SETTLE = max(0.0, args.settle)
    if os.geteuid() != 0:
        print("bench needs root: it dumps and restores real processes with CRIU", file=sys.stderr)
        return 1
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            ap.error(f"unknown kind {k!r}")
    compile_bytecode()
    base = args.dir / f"run-{os.getpid()}"
    base.mkdir(parents=True)
    expected: dict = {}
    samples: dict[str, list] = {k: [] for k in kinds}
    held = None if args.leave_page_reporting else host_memory.HostBacked()
    stack = contextlib.ExitStack()
    try:
        if held is not None:
            stack.enter_context(held)
            print(f"host memory: {json.dumps(held.summary)}", file=sys.stderr, flush=True)
        for rep in range(args.reps):
            for k in kinds:
                t0 = time.monotonic()
                s = one_rep(k, args.mb, base, rep, not args.no_verify, expected, args.staging_budget)
                samples[k].append(s)
                print(f"[{k} rep {rep + 1}/{args.reps}, load {s['loadavg']:.1f}] freeze raw {s['raw_dump']['freeze']:.3f}s "
                      f"gpusnap {s['gs_dump']['freeze']:.3f}s; dump raw {s['raw_dump']['wall']:.2f}s "
                      f"gpusnap {s['gs_dump']['wall']:.2f}s; restore cold raw {s['raw_restore_cold']['wall']:.2f}s "
                      f"gpusnap {s['gs_restore']['wall']:.2f}s ({time.monotonic() - t0:.0f}s)", file=sys.stderr)
    finally:
        stack.close()               # (the page reporting put back)
        shutil.rmtree(base, ignore_errors=True)
        try:
            args.dir.rmdir()
        except OSError:
            pass
    summaries = [summarize(k, samples[k]) for k in kinds]
    sys.stderr.flush()
    print(table(summaries, args.mb), flush=True)
    if str(args.chart) not in ("", "."):
        if draw_chart(summaries, args.mb, args.chart):
            print(f"chart: {args.chart}", file=sys.stderr)
        else:
            print("chart: skipped (no matplotlib; `make bench` installs it)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({
            "mb": args.mb, "reps": args.reps, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "loadavg_per_sample": {k: [x["loadavg"] for x in samples[k]] for k in kinds},
            "targets": {"freeze_ratio": FREEZE_TARGET, "committed_ratio": COMMITTED_TARGET,
                        "dump_ratio": DUMP_TARGET, "restore_ratio": RESTORE_TARGET,
                        "restore_warm_ratio": RESTORE_WARM_TARGET, "size": SIZE_TARGET,
                        "incremental_ratio": INCR_TARGET},
            "page_cache": "dumps: warm; restores: warm (both sides' files read first) and cold (drop_caches), see the keys",
            "settle_s": SETTLE,
            "host_memory": held.summary if held is not None else "as the machine has it (--leave-page-reporting)",
            "summary": summaries, "samples": samples}, indent=1) + "\n")
    ok = all(m["digest_ok"] for m in summaries)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
