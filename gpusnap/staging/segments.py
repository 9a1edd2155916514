"""The runs of a dump's staged images (staging.py): Segment (a slot, bytes or a spill
extent) and the claims on it (Hold: page groups pointing into a slot, sinks.PagesSink),
StagedImage (one image's segments, the drain appending, the ingest taking), and
releaser(), which lets go of a batch's claims."""

from __future__ import annotations

import collections
import threading
from typing import Iterable


class StagingCancelled(Exception):
    """The dump is being unwound: the ingest stops."""


class Segment:
    """A run of one image's bytes: a slot of the arena, a bytes object, or a spill extent.
    refs: the claims on it (the ingest's own, and Holds); freed when the last is let go.
    ready: for a spill extent written directly (spill.py), set once its write has ended."""
    __slots__ = ("slot", "data", "offset", "length", "refs", "ready")

    def __init__(self, length: int, slot: int = -1, data: bytes | None = None, offset: int = -1):
        self.slot, self.data, self.offset, self.length = slot, data, offset, length
        self.refs = 1
        self.ready: threading.Event | None = None


class Hold:
    """Claims on a staged slot beyond the ingest's own. The page pipeline's groups point into
    the slot instead of copying their pages out of it (sinks.PagesSink); each group's claim
    is let go once the pack writer has its bytes, and the slot is freed (or reused) only
    after the last one. A copy of every new page on the ingest's thread was a third of its
    time (the memmove and the page faults of fresh group buffers)."""
    __slots__ = ("staging", "seg")

    def __init__(self, staging, seg: Segment):
        self.staging, self.seg = staging, seg

    def retain(self, n: int) -> None:
        self.staging.retain(self.seg, n)

    def release(self, n: int) -> None:
        self.staging.release(self.seg, n)


class StagedImage:
    """One image's segments in stream order: the drain appends, the ingest takes."""

    def __init__(self, staging, name: str):
        self.staging = staging
        self.name = name
        self._segs: collections.deque[Segment] = collections.deque()
        self._cond = threading.Condition()
        self._eof = False
        self.bytes = 0
        self.writing: list[Segment] = []     # spill extents whose direct write may not have ended

    def put(self, seg: Segment) -> None:
        with self._cond:
            self._segs.append(seg)
            self.bytes += seg.length
            self._cond.notify()

    def end(self) -> None:
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def take(self) -> Segment | None:
        """The next segment (waiting for the drain if needed); None at the image's end."""
        st = self.staging
        with self._cond:
            while True:
                if st.cancelled:
                    raise StagingCancelled()
                if self._segs:
                    return self._segs.popleft()
                if self._eof:
                    return None
                self._cond.wait(0.2)

    def discard(self) -> None:
        with self._cond:
            segs, self._segs = list(self._segs), collections.deque()
        for s in segs:
            self.staging.release(s)


def releaser(holds: Iterable[list]):
    """A function letting go of every claim in `holds` (lists of Holds, one entry per
    claim), or None when there is none."""
    counts: dict = {}
    for hs in holds:
        for h in hs:
            counts[h] = counts.get(h, 0) + 1
    if not counts:
        return None

    def done() -> None:
        for h, n in counts.items():
            h.release(n)
    return done
