"""`gpusnap slurm-run`: a batch job that survives preemption, time limits and node failures.

Used as the command of a Slurm batch script (`exec gpusnap slurm-run --name N -- CMD ...`), it
supervises one job, unchanged:

- on the first start it starts CMD the way `gpusnap run` does (own session and PID namespace);
  after a requeue (SLURM_RESTART_COUNT > 0) it restores the newest snapshot of the name that
  restores, falling back to older ones and finally to a fresh start, and says which;
- it snapshots the job every `--every` (retention `--keep-last`), so that a hard node failure
  loses at most one interval;
- on the preemption/time-limit signal (`#SBATCH --signal=B:USR1@SECONDS`, or SIGTERM) it takes a
  final `dump --exit` and asks Slurm to requeue the job;
- it is a child subreaper, so a restored tree (detached by CRIU) becomes its child: the restored
  processes live in the new job's cgroup, are accounted to it and receive its signals.

Every event is one JSON line in REPO/jobs/NAME/slurm.jsonl (and one human line on stderr, which
is the job's Slurm output); when it runs under Slurm the job's Comment says where it resumed from.
dump, restore and verify run as `gpusnap` subcommands with --json: the command-line contract is
what this supervisor relies on, as a user's script would.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.ops import run as run_op
from gpusnap.system import proc
from gpusnap.errors import RepositoryError, RepositoryLocked, UsageError
from gpusnap.repo import fsutil

PR_SET_CHILD_SUBREAPER = 36
EVENTS = "slurm.jsonl"
LOCK_PATIENCE_FINAL_S = 60.0
REQUEUE_WAIT_S = 120.0  # after `scontrol requeue`, wait this long for Slurm to end this instance  # how long a final snapshot waits for another job's dump to finish


@dataclass
class Options:
    name: str
    repo: Path
    command: list[str]
    every_s: float | None = None
    keep_last: int | None = None
    resume: str = "auto"  # auto (after a Slurm requeue), always, never
    requeue: bool = True  # ask Slurm to requeue after the final snapshot
    copy_to: str | None = None  # the shared tier (ops/tiers.py): each snapshot is copied there; resumes look there too
    copy_keep_last: int | None = None
    extra_env: dict = field(default_factory=dict)


def parse_interval(text: str) -> float:
    """'90s', '10m', '2h' or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    t = text.strip().lower()
    try:
        if t and t[-1] in units:
            v = float(t[:-1]) * units[t[-1]]
        else:
            v = float(t)
    except ValueError:
        v = -1
    if not v > 0:
        raise UsageError(f"bad interval {text!r}", hint="use e.g. 90s, 10m or 2h")
    return v


class Supervisor:
    def __init__(self, opts: Options, gpusnap_argv: list[str] | None = None):
        self.o = opts
        self.gpusnap = gpusnap_argv or [sys.executable, "-m", "gpusnap"]
        # the job's output files and this log must outlive the node: with a shared tier (a path)
        # they live in its jobs/NAME/, where a requeued job on any node finds them (a restore
        # refuses a snapshot whose output files are gone)
        self.home = Path(opts.copy_to) if opts.copy_to and "://" not in opts.copy_to else Path(opts.repo)
        self.job_dir = run_op.jobs_dir(self.home) / opts.name
        self.pid: int | None = None           # the job's root (its namespace's init)
        self.runtime_base = 0.0                # job time before this segment (from the snapshot)
        self.segment_start = time.monotonic()
        self.signal_seen: int | None = None
        self.slurm_job = os.environ.get("SLURM_JOB_ID")
        self.restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)

    # --- output -----------------------------------------------------------------------------
    def event(self, kind: str, message: str, **fields) -> None:
        rec = {"time": round(time.time(), 3), "event": kind, "name": self.o.name,
               "slurm_job": self.slurm_job, "restart": self.restarts, **fields}
        try:
            dfd = run_op.open_job_dir(self.home, self.o.name)     # private whatever the umask, no link
            try:
                fd = fsutil.open_private_at(dfd, EVENTS, os.O_WRONLY | os.O_APPEND, self.job_dir / EVENTS)
            finally:
                os.close(dfd)
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except (OSError, RepositoryError) as e:
            print(f"gpusnap slurm-run: cannot write {self.job_dir / EVENTS}: {e}", file=sys.stderr, flush=True)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        print(f"[{stamp}] gpusnap slurm-run: {message}", file=sys.stderr, flush=True)

    def comment(self, text: str) -> None:
        if not self.slurm_job:
            return
        try:
            subprocess.run(["scontrol", "update", f"JobId={self.slurm_job}", f"Comment={text[:250]}"],
                           capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            pass

    def runtime(self) -> float:
        return self.runtime_base + (time.monotonic() - self.segment_start)

    # --- gpusnap subcommands ------------------------------------------------------------------
    def _gpusnap(self, *args: str, timeout: float | None = None, repo: Path | None = None) -> tuple[int, dict]:
        argv = [*self.gpusnap, *args, "--repo", str(repo or self.o.repo), "--json"]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                               env=dict(os.environ, **self.o.extra_env))
        except subprocess.TimeoutExpired:
            return 124, {"message": f"gpusnap {args[0]} did not finish within {timeout:.0f} s"}
        try:
            data = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {}
        except (ValueError, IndexError):
            data = {"message": p.stdout.strip()[-500:]}
        if p.returncode < 0:       # SIGKILL: the OOM killer takes a dump before its job (system/oom.py)
            try:
                sig = signal.Signals(-p.returncode).name
            except ValueError:
                sig = f"signal {-p.returncode}"
            data["message"] = (f"gpusnap {args[0]} was killed by {sig}"
                               + (" (by hand, or by the kernel's OOM killer: see dmesg)"
                                  if p.returncode == -signal.SIGKILL else ""))
        elif p.returncode and "message" not in data:
            data["message"] = (p.stderr.strip() or f"exit {p.returncode}")[-500:]
        return p.returncode, data

    def _past_runtime(self, snapshot_dir: str) -> float:
        """The job time recorded when that snapshot was taken (0 when unknown)."""
        try:
            with open(self.job_dir / EVENTS) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if rec.get("event") in ("snapshot", "final-snapshot") and rec.get("snapshot") == snapshot_dir:
                        return float(rec.get("job_runtime_s", 0))
        except OSError:
            pass
        return 0.0

    def candidates(self) -> list[tuple[Path, str, float]]:
        """Snapshots of this name, newest first: (repository, directory, created), in this
        repository and in --copy-to's when it is a path (the shared tier: a requeued job on
        another node, or on this one after its local repository was lost, finds them there)."""
        from gpusnap.ops import tiers

        roots = [Path(self.o.repo)]
        if self.o.copy_to and "://" not in self.o.copy_to:
            roots.append(Path(self.o.copy_to))
        return tiers.candidates(self.o.name, roots)

    # --- the job ------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Restore the newest snapshot that verifies and restores; False when none does."""
        for root, path, created in self.candidates():
            t0 = time.monotonic()
            rc, v = self._gpusnap("verify", path, repo=root)
            if rc:
                self.event("skip", f"snapshot {path} does not verify ({v.get('message', rc)}); trying an older one",
                           snapshot=path, exit_code=rc)
                continue
            rc, r = self._gpusnap("restore", path, repo=root)
            if rc or "pid" not in r:
                self.event("skip", f"snapshot {path} did not restore ({r.get('message', rc)}); trying an older one",
                           snapshot=path, exit_code=rc)
                continue
            self.pid = int(r["pid"])
            self.runtime_base = self._past_runtime(path)
            self.segment_start = time.monotonic()
            secs = time.monotonic() - t0
            age = time.time() - created
            # a snapshot of a job that had a terminal restores (from here, no terminal) into a
            # new tmux session (ops/restore_terminal.py): the event says how to reach it
            term = r.get("terminal") if isinstance(r.get("terminal"), dict) else None
            self.event("resumed", f"resumed {self.o.name} from snapshot {path} (taken {age:.0f} s ago; "
                                  f"{self.runtime_base:.0f} s of work saved) in {secs:.1f} s, PID {self.pid}"
                                  + (f"; {term.get('line')}" if term else ""),
                       snapshot=path, repository=str(root), pid=self.pid, restore_seconds=round(secs, 3),
                       work_saved_s=round(self.runtime_base, 1), snapshot_age_s=round(age, 1),
                       terminal=term)
            self.comment(f"gpusnap: resumed from {Path(path).name} (restart {self.restarts}, "
                         f"{self.runtime_base:.0f} s of work saved)")
            return True
        return False

    def start_fresh(self, why: str) -> None:
        job = run_op.start(self.o.command, self.home, name=self.o.name)
        self.pid = job.pid
        self.runtime_base = 0.0
        self.segment_start = time.monotonic()
        self.event("started", f"started {self.o.name} from the beginning ({why}), PID {self.pid}", pid=self.pid)
        self.comment(f"gpusnap: started from the beginning ({why})")

    def dump(self, final: bool) -> bool:
        args = ["dump", str(self.pid), "--name", self.o.name]
        if final:
            args.append("--exit")
        if self.o.keep_last:
            args += ["--keep-last", str(self.o.keep_last)]
        if self.o.copy_to:
            args += ["--copy-to", self.o.copy_to]
            if self.o.copy_keep_last:
                args += ["--copy-keep-last", str(self.o.copy_keep_last)]
        t0 = time.monotonic()
        runtime = self.runtime()
        # A shared repository has one writer at a time: another job's dump holds it for a few
        # seconds, so wait for it (exit 10 is RepositoryLocked) rather than lose this snapshot.
        patience = LOCK_PATIENCE_FINAL_S if final else max(5.0, (self.o.every_s or 60) / 2)
        while True:
            rc, r = self._gpusnap(*args)
            if rc != RepositoryLocked.exit_code or time.monotonic() - t0 > patience:
                break
            time.sleep(1)
        secs = time.monotonic() - t0
        kind = "final-snapshot" if final else "snapshot"
        if rc == 0 or r.get("snapshot"):  # committed (a failed retention after it still counts)
            self.event(kind, f"{'final ' if final else ''}snapshot {r.get('snapshot')} in {secs:.1f} s "
                             f"(frozen {r.get('frozen_seconds', 0):.2f} s)",
                       snapshot=r.get("snapshot"), seconds=round(secs, 3),
                       frozen_seconds=r.get("frozen_seconds"), job_runtime_s=round(runtime, 1),
                       bytes_stored=r.get("bytes_stored"), exit_code=rc, copy=r.get("copy"))
            c = r.get("copy") or {}
            if c.get("status") == "pending":
                self.event("copy-pending", f"not copied to {c.get('to')} yet: {c.get('error')}; the next snapshot "
                                           "copies it", snapshot=r.get("snapshot"), error=c.get("error"))
            return True
        self.event(f"{kind}-failed", f"{'final ' if final else ''}snapshot failed (exit {rc}): "
                                     f"{r.get('message', '')}; the job {'keeps running' if not final else 'was left running'}",
                   exit_code=rc, seconds=round(secs, 3))
        return False

    def alive(self) -> bool:
        st = proc.read_stat(self.pid) if self.pid else None
        return st is not None and st.state not in ("Z", "X")

    def _reap(self) -> int | None:
        """Reap every dead child; the job's exit status once its root is gone."""
        status = None
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == self.pid:
                status = os.waitstatus_to_exitcode(st)
        return status

    def _job_exit_code(self, reaped: int | None) -> int:
        if reaped is not None:
            return 128 - reaped if reaped < 0 else reaped
        try:  # the namespace's init records CMD's status (run_op.INIT)
            lines = (self.job_dir / "exit").read_text().split()
            return int(lines[-1]) if lines else 1
        except (OSError, ValueError):
            return 1

    def _on_signal(self, signum, frame) -> None:
        self.signal_seen = signum

    def run(self) -> int:
        from gpusnap.repo import locate

        run_op.require_root("slurm-run")
        if self.o.copy_to and not os.path.lexists(self.o.repo):
            # node-local storage (a fresh node's tmpfs or scratch disk) starts empty: the shared
            # tier holds what matters, so the local repository is made here
            from gpusnap.repo.repository import Repository

            Repository.init(Path(self.o.repo))
        locate.open_repository(self.o.repo, create_at_default=True)   # a typo fails now, not at each dump
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise UsageError("cannot become a child subreaper (prctl failed)")
        for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, self._on_signal)
        resume = self.o.resume == "always" or (self.o.resume == "auto" and self.restarts > 0)
        if not resume:
            self.start_fresh("first start" if self.o.resume == "auto" else "--resume never")
        elif not self.resume():
            self.start_fresh("no snapshot of this name restores")
        next_dump = time.monotonic() + self.o.every_s if self.o.every_s else None
        while True:
            reaped = self._reap()
            if reaped is not None or not self.alive():
                code = self._job_exit_code(reaped)
                self.event("finished", f"job {self.o.name} finished with exit status {code} "
                                       f"after {self.runtime():.0f} s of work", exit_code=code,
                           job_runtime_s=round(self.runtime(), 1))
                self.comment(f"gpusnap: finished (exit {code})")
                return code
            if self.signal_seen is not None:
                sig = signal.Signals(self.signal_seen).name
                self.event("preempted", f"{sig}: taking the final snapshot", signal=sig)
                ok = self.dump(final=True)
                if self.slurm_job and self.o.requeue:
                    p = subprocess.run(["scontrol", "requeue", self.slurm_job], capture_output=True, text=True,
                                       timeout=60, check=False)
                    self.event("requeue", f"asked Slurm to requeue job {self.slurm_job}: "
                                          f"{'ok' if p.returncode == 0 else p.stderr.strip()}",
                               exit_code=p.returncode, snapshot_ok=ok)
                    if p.returncode == 0:
                        # Let Slurm end this instance itself: a batch that exits on its own right
                        # after requeueing races slurmd's kill, and the relaunch on the same node
                        # can fail ("Job N already killed, do not launch batch job").
                        self.signal_seen = None
                        end = time.monotonic() + REQUEUE_WAIT_S
                        while time.monotonic() < end and self.signal_seen is None:  # Slurm's TERM
                            time.sleep(0.5)
                            self._reap()
                if not ok:
                    return 75  # EX_TEMPFAIL: the job will resume from its last periodic snapshot
                return 0
            if next_dump is not None and time.monotonic() >= next_dump:
                self.dump(final=False)
                next_dump = time.monotonic() + self.o.every_s
            time.sleep(0.2)
