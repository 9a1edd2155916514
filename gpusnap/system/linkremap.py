"""CRIU's link-remap files, kept in the snapshot so that a restore finds them in both dump modes.

With `--link-remap` (chosen by gpusnap/system/ghosts.py) CRIU reaches a file the job holds
through a removed name (every named POSIX semaphore: glibc maps it under a temporary name it
then unlinks) by a hard link `link_remap.N` it makes in that directory at dump, and restore
opens that link. With `--exit` the link outlives the killed job; with the job left running
CRIU deletes it once the job resumes, and a later restore fails ("No such file"). And in both
modes the file's contents go on changing after the dump (a semaphore's count), while the
restored memory expects them as they were at the freeze. So:

- dump, at the post-dump gate (everything dumped, the job still frozen, CRIU's links still
  there): `Keeper.at_freeze` finds, in the directory of each such name, the `link_remap.*`
  entries that are one of the scanned inodes, and reads their contents, mode and owner; the
  other names the inode has there (a semaphore's `sem.NAME`, which the job's other processes
  map by that name) were looked up before the freeze. The contents are stored after CRIU finishes as one blob image each,
  `gpusnap-link-remap-N.img`, the names in the manifest's `meta.link_remaps` (docs/format.md);
- restore, before CRIU runs (`put_back`): for each, the inode is the one still reachable by
  one of its names (a job killed after the dump leaves its semaphores), else a new file made
  under those names; the contents at the freeze are written back into it, and `link_remap.N`
  is linked to it. Held by a running process (the original job, restored beside itself in a
  PID namespace of its own), it would be shared with it: refused, naming the process. CRIU removes `link_remap.N` itself
  once the restore succeeded; a failed restore removes what was made here.

Contents are read inside the freeze: semaphores are 32 bytes each; other link-remapped files
(rare: a file renamed away with another hard link open) are read whole too, up to KEEP_MAX
bytes in all; one beyond that is not kept, and its restore needs CRIU's link as without this.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from gpusnap.errors import CorruptSnapshot, FilesChanged

PREFIX = "link_remap."
IMAGE = "gpusnap-link-remap-{}.img"
KEEP_MAX = 256 << 20     # bytes read inside the freeze, at most


@dataclass
class Kept:
    path: str                 # CRIU's link_remap.N, absolute
    names: list[str]          # the inode's other names in that directory
    mode: int
    uid: int
    gid: int
    data: bytes = b""


class Keeper:
    """What the gate keeps: scanned (dev, ino) of the link-remapped files, found at the freeze.
    Their other names are looked up here, before the freeze; inside it only `link_remap.*`
    entries are stat'ed."""

    def __init__(self, linked: list) -> None:
        self.inodes = {(d.dev, d.ino) for d in linked}
        self.dirs = sorted({os.path.dirname(d.path) or "/" for d in linked})
        self.names: dict[tuple[int, int], list[str]] = {}
        for d in self.dirs:
            for e in _scan(d, lambda n: not n.startswith(PREFIX)):
                st = e.stat(follow_symlinks=False)
                if (st.st_dev, st.st_ino) in self.inodes:
                    self.names.setdefault((st.st_dev, st.st_ino), []).append(e.path)
        self.kept: list[Kept] = []

    def at_freeze(self) -> None:
        for d in self.dirs:
            for e in _scan(d, lambda n: n.startswith(PREFIX)):
                st = e.stat(follow_symlinks=False)
                if (st.st_dev, st.st_ino) in self.inodes:
                    self._keep(e, self.names.get((st.st_dev, st.st_ino), []))

    def _keep(self, e: os.DirEntry, names: list[str]) -> None:
        try:
            with open(e.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size + sum(len(k.data) for k in self.kept) > KEEP_MAX:
                    return
                data = f.read()
        except OSError:
            return          # restore then fails as CRIU alone would, naming the file
        self.kept.append(Kept(e.path, sorted(names), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, data))

    def store(self, writer) -> list[dict]:
        """Write each kept file as a blob image; returns meta.link_remaps."""
        out = []
        for i, k in enumerate(self.kept):
            name = IMAGE.format(i)
            sink = writer.image_sink(name)
            if k.data:
                sink.write(k.data)
            sink.close()
            out.append({"path": k.path, "names": k.names, "mode": k.mode, "uid": k.uid, "gid": k.gid,
                        "size": len(k.data), "image": name})
        return out


def _scan(d: str, want) -> list[os.DirEntry]:
    """The regular files of directory d whose names `want` accepts (stat cached)."""
    out = []
    try:
        with os.scandir(d) as it:
            for e in it:
                if not want(e.name):
                    continue
                try:
                    if stat.S_ISREG(e.stat(follow_symlinks=False).st_mode):
                        out.append(e)
                except OSError:
                    continue
    except OSError:
        pass
    return out


# ---------------------------------------------------------------- restore

def _entries(snap) -> list[dict]:
    raw = snap.manifest.get("meta", {}).get("link_remaps") or []
    ok = isinstance(raw, list) and all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and os.path.isabs(e["path"])
        and os.path.basename(e["path"]).startswith(PREFIX) and isinstance(e.get("image"), str)
        and isinstance(e.get("names"), list) and all(isinstance(n, str) and os.path.isabs(n) and
                                                     os.path.dirname(n) == os.path.dirname(e["path"])
                                                     for n in e["names"])
        and all(type(e.get(k)) is int for k in ("mode", "uid", "gid", "size")) for e in raw)
    if not ok:
        raise CorruptSnapshot(f"snapshot {snap.path} has a malformed meta.link_remaps")
    return raw


@dataclass
class PutBack:
    made: list[str] = field(default_factory=list)     # paths created here (removed on undo)

    def undo(self) -> None:
        for p in reversed(self.made):
            try:
                os.unlink(p)
            except OSError:
                pass
        self.made.clear()


def _existing(paths: list[str]) -> str | None:
    for p in paths:
        try:
            if stat.S_ISREG(os.lstat(p).st_mode):
                return p
        except OSError:
            continue
    return None


def put_back(snap) -> PutBack:
    """Before CRIU's restore: every link_remap file of the snapshot, at its path, linked to the
    inode its names reach, with the contents it had at the freeze. Refused (FilesChanged),
    before anything is made, when a running process holds one of those inodes."""
    from gpusnap.system import fileusers

    todo = []
    for e in _entries(snap):
        data = b"".join(snap.read_image(e["image"]))
        if len(data) != e["size"]:
            raise CorruptSnapshot(f"snapshot {snap.path}: image {e['image']} is {len(data)} bytes, "
                                  f"its meta.link_remaps entry says {e['size']}")
        todo.append((e, data, _existing(e["names"]) or _existing([e["path"]])))
    there = {}
    for _, _, target in todo:
        if target is not None:
            st = os.lstat(target)
            there[(st.st_dev, st.st_ino)] = target
    for inode, users in fileusers.users(set(there)).items():
        if users:   # the restored job would share it (a semaphore: its locks) with them
            raise FilesChanged(f"{there[inode]}, which the snapshot's job shares by name (a named semaphore "
                               f"or a file linked through a removed name), is in use by {users[0]}: the "
                               "restored job would share it with that process; nothing was restored",
                               hint="stop that process (the original job, or an earlier restore of it), "
                                    "then restore again")
    done = PutBack()
    try:
        for e, data, target in todo:
            _one(e, data, target, done)
    except BaseException:
        done.undo()
        raise
    return done


def _one(e: dict, data: bytes, target: str | None, done: PutBack) -> None:
    remap, names = e["path"], e["names"]
    if target is None:          # nothing left of it: make it, under its first name
        target = names[0] if names else remap
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, e["mode"])
        done.made.append(target)
        try:
            os.write(fd, data)
            os.fchown(fd, e["uid"], e["gid"])
        finally:
            os.close(fd)
    else:                       # back to its contents at the freeze
        fd = os.open(target, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, len(data))
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
    for p in [remap, *names]:
        if p == target:
            continue
        try:
            cur = os.lstat(p)
        except FileNotFoundError:
            cur = None
        if cur is not None:
            t = os.lstat(target)
            if (cur.st_dev, cur.st_ino) == (t.st_dev, t.st_ino):
                continue
            if p != remap:
                continue        # another file took that name since: leave it
            os.unlink(p)        # a stale link_remap.N of another inode
        try:
            os.link(target, p)
        except OSError as err:
            raise FilesChanged(f"cannot put back {p}, which the snapshot's restore needs: {err.strerror}",
                               hint="make room or permissions there, then restore again") from None
        done.made.append(p)
