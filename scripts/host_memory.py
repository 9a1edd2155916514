"""Memory backed by the host for a benchmark run: free page reporting held off, free memory
faulted in once (scripts/bench.py, scripts/bench_growth.py).

On a VM whose balloon reports free pages to its host (virtio-balloon free page reporting, as
on the 2-core VMs measured here), memory the guest frees is handed back at once, and whoever
touches it next faults it in from the host again (~1 s per GiB here). Which side of a
benchmark pays depends on what ran before: raw CRIU's images go to the page cache while the
job is frozen, so raw CRIU paid it inside its freeze (1 GiB: 0.4 s, 1.3-2.4 s right after a
gpusnap dump on the same job; 4 GiB: 2-4 s, 10-12 s), while gpusnap writes around the page
cache and faults its staging arena in before it freezes the job. Ratios measured so compare
gpusnap against a raw CRIU slowed by the VM, not by its design. On bare metal (a GPU
workstation) memory stays backed; `HostBacked` gives both sides that for the run and puts
the kernel's setting back after it.
"""

from __future__ import annotations

import mmap
import signal
import threading
from pathlib import Path

from gpusnap.staging.arena import PAGE_REPORTING_ORDER   # (what a dump's arena decides its huge pages from)
from gpusnap.staging.budget import _mem_available   # (what a dump's budget is chosen from)

PARAMS = PAGE_REPORTING_ORDER.parent
CHUNK = 1 << 30
MADV_POPULATE_WRITE = 23   # (Linux 5.14; not in Python's mmap module before 3.14)


def _reported_kib(params: Path) -> int | None:
    try:
        return int((params / "reported_kib").read_text())
    except (OSError, ValueError):
        return None


def fault_in(nbytes: int) -> int:
    """Fault in nbytes of fresh anonymous memory at once (1 GiB mappings, every page populated),
    then free it all: the guest's free memory is then backed by the host. Returns the bytes
    touched (fewer when memory runs out)."""
    maps: list[mmap.mmap] = []
    done = 0
    try:
        while done < nbytes:
            n = min(CHUNK, nbytes - done)
            try:
                m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except OSError:
                break
            maps.append(m)
            try:
                m.madvise(MADV_POPULATE_WRITE)
            except OSError:                    # (out of memory: what was faulted in stays counted)
                break
            done += n
    finally:
        for m in maps:
            m.close()
    return done


def _exit_on_term(signum, frame) -> None:  # noqa: ARG001
    raise SystemExit(128 + signum)


class HostBacked:
    """with HostBacked(): free page reporting held off (the highest order the kernel takes,
    above every free block) and the free memory but `keep` faulted in once; the old order is
    put back on exit. Where the guest reports no free pages (bare metal, no balloon), it does
    nothing. `summary` says what was done, for the benchmark's report."""

    def __init__(self, params: Path = PARAMS, keep: int = 1536 << 20, warm: int | None = None):
        self.params, self.keep, self.warm = params, keep, warm
        self.order_file = params / "page_reporting_order"
        self.old: str | None = None
        self.reported_before: int | None = None
        self._old_term = None
        self.summary: dict = {"page_reporting": "none (memory stays backed)"}

    def __enter__(self) -> "HostBacked":
        try:
            self.old = self.order_file.read_text().strip()
        except OSError:
            return self
        if threading.current_thread() is threading.main_thread():
            # a benchmark stopped by SIGTERM (timeout, kill) unwinds too, so the order is put back
            self._old_term = signal.signal(signal.SIGTERM, _exit_on_term)
        held = None
        for order in (11, 10):          # 11: above the buddy allocator's largest block (order 10)
            if int(self.old) >= order:
                break
            try:
                self.order_file.write_text(f"{order}\n")
            except OSError:
                continue
            held = order
            break
        self.reported_before = _reported_kib(self.params)
        want = self.warm if self.warm is not None else max(0, _mem_available() - self.keep)
        touched = fault_in(want) if held is not None else 0
        self.summary = {"page_reporting": f"held off for the run (order {self.old} -> {held})" if held is not None
                        else f"left on (order {self.old}: the kernel took no higher one)",
                        "faulted_in_gib": round(touched / (1 << 30), 1)}
        return self

    def __exit__(self, *exc) -> None:
        if self.old is None:
            return
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
        after = _reported_kib(self.params)
        if after is not None and self.reported_before is not None:
            self.summary["reported_during_run_mib"] = (after - self.reported_before) >> 10
        try:
            self.order_file.write_text(f"{self.old}\n")
        except OSError as e:
            self.summary["restore_failed"] = f"could not put page_reporting_order back to {self.old}: {e}"
