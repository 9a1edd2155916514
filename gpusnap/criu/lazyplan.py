"""What a lazy restore fills: the lazy pieces of each restored process, and what is still pending.

plan() reads (criu/images.py) the pagemaps (as the restore hands them to CRIU:
criu/sparse.py may have rewritten them) and mm images of a snapshot: every PE_LAZY entry
(private anonymous memory CRIU leaves to the lazy-pages daemon) becomes pieces [offset in
the pages image, address, length], cut at mapping ends (one UFFDIO_COPY cannot span two
mappings). Mm keeps, per restored process, the pieces not copied yet, and follows what the
process does meanwhile (fork: a copy; mremap: moved; munmap, MADV_DONTNEED: dropped). Pure bookkeeping, no system
calls: criu/lazypages.py is the daemon that uses it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from gpusnap.criu import images
from gpusnap.criu.images import PE_LAZY, PE_PARENT, PE_PRESENT
from gpusnap.errors import CorruptSnapshot, UsageError

PAGE = 4096


@dataclass
class LazyPlan:
    """What the daemon fills. tasks: PID (as in the image names) -> pages image name and its
    lazy pieces [offset in the pages image, address, length], cut at mapping ends; holes:
    pages image -> sorted (start, end) byte ranges the image files may leave out (CRIU does
    not read lazy pages); bytes: the lazy bytes in all."""
    tasks: dict[int, tuple[str, list[list[int]]]] = field(default_factory=dict)
    holes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    bytes: int = 0


def plan(snap, sp=None) -> LazyPlan:
    """The lazy pieces of every task of `snap`, read from its pagemaps (as restore hands them
    to CRIU: `sp`, criu/sparse.py, may have rewritten some) and mm images."""
    lp = LazyPlan()
    for name, pid in images.pagemaps(snap):
        raw = sp.pagemaps[name] if sp is not None and name in sp.pagemaps else images.read(snap, name)
        mm_name = f"mm-{pid}.img"
        try:
            pages_id, entries = images.pagemap(raw)
            vmas = images.vmas(images.read(snap, mm_name)) if snap.has_image(mm_name) else []
        except (ValueError, KeyError, StopIteration) as e:
            raise CorruptSnapshot(f"snapshot {snap.path} has an unreadable {name} or {mm_name}: {e}") from None
        pages = f"pages-{pages_id}.img"
        spans = sorted((v["start"], v["end"]) for v in vmas)
        starts = [s for s, _ in spans]
        pieces: list[list[int]] = []
        off = 0
        for e in entries:
            flags, va, n = e["flags"], e["vaddr"], e["nr_pages"]
            if flags & PE_PARENT:
                raise UsageError(f"snapshot {snap.path} keeps pages in a parent image, which a lazy restore "
                                 "cannot serve", hint="restore it with --via files or --via stream")
            if not flags & PE_PRESENT:
                continue
            if flags & PE_LAZY:
                end = va + n * PAGE
                i = max(0, bisect.bisect_right(starts, va) - 1)
                while i < len(spans) and spans[i][0] < end:
                    lo, hi = max(va, spans[i][0]), min(end, spans[i][1])
                    if lo < hi:
                        pieces.append([off + lo - va, lo, hi - lo])
                    i += 1
            off += n * PAGE
        if not pieces:
            continue
        if not snap.has_image(pages) or snap.image(pages)["type"] != "pages":
            raise UsageError(f"snapshot {snap.path}: {pages} is not stored as pages, so it cannot be "
                             "restored lazily", hint="restore it with --via files or --via stream")
        size = sp.size.get(pages) if sp is not None and pages in sp.size else int(snap.image(pages)["size"])
        if off > size:         # the pagemap is data: it may not point past its pages
            raise CorruptSnapshot(f"snapshot {snap.path}: {name} lists {off} bytes of pages, {pages} "
                                  f"holds {size}")
        lp.tasks[pid] = (pages, pieces)
        holes = lp.holes.setdefault(pages, [])
        for o, _, ln in pieces:
            if holes and holes[-1][1] == o:
                holes[-1] = (holes[-1][0], o + ln)
            else:
                holes.append((o, o + ln))
        lp.bytes += sum(p[2] for p in pieces)
    for h in lp.holes.values():
        h.sort()
    return lp


# -- one restored process's pending memory ---------------------------------------------------

def _cut(p: list[int], a: int, b: int) -> tuple[list | None, list | None, list | None]:
    """Piece p split by the address range [a, b): (before, inside, after), each or None."""
    off, va, ln = p
    lo, hi = max(va, a), min(va + ln, b)
    if lo >= hi:
        return (p, None, None) if va + ln <= a else (None, None, p)
    before = [off, va, lo - va] if lo > va else None
    inside = [off + lo - va, lo, hi - lo]
    after = [off + hi - va, hi, va + ln - hi] if va + ln > hi else None
    return before, inside, after


class Mm:
    """A restored process's userfaultfd and what is still to be copied into it: per pages
    image, pieces [image offset, address, length] sorted by offset."""

    def __init__(self, fd: int, pending: dict[str, list[list[int]]]):
        self.fd = fd
        self.pending = pending

    def bytes_pending(self) -> int:
        return sum(p[2] for ps in self.pending.values() for p in ps)

    def take(self, img: str, lo: int, hi: int) -> list[list[int]]:
        """Remove and return the pending pieces of image bytes [lo, hi) (cut to them)."""
        ps = self.pending.get(img)
        if not ps:
            return []
        i = max(0, bisect.bisect_right(ps, lo, key=lambda p: p[0]) - 1)
        out, keep = [], []
        j = i
        while j < len(ps) and ps[j][0] < hi:
            off, va, ln = ps[j]
            a, b = max(off, lo), min(off + ln, hi)
            if a >= b:
                keep.append(ps[j])
            else:
                if a > off:
                    keep.append([off, va, a - off])
                out.append([a, va + a - off, b - a])
                if off + ln > b:
                    keep.append([b, va + b - off, off + ln - b])
            j += 1
        ps[i:j] = keep
        return out

    def put(self, img: str, piece: list[int]) -> None:
        bisect.insort(self.pending.setdefault(img, []), piece, key=lambda p: p[0])

    def find(self, addr: int) -> tuple[str, int] | None:
        """(pages image, offset) of the pending page at addr, or None."""
        for img, ps in self.pending.items():
            for off, va, ln in ps:
                if va <= addr < va + ln:
                    return img, off + addr - va
        return None

    def drop(self, a: int, b: int) -> None:
        """Addresses [a, b) were unmapped or MADV_DONTNEED'd: nothing to copy there any more."""
        for img, ps in self.pending.items():
            out = []
            for p in ps:
                before, _, after = _cut(p, a, b)
                out.extend(x for x in (before, after) if x)
            ps[:] = out

    def remap(self, frm: int, to: int, length: int) -> None:
        for ps in self.pending.values():
            out = []
            for p in ps:
                before, inside, after = _cut(p, frm, frm + length)
                if inside:
                    inside[1] += to - frm
                out.extend(x for x in (before, inside, after) if x)
            ps[:] = out

    def clone(self, fd: int) -> "Mm":
        return Mm(fd, {img: [list(p) for p in ps] for img, ps in self.pending.items()})
