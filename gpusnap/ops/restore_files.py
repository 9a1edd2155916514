"""Files the job had open that changed after the dump: checked, and output files fixed, before CRIU runs.

CRIU records the size of every regular file a process has open or mapped (except files opened
O_APPEND for writing, whose size gpusnap records itself at the freeze: `meta.append_files`,
gpusnap/system/appendfiles.py) and refuses to restore when the size differs ("File X has bad size").
A job started as `python train.py > train.log` keeps writing its log after the dump; when it
crashes later, the log is longer than the snapshot expects. Here, before CRIU runs:

- an output file (opened for writing) that grew and that no live process has open or mapped
  (by device and inode, gpusnap/system/fileusers.py): the bytes beyond the snapshot's size are
  moved into `<file>.gpusnap-<snapshot id>-after` next to it (fsynced first), the file is
  truncated back to the size the restored job expects, and the restore says so in one line.
  This is done as the file's owner, through descriptors (gpusnap/system/ownerfs.py): the file's
  directory may be the owner's, and any name in it a link swapped in while gpusnap works;
- such a file that another live process uses: an appended one (CRIU checks no size) is left as
  it is (the restored job appends after the other writer's lines; one line says so); any other
  is refused, naming the file and the process (its data would be cut);
- an output file that shrank, was rotated away (for appended files: another inode at that
  path) or vanished: refused, naming the file (the
  snapshot does not hold file contents, so what the job expects there cannot be rebuilt);
- an input file (opened read-only, or mapped: libraries, data) that changed size or vanished:
  refused, naming the file.

`check` decides all of this once; `prepare` (restore) acts on it and `inspect` reports it
(gpusnap/ops/inspect.py), so the two always agree.
Nothing is changed unless every file passes; if the restore then fails, the moved bytes are
put back (undo). The entries come from CRIU's files.img (or reg-files.img of older CRIUs),
read at the wire level (criu/images.py) instead of through pycriu (whose import alone costs 0.1 s).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from gpusnap.criu import images
from gpusnap.errors import CorruptSnapshot, FilesChanged
from gpusnap.system import fileusers, ownerfs

O_ACCMODE = 0o3
O_WRONLY = 0o1
O_APPEND = 0o2000
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
    mode: int | None = None     # st_mode at the dump: CRIU refuses a file whose mode differs

    @property
    def writable(self) -> bool:
        return self.flags & O_ACCMODE != 0


def reg_files(snap) -> list[RegFile]:
    """Every regular-file entry of the snapshot (files.img, or reg-files.img)."""
    try:
        return [RegFile(**d) for d in images.reg_files(snap)]
    except ValueError as e:
        raise CorruptSnapshot(f"snapshot {snap.path} has an unreadable files image: {e}") from None


def _remapped_ids(snap) -> set[int]:
    """Files CRIU restores itself (deleted-but-open ghosts, linked remaps): not checked here."""
    try:
        return images.remapped_ids(snap)
    except ValueError as e:
        raise CorruptSnapshot(f"snapshot {snap.path} has an unreadable remap image: {e}") from None


# -- fixing, as the file's owner and through descriptors (gpusnap/system/ownerfs.py) -------------

@dataclass
class Moved:
    path: str
    after: str
    size: int           # the size the snapshot expects (the file was truncated to this)
    moved: int          # bytes moved into `after`
    ident: tuple[int, int] = (0, 0)         # (dev, ino) of the file
    after_ident: tuple[int, int] = (0, 0)   # (dev, ino) of `after`, created by gpusnap
    owner: tuple[int, int] = (0, 0)         # (uid, gid) it was done as


@dataclass
class FileFixes:
    moved: list[Moved] = field(default_factory=list)
    left: list[str] = field(default_factory=list)   # notes on shared appended files left as they are

    def notes(self) -> list[str]:
        return [f"{m.path} grew by {m.moved} bytes after the snapshot; those bytes are in {m.after}, "
                f"and {m.path} is back at the {m.size} bytes the restored job expects" for m in self.moved] \
            + self.left

    def undo(self) -> None:
        """Put moved bytes back (the restore failed, nothing runs from these files), as each
        file's owner; a file or `after` that is not the one gpusnap made is left alone."""
        for m in reversed(self.moved):
            try:
                ownerfs.as_owner(m.owner[0], m.owner[1], _put_back, m.path, os.path.basename(m.after), m.size,
                                 list(m.ident), list(m.after_ident))
            except OSError:
                pass
        self.moved.clear()


def _pwrite_all(fd: int, b: bytes, off: int) -> None:
    view = memoryview(b)
    while view:                      # (a short write, e.g. at a full disk, raises on the next call)
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def _move_tail(path: str, size: int, snap_id: str, ident: list[int]) -> list:
    """(runs as the file's owner) The bytes of `path` beyond `size` into a new file next to it,
    then `path` cut back to `size`. Returns [after name, bytes moved, after's dev, ino]."""
    dfd, name = ownerfs.open_parent(path)
    try:
        fd, st = ownerfs.open_checked(dfd, name, os.O_RDWR, ident[0], ident[1])
        try:
            ofd, after = ownerfs.create_numbered(dfd, f"{name}.gpusnap-{snap_id}-after", st.st_mode & 0o666)
            ost = os.fstat(ofd)
            try:
                try:
                    os.fchown(ofd, -1, st.st_gid)    # the log's group (if the owner is in it)
                except OSError:
                    pass
                moved, off = 0, size
                while b := os.pread(fd, COPY_CHUNK, off):   # to the end as it is now (a late writer's too)
                    _pwrite_all(ofd, b, moved)
                    moved += len(b)
                    off += len(b)
                os.fsync(ofd)
                os.ftruncate(fd, size)
                os.fsync(fd)
            except BaseException:
                ownerfs.unlink_if_same(dfd, after, ost.st_dev, ost.st_ino)
                raise
            finally:
                os.close(ofd)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
    return [after, moved, ost.st_dev, ost.st_ino]


def _put_back(path: str, after: str, size: int, ident: list[int], after_ident: list[int]) -> bool:
    """(runs as the file's owner) Append `after` to `path` again and remove it, if both are
    still the files gpusnap checked and made and nobody wrote to `path` meanwhile."""
    dfd, name = ownerfs.open_parent(path)
    try:
        src, _ = ownerfs.open_checked(dfd, after, os.O_RDONLY, after_ident[0], after_ident[1])
        try:
            dst, st = ownerfs.open_checked(dfd, name, os.O_WRONLY, ident[0], ident[1])
            try:
                if st.st_size != size:
                    return False      # someone wrote meanwhile: keep both files as they are
                off = size
                while b := os.read(src, COPY_CHUNK):
                    _pwrite_all(dst, b, off)
                    off += len(b)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return ownerfs.unlink_if_same(dfd, after, after_ident[0], after_ident[1])
    finally:
        os.close(dfd)


def _set_aside(c: "FileCheck", snap_id: str) -> Moved:
    after, moved, adev, aino = ownerfs.as_owner(c.uid, c.gid, _move_tail, c.path, c.size, snap_id,
                                                [c.dev, c.ino])
    return Moved(path=c.path, after=os.path.join(os.path.dirname(c.path), after), size=c.size, moved=moved,
                 ident=(c.dev, c.ino), after_ident=(adev, aino), owner=(c.uid, c.gid))


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


# -- the checks: one function decides, restore acts on it and inspect reports it ---------------

OK, SET_ASIDE, LEFT, REFUSED = "ok", "set-aside", "left", "refused"


@dataclass
class FileCheck:
    path: str
    verdict: str            # OK, SET_ASIDE (grown: tail moved aside), LEFT (shared append file), REFUSED
    detail: str             # why, in a sentence ("" when ok)
    size: int | None        # the size the snapshot expects (None: not recorded)
    now: int | None = None  # the size on disk now
    dev: int = 0
    ino: int = 0
    uid: int = 0
    gid: int = 0
    append_only: bool = False   # every fd of the job appended (CRIU checks no size for it)


def _resolved(path: str) -> str | None:
    try:
        return os.path.realpath(path)
    except OSError:         # a link swapped in and out while it was read (EINVAL from readlink)
        return None


def check(snap, inherited=frozenset()) -> list[FileCheck]:
    """What a restore of `snap` would do with each file the job had open, decided once for
    `restore` (prepare) and `inspect` alike: nothing (ok), set the bytes written after the dump
    aside (an output file that grew and no other live process uses), leave it (an appended file
    another process uses too: the restored job appends after it), or refuse (naming the file,
    and the process when another one uses it)."""
    skip = _remapped_ids(snap)
    files: dict[str, dict] = {}     # path -> size CRIU expects (None: none), written, size checked by CRIU, mode
    for rf in reg_files(snap):
        if rf.ext or rf.id in skip or not rf.name.startswith("/"):
            continue
        if rf.name.startswith(PSEUDO_FS):   # /proc/PID/... of the job itself: CRIU reopens them
            continue
        if rf.mode is not None and not stat.S_ISREG(rf.mode):
            continue                    # directories, devices: not files with contents (inspect shows a gone one)
        f = files.setdefault(rf.name, {"size": None, "writable": False, "sized": False, "mode": rf.mode})
        if rf.size is not None:
            f["size"], f["sized"] = rf.size, True
        f["writable"] = f["writable"] or rf.writable
    meta = snap.manifest.get("meta") or {}
    same_host = meta.get("hostname") in (None, os.uname().nodename)
    appended: dict[str, dict] = {}
    for e in _append_files(snap):
        appended[e["path"]] = e
        f = files.setdefault(e["path"], {"size": None, "writable": True, "sized": False, "mode": None})
        f["writable"] = True
        if f["size"] is None:
            f["size"] = e["size"]
    out = [_check_one(name, f, appended.get(name), same_host) for name, f in files.items() if name not in inherited]
    _judge_grown(snap, [c for c in out if c.verdict == SET_ASIDE], meta)
    return out


def _check_one(name: str, f: dict, appended: dict | None, same_host: bool) -> FileCheck:
    """One file against the snapshot's record of it (f: size, writable, sized, mode;
    appended: its append-file entry)."""
    size, writable, mode = f["size"], f["writable"], f["mode"]
    kind = "output file" if writable else "input file"
    c = FileCheck(path=name, verdict=REFUSED, detail="", size=size, append_only=not f["sized"])
    try:
        st = os.stat(name)
    except FileNotFoundError:
        c.detail = f"{kind} {name} is gone" + (f" (the snapshot expects {size} bytes there)" if size is not None else "")
        return c
    except OSError as e:
        c.detail = f"{kind} {name} cannot be checked: {e.strerror}"
        return c
    c.now, c.dev, c.ino, c.uid, c.gid = st.st_size, st.st_dev, st.st_ino, st.st_uid, st.st_gid
    real = _resolved(name)
    if real != name:
        # CRIU records resolved paths: a link there now was put in since (a directory swapped
        # for a link to another user's): CRIU would reopen the file behind it for the job
        c.detail = (f"{kind} {name} is reached through a symbolic link now ({real or 'changing while checked'}), "
                    "not the file the job had open")
    elif mode is not None and st.st_mode != mode:
        c.detail = (f"{kind} {name} has mode {stat.filemode(st.st_mode)} now, {stat.filemode(mode)} at the "
                    "dump (CRIU refuses a file whose mode changed: chmod it back)")
    elif appended is not None and not _same_file(st, appended, same_host):
        c.detail = (f"output file {name} was rotated or replaced since the snapshot (another file "
                    "is at that path now); the snapshot does not hold its contents")
    elif size is None or st.st_size == size:
        c.verdict = OK          # (size None: appended, with no size recorded: CRIU checks none)
    elif writable and st.st_size > size:
        c.verdict = SET_ASIDE
    elif writable:
        c.detail = (f"output file {name} shrank or was replaced since the snapshot "
                    f"({st.st_size} bytes now, the snapshot expects {size}); the snapshot does "
                    "not hold its contents")
    else:
        c.detail = f"input file {name} changed since the snapshot ({st.st_size} bytes now, {size} then)"
    return c


def _judge_grown(snap, grown: list[FileCheck], meta: dict) -> None:
    """Output files that grew: set aside when nothing else uses them, left when another
    process appends to them too, else refused (cutting them would cut its data)."""
    dumped = {p for p in meta.get("pids") or [] if type(p) is int}     # the job's PIDs at the dump
    used = fileusers.users({(c.dev, c.ino) for c in grown})
    for c in grown:
        users = used.get((c.dev, c.ino)) or []
        if not users:
            c.detail = (f"{c.path} grew by {c.now - c.size} bytes after the snapshot: restore sets them aside "
                        f"in {c.path}.gpusnap-{snap.id}-after and cuts the file back to {c.size} bytes")
        elif c.append_only:
            c.verdict = LEFT
            c.detail = (f"{c.path} grew after the snapshot and {users[0]} has it {users[0].how} too: left as it "
                        "is, the restored job appends after what is there")
        else:
            c.verdict = REFUSED
            who = ("the snapshotted job itself, still running (restore it once it has stopped)"
                   if users[0].pid in dumped else "which is not part of the job being restored")
            c.detail = (f"output file {c.path} grew after the snapshot and is {users[0].how} by {users[0]}, "
                        f"{who}; cutting it back would cut that process's data")


def prepare(snap, inherited=frozenset()) -> FileFixes:
    """Act on check(snap): refuse (FilesChanged, naming each file) or set aside what was written
    to output files after the dump. Returns what was done (undo() puts it back).
    `inherited`: paths CRIU gets as open descriptors (a fork's own files): left alone."""
    checks = check(snap, inherited)
    problems = [c.detail for c in checks if c.verdict == REFUSED]
    if problems:
        busy = any(" by process " in p for p in problems)
        raise FilesChanged(
            "files the job had open changed since the snapshot: " + "; ".join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""),
            hint=("stop the named process first (or restore once it is done with the file), or " if busy else "")
            + "put the named files back as they were when the snapshot was taken (e.g. the rotated or "
              "older copy), then restore again; nothing was changed or restored")
    fixes = FileFixes(left=[c.detail for c in checks if c.verdict == LEFT])
    c = None
    try:
        for c in checks:
            if c.verdict == SET_ASIDE:
                with ownerfs.uninterrupted():       # a move done is a move recorded (for undo)
                    fixes.moved.append(_set_aside(c, snap.id))
    except OSError as e:
        fixes.undo()
        raise FilesChanged(f"cannot set aside what was written to {c.path} after the snapshot (as its "
                           f"owner, uid {c.uid}): {e.strerror or e}",
                           hint="gpusnap does this as the file's owner, next to the file: free some space there "
                                "or let the owner write that directory, or move the file's end away by hand; "
                                "nothing was changed or restored") from None
    except BaseException:            # an interrupt between two files: put back what was moved
        fixes.undo()
        raise
    return fixes
