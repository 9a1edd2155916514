"""The content-addressed, deduplicating snapshot repository (docs/format.md)."""

from gpusnap.repo.repository import Repository, Snapshot
from gpusnap.repo.pipeline.writer import ImageSink, SnapshotWriter

__all__ = ["Repository", "Snapshot", "SnapshotWriter", "ImageSink"]
