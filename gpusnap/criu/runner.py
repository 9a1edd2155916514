"""Finding CRIU, checking its version, running it, and turning its failures into clear errors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpusnap.errors import CriuUnavailable
from gpusnap import settings

MIN_VERSION = (4, 0)  # the device plugin hooks and working vDSO handling on recent kernels
# Linux 6.16 restricted SO_PASSCRED/SO_PASSSEC to unix and netlink sockets; CRIU before 4.2
# still asks every socket for them, so it cannot dump a job holding an AF_INET, AF_INET6 or
# AF_PACKET socket on such a kernel (CRIU issues #2705/#2718, fixed in 4.2).
SOCKETS_FIXED_IN = (4, 2)
SOCKETS_BROKEN_FROM_KERNEL = (6, 16)
INSTALL_HINT = ("run `make setup` as root in the gpusnap checkout: it builds CRIU 4.2.1 from Debian's "
                "source package into /opt/gpusnap and links it as /usr/local/sbin/criu")


@dataclass(frozen=True)
class CriuInfo:
    path: str
    version: tuple[int, ...]

    @property
    def version_str(self) -> str:
        return ".".join(map(str, self.version))


_info_cache: dict[str, "CriuInfo"] = {}  # one `criu --version` per process


def criu_path() -> str | None:
    """$GPUSNAP_CRIU, else the CRIU `make setup` builds (/usr/local/sbin/criu, looked up directly
    because cron's PATH lacks that directory and a Debian criu 4.1 may sit in /usr/sbin), else PATH."""
    env = settings.get("GPUSNAP_CRIU")
    if env:
        return env
    for p in ("/usr/local/sbin/criu",):
        if os.access(p, os.X_OK):
            return p
    return shutil.which("criu") or next(
        (p for p in ("/usr/sbin/criu", "/sbin/criu") if os.access(p, os.X_OK)), None)


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"Version:\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def criu_info() -> CriuInfo:
    """Locate CRIU and check it is >= MIN_VERSION, or raise CriuUnavailable saying how to get it."""
    path = criu_path()
    if path is not None and path in _info_cache:
        return _info_cache[path]
    if path is None:
        raise CriuUnavailable("CRIU is not installed (no `criu` on PATH)", hint=INSTALL_HINT)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CriuUnavailable(f"cannot run {path}: {e}", hint=INSTALL_HINT) from None
    version = parse_version(out)
    if version is None:
        raise CriuUnavailable(f"cannot tell the version of {path} (`criu --version` said {out.strip()!r})",
                              hint=INSTALL_HINT)
    check_version(version, path)
    _info_cache[path] = CriuInfo(path=path, version=version)
    return _info_cache[path]


def check_version(version: tuple[int, ...], path: str) -> tuple[int, ...]:
    if version[:2] < MIN_VERSION:
        raise CriuUnavailable(
            f"CRIU {'.'.join(map(str, version))} at {path} is too old: gpusnap needs 4.0 or newer "
            "(the device plugin hooks and working vDSO handling on recent kernels came with 4.0)",
            hint=INSTALL_HINT)
    return version


def kernel_version(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of the running kernel (or of a `uname -r` string)."""
    m = re.match(r"(\d+)\.(\d+)", release if release is not None else os.uname().release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def sockets_broken(version: tuple[int, ...], kernel: tuple[int, int] | None = None) -> bool:
    """True when this CRIU cannot dump AF_INET/AF_INET6/AF_PACKET sockets on this kernel."""
    return version[:2] < SOCKETS_FIXED_IN and (kernel or kernel_version()) >= SOCKETS_BROKEN_FROM_KERNEL


def install_hint(path: str | None = None) -> str:
    """INSTALL_HINT, plus what to unset when $GPUSNAP_CRIU chose this CRIU."""
    if settings.get("GPUSNAP_CRIU") and path == settings.get("GPUSNAP_CRIU"):
        return INSTALL_HINT + f"; $GPUSNAP_CRIU makes gpusnap use {path}: unset it afterwards"
    return INSTALL_HINT




def log_errors(log_path: Path, limit: int = 8) -> list[str]:
    """The last error lines of a CRIU log, without the harmless ones users cannot act on."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    hits = [ln.strip() for ln in lines if "Error" in ln and "RLIMIT_NOFILE for self" not in ln]
    return hits[-limit:]


def explain(lines: list[str]) -> str | None:
    """Turn the CRIU errors users meet most into advice."""
    text = "\n".join(lines)
    rules = [
        ("Can't get rlimit", "this root lacks CAP_SYS_RESOURCE, so CRIU cannot dump a process of another "
                             "user; run the job as root or give root that capability (see `gpusnap doctor`)"),
        ("TCP connection", "the job has established TCP connections; CRIU cannot keep them across a restore"),
        ("external socket", "the job talks over a unix socket to a process outside its tree"),
        ("tty", "the job had a terminal CRIU could not hand over: gpusnap gives it the terminal `gpusnap "
                "restore` runs in, or from no terminal a new tmux session; `gpusnap inspect` says which, and "
                "`gpusnap doctor` whether tmux is there"),
        ("File exists", "a PID of the snapshot is taken: is the original job still running?"),
        ("has bad size", "a file the job had open changed size since the dump"),
        ("No such file or directory", "a file the job had open is gone since the dump"),
    ]
    for needle, advice in rules:
        if needle in text:
            return advice
    return None


# Dump failures users meet, as CRIU 4.2 words them, and what to do. First match wins; a dump
# failure nothing here matches still gets DUMP_FALLBACK, so every failed dump has a hint.
DUMP_ADVICE: list[tuple[str, str]] = [
    (r"Connected TCP socket", "the job has an established TCP connection CRIU was not told to dump (opened "
     "after gpusnap's preflight looked?); dump again: gpusnap adds --tcp-established when it sees one"),
    (r"Iptables configuration failed|iptables|nftables|network.?lock|Can't lock network",
     "CRIU could not lock the job's TCP connections: it needs `iptables` (apt-get install iptables) or a "
     "CRIU built with nftables; `gpusnap doctor PID` says which is there"),
    (r"half of stream unix connection|name-less external socket|unreachable peer|Unix socket \d+ without peer",
     "the job has a unix stream connection (or a datagram socket to a nameless peer) to a process outside "
     "its tree, which CRIU cannot restore; `gpusnap doctor PID` names the peer: close that connection "
     "(journald, syslog, a desktop bus, a database socket) or dump the tree that holds both ends"),
    (r"External socket is used", "the job connected a unix socket to a process outside its tree after "
     "gpusnap's preflight looked; dump again (a datagram socket to a daemon's address is dumped with "
     "--ext-unix-sk and reconnected on restore; `gpusnap doctor PID` says which kind it is)"),
    (r"SysVIPC|doesn't live in IPC ns", "the job has SysV shared memory attached in the "
     "host's IPC namespace, which CRIU cannot dump; start it with `gpusnap run -- CMD` (an IPC namespace of "
     "its own, dumped and restored with its segments)"),
    (r"file locks are hold|--file-locks", "the job took a file lock while it was being dumped; dump again "
     "(gpusnap adds --file-locks when the job holds locks or leases)"),
    (r"Can't dump ghost file .* increase limit", "the job holds open a deleted file larger than the ghost "
     "limit gpusnap chose from the deleted files its preflight saw: the file grew, or was opened, after it "
     "looked; dump again (`gpusnap doctor PID` lists the deleted files and their sizes)"),
    (r"Can't create link remap|Use link-remap option", "the job holds a file through a removed name that is "
     "still linked elsewhere (a named POSIX semaphore, as Python multiprocessing's forkserver and spawn "
     "make) opened after gpusnap's preflight looked; dump again: gpusnap adds --link-remap when it sees one"),
    (r"Can't link remap to", "CRIU could not make its link_remap hard link beside a file the job holds through "
     "a removed name (a read-only or full filesystem, or the directory is gone); make that directory "
     "writable, then dump again"),
    (r"Cannot allocate memory|Can't allocate memory|ENOMEM|[Oo]ut of memory|\(-12\)",
     "the machine ran out of memory while CRIU dumped the job; free memory (or add swap) and dump again"),
    (r"No space left on device|ENOSPC", "a disk filled up during the dump; free space (`gpusnap prune`) "
     "and dump again"),
    (r"Can't get rlimit", "this root lacks CAP_SYS_RESOURCE, so CRIU cannot dump a process of another "
     "user; run the job as root or give root that capability (see `gpusnap doctor`)"),
    (r"SEIZE|[Cc]an't seize|Unable to seize|PTRACE_", "CRIU could not stop a process of the job: it is traced by a debugger or "
     "strace, or stuck in uninterruptible sleep (state D); detach the tracer, or wait and dump again"),
    (r"Unable to freeze cgroup|freez", "the job's processes could not all be frozen in time (it forks fast, "
     "or some are in state D); dump again"),
    (r"pid namespace without the process init", "the job is in a PID namespace whose init is not in the "
     "dumped tree: dump the namespace's PID 1 (jobs started with `gpusnap run` are dumped that way)"),
    (r"uprobes vma", "a process of the job is probed with uprobes (a tracer or profiler); stop it first"),
    (r"hugetlb|HUGETLB|huge page", "the job maps huge pages (hugetlbfs / MAP_HUGETLB); see `gpusnap doctor "
     "PID` for whether this CRIU can snapshot them here"),
    (r"Unsupported mapping|Can't dump file .* of that type|Unsupported type", "the job uses a kind of "
     "memory mapping, file or socket CRIU cannot snapshot (a device, an unusual socket family); the CRIU "
     "errors above name it"),
    (r"[Tt]ty|terminal", "the job uses a terminal CRIU could not dump; start it with `gpusnap run` (no "
     "terminal), or with setsid and stdio redirected to files"),
    (r"overmounted", "the job has a file open on a mount point that another mount hides; CRIU cannot "
     "dump that"),
]
DUMP_FALLBACK = ("the CRIU errors above say what it could not dump; `gpusnap doctor PID` checks the usual "
                 "causes, and the full CRIU log is kept")


def explain_dump(lines: list[str]) -> str:
    """Advice for a failed `criu dump` (never None: every dump failure gets a hint)."""
    # match the message, not CRIU's "(00.1) Error (criu/seize.c:12):" prefix
    text = "\n".join(re.sub(r"^.*?Error \([^)]*\):\s*", "", ln) for ln in lines)
    for rx, advice in DUMP_ADVICE:
        if re.search(rx, text):
            return advice
    return DUMP_FALLBACK


# Restore failures users meet, from CRIU's log lines to what to do (first match wins; the
# specific before the generic). The PIDs case is worded like restore.pids_hint.
_NO_UFFD = ("this kernel (or a seccomp filter around gpusnap) does not let CRIU use userfaultfd, which "
            "--via lazy needs: restore with --via stream or --via files (or auto, the default)")
RESTORE_RULES = [
    ("userfaultfd", _NO_UFFD),
    ("uffd API", _NO_UFFD),
    ("Can't read pages data",
     "CRIU cannot read this snapshot's pages from a stream (private huge-page mappings need to be read "
     "at an offset): restore with --via files"),
    ("do not match expected",
     "a PID the snapshot needs was taken while CRIU restored: is the original job (or a restore of it) "
     "running? stop it, wait until it has exited, then restore again"),
    ("Can't fork for",
     "CRIU could not recreate a process under its original PID: the PID is probably taken (is the original "
     "job still running? stop it first), or this kernel refuses clone3 with set_tid"),
    ("link_remap.",
     "a link_remap file CRIU needs for a file the job held through a removed name (a named semaphore) is "
     "gone: gpusnap puts them back from the snapshot; a snapshot made before it kept them cannot bring "
     "that file back, so restore a newer snapshot"),
    ("has bad size",
     "a file the job had open changed size since the dump (gpusnap sets aside output files that grew; an "
     "input file must be put back as it was)"),
    ("has bad build-id",
     "a program or library the job had mapped was replaced since the dump (e.g. a package upgrade): "
     "restore on a machine with the same versions, or put the old file back"),
    ("has bad mode",
     "a file the job had open has other permissions than at the dump: chmod it back"),
    ("Address already in use",
     "a port or socket address the job used is taken: is the original job still running? stop it, or "
     "free the address, then restore again"),
    ("Can't connect inet socket back",
     "the job had TCP connections whose peer is gone; the connections cannot be re-established"),
    ("unix: Can't connect",
     "the job's unix datagram socket could not be connected again to the daemon outside the job it was "
     "talking to (dumped with --ext-unix-sk): start that daemon at the same address, then restore again"),
    ("Cannot allocate memory",
     "out of memory: the restored job needs as much memory as it had at the dump (huge pages: "
     "vm.nr_hugepages); free some memory, or restore with --via stream, which holds no image files in memory"),
    ("Out of memory",
     "out of memory: free some memory (the restored job needs as much as it had at the dump), or restore "
     "with --via stream, which holds no image files in memory"),
]
RESTORE_FALLBACK = ("see CRIU's errors above and its full log; `gpusnap doctor` checks the usual suspects, and "
                    "`gpusnap verify` the snapshot")


def explain_restore(lines: list[str]) -> str:
    """Advice for a failed `criu restore`: restore's own rules, then the shared ones, then a
    pointer to the log; never empty."""
    text = "\n".join(lines)
    for needle, advice in RESTORE_RULES:
        if needle in text:
            return advice
    return explain(lines) or RESTORE_FALLBACK


def require_privileges(action: str) -> None:
    """CRIU needs root, or CAP_CHECKPOINT_RESTORE with CAP_SYS_PTRACE, for a dump or restore:
    the rule of ops/preflight.py privileges(), which `dump` and `doctor` apply too."""
    from gpusnap.errors import NotRoot
    from gpusnap.system import caps

    if os.geteuid() == 0 or caps.may_run_criu(caps.cap_eff()):
        return
    raise NotRoot(f"gpusnap {action} must run as root (CRIU needs it to {action} processes)",
                  hint=f"run `sudo gpusnap {action} ...`, or give gpusnap CAP_CHECKPOINT_RESTORE and "
                       "CAP_SYS_PTRACE")


def supervise(criu, server, progress=None, total: int = 0, stop=None) -> None:
    """Wait for a CRIU child while its image stream flows: report progress, and break the
    stream as soon as the streamer fails (CRIU then fails cleanly and, on dump, resumes the
    job), or when `stop()` says so (a restore interrupted). A pidfd wakes us the moment CRIU
    exits, rather than on the next poll."""
    import select

    try:
        pidfd = os.pidfd_open(criu.pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while criu.poll() is None:
            if progress:
                progress(server.bytes, total)
            if server.failed or (stop is not None and stop()):
                server.abort()
            if pidfd is not None:
                select.select([pidfd], [], [], 0.1)
            else:
                try:
                    criu.wait(timeout=0.1)
                except subprocess.TimeoutExpired:
                    pass
    finally:
        if pidfd is not None:
            os.close(pidfd)
