"""What criu/ needs from outside, stated once. criu/ never imports the repository: ops/ hands
it the repository's implementations of these.

- ImageNames: the rule for image names (repo/format/names.py): which names CRIU may send on
  its socket, and which are pages images.
- SinkFactory: where each image CRIU dumps goes (SnapshotWriter.image_sink).
- ImageSource: where each image CRIU restores comes from (Snapshot.read_image).
- PageJobs: a snapshot's pages images as jobs read in any order, for the lazy restore's fill
  (repo/reader.py PageJobs, from Snapshot.page_jobs()).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol


class ImageNames(Protocol):
    def image_name_problem(self, name: str) -> str | None: ...   # None: a valid image name
    def is_pages_image(self, name: str) -> bool: ...


class ImageSink(Protocol):
    def write(self, data: bytes, hold=None) -> None: ...   # hold: a staging.Hold on a slot view
    def close(self) -> None: ...


SinkFactory = Callable[[str], ImageSink]
# Returns the image's bytes as chunks, or None when the image does not exist.
ImageSource = Callable[[str], "Iterable[bytes] | None"]


class PageJobs(Protocol):
    def jobs(self, name: str, job_bytes: int, drop: list | None = None) -> Iterator: ...
    def open_reader(self): ...                             # one per thread; has close()
    def build(self, name: str, job, rd) -> bytearray | None: ...   # checked; None: all zero
