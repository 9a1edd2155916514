"""A job whose memory holds the cases restore's zero-page skipping (gpusnap/criu/sparse.py)
must get right; tests/test_sparse_restore.py dumps and restores it.

    python tests/jobs/zero_pages.py OUT

* anon: 8 MiB of private anonymous memory, odd MiBs a pattern, even MiBs written with zeros
  (present zero pages: left out at restore);
* file: a 1 MiB file of 0xAB mapped private, its first 512 KiB overwritten with zeros
  (zero pages over other file content: must stay in the image);
* cow: 2 MiB of private anonymous 0xCD made before a fork; the child zeroes its first MiB
  (the parent's copy keeps 0xCD: CRIU must not hand it to the child).

OUT/pid: "parent child" once both are set up; OUT/expected-<role>: the digest of the
role's memory then. OUT/finish: each process writes OUT/result-<role>, the digest now.
"""

import hashlib
import mmap
import os
import sys
import time
from pathlib import Path

MIB = 1 << 20
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)

anon = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(8):
    anon[i * MIB:(i + 1) * MIB] = bytes([i + 1]) * MIB if i % 2 else bytes(MIB)
backing = out / "backing"
backing.write_bytes(b"\xab" * MIB)
fd = os.open(backing, os.O_RDWR)
filemap = mmap.mmap(fd, MIB, flags=mmap.MAP_PRIVATE)
filemap[:MIB // 2] = bytes(MIB // 2)
cow = mmap.mmap(-1, 2 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
cow[:] = b"\xcd" * (2 * MIB)


def digest() -> str:
    return hashlib.sha256(bytes(anon) + bytes(filemap) + bytes(cow)).hexdigest()


def publish(name: str, text: str) -> None:
    # whole or not at all: the test reads a file as soon as it exists
    tmp = out / f".{name}.{os.getpid()}"
    tmp.write_text(text)
    os.rename(tmp, out / name)


def serve(role: str) -> None:
    publish(f"expected-{role}", digest())
    while not (out / "finish").exists():
        time.sleep(0.01)
    publish(f"result-{role}", digest())


child = os.fork()
if child == 0:
    cow[:MIB] = bytes(MIB)
    serve("child")
    os._exit(0)
while not (out / "expected-child").exists():
    time.sleep(0.01)
publish("pid", f"{os.getpid()} {child}")
serve("parent")
os.waitpid(child, 0)
