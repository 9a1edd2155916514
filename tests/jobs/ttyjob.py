"""A job for a terminal: prints `tick N` at each step of a hash chain kept in its memory, then
asks `say something:` on its terminal, answers `you said '...'`, and writes the chain's digest
and the line to OUT (atomically); then waits for one more line and ends. Run uninterrupted, the same arguments and line give the same
OUT: a restored copy that lost or repeated anything does not."""

import hashlib
import os
import sys
import time


def main() -> None:
    out, ticks, tick_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    state = bytearray(8 << 20)                  # memory the chain reads and writes
    h = hashlib.sha256(b"ttyjob")
    for i in range(ticks):
        off = (i * 4099) % len(state)
        state[off:off + 32] = h.digest()
        h.update(bytes(state[off:off + 64]) + str(i).encode())
        print(f"tick {i}", flush=True)
        if tick_ms:
            time.sleep(tick_ms / 1000)
    line = input("say something: ")
    print(f"you said {line!r}", flush=True)
    with open(out + ".tmp", "w") as f:
        f.write(f"{h.hexdigest()} {line}\n")
    os.rename(out + ".tmp", out)
    input("press Enter to end: ")           # so that its answer can be read on the terminal


if __name__ == "__main__":
    main()
