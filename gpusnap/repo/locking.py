"""The repository's locks as one process holds them (docs/format.md §6): shared by writers
(dump, import, a copy's receiver) and readers, exclusive for prune, repair and forget --prune.

Each lock is taken twice over, flock first, then a lock file (repo/lockfile.py):
  * flock on locks/writer (LOCK_SH for a writer, LOCK_EX for an exclusive holder) and on
    locks/readers (LOCK_SH for a reader, LOCK_EX for prune's second step): the files and
    modes gpusnap before revision 1.6 used, so an older gpusnap on the same repository is
    kept out, and keeps this one out, as before; on a local filesystem it is also the fast
    path: a holder on this machine blocks at once, and a dead one's lock is free at once;
  * a lock file, which holds where flock does not reach other machines (NFS with nolock).
Both are waited for within one --lock-wait deadline (repo/lockwait.py); a refusal is
RepositoryLocked (exit 10) naming the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from gpusnap.errors import RepositoryError, RepositoryLocked
from gpusnap.repo import lockfile, lockwait

OPENING = " (opening)"        # `what` of a writer's open-time exclusive look (try_exclusive)
OPENING_GRACE = 5.0           # how long a writer waits for one, whatever its --lock-wait


class Held:
    """One process's hold on the writer side of a repository's locks: None, shared or
    exclusive. `open_file(name)` opens locks/<name> for flock (Repository._lock_file)."""

    def __init__(self, path: Path, open_file: Callable[[str], int]):
        self.path = path
        self.locks = path / "locks"
        self._open = open_file
        self.fd: int | None = None              # locks/writer, flocked
        self.exclusive = False
        self.refresher: lockfile.Refresher | None = None

    @property
    def held(self) -> bool:
        return self.refresher is not None

    def take(self, exclusive: bool, wait: float, what: str, notice: Callable[[str], None]) -> None:
        """Take the lock (flock, then a lock file), waiting up to `wait` seconds for the
        holders that keep it out; RepositoryLocked if they are still there then."""
        deadline = time.monotonic() + wait
        told = []

        def on_wait() -> None:
            if not told:
                told.append(1)
                notice(f"waiting for {self.holders(exclusive)} to release repository {self.path} "
                       f"(up to {wait:g} s)")

        if self.fd is None:
            self.fd = self._open("writer")
        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if not lockwait.flock(self.fd, op, wait, on_wait) and \
                (exclusive or not self._openers_only() or not lockwait.flock(self.fd, op, OPENING_GRACE)):
            self._refuse(exclusive, wait)
        try:
            name = poll_files(self.locks, exclusive, False, what, deadline, on_wait)
        except BaseException:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            raise
        if name is None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self._refuse(exclusive, wait)
        self.exclusive = exclusive
        self.refresher = lockfile.Refresher(self.locks, name, exclusive, what)
        if exclusive:
            self._write_legacy_holder(what)

    def _refuse(self, exclusive: bool, wait: float):
        holder = self.holders(exclusive)
        waited = f" (waited {wait:g} s)" if wait > 0 else ""
        raise RepositoryLocked(
            f"repository {self.path} is locked by {holder}{waited}",
            "wait for that gpusnap to finish, or give it longer (--lock-wait SECONDS, "
            "$GPUSNAP_LOCK_WAIT); a lock held by a dead process is released automatically")

    def _write_legacy_holder(self, what: str) -> None:
        """Who holds locks/writer exclusively, in the file itself: what gpusnap before
        revision 1.6 reads to name the holder. Information only: a full disk must not stop
        a prune, which is what frees space."""
        with contextlib.suppress(OSError):
            os.fchmod(self.fd, 0o600)
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                                           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode(), 0)

    def release(self) -> None:
        """Let go of the lock (the flock is kept on its descriptor's file only while held)."""
        if self.refresher is not None:
            r, self.refresher = self.refresher, None
            r.stop()
            lockfile.remove(self.locks, r.name)
        if self.fd is not None:
            if self.exclusive:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, 0)
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.exclusive = False

    def close(self) -> None:
        self.release()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _openers_only(self) -> bool:
        """Whether what keeps a shared lock out is only writers' open-time look
        (try_exclusive: milliseconds), or a holder between its flock and its lock file."""
        try:
            infos = lockfile.conflicting(lockfile.others(self.locks, self.names()), False, False)
        except OSError:
            return False
        return all(i.what.endswith(OPENING) for i in infos)

    def try_exclusive(self, what: str) -> bool:
        """Take the exclusive lock if nobody holds any writer lock right now (no wait). Not
        held before; -> whether it is held (exclusive) now. Its lock file says OPENING: a
        writer that meets it waits OPENING_GRACE for it whatever its --lock-wait, since
        writers never keep each other out for longer."""
        try:
            self.take(True, 0.0, what + OPENING, lambda line: None)
            return True
        except RepositoryLocked:
            return False

    def downgrade(self, wait: float, what: str, notice: Callable[[str], None]) -> None:
        """Exclusive -> shared. The shared lock file is made before the exclusive one goes,
        so no other machine's prune ever sees neither; flock cannot convert atomically
        (another's LOCK_EX may slip in between), so that part waits as a take() does."""
        assert self.refresher is not None and self.exclusive
        old = self.refresher
        what = what.removesuffix(OPENING)
        name = lockfile.create(self.locks, False, what)
        old.stop()
        lockfile.remove(self.locks, old.name)
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        self.refresher = lockfile.Refresher(self.locks, name, False, what)
        self.exclusive = False
        if not lockwait.flock(self.fd, fcntl.LOCK_SH, wait, lambda: notice(
                f"waiting for {self.holders(False)} to release repository {self.path} (up to {wait:g} s)")):
            self.release()
            self._refuse(False, wait)

    def check(self) -> None:
        """RepositoryError when the lock file is gone (another machine took it as stale:
        this process stalled past the staleness timeout), before anything is named."""
        if self.refresher is not None and self.refresher.lost():
            raise RepositoryError(f"lost the lock on repository {self.path}: its lock file "
                                  f"locks/{self.refresher.name} was removed as stale",
                                  "nothing was committed; dump again")

    def holders(self, exclusive: bool, readers: bool = False) -> str:
        """Who keeps a lock of this kind out, from the lock files (an older gpusnap's from
        the text it wrote into locks/writer)."""
        try:
            infos = lockfile.conflicting(lockfile.others(self.locks, self.names()), exclusive, readers)
        except OSError:
            infos = []
        if infos:
            more = f" and {len(infos) - 1} other(s)" if len(infos) > 1 else ""
            return infos[0].describe() + more
        return legacy_holder(self.fd) if self.fd is not None else "pid ?"

    def names(self) -> set[str]:
        """This hold's lock file, if any."""
        return {self.refresher.name} if self.refresher is not None else set()


def legacy_holder(fd: int) -> str:
    """Who holds locks/writer, as an exclusive holder wrote it (information only)."""
    info = {}
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(os.pread(fd, 4096, 0).decode(errors="replace").strip())
    if not isinstance(info, dict) or not info:
        return "pid ?"
    return (f"pid {info.get('pid', '?')} on {info.get('host')} ({info.get('what')}, "
            f"since {info.get('since')})")


def poll_files(locks: Path, exclusive: bool, readers: bool, what: str, deadline: float,
               on_wait: Callable[[], None], mine: str | None = None, ignore: frozenset = frozenset()) -> str | None:
    """Make a lock file (unless `mine` names one already made), then look at the others; while
    one conflicts, remove ours (unless it is `mine`), wait and try again until `deadline`.
    `ignore`: this process's other lock files (a reader inside a prune never waits for it).
    -> the lock file's name, or None if still kept out then."""
    pause = 0.05
    grace = time.monotonic() + OPENING_GRACE
    while True:
        name = mine or lockfile.create(locks, exclusive, what)
        against = lockfile.conflicting(lockfile.others(locks, {name} | ignore), exclusive, readers)
        if not against:
            return name
        if mine is None:
            lockfile.remove(locks, name)
        openers = not exclusive and all(i.what.endswith(OPENING) for i in against)
        left = (max(deadline, grace) if openers else deadline) - time.monotonic()
        if left <= 0:
            return None
        if not openers:
            on_wait()
        time.sleep(min(pause, left))
        pause = min(pause * 2, 1.0)
