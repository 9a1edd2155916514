"""criu/pipefeed.py: pages fed to a pipe by vmsplice stay referenced by the pipe until they
are read, so the feeder must keep each buffer alive (and unchanged) until then: checked with
a slow reader, whose progress every buffer's release is compared against, and the bytes
that arrive compared with what was fed."""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
import weakref

import pytest

from gpusnap.criu import pipefeed

CHUNK = 1 << 18
READ = 1 << 16


class Buf(bytearray):
    """A bytearray that can be watched for its release (weakref)."""


def _chunk(i: int) -> Buf:
    return Buf(hashlib.sha256(str(i).encode()).digest() * (CHUNK // 32))


@pytest.mark.parametrize("splice", [True, False])
def test_no_buffer_is_let_go_before_the_reader_has_it(splice):
    if splice and pipefeed._vmsplice is None:
        pytest.skip("no vmsplice in this libc")
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)    # the whole first chunk fits in the pipe
    got: list[bytes] = []
    read_so_far = [0]
    early: list[tuple[int, int]] = []
    first_fed = threading.Event()       # the reader starts once the first chunk is fed (and
                                        # by write(), released): the check below can fire

    def reader():
        first_fed.wait(10)
        while True:
            time.sleep(0.001)             # a slow reader: the pipe stays full
            b = os.read(r, READ)
            if not b:
                return
            got.append(b)
            read_so_far[0] += len(b)

    def released(end: int) -> None:
        # the reader's count may lag its last read() by one READ
        if read_so_far[0] + READ < end:
            early.append((end, read_so_far[0]))

    t = threading.Thread(target=reader)
    t.start()
    f = pipefeed.Feeder(w, CHUNK // 4)
    f.splice = splice
    n = 64
    for i in range(n):
        c = _chunk(i)
        weakref.finalize(c, released, (i + 1) * CHUNK)
        f.write(c)
        del c                             # the caller keeps no reference
        first_fed.set()
    held = f.held()
    os.close(w)
    t.join(60)
    os.close(r)
    del held
    if splice:      # (write() copies: its buffers may go at once)
        assert not early, f"released before read (end, read so far): {early[:3]}"
    else:
        assert early      # the slow reader is slow enough for the check above to mean something
    data = b"".join(got)
    assert len(data) == n * CHUNK == f.fed
    assert all(data[i * CHUNK:(i + 1) * CHUNK] == _chunk(i) for i in range(n))


def test_only_what_the_pipe_can_still_hold_is_held():
    r, w = os.pipe()
    f = pipefeed.Feeder(w, 1 << 16)
    if not f.splice:
        pytest.skip("no vmsplice in this libc")
    cap = f.capacity
    drained = []
    t = threading.Thread(target=lambda: drained.append(sum(iter(lambda: len(os.read(r, 1 << 16)), 0))))
    t.start()
    for i in range(8 * cap // 4096):
        f.write(bytes([i % 251]) * 4096)
    held = f.held()
    os.close(w)
    t.join(30)
    os.close(r)
    assert drained == [8 * cap]
    # a pipe holds at most `cap` bytes: older buffers are read and let go
    assert cap // 4096 <= len(held) <= cap // 4096 + 1
