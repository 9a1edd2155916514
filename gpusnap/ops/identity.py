"""A job's identity: a name (`run --name N`, `dump --name N`) stands for the job, not its first PID.

REPO/jobs/N/job.json records the process tree that carries the name now: its root PID, the
root's start time (clock ticks after boot, from /proc/PID/stat) and the boot it runs in, so a
PID reused by another process never matches. `dump --name N`, `schedule run`, `schedule ls`,
`doctor`, `ls` and `slurm-run` look the name up here.

Every restore moves the name to the restored tree (written atomically, temp file and rename):
- the named job is gone (a crash): the restored tree takes the name (`restores` counts up);
- the named job still runs (a restore beside it, possible for a job in a PID namespace of its
  own): a fork. It never takes the name; it gets the next free `N-forkK` (K = 1, 2, ...; the
  directory REPO/jobs/N-forkK is claimed with an exclusive mkdir), shown in restore's output,
  `--json` and `ls`. A fork of a `gpusnap run` job writes stdout.log, stderr.log and exit in
  REPO/jobs/N-forkK/ (its logs start with what the original had written up to the snapshot):
  gpusnap opens them and hands them to CRIU with `--inherit-fd fd[K]:<path in the image>`,
  so the original's files are neither cut back nor written by the fork.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from gpusnap.errors import GpusnapError, Interrupted, ProcessNotFound, RepositoryError
from gpusnap.repo import fsutil
from gpusnap.system import hostlock, proc

RUN_FILES = ("stdout.log", "stderr.log", "exit")   # a `run` job's files, each held open by the job


@dataclass
class Job:
    name: str
    pid: int          # the tree's root (for `run` jobs: the namespace's init), as this machine sees it
    dir: str
    cmd: list[str]
    cwd: str
    started: float
    start: int = 0                 # the root's start time (/proc/PID/stat field 22); 0: an old record
    boot: str = ""                 # /proc/sys/kernel/random/boot_id when recorded
    kind: str = "run"              # "run": started by `gpusnap run`; "process": named by `dump --name`
    forked_from: str | None = None  # a fork: the name of the job it was restored beside
    restored_from: str | None = None  # the snapshot the tree was restored from, if it was
    restores: int = 0

    @property
    def stdout(self) -> Path:
        return Path(self.dir) / "stdout.log"

    @property
    def stderr(self) -> Path:
        return Path(self.dir) / "stderr.log"

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.kind == "run":
            d.update(stdout=str(self.stdout), stderr=str(self.stderr))
        return d


def jobs_dir(repo: Path) -> Path:
    return Path(repo) / "jobs"


def boot_id() -> str:
    return proc.boot_id()


def load(repo: Path, name: str) -> Job | None:
    try:
        d = json.loads((jobs_dir(repo) / name / "job.json").read_text())
        fields = {k: v for k, v in d.items() if k in Job.__dataclass_fields__}
        job = Job(**fields)
        job.pid, job.start = int(job.pid), int(job.start)
        return job if job.name == name else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(repo: Path, job: Job) -> None:
    """job.json, replaced atomically (a private temp file, then rename)."""
    d = jobs_dir(repo) / job.name
    try:   # jobs/ and jobs/NAME private whatever the umask, never through a link (docs/faults.md)
        os.close(fsutil.private_dirs(Path(repo), "jobs", job.name))
    except RepositoryError as e:     # (an OSError to the callers: a record is best effort)
        raise OSError(errno.EPERM, e.message) from None
    write_record(d / "job.json", json.dumps(asdict(job), indent=1) + "\n")


def write_record(path: Path, text: str) -> None:
    fsutil.write_atomic(path, text)


def alive(job: Job) -> bool:
    """The recorded tree still runs: the same process (PID, start time and boot), not a reuse."""
    st = proc.read_stat(job.pid)
    if st is None or st.state in ("Z", "X"):
        return False
    if job.start:
        return st.starttime == job.start and (not job.boot or job.boot == boot_id())
    cmd = proc.cmdline(job.pid)      # a record of an older gpusnap: its init's command line
    return "gpusnap run init" in cmd or cmd.startswith("gpusnap-init ")


def stamped(job: Job, pid: int) -> Job | None:
    """`job` naming the tree rooted at `pid` now (None when that process is gone)."""
    st = proc.read_stat(pid)
    if st is None or st.state in ("Z", "X"):
        return None
    return replace(job, pid=pid, start=st.starttime, boot=boot_id(), started=time.time())


def find(name: str, repo: Path) -> Job:
    """The running job named `name` in this repository."""
    job = load(repo, name)
    if job is None:
        raise ProcessNotFound(f"no job named {name!r} was started with `gpusnap run` or dumped with `--name "
                              f"{name}` (looked in {jobs_dir(repo) / name})", hint="give the PID, or --match PATTERN")
    if not alive(job):
        raise ProcessNotFound(f"job {name!r} (PID {job.pid}) is not running any more",
                              hint=f"its record is in {job.dir}; `gpusnap restore {name}` brings back its last "
                                   "snapshot (and the name follows the restored job)")
    return job


def running(name: str, repo: Path) -> Job | None:
    job = load(repo, name)
    return job if job is not None and alive(job) else None


def list_jobs(repo: Path) -> list[tuple[Job, bool]]:
    out = []
    d = jobs_dir(repo)
    try:
        names = sorted(os.listdir(d))
    except OSError:            # none yet, or not readable by this user: no named jobs to go by
        return out
    for n in names:
        job = load(repo, n)
        if job:
            out.append((job, alive(job)))
    return out


def name_of(repo: Path, pid: int) -> str | None:
    """The name of the live job whose root is `pid`, if it has one."""
    for job, up in list_jobs(repo):
        if up and job.pid == pid:
            return job.name
    return None


def note_dump(repo: Path, name: str, pid: int) -> None:
    """`dump --name NAME PID`: from now on NAME stands for this tree, unless it stands for
    another job that still runs (that job keeps it). Best effort: the dump is committed."""
    old = load(repo, name)
    if old is not None and alive(old):
        return
    base = Job(name=name, pid=pid, dir=str(jobs_dir(repo) / name), cmd=proc.cmdline(pid).split(),
               cwd=_cwd(pid), started=time.time(), kind="process")
    job = stamped(base, pid)
    if job is None:
        return
    with contextlib.suppress(OSError):
        save(repo, job)


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


# -- restores ------------------------------------------------------------------------------
@dataclass
class Claim:
    """What a restore will record, decided before CRIU runs (under the name's lock)."""
    repo: Path
    job: Job                                   # pid filled in by commit()
    fork_of: str | None = None
    inherit: list[tuple[int, str]] = field(default_factory=list)   # (fd, file key in the image)
    paths: set[str] = field(default_factory=set)     # the original's files the fork does not touch
    made_dir: Path | None = None
    _locks: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def criu_flags(self) -> list[str]:
        out: list[str] = []
        for fd, key in self.inherit:
            out += ["--inherit-fd", f"fd[{fd}]:{key}"]
        return out

    def _close(self) -> None:
        for fd, _ in self.inherit:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.inherit = []
        self._locks.close()

    def commit(self, pid: int) -> tuple[Job | None, str | None]:
        """Record the restored tree; (the record, or None and why it could not be written)."""
        try:
            job = stamped(self.job, pid)
            if job is None:
                return None, f"the restored job (PID {pid}) ended before its name could be recorded"
            save(self.repo, job)
            self.job = job
            return job, None
        except OSError as e:
            return None, f"the name {self.job.name} could not be recorded for the restored job: {e}"
        finally:
            self._close()

    def abandon(self, error: BaseException | None = None) -> None:
        """The restore failed (or never began: error None): a fork directory made for it goes,
        unless the restore was interrupted (its tree may run and hold the files)."""
        self._close()
        gone = error is None or (isinstance(error, GpusnapError) and not isinstance(error, Interrupted))
        if self.made_dir is not None and gone:
            for n in RUN_FILES:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.made_dir / n)
            with contextlib.suppress(OSError):
                os.rmdir(self.made_dir)


def _lock_name(repo: Path, name: str) -> str:
    # a name may hold '_' and '+', which lock names may not: a digest of repository and name
    return "job-" + hashlib.sha256(f"{Path(repo).absolute()}\0{name}".encode()).hexdigest()[:32]


def claim(repo: Path, snap) -> Claim:
    """Decide the restored tree's name (the snapshot's, or a fork's) and, for a fork of a
    `run` job, open its own files. Holds the name's lock until commit() or abandon()."""
    name = snap.name
    locks = contextlib.ExitStack()
    locks.enter_context(hostlock.held(_lock_name(repo, name)))
    try:
        old = load(repo, name)
        if old is None:
            job = Job(name=name, pid=0, dir=str(jobs_dir(repo) / name), cmd=[], cwd="", started=0.0,
                      kind="process", restored_from=str(snap.path), restores=1)
            return Claim(repo=Path(repo), job=job, _locks=locks)
        if not alive(old):   # the job is gone: the restored tree takes its name
            job = replace(old, restored_from=str(snap.path), restores=old.restores + 1, forked_from=None)
            return Claim(repo=Path(repo), job=job, _locks=locks)
        try:
            fork_name, d = _new_fork_dir(repo, name)
        except OSError as e:
            raise RepositoryError(f"cannot make a directory for a fork of job {name} in {jobs_dir(repo)}: "
                                  f"{e.strerror}", hint="nothing was restored; the running original is "
                                  "untouched") from None
        c = Claim(repo=Path(repo), job=replace(old, name=fork_name, dir=str(d), forked_from=name,
                                               restored_from=str(snap.path), restores=1),
                  fork_of=name, made_dir=d, _locks=locks)
        try:
            if old.kind == "run":
                _open_fork_files(c, snap, Path(old.dir), d)
        except OSError as e:
            c.abandon()
            raise RepositoryError(f"cannot make the fork's own files in {d}: {e.strerror}",
                                  hint="nothing was restored; the running original and its files are "
                                       "untouched") from None
        except BaseException:
            c.abandon()
            raise
        return c
    except BaseException:
        locks.close()
        raise


def _new_fork_dir(repo: Path, name: str) -> tuple[str, Path]:
    base = jobs_dir(repo)
    os.close(fsutil.private_dirs(Path(repo), "jobs"))     # no fork in a jobs/ others could write
    for k in range(1, 10000):
        suffix = f"-fork{k}"
        fork = name[:100 - len(suffix)] + suffix     # still a valid name (at most 100 characters)
        try:
            (base / fork).mkdir(mode=0o700)
            return fork, base / fork
        except FileExistsError:
            continue
    raise RepositoryError(f"no free fork name for job {name} (tried {name}-fork1 to {name}-fork9999 in {base})",
                          hint="remove the directories of old forks that ended")


def _open_fork_files(c: Claim, snap, orig_dir: Path, d: Path) -> None:
    from gpusnap.ops import restore_files

    sizes: dict[str, int | None] = {}
    for rf in restore_files.reg_files(snap):
        sizes.setdefault(rf.name, rf.size)
    meta = snap.manifest.get("meta") or {}
    for e in meta.get("append_files") or []:
        if isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("size"), int):
            sizes[e["path"]] = e["size"]
    for n in RUN_FILES:
        path = str(orig_dir / n)
        if path not in sizes:
            continue
        fd = os.open(d / n, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        c.inherit.append((fd, path.lstrip("/")))
        c.paths.add(path)
        if n != "exit":
            _copy_prefix(path, fd, sizes[path])


def _copy_prefix(path: str, fd: int, size: int | None) -> None:
    """The fork's log starts with what the original had written when the snapshot was taken."""
    if not size:
        return
    try:
        src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        left = size
        while left > 0:
            chunk = os.read(src, min(left, 1 << 20))
            if not chunk:
                break
            os.write(fd, chunk)
            left -= len(chunk)
    finally:
        os.close(src)
