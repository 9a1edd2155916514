"""Pack names (docs/format.md §3, revision 1.2): blake3 of the pack descriptor; packs named
by the blake3 of the whole file (before revision 1.2) still verify."""

import dataclasses
import os
import random

import blake3
import pytest

from gpusnap.repo import Repository
from gpusnap.repo import format as F
from gpusnap.repo.codec import decompress
from gpusnap.repo.store import pack_path
from gpusnap.repo.maint.verify import verify
from repo_helpers import PAGE, dump, read_all, text_page


def _descriptor_name(data: bytes) -> bytes:
    """The name per docs/format.md §3, from the pack file alone (ids from the content)."""
    d = [b"GSNPNAME", data[:16]]
    for off, h in F.parse_pack(data):
        d.append(data[off:off + 16])
        raw = decompress(data[off + 16:off + 16 + h.stored_len], h.codec, h.raw_len)
        if h.kind == F.KIND_PAGES:
            d += [blake3.blake3(raw[s * PAGE:(s + 1) * PAGE]).digest(16) for s in range(h.n_pages)]
        else:
            d.append(blake3.blake3(raw).digest())
    d.append(data[-16:])
    return blake3.blake3(b"".join(d)).digest()


def _packs(repo):
    return sorted(p for p in (repo.path / "packs").rglob("*") if p.is_file())


@pytest.fixture
def repo(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    rnd = random.Random(3)
    img = b"".join([text_page(rnd) for _ in range(40)] + [os.urandom(PAGE) for _ in range(40)])
    snap, _ = dump(repo, {"pages-1.img": img + b"tail", "core-1.img": b"core" * 3000}, name="one",
                   pack_target=64 << 10)
    return repo, snap, img + b"tail"


def test_names_are_descriptor_hashes(repo):
    repo, snap, img = repo
    packs = _packs(repo)
    assert len(packs) > 1
    for p in packs:
        data = p.read_bytes()
        assert p.name == _descriptor_name(data).hex()
        assert p.name != blake3.blake3(data).hexdigest()
    assert verify(repo).ok


def test_pre_1_2_whole_file_names_still_verify(repo):
    """Rename every pack to the blake3 of its bytes and rewrite the index to match."""
    repo, snap, img = repo
    ren = {}
    for p in _packs(repo):
        new = blake3.blake3(p.read_bytes()).digest()
        dest = pack_path(repo.path, new)
        dest.parent.mkdir(mode=0o700, exist_ok=True)
        os.rename(p, dest)
        ren[bytes.fromhex(p.name)] = new
    for f in list((repo.path / "index").iterdir()):
        parsed = F.parse_index(f.read_bytes())
        data = F.encode_index([ren[x] for x in parsed.packs], [dataclasses.replace(b, pack=ren[b.pack]) for b in parsed.blobs])
        (repo.path / "index" / data[-32:].hex()).write_bytes(data)
        f.unlink()
    for loc in (repo.path / "snapshots").rglob("locations"):
        loc.unlink()                       # stale now; restore builds them from the index
    rep = verify(repo)
    assert rep.ok, rep.problems
    assert read_all(snap, "pages-1.img") == img


def test_descriptor_damage_is_reported(repo):
    repo, snap, img = repo
    p = _packs(repo)[0]
    data = bytearray(p.read_bytes())
    data[-8] ^= 1                          # trailer reserved field: no blob is damaged
    os.chmod(p, 0o600)
    p.write_bytes(bytes(data))
    rep = verify(repo)
    assert not rep.ok
    assert any(x.scope == "pack" and x.name == p.name for x in rep.problems)
