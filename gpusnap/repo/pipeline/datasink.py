"""DataSink: any image of a dump that is not pages-*.img (core, mm, files, ...), cut into
1 MiB chunks stored as content-addressed data blobs (dedup by blake3, compressed one blob
at a time: encoder.encode_blob)."""

from __future__ import annotations

import blake3

from gpusnap.repo.pipeline.sinks import DATA_CHUNK, ImageSink


class DataSink(ImageSink):
    """Any image that is not pages-*.img: 1 MiB chunks stored as content-addressed blobs."""

    def __init__(self, w, filename, no):
        super().__init__(w, filename, no)
        self.buf = bytearray()
        self.h = blake3.blake3()
        self.blobs: list[str] = []

    def _write(self, data, hold=None) -> None:
        self.size += len(data)
        self.h.update(data)
        self.buf += data
        while len(self.buf) >= DATA_CHUNK:
            chunk = bytes(memoryview(self.buf)[:DATA_CHUNK])    # one copy, not slice + bytes
            del self.buf[:DATA_CHUNK]
            self.blobs.append(self._store_data(chunk).hex())

    def _close(self) -> dict:
        if self.buf:
            self.blobs.append(self._store_data(bytes(self.buf)).hex())
            self.buf = bytearray()
        self.c.bytes_raw = self.size
        return {"name": self.filename, "type": "blob", "size": self.size,
                "digest": self.h.hexdigest(), "blobs": self.blobs}
