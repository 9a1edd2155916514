"""The staging budget: how much memory a dump may stage CRIU's bytes in (choose_budget, the
default and why), and the sizes users give it (parse_size)."""

from __future__ import annotations

from pathlib import Path

from gpusnap import settings

JOB_MARGIN = 16 << 20      # beyond the job's anonymous memory: the small images
SHARE = 2                  # the default budget: 1/SHARE of the memory available


def _mem_available() -> int:
    """The machine's MemAvailable (0 where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError):
        pass
    return 0


def choose_budget(job_bytes: int | None = None, available: tuple[int | None, str] | None = None) -> tuple[int, str]:
    """The default staging budget and why: half the memory available now, and never more than
    the job (its anonymous memory, about what CRIU streams, plus 16 MiB for the other images);
    GPUSNAP_STAGING_BUDGET (bytes, K/M/G suffix) overrides. `available` is that memory and
    where the figure comes from (a dump passes system/memcg.py's: what its memory cgroup leaves
    where that is less than the machine's, as inside a Slurm job); else the machine's MemAvailable.
    No fixed ceiling: beyond the budget the spill file takes CRIU's bytes at the disk's speed
    while the job is frozen, so the freeze of a job that fits is a copy into memory and one that
    does not waits for the disk (8 GiB of random bytes, 24 GiB machine: a budget of a quarter
    of the memory available, 3.5 GiB, froze it for 0.70-0.92x raw CRIU's freeze, its whole size
    for 0.35x; docs/benchmark.md); faulting the larger arena in happens before the freeze.
    Half, not all: the job runs on beside the snapshot's memory until it is stored, and the
    page cache keeps the rest; should memory still run out, the OOM killer takes the dump,
    not the job (system/oom.py)."""
    env = settings.get("GPUSNAP_STAGING_BUDGET", "").strip()
    if env:
        return parse_size(env), "GPUSNAP_STAGING_BUDGET"
    if available is None:
        n = _mem_available()
        available = (n, f"the {n >> 20} MiB available") if n else (None, "available memory unknown")
    avail, where = available
    if avail is None:
        budget, why = 256 << 20, f"256 MiB ({where})"
    else:
        budget, why = avail // SHARE, f"half {where}"
    if job_bytes is not None and job_bytes + JOB_MARGIN < budget:
        budget, why = job_bytes + JOB_MARGIN, f"the job's {job_bytes >> 20} MiB of memory + 16 MiB ({why} is more)"
    return budget, why


def default_budget(job_bytes: int | None = None) -> int:
    """choose_budget()'s bytes."""
    return choose_budget(job_bytes)[0]


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        n = int(float(num) * mult)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (bytes, or a number with K, M or G)") from None
    if n < 0:
        raise ValueError(f"not a size: {text!r}")
    return n
