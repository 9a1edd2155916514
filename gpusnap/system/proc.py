"""Facts about live processes read from /proc: trees, sessions, terminals, memory, liveness."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
PF_KTHREAD = 0x00200000     # stat flags: a kernel thread


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    tty_nr: int
    flags: int = 0          # PF_* (PF_KTHREAD)
    starttime: int = 0      # clock ticks after boot: with the PID, names one process for good


def read_stat(pid: int) -> ProcStat | None:
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces and parentheses: split at the last ')'.
    lpar, rpar = raw.index("("), raw.rindex(")")
    rest = raw[rpar + 2:].split()
    return ProcStat(pid=int(raw[:lpar]), comm=raw[lpar + 1:rpar], state=rest[0], ppid=int(rest[1]),
                    pgrp=int(rest[2]), session=int(rest[3]), tty_nr=int(rest[4]),
                    flags=int(rest[6]) if len(rest) > 6 else 0,
                    starttime=int(rest[19]) if len(rest) > 19 else 0)


def alive_since(pid: int, start: int) -> bool:
    """Whether the process that started at `start` (clock ticks after boot) as `pid` still
    runs: not gone, not a zombie, its PID not taken by another process since."""
    st = read_stat(pid)
    return st is not None and st.state not in ("Z", "X") and st.starttime == start


def boot_id() -> str:
    """This boot's id (/proc/sys/kernel/random/boot_id): with a PID and its start time, names
    one process of one machine for good."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def exists(pid: int) -> bool:
    """True if `pid` names a process that is not a zombie."""
    st = read_stat(pid)
    return st is not None and st.state not in ("Z", "X")


def ancestors(pid: int) -> list[int]:
    out = []
    st = read_stat(pid)
    while st is not None and st.ppid > 0:
        out.append(st.ppid)
        st = read_stat(st.ppid)
    return out


def children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = os.listdir(PROC / str(pid) / "task")
    except (FileNotFoundError, ProcessLookupError):
        return kids
    for tid in tasks:
        try:
            kids += [int(x) for x in (PROC / str(pid) / "task" / tid / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return kids


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants, parents before children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p in out:
            continue
        out.append(p)
        todo.extend(children(p))
    return out


def fd_targets(pid: int) -> dict[int, str]:
    """fd -> what /proc/PID/fd/N links to (a path, socket:[N], pipe:[N], ...)."""
    d = PROC / str(pid) / "fd"
    out: dict[int, str] = {}
    try:
        names = os.listdir(d)
    except OSError:
        return out
    for n in names:
        try:
            out[int(n)] = os.readlink(d / n)
        except (OSError, ValueError):
            continue
    return out


def threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(PROC / str(pid) / "task"))
    except (FileNotFoundError, ProcessLookupError):
        return []


def status(pid: int | str) -> dict[str, str]:
    """/proc/PID/status as {field: value} ("self" for this process); {} when it is gone."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def status_kib(fields: dict[str, str], key: str) -> int:
    """A "NNN kB" field of status() in bytes (0 when absent)."""
    try:
        return int(fields[key].split()[0]) << 10
    except (KeyError, IndexError, ValueError):
        return 0


def rss_bytes(pids: list[int]) -> int:
    return sum(status_kib(status(pid), "VmRSS") for pid in pids)


def anon_bytes(pids: list[int]) -> int:
    """RssAnon + RssShmem of the tree: about what CRIU will stream (file-backed pages that were
    never written are not dumped; a job that maps gigabytes of model files must not size the
    staging arena by them)."""
    total = 0
    for pid in pids:
        st = status(pid)
        total += status_kib(st, "RssAnon") + status_kib(st, "RssShmem")
    return total


def usable_cores() -> int:
    """The cores this process may run on (its affinity: `taskset`, cgroup cpusets), not the
    machine's: threads beyond them only take turns."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def peak_rss_self() -> int | None:
    """This process's VmHWM (peak resident set) in bytes."""
    return status_kib(status("self"), "VmHWM") or None


def tracer(pid: int) -> int:
    """TracerPid: the process ptrace-attached to `pid` (CRIU while it dumps), 0 when none."""
    try:
        return int(status(pid).get("TracerPid", "0"))
    except ValueError:
        return 0


def needs_shell_job(pids: list[int]) -> bool:
    """CRIU needs --shell-job when the tree's session or process group leader lives outside
    the tree (a job started from a shell, with nohup, or by another program) or when it has a
    controlling terminal."""
    members = set(pids)
    for pid in pids:
        st = read_stat(pid)
        if st is None:
            continue
        if st.tty_nr != 0 or st.session not in members or st.pgrp not in members:
            return True
    return False


def session_outside_namespace(pid: int) -> bool:
    """True when the session leader of `pid` is not visible in the PID namespace `pid` lives
    in (its session id there is 0). CRIU refuses such a task: it could not recreate the
    session on restore. This happens to processes whose session was created by a parent
    outside a container, e.g. a job started by a container's init without setsid."""
    fields = status(pid)
    if not fields:
        return False
    if "NSsid" in fields:
        # one id per nested namespace, outermost first; the last is the task's own
        return fields["NSsid"].split()[-1] == "0"
    st = read_stat(pid)  # kernels without NSsid (before 4.1)
    return st is not None and st.session == 0


def cmdline(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def find_matching(pattern: str) -> list[int]:
    """PIDs whose command line matches the regular expression `pattern` (like pgrep -f),
    leaving out gpusnap itself, its ancestors and any process whose parent also matches.
    The pattern is a user's: validate.check_match checks it first (the one place that does)."""
    rx = re.compile(pattern)
    skip = {os.getpid(), *ancestors(os.getpid())}
    hits = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in skip:
            continue
        line = cmdline(pid)
        if line and rx.search(line) and exists(pid):
            hits.append(pid)
    hitset = set(hits)
    # A tree is dumped from its root: drop matches whose parent matches too.
    return sorted(p for p in hits if (read_stat(p) or ProcStat(p, "", "", 0, 0, 0, 0)).ppid not in hitset)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to `timeout` seconds for `pids` to disappear; return those still present."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if read_stat(p) is not None]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)

