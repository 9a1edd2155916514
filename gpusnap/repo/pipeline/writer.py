"""SnapshotWriter: one dump in progress: its sinks (repo/pipeline/sinks.py), its pack
writer, and the commit that makes the snapshot durable and visible in a fixed order
(docs/format.md §5.3), or the abort that removes only what nothing names."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import time
from pathlib import Path

from gpusnap.errors import GpusnapError, NoSpace, RepositoryError
from gpusnap.repo import fsutil, locations
from gpusnap.repo.codec import codec_name
from gpusnap.system.faults import fault
from gpusnap.system import interrupt
from gpusnap.repo.format import FORMAT_VERSION, encode_manifest
from gpusnap.repo.index import named_packs, write_index_file
from gpusnap.repo.pipeline import pagetable
from gpusnap.repo.pipeline.packwriter import PackWriter
from gpusnap.repo.store import pack_path
from gpusnap.repo.format.names import is_pages_image
from gpusnap.repo.pipeline.datasink import DataSink
from gpusnap.repo.pipeline.sinks import GROUP_PAGES, Counters, ImageSink, PagesSink

__all__ = ["SnapshotWriter"]


class SnapshotWriter:
    """One dump in progress. image_sink() may be called from many threads at once."""

    def __init__(self, repo, name: str, codec: int, meta: dict | None, group_pages: int = GROUP_PAGES,
                 pack_target: int | None = None):
        self.repo = repo
        self.name = name
        self.codec = codec
        self.meta = dict(meta or {})
        self.group_pages = group_pages
        self.created = time.time()
        # The repository's index (records whose pack is missing or short left out: never
        # dedup against them) loads in a thread, overlapping the dump's own setup; the
        # first use waits for it (wait_index(): dump.py waits before CRIU starts).
        self._index = None
        self._index_error: BaseException | None = None
        self._index_thread = threading.Thread(target=self._load_index, name="gpusnap-index", daemon=True)
        self._index_thread.start()
        self.claimed_pages = pagetable.PageTable()
        self.claimed_data: dict = {}
        root = repo.path
        self.tmpdir = root / "snapshots" / f".tmp-{name}-{os.getpid()}-{int(self.created * 1e6)}-{os.urandom(4).hex()}"
        fsutil.mkdir_private(self.tmpdir)
        self.packer = PackWriter(root, **({"target_size": pack_target} if pack_target else {}))
        self.lock = threading.Lock()
        self.sinks: list[ImageSink] = []
        self.images: dict[str, dict] = {}
        self.image_counters: list[Counters] = []
        self.stats: dict = {}
        self.state = "open"
        self._index_dest: Path | None = None   # the dump's index file, once its name is known
        self._indexed: set[bytes] = set()      # packs an index file of checkpoint() names
        self._checkpoint_bytes = 0
        fault("writer:open")

    def _load_index(self) -> None:
        try:
            idx = self.repo.index(check_packs=True)
            idx.page_table()
            self._index = idx
        except BaseException as e:        # raised by wait_index() in the thread that needs it
            self._index_error = e

    def wait_index(self):
        """The index this dump deduplicates against, once loaded (raises what the load raised)."""
        if self._index is None:
            self._index_thread.join()
            if self._index_error is not None:
                raise self._index_error
        return self._index

    @property
    def index(self):
        """The RepoIndex the dump started with (for the locations file at commit, locations.py)."""
        return self._index if self._index is not None else self.wait_index()

    @property
    def known_pages(self):
        return self.index.page_table()

    @property
    def known_data(self) -> dict:
        return self.index.data_loc

    def image_sink(self, filename: str) -> ImageSink:
        with self.lock:
            if self.state != "open":
                raise RepositoryError(f"snapshot writer is {self.state}")
            if filename in self.images or any(s.filename == filename for s in self.sinks):
                raise RepositoryError(f"image {filename} written twice in one snapshot")
            no = len(self.sinks)
            cls = PagesSink if is_pages_image(filename) else DataSink
            s = cls(self, filename, no)
            self.sinks.append(s)
            return s

    def checkpoint(self) -> int:
        """Name the packs finished so far in an index file of their own, so that they outlive
        an interruption (a copy resumes without sending them again, ops/serve.py): their
        directories fsynced first, then the index written as at a commit (docs/format.md
        §5.3 steps 1-2, §13). From then on abort() keeps them, like any data an index names
        that no snapshot uses yet. -> how many packs it named."""
        if len(self.packer.done) == len(self._indexed):     # (called per frame: the cheap case first)
            return 0
        new = [p for p in self.packer.finished() if p[0] not in self._indexed]
        if not new:
            return 0
        root = self.repo.path
        for d in sorted({pack_path(root, ph).parent for ph, _ in new}) + [root / "packs"]:
            fsutil.fsync_dir(d)
        res = write_index_file(root, new)
        self._indexed.update(ph for ph, _ in new)
        self._checkpoint_bytes += res[1]
        fault("writer:checkpoint")
        return len(new)

    def _image_done(self, sink: ImageSink, entry: dict) -> None:
        with self.lock:
            self.images[sink.filename] = entry

    def _totals(self) -> Counters:
        t = Counters()
        for s in self.sinks:
            for k in t.__slots__:
                setattr(t, k, getattr(t, k) + getattr(s.c, k))
        return t

    def commit(self, extra_meta: dict | None = None):
        """Make the snapshot durable and visible, in this order (docs/format.md §5.3):
          1. packs: each fsynced and renamed into packs/ab/ as it fills; here the last one,
             then the directories that received packs are fsynced;
          2. the dump's index file: temp, fsync, rename into index/, fsync index/ -- from
             here on the packs are named and stay, whatever happens next;
          3. locations, manifest (page lists were fsynced as their images closed) in
             snapshots/.tmp-*/, fsync of that directory;
          4. rename .tmp-* to snapshots/<dir>, fsync snapshots/: the commit point.
        Whatever stops it (an exception, a signal, a full disk) before step 4 leaves no
        snapshot, and _abort() removes only what nothing names."""
        with self.lock:
            if self.state != "open":
                raise RepositoryError(f"snapshot writer is {self.state}")
            self.state = "committing"
        try:
            fault("commit:start")
            interrupt.check()       # a signal whose exception a finalizer swallowed
            bad = [s.filename for s in self.sinks if not s.closed or s.failed]
            if bad:
                raise RepositoryError(f"cannot commit: images not completed: {', '.join(sorted(bad))}")
            root = self.repo.path
            packs = self.packer.finish()
            fault("commit:packs-durable")
            self.repo.check_lock()    # a stall past the lock's staleness: a prune may have run
            ires = write_index_file(root, [p for p in packs if p[0] not in self._indexed],
                                    on_name=self._set_index_dest)
            index_bytes = (ires[1] if ires else 0) + self._checkpoint_bytes
            fault("commit:index-renamed")
            # -- locations hook (gpusnap/repo/locations.py, docs/format.md §5.4) --
            loc_bytes = locations.write_at_commit(self, packs)
            fault("commit:locations-written")
            t = self._totals()
            if extra_meta:
                self.meta.update(extra_meta)
            pl_bytes = sum(e.get("pagelist_size", 0) for e in self.images.values())
            stats = t.as_dict()
            stats["bytes_packs"] = self.packer.bytes_written
            stats["bytes_index"] = index_bytes
            stats["bytes_locations"] = loc_bytes
            stats["packs_new"] = len(packs)
            body = {
                "format": "gpusnap-snapshot", "version": FORMAT_VERSION,
                "repo_id": self.repo.config["id"], "name": self.name, "created": self.created,
                "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
                "compress": codec_name(self.codec), "group_pages": self.group_pages,
                "meta": self.meta,
                "images": [self.images[k] for k in sorted(self.images)],
                "stats": stats,
            }
            # bytes_stored counts what this dump added: packs, index, page lists, manifest.
            data, _ = encode_manifest(body)
            stats["bytes_stored"] = 0
            for _ in range(3):   # the number's own digits change the manifest size: iterate to a fixed point
                total = self.packer.bytes_written + index_bytes + loc_bytes + pl_bytes + len(data)
                if stats["bytes_stored"] == total:
                    break
                stats["bytes_stored"] = total
                data, _ = encode_manifest(body)
            fsutil.write_private(self.tmpdir / "manifest", data)
            fsutil.fsync_dir(self.tmpdir)
            fault("commit:manifest-written")
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.created))
            snaps = root / "snapshots"
            self.stats = dict(stats)
            dest = self._rename_into(snaps, f"{self.name}-{stamp}")
            self.state = "committed"      # (a signal just before this line: _abort() is harmless)
            fault("commit:snapshot-renamed")
            fsutil.fsync_dir(snaps)
            fault("commit:done")
            return self.repo.snapshot_at(dest)
        except BaseException as e:
            if self.state != "committed":
                self._abort()
            if isinstance(e, OSError) and e.errno == 28:
                raise NoSpace(f"repository {self.repo.path} is full: {e}",
                              "free space or prune old snapshots (gpusnap prune --keep-last N)") from e
            if isinstance(e, OSError):
                raise RepositoryError(f"writing snapshot failed: {e}") from e
            raise

    def _rename_into(self, snaps: Path, base: str) -> Path:
        """Rename the .tmp- directory to snapshots/<base>, or <base>-2, -3, … when that
        name is taken (same name, same second), race-free among writers: rename(2) onto a
        directory that is not empty fails (a committed snapshot is never empty), so of two
        writers that pick one name, one gets it and the other tries the next."""
        k = 1
        while True:
            dest = snaps / (base if k == 1 else f"{base}-{k}")
            if not os.path.lexists(dest):
                try:
                    os.rename(self.tmpdir, dest)
                    return dest
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
            k += 1

    def _set_index_dest(self, dest: Path) -> None:
        self._index_dest = dest

    def abort(self) -> None:
        with self.lock:
            if self.state in ("committed", "aborted"):
                return
            self.state = "aborting"
        self._abort()

    def _abort(self) -> None:
        """Remove what nothing names, nothing else (docs/format.md §5.3, recovery rules):
        the snapshot's .tmp- directory (unless the commit's rename already made it a
        snapshot), temporary pack files, and the packs this dump created only while no
        index file names them. Whether the index got into index/ is read from the
        directory, not from a flag, so a signal between the rename and any bookkeeping
        cannot make it wrong (index file names are their content's checksum: another
        writer's index of the same packs has the same name and counts as naming them)."""
        fault("abort:start")
        for s in self.sinks:
            if isinstance(s, PagesSink):
                s._abort()
        named = self._index_dest is not None and os.path.lexists(self._index_dest)
        if not named and self.packer.done:
            # another writer's index may name a pack of the same name (the same pages, dumped
            # at once): packs are deleted only while no other writer runs, and only those no
            # index names; otherwise they stay for prune (docs/format.md §5.3)
            with contextlib.suppress(GpusnapError, OSError), self.repo.alone() as alone:
                if alone:
                    keep = frozenset(self._indexed) | named_packs(self.repo.path)
                    self.packer.abort(delete_finished=True, keep=keep)
        self.packer.abort(delete_finished=False)
        fault("abort:packs-done")
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.state = "aborted"
