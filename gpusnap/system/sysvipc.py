"""SysV IPC (shared memory, semaphores, message queues) a process tree uses, and whether CRIU
can take it.

CRIU saves SysV objects only together with the IPC namespace they live in, and it dumps an
IPC namespace only when the tree's root has one of its own (as a `gpusnap run` job does:
`unshare --ipc`); it then recreates it, objects and contents, at restore, with no option
needed. In the host's IPC namespace:

- an attached shared-memory segment (a "/SYSV<key>" line in /proc/PID/maps) makes CRIU's dump
  fail ("... doesn't live in IPC ns"): refused here, before the job is touched;
- a segment the tree made (cpid) or last attached (lpid) but has no longer mapped, and a
  message queue it last sent to or read from (lspid/lrpid in /proc/sysvipc/msg), are not in
  the snapshot: the dump works, and the restored job finds them as they are then (if they still
  exist); said as a warning.

What cannot be decided from /proc: which semaphore sets the tree uses (/proc/sysvipc/sem has
no PIDs, and a process's SEM_UNDO adjustments are not shown anywhere), and message queues the
tree opened but has not used yet. Those dump and restore as plain CRIU does (not saved, found
again in the host namespace), unreported. A tree whose processes sit in different IPC
namespaces below the root's is left to CRIU.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

PROC = Path("/proc")
HINT = ("start the job with `gpusnap run -- CMD`: it gets an IPC namespace of its own, which CRIU "
        "dumps and restores with its SysV objects")
_SYSV_MAP = re.compile(r"\s/SYSV([0-9a-fA-F]{8})(?: \(deleted\))?$")


def ipc_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(PROC / str(pid) / "ns" / "ipc")
    except OSError:
        return None


def table(kind: str) -> list[dict[str, str]]:
    """Rows of /proc/sysvipc/<kind> (shm, sem, msg) as seen from this IPC namespace."""
    try:
        lines = (PROC / "sysvipc" / kind).read_text().splitlines()
    except OSError:
        return []
    if not lines:
        return []
    head = lines[0].split()
    return [dict(zip(head, ln.split())) for ln in lines[1:] if ln.strip()]


def shm_attached(pids: list[int]) -> list[tuple[int, int, str]]:
    """(pid, shmid, key) for each SysV shared-memory mapping of the processes (the maps line's
    inode column is the segment's id)."""
    out = []
    for pid in pids:
        try:
            maps = (PROC / str(pid) / "maps").read_text(errors="replace")
        except OSError:
            continue
        seen = set()
        for line in maps.splitlines():
            m = _SYSV_MAP.search(line)
            f = line.split()
            if m and len(f) >= 5 and f[4].isdigit() and int(f[4]) not in seen:
                seen.add(int(f[4]))
                out.append((pid, int(f[4]), "0x" + m.group(1).lower()))
    return out


def check(pids: list[int]) -> list[tuple[str, str, str | None]]:
    """(status, detail, fix) findings for the tree (root first); empty when it uses no SysV IPC
    that can be seen, or has an IPC namespace of its own."""
    if not pids:
        return []
    mine, root = ipc_ns(os.getpid()), ipc_ns(pids[0])
    if root is None or root != mine:
        return []       # the root's own namespace: CRIU dumps it whole (or the root is gone)
    tree = set(pids)
    out: list[tuple[str, str, str | None]] = []
    attached = [a for a in shm_attached(pids) if ipc_ns(a[0]) == mine]
    if attached:
        items = ", ".join(f"pid {p}: segment {i} (key {k})" for p, i, k in attached[:5])
        out.append(("fail", f"has {len(attached)} SysV shared-memory segment(s) attached in the host's IPC "
                    f"namespace ({items}); CRIU saves SysV objects only with an IPC namespace of the job's own, "
                    "so it cannot dump this one; the job was not touched", HINT))
    ids = {a[1] for a in attached}
    loose = [r for r in table("shm") if _pid_in(r, ("cpid", "lpid"), tree) and _int(r.get("shmid")) not in ids]
    queues = [r for r in table("msg") if _pid_in(r, ("lspid", "lrpid"), tree)]
    said = [f"shared-memory segment {r['shmid']}" for r in loose[:5]] + \
           [f"message queue {r['msqid']} ({r.get('qnum', '?')} message(s) queued)" for r in queues[:5]]
    if said:
        out.append(("warn", "uses SysV IPC in the host's IPC namespace (" + ", ".join(said) + "): not in the "
                    "snapshot; a restore finds these objects as they are then, if they still exist", HINT))
    return out


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _pid_in(row: dict[str, str], cols: tuple[str, ...], tree: set[int]) -> bool:
    return any(_int(row.get(c)) in tree for c in cols)
