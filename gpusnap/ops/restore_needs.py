"""What a restore will need to know about a snapshot, recorded at dump time.

Private huge-page mappings (MAP_PRIVATE|MAP_HUGETLB) are the one kind of memory CRIU never
premaps on restore: its restorer reads their pages with preadv() at an offset into the pages
image (criu/mem.c, restore_priv_vma_content -> pagemap_enqueue_iovec; criu/pie/restorer.c,
vma_ios). Under `--stream` that image is a pipe, the preadv fails with ESPIPE ("Can't read
pages data (-29)") and the snapshot cannot be restored; from image files it works. So the dump
records how much hugetlb memory the tree maps (`meta.hugetlb_bytes`, docs/format.md), and
restore chooses the files path for such snapshots. Snapshots without the field (older ones)
are answered from their mm images.

A TCP socket that was connected and then reset (state CLOSE, a peer address kept) is not in
/proc/net/tcp, so the dump's preflight cannot see it; CRIU dumps it all the same, and its
restore then refuses it without --tcp-established ("Connected TCP socket in image"). The
restore reads such sockets from files.img (`reset_tcp`).

A job that ran in a named network namespace (`ip netns`, `meta.netns`) is restored into that
namespace again with CRIU's --join-ns (`join_netns`); when none is bound at its path any more
the restore refuses before anything runs (system/netns.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.criu import images
from gpusnap.errors import CorruptSnapshot, NetnsMissing

MAP_HUGETLB = 0x40000


def hugetlb_bytes(pids: list[int]) -> int:
    """Bytes of hugetlb mappings in the tree now. A process that vanished meanwhile counts as
    none; the dump fails later anyway."""
    return sum(_smaps_hugetlb(pid) for pid in pids if _maybe_hugetlb(pid))


def _maybe_hugetlb(pid: int) -> bool:
    """Whether /proc/PID/maps shows a mapping that may be hugetlb. Every hugetlb mapping is a
    file on a hugetlbfs superblock, which has no block device (major 0): /anon_hugepage,
    /SYSV..., /memfd:..., or a file on a hugetlbfs mount. maps costs nothing per page; smaps
    walks every page table (~12 ms per GiB resident), so it is read only for such a process."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        f = line.split(None, 5)
        if len(f) >= 5 and f[3].startswith("00:") and f[4] != "0":
            return True
    return False


def _smaps_hugetlb(pid: int) -> int:
    """Bytes of PID's mappings whose /proc/PID/smaps VmFlags have 'ht'."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text(errors="replace")
    except OSError:
        return 0
    total = start = end = 0
    for line in text.splitlines():
        c = line[:1]
        if c in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            a, b = line.split(" ", 1)[0].split("-")
            start, end = int(a, 16), int(b, 16)
        elif line.startswith("VmFlags:") and " ht" in f" {line[8:]}":
            total += end - start
    return total


def snapshot_hugetlb_bytes(snap) -> int:
    """Bytes of hugetlb mappings the snapshot restores: the dump's record, or else from its
    mm images (criu/images.py)."""
    v = snap.manifest.get("meta", {}).get("hugetlb_bytes")
    if type(v) is int and v >= 0:
        return v
    total = 0
    for name in snap.image_names():
        if not (name.startswith("mm-") and name.endswith(".img")):
            continue
        try:
            vmas = images.vmas(images.read(snap, name))
        except ValueError:          # unreadable: let CRIU report it
            continue
        total += sum(vma["end"] - vma["start"] for vma in vmas if vma["flags"] & MAP_HUGETLB)
    return total


def hugepage_pool() -> tuple[int, int, int] | None:
    """(total pages, free pages, page size in bytes) of the default huge-page pool
    (/proc/meminfo), None when unknown."""
    vals: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("HugePages_Total", "HugePages_Free", "Hugepagesize"):
                vals[k] = int(v.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if len(vals) != 3 or not vals["Hugepagesize"]:
        return None
    return vals["HugePages_Total"], vals["HugePages_Free"], vals["Hugepagesize"] * 1024



TCP_CLOSE = 7
IPPROTO_TCP = 6


def reset_tcp(snap) -> bool:
    """Whether the snapshot holds a TCP socket that was connected and is closed now (reset):
    CRIU restores it only with --tcp-established."""
    try:
        socks = images.inet_sockets(snap)
    except ValueError:
        return False    # unreadable: CRIU says so in its own words
    return any(s["proto"] == IPPROTO_TCP and s["state"] == TCP_CLOSE and s["dst_port"] for s in socks)


def recorded_netns(snap) -> dict | None:
    """meta.netns when it names a path (a named network namespace), checked: it is data read
    from the snapshot, and it ends up on CRIU's command line. None: CRIU makes a new one."""
    rec = snap.manifest.get("meta", {}).get("netns")
    if not isinstance(rec, dict) or rec.get("path") is None:
        return None     # gpusnap's own namespace, or one with no name
    path = rec["path"]
    if not isinstance(path, str) or not path.startswith("/") or "," in path:
        raise CorruptSnapshot(f"snapshot {snap.path} records a malformed network namespace path {path!r}")
    return rec


def netns_outlook(snap) -> dict | None:
    """What a restore does with the job's named network namespace (restore and inspect alike):
    {"path", "name", "status": "same" | "made again" | "missing", "detail"}; None when the job
    ran in gpusnap's own namespace or an unnamed one."""
    from gpusnap.system import netns

    rec = recorded_netns(snap)
    if rec is None:
        return None
    path = rec["path"]
    name = os.path.basename(path)
    now = netns.mounted_at(path)
    if now is None:
        status, detail = "missing", (f"no network namespace is bound at {path} now: restore refuses "
                                     f"(`ip netns add {name}`)")
    elif now == rec.get("inode"):
        status, detail = "same", f"the job joins {name} again, the namespace it ran in"
    else:
        # `ip netns delete` and `add` since the dump: a namespace of that name, not the one the
        # job knew; its interfaces, addresses and routes are whatever the new one holds
        status, detail = "made again", (f"{name} was made again since the dump (another network namespace is bound "
                                        f"at {path}): the job joins the new one, with the interfaces and "
                                        "addresses it holds now")
    return {"path": path, "name": name, "status": status, "detail": detail}


def join_netns(snap) -> tuple[list[str], str | None]:
    """CRIU's --join-ns for a job dumped in a named network namespace ([] for any other) and a
    note when the namespace there is not the one the job ran in; raises NetnsMissing when no
    network namespace is bound at the recorded path now."""
    out = netns_outlook(snap)
    if out is None:
        return [], None
    path, name = out["path"], out["name"]
    if out["status"] == "missing":
        raise NetnsMissing(f"the job ran in the network namespace {name} ({path}), which the restore joins "
                           f"again, and no network namespace is bound at {path} now; nothing was restored",
                           hint=f"make it again (`ip netns add {name}`, with the interfaces and addresses the "
                                "job needs; `ip netns list` shows those that exist), then restore again")
    return ["--join-ns", f"net:{path}"], out["detail"] if out["status"] == "made again" else None
