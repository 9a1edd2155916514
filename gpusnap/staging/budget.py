"""The staging budget: how much memory a dump may stage CRIU's bytes in (choose_budget, the
default and why), and the sizes users give it (parse_size)."""

from __future__ import annotations

from pathlib import Path

from gpusnap import settings

JOB_MARGIN = 16 << 20      # beyond the job's anonymous memory: the small images


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError):
        pass
    return 0


def choose_budget(job_bytes: int | None = None) -> tuple[int, str]:
    """The default staging budget and why: a quarter of the memory available now, and never
    more than the job (its anonymous memory, about what CRIU streams, plus 16 MiB for the
    other images); GPUSNAP_STAGING_BUDGET (bytes, K/M/G suffix) overrides.
    No fixed ceiling: beyond the budget the spill file takes CRIU's bytes at the disk's speed
    while the job is frozen, and the storing reads them back, so a job that fits cuts both its
    freeze and its dump (4 GiB, memory backed by the host: 2 GiB budget frozen 1.59-1.63 s and
    committed 7.0-7.4 s, 4.1 GiB budget 0.85-0.86 s and 4.8-5.1 s, docs/benchmark.md); faulting
    the larger arena in (~0.16 s per GiB there) happens before the freeze. The quarter keeps
    the dump's peak memory (about the budget) to a share of what the machine has free."""
    env = settings.get("GPUSNAP_STAGING_BUDGET", "").strip()
    if env:
        return parse_size(env), "GPUSNAP_STAGING_BUDGET"
    avail = _mem_available()
    if not avail:
        budget, why = 256 << 20, "256 MiB (available memory unknown)"
    else:
        budget, why = avail // 4, f"a quarter of the {avail >> 20} MiB available"
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
