"""Tiered snapshots with many writers (docs/format.md §6 and §14): retention reads which
snapshots are still to be copied under the exclusive writer lock, so a snapshot another writer
marked pending while the retention waited for that lock is kept; the records of gone snapshots
are swept only under prune's locks (never while a writer may be between its commit and its
pending record), by every prune; the records two writers write at once never share a
temporary file. No CRIU: snapshots made by the repository's writer, marked as a tiered dump
marks them; the other writer is a process holding the lock (test_concurrent_writers.Holder)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gpusnap.errors import RepositoryLocked
from gpusnap.ops import prune as prune_op
from gpusnap.repo import Repository, copies
from gpusnap.repo.maint import prune as prune_mod
from repo_helpers import dump as fake_dump
from test_concurrent_writers import Holder


def _snaps(repo, n: int, name: str = "j") -> list:
    return [fake_dump(repo, {"pages-1.img": os.urandom(8 * 4096), "core-1.img": os.urandom(64)}, name=name)[0]
            for _ in range(n)]


def test_retention_reads_the_pending_records_under_the_exclusive_lock(tmp_path):
    """The retention's first look finds the oldest snapshot unmarked; while it waits for a
    writer to finish, that writer marks it pending (a tiered dump right after its commit):
    the retention, once exclusive, sees the record and keeps it."""
    repo = Repository.open(tmp_path / "a", create=True)
    snaps = _snaps(repo, 3)
    to = str(tmp_path / "b")
    writer = Holder(repo.path, "shared")
    waiting = threading.Event()
    repo.wait_for_locks(60, lambda text: waiting.set() if text.startswith("waiting") else None)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", prune_op.retain(repo, "j", 1)))
    t.start()
    try:
        assert waiting.wait(30), "the retention never waited for the writer"
        copies.mark_pending(repo.path, snaps[0], to)
    finally:
        writer.release()
        t.join(60)
    deleted, _ = out["r"]
    assert deleted == [snaps[1].id]
    assert [s.id for s in repo.snapshots()] == [snaps[0].id, snaps[2].id]


def test_records_of_gone_snapshots_are_swept_only_under_prunes_locks(tmp_path):
    repo = Repository.open(tmp_path / "a", create=True)
    snaps = _snaps(repo, 2)
    to = str(tmp_path / "b")
    for s in snaps:
        copies.mark_pending(repo.path, s, to)
    from gpusnap.ops.forget import forget

    forget(repo, [snaps[0].id])                  # no --prune: its record stays, ignored
    assert copies.pending(repo, to) == [snaps[1].path.name]
    assert set(copies.records(repo.path)) == {s.path.name for s in snaps}
    writer = Holder(repo.path, "shared")         # a writer that may not have written its record yet
    try:
        with pytest.raises(RepositoryLocked):
            copies.sweep(repo)
        assert set(copies.records(repo.path)) == {s.path.name for s in snaps}
    finally:
        writer.release()
    prune_mod.run(repo)                          # any prune sweeps them, under its exclusive locks
    assert set(copies.records(repo.path)) == {snaps[1].path.name}
    assert not [n for n in os.listdir(repo.path / "copies") if n.startswith(".")]


def test_two_writers_of_one_record_never_clash(tmp_path):
    """Two writers (a tiered dump catching up, `copy --pending`) write the same record at once:
    each through its own temporary name, the record always whole, nothing left behind."""
    repo = Repository.open(tmp_path / "a", create=True)
    (snap,) = _snaps(repo, 1)
    to = str(tmp_path / "b")
    errors: list = []
    stop = time.monotonic() + 2

    def write(state: str) -> None:
        try:
            while time.monotonic() < stop:
                copies.write_record(repo.path, snap.path.name, snap.id, to, state)
                recs = copies.records(repo.path)[snap.path.name]
                assert len(recs) == 1 and recs[0]["state"] in ("pending", "copied")
        except BaseException as e:          # noqa: BLE001 (reported below)
            errors.append(e)
    ts = [threading.Thread(target=write, args=(s,)) for s in ("pending", "copied")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert os.listdir(repo.path / "copies") == [f"{snap.path.name}.{copies._key(to)}"]
