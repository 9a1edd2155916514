"""Restore without copying zero pages: the images CRIU reads leave out runs of zero pages
of private anonymous memory, and the pagemaps say so.

A zero page the job had touched is stored as a marker (docs/format.md), yet CRIU restores
it like any other: gpusnap writes 4 KiB of zeros into the pages image and CRIU copies them
into the new process. In private anonymous memory a page that is not in the image at all
is the same thing (it reads as zeros and is allocated on first write), so for restore a
run of zero pages there is left out of the pages image and its pagemap entry is split
around it. Not left out: pages of file-backed, shared, special (vdso, vvar, AIO, memfd,
plugin-managed, guard) and hugetlb mappings, where a missing page means other content,
and every image whose pagemap uses a parent image. Where a forked child shares a
copy-on-write area with its parent, CRIU drops the parent's pages the child's image does
not list (criu/mem.c, restore_priv_vma_content), so a left-out page is zero there too.

Only runs of at least MIN_RUN pages are left out: each one costs a pagemap entry. The
snapshot is untouched; export and inspect still see the images exactly as CRIU wrote them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from gpusnap.criu import images
from gpusnap.criu.images import PE_LAZY, PE_PARENT, PE_PRESENT  # noqa: F401 - named here too (tests use sparse.PE_*)

PAGE = 4096
MIN_RUN = 16                     # pages (64 KiB): shorter zero runs stay in the image

# criu/include/image.h (VmaEntry.status); pagemap.h (PagemapEntry.flags): criu/images.py
VMA_AREA_REGULAR = 1 << 0
VMA_AREA_STACK = 1 << 1
VMA_AREA_HEAP = 1 << 5
VMA_ANON_PRIVATE = 1 << 9
_PLAIN = VMA_AREA_REGULAR | VMA_AREA_STACK | VMA_AREA_HEAP | VMA_ANON_PRIVATE
MAP_HUGETLB = 0x40000


@dataclass
class Sparse:
    """What a restore leaves out. drop: pages image -> sorted (first page, count) runs;
    pagemaps: pagemap image -> its rewritten bytes; size: pages image -> its new size."""
    drop: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    pagemaps: dict[str, bytes] = field(default_factory=dict)
    size: dict[str, int] = field(default_factory=dict)
    pages_left_out: int = 0


def plain_anonymous(vma: dict) -> bool:
    """A private anonymous mapping with nothing special about it (a missing page reads 0)."""
    st = vma["status"]
    return (st & (VMA_AREA_REGULAR | VMA_ANON_PRIVATE)) == (VMA_AREA_REGULAR | VMA_ANON_PRIVATE) \
        and not st & ~_PLAIN and not vma["flags"] & MAP_HUGETLB


def droppable(entries: list[dict], vmas: list[dict]) -> list[tuple[int, int]] | None:
    """The page-index runs of the pages image (as the pagemap `entries` lay it out) that lie
    in plain anonymous mappings; None if the pagemap refers to a parent image."""
    spans = sorted((v["start"], v["end"]) for v in vmas if plain_anonymous(v))
    starts = [s for s, _ in spans]
    out: list[tuple[int, int]] = []
    idx = 0
    for e in entries:
        flags, va, n = e["flags"], e["vaddr"], e["nr_pages"]
        if flags & PE_PARENT:
            return None
        if not flags & PE_PRESENT:
            continue                      # not in the pages image
        end = va + n * PAGE
        i = max(0, bisect.bisect_right(starts, va) - 1)
        while i < len(spans) and spans[i][0] < end:
            lo, hi = max(va, spans[i][0]), min(end, spans[i][1])
            if lo < hi:
                _add(out, idx + (lo - va) // PAGE, (hi - lo) // PAGE)
            i += 1
        idx += n
    return out


def _add(runs: list, first: int, count: int) -> None:
    if runs and runs[-1][0] + runs[-1][1] == first:
        runs[-1] = (runs[-1][0], runs[-1][1] + count)
    else:
        runs.append((first, count))


def zero_runs(refs) -> list[tuple[int, int]] | None:
    """(first page, count) of the zero-page runs in a page list's records; None when the
    image has a tail (not whole pages: left as it is)."""
    out: list[tuple[int, int]] = []
    idx = 0
    for rec in refs:
        if rec[0] == "zero":
            _add(out, idx, rec[1])
            idx += rec[1]
        elif rec[0] == "pages":
            idx += len(rec[1]) // 16
        else:
            return None
    return out


def intersect(a: list[tuple[int, int]], b: list[tuple[int, int]], min_run: int = MIN_RUN) -> list[tuple[int, int]]:
    """Runs in both sorted run lists, those of at least min_run pages."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][0] + a[i][1], b[j][0] + b[j][1])
        if hi - lo >= min_run:
            out.append((lo, hi - lo))
        if a[i][0] + a[i][1] < b[j][0] + b[j][1]:
            i += 1
        else:
            j += 1
    return out


def split_entries(entries: list[dict], drop: list[tuple[int, int]]) -> list[dict]:
    """The pagemap entries with the dropped page-index runs taken out (entries split)."""
    out = []
    idx = 0
    d = 0
    for e in entries:
        flags, n = e["flags"], e["nr_pages"]
        if not flags & PE_PRESENT:
            out.append(e)
            continue
        lo, end = idx, idx + n
        while lo < end:
            while d < len(drop) and drop[d][0] + drop[d][1] <= lo:
                d += 1
            if d < len(drop) and drop[d][0] <= lo:          # lo is dropped: skip the run
                lo = min(end, drop[d][0] + drop[d][1])
                continue
            hi = min(end, drop[d][0]) if d < len(drop) else end
            out.append({**e, "vaddr": e["vaddr"] + (lo - idx) * PAGE, "nr_pages": hi - lo})
            lo = hi
        idx = end
    return out


def plan(snap) -> Sparse:
    """The runs to leave out of each pages image of `snap`, and the pagemaps to match. An
    image whose pagemap or mm image does not read as expected is left whole."""
    sp = Sparse()
    for name, pid in images.pagemaps(snap):
        mm_name = f"mm-{pid}.img"
        if not snap.has_image(mm_name):
            continue
        raw = images.read(snap, name)
        try:
            pages_id, entries = images.pagemap(raw)
            vmas = images.vmas(images.read(snap, mm_name))
        except (ValueError, KeyError, StopIteration):
            continue                      # CRIU reports what is wrong with it, if anything
        pages = f"pages-{pages_id}.img"
        if not snap.has_image(pages) or snap.image(pages)["type"] != "pages":
            continue
        runs = droppable(entries, vmas)
        zeros = zero_runs(snap.iter_page_refs(pages)) if runs else None
        drop = intersect(zeros, runs) if zeros else []
        if not drop:
            continue
        left_out = sum(c for _, c in drop)
        sp.drop[pages] = drop
        sp.pagemaps[name] = images.rewrite_pagemap(raw, split_entries(entries, drop))
        sp.size[pages] = int(snap.image(pages)["size"]) - left_out * PAGE
        sp.pages_left_out += left_out
    return sp
