"""Feeding CRIU's pages through a pipe without copying them: vmsplice(2).

`criu restore --stream` reads each pages image from a pipe with read() straight into the
restored process's memory. Written with write(), every byte is copied twice (into the pipe's
own pages, then out of them); vmsplice() puts references to the decoded buffer's pages into
the pipe instead, so CRIU's read() is the only copy. A referenced page must not change until
it has been read: the buffers stay referenced here until at least a pipe's capacity has been
fed after them (the pipe cannot hold more than that, so CRIU has read them), and the last
ones until the restore is over (held()). Only for images CRIU read()s: it splice()s others
(pipe contents, ghost files) onward, where a reference would outlive the pipe.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os

from gpusnap.system.buffers import buffer_address


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _vmsplice = _libc.vmsplice
    _vmsplice.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_size_t, ctypes.c_uint]
    _vmsplice.restype = ctypes.c_ssize_t
except (OSError, AttributeError):     # not glibc: write() it is
    _vmsplice = None


class Feeder:
    """Feeds one pipe: write(chunk) for each chunk in order, then held() -> what must stay
    alive until CRIU is done with the pipe."""

    def __init__(self, fd: int, step: int):
        self.fd = fd
        self.step = step
        self.fed = 0
        self._held: collections.deque = collections.deque()   # (keep-alive, end offset)
        try:
            self.capacity = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        except OSError:
            self.capacity = 1 << 20
        self.splice = _vmsplice is not None

    def write(self, chunk) -> None:
        view = memoryview(chunk)
        if not self.splice:
            while view:
                view = view[os.write(self.fd, view[:self.step]):]
            self.fed += len(chunk)
            return
        addr, keep = buffer_address(chunk)     # keep: holds the memory at addr alive
        off, n = 0, len(view)
        view.release()
        iov = _Iovec()
        while off < n:
            iov.base, iov.len = addr + off, min(self.step, n - off)
            r = _vmsplice(self.fd, ctypes.byref(iov), 1, 0)
            if r < 0:
                e = ctypes.get_errno()
                if e == 4:            # EINTR
                    continue
                raise OSError(e, os.strerror(e))
            off += r
        self.fed += n
        self._held.append((keep, self.fed))
        while self._held and self._held[0][1] + self.capacity <= self.fed:
            self._held.popleft()

    def held(self) -> list:
        return list(self._held)
