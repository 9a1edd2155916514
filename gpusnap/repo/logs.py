"""The repository's logs/ directory: CRIU's log of each dump and restore kept there, named
after its snapshot (<snapshot dir>-dump, -restore) so that it goes when the snapshot goes
(repo/maint/prune.py prune_logs), or after the failed run (failed-dump-..., unique)."""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.repo import fsutil


def keep_log(repo_path: str | os.PathLike, log: Path, label: str) -> str | None:
    """Copy a CRIU log into REPO/logs/<label>.log (private) and return where it went; never
    over an existing log (<label>-2.log, -3, ... instead), never through a symlink. Logs of a
    snapshot are named <snapshot dir>-dump / -restore and go when it goes (prune.prune_logs);
    callers make the labels of failed runs unique (time and pid). On a full repository disk
    the log goes to a private temporary directory instead; a log is never worth failing over."""
    import stat
    import tempfile

    from gpusnap.errors import GpusnapError

    if not log.exists():
        return None

    def free_name(folder: Path) -> str:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            name, k = f"{label}.log", 1
            while True:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    return name
                if stat.S_ISLNK(st.st_mode):     # planted: nothing more is written in logs/
                    raise OSError(f"{folder / name} is a symbolic link")
                k += 1
                name = f"{label}-{k}.log"
        finally:
            os.close(dfd)

    try:
        logs = Path(repo_path) / "logs"
        logs.mkdir(mode=0o700, exist_ok=True)
        name = free_name(logs)
        fsutil.copy_into(log, logs, name)          # never through a symlink in the repository
        return str(logs / name)
    except (OSError, GpusnapError):               # (a planted symlink: refused, the log goes to tmp)
        pass
    try:
        import shutil

        dst = Path(tempfile.mkdtemp(prefix="gpusnap-log-")) / f"{label}.log"
        shutil.copyfile(log, dst)
        return str(dst)
    except OSError:
        return None
