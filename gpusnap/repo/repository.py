"""Repository: opening (after the trust checks, repo/trust.py), the writer and readers
locks, the index, open-time recovery, and the list of snapshots (docs/format.md).
Snapshots are read through repo/snapshot.py; dumps write through repo/pipeline/writer.py.
Over 400 lines: opening by the path rules, creation and the lock waits all act on the one
Repository object; splitting them is the next step of the module clean-up (issue 34)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gpusnap.errors import CorruptSnapshot, GpusnapError, RepositoryError, RepositoryLocked, SnapshotNotFound, UsageError
from gpusnap.repo import fsutil, lockfile, locking, lockwait, pathcheck, recovery
from gpusnap.repo.codec import codec_id
from gpusnap.repo.format import SNAPSHOT_NAME, FormatError, make_config, encode_config, parse_config
from gpusnap.repo.index import RepoIndex
from gpusnap.repo.snapshot import Snapshot
from gpusnap.repo.trust import (CONFIG_TMP, QUARANTINE, SUBDIRS, check_tree, half_made, no_repository,
                                quarantine_file, untrusted)
from gpusnap.system.access import read_only_error, read_only_reason
from gpusnap.system.faults import fault

if TYPE_CHECKING:  # the dump side is imported where a snapshot is written (restore never loads it)
    from gpusnap.repo.pipeline.writer import SnapshotWriter

__all__ = ["QUARANTINE", "Repository", "Snapshot", "quarantine_file"]


def _notice(text: str) -> None:
    recovery.warn("gpusnap: %s", text)


class Repository:
    def __init__(self, path: Path, config: dict):
        self.path = path
        self.config = config
        self._lock_mutex = threading.Lock()
        self._lock_depth = 0
        self._held = locking.Held(path, self._lock_file)
        self._index: RepoIndex | None = None
        self._index_names: list[str] | None = None
        self._index_checked = False
        self._index_mutex = threading.Lock()
        self.recovery: list[str] = []     # what open-time recovery did (recover())
        # how long a writer waits for a lock another gpusnap holds (repo/lockwait.py; the
        # commands set it with wait_for_locks(), the library alone fails at once)
        self.lock_wait = 0.0
        self.notice: Callable[[str], None] = _notice   # "waiting for …", "read-only …": one line each

    # -- open / create -------------------------------------------------------------------
    @classmethod
    def open(cls, path, create: bool = False) -> "Repository":
        """The repository at `path`, after the trust checks. `path` is checked as given,
        component by component (repo/pathcheck.py), never resolved first. create: make it
        when missing (gpusnap init, or a dump at the default location: repo/locate.py)."""
        path = given = Path(path).absolute()
        try:
            try:
                path = pathcheck.walk(given, create=create)
            except pathcheck.Missing:
                raise no_repository(given) from None
            except pathcheck.NotADir:
                raise NotADirectoryError from None
            if create:
                with _creating(path):
                    cls._create(path)
            elif not os.path.lexists(path / "config"):
                raise FileNotFoundError     # (before check_tree makes tmp/ and locks/ in it)
            check_tree(path)
            fd = fsutil.open_nofollow(path / "config", os.O_RDONLY)
            try:
                st = os.fstat(fd)
                bad = fsutil.untrusted_reason(st, want_dir=False)
                if bad:
                    raise untrusted(path / "config", bad)
                with os.fdopen(fd, "rb", closefd=False) as f:
                    data = f.read((1 << 20) + 1)
            finally:
                os.close(fd)
        except FileNotFoundError:
            if path.exists() and not path.is_dir():
                raise RepositoryError(f"{path} is a file, not a gpusnap repository",
                                      "point --repo at a repository directory") from None
            if half_made(path):
                raise RepositoryError(f"{given}: the creation of this repository was cut short (no config "
                                      "file yet; nothing was stored in it)",
                                      f"`gpusnap init --repo {given}` finishes it (so does the next dump "
                                      "where it is the default repository)") from None
            raise RepositoryError(f"{given} is not a gpusnap repository (no config file)",
                                  "`gpusnap init --repo DIR` creates one in a new or empty directory; "
                                  "or point --repo at an existing repository") from None
        except NotADirectoryError:
            raise RepositoryError(f"{given} is a file, not a gpusnap repository",
                                  "point --repo at a repository directory") from None
        except PermissionError as e:
            raise RepositoryError(f"cannot read repository {given}: {e.strerror or e}",
                                  "run gpusnap as root (sudo) or as the repository's owner") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise untrusted(path / "config", "is a symbolic link") from None
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                from gpusnap.errors import NoSpace
                raise NoSpace(f"no space to create repository {given}: {e.strerror}",
                              "free some space, then dump again") from None
            raise RepositoryError(f"cannot read repository {given}: {e}") from None
        try:
            cfg = parse_config(data)
        except FormatError as e:
            raise RepositoryError(f"{path / 'config'}: {e}") from None
        return cls(path, cfg)

    @classmethod
    def init(cls, path) -> "Repository":
        """`gpusnap init`: a new repository at `path` (made with the directories above it
        when missing); an existing repository is an error, as restic's and borg's init."""
        given = Path(path).absolute()
        try:
            if os.path.lexists(pathcheck.walk(given) / "config"):
                raise RepositoryError(f"{given} is already a gpusnap repository", "use it as it is")
        except (pathcheck.Missing, pathcheck.NotADir):
            pass                         # (open() says what is wrong with a file in the way)
        return cls.open(given, create=True)

    @staticmethod
    def _create(path: Path) -> None:
        if (path / "config").exists() or os.path.lexists(path / "config"):
            return
        # never write into a directory another user controls
        bad = fsutil.untrusted_reason(os.lstat(path), want_dir=True)
        if bad and bad != "is not a directory":
            raise untrusted(path, bad)
        if not path.is_dir() or (any(path.iterdir()) and not half_made(path)):
            raise RepositoryError(f"{path} exists, is not empty and is not a gpusnap repository",
                                  "choose an empty or new directory for the repository")
        if (path / "tmp").is_dir():     # a killed creation's config, never renamed into place
            for name in os.listdir(path / "tmp"):
                if name.startswith(CONFIG_TMP):
                    fsutil.unlink_quiet(path / "tmp" / name)
        fd = fsutil.open_dir(path)      # private whatever the umask or an empty directory's mode
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        for d in SUBDIRS:
            fsutil.mkdir_private(path / d)
        fault("repo:created-subdirs")       # (test hook: killed before the config is written)
        import secrets      # here only: it loads OpenSSL (~5 ms), which no dump or restore needs

        cfg = make_config(secrets.token_hex(16), time.time())
        fsutil.write_file_atomic(path / "tmp", path / "config", encode_config(cfg))
        fsutil.fsync_dir(path)

    # -- locking (repo/locking.py, docs/format.md §6) ------------------------------------------
    @contextlib.contextmanager
    def writer_lock(self, recover: bool = True, exclusive: bool = False, what: str = "writer",
                    when_alone: Callable[[], None] | None = None):
        """The writer side of the repository's locks: shared by the writers that only add
        (dump, import, a copy's receiver: any number at once), exclusive for what deletes
        (prune, repair, forget --prune: it waits for every writer). Re-entrant within this
        Repository object; an exclusive one asked for inside a shared one lets go of the
        shared one first (two dumps' retentions never wait for each other) and takes it
        again after. Taking it runs the open-time recovery (recover(); recover=False for a
        dry run that must change nothing) only when exclusive: a writer first tries the
        exclusive lock without waiting, and when nobody else writes runs the recovery and
        `when_alone` (sweeps of what dead writers left) before going down to shared."""
        with self._lock_mutex:
            upgraded = False
            if self._lock_depth == 0:
                try:
                    self._take_first(recover, exclusive, what, when_alone)
                except BaseException:
                    self._held.close()      # (a full disk while going down to shared)
                    raise
            elif exclusive and not self._held.exclusive:
                self._held.release()
                try:
                    self._held.take(True, self.lock_wait, what, self.notice)
                except BaseException:
                    with contextlib.suppress(GpusnapError, OSError):
                        self._held.take(False, self.lock_wait, what, self.notice)
                    raise
                upgraded = True
            self._lock_depth += 1
        try:
            yield self
        finally:
            with self._lock_mutex:
                self._lock_depth -= 1
                if self._lock_depth == 0:
                    self._held.close()
                elif upgraded and self._held.held:
                    with contextlib.suppress(GpusnapError, OSError):
                        self._held.downgrade(self.lock_wait, what, self.notice)

    def _take_first(self, recover: bool, exclusive: bool, what: str, when_alone) -> None:
        if exclusive:
            self._held.take(True, self.lock_wait, what, self.notice)
            if recover:
                self._recover_quietly()
        elif recover and self._held.try_exclusive(what):
            try:
                self._recover_quietly()
                if when_alone is not None:
                    when_alone()
            finally:
                self._held.downgrade(self.lock_wait, what, self.notice)
        else:
            self._held.take(False, self.lock_wait, what, self.notice)

    @contextlib.contextmanager
    def alone(self, what: str = "writer"):
        """Inside writer_lock(): yields whether this process is now the only writer (the
        exclusive lock taken without waiting; nobody can start until the block ends), e.g.
        to delete packs of an aborted dump that another writer could otherwise name. Back
        to the shared lock after."""
        got = upgraded = False
        with self._lock_mutex:
            if self._lock_depth and self._held.exclusive:
                got = True
            elif self._lock_depth and self._held.held:
                self._held.release()
                got = upgraded = self._held.try_exclusive(what)
                if not got:
                    self._held.take(False, self.lock_wait, what, self.notice)
        try:
            yield got
        finally:
            if upgraded:
                with self._lock_mutex:
                    self._held.downgrade(self.lock_wait, what, self.notice)

    def check_lock(self) -> None:
        """RepositoryError if this process's lock file was taken over as stale (it stalled
        for longer than the staleness timeout): a writer checks before naming its packs."""
        self._held.check()

    def wait_for_locks(self, seconds: float, notice: Callable[[str], None] | None = None) -> "Repository":
        """Make this repository's writers wait up to `seconds` for a lock another gpusnap
        holds (lockwait.seconds() gives a command's), telling `notice` (a line) before."""
        self.lock_wait = seconds
        if notice is not None:
            self.notice = notice
        return self

    @contextlib.contextmanager
    def readers_lock(self, exclusive: bool = False):
        """Restores read shared (they wait for a prune to finish); prune takes it exclusive
        and waits (lock_wait) for a restore or verify to finish, then refuses, so it never
        deletes data under a reader. Writers that only add do not take it. Each side is a
        flock on locks/readers and a lock file (repo/locking.py). On a repository this
        process cannot write (a read-only mount, a backup copy) a reader takes the existing
        lock file read-only (flock needs no write access; a bind mount shares the lock with
        its writable view), or no lock where there is none, and says so, and leaves no
        lock file."""
        if exclusive:
            fd = self._lock_file("readers")
        else:
            fd = self._reader_fd()
            if fd is None:
                yield self
                return
        name = None
        try:
            if exclusive:
                self._readers_exclusive(fd)
            else:
                fcntl.flock(fd, fcntl.LOCK_SH)
                name = self._reader_file()
            yield self
        finally:
            if name is not None:
                name.stop()
                lockfile.remove(self.path / "locks", name.name)
            os.close(fd)

    def _readers_exclusive(self, fd: int) -> None:
        deadline = time.monotonic() + self.lock_wait
        told = []

        def on_wait():
            if not told:
                told.append(1)
                self.notice(f"waiting for a restore or verify reading repository {self.path} "
                            f"to finish (up to {self.lock_wait:g} s)")
        mine = self._held.refresher.name if self._held.refresher is not None else None
        ok = lockwait.flock(fd, fcntl.LOCK_EX, self.lock_wait, on_wait)
        if ok and mine is not None:
            ok = locking.poll_files(self.path / "locks", True, True, "prune", deadline, on_wait, mine) is not None
        if not ok:
            raise RepositoryLocked(f"a restore is reading repository {self.path} (or a verify is checking it)",
                                   "prune again when it has finished, or give it longer "
                                   "(--lock-wait SECONDS, $GPUSNAP_LOCK_WAIT)")

    def _reader_file(self) -> "lockfile.Refresher | None":
        """A reader's lock file, once no exclusive one is there (waiting for a prune on
        another machine as flock waits for one here); none where none can be written."""
        locks = self.path / "locks"
        try:
            name = locking.poll_files(locks, False, False, lockfile.READ, time.monotonic() + lockwait.MAX_WAIT,
                                      lambda: None, ignore=frozenset(self._held.names()))
        except OSError:
            return None          # a read-only repository: the flock above is all there is
        return lockfile.Refresher(locks, name, False, lockfile.READ)

    def _reader_fd(self) -> int | None:
        """The readers lock file for a shared lock; on a repository this process cannot
        change, the existing file opened read-only, or None (no lock file: no lock)."""
        try:
            return self._lock_file("readers")
        except RepositoryError:
            why = read_only_reason(self.path)
            if why is None:
                raise
        try:
            fd = fsutil.open_lock_file(self.path / "locks", "readers", create=False)
            self.notice(f"repository {self.path} is read-only ({why}): reading it, "
                        "holding its readers lock through a read-only descriptor")
            return fd
        except (FileNotFoundError, PermissionError):
            self.notice(f"repository {self.path} is read-only ({why}): reading it without a lock "
                        "(it has no lock file)")
            return None

    def _lock_file(self, name: str) -> int:
        """locks/<name>, never through a symlink or hard link (the writer lock is truncated).
        A repository on a read-only filesystem is one RepositoryError (exit 14)."""
        try:
            return fsutil.open_lock_file(self.path / "locks", name)
        except OSError as e:
            if e.errno == errno.EROFS or (e.errno in (errno.EACCES, errno.EPERM) and read_only_reason(self.path)):
                raise read_only_error(self.path, read_only_reason(self.path) or e.strerror) from None
            if e.errno in (errno.EACCES, errno.EPERM):
                raise RepositoryError(f"cannot lock repository {self.path}: {e.strerror}",
                                      "run gpusnap as root (sudo) or as the repository's owner") from None
            raise

    def holds_lock(self) -> bool:
        return self._lock_depth > 0 and self._held.held

    def holds_exclusive(self) -> bool:
        return self.holds_lock() and self._held.exclusive

    # -- index -----------------------------------------------------------------------------
    @property
    def index_loaded(self) -> bool:
        """Whether this Repository holds the index in memory (a restore never needs it)."""
        return self._index is not None

    def index(self, check_packs: bool = False) -> RepoIndex:
        """The repository's index (cached while index/ does not change). check_packs: leave
        out every record whose pack is missing or too short (the dump's view: it never
        deduplicates against data that is not there; store.RepoIndex.load)."""
        with self._index_mutex:
            names = sorted(n for n in os.listdir(self.path / "index") if not n.startswith("."))
            idx = self._index
            if (idx is None or names != self._index_names
                    or (check_packs and not (self._index_checked and idx.packs_present(self.path)))):
                idx = RepoIndex.load(self.path, names, check_packs=check_packs)
                self._index = idx
                self._index_names = names
                self._index_checked = check_packs
            return idx

    # -- open-time recovery (writer lock held; repo/recovery.py) ---------------------------
    def _recover_quietly(self) -> None:
        try:
            self.recover()
        except (OSError, FormatError, GpusnapError) as e:
            # the dump's own check (check_packs) still keeps it from using missing data
            recovery.warn("gpusnap: repository %s: recovery failed: %s", self.path, e)

    def recover(self) -> list[str]:
        """recovery.recover(): lines saying what was done (also in self.recovery, and logged)."""
        self.recovery = recovery.recover(self)
        return self.recovery

    def snapshots_missing_data(self, idx: RepoIndex) -> dict[str, str]:
        return recovery.snapshots_missing_data(self, idx)

    # -- snapshots ---------------------------------------------------------------------------
    def new_snapshot(self, name: str, compress: str = "auto", meta: dict | None = None, **kw) -> SnapshotWriter:
        if not isinstance(name, str) or not SNAPSHOT_NAME.match(name):
            raise UsageError(f"bad snapshot name {name!r}",
                             "use letters, digits, '.', '_', '+', '-' (up to 100), starting with a letter or digit")
        try:
            c = codec_id(compress)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if not self.holds_lock():
            raise RepositoryError("new_snapshot() needs the repository's writer lock (use repo.writer_lock())")
        from gpusnap.repo.pipeline.writer import SnapshotWriter

        return SnapshotWriter(self, name, c, meta, **kw)

    def _snapshot_entries(self) -> list[tuple[Path, str | None]]:
        """(path, None) for each snapshot directory, (path, why) for an entry that is not one
        (a symlink, a file, another user's directory): such entries are reported, never
        followed, read or deleted."""
        d = self.path / "snapshots"
        dfd = fsutil.open_dir(d)
        out = []
        try:
            for n in sorted(os.listdir(dfd)):
                if n.startswith("."):
                    continue
                try:
                    st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append((d / n, fsutil.untrusted_reason(st, want_dir=True)))
        finally:
            os.close(dfd)
        return out

    def _snapshot_dirs(self) -> list[Path]:
        return [p for p, bad in self._snapshot_entries() if bad is None]

    def unusable_entries(self) -> dict[Path, str]:
        """Entries of snapshots/ that are not snapshot directories gpusnap can trust."""
        return {p: f"{p.name} {bad}; not a snapshot, left alone" for p, bad in self._snapshot_entries() if bad}

    def snapshots(self) -> list["Snapshot"]:
        """Committed snapshots whose manifest verifies, oldest first."""
        out = []
        for p in self._snapshot_dirs():
            try:
                out.append(Snapshot(self, p))
            except CorruptSnapshot:
                continue
        out.sort(key=lambda s: (s.created, s.path.name))
        return out

    def broken_snapshots(self) -> dict[Path, str]:
        """Snapshot directories whose manifest does not verify, and untrusted entries."""
        out = self.unusable_entries()
        for p in self._snapshot_dirs():
            try:
                Snapshot(self, p)
            except CorruptSnapshot as e:
                out[p] = str(e)
        return out

    def snapshot_at(self, path: Path) -> "Snapshot":
        """The snapshot in directory `path` of snapshots/ (what SnapshotWriter.commit() just
        renamed into place); the writer gets it here so that it never imports this module."""
        return Snapshot(self, path)

    def snapshot(self, ref: str) -> "Snapshot":
        ref = str(ref)
        p = Path(ref)
        if "/" in ref or p.is_absolute():
            rp = p.absolute()
            try:            # checked as given, as the repository's own path (never resolved)
                where = pathcheck.walk(rp.parent)
            except (pathcheck.Missing, pathcheck.NotADir):
                where = None
            if where == self.path / "snapshots" and not rp.name.startswith(".") \
                    and self.path / "snapshots" / rp.name in self._snapshot_dirs():
                return Snapshot(self, self.path / "snapshots" / rp.name)
            raise SnapshotNotFound(f"{ref} is not a snapshot of repository {self.path}")
        if ref and not ref.startswith(".") and (self.path / "snapshots" / ref) in self._snapshot_dirs():
            return Snapshot(self, self.path / "snapshots" / ref)
        snaps = self.snapshots()
        # A name wins over an id prefix: "a" must not pick whichever id happens to start with a.
        byname = [s for s in snaps if s.name == ref]
        if byname:
            return byname[-1]
        byid = [s for s in snaps if len(ref) >= 4 and s.id.startswith(ref.lower())]
        if len(byid) == 1:
            return byid[0]
        if len(byid) > 1:
            raise SnapshotNotFound(f"snapshot id prefix {ref} is ambiguous ({len(byid)} snapshots)",
                                   "give more digits of the id")
        raise SnapshotNotFound(f"no snapshot {ref!r} in repository {self.path}", "list them with: gpusnap ls")

    def remove_snapshot(self, snap) -> None:
        """Delete one committed snapshot directory (its logs go with prune.prune_logs). The
        data it referenced stays until prune finds nothing needs it. Readers never see a
        half-deleted snapshot: the directory is renamed to snapshots/.del-* (ignored by every
        reader, removed by prune if a crash leaves it) before it is deleted. `snap` is a
        Snapshot, or anything with the `path` of a snapshot directory (one whose manifest is
        unreadable). The caller holds the writer lock, and the readers lock exclusively (a
        restore may be reading it)."""
        import shutil
        if not self.holds_lock():
            raise RepositoryError("remove_snapshot() needs the repository's writer lock (use repo.writer_lock())")
        sd = self.path / "snapshots"
        if Path(snap.path).parent != sd or sd / Path(snap.path).name not in self._snapshot_dirs():
            raise SnapshotNotFound(f"{snap.path} is not a snapshot directory of repository {self.path}")
        tomb = sd / f".del-{snap.path.name}"
        shutil.rmtree(tomb, ignore_errors=True)   # left by a crash while an earlier namesake went
        os.rename(snap.path, tomb)
        fsutil.fsync_dir(sd)
        shutil.rmtree(tomb)


@contextlib.contextmanager
def _creating(path: Path):
    """Two gpusnaps creating one repository at once (two schedules' first run in the same
    minute) take turns, so the second finds it made rather than half-made (exit 14): a
    machine-wide lock named after the path (in /run/gpusnap, which only root can write: a
    lock on a directory any user may open could be held by that user forever)."""
    if os.path.lexists(path / "config"):
        yield
        return
    import hashlib

    from gpusnap.system import hostlock

    with hostlock.held("create-repo-" + hashlib.sha256(os.fsencode(path)).hexdigest()[:32]):
        yield
