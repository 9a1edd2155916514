"""Scheduled runs under way, and runs that ended without a word.

A run logs its one JSON line when it ends (runlog.py). A run killed by SIGKILL never does: the
kernel's OOM killer takes a dump before its job (system/oom.py), and `kill -9` is SIGKILL too.
Without more, `schedule ls` and `doctor` would go on showing the run before it as the last
result: a schedule failing in silence. So each run leaves a marker beside its log while it
runs, `schedule-NAME.run-PID-STARTTIME` (PID and start time name one process for good), and
removes it however it ends but SIGKILL. A marker whose process is gone is a killed run (or
one a reboot cut):
`schedule ls` and `doctor` say so at once, and the schedule's next run writes its line into the
log ("outcome": "killed") before its own.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from gpusnap.ops.schedule.record import Schedule, private_dir
from gpusnap.system import proc

KILLED = "killed"


@dataclass
class Marker:
    path: Path
    pid: int
    start: int
    time: str           # when the run started (the log's "time")

    @property
    def alive(self) -> bool:
        return proc.alive_since(self.pid, self.start)

    def record(self, s: Schedule) -> dict:
        """The log line of a run this marker outlived."""
        return {"time": self.time, "schedule": s.name, "pid": None, "outcome": KILLED, "exit_code": None,
                "message": f"the run that started at {self.time} (gpusnap PID {self.pid}) ended without a word: "
                           "killed by SIGKILL (by hand, or by the kernel's OOM killer, which takes a dump before "
                           "its job when memory runs out: see `dmesg`) or cut by a reboot"}


def _prefix(s: Schedule) -> str:
    return Path(s.log).stem + ".run-"


def markers(s: Schedule) -> list[Marker]:
    """The markers beside the schedule's log, oldest run first."""
    d, prefix, out = Path(s.log).parent, _prefix(s), []
    try:
        names = [n for n in os.listdir(d) if n.startswith(prefix)]
    except OSError:
        return []
    for n in names:
        try:
            pid, start = (int(x) for x in n[len(prefix):].split("-"))
            fd = os.open(d / n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                info = json.loads(os.read(fd, 4096) or b"{}")
            finally:
                os.close(fd)
            when = info["time"] if isinstance(info, dict) and isinstance(info.get("time"), str) else ""
        except (OSError, ValueError, KeyError):
            continue        # not ours, or removed meanwhile
        out.append(Marker(d / n, pid, start, when))
    return sorted(out, key=lambda m: (m.time, m.start))


@contextlib.contextmanager
def running(s: Schedule, started: str):
    """While inside, this run's marker exists; removed on the way out (any end but SIGKILL)."""
    me = proc.read_stat(os.getpid())
    path = Path(s.log).parent / f"{_prefix(s)}{os.getpid()}-{me.starttime if me else 0}"
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps({"time": started}).encode())
    finally:
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def settle(s: Schedule, append) -> list[dict]:
    """At a run's start: every run killed since is written into the log (`append(s, record)`),
    its marker removed first, so two runs starting together write it once."""
    done = []
    for m in markers(s):
        if m.alive:
            continue
        try:
            m.path.unlink()
        except FileNotFoundError:
            continue        # another run took it
        rec = m.record(s)
        append(s, rec)
        done.append(rec)
    return done
