"""Files the job had open that changed after the dump: checked, and output files fixed, before CRIU runs.

CRIU records the size of every regular file a process has open or mapped (except files opened
O_APPEND for writing, whose size gpusnap records itself at the freeze: `meta.append_files`,
gpusnap/system/appendfiles.py) and refuses to restore when the size differs ("File X has bad size").
A job started as `python train.py > train.log` keeps writing its log after the dump; when it
crashes later, the log is longer than the snapshot expects. Here, before CRIU runs:

- an output file (opened for writing) that grew: the bytes beyond the snapshot's size are moved
  into `<file>.gpusnap-<snapshot id>-after` next to it (fsynced first), the file is truncated
  back to the size the restored job expects, and the restore says so in one line;
- an output file that shrank, was rotated away (for appended files: another inode at that
  path) or vanished: refused, naming the file (the
  snapshot does not hold file contents, so what the job expects there cannot be rebuilt);
- an input file (opened read-only, or mapped: libraries, data) that changed size or vanished:
  refused, naming the file.

Nothing is changed unless every file passes; if the restore then fails, the moved bytes are
put back (undo). The entries come from CRIU's files.img (or reg-files.img of older CRIUs),
read at the wire level (criu/pbwire.py) instead of through pycriu (whose import alone costs 0.1 s).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpusnap.criu import pbwire
from gpusnap.errors import CorruptSnapshot, FilesChanged

O_ACCMODE = 0o3
O_WRONLY = 0o1
O_APPEND = 0o2000
FD_TYPE_REG = 1
REMAP_LINKED, REMAP_GHOST, REMAP_PROCFS = 0, 1, 2
COPY_CHUNK = 1 << 20
# kernel files that exist only while the job runs (e.g. its own /proc/PID/maps, which zdtm's
# maps09 keeps open): not files the job wrote or read in the sense checked here
PSEUDO_FS = ("/proc/", "/sys/")


@dataclass
class RegFile:
    id: int
    flags: int
    pos: int
    name: str
    size: int | None
    ext: bool = False

    @property
    def writable(self) -> bool:
        return self.flags & O_ACCMODE != 0


def _reg(msg: bytes) -> RegFile:
    d: dict = {}
    for num, v in pbwire.fields(msg):
        d[num] = v
    return RegFile(id=d.get(1, 0), flags=d.get(2, 0), pos=d.get(3, 0),
                   name=bytes(d.get(6, b"")).decode(errors="surrogateescape"),
                   size=d.get(8), ext=bool(d.get(9, 0)))


def reg_files(snap) -> list[RegFile]:
    """Every regular-file entry of the snapshot (files.img, or reg-files.img)."""
    out: list[RegFile] = []
    try:
        if snap.has_image("files.img"):
            for msg in pbwire.entries(b"".join(snap.read_image("files.img"))):
                typ = None
                reg = None
                for num, v in pbwire.fields(msg):
                    if num == 1:
                        typ = v
                    elif num == 3:
                        reg = v
                if typ == FD_TYPE_REG and reg is not None:
                    out.append(_reg(reg))
        if snap.has_image("reg-files.img"):
            out.extend(_reg(m) for m in pbwire.entries(b"".join(snap.read_image("reg-files.img"))))
    except ValueError as e:
        raise CorruptSnapshot(f"snapshot {snap.path} has an unreadable files image: {e}") from None
    return out


def _remapped_ids(snap) -> set[int]:
    """Files CRIU restores itself (deleted-but-open ghosts, linked remaps): not checked here."""
    ids: set[int] = set()
    if not snap.has_image("remap-fpath.img"):
        return ids
    try:
        for msg in pbwire.entries(b"".join(snap.read_image("remap-fpath.img"))):
            for num, v in pbwire.fields(msg):
                if num == 1:
                    ids.add(v)
    except ValueError as e:
        raise CorruptSnapshot(f"snapshot {snap.path} has an unreadable remap image: {e}") from None
    return ids


# -- checking and fixing -----------------------------------------------------------------------

@dataclass
class Moved:
    path: str
    after: str
    size: int           # the size the snapshot expects (the file was truncated to this)
    moved: int          # bytes moved into `after`


@dataclass
class FileFixes:
    moved: list[Moved] = field(default_factory=list)

    def notes(self) -> list[str]:
        return [f"{m.path} grew by {m.moved} bytes after the snapshot; those bytes are in {m.after}, "
                f"and {m.path} is back at the {m.size} bytes the restored job expects" for m in self.moved]

    def undo(self) -> None:
        """Put moved bytes back (the restore failed, nothing runs from these files)."""
        for m in reversed(self.moved):
            try:
                with open(m.after, "rb") as src, open(m.path, "r+b") as dst:
                    if os.fstat(dst.fileno()).st_size != m.size:
                        continue   # someone wrote meanwhile: keep both files as they are
                    dst.seek(m.size)
                    while True:
                        b = src.read(COPY_CHUNK)
                        if not b:
                            break
                        dst.write(b)
                    dst.flush()
                    os.fsync(dst.fileno())
                os.unlink(m.after)
            except OSError:
                pass
        self.moved.clear()


def _after_name(path: str, snap_id: str) -> str:
    base = f"{path}.gpusnap-{snap_id}-after"
    cand, n = base, 1
    while os.path.lexists(cand):
        cand = f"{base}.{n}"
        n += 1
    return cand


def _move_tail(path: str, size: int, snap_id: str) -> Moved:
    after = _after_name(path, snap_id)
    with open(path, "r+b") as f:
        st = os.fstat(f.fileno())
        fd = os.open(after, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     st.st_mode & 0o666)
        moved = 0
        try:
            with os.fdopen(fd, "wb") as out:
                f.seek(size)
                while True:          # until the end as it is now (a late writer's bytes too)
                    b = f.read(COPY_CHUNK)
                    if not b:
                        break
                    out.write(b)
                    moved += len(b)
                out.flush()
                os.fsync(out.fileno())
            try:
                os.chown(after, st.st_uid, st.st_gid)
            except OSError:
                pass
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            os.unlink(after)
            raise
    return Moved(path=path, after=after, size=size, moved=moved)


def _append_files(snap) -> list[dict]:
    """`meta.append_files`: the files the job appended to, with their size at the freeze."""
    meta = snap.manifest.get("meta") or {}
    raw = meta.get("append_files")
    if raw is None:
        return []
    ok = isinstance(raw, list) and all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and e["path"].startswith("/")
        and all(isinstance(e.get(k), int) and not isinstance(e.get(k), bool) and e[k] >= 0
                for k in ("size", "dev", "ino")) for e in raw)
    if not ok:
        raise CorruptSnapshot(f"snapshot {snap.path} has a malformed meta.append_files")
    return [e for e in raw if not e["path"].startswith(PSEUDO_FS)]


def _same_file(st: os.stat_result, e: dict, same_host: bool) -> bool:
    # st_dev numbers are per machine (an NFS mount's differs from node to node): on another
    # host only the inode number can tell the file the job wrote from a rotated one
    return st.st_ino == e["ino"] and (st.st_dev == e["dev"] or not same_host)


def prepare(snap, inherited=frozenset()) -> FileFixes:
    """Check every file the snapshot had open against what CRIU will expect; refuse
    (FilesChanged, naming each file) or fix output files that grew. Returns what was fixed.
    `inherited`: paths CRIU gets as open descriptors (a fork's own files): left alone."""
    skip = _remapped_ids(snap)
    problems: list[str] = []
    grown: list[tuple[str, int]] = []
    files: dict[str, list] = {}          # path -> [size CRIU expects, written by any of its fds]
    for rf in reg_files(snap):
        if rf.size is None or rf.ext or rf.id in skip or not rf.name.startswith("/"):
            continue
        if rf.name.startswith(PSEUDO_FS):   # /proc/PID/... of the job itself: CRIU reopens them
            continue
        f = files.setdefault(rf.name, [rf.size, False])
        f[1] = f[1] or rf.writable
    meta = snap.manifest.get("meta") or {}
    same_host = meta.get("hostname") in (None, os.uname().nodename)
    appended: dict[str, dict] = {}
    for e in _append_files(snap):
        appended[e["path"]] = e
        files.setdefault(e["path"], [e["size"], True])[1] = True
    for name, (size, writable) in files.items():
        if name in inherited:
            continue
        kind = "output file" if writable else "input file"
        try:
            st = os.stat(name)
        except FileNotFoundError:
            problems.append(f"{kind} {name} is gone (the snapshot expects {size} bytes there)")
            continue
        except OSError as e:
            problems.append(f"{kind} {name} cannot be checked: {e.strerror}")
            continue
        if name in appended and not _same_file(st, appended[name], same_host):
            problems.append(f"output file {name} was rotated or replaced since the snapshot (another file "
                            "is at that path now); the snapshot does not hold its contents")
            continue
        if st.st_size == size:
            continue
        if writable and st.st_size > size:
            grown.append((name, size))
        elif writable:
            problems.append(f"output file {name} shrank or was replaced since the snapshot "
                            f"({st.st_size} bytes now, the snapshot expects {size}); the snapshot does "
                            "not hold its contents")
        else:
            problems.append(f"input file {name} changed since the snapshot ({st.st_size} bytes now, "
                            f"{size} then)")
    if problems:
        raise FilesChanged(
            "files the job had open changed since the snapshot: " + "; ".join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""),
            hint="put the named files back as they were when the snapshot was taken (e.g. the rotated or "
                 "older copy), then restore again; nothing was changed or restored")
    fixes = FileFixes()
    try:
        for path, size in grown:
            fixes.moved.append(_move_tail(path, size, snap.id))
    except OSError as e:
        fixes.undo()
        raise FilesChanged(f"cannot set aside what was written to {path} after the snapshot: {e}",
                           hint="free some space next to the file, or move its end away by hand") from None
    return fixes
