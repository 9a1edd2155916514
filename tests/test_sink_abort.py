"""A dump aborted (a signal on the main thread) while an image's drain thread is starting the
page compressors (gpusnap/repo/pipeline/sinks.py): the abort must neither fail ("cannot join
thread before it is started", seen once in test_faults under load) nor leave a compressor
running, and the drain thread gets the abort as its error."""

from __future__ import annotations

import os
import threading

import pytest

from gpusnap.errors import RepositoryError
from gpusnap.repo.pipeline import sinks
from gpusnap.repo.repository import Repository

PAGE = 4096


def test_abort_while_the_compressors_are_starting(tmp_path, monkeypatch):
    starting = threading.Event()     # the drain thread is inside the first compressor's start()
    go_on = threading.Event()        # ... and stays there until the abort has run

    class HeldThread(threading.Thread):
        def start(self):
            if self.name.startswith("gpusnap-pages-") and not starting.is_set():
                starting.set()
                go_on.wait(10)
            super().start()

    monkeypatch.setattr(sinks.threading, "Thread", HeldThread)
    repo = Repository.open(tmp_path / "repo", create=True)
    errors: list[BaseException] = []
    with repo.writer_lock():
        w = repo.new_snapshot("x", compress="lz4")
        sink = w.image_sink("pages-1.img")

        def drain():
            try:
                sink.write(os.urandom(PAGE * 64))     # enough full groups for a hand-over
                sink.close()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=drain)
        t.start()
        assert starting.wait(10), "the sink never started its compressors"
        aborter = threading.Thread(target=w.abort)   # the main thread's unwinding, as on a signal
        aborter.start()
        aborter.join(2)      # (it may wait for the compressor being started: let that go on)
        go_on.set()
        aborter.join(10)
        t.join(10)
    assert not aborter.is_alive() and not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RepositoryError), errors
    assert not [th for th in threading.enumerate() if th.name.startswith("gpusnap-pages-")]
    assert not list((repo.path / "snapshots").iterdir())


@pytest.mark.parametrize("when", ["before", "after"])
def test_no_compressor_starts_after_an_abort(tmp_path, when):
    repo = Repository.open(tmp_path / "repo", create=True)
    with repo.writer_lock():
        w = repo.new_snapshot("x", compress="lz4")
        sink = w.image_sink("pages-1.img")
        if when == "after":
            sink.write(os.urandom(PAGE * 64))
        w.abort()
        with pytest.raises(RepositoryError):
            sink.write(os.urandom(PAGE * 64))
            sink.close()
    assert not [th for th in threading.enumerate() if th.name.startswith("gpusnap-pages-")]
