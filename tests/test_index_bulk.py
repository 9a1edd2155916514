"""The bulk index parse (native/pages/gs_index.c through format.index.parse_index_records)
and RepoIndex built on it, against the reference parse (format.index.parse_index): the same
records from valid files, the same FormatError from damaged ones, the same records left out
for missing and short packs, the same page and data locations (first file by name wins)."""

import os
import random
from array import array

import blake3
import pytest
from hypothesis import given, settings, strategies as st

from gpusnap.repo import format as F
from gpusnap.repo.format import FormatError
from gpusnap.repo.format.index import parse_index_records
from gpusnap.repo.index import RepoIndex, write_index_file
from gpusnap.repo.repository import Repository
from gpusnap.repo.store import pack_path

from repo_helpers import dump, read_all


def _blobs(rnd: random.Random, packs: list[bytes], n: int, shared_ids: list[bytes] = ()) -> list[F.Blob]:
    out = []
    off = {ph: F.PACK_HEADER.size for ph in packs}
    for _ in range(n):
        ph = rnd.choice(packs)
        if rnd.random() < 0.2:
            raw = rnd.randint(1, 5000)
            codec, stored = (F.CODEC_NONE, raw) if rnd.random() < 0.5 or raw < 2 else (F.CODEC_ZSTD, rnd.randint(1, raw - 1))
            ids = rnd.choice(shared_ids) if shared_ids and rnd.random() < 0.3 else rnd.randbytes(32)
            b = F.Blob(ph, off[ph], F.KIND_DATA, codec, 0, raw, stored, ids)
        else:
            np_ = rnd.randint(1, 20)
            stored = rnd.randint(1, np_ * F.PAGE_SIZE - 1)
            ids = b"".join(rnd.choice(shared_ids)[:16] if shared_ids and rnd.random() < 0.3 else rnd.randbytes(16)
                           for _ in range(np_))
            b = F.Blob(ph, off[ph], F.KIND_PAGES, F.CODEC_LZ4, np_, np_ * F.PAGE_SIZE, stored, ids)
        off[ph] += F.BLOB_HEADER.size + b.stored_len
        out.append(b)
    return out


def _index(rnd, n_packs=3, n=40, shared=()):
    packs = [rnd.randbytes(32) for _ in range(n_packs)]
    return packs, F.encode_index(packs, _blobs(rnd, packs, n, shared))


def _fields(b: F.Blob) -> tuple:
    """What fields() answers for a blob: everything but its ids, in Blob's order."""
    return b.pack, b.offset, b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len


def _same(data: bytes, pack_size=None):
    """parse_index_records(data) agrees with parse_index(data): records or error."""
    try:
        ref = F.parse_index(data)
    except FormatError as e:
        with pytest.raises(FormatError) as got:
            parse_index_records(data, pack_size)
        assert str(got.value) == str(e)
        return None
    recs = parse_index_records(data, pack_size)
    assert recs.packs == ref.packs
    if pack_size is None:
        assert [recs.blob(i) for i in range(recs.n)] == ref.blobs
        assert [recs.fields(i) for i in range(recs.n)] == [_fields(b) for b in ref.blobs]
        assert recs.pages == sum(b.n_pages for b in ref.blobs if b.kind == F.KIND_PAGES)
    return ref, recs


def test_valid_files_parse_alike():
    rnd = random.Random(1)
    for n in (0, 1, 7, 300):
        _same(_index(rnd, n=n)[1])
    with pytest.raises(IndexError):
        parse_index_records(_index(rnd, n=3)[1]).blob(3)
    with pytest.raises(IndexError):
        parse_index_records(_index(rnd, n=3)[1]).fields(3)


def test_each_damage_gives_the_reference_error():
    """Every field of every record set to values the format refuses, the checksum fixed so
    the record checks are reached: the bulk parse names the same fault."""
    rnd = random.Random(2)
    _, data = _index(rnd, n_packs=2, n=6)
    body = bytearray(data[:-32])
    start = F.INDEX_HEADER.size + 2 * 32
    seen = set()
    values = [0, 1, 2, 3, 5, 15, 16, 255, 256, 257, 4096, 4095, 1 << 16, (4 << 20) + 1, 0xFFFFFFFF, 0xFFFF]
    pos, recs = start, []
    for _ in range(6):
        recs.append(pos)
        _, _, kind, _, n_pages, _, _ = F.INDEX_RECORD.unpack_from(body, pos)
        pos += F.INDEX_RECORD.size + (n_pages * 16 if kind == F.KIND_PAGES else 32)
    fields = [(0, "<I"), (4, "<I"), (8, "<B"), (9, "<B"), (10, "<H"), (12, "<I"), (16, "<I")]
    import struct
    for rpos in recs:
        for foff, fmt in fields:
            for v in values:
                if v >= 1 << (8 * struct.calcsize(fmt)):
                    continue
                b = bytearray(body)
                struct.pack_into(fmt, b, rpos + foff, v)
                b = bytes(b)
                try:
                    F.parse_index(b + blake3.blake3(b).digest())
                except FormatError as e:
                    seen.add(str(e).split(" ")[0] + str(e)[-8:])
                _same(b + blake3.blake3(b).digest())
    # header counts, truncations, trailing bytes
    for cut in range(len(body) - 40, len(body) + 1):
        b = body[:cut]
        _same(bytes(b) + blake3.blake3(b).digest())
    b = bytes(body) + b"\0"
    _same(b + blake3.blake3(b).digest())
    for n_blobs in (0, 5, 7, 1 << 20):
        b = bytearray(body)
        struct.pack_into("<I", b, 16, n_blobs)
        _same(bytes(b) + blake3.blake3(b).digest())
    assert len(seen) >= 8          # the edits reached most of the record checks


def _mutations(valid: bytes):
    return st.one_of(
        st.tuples(st.integers(0, len(valid) - 1), st.integers(1, 255)).map(
            lambda t: valid[:t[0]] + bytes([valid[t[0]] ^ t[1]]) + valid[t[0] + 1:]),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=40)).map(
            lambda t: valid[:t[0]] + t[1] + valid[t[0]:]),
        st.tuples(st.integers(0, len(valid)), st.binary(max_size=40)).map(
            lambda t: valid[:t[0]] + t[1] + valid[t[0] + len(t[1]):]),
    )


_FUZZ_BODY = _index(random.Random(3), n_packs=2, n=5)[1][:-32]


@settings(max_examples=500, deadline=None)
@given(_mutations(_FUZZ_BODY), st.booleans())
def test_fuzz_alike(body, rehash):
    data = body + (blake3.blake3(body).digest() if rehash else _index(random.Random(3), n_packs=2, n=5)[1][-32:])
    _same(data)


def test_missing_and_short_packs_left_out():
    rnd = random.Random(4)
    packs, data = _index(rnd, n_packs=4, n=200)
    ref = F.parse_index(data)
    ends = {}
    for b in ref.blobs:
        ends[b.pack] = max(ends.get(b.pack, 0), b.end)
    # pack 0 missing, pack 1 short (half its records fit), 2 exactly long enough, 3 longer
    half = sorted(b.end for b in ref.blobs if b.pack == packs[1])
    size = {packs[0]: None, packs[1]: half[len(half) // 2], packs[2]: ends[packs[2]], packs[3]: ends[packs[3]] + 100}
    recs = parse_index_records(data, lambda ps: array("q", [-1 if size[p] is None else size[p] for p in ps]))
    kept = [b for b in ref.blobs if size[b.pack] is not None and b.end <= size[b.pack]]
    assert [recs.blob(i) for i in range(recs.n)] == kept
    assert recs.pages == sum(b.n_pages for b in kept if b.kind == F.KIND_PAGES)
    flags = {p: recs.pack_flags[i] for i, p in enumerate(recs.packs)}
    assert flags == {packs[0]: 1, packs[1]: 2, packs[2]: 0, packs[3]: 0}
    want_end = {p: max((b.end for b in kept if b.pack == p), default=0) for p in packs}
    assert dict(zip(recs.packs, recs.pack_end)) == want_end


def _reference(root, names, check_packs):
    """RepoIndex as the code before the bulk parse built it: parse_index + add_file."""
    from gpusnap.repo.store import pack_sizes
    idx = RepoIndex()
    for name in names:
        try:
            data = (root / "index" / name).read_bytes()
            if data[-32:].hex() != name:
                raise FormatError("file name is not its checksum")
            parsed = F.parse_index(data)
        except (OSError, FormatError) as e:
            idx.bad_files[name] = str(e)
            continue
        idx.add_file(name, parsed, pack_sizes(root, parsed.packs) if check_packs else None)
    return idx


def _write_pack(root, ph: bytes, size: int):
    p = pack_path(root, ph)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("check_packs", [False, True])
def test_repo_index_matches_reference(tmp_path, check_packs):
    """Files sharing ids (the first by name wins), a damaged one, a misnamed one, a pack
    missing and a pack short: the same blobs, data locations, page locations, reports."""
    root = tmp_path
    (root / "index").mkdir()
    (root / "tmp").mkdir()
    rnd = random.Random(5)
    shared = [rnd.randbytes(32) for _ in range(30)]
    files = []
    for k in range(5):
        packs = [rnd.randbytes(32) for _ in range(2)]
        blobs = _blobs(rnd, packs, 150, shared)
        for i, ph in enumerate(packs):
            end = max(b.end for b in blobs if b.pack == ph)
            if k == 1 and i == 0:
                continue                                  # missing
            _write_pack(root, ph, end - 50 if k == 2 and i == 1 else end)   # short / whole
        path, _ = write_index_file(root, [(ph, [b for b in blobs if b.pack == ph]) for ph in packs])
        files.append(path)
    damaged = files[3]
    d = bytearray(damaged.read_bytes())
    d[30] ^= 1
    damaged.write_bytes(bytes(d))
    (root / "index" / ("ab" * 32)).write_bytes(files[4].read_bytes())     # name is not its checksum
    (root / "index" / "stray").write_bytes(b"x")
    names = sorted(os.listdir(root / "index"))
    ref = _reference(root, [n for n in names if n != "stray"], check_packs)
    lazy = RepoIndex.load(root, check_packs=check_packs)      # blobs asked for one by one first
    n = len(ref.blobs)
    for i in (n - 1, 0, n // 2, -1, -n, 1, n - 2):
        assert lazy.blobs[i] == ref.blobs[i]
    with pytest.raises(IndexError):
        lazy.blobs[n]
    assert lazy.packs_present(root) == ref.packs_present(root)
    one_by_one = RepoIndex.load(root, check_packs=check_packs)   # (a segment asked often becomes a list)
    assert [one_by_one.blobs[i] for i in range(n)] == [one_by_one.blobs[i] for i in range(n)] == list(ref.blobs)
    assert list(lazy.blobs) == list(ref.blobs) and lazy.blobs[n // 3] == ref.blobs[n // 3]
    got = RepoIndex.load(root, check_packs=check_packs)
    assert list(got.blobs) == list(ref.blobs) and len(got.blobs) == len(ref.blobs)
    assert got.data_loc == ref.data_loc
    assert {k: v for k, v in got.bad_files.items() if k != "stray"} == ref.bad_files
    assert got.bad_files["stray"] == "unexpected file in index/"
    assert got.missing_packs == ref.missing_packs and got.short_packs == ref.short_packs
    if check_packs:
        assert got.missing_packs and got.short_packs
    ids = b"".join(b.ids for b in ref.blobs if b.kind == F.KIND_PAGES)
    assert got.page_table().get_many(ids) == ref.page_table().get_many(ids)
    assert got.packs_present(root) == ref.packs_present(root)
    for i in (0, 1, len(ref.blobs) - 1, -1, -len(ref.blobs)):
        assert got.blobs[i] == ref.blobs[i]
    assert got.blobs[3:40:7] == ref.blobs[3:40:7]
    with pytest.raises(IndexError):
        got.blobs[len(ref.blobs)]


def test_blob_list_mixes_files_and_added_records(tmp_path):
    """add_file() after a bulk load: one numbering over both (repair and prune add Blobs)."""
    root = tmp_path
    (root / "index").mkdir()
    (root / "tmp").mkdir()
    rnd = random.Random(6)
    packs = [rnd.randbytes(32)]
    first = _blobs(rnd, packs, 20)
    write_index_file(root, [(packs[0], first)])
    idx = RepoIndex.load(root)
    more = _blobs(rnd, packs, 10)
    idx.add_file("extra", F.IndexFile(packs, more))
    # fields() from the records still unbuilt, from the added list, and once all is one list
    assert [idx.blobs.fields(i) for i in range(30)] == [_fields(b) for b in first + more]
    with pytest.raises(IndexError):
        idx.blobs.fields(30)
    assert list(idx.blobs) == first + more and idx.blobs[-1] == more[-1] and idx.blobs[19] == first[-1]
    assert [idx.blobs.fields(i) for i in range(30)] == [_fields(b) for b in first + more]
    t = idx.page_table()
    for bno, b in enumerate(first + more):
        if b.kind == F.KIND_PAGES:
            assert t.get(b.ids[:16]) == bno << 8


def test_dump_dedups_against_a_loaded_index(tmp_path):
    """Real dumps through the writer (index loaded in its thread): the second dump of the
    same images stores no page again, and its snapshot reads back."""
    repo = Repository.open(tmp_path / "r", create=True)
    rnd = random.Random(7)
    pages = rnd.randbytes(64 * F.PAGE_SIZE)
    images = {"pages-1.img": pages, "core-1.img": b"core" * 100}
    dump(repo, images, name="a")
    s2, stats = dump(repo, images, name="b")
    assert stats["pages_dedup"] == 64
    assert read_all(s2, "pages-1.img") == pages


def test_writer_reports_an_index_load_failure(tmp_path):
    """The load runs in a thread; what it raised is raised where the index is needed."""
    repo = Repository.open(tmp_path / "r", create=True)
    with repo.writer_lock():
        os.rename(repo.path / "index", repo.path / "index.away")
        w = repo.new_snapshot("x")
        try:
            with pytest.raises(FileNotFoundError):
                w.wait_index()
            with pytest.raises(FileNotFoundError):
                w.known_pages
        finally:
            w.abort()
            os.rename(repo.path / "index.away", repo.path / "index")
