"""userfaultfd, the few kernel calls the lazy restore makes (include/uapi/linux/userfaultfd.h).

CRIU's lazy restore hands gpusnap one userfaultfd per restored process (criu/lazypages.py);
through it gpusnap puts pages into the process (UFFDIO_COPY), answers faults on pages that
are not in the snapshot with zeros (UFFDIO_ZEROPAGE), and reads the process's faults and
non-cooperative events (fork, mremap, munmap, madvise) as 32-byte messages. Python has no
binding for these; ctypes is used so that the copies run without the GIL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct

PAGE = 4096
MSG_SIZE = 32

# uffd_msg.event
EVENT_PAGEFAULT = 0x12
EVENT_FORK = 0x13
EVENT_REMAP = 0x14
EVENT_REMOVE = 0x15
EVENT_UNMAP = 0x16

# _IOWR/_IOR(0xAA, nr, struct): uffdio_copy is 40 bytes, uffdio_zeropage 32, uffdio_range 16
UFFDIO_UNREGISTER = 0x8010AA01
UFFDIO_WAKE = 0x8010AA02
UFFDIO_COPY = 0xC028AA03
UFFDIO_ZEROPAGE = 0xC020AA04

# the process behind the userfaultfd is gone (ESRCH before Linux 4.18, ENOSPC since)
GONE = (errno.ESRCH, errno.ENOSPC)


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


class _Zero(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("zeropage", ctypes.c_int64)]


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_ioctl = _libc.ioctl
_ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_ioctl.restype = ctypes.c_int


class Gone(Exception):
    """The process behind this userfaultfd has exited: nothing more goes into it."""


def copy(fd: int, dst: int, src: int, length: int) -> tuple[int, int]:
    """UFFDIO_COPY `length` bytes from address src to dst in the process. Returns (bytes
    copied, errno: 0, EAGAIN (a fork, mremap, munmap or madvise is under way: read the
    events, then copy the rest), EEXIST (the page at dst+copied is there already) or
    ENOENT (no registered mapping at dst+copied)). Raises Gone."""
    c = _Copy(dst, src, length, 0, 0)
    r = _ioctl(fd, UFFDIO_COPY, ctypes.byref(c))
    if r == 0:
        return length, 0
    e = ctypes.get_errno()
    done = c.copy if c.copy > 0 else 0
    if c.copy < 0 and -c.copy in (errno.EEXIST, errno.ENOENT, errno.EAGAIN) + GONE:
        e = -c.copy
    if e in GONE:
        raise Gone()
    if e in (errno.EAGAIN, errno.EEXIST, errno.ENOENT):
        return done, e
    raise OSError(e, f"UFFDIO_COPY: {os.strerror(e)}")


def zeropage(fd: int, start: int, length: int = PAGE) -> None:
    """Map zero pages at start (a fault on memory the snapshot does not hold); a page
    already there is woken instead. Raises Gone."""
    z = _Zero(start, length, 0, 0)
    if _ioctl(fd, UFFDIO_ZEROPAGE, ctypes.byref(z)) == 0:
        return
    e = ctypes.get_errno()
    if e in GONE:
        raise Gone()
    if e in (errno.EEXIST, errno.EAGAIN):
        wake(fd, start, length)
        return
    if e == errno.ENOENT:          # unmapped meanwhile: the UNMAP event follows
        return
    raise OSError(e, f"UFFDIO_ZEROPAGE: {os.strerror(e)}")


def wake(fd: int, start: int, length: int) -> None:
    r = _Range(start, length)
    if _ioctl(fd, UFFDIO_WAKE, ctypes.byref(r)) != 0:
        e = ctypes.get_errno()
        if e in GONE:
            raise Gone()


def unregister(fd: int, start: int, length: int) -> None:
    """Faults in [start, start+length) no longer come here (the kernel zero-fills them)."""
    r = _Range(start, length)
    if _ioctl(fd, UFFDIO_UNREGISTER, ctypes.byref(r)) != 0:
        e = ctypes.get_errno()
        if e in GONE or e == errno.ENOMEM:     # ENOMEM: the process's memory is gone
            raise Gone()
        if e != errno.EINVAL:                  # EINVAL: nothing registered there (any more)
            raise OSError(e, f"UFFDIO_UNREGISTER: {os.strerror(e)}")


def read_msgs(fd: int, buf: bytearray) -> list[tuple]:
    """The messages waiting on fd (non-blocking): (EVENT_PAGEFAULT, address) |
    (EVENT_FORK, new fd) | (EVENT_REMAP, from, to, len) | (EVENT_REMOVE or EVENT_UNMAP,
    start, end). [] when none is waiting."""
    try:
        n = os.readv(fd, [buf])
    except BlockingIOError:
        return []
    except OSError as e:
        if e.errno in GONE or e.errno == errno.EBADF:
            raise Gone() from None
        raise
    if n == 0:
        raise Gone()
    out = []
    for i in range(0, n - n % MSG_SIZE, MSG_SIZE):
        ev = buf[i]
        if ev == EVENT_PAGEFAULT:
            out.append((ev, struct.unpack_from("<Q", buf, i + 16)[0] & ~(PAGE - 1)))
        elif ev == EVENT_FORK:
            out.append((ev, struct.unpack_from("<I", buf, i + 8)[0]))
        elif ev == EVENT_REMAP:
            out.append((ev, *struct.unpack_from("<QQQ", buf, i + 8)))
        elif ev in (EVENT_REMOVE, EVENT_UNMAP):
            out.append((ev, *struct.unpack_from("<QQ", buf, i + 8)))
        else:
            raise OSError(errno.EPROTO, f"unexpected userfaultfd event {ev:#x}")
    return out
