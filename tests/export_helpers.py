"""Shared helpers for the export-format tests: a real sample export, export files built
record by record (crafted lengths, types, sizes), the trailer recomputed after a change, and
an import run in a child under memory and wall-clock bounds."""

from __future__ import annotations

import os
import random
import resource
import subprocess

import blake3

from conftest import GPUSNAP, ROOT
from gpusnap.ops.export import write_export
from gpusnap.repo.format import export as X
from gpusnap.repo import Repository
from gpusnap.repo import format as F
from repo_helpers import PAGE, dump, text_page

TRAILER = X.RECORD.size + 32


def sample(tmp_path, name="job"):
    """A repository with one snapshot of every image kind: random, text and zero pages, a
    partial last page, small and multi-record blob images, an empty one. -> (repo, snap)."""
    repo = Repository.open(tmp_path / "src", create=True)
    rnd = random.Random(3)
    img = b"".join([os.urandom(PAGE) for _ in range(20)] + [bytes(PAGE)] * 9 + [text_page(rnd) for _ in range(30)])
    img += os.urandom(100)
    images = {"pages-1.img": img, "core-1.img": os.urandom(3000), "empty.img": b"", "big.img": os.urandom(3 << 20)}
    snap, _ = dump(repo, images, name=name, meta={"pid": 1})
    return repo, snap


def export_bytes(snap) -> bytes:
    import io
    buf = io.BytesIO()
    write_export(snap, buf)
    return buf.getvalue()


def records(data: bytes) -> list[tuple[int, int, int, int, int, int]]:
    """(offset of the head, tag, codec, reserved, raw_len, stored_len) of each record."""
    out, off = [], X.HEADER.size
    while off < len(data):
        tag, codec, res, raw, stored = X.RECORD.unpack_from(data, off)
        out.append((off, tag, codec, res, raw, stored))
        off += X.RECORD.size + stored
    return out


def rehash(body: bytes) -> bytes:
    """body (an export without its end record) + a correct end record."""
    return body + X.RECORD.pack(X.TAG_END, 0, 0, 32, 32) + blake3.blake3(body).digest()


def retrailer(data: bytes) -> bytes:
    """An export whose bytes before the end record were changed: the trailer made to match."""
    return rehash(data[:-TRAILER])


def record(tag: int, payload: bytes, codec: int = 0, raw_len: int | None = None) -> bytes:
    return X.RECORD.pack(tag, codec, 0, len(payload) if raw_len is None else raw_len, len(payload)) + payload


def manifest_body(images: list[dict], meta: dict | None = None, name="crafted") -> dict:
    return {"format": "gpusnap-snapshot", "version": 1, "repo_id": "0" * 32, "name": name, "created": 1.7e9,
            "meta": meta if meta is not None else {}, "stats": {}, "images": images}


def craft(body: dict, *recs: bytes, flags: int = 0) -> bytes:
    """An export of the manifest `body` followed by the records `recs`, with a correct trailer."""
    head = X.HEADER.pack(X.MAGIC, X.VERSION, flags, 0) + record(X.TAG_MANIFEST, F.encode_manifest(body)[0])
    return rehash(head + b"".join(recs))


def zero_pages_export(npages: int, name="zeros") -> bytes:
    """An export of one pages image of `npages` zero pages: a few bytes whatever npages."""
    pl = b""
    left = npages
    while left:
        k = min(left, (1 << 32) - 1)
        pl += F.encode_pl_zero(k)
        left -= k
    im = {"name": "pages-1.img", "type": "pages", "size": npages * PAGE, "digest": blake3.blake3(pl).hexdigest(),
          "pagelist": "pl-000000", "pagelist_size": len(pl)}
    return craft(manifest_body([im], name=name), record(X.TAG_PAGELIST, pl))


# A bound, not a benchmark: generous enough that a loaded machine passes, far below what
# an unbounded import of the crafted files below takes (hours to weeks).
WALL_BUDGET_S = 120
MEMORY_BUDGET = 2 << 30          # address space of the importing process (RLIMIT_AS)


def import_bounded(path, repo, *, memory: int = MEMORY_BUDGET, timeout: float = WALL_BUDGET_S,
                   stdin=None) -> subprocess.CompletedProcess:
    """`gpusnap import` of `path` ('-': stdin) into `repo` in a child limited to `memory`
    bytes of address space and `timeout` seconds (subprocess.TimeoutExpired past it)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = dict(os.environ, MALLOC_ARENA_MAX="2")   # thread arenas reserve 64 MiB of address space each
    if not os.path.lexists(repo):     # (not the default location: import makes none there)
        subprocess.run([*GPUSNAP, "init", "--repo", str(repo)], check=True, capture_output=True, cwd=ROOT)
    return subprocess.run([*GPUSNAP, "import", str(path), "--repo", str(repo), "--json"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout, preexec_fn=limit, input=stdin)
