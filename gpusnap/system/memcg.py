"""How much memory this process may still take: the machine's MemAvailable, and the room its
memory cgroup leaves (room()). A dump run inside a Slurm job's cgroup, a systemd unit with
MemoryMax= or a container sizes its staging by the tighter of the two: sized by the machine
alone, it would fault in more than the cgroup allows and the cgroup's OOM killer would take it.

Both cgroup versions: v2 (memory.max and memory.high, memory.current) and the v1 memory
controller (memory.limit_in_bytes, memory.usage_in_bytes), every level from the process's own
cgroup up to the mount's root, since a parent's limit binds its children too. The inactive
file cache counts as room, as the kernel reclaims it first (MemAvailable counts it too)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 60     # v1 writes "no limit" as the largest page-aligned counter (~2^63)


@dataclass(frozen=True)
class Room:
    bytes: int      # what the tightest level still leaves
    cgroup: str     # that level, as /proc/PID/cgroup names it
    limit: int      # its limit


def meminfo_available() -> int | None:
    """The machine's MemAvailable in bytes (None where /proc/meminfo does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read(p: Path) -> str | None:
    try:
        return p.read_text()
    except OSError:
        return None


def _stat(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key and v.strip().isdigit():
            return int(v)
    return 0


def _mounts() -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """(root, mount point) of the v1 memory controller's hierarchy and of the v2 one, if mounted."""
    v1 = v2 = None
    for line in (_read(Path("/proc/self/mountinfo")) or "").splitlines():
        left, sep, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if not sep or len(f) < 5 or len(r) < 3:
            continue
        root, point = f[3], f[4].replace("\\040", " ")
        if r[0] == "cgroup" and "memory" in r[2].split(",") and v1 is None:
            v1 = (root, point)
        elif r[0] == "cgroup2" and v2 is None:
            v2 = (root, point)
    return v1, v2


def _own_dir(pid: str) -> tuple[Path, Path, bool] | None:
    """(the process's memory cgroup directory, the mount point it lies under, v2?)."""
    v1, v2 = _mounts()
    for line in (_read(Path(f"/proc/{pid}/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, ctrls, path = parts
        if v1 and "memory" in ctrls.split(","):
            mount, is_v2 = v1, False
        elif v2 and hier == "0" and ctrls == "":
            mount, is_v2 = v2, True
        else:
            continue
        root, point = mount
        rel = path if root == "/" else path.removeprefix(root) if path.startswith(root) else None
        if rel is None or ".." in rel.split("/"):
            continue        # outside what is mounted here (another cgroup namespace)
        if not is_v2 or v1 is None:     # v1's memory controller wins where both are mounted
            return Path(point) / rel.lstrip("/"), Path(point), is_v2
    return None


def _level(d: Path, v2: bool) -> tuple[int, int] | None:
    """(room, limit) at one level, None where it sets no limit."""
    if v2:
        limits = []
        for name in ("memory.max", "memory.high"):
            t = (_read(d / name) or "max").strip()
            if t.isdigit():
                limits.append(int(t))
        usage, stat, inactive = _read(d / "memory.current"), _read(d / "memory.stat"), "inactive_file"
    else:
        t = (_read(d / "memory.limit_in_bytes") or "").strip()
        limits = [int(t)] if t.isdigit() and int(t) < UNLIMITED else []
        usage, stat, inactive = _read(d / "memory.usage_in_bytes"), _read(d / "memory.stat"), "total_inactive_file"
    if not limits or usage is None or not usage.strip().isdigit():
        return None
    limit = min(limits)
    return min(limit, max(0, limit - int(usage)) + _stat(stat, inactive)), limit


def room(pid: int | str = "self") -> Room | None:
    """The room the tightest memory cgroup limit over the process and its ancestors leaves;
    None where no limit applies (or none can be read)."""
    own = _own_dir(str(pid))
    if own is None:
        return None
    d, top, v2 = own
    best: Room | None = None
    while True:
        got = _level(d, v2)
        if got is not None and (best is None or got[0] < best.bytes):
            best = Room(got[0], "/" + str(d.relative_to(top)).removeprefix("."), got[1])
        if d == top or top not in d.parents:
            return best
        d = d.parent


def available(pid: int | str = "self") -> tuple[int | None, str]:
    """The memory the process may still take, and where that figure comes from: the
    machine's MemAvailable, or its memory cgroup's room where that is less."""
    avail, r = meminfo_available(), room(pid)
    if r is not None and (avail is None or r.bytes < avail):
        return r.bytes, f"the {r.bytes >> 20} MiB its memory cgroup {r.cgroup} leaves (limit {r.limit >> 20} MiB)"
    if avail is None:
        return None, "available memory unknown"
    return avail, f"the {avail >> 20} MiB available"
