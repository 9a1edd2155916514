"""Open deleted files of a tree, and the CRIU options they need (--ghost-limit, --link-remap).

A file the job holds open (an fd, or a file mapping) whose name is gone comes in two kinds,
as CRIU tells them apart (criu/files-reg.c, check_path_remap):

- no name left at all (st_nlink 0: a temp file unlinked while open): a *ghost file*. CRIU
  copies its contents into the images (ghost-file-*.img), which go through gpusnap's image
  stream into the repository like every other image, and recreates the file at restore. CRIU
  refuses ghosts larger than its ghost limit (1 MiB by default), so the preflight passes
  `--ghost-limit` sized from the largest one, with headroom for growth until the freeze.
- a name gone but the inode still linked elsewhere (st_nlink > 0): CRIU can reach it only
  through a *link remap*, a hard link `link_remap.N` it makes beside the old name at dump.
  This is how glibc's sem_open leaves every named POSIX semaphore: it creates the file under a
  temporary name, maps it, links it to /dev/shm/sem.NAME and unlinks the temporary name, so
  each mapping points to a deleted name of a linked inode. Python's multiprocessing with the
  `forkserver` or `spawn` start method (Pool, Queue, Lock) holds such semaphores. The
  preflight passes `--link-remap`.

Link remaps in both dump modes (what restore needs is the link_remap.N file, by its path):
with `--exit` CRIU leaves the link_remap files in place and the killed job's inode lives on
through them. With the job left running CRIU deletes them once the job resumes, so
gpusnap keeps them itself (gpusnap/system/linkremap.py): at the post-dump gate, while the
job is still frozen, it copies each link_remap file CRIU made into the snapshot, and restore
puts them back before CRIU runs. Ghost files need nothing of the kind: their contents are in
the images in both modes.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

DELETED = " (deleted)"
MiB = 1 << 20
# CRIU's default ghost limit: below it nothing needs to be passed
CRIU_DEFAULT_GHOST_LIMIT = MiB
# deleted files this big in all are worth a warning: each snapshot stores them
BIG_GHOSTS = 1 << 30
# kernel names that end in " (deleted)" but are no file CRIU treats as a ghost: shared
# anonymous memory, SysV shm, memfd (CRIU dumps those as memory), anon inodes
_NOT_FILES = ("/dev/zero", "/SYSV", "/memfd:", "anon_inode:", "/anon_hugepage")


@dataclass(frozen=True)
class Deleted:
    path: str        # the name it had, " (deleted)" stripped
    dev: int
    ino: int
    size: int        # st_size
    stored: int      # st_blocks * 512: what CRIU compares with its ghost limit
    nlink: int
    holder: int      # a PID holding it

    @property
    def ghost(self) -> bool:
        return self.nlink == 0


def _entries(pid: int):
    """(link target, path to stat through) for every fd and file mapping of pid."""
    for kind in ("fd", "map_files"):
        d = f"/proc/{pid}/{kind}"
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            p = f"{d}/{n}"
            try:
                yield os.readlink(p), p
            except OSError:
                continue


def scan(pids: list[int]) -> list[Deleted]:
    """Every regular file the tree holds through a deleted name, once per inode."""
    seen: dict[tuple[int, int], Deleted] = {}
    for pid in pids:
        for target, p in _entries(pid):
            if not target.endswith(DELETED) or target.startswith(_NOT_FILES):
                continue
            try:
                st = os.stat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                continue
            path = target[: -len(DELETED)]
            # (CRIU looks the name up with its " (deleted)" suffix, so a linked inode is remapped
            # even when a new file took the old name)
            seen[(st.st_dev, st.st_ino)] = Deleted(path, st.st_dev, st.st_ino, st.st_size,
                                                   st.st_blocks * 512, st.st_nlink, pid)
    return list(seen.values())



def ghost_limit(found: list[Deleted]) -> int | None:
    """The --ghost-limit (bytes) covering every ghost, or None when CRIU's default does. CRIU
    checks each ghost on its own; the headroom (double, at least +16 MiB) covers growth between
    this look and the freeze."""
    biggest = max((max(d.stored, d.size) for d in found if d.ghost), default=0)
    if biggest <= CRIU_DEFAULT_GHOST_LIMIT // 2:
        return None
    mib = -(-biggest // MiB)
    return max(2 * mib, mib + 16) * MiB


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB // 10 else f"{n} bytes"


def plan(found: list[Deleted]) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    """(CRIU options, findings as (name, status, detail, fix)) for what scan() found."""
    opts: list[str] = []
    findings: list[tuple[str, str, str, str]] = []
    ghosts = [d for d in found if d.ghost]
    linked = [d for d in found if not d.ghost]
    if ghosts:
        total = sum(d.size for d in ghosts)
        limit = ghost_limit(found)
        names = ", ".join(d.path for d in ghosts[:3]) + (" ..." if len(ghosts) > 3 else "")
        how = f"--ghost-limit {limit // MiB}M" if limit else "within CRIU's default ghost limit"
        if limit:
            opts += ["--ghost-limit", f"{limit // MiB}M"]
        big = total >= BIG_GHOSTS
        findings.append(("deleted files", "warn" if big else "info",
                         f"{len(ghosts)} deleted open file(s), {_mib(total)}: stored in the snapshot ({how}): {names}",
                         "every snapshot stores them (deduplicated): truncate or close a big deleted file the job "
                         "no longer needs" if big else
                         "their contents are in the snapshot; restore recreates them as the job saw them"))
    if linked:
        opts.append("--link-remap")
        names = ", ".join(d.path for d in linked[:3]) + (" ..." if len(linked) > 3 else "")
        findings.append(("link remap", "info", f"{len(linked)} file(s) open through a removed name but linked "
                         f"elsewhere (named semaphores, files renamed or relinked): {names}; dumped with "
                         "--link-remap, their remap links kept in the snapshot",
                         "restore puts the links back before CRIU runs, in both dump modes"))
    return opts, findings
