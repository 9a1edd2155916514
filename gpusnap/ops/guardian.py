"""The guardian of a `dump --exit`: the job ends running unless the snapshot was committed.

With --exit, CRIU leaves the dumped tree stopped (and its CUDA processes checkpointed) for
gpusnap to kill once the snapshot is committed. If gpusnap dies in between (SIGKILL, the
OOM killer), nothing would ever resume it. So before CRIU starts, gpusnap starts this
small process (double-forked, in a session of its own, so no signal meant for gpusnap's
terminal or process group reaches it) and keeps the write end of a pipe to it:

  "P<pid>\\n"  CRIU's PID
  "C"         the snapshot is committed: the tree is to be killed, as --exit wants
  "D"         gpusnap has settled everything itself: nothing to do

End of file without "C" or "D" means gpusnap died: the guardian waits until CRIU is gone
(or no process of the tree is traced any more), then SIGCONTs the tree and brings its CUDA
processes back to RUNNING (restore and unlock), after lifting CRIU's network lock on the
tree's TCP connections (gpusnap/criu/netlock_rules.py), which a stopped dump leaves in place
for a restore and which would blackhole a job that runs on. Processes are recognised by their start
time, so a recycled PID is never signalled.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpusnap.system import oom, proc


# how long to wait for CRIU to let the tree go: its own bounded driver calls, then a margin
WAIT_CRIU_S = 900.0


def _start_time(pid: int) -> int | None:
    st = proc.read_stat(pid)
    return st.starttime if st is not None else None


class Guardian:
    """gpusnap's end: start() before CRIU, tell it CRIU's pid, then committed() or done()."""

    def __init__(self, pids: list[int], report: Path, cuda: list[int], log: Path | None = None,
                 tcp: list[dict] | None = None, criu_log: Path | None = None):
        r, self._w = os.pipe()
        os.set_inheritable(r, True)
        args = [sys.executable, "-m", "gpusnap.ops.guardian", "--fd", str(r), "--report", str(report),
                "--pids", ",".join(f"{p}:{_start_time(p) or 0}" for p in pids),
                "--cuda", ",".join(map(str, cuda)) or "-"]
        if log:
            args += ["--log", str(log)]
        if tcp:
            args += ["--tcp", ",".join(f"{c['local']}>{c['remote']}" for c in tcp)]
        if criu_log:
            args += ["--criu-log", str(criu_log)]
        if oom.inherited() is not None:     # the dump made itself expendable; not the guardian
            args += ["--oom-score-adj", str(oom.inherited())]
        try:
            mid = subprocess.Popen(args, pass_fds=(r,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
            mid.wait()  # the middle process exits at once; the guardian is init's child
        finally:
            os.close(r)

    def _send(self, msg: bytes) -> None:
        if self._w is not None:
            try:
                os.write(self._w, msg)
            except OSError:
                pass

    def criu(self, pid: int) -> None:
        self._send(f"P{pid}\n".encode())

    def committed(self) -> None:
        self._send(b"C")

    def done(self) -> None:
        self._send(b"D")
        self.close()

    def close(self) -> None:
        if self._w is not None:
            os.close(self._w)
            self._w = None


# ---------------------------------------------------------------- the guardian process

def _alive_same(pid: int, start: int) -> bool:
    st = _start_time(pid)
    return st is not None and (start == 0 or st == start)


def _wait_gone(pid: int, limit: float) -> None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        select.select([fd], [], [], limit)
    finally:
        os.close(fd)


def _traced(pids: dict[int, int]) -> bool:
    return any(_alive_same(pid, start) and proc.tracer(pid) for pid, start in pids.items())


def _log(path: str | None, msg: str) -> None:
    if path:
        try:
            Path(path).parent.mkdir(mode=0o700, exist_ok=True)
            # root writes into the repository: never through a symlink someone planted there
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} guardian {os.getpid()}: {msg}\n".encode())
            finally:
                os.close(fd)
        except OSError:
            pass


def _run(a) -> int:
    pids: dict[int, int] = {}
    for item in a.pids.split(","):
        if item:
            p, _, s = item.partition(":")
            pids[int(p)] = int(s or 0)
    cuda = [int(x) for x in a.cuda.split(",") if x.isdigit()]
    buf = b""
    while True:
        try:
            chunk = os.read(a.fd, 256)
        except InterruptedError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            break
        buf += chunk
    os.close(a.fd)
    if b"D" in buf:
        return 0
    criu = next((int(x[1:]) for x in buf.decode(errors="replace").split("\n") if x[:1] == "P"
                 and x[1:].isdigit()), None)
    if criu is not None:
        _wait_gone(criu, WAIT_CRIU_S)
    deadline = time.monotonic() + WAIT_CRIU_S
    while _traced(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    if b"C" in buf:
        for pid, start in pids.items():
            if _alive_same(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _log(a.log, "snapshot committed; job killed as --exit asked")
        return 0
    unfreed: list[str] = []
    conns = [dict(zip(("local", "remote"), x.split(">", 1))) for x in (a.tcp or "").split(",") if ">" in x]
    if conns and any(_alive_same(pid, start) for pid, start in pids.items()):
        from gpusnap.criu import netlock_rules

        unfreed = netlock_rules.lift(conns)
        netlock_rules.lift_table(netlock_rules.run_id(a.criu_log) if a.criu_log else None)
        netlock_rules.repair_off([p for p, s in pids.items() if _alive_same(p, s)])
    resumed = []
    for pid, start in pids.items():
        if _alive_same(pid, start):
            try:
                os.kill(pid, signal.SIGCONT)
                resumed.append(pid)
            except ProcessLookupError:
                pass
    problems = []
    if resumed:
        from gpusnap.gpu import report

        problems = report.settle_after_failed_dump(report.read(a.report), [p for p in cuda if p in resumed])
    _log(a.log, f"gpusnap ended before the commit; job resumed (PIDs {resumed})"
         + (f"; network lock lifted from {len(conns)} connection(s)" if conns and not unfreed else "")
         + (f"; network lock NOT lifted from {', '.join(unfreed)}" if unfreed else "")
         + (f"; GPU problems: {'; '.join(problems)}" if problems else ""))
    try:
        os.unlink(a.report)
    except OSError:
        pass
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpusnap.ops.guardian")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--pids", required=True)
    ap.add_argument("--cuda", default="-")
    ap.add_argument("--report", default="")
    ap.add_argument("--log")
    ap.add_argument("--tcp", default="")       # LOCAL>REMOTE,...: the tree's TCP connections
    ap.add_argument("--criu-log")
    ap.add_argument("--oom-score-adj", type=int)    # the value gpusnap had before its dump raised it
    a = ap.parse_args(argv)
    if os.fork() > 0:  # the middle process: gpusnap reaps it at once
        os._exit(0)
    if a.oom_score_adj is not None:
        oom.write(a.oom_score_adj)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.chdir("/")
    try:
        return _run(a)
    except Exception as e:  # noqa: BLE001 - nobody is left to tell but the log
        _log(a.log, f"failed: {type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
