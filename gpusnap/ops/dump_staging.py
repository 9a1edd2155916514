"""A dump's staging, before and after CRIU: the budget chosen (and why, reported), the
early arena faulted in while the preflight runs (given back while the dump waits for
another gpusnap), and the throughput of each phase (--json, the snapshot's meta, inspect)."""

from __future__ import annotations

import os
import time

from gpusnap import settings, staging as staging_mod
from gpusnap.system import memcg, proc


def job_facts(pid: int) -> tuple[int | None, bool]:
    """The tree's anonymous memory (about what CRIU streams; None where the preflight will
    refuse anyway: not root, no process), and whether a process of the tree touches NVIDIA
    (libcuda mapped, a /dev/nvidia* file open): only then may the preflight find GPU memory
    to stage."""
    if os.geteuid() != 0 or not proc.exists(pid):
        return None, False
    try:
        pids = proc.tree(pid)
        anon = proc.anon_bytes(pids)
    except OSError:
        return None, False
    from gpusnap.gpu import procs as gpu_procs

    return anon, any(gpu_procs.scan_process(p) is not None for p in pids)


def throughput(staging, phases: dict, t0: float) -> dict:
    """CRIU's bytes per second of each phase so far (MB/s): criu_mb_s (over the 'criu' phase:
    into staging, the job frozen), storing_mb_s (over 'storing': what the pipeline had left
    once CRIU exited), dump_mb_s (the whole dump); and the staging's budget and spill."""
    n = staging.staged

    def rate(sec) -> float | None:
        return round(n / sec / 1e6, 1) if sec else None
    return {"criu_mb_s": rate(phases.get("criu")), "storing_mb_s": rate(phases.get("storing")),
            "dump_mb_s": rate(time.monotonic() - t0), "bytes": n,
            "spill_mode": staging.spill_mode or None, "spilled_bytes": staging.spilled,
            "staging_budget": staging.budget, "budget_choice": staging.budget_choice,
            "arena_short": staging.arena_short}


def gpu_bytes(gpu: dict | None) -> int:
    """The GPU memory of the tree's processes (the preflight's GPU facts, from NVML through
    nvidia-smi; 0 where unknown): what a CUDA checkpoint moves into their host memory inside
    CRIU, after the tree's anonymous memory was measured."""
    return sum(p.get("memory_bytes") or 0 for p in (gpu or {}).get("processes") or [])


class EarlyArena:
    """The dump's staging budget (and why: reported in --json's staging) and its early arena,
    sized by the tree's anonymous memory (about what CRIU streams) and 16 MiB for the rest, its
    faulting-in started as the dump begins; None where the preflight will refuse anyway (not
    root, no process) or not one slot fits the budget (everything then spills). Its threads
    stop short of running memory out (the machine's, or the memory cgroup's: Arena's guard),
    unless GPUSNAP_ARENA_GUARD is 0.

    add_gpu(): a GPU job's device memory, known once the preflight asked the driver, raises
    the default budget (the job is host and device memory) and the arena: faulted in on top
    while the dump goes on. A tree that touches NVIDIA has its arena mapped up to the largest
    budget from the start, so that it grows in place; any other tree's is mapped at its size
    (address space counts where the kernel commits it strictly, vm.overcommit_memory=2).
    Given back while this dump waits for another gpusnap (the job's host lock, the
    repository's writer lock: up to minutes) and made again once it may go on."""

    def __init__(self, req):
        self.pid = req.pid
        self.host, self._nvidia = job_facts(req.pid)
        self.gpu = 0
        self._available = memcg.available()     # one reading: the budget's, raised or not
        if req.staging_budget is not None:
            self.budget, self.choice = req.staging_budget, "--staging-budget"
            self._fixed = True
        else:
            self.budget, self.choice = staging_mod.choose_budget(self.host, self._available)
            self._fixed = self.choice == "GPUSNAP_STAGING_BUDGET"
        # the most the budget may become (the default without the job's size to bound it)
        self._cap = self.budget if self._fixed else staging_mod.choose_budget(None, self._available)[0]
        self.released = False
        self.in_use = False     # the staging has it (from then on only the end frees it)
        self.arena = self._make()

    def _want(self) -> int:
        return (self.host or 0) + self.gpu + staging_mod.JOB_MARGIN

    def _make(self):
        if self.host is None:
            return None
        room = None if settings.get("GPUSNAP_ARENA_GUARD") == "0" else memcg.available
        return staging_mod.Arena.sized(self.budget, self._want(), room=room, keep=self.gpu,
                                       capacity=self._cap if self._nvidia else 0)

    def add_gpu(self, gpu: dict | None) -> None:
        """The tree's GPU memory (the preflight's GPU facts) counted in: the budget raised
        where it was the default, the arena grown (up to the budget) or made."""
        n = gpu_bytes(gpu)
        if n <= self.gpu or self.host is None:
            return
        self.gpu = n
        if not self._fixed:
            # the checkpoint also grows the job's host memory by as much: only the rest is available
            avail, where = self._available
            if avail is not None:
                avail, where = max(0, avail - n), f"{where} less the job's {n >> 20} MiB of GPU memory"
            self.budget, why = staging_mod.choose_budget(self.host + n, (avail, where))
            self.choice = f"{why}; {n >> 20} MiB of it GPU memory" if why.startswith("the job's") else why
        if self.in_use or self.released:
            return          # (again() makes it with the GPU memory in)
        if self.arena is None:
            self.arena = self._make()
        else:
            self.arena.grow_to(min(self.budget, self._want()) // staging_mod.SEG, keep=n)

    def take(self):
        self.in_use = True
        return self.arena

    def release(self, final: bool = False) -> None:
        if self.arena is not None and (final or not self.in_use):
            self.arena.close()
            self.arena = None
            self.released = True

    def again(self) -> None:
        if self.released and self.arena is None:
            self.arena = self._make()
            self.released = False
