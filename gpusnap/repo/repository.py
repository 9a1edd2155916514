"""Repository, Snapshot: opening, locking, listing, reading (docs/format.md)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import queue
import secrets
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Iterator

import blake3

from gpusnap.errors import CorruptSnapshot, GpusnapError, RepositoryError, RepositoryLocked, SnapshotNotFound, UsageError
from gpusnap.repo import fsutil, locations, native
from gpusnap.repo.codec import codec_id
from gpusnap.repo.format import BLOB_HEADER, HEX64, PAGE_ID_LEN, PAGE_SIZE, SNAPSHOT_NAME, FormatError, iter_pagelist, make_config, encode_config, parse_config, parse_index, parse_manifest
from gpusnap.repo.store import BlobReader, RepoIndex, index_pack_names, pack_path, pack_sizes, write_index_file
from gpusnap.repo.pipeline.writer import SnapshotWriter

SUBDIRS = ("packs", "index", "snapshots", "locks", "tmp")
QUARANTINE = "quarantine"      # index files set aside by recovery or repair (docs/format.md §10)
log = logging.getLogger("gpusnap")
MADE_ON_OPEN = ("tmp", "locks")     # recreated when missing; the others missing = damaged
OPTIONAL = ("logs", "quarantine")  # checked when present


def _untrusted(p, why: str) -> RepositoryError:
    return fsutil.untrusted(p, why)


def _check_above(path: Path) -> None:
    """Every directory above the repository must be trusted too, or writable only with the
    sticky bit (as /tmp): else its owner could swap the repository for one of their own."""
    for anc in reversed(path.parents):
        try:
            st = os.lstat(anc)
        except FileNotFoundError:
            return                    # (created by a dump, as the caller)
        if st.st_uid not in fsutil.trusted_uids():
            raise _untrusted(anc, f"(above the repository) is owned by uid {st.st_uid}, neither you nor root")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise _untrusted(anc, f"(above the repository) is writable by others (mode {st.st_mode & 0o7777:04o})")


def _check_tree(path: Path) -> None:
    """The repository directory, its subdirectories and packs/xx/: real directories (not
    symlinks), owned by the caller or root, writable by nobody else. Missing tmp/ and locks/
    are recreated (never through a symlink: relative to the checked directory's fd)."""
    rfd = fsutil.open_dir(path)
    try:
        bad = fsutil.untrusted_reason(os.fstat(rfd), want_dir=True)
        if bad:
            raise _untrusted(path, bad)
        for d in SUBDIRS + OPTIONAL:
            try:
                st = os.stat(d, dir_fd=rfd, follow_symlinks=False)
            except FileNotFoundError:
                if d in MADE_ON_OPEN:
                    os.mkdir(d, 0o700, dir_fd=rfd)
                    continue
                if d in OPTIONAL:
                    continue
                if not os.path.lexists(path / "config"):
                    raise
                raise RepositoryError(f"{path} is damaged: directory {d}/ is missing") from None
            bad = fsutil.untrusted_reason(st, want_dir=True)
            if bad:
                raise _untrusted(path / d, bad)
        pfd = fsutil.open_dir("packs", dir_fd=rfd)
        try:
            for sub in os.listdir(pfd):
                st = os.stat(sub, dir_fd=pfd, follow_symlinks=False)
                bad = fsutil.untrusted_reason(st, want_dir=True)
                if bad:
                    raise _untrusted(path / "packs" / sub, bad)
        finally:
            os.close(pfd)
    finally:
        os.close(rfd)
from gpusnap.repo.format import _ONES, _ZCHUNK, _ZIDS, _ZKINDS, _ZVIEW, READ_CHUNK


def quarantine_file(root: Path, path: Path) -> Path:
    """Move `path` (an index file) into REPO/quarantine/ (atomic rename, both directories
    fsynced): kept for inspection, never read. -> its new path."""
    q = root / QUARANTINE
    fsutil.mkdir_private(q)
    dest = q / f"{path.parent.name}-{path.name}"
    k = 1
    while os.path.lexists(dest):
        k += 1
        dest = q / f"{path.parent.name}-{path.name}.{k}"
    os.rename(path, dest)
    fsutil.fsync_dir(q)
    fsutil.fsync_dir(path.parent)
    return dest


class Repository:
    def __init__(self, path: Path, config: dict):
        self.path = path
        self.config = config
        self._lock_mutex = threading.Lock()
        self._lock_depth = 0
        self._lock_fd: int | None = None
        self._index: RepoIndex | None = None
        self._index_names: list[str] | None = None
        self._index_checked = False
        self._index_mutex = threading.Lock()
        self.recovery: list[str] = []     # what open-time recovery did (recover())

    # -- open / create -------------------------------------------------------------------
    @classmethod
    def open(cls, path, create: bool = False) -> "Repository":
        path = Path(os.path.realpath(Path(path).absolute()))
        try:
            _check_above(path)
            if create:
                cls._create(path)
            _check_tree(path)
            fd = fsutil.open_nofollow(path / "config", os.O_RDONLY)
            try:
                st = os.fstat(fd)
                bad = fsutil.untrusted_reason(st, want_dir=False)
                if bad:
                    raise _untrusted(path / "config", bad)
                with os.fdopen(fd, "rb", closefd=False) as f:
                    data = f.read((1 << 20) + 1)
            finally:
                os.close(fd)
        except FileNotFoundError:
            if path.exists() and not path.is_dir():
                raise RepositoryError(f"{path} is a file, not a gpusnap repository",
                                      "point --repo at a repository directory") from None
            raise RepositoryError(f"{path} is not a gpusnap repository (no config file)",
                                  "create one with a dump, or point --repo at an existing repository") from None
        except NotADirectoryError:
            raise RepositoryError(f"{path} is a file, not a gpusnap repository",
                                  "point --repo at a repository directory") from None
        except PermissionError as e:
            raise RepositoryError(f"cannot read repository {path}: {e.strerror or e}",
                                  "run gpusnap as root (sudo) or as the repository's owner") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _untrusted(path / "config", "is a symbolic link") from None
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                from gpusnap.errors import NoSpace
                raise NoSpace(f"no space to create repository {path}: {e.strerror}",
                              "free some space, then dump again") from None
            raise RepositoryError(f"cannot read repository {path}: {e}") from None
        try:
            cfg = parse_config(data)
        except FormatError as e:
            raise RepositoryError(f"{path / 'config'}: {e}") from None
        return cls(path, cfg)

    @staticmethod
    def _create(path: Path) -> None:
        if (path / "config").exists() or os.path.lexists(path / "config"):
            return
        if os.path.lexists(path):           # never write into a directory another user controls
            bad = fsutil.untrusted_reason(os.lstat(path), want_dir=True)
            if bad and bad != "is not a directory":
                raise _untrusted(path, bad)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise RepositoryError(f"{path} exists, is not empty and is not a gpusnap repository",
                                  "choose an empty or new directory for the repository")
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fsutil.mkdir_private(path)
        for d in SUBDIRS:
            fsutil.mkdir_private(path / d)
        cfg = make_config(secrets.token_hex(16), time.time())
        fsutil.write_file_atomic(path / "tmp", path / "config", encode_config(cfg))
        fsutil.fsync_dir(path)

    # -- locking ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def writer_lock(self, recover: bool = True):
        """One writer per repository (flock on locks/writer: the kernel drops it when the
        holder dies). Re-entrant within this Repository object. Taking it runs the
        open-time recovery (recover(); recover=False for a dry run that must change
        nothing)."""
        with self._lock_mutex:
            if self._lock_depth == 0:
                fd = self._lock_file("writer")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    try:
                        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                    finally:
                        os.close(fd)
                    info = {}
                    with contextlib.suppress(ValueError):
                        info = json.loads(holder)
                    pid = info.get("pid", "?") if isinstance(info, dict) else "?"
                    raise RepositoryLocked(
                        f"repository {self.path} is locked by pid {pid}"
                        + (f" on {info.get('host')} ({info.get('what')}, since {info.get('since')})" if isinstance(info, dict) and info else ""),
                        "wait for that gpusnap to finish; a lock held by a dead process is released automatically")
                # who holds it is information only: a full disk must not stop the writer
                # (a prune is what frees space)
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o600)
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": "writer",
                                              "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode(), 0)
                self._lock_fd = fd
                first = True
            else:
                first = False
            self._lock_depth += 1
        try:
            if first and recover:
                self._recover_quietly()
            yield self
        finally:
            with self._lock_mutex:
                self._lock_depth -= 1
                if self._lock_depth == 0:
                    fd, self._lock_fd = self._lock_fd, None
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                    os.close(fd)     # closing the only fd releases the flock

    @contextlib.contextmanager
    def readers_lock(self, exclusive: bool = False):
        """Restores read shared (they wait for a prune to finish); prune takes it exclusive
        and refuses while a restore is reading, so it never deletes data under a reader.
        Dumps only add data and do not take it."""
        fd = self._lock_file("readers")
        try:
            if exclusive:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise RepositoryLocked(f"a restore is reading repository {self.path} (or a verify is checking it)",
                                           "prune again when it has finished") from None
            else:
                fcntl.flock(fd, fcntl.LOCK_SH)
            yield self
        finally:
            os.close(fd)

    def _lock_file(self, name: str) -> int:
        """locks/<name>, never through a symlink or hard link (the writer lock is truncated)."""
        try:
            return fsutil.open_lock_file(self.path / "locks", name)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                raise RepositoryError(f"cannot lock repository {self.path}: {e.strerror}",
                                      "run gpusnap as root (sudo) or as the repository's owner") from None
            raise

    def holds_lock(self) -> bool:
        return self._lock_depth > 0

    # -- index -----------------------------------------------------------------------------
    def _load_index(self, refresh: bool = False, check_packs: bool = False) -> RepoIndex:
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

    # -- open-time recovery (writer lock held) -------------------------------------------------
    def _recover_quietly(self) -> None:
        try:
            self.recover()
        except (OSError, FormatError, GpusnapError) as e:
            # the dump's own check (check_packs) still keeps it from using missing data
            log.warning("gpusnap: repository %s: recovery failed: %s", self.path, e)

    def recover(self) -> list[str]:
        """Make the repository consistent after any crash or loss (docs/format.md §10);
        called when the writer lock is taken. By the commit order an index file names only
        packs that were durable before it, so an index naming a missing pack means data was
        lost outside gpusnap (or by a gpusnap before format revision 1.3, whose aborted
        commit could delete the packs of an index it had written). Such an index file is
        replaced by one holding its records whose packs are there, then moved to
        quarantine/; the snapshots that needed the lost data are reported. Cheap when all
        is well: the pack lists at the head of each index file and one lstat per pack.
        -> lines saying what was done (also in self.recovery, and logged)."""
        root = self.path
        idir = root / "index"
        lists: dict[str, list[bytes]] = {}
        for n in sorted(os.listdir(idir)):
            if not HEX64.match(n):
                continue
            try:
                lists[n] = index_pack_names(idir / n)
            except (OSError, FormatError):
                continue          # a damaged index file: load() reports it, repair rebuilds
        sizes = pack_sizes(root, {ph for v in lists.values() for ph in v})
        bad = [n for n, v in lists.items() if any(sizes[ph] is None for ph in v)]
        done: list[str] = []
        lost_packs: set[bytes] = set()
        for n in bad:
            try:
                with open(idir / n, "rb") as f:
                    parsed = parse_index(f.read())
            except (OSError, FormatError):
                continue
            keep: dict[bytes, list] = {}
            for b in parsed.blobs:
                ph = parsed.packs[b.pack_no]
                size = sizes.get(ph)
                if size is not None and b.offset + BLOB_HEADER.size + b.stored_len + 16 <= size:
                    keep.setdefault(ph, []).append(b)
            missing = [ph for ph in parsed.packs if sizes.get(ph) is None]
            lost_packs.update(missing)
            # the records that still hold first, then the file aside: a crash in between
            # leaves both (duplicates are legal), never fewer records than data
            res = write_index_file(root, sorted(keep.items())) if keep else None
            quarantine_file(root, idir / n)
            done.append(f"index file {n} names {len(missing)} missing pack(s) "
                        f"({', '.join(ph.hex()[:16] for ph in missing)}): moved to {QUARANTINE}/"
                        + (f", its {sum(map(len, keep.values()))} record(s) in present packs kept in "
                           f"index/{res[0].name}" if res else ""))
        if done:
            idx = self._load_index(check_packs=True)
            for dirname, why in self.snapshots_missing_data(idx).items():
                done.append(f"snapshot {dirname} is damaged: {why} (run gpusnap verify; restore another snapshot)")
            for line in done:
                log.warning("gpusnap: repository %s: %s", root, line)
        self.recovery = done
        return done

    def snapshots_missing_data(self, idx: RepoIndex) -> dict[str, str]:
        """Snapshot dir name -> why, for every snapshot that needs pages or blobs `idx` does
        not hold (or whose manifest or page lists are unreadable)."""
        import numpy as np
        out: dict[str, str] = {}
        for p, why in self.broken_snapshots().items():
            out[p.name] = why
        table = idx.page_table()
        for s in self.snapshots():
            try:
                pages, data = s.referenced_page_bytes()
            except CorruptSnapshot as e:
                out[s.path.name] = str(e)
                continue
            ids = np.unique(np.frombuffer(pages, dtype="V16"))
            locs = np.frombuffer(table.get_many(ids.tobytes()), dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
            missing = int((locs < 0).sum()) + sum(1 for bid in data if bid not in idx.data_loc)
            if missing:
                out[s.path.name] = f"{missing} page(s)/blob(s) it needs are lost"
        return out

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
        snaps_dir = (self.path / "snapshots").resolve()
        p = Path(ref)
        if "/" in ref or p.is_absolute():
            try:
                rp = p.resolve()
            except OSError:
                rp = p
            if rp.parent == snaps_dir and not rp.name.startswith(".") \
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

    def usage(self) -> dict:
        from gpusnap.repo.maint.usage import repo_usage
        return repo_usage(self)


PREFETCH_MIN = 8 << 20     # pages images at least this big are read ahead in a thread
PREFETCH_DEPTH = 3         # chunks (<= 1 MiB each) read ahead


def _prefetched(it: Iterator[bytes], depth: int = PREFETCH_DEPTH) -> Iterator[bytes]:
    """Run the generator `it` in a helper thread, `depth` items ahead; exceptions reach the
    caller in order. Closing this generator early stops and closes `it` (in its thread)."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for x in it:
                if not put((0, x)):
                    return
            put((1, None))
        except BaseException as e:   # noqa: BLE001 - handed to the consumer
            put((2, e))
        finally:
            it.close()

    t = threading.Thread(target=run, name="gpusnap-read-ahead", daemon=True)
    t.start()
    try:
        while True:
            tag, x = q.get()
            if tag == 0:
                yield x
            elif tag == 1:
                return
            else:
                raise x
    finally:
        stop.set()
        t.join()


class Snapshot:
    def __init__(self, repo: Repository, path: Path):
        self.repo = repo
        self.path = Path(path)
        try:
            fd = fsutil.open_nofollow(self.path / "manifest", os.O_RDONLY)
            with os.fdopen(fd, "rb") as f:
                data = f.read((256 << 20) + 1)
        except FileNotFoundError:
            raise CorruptSnapshot(f"snapshot {self.path}: manifest missing",
                                  "the snapshot is incomplete or damaged; use another one") from None
        except OSError as e:
            raise CorruptSnapshot(f"snapshot {self.path}: cannot read manifest: {e}") from None
        try:
            self.manifest, self.id = parse_manifest(data)
        except FormatError as e:
            raise CorruptSnapshot(f"snapshot {self.path}: manifest damaged: {e}",
                                  "run gpusnap verify; restore an older snapshot") from None
        self.name = self.manifest["name"]
        self.created = float(self.manifest["created"])
        self._images = {im["name"]: im for im in self.manifest["images"]}
        self._image_no = {im["name"]: i for i, im in enumerate(self.manifest["images"])}
        self._loc_mutex = threading.Lock()
        self._loc = None                  # locations.Locations, False = not usable, None = not tried
        self.loc_reason: str | None = None

    def locations(self):
        """The snapshot's checked locations file (docs/format.md §5.4), or None when it is
        missing, damaged or stale (then reads go through the repository index)."""
        with self._loc_mutex:
            if self._loc is None:
                try:
                    loc = locations.Locations.open(self.path, locations.image_digests(self.manifest))
                    try:
                        loc.check_packs(self.repo.path)
                    except BaseException:
                        loc.close()
                        raise
                    self._loc = loc
                except locations.LocationsInvalid as e:
                    self._loc = False
                    self.loc_reason = str(e)
            return self._loc or None

    def __repr__(self):
        return f"<Snapshot {self.path.name} id={self.id}>"

    @property
    def meta(self) -> dict:
        return self.manifest["meta"]

    @property
    def stats(self) -> dict:
        return self.manifest["stats"]

    def image_names(self) -> list[str]:
        return list(self._images)

    def has_image(self, filename) -> bool:
        return filename in self._images

    def image(self, filename) -> dict:
        try:
            return self._images[filename]
        except KeyError:
            raise SnapshotNotFound(f"snapshot {self.path} has no image {filename}") from None

    def _corrupt(self, what: str, pack: bytes | None = None) -> CorruptSnapshot:
        where = f" (pack {pack_path(self.repo.path, pack)})" if pack else ""
        return CorruptSnapshot(f"snapshot {self.path} is damaged: {what}{where}",
                               "run gpusnap verify to see what is affected; restore another snapshot")

    # -- page lists ---------------------------------------------------------------------
    def _check_pagelist(self, im: dict) -> Path:
        p = self.path / im["pagelist"]
        h = blake3.blake3()
        n = 0
        try:
            with os.fdopen(fsutil.open_nofollow(p, os.O_RDONLY), "rb") as f:
                while True:
                    b = f.read(READ_CHUNK)
                    if not b:
                        break
                    h.update(b)
                    n += len(b)
        except OSError as e:
            raise self._corrupt(f"page list {im['pagelist']} of {im['name']} unreadable: {e}") from None
        if n != im["pagelist_size"] or h.hexdigest() != im["digest"]:
            raise self._corrupt(f"page list {im['pagelist']} of {im['name']} does not match its checksum")
        return p

    def iter_page_refs(self, filename) -> Iterator[tuple]:
        """("zero", n) / ("pages", ids bytes) / ("tail", len, blob id) after checking the page list."""
        im = self.image(filename)
        p = self._check_pagelist(im)
        with os.fdopen(fsutil.open_nofollow(p, os.O_RDONLY), "rb", buffering=READ_CHUNK) as f:
            try:
                yield from iter_pagelist(f.read, im["size"])
            except FormatError as e:
                raise self._corrupt(f"page list of {filename}: {e}") from None

    def referenced_ids(self) -> tuple[set, set]:
        """(page ids, data blob ids) this snapshot needs."""
        raw, data = self.referenced_page_bytes()
        return {raw[i:i + PAGE_ID_LEN] for i in range(0, len(raw), PAGE_ID_LEN)}, data

    def referenced_page_bytes(self) -> tuple[bytes, set]:
        """(the page ids of every page record, concatenated (16 bytes each, repeats kept),
        data blob ids): referenced_ids() without a Python object per page."""
        parts: list[bytes] = []
        data: set = set()
        for name, im in self._images.items():
            if im["type"] == "blob":
                data.update(bytes.fromhex(b) for b in im["blobs"])
                continue
            for rec in self.iter_page_refs(name):
                if rec[0] == "pages":
                    parts.append(rec[1])
                elif rec[0] == "tail":
                    data.add(rec[2])
        return b"".join(parts), data

    # -- structure check --------------------------------------------------------------
    def check_structure(self) -> None:
        """Cheap pre-restore check: page lists verify, every id is in the index, every pack
        it needs exists and is long enough. Raises CorruptSnapshot.

        With a usable locations file (checked when opened: checksum, images, packs present
        and long enough) only the page lists are checked here, in bounded memory; the rest
        goes through the repository index."""
        if self.locations() is not None:
            for im in self._images.values():
                if im["type"] == "pages":
                    self._check_pagelist(im)
            return
        idx = self.repo._load_index()
        pages, data = self.referenced_ids()
        need: dict[bytes, int] = {}
        missing = 0
        for pid in pages:
            loc = idx.page_loc.get(pid)
            if loc is None:
                missing += 1
                continue
            b = idx.blobs[loc >> 8]
            end = b.offset + BLOB_HEADER.size + b.stored_len + 16
            if need.get(b.pack, 0) < end:
                need[b.pack] = end
        for bid in data:
            bno = idx.data_loc.get(bid)
            if bno is None:
                missing += 1
                continue
            b = idx.blobs[bno]
            end = b.offset + BLOB_HEADER.size + b.stored_len + 16
            if need.get(b.pack, 0) < end:
                need[b.pack] = end
        if missing:
            extra = f"; damaged index files: {', '.join(sorted(idx.bad_files))}" if idx.bad_files else ""
            raise self._corrupt(f"{missing} pages/blobs are not in the repository index{extra}")
        for ph, end in need.items():
            pp = pack_path(self.repo.path, ph)
            try:
                size = os.stat(pp).st_size
            except FileNotFoundError:
                raise self._corrupt("pack missing", ph) from None
            if size < end:
                raise self._corrupt(f"pack truncated ({size} bytes, needs at least {end})", ph)

    # -- reading ----------------------------------------------------------------------------
    def read_image(self, filename) -> Iterator[bytes]:
        """The original bytes of an image, in chunks of at most 1 MiB; every page and blob is
        checked against its checksum before it is yielded."""
        im = self.image(filename)
        if im["type"] == "pages" and im.get("size", 0) >= PREFETCH_MIN:
            # Big pages image: build and check chunks one step ahead in a helper thread
            # (the checks run without the GIL) while the caller writes the previous one.
            yield from _prefetched(self._read_image(im))
        else:
            yield from self._read_image(im)

    def _read_image(self, im) -> Iterator[bytes]:
        loc = self.locations()
        if loc is not None:
            yield from locations.read_image(self, im, loc, self._image_no[im["name"]])
            return
        idx = self.repo._load_index()
        reader = BlobReader(self.repo.path, idx)
        try:
            if im["type"] == "blob":
                yield from self._read_blob_image(im, idx, reader)
            else:
                yield from self._read_pages_image(im, idx, reader)
        finally:
            reader.close()

    def _get_blob(self, reader, idx, bno, what):
        try:
            return reader.get(bno)
        except FileNotFoundError:
            raise self._corrupt(f"{what}: pack missing", idx.blobs[bno].pack) from None
        except (OSError, FormatError) as e:
            raise self._corrupt(f"{what}: {e}", idx.blobs[bno].pack) from None

    def _data_blob(self, bid: bytes, idx, reader, filename) -> bytes:
        bno = idx.data_loc.get(bid)
        if bno is None:
            raise self._corrupt(f"blob {bid.hex()[:16]} of {filename} is not in the repository index")
        data = self._get_blob(reader, idx, bno, f"blob of {filename}")
        if blake3.blake3(data).digest() != bid:
            raise self._corrupt(f"blob {bid.hex()[:16]} of {filename} fails its checksum", idx.blobs[bno].pack)
        return data

    def _read_blob_image(self, im, idx, reader):
        h = blake3.blake3()
        n = 0
        name = im["name"]
        for bh in im["blobs"]:
            data = self._data_blob(bytes.fromhex(bh), idx, reader, name)
            reader.cache.clear()       # data blobs are rarely shared inside one image
            n += len(data)
            if n > im["size"]:
                raise self._corrupt(f"image {name} longer than recorded")
            h.update(data)
            for o in range(0, len(data), READ_CHUNK):
                yield data[o:o + READ_CHUNK]
        if n != im["size"] or h.hexdigest() != im["digest"]:
            raise self._corrupt(f"image {name} does not match its recorded size/checksum")

    def _read_pages_image(self, im, idx, reader):
        """Pages are gathered into output chunks (slices of the decompressed groups, one
        copy) and each chunk's pages are checked against their ids in one native call
        (gpusnap/repo/native.py, GIL released); zero pages are produced here, not checked."""
        name = im["name"]
        page_loc = idx.page_loc
        verify = native.verify
        out: list = []
        outn = 0
        ids_parts: list[bytes] = []
        kinds = bytearray()
        has_data = False
        cur_bno = -1
        curv = None
        limit = READ_CHUNK
        for rec in self.iter_page_refs(name):
            kind = rec[0]
            if kind == "pages":
                ids = rec[1]
                n = len(ids) // PAGE_ID_LEN
                o = 0
                while o < n:
                    take = min((limit - outn) // PAGE_SIZE, n - o)
                    if take <= 0:          # (only after a tail, which is last anyway)
                        take = n - o
                    seg = ids[o * PAGE_ID_LEN:(o + take) * PAGE_ID_LEN]
                    ids_parts.append(seg)
                    kinds += _ONES[:take]
                    has_data = True
                    rs = re = -1
                    for p in range(0, take * PAGE_ID_LEN, PAGE_ID_LEN):
                        pid = seg[p:p + PAGE_ID_LEN]
                        loc = page_loc.get(pid)
                        if loc is None:
                            extra = f" (damaged index files: {', '.join(sorted(idx.bad_files))})" if idx.bad_files else ""
                            raise self._corrupt(f"page {pid.hex()} of {name} is not in the repository index{extra}")
                        bno = loc >> 8
                        s = (loc & 0xFF) * PAGE_SIZE
                        if bno == cur_bno and s == re:
                            re += PAGE_SIZE
                            continue
                        if re > rs:
                            out.append(curv[rs:re])
                        if bno != cur_bno:
                            curv = memoryview(self._get_blob(reader, idx, bno, f"pages of {name}"))
                            cur_bno = bno
                        rs, re = s, s + PAGE_SIZE
                    out.append(curv[rs:re])
                    outn += take * PAGE_SIZE
                    o += take
                    if outn >= limit:
                        yield self._finish_chunk(out, ids_parts, kinds, has_data, verify, idx, name)
                        out, outn, ids_parts, kinds, has_data = [], 0, [], bytearray(), False
            elif kind == "zero":
                left = rec[1] * PAGE_SIZE
                while left:
                    k = min(left, limit - outn)
                    if k <= 0:
                        k = left
                    out.append(_ZCHUNK if k == READ_CHUNK else _ZVIEW[:k])
                    ids_parts.append(_ZIDS[:k // PAGE_SIZE * PAGE_ID_LEN] if k <= READ_CHUNK else bytes(k // PAGE_SIZE * PAGE_ID_LEN))
                    kinds += _ZKINDS[:k // PAGE_SIZE] if k <= READ_CHUNK else bytes(k // PAGE_SIZE)
                    outn += k
                    left -= k
                    if outn >= limit:
                        yield self._finish_chunk(out, ids_parts, kinds, has_data, verify, idx, name)
                        out, outn, ids_parts, kinds, has_data = [], 0, [], bytearray(), False
            else:
                data = self._data_blob(rec[2], idx, reader, name)
                if len(data) != rec[1]:
                    raise self._corrupt(f"tail of {name} has the wrong length")
                out.append(data)
                outn += len(data)
        if out:
            yield self._finish_chunk(out, ids_parts, kinds, has_data, verify, idx, name)

    def _finish_chunk(self, out, ids_parts, kinds, has_data, verify, idx, name) -> bytes:
        data = out[0] if len(out) == 1 and type(out[0]) is bytes else b"".join(out)
        if has_data:
            ids = b"".join(ids_parts)
            bad = verify(data, len(kinds), ids, kinds)
            if bad >= 0:
                loc = idx.page_loc.get(ids[bad * PAGE_ID_LEN:(bad + 1) * PAGE_ID_LEN])
                pack = idx.blobs[loc >> 8].pack if loc is not None else None
                raise self._corrupt(f"a page of {name} fails its checksum", pack)
        return data
