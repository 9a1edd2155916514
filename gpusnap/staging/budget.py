"""The staging budget: how much memory a dump may stage CRIU's bytes in (choose_budget, the
default and why), and the sizes users give it (parse_size)."""

from __future__ import annotations

from pathlib import Path

from gpusnap import settings

DEFAULT_CAP = 2 << 30      # the default budget's ceiling (see choose_budget)
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
    """The default staging budget and why: a quarter of the memory available now, at most
    2 GiB, and never more than the job (its anonymous memory, about what CRIU streams, plus
    16 MiB for the other images); GPUSNAP_STAGING_BUDGET (bytes, K/M/G suffix) overrides.
    Why no more than 2 GiB by default: beyond it the spill file takes CRIU's bytes at the
    disk's speed (spill.py), while fresh memory faulted in for a bigger arena cost ~1 s per
    GiB on the VMs measured here (docs/benchmark.md), and the dump's peak memory is the
    budget."""
    env = settings.get("GPUSNAP_STAGING_BUDGET", "").strip()
    if env:
        return parse_size(env), "GPUSNAP_STAGING_BUDGET"
    avail = _mem_available()
    if not avail:
        budget, why = 256 << 20, "256 MiB (available memory unknown)"
    elif avail // 4 < DEFAULT_CAP:
        budget, why = avail // 4, f"a quarter of the {avail >> 20} MiB available"
    else:
        budget, why = DEFAULT_CAP, f"the 2 GiB cap (a quarter of the {avail >> 20} MiB available is more)"
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
