"""The one error hierarchy of gpusnap: every failure a user can meet, its message and exit code.

The CLI maps any GpusnapError to `exit_code` in one place (cli.main); nothing else calls
sys.exit. `docs/exit-codes.md` lists the same table and a test keeps the two in step.
"""

from __future__ import annotations


class GpusnapError(Exception):
    """Base class. `message` says what happened, `hint` what to do about it."""

    exit_code = 1
    title = "internal error"

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(GpusnapError):
    exit_code = 2
    title = "bad command line"


class NotRoot(GpusnapError):
    exit_code = 3
    title = "not root"


class CriuUnavailable(GpusnapError):
    """CRIU is missing, older than 4.0, or too old for this job on this kernel (network sockets)."""

    exit_code = 4
    title = "CRIU missing or too old"


class ProcessNotFound(GpusnapError):
    exit_code = 5
    title = "no such process"


class SnapshotNotFound(GpusnapError):
    """The directory or name given is not a snapshot."""

    exit_code = 6
    title = "not a snapshot"


class PidsInUse(GpusnapError):
    exit_code = 7
    title = "PIDs in use"


class CriuFailed(GpusnapError):
    exit_code = 8
    title = "CRIU failed"

    def __init__(self, message: str, hint: str | None = None, log_path: str | None = None,
                 last_lines: list[str] | None = None):
        super().__init__(message, hint)
        self.log_path = log_path
        self.last_lines = last_lines or []


class CorruptSnapshot(GpusnapError):
    """Stored data does not match its checksum, or is missing or malformed."""

    exit_code = 9
    title = "corrupt snapshot"


class RepositoryLocked(GpusnapError):
    exit_code = 10
    title = "repository locked"


class NoSpace(GpusnapError):
    exit_code = 11
    title = "not enough disk space"


class GpuCheckpointFailed(GpusnapError):
    """The CUDA plugin could not lock, checkpoint or restore a GPU process."""

    exit_code = 12
    title = "GPU checkpoint failed"


class GpuMismatch(GpusnapError):
    """The snapshot's GPUs are not on this machine and no --gpu-map says where they go."""

    exit_code = 13
    title = "GPUs differ"


class RepositoryError(GpusnapError):
    """The repository is unusable: wrong format version, bad permissions, malformed config."""

    exit_code = 14
    title = "repository error"


class StreamProtocolError(GpusnapError):
    """CRIU's image stream broke the protocol (bad file name, short message, lost peer)."""

    exit_code = 15
    title = "image stream error"


class NotDumpable(GpusnapError):
    """The process is in a state CRIU cannot snapshot (found before anything is touched)."""

    exit_code = 16
    title = "cannot snapshot this process"


class RetentionFailed(GpusnapError):
    """The new snapshot is committed, but `dump --keep-last` could not prune the old ones."""

    exit_code = 21
    title = "retention failed"


class SchedulerUnavailable(GpusnapError):
    """Neither systemd nor a cron daemon runs here: a schedule would never run."""

    exit_code = 22
    title = "no scheduler"
class DamageRemains(GpusnapError):
    """`gpusnap repair` rebuilt what the packs hold, and some snapshots still need data that
    is in no pack."""

    exit_code = 19
    title = "damage remains after repair"


class FilesChanged(GpusnapError):
    """A file the snapshot's job had open changed or vanished since the dump, in a way restore
    cannot repair (an input file, or an output file that shrank); nothing was changed."""

    exit_code = 25
    title = "files changed"


class HugePagesUnavailable(GpusnapError):
    """The snapshot maps huge pages and this machine's huge-page pool cannot hold them."""

    exit_code = 26
    title = "not enough huge pages"


class GpuRestoreFailed(GpusnapError):
    """CRIU restored the tree but the CUDA plugin could not restore or unlock a GPU process;
    the half-restored tree was killed."""

    exit_code = 23
    title = "GPU restore failed"


class GpuUnsupportedProcess(GpusnapError):
    """A process of the job maps NVIDIA device files without a CUDA context (a forked
    DataLoader worker, an NVML-only monitor): CUDA checkpoint cannot handle it, CRIU cannot
    dump the device mapping. Found before the job is touched."""

    exit_code = 24
    title = "GPU device without a CUDA context"


class Interrupted(GpusnapError):
    exit_code = 130
    title = "interrupted"



class InterruptedAfterCommit(GpusnapError):
    """A signal landed after the dump's commit point: the snapshot IS committed (and
    restorable); what follows the commit (--exit stopping the job, --keep-last) did not run."""

    exit_code = 28
    title = "interrupted after the commit"

    def __init__(self, message: str, hint: str | None = None, snapshot: str | None = None):
        super().__init__(message, hint)
        self.snapshot = snapshot          # the committed snapshot's directory


class AccessDenied(GpusnapError):
    """This user may not read or change the repository (or file): usually another user's."""

    exit_code = 31
    title = "permission denied"


class BadExportFile(GpusnapError):
    """An export file (gpusnap export) is damaged, truncated or not one; nothing was imported."""

    exit_code = 32
    title = "bad export file"


class ContainerEngineFailed(GpusnapError):
    """The container engine (Podman) failed a checkpoint or a restore gpusnap asked of it;
    nothing was stored, or nothing restored."""

    exit_code = 33
    title = "container engine failed"


class CopyFailed(GpusnapError):
    """`gpusnap copy`: the connection to the destination broke (ssh failed, the other end
    died), or the other end's gpusnap or what it sent broke the copy protocol (a malformed
    frame, data that does not match its checksum); the snapshot in progress was not committed
    there, what arrived in finished packs stays for the next copy."""

    exit_code = 34
    title = "copy failed"


class NetnsMissing(GpusnapError):
    """The snapshot's job ran in a named network namespace (`ip netns`), which the restore joins
    again, and no network namespace is bound at that path now; nothing was restored."""

    exit_code = 35
    title = "network namespace missing"


class NativeLibraryMissing(GpusnapError):
    """A native part of gpusnap is missing or of another version: the page library
    (build/lib/libgpusnap_pages.so) or the post-dump gate (build/bin/gpusnap-gate)."""

    exit_code = 27
    title = "native part missing"

def all_error_classes() -> list[type[GpusnapError]]:
    """Every error class, base first, in exit-code order (for docs and tests)."""
    seen: list[type[GpusnapError]] = []
    stack = [GpusnapError]
    while stack:
        cls = stack.pop()
        seen.append(cls)
        stack.extend(cls.__subclasses__())
    return sorted(seen, key=lambda c: c.exit_code)
