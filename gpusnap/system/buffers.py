"""The address of a Python buffer for a C call (ctypes), with an object that keeps the memory
alive while C uses it: shared by the native page library's bindings (repo/native.py) and the
vmsplice feed (criu/pipefeed.py)."""

from __future__ import annotations

import ctypes


def buffer_address(buf) -> tuple[int, object]:
    """Address of a readable buffer (bytes, bytearray, memoryview) and an object keeping it alive."""
    if type(buf) is bytes:
        return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value, buf
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("buffer is not contiguous")
    if mv.readonly:
        b = bytes(mv)       # ctypes cannot take the address of a read-only view; copy
        return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value, b
    c = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(c), c
