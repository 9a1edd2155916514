"""Waiting for a process to wait: a test that holds a lock knows the other gpusnap is
blocked on it (not merely slow) when /proc/locks lists it as a waiter."""

from __future__ import annotations

import time


def blocked_on_flock(pid: int) -> bool:
    """/proc/locks lists a process waiting for a lock with '->'."""
    for line in open("/proc/locks"):
        f = line.split()
        if "->" in f and f[f.index("->") + 1] == "FLOCK" and int(f[f.index("->") + 4]) == pid:
            return True
    return False


def wait_until_blocked(p, what: str, limit: float = 120) -> None:
    """Until process `p` (a Popen) waits for a flock; it must not end meanwhile. The limit is
    a safety net for a hang, not a measure."""
    deadline = time.monotonic() + limit
    while not blocked_on_flock(p.pid):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, f"{what} never waited for the lock"
        time.sleep(0.01)
