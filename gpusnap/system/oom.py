"""Whom the OOM killer takes while a dump holds its staging memory: gpusnap, not the job.

A dump faults in a staging arena as large as its budget (up to the job's own size) before the
freeze and holds it until the snapshot is stored. Should memory run out meanwhile (another
process, or the job itself once it runs on), the kernel kills the process with the highest
badness, its memory weighted by oom_score_adj; without a word from us that is the job, the
largest process, and its work is lost for the sake of a snapshot. So a dump makes itself the
first to go (oom_score_adj 1000) from before its arena is faulted in until it ends, and puts
every process it starts that protects the job back to the value gpusnap began with: CRIU (it
holds the job frozen; a CRIU killed there would leave it so) and the guardian of `--exit`.
gpusnap killed in the middle of a dump costs only the snapshot: CRIU fails the dump and
resumes the job, and the guardian resumes a job that CRIU left stopped (tests/test_oom.py).
First, not only: a job that allocates while the kernel is still freeing gpusnap's memory can
be the same episode's second victim (seen in a memory cgroup squeezed to its limit, the job's
page-cache write invoking the second kill), which is why the default budget is half of what
the machine, or the dump's memory cgroup, has available (staging/budget.py, system/memcg.py).

Why lowering a child back is allowed: the kernel refuses only a value below the process's
oom_score_adj_min, and a writer without CAP_SYS_RESOURCE never moves that minimum, so the
value gpusnap started with stays within reach. GPUSNAP_DUMP_OOM_SCORE_ADJ sets the dump's
value (-1000 to 1000) or `keep` (gpusnap's own is left as it is)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from gpusnap import settings
from gpusnap.errors import UsageError

DUMP_SCORE = 1000     # the first to go, whatever its size

# the value gpusnap had before a dump raised it, for the processes it starts meanwhile
_before: int | None = None


def _path(pid: int | str) -> Path:
    return Path(f"/proc/{pid}/oom_score_adj")


def read(pid: int | str = "self") -> int | None:
    try:
        return int(_path(pid).read_text())
    except (OSError, ValueError):
        return None


def write(value: int, pid: int | str = "self") -> bool:
    try:
        _path(pid).write_text(str(value))
        return True
    except OSError:
        return False


def dump_score() -> int | None:
    """The value a dump runs with (GPUSNAP_DUMP_OOM_SCORE_ADJ, default 1000); None: `keep`."""
    raw = (settings.get("GPUSNAP_DUMP_OOM_SCORE_ADJ", "") or "").strip().lower()
    if not raw:
        return DUMP_SCORE
    if raw == "keep":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"GPUSNAP_DUMP_OOM_SCORE_ADJ must be a number from -1000 to 1000 or `keep`, "
                         f"not {raw!r}") from None
    if not -1000 <= value <= 1000:
        raise UsageError(f"GPUSNAP_DUMP_OOM_SCORE_ADJ must be from -1000 to 1000, not {value}")
    return value


@contextlib.contextmanager
def expendable():
    """While inside: this process is the OOM killer's first choice; then as it was. Yields
    the value it runs with (None where it was kept or could not be set)."""
    global _before
    want, before = dump_score(), read()
    if want is None or before is None or _before is not None or not write(want):
        yield None      # kept, unreadable, or already raised by an outer dump
        return
    _before = before
    try:
        yield want
    finally:
        _before = None
        write(before)


def spare(pid: int) -> None:
    """Put a process this dump started back to the value gpusnap began with (called at once
    after it starts: a CRIU just exec'd has not seized the job yet)."""
    if _before is not None:
        write(_before, pid)


def inherited() -> int | None:
    """The value a process started now should have, where a dump raised this one's; else None."""
    return _before
