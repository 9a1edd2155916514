"""Snapshot: one committed snapshot of a repository: its manifest, page lists and the
locations its reads follow (docs/format.md §5)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterator

import blake3

from gpusnap.errors import CorruptSnapshot, SnapshotNotFound
from gpusnap.repo import fsutil, locations, reader
from gpusnap.repo.format import READ_CHUNK, FormatError, iter_pagelist, parse_manifest
from gpusnap.repo.format.locations import Locations, LocationsInvalid, image_digests
from gpusnap.repo.store import pack_path


class Snapshot:
    def __init__(self, repo, path: Path):
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
        self._loc = None                  # Locations, False = not usable, None = not tried
        self._built = None                # the one built from the index (reading_locations)
        self.loc_reason: str | None = None

    def locations(self):
        """The snapshot's checked locations file (docs/format.md §5.4), or None when it is
        missing, damaged or stale (loc_reason says why; reading_locations() then builds one
        from the repository index)."""
        with self._loc_mutex:
            if self._loc is None:
                try:
                    loc = Locations.open(self.path, image_digests(self.manifest))
                    try:
                        locations.check_packs(loc, self.repo.path)
                    except BaseException:
                        loc.close()
                        raise
                    self._loc = loc
                except LocationsInvalid as e:
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

    def image_no(self, filename) -> int:
        """The image's place in the manifest (and in the locations file)."""
        self.image(filename)
        return self._image_no[filename]

    def image(self, filename) -> dict:
        try:
            return self._images[filename]
        except KeyError:
            raise SnapshotNotFound(f"snapshot {self.path} has no image {filename}") from None

    def corrupt(self, what: str, pack: bytes | None = None) -> CorruptSnapshot:
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
            raise self.corrupt(f"page list {im['pagelist']} of {im['name']} unreadable: {e}") from None
        if n != im["pagelist_size"] or h.hexdigest() != im["digest"]:
            raise self.corrupt(f"page list {im['pagelist']} of {im['name']} does not match its checksum")
        return p

    def pagelist_bytes(self, filename) -> bytes:
        """The page list of a pages image, checked against the manifest (for export)."""
        im = self.image(filename)
        try:
            with os.fdopen(fsutil.open_nofollow(self.path / im["pagelist"], os.O_RDONLY), "rb") as f:
                data = f.read(im["pagelist_size"] + 1)
        except OSError as e:
            raise self.corrupt(f"page list {im['pagelist']} of {filename} unreadable: {e}") from None
        if len(data) != im["pagelist_size"] or blake3.blake3(data).hexdigest() != im["digest"]:
            raise self.corrupt(f"page list {im['pagelist']} of {filename} does not match its checksum")
        return data

    def iter_page_refs(self, filename) -> Iterator[tuple]:
        """("zero", n) / ("pages", ids bytes) / ("tail", len, blob id) after checking the page list."""
        im = self.image(filename)
        p = self._check_pagelist(im)
        with os.fdopen(fsutil.open_nofollow(p, os.O_RDONLY), "rb", buffering=READ_CHUNK) as f:
            try:
                yield from iter_pagelist(f.read, im["size"])
            except FormatError as e:
                raise self.corrupt(f"page list of {filename}: {e}") from None

    def referenced_page_bytes(self) -> tuple[bytes, set]:
        """(the page ids of every page record, concatenated (16 bytes each, repeats kept),
        data blob ids): no Python object per page."""
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

    # -- the runs readers follow ----------------------------------------------------------
    def reading_locations(self) -> "Locations":
        """The locations every read follows: the snapshot's file when usable, else one built
        in memory from the repository index (for a snapshot older than the file, or one whose
        file is damaged or stale). Raises CorruptSnapshot when the index lacks data it needs
        or a pack it names is missing or short."""
        loc = self.locations()
        if loc is not None:
            return loc
        with self._loc_mutex:
            if self._built is None:
                idx = self.repo.index()
                try:
                    data = locations.build(self.path, self.manifest["images"], locations.index_resolver(idx))
                except locations.MissingData as e:
                    extra = f"; damaged index files: {', '.join(sorted(idx.bad_files))}" if idx.bad_files else ""
                    raise self.corrupt(f"pages/blobs are not in the repository index ({e}){extra}") from None
                except FormatError as e:
                    raise self.corrupt(f"page list: {e}") from None
                except OSError as e:
                    raise self.corrupt(f"page list unreadable: {e}") from None
                try:
                    built = Locations.from_bytes(data, image_digests(self.manifest))
                except LocationsInvalid as e:      # (a bug: build() wrote it)
                    raise self.corrupt(f"locations built from the index unusable: {e}") from None
                for ph, end in built.iter_packs():
                    try:
                        size = os.stat(pack_path(self.repo.path, ph)).st_size
                    except FileNotFoundError:
                        raise self.corrupt("pack missing", ph) from None
                    if size < end:
                        raise self.corrupt(f"pack truncated ({size} bytes, needs at least {end})", ph)
                self._built = built
            return self._built

    def check_structure(self) -> None:
        """Cheap pre-restore check: page lists verify, every id has a location, every pack
        needed exists and is long enough. Raises CorruptSnapshot. With a usable locations
        file (checked when opened) nothing but the page lists is read, in bounded memory."""
        for im in self._images.values():
            if im["type"] == "pages":
                self._check_pagelist(im)
        self.reading_locations()

    # -- reading ----------------------------------------------------------------------------
    def page_jobs(self) -> "PageJobs":
        """Its pages images as jobs to read in any order (the lazy restore's fill)."""
        return PageJobs(self)

    def read_image(self, filename, drop: list | None = None) -> Iterator:
        """The original bytes of an image, in chunks of at most 1 MiB (repo/reader.py); every
        page and blob is checked against its checksum before it is yielded. drop: zero-page
        runs to leave out of a pages image (criu/sparse.py)."""
        im = self.image(filename)
        yield from reader.read_image(self, im, self.reading_locations(), self._image_no[filename], drop)


class PageJobs:
    """A snapshot's pages images as jobs read in any order, by any thread (the lazy restore's
    fill, criu/lazypages.py): the jobs of an image, a reader per thread, one job built and
    checked. One set of locations for all of them."""

    def __init__(self, snap):
        self.snap = snap
        self.loc = snap.reading_locations()

    def jobs(self, name: str, job_bytes: int, drop: list | None = None) -> Iterator["reader.Job"]:
        return reader.plan(self.snap, name, self.loc, self.snap.image_no(name), job_bytes, drop)

    def open_reader(self) -> "reader.RunReader":
        return reader.RunReader(self.snap.repo.path, self.loc)

    def build(self, name: str, job: "reader.Job", rd: "reader.RunReader") -> bytearray | None:
        return reader.assemble(self.snap, name, job, rd)
