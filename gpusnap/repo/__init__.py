"""The content-addressed, deduplicating snapshot repository (docs/format.md)."""

from .repository import Repository, Snapshot
from .writer import ImageSink, SnapshotWriter

__all__ = ["Repository", "Snapshot", "SnapshotWriter", "ImageSink"]
