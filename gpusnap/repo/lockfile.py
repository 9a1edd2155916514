"""Lock files under REPO/locks/ (docs/format.md §6): the repository's locks on any filesystem.

flock(2) only holds where the filesystem's locks reach every machine that mounts it (not NFS
with `nolock`, not every FUSE or cluster filesystem), so every gpusnap that uses a repository
also leaves a file saying so: `locks/lock-<32 hex>`, JSON naming its host, PID, the process's
start time, the boot it belongs to, whether it is exclusive, and when it was made and last
refreshed. A holder refreshes its file every REFRESH seconds (a thread); a file is stale, and
whoever finds it removes it, when its process is gone (same host and boot: the PID is dead or
names another process) or, from another machine, when it has not been refreshed for STALE
seconds. The protocol is restic's: create your own file first, then look at the others, and
back off (remove yours, wait, try again) if one conflicts, so of two that race at least one
sees the other.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpusnap import settings
from gpusnap.repo import fsutil
from gpusnap.system import proc

PREFIX = "lock-"
DEFAULT_STALE = 300.0      # a lock not refreshed for this long (another machine's) is stale
STALE_ENV = "GPUSNAP_LOCK_STALE"
READ = "read"              # `what` of a reader's (restore, verify, export, copy) lock file
MAX_SIZE = 4096


def stale_after() -> float:
    """$GPUSNAP_LOCK_STALE seconds (tests shorten it), else DEFAULT_STALE."""
    raw = (settings.get(STALE_ENV) or "").strip()
    try:
        v = float(raw) if raw else DEFAULT_STALE
    except ValueError:
        v = DEFAULT_STALE
    return v if v > 0 else DEFAULT_STALE


def refresh_every() -> float:
    """How often a holder rewrites its file: a fifth of the staleness timeout, so four
    refreshes may be missed (a loaded machine, a slow server) before anyone takes it over."""
    return stale_after() / 5


@dataclass
class LockInfo:
    name: str
    exclusive: bool
    what: str
    host: str
    pid: int
    start: int
    boot: str
    created: float
    refreshed: float

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        return f"pid {self.pid} on {self.host} ({self.what}, since {since})"

    def stale(self, now: float | None = None) -> bool:
        """Whether nobody holds this lock any more (see the module docstring)."""
        if self.host == socket.gethostname() and self.boot and self.boot == proc.boot_id():
            return not proc.alive_since(self.pid, self.start)
        if self.host == socket.gethostname() and self.boot and proc.boot_id() and self.boot != proc.boot_id():
            return True             # made before this machine last booted
        now = time.time() if now is None else now
        return now - self.refreshed > stale_after()


def _mine_body(exclusive: bool, what: str, created: float) -> bytes:
    st = proc.read_stat(os.getpid())
    now = time.time()
    return json.dumps({"format": "gpusnap-lock", "version": 1, "exclusive": exclusive, "what": what,
                       "host": socket.gethostname(), "pid": os.getpid(),
                       "start": st.starttime if st else 0, "boot": proc.boot_id(),
                       "created": created, "refreshed": now}, sort_keys=True).encode()


def parse(name: str, data: bytes) -> LockInfo:
    """A lock file's content. Raises ValueError."""
    d = json.loads(data.decode())
    if not isinstance(d, dict) or d.get("format") != "gpusnap-lock":
        raise ValueError("not a gpusnap lock file")
    return LockInfo(name, bool(d["exclusive"]), str(d.get("what", "?")), str(d["host"]), int(d["pid"]),
                    int(d.get("start", 0)), str(d.get("boot", "")), float(d["created"]), float(d["refreshed"]))


def create(locks: Path, exclusive: bool, what: str) -> str:
    """Write a new lock file of this process (temp name, fsync, rename: never seen half
    written) -> its name."""
    name = f"{PREFIX}{os.urandom(16).hex()}"
    fsutil.write_atomic(locks / name, _mine_body(exclusive, what, time.time()))
    return name


def remove(locks: Path, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        dfd = fsutil.open_dir(locks)
        try:
            os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)


def read(locks: Path, name: str) -> LockInfo | None:
    """The lock file `name`, or None when it is gone. One that cannot be parsed counts as
    held (a newer gpusnap's, or damaged) until its mtime is STALE seconds old."""
    try:
        fd = _open_ro(locks, name)
    except FileNotFoundError:
        return None
    try:
        data = os.read(fd, MAX_SIZE)
        mtime = os.fstat(fd).st_mtime
    finally:
        os.close(fd)
    try:
        return parse(name, data)
    except (ValueError, KeyError, TypeError):
        return LockInfo(name, True, "unreadable lock file", "?", 0, 0, "", mtime, mtime)


def _open_ro(locks: Path, name: str) -> int:
    dfd = fsutil.open_dir(locks)
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)


def others(locks: Path, mine: set[str]) -> list[LockInfo]:
    """Every live lock file but `mine`; stale ones are removed on the way."""
    out = []
    for n in sorted(os.listdir(locks)):
        if not n.startswith(PREFIX) or n in mine or n.endswith(".tmp"):
            continue
        info = read(locks, n)
        if info is None:
            continue
        if info.stale():
            remove(locks, n)
            continue
        out.append(info)
    return out


def conflicting(infos: list[LockInfo], exclusive: bool, readers: bool) -> list[LockInfo]:
    """The locks in `infos` that keep out a lock of this kind: an exclusive one is kept out
    by every writer's lock (readers=False) or every reader's (readers=True: prune's second
    step); a shared one only by an exclusive one."""
    if exclusive:
        return [i for i in infos if (i.what == READ) == readers and not i.exclusive] + \
               [i for i in infos if i.exclusive]
    return [i for i in infos if i.exclusive]


class Refresher:
    """Rewrites one lock file every refresh_every() seconds in a daemon thread, in place
    (opened without O_CREAT: a file someone removed as stale is never made again; the
    holder has then lost its lock, and lost() says so)."""

    def __init__(self, locks: Path, name: str, exclusive: bool, what: str):
        self.locks, self.name, self.exclusive, self.what = locks, name, exclusive, what
        made = read(locks, name)           # (its creation time stays what create() wrote)
        self.created = made.created if made is not None else time.time()
        self._lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpusnap-lock-refresh", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(refresh_every()):
            self.refresh()

    def refresh(self) -> None:
        try:
            dfd = fsutil.open_dir(self.locks)
            try:
                fd = os.open(self.name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            finally:
                os.close(dfd)
        except FileNotFoundError:
            self._lost = True
            return
        except OSError:
            return                  # a full disk, a slow server: tried again next time
        try:
            body = _mine_body(self.exclusive, self.what, self.created)
            os.pwrite(fd, body, 0)
            os.ftruncate(fd, len(body))
            os.fsync(fd)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                raise
        finally:
            os.close(fd)

    def lost(self) -> bool:
        """Whether the file is gone (someone judged it stale): the lock no longer holds."""
        if not self._lost and not os.path.lexists(self.locks / self.name):
            self._lost = True
        return self._lost

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
