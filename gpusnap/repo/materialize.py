"""Image files for a plain `criu restore -D DIR`: a snapshot written out of the repository.

The second restore path (the first is `--stream`, fed by the serve streamer). CRIU restores
from a directory faster than from a stream (its restorer preadv()s pages straight into place
instead of copying them out of premapped memory), and only a directory lets it restore
private huge-page mappings at all (gpusnap/ops/restore_needs.py).

The directory is private (0700, created exclusively, named after this process so that a
later run can remove what a SIGKILLed one left) and on tmpfs (/dev/shm) when the memory
available leaves room for the images and for the restored job besides; else under the
repository's own tmp/. Images are decoded in parallel (gpusnap/repo/parallel_read.py: big pages
images in 4 MiB jobs across all cores, small images one per thread), every page checked against
its checksum on the way, and zero pages are left as holes, so they cost neither memory on tmpfs
nor disk writes. $GPUSNAP_RESTORE_IMAGES=tmpfs|disk overrides the choice of place.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpusnap.errors import GpusnapError, Interrupted, NoSpace
from gpusnap.system import memcg, proc, tmpdirs
from gpusnap.system.access import read_only_reason
from gpusnap import settings

PREFIX = tmpdirs.IMAGES
SHM = Path("/dev/shm")
TMPFS_MAGIC = 0x01021994
PAGE = 4096
# tmpfs only when MemAvailable covers the images, the restored job's own memory (about the
# same size again) and this much besides.
MEM_MARGIN = 256 << 20


@dataclass
class Plan:
    where: str          # "tmpfs" or "disk"
    parent: Path
    need_bytes: int     # non-zero bytes to write (holes are free)
    note: str | None = None     # a line to show: why not where it would go otherwise


def mem_available() -> int | None:
    """The memory a restore may fill /dev/shm with: the machine's, or what the memory cgroup
    leaves where that is less (tmpfs pages are charged to it and cannot be reclaimed)."""
    return memcg.available()[0]


def _is_tmpfs(path: Path) -> bool:
    try:
        import ctypes
        import ctypes.util

        class StatFs(ctypes.Structure):
            _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_long * 15)]

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buf = StatFs()
        if libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
            return False
        return buf.f_type == TMPFS_MAGIC
    except (OSError, AttributeError):
        return False


def snapshot_bytes(snap) -> int:
    """Bytes the image files take, zero pages excepted."""
    st = snap.manifest.get("stats", {})
    raw = int(st.get("bytes_raw", 0) or 0)
    zero = int(st.get("pages_zero", 0) or 0) * PAGE
    return max(raw - zero, 0)


def fits_tmpfs(need: int, mem_avail: int | None, shm_free: int) -> bool:
    """Room on tmpfs for `need` bytes of images while the restored job (about as big again)
    comes back, with a margin."""
    return mem_avail is not None and mem_avail >= 2 * need + MEM_MARGIN and shm_free >= need + MEM_MARGIN


def plan(snap, repo_path: Path) -> Plan:
    """Where the image files go: $GPUSNAP_RESTORE_IMAGES (tmpfs|disk) when set, else tmpfs
    (/dev/shm) when they fit in memory, else the repository's tmp/ directory."""
    need = snapshot_bytes(snap)
    disk = Plan("disk", Path(repo_path) / "tmp", need)
    force = settings.get("GPUSNAP_RESTORE_IMAGES", "auto")
    shm_ok = SHM.is_dir() and os.access(SHM, os.W_OK) and _is_tmpfs(SHM)
    if read_only_reason(repo_path):
        # a read-only repository (a backup copy, a read-only mount): its tmp/ takes nothing
        where = SHM if shm_ok else Path(tempfile.gettempdir())
        return Plan("tmpfs" if shm_ok else "disk", where, need,
                    note=f"gpusnap: repository {repo_path} is read-only: image files go to {where} instead")
    if force == "disk":
        return disk
    if force == "tmpfs" and shm_ok:
        return Plan("tmpfs", SHM, need)
    try:
        free = shutil.disk_usage(SHM).free if shm_ok else 0
    except OSError:
        free = 0
    if shm_ok and fits_tmpfs(need, mem_available(), free):
        return Plan("tmpfs", SHM, need)
    return disk


def remove_stale(parent: Path) -> None:
    """Remove image directories left by gpusnap processes that no longer exist (SIGKILL)."""
    tmpdirs.remove_dead(parent, PREFIX)


def remove_leftovers(repo_path: Path) -> None:
    """Image directories of SIGKILLed restores, in both places they can be: every restore
    calls this, whichever path it takes, so a tmpfs full of a dead run's images (memory)
    does not wait for the next restore that happens to write images there."""
    for parent in (SHM, Path(repo_path) / "tmp"):
        remove_stale(parent)


class _Term(BaseException):
    pass


def _on_term(signum, frame):  # noqa: ARG001
    raise _Term()


@contextmanager
def images_dir(snap, repo_path: Path):
    """A private directory holding the snapshot's image files; removed on every exit path
    (SIGTERM and SIGHUP included; after a SIGKILL, by the next run). Yields (dir, Plan)."""
    p = plan(snap, repo_path)
    if p.note:
        import logging

        logging.getLogger("gpusnap").warning(p.note)
    if p.where == "disk":
        p.parent.mkdir(mode=0o700, exist_ok=True)
    remove_leftovers(repo_path)
    d = tmpdirs.make(PREFIX, p.parent)   # 0700, exclusive, named after this process
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, _on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield d, p
    except _Term:
        raise Interrupted("restore interrupted; nothing was restored") from None
    finally:
        shutil.rmtree(d, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


def write_images(snap, d: Path, threads: int | None = None, progress=None, total: int = 0, sparse=None,
                 holes=None) -> int:
    """Write every image of the snapshot into d; returns the bytes written (holes excluded).
    Any failure (a bad page, a full disk) stops the others and is raised. sparse: zero-page
    runs to leave out (criu/sparse.py); holes: byte ranges of pages images not to write (the
    lazy restore's, criu/lazypages.py)."""
    import errno

    from gpusnap.repo import parallel_read

    threads = threads or max(2, min(8, proc.usable_cores()))
    stop = threading.Event()
    done = [0]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpusnap-materialize") as ex:
        try:
            futs = [ex.submit(parallel_read.write_images, snap, d, threads, stop, done, sparse, holes)]
            if progress:
                while wait(futs, timeout=0.1).not_done:
                    progress(min(done[0], total), total)
            first: BaseException | None = None
            written = 0
            for f in futs:
                try:
                    written += f.result()
                except BaseException as e:  # noqa: BLE001 - the first failure wins, the rest stop
                    stop.set()
                    if first is None:
                        first = e
            if first is not None:
                if isinstance(first, OSError) and first.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NoSpace(f"no room to write the snapshot's images into {d.parent}",
                                  hint="free some space (or memory, for /dev/shm), or restore with --via stream")
                if isinstance(first, GpusnapError):
                    raise first
                raise first
        except BaseException:
            # a SIGTERM (_Term) or a progress failure in the wait above: stop the writer
            # before the executor's shutdown waits for it, or every image is written first
            stop.set()
            raise
    return written
