"""Staging fed as CRIU feeds it and read as the ingest reads it (tests/test_staging.py,
tests/test_arena.py): real pipes, a writer thread, every segment released."""

from __future__ import annotations

import os
import threading

from gpusnap import staging as st


def _pattern(n: int, seed: int = 7) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


def _stage(staging: st.Staging, data: bytes, pages: bool, chunk: int = 1 << 16, started=None) -> st.StagedImage:
    """A writer thread feeds `data` through a pipe, as CRIU does, while the drain stages it;
    started(image) is called once the image exists (an ingest may take from it meanwhile)."""
    r, w = os.pipe()

    def feed():
        view = memoryview(data)
        while view:
            n = os.write(w, view[:chunk])
            view = view[n:]
        os.close(w)

    t = threading.Thread(target=feed)
    t.start()
    image = st.StagedImage(staging, "pages-1.img" if pages else "core-1.img")
    if started is not None:
        started(image)
    try:
        staging.stage_pipe(r, image, pages)
    finally:
        os.close(r)
        t.join()
    return image


def _ingest(staging: st.Staging, image: st.StagedImage) -> bytes:
    out = []
    while (seg := image.take()) is not None:
        data = staging.read(seg)
        out.append(bytes(data))
        if isinstance(data, memoryview):
            data.release()
        staging.release(seg)
    return b"".join(out)
