"""A dump's staging, before and after CRIU: the budget chosen (and why, reported), the
early arena faulted in while the preflight runs (given back while the dump waits for
another gpusnap), and the throughput of each phase (--json, the snapshot's meta, inspect)."""

from __future__ import annotations

import os
import time

from gpusnap import settings, staging as staging_mod
from gpusnap.system import memcg, proc


def job_bytes(pid: int) -> int | None:
    """The tree's anonymous memory (about what CRIU streams); None where the preflight will
    refuse anyway (not root, no process)."""
    if os.geteuid() != 0 or not proc.exists(pid):
        return None
    try:
        return proc.anon_bytes(proc.tree(pid))
    except OSError:
        return None


def staging_budget(req) -> tuple[int, str]:
    """The dump's staging budget and how it was chosen (reported in --json's staging)."""
    if req.staging_budget is not None:
        return req.staging_budget, "--staging-budget"
    return staging_mod.choose_budget(job_bytes(req.pid), memcg.available())


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


def early_arena(pid: int, budget: int):
    """The staging arena, sized by the tree's anonymous memory (about what CRIU streams) and
    16 MiB for the rest, its faulting-in started; None where the preflight will refuse anyway
    (not root, no process) or not one slot fits the budget (everything then spills). Its
    threads stop short of running memory out (the machine's, or the memory cgroup's:
    Arena's guard), unless GPUSNAP_ARENA_GUARD is 0."""
    anon = job_bytes(pid)
    if anon is None:
        return None
    room = None if settings.get("GPUSNAP_ARENA_GUARD") == "0" else memcg.available
    return staging_mod.Arena.sized(budget, anon + staging_mod.JOB_MARGIN, room=room)


class EarlyArena:
    """The early arena, given back while this dump waits for another gpusnap (the job's
    host lock, the repository's writer lock: up to minutes) and made again once it may go on."""

    def __init__(self, pid: int, budget: int, choice: str = "given"):
        self.pid, self.budget = pid, budget
        self.choice = choice    # how the budget was chosen (staging_budget), reported
        self.arena = early_arena(pid, budget)
        self.released = False
        self.in_use = False     # the staging has it (from then on only the end frees it)

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
            self.arena = early_arena(self.pid, self.budget)
            self.released = False
