"""A container engine's checkpoint archive (an uncompressed tar) stored in a snapshot, and
written out again with the same members and contents (docs/format.md §12).

Each regular file of the archive becomes one image of the snapshot: the CRIU images under
`checkpoint/` keep their names, so pages images go through the page pipeline and deduplicate
against every other snapshot (a container's memory, dumped again, costs only what changed);
any other file is stored as `archive.<path, '/' as '%'>`. The order, the directories and
every member's header fields are kept in one more image, `archive.layout.json`, from which
the archive is rebuilt. Nothing read from an archive or a layout is trusted: member names
are checked like any image name, and a layout that names an image the snapshot lacks, or a
size that does not match it, is a damaged snapshot.

Docker's checkpoint is a directory, not an archive: store_dir() keeps it as the archive a tar
of it under `checkpoint/` would be (the same images, the same layout), and write_dir() makes
the directory again from such a snapshot, so both engines share one format.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import tarfile
from pathlib import Path
from typing import BinaryIO, Callable

from gpusnap.errors import CorruptSnapshot, RepositoryError
from gpusnap.repo.format.names import image_name_problem

LAYOUT = "archive.layout.json"
CHUNK = 1 << 20
_KINDS = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink"}


def image_name(path: str) -> str:
    """The image that holds archive member `path`."""
    parts = path.strip("/").split("/")
    if len(parts) == 2 and parts[0] == "checkpoint" and not parts[1].startswith("archive."):
        return parts[1]
    return "archive." + path.strip("/").replace("%", "%25").replace("/", "%")


def store(writer, f: BinaryIO, progress: Callable[[int], None] | None = None) -> dict:
    """Read the tar stream `f` to its end into `writer` (a SnapshotWriter): one image per
    regular file, then the layout. Returns {"members", "bytes"}."""
    try:
        tar = tarfile.open(fileobj=f, mode="r|")
    except tarfile.TarError as e:
        raise RepositoryError(f"the container archive is no tar stream: {e}") from None
    with tar:
        return _store_members(writer, ((_entry(m), (lambda m=m: tar.extractfile(m))) for m in tar), progress)


def store_dir(writer, directory: Path, progress: Callable[[int], None] | None = None) -> dict:
    """A checkpoint directory of CRIU's images (Docker's) stored as the archive it would be as a
    tar of `checkpoint/`: the same images and layout as Podman's (§12), so one format and one
    restore path hold both. Only regular files directly in it are kept."""
    def members():
        st = os.stat(directory)
        yield _entry(_info("checkpoint", tarfile.DIRTYPE, st)), None
        for name in sorted(os.listdir(directory)):
            fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as src:
                st = os.fstat(src.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise RepositoryError(f"the checkpoint directory holds {name!r}, which is no regular file")
                ti = _info(f"checkpoint/{name}", tarfile.REGTYPE, st)
                yield _entry(ti), (lambda src=src: src)

    return _store_members(writer, members(), progress)


def _info(path: str, kind: bytes, st: os.stat_result) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(path)
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime)
    ti.size = st.st_size if kind == tarfile.REGTYPE else 0
    ti.uname, ti.gname = _user_name(st.st_uid), _group_name(st.st_gid)
    return ti


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return ""


def _entry(m: tarfile.TarInfo) -> dict:
    kind = _KINDS.get(m.type)
    if kind is None:
        raise RepositoryError(f"the container archive holds {m.name!r} of a kind gpusnap does not keep")
    entry = {"path": m.name, "kind": kind, "mode": m.mode, "uid": m.uid, "gid": m.gid,
             "uname": m.uname, "gname": m.gname, "mtime": int(m.mtime)}
    if kind == "symlink":
        entry["link"] = m.linkname
    if kind == "file":
        name = image_name(m.name)
        if image_name_problem(name):
            raise RepositoryError(f"the container archive holds an unusable name {m.name!r}")
        entry.update(image=name, size=m.size)
    return entry


def _store_members(writer, members, progress) -> dict:
    """Each (layout entry, opener of its bytes) in order: a file's bytes into its image, then
    the layout. A file's bytes are read while its member is current (a tar stream moves on)."""
    layout, total = [], 0
    for entry, opener in members:
        if entry["kind"] == "file":
            sink, src, n = writer.image_sink(entry["image"]), opener(), 0
            while chunk := src.read(CHUNK):
                sink.write(chunk)
                n += len(chunk)
                total += len(chunk)
                if progress:
                    progress(total)
            sink.close()
            if n != entry["size"]:
                raise RepositoryError(f"{entry['path']} changed size while it was stored")
        layout.append(entry)
    sink = writer.image_sink(LAYOUT)
    sink.write(json.dumps({"version": 1, "members": layout}, separators=(",", ":")).encode())
    sink.close()
    return {"members": len(layout), "bytes": total}


def layout(snap) -> list[dict]:
    """The archive's members, checked against the snapshot's images."""
    def bad(why: str) -> CorruptSnapshot:
        return CorruptSnapshot(f"snapshot {snap.path} has a damaged container archive layout: {why}")

    if not snap.has_image(LAYOUT):
        raise bad(f"no {LAYOUT}")
    try:
        doc = json.loads(b"".join(snap.read_image(LAYOUT)))
        members = doc["members"]
        assert doc.get("version") == 1 and isinstance(members, list)
    except (ValueError, KeyError, AssertionError, TypeError):
        raise bad("not the JSON it should be") from None
    for e in members:
        if not isinstance(e, dict) or e.get("kind") not in ("file", "dir", "symlink") or not isinstance(e.get("path"), str):
            raise bad("a member without a kind or a path")
        if e["kind"] == "file" and (not isinstance(e.get("image"), str) or not snap.has_image(e["image"])
                                    or snap.image(e["image"])["size"] != e.get("size")):
            raise bad(f"member {e['path']!r} names no image of its size")
    return members


def write(snap, f: BinaryIO) -> int:
    """The archive rebuilt into `f` (every page checked on the way, as any read); its bytes."""
    out = 0
    with tarfile.open(fileobj=f, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for e in layout(snap):
            ti = tarfile.TarInfo(e["path"])
            ti.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE}[e["kind"]]
            ti.mode, ti.uid, ti.gid = int(e["mode"]) & 0o7777, int(e["uid"]), int(e["gid"])
            ti.uname, ti.gname, ti.mtime = str(e.get("uname") or ""), str(e.get("gname") or ""), int(e["mtime"])
            if e["kind"] == "symlink":
                ti.linkname = str(e["link"])
            if e["kind"] != "file":
                tar.addfile(ti)
                continue
            ti.size = int(e["size"])
            tar.addfile(ti, _Reader(snap.read_image(e["image"])))
            out += ti.size
    return out


def write_dir(snap, directory: Path) -> int:
    """A checkpoint directory rebuilt from the snapshot (Docker's, which takes no archive): the
    archive must be exactly `checkpoint/` and files directly in it, which go into `directory`
    (made here, private, and not there before). Returns the bytes written."""
    members = layout(snap)
    if not members or members[0]["path"].rstrip("/") != "checkpoint" or members[0]["kind"] != "dir" or any(
            e["kind"] != "file" or e["image"] != image_name(e["path"])
            or e["image"] != e["path"].partition("/")[2]
            or "/" in e["image"] or image_name_problem(e["image"]) for e in members[1:]):
        raise CorruptSnapshot(f"snapshot {snap.path} holds no checkpoint directory (a Docker checkpoint is "
                              "`checkpoint/` and CRIU's images in it, nothing else)")
    os.mkdir(directory, 0o700)
    out = 0
    for e in members[1:]:
        fd = os.open(directory / e["image"], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     int(e["mode"]) & 0o777)
        with os.fdopen(fd, "wb") as f:
            for chunk in snap.read_image(e["image"]):
                f.write(chunk)
            os.fchmod(f.fileno(), int(e["mode"]) & 0o777)     # (the umask narrowed it)
        out += int(e["size"])
    return out


class _Reader:
    """A file object over an image's chunks, for tarfile.addfile (which reads it in small
    pieces: a chunk is sliced through a memoryview, never copied whole per read)."""

    def __init__(self, chunks):
        self._it, self._cur, self._pos = iter(chunks), memoryview(b""), 0

    def read(self, n: int = -1) -> bytes:
        parts, want = [], n
        while want != 0:
            if self._pos >= len(self._cur):
                nxt = next(self._it, None)
                if nxt is None:
                    break
                self._cur, self._pos = memoryview(nxt).cast("B"), 0
                continue
            end = len(self._cur) if want < 0 else min(len(self._cur), self._pos + want)
            parts.append(self._cur[self._pos:end])
            if want > 0:
                want -= end - self._pos
            self._pos = end
        return b"".join(parts)
