"""The read path's native decode loop (native/pages/gs_decode.c through reader.assemble):
real repositories written with every codec read back to exactly the original bytes by the
sequential reader and the parallel materializer, and damaged blobs refused with exactly the
error the pure-Python decoder (store.BlobReader.read_at(python=True), codec.decompress)
gives for the same blob, never a crash."""

import os
import struct
import threading

import numpy as np
import pytest

from gpusnap.errors import CorruptSnapshot
from gpusnap.repo import Repository, native, parallel_read
from gpusnap.repo.format import CODEC_LZ4, CODEC_NONE, CODEC_SHUF2_ZSTD, CODEC_SHUF4_ZSTD, CODEC_ZSTD, KIND_PAGES, FormatError
from gpusnap.repo.store import BlobReader, pack_path
from repo_helpers import PAGE, dump, read_all

CODECS = ["none", "lz4", "zstd", "shuffle4-zstd", "shuffle2-zstd", "auto"]
CODEC_IDS = {"none": CODEC_NONE, "lz4": CODEC_LZ4, "zstd": CODEC_ZSTD, "shuffle4-zstd": CODEC_SHUF4_ZSTD,
             "shuffle2-zstd": CODEC_SHUF2_ZSTD}
IMG = "pages-1.img"


def _pages():
    """Zero-heavy, text, fp32 weights, fp16 and random pages, with zero pages between."""
    rng = np.random.default_rng(5)
    fp32 = rng.standard_normal(PAGE * 70 // 4).astype(np.float32).tobytes()
    fp16 = rng.standard_normal(PAGE * 40 // 2).astype(np.float16).tobytes()
    sparse = bytearray(PAGE * 50)
    for i in range(0, len(sparse), 700):
        sparse[i:i + 9] = rng.bytes(9)
    rnd = rng.bytes(PAGE * 30)
    text = (b"tensor weight grad loss " * 2000)[:PAGE * 20]
    # compressible pages first: after groups that do not compress the writer stops trying a while
    return bytes(sparse) + text + bytes(PAGE * 3) + fp32 + bytes(PAGE * 5) + fp16 + rnd


BASE = _pages()


def _variant(base: bytes) -> bytes:
    """Pages of base in another order and cut at other places (runs into the middle of its
    blobs), new pages, and a tail that is not a whole page."""
    pg = [base[i:i + PAGE] for i in range(0, len(base), PAGE)]
    rng = np.random.default_rng(9)
    out = pg[3:41] + [rng.bytes(PAGE)] + pg[100:97:-1] + pg[150:170] + pg[7:9] + [bytes(PAGE)] + pg[60:130]
    return b"".join(out) + b"tail of the image"


def _read_every_way(snap, name, threads=2):
    """The image as read by each path: sequential, materialized to files, parallel stream."""
    seq = read_all(snap, name)
    out = snap.path.parent.parent / f"out-{snap.path.name}-{threads}"
    out.mkdir(mode=0o700)
    parallel_read.write_images(snap, out, threads, threading.Event(), [0])
    files = (out / name).read_bytes()
    par = b"".join(parallel_read.iter_image_parallel(snap, name, threads))
    return seq, files, par


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_reads_back_exactly(tmp_path, monkeypatch, codec):
    """Both snapshots read back exactly, also with jobs that cut blobs in two (5 pages: the
    writer's blobs are 16) and one worker, so the blob kept between two jobs is used."""
    monkeypatch.setattr(parallel_read, "JOB_BYTES", 5 * PAGE)
    repo = Repository.open(tmp_path / "repo", create=True)
    img2 = _variant(BASE)
    s1, _ = dump(repo, {IMG: BASE, "core-1.img": b"core" * 100}, name="one", compress=codec)
    s2, _ = dump(repo, {IMG: img2}, name="two", compress=codec)
    used = {r[3] for r in s1.reading_locations().iter_runs(s1.image_no(IMG))}
    if codec in CODEC_IDS:
        assert used <= {CODEC_IDS[codec], CODEC_NONE} and (codec == "none" or CODEC_IDS[codec] in used), used
    else:
        assert {CODEC_LZ4, CODEC_SHUF4_ZSTD} <= used, used      # auto chose per blob
    runs2 = list(s2.reading_locations().iter_runs(s2.image_no(IMG)))
    assert any(r[7] != 0 or r[8] != r[4] for r in runs2 if r[2] == KIND_PAGES)   # partial blobs
    for s, img in ((s1, BASE), (s2, img2)):
        for got in _read_every_way(s, IMG):
            assert got == img
        seq, files, par = _read_every_way(s, IMG, threads=1)
        assert files == img and par == img
    assert read_all(s1, "core-1.img") == b"core" * 100


def test_jobs_over_many_packs_decode_in_parts(tmp_path, monkeypatch):
    """A job whose pages lie in more packs than a reader keeps open is decoded in parts
    (here: one pack at a time), to the same bytes, and its pages are still all checked."""
    from gpusnap.repo import reader

    monkeypatch.setattr(reader, "PAGE_FDS", 1)
    monkeypatch.setattr(parallel_read, "JOB_BYTES", 64 * PAGE)
    repo = Repository.open(tmp_path / "repo", create=True)
    img2 = _variant(BASE)
    dump(repo, {IMG: BASE}, name="one", compress="auto")
    s2, _ = dump(repo, {IMG: img2}, name="two", compress="auto")
    loc = s2.reading_locations()
    assert len({r[0] for r in loc.iter_runs(s2.image_no(IMG))}) >= 2
    for got in _read_every_way(s2, IMG):
        assert got == img2
    # a damaged page in the first part is still found by the check at the end of the job
    pp, name, r = _runs(s2, CODEC_NONE)[0]
    _patch(pp, r[1] + 16 + r[7] * PAGE + 5, b"\x99")
    with pytest.raises(CorruptSnapshot, match=f"a page of {IMG} fails its checksum") as e:
        read_all(Repository.open(repo.path).snapshot(s2.path.name), IMG)
    assert str(pp) in str(e.value)


# -- damage --------------------------------------------------------------------------------
def _runs(snap, codec=None):
    """[(pack path, pack name, run)] of the image's pages runs (stored with codec)."""
    loc = snap.reading_locations()
    out = []
    for r in loc.iter_runs(snap.image_no(IMG)):
        if r[2] == KIND_PAGES and (codec is None or r[3] == codec):
            name = loc.pack(r[0])[0]
            out.append((pack_path(snap.repo.path, name), name, r))
    return out


def _patch(path, offset, data: bytes):
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _reference(repo, name, r) -> str:
    """What the pure-Python decoder says about this blob: its FormatError, or, when it
    decodes, the page checksum failure that follows."""
    br = BlobReader(repo.path)
    try:
        br.read_at(name, r[1], r[2], r[3], r[4], r[5], r[6], python=True)
    except FormatError as e:
        return f"{IMG}: {e}"
    finally:
        br.close()
    return f"a page of {IMG} fails its checksum"


def _refused_alike(snap, pp, name, r, parallel_exact=True, fresh=True):
    """Every read path refuses the image with the Python decoder's message and the pack.
    fresh=False: read through `snap` itself (its packs were checked before the damage)."""
    want = f"damaged: {_reference(snap.repo, name, r)} (pack {pp})"
    s = Repository.open(snap.repo.path).snapshot(snap.path.name) if fresh else snap
    with pytest.raises(CorruptSnapshot) as e:
        read_all(s, IMG)
    assert want in str(e.value)
    for threads in (1, 3):
        out = snap.path.parent.parent / f"out-{threads}-{os.urandom(4).hex()}"
        out.mkdir(mode=0o700)
        with pytest.raises(CorruptSnapshot) as e:
            parallel_read.write_images(s, out, threads, threading.Event(), [0])
        assert (want if parallel_exact else str(pp)) in str(e.value)
        with pytest.raises(CorruptSnapshot) as e:
            b"".join(parallel_read.iter_image_parallel(s, IMG, threads))
        assert (want if parallel_exact else str(pp)) in str(e.value)
    return want


@pytest.fixture
def small_jobs(monkeypatch):
    monkeypatch.setattr(parallel_read, "JOB_BYTES", 7 * PAGE)


def _snap(tmp_path, codec):
    repo = Repository.open(tmp_path / "repo", create=True)
    s, _ = dump(repo, {IMG: BASE}, compress=codec)
    return s


def _flip(path, offset, mask=0x5A) -> bytes:
    """XOR one byte of the file; -> its old value."""
    fd = os.open(path, os.O_RDONLY)
    try:
        old = os.pread(fd, 1, offset)
    finally:
        os.close(fd)
    _patch(path, offset, bytes([old[0] ^ mask]))
    return old


@pytest.mark.parametrize("codec", ["none", "lz4", "zstd", "shuffle4-zstd", "shuffle2-zstd"])
@pytest.mark.parametrize("where", [0.1, 0.5, 0.95])
def test_flipped_payload_byte(tmp_path, small_jobs, codec, where):
    s = _snap(tmp_path, codec)
    pp, name, r = _runs(s, CODEC_IDS[codec])[1]
    _flip(pp, r[1] + 16 + int(r[6] * where))
    _refused_alike(s, pp, name, r)


@pytest.mark.parametrize("field,value,message", [
    (0, b"GX", "bad blob header magic"),
    (6, b"\x01\x00", "bad blob header magic"),                      # reserved
    (2, b"\x07", "unknown blob kind 7"),
    (2, b"\x02", "data blob with bad length / page count"),
    (3, b"\x09", "unknown codec id 9"),
    (4, b"\x0f\x00", "page blob with inconsistent page count / length"),
    (3, b"\x01", ""),                                               # another codec
    (12, b"\x01\x00\x00\x00", ""),                                   # another stored length
    (8, b"\x00\x10\x01\x00", "page blob with inconsistent page count / length"),   # another raw length
])
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_wrong_header_field(tmp_path, small_jobs, codec, field, value, message):
    s = _snap(tmp_path, codec)
    pp, name, r = _runs(s, CODEC_IDS[codec])[2]
    _patch(pp, r[1] + field, value)
    assert message in _refused_alike(s, pp, name, r)


@pytest.mark.parametrize("codec", ["none", "lz4", "shuffle4-zstd"])
def test_truncated_pack(tmp_path, small_jobs, codec):
    """A pack cut short after the snapshot checked its packs (opening a snapshot refuses a
    short pack before any read: tests/test_repo_corruption.py)."""
    s = _snap(tmp_path, codec)
    assert s.reading_locations() is s.locations()          # checked now, not again
    pp, name, r = _runs(s, CODEC_IDS[codec])[1]
    os.chmod(pp, 0o600)
    os.truncate(pp, r[1] + 16 + r[6] // 2)
    # the parallel paths may meet a later blob of the same pack first
    want = _refused_alike(s, pp, name, r, parallel_exact=False, fresh=False)
    assert f"{IMG}: pack truncated: blob at offset {r[1]} cut short" in want


def test_missing_pack(tmp_path, small_jobs):
    s = _snap(tmp_path, "zstd")
    assert s.reading_locations() is s.locations()
    pp, name, r = _runs(s)[0]
    os.unlink(pp)
    for it in (lambda: read_all(s, IMG), lambda: b"".join(parallel_read.iter_image_parallel(s, IMG, 2))):
        with pytest.raises(CorruptSnapshot, match=f"{IMG}: pack missing") as e:
            it()
        assert str(pp) in str(e.value)


def _raw_frame(content_size: int | None, payload_len: int, window_log: int = 20) -> bytes:
    """A zstd frame of exactly payload_len bytes whose content is one raw block, declaring
    content_size (None: not declared; then a window descriptor instead)."""
    if content_size is None:
        head = b"\x28\xb5\x2f\xfd" + bytes([0x00, (window_log - 10) << 3])
    else:
        head = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", content_size)   # single segment, 8-byte size
    n = payload_len - len(head) - 3
    assert n > 0
    return head + struct.pack("<I", (n << 3) | 1)[:3] + b"\x42" * n                    # last block, raw


def _rle_frame(block: int, nblocks: int, payload_len: int) -> bytes:
    """A zstd frame without a declared size of nblocks RLE blocks of `block` bytes, padded
    with a last raw block to exactly payload_len bytes."""
    head = b"\x28\xb5\x2f\xfd" + bytes([0x00, (17 - 10) << 3])
    body = b"".join(struct.pack("<I", (block << 3) | 2)[:3] + b"\x07" for _ in range(nblocks))
    n = payload_len - len(head) - len(body) - 3
    assert n > 0
    return head + body + struct.pack("<I", (n << 3) | 1)[:3] + b"\x07" * n


@pytest.mark.parametrize("case", ["declares-larger", "declares-smaller", "produces-less", "produces-more", "garbage"])
def test_lying_zstd_frame(tmp_path, small_jobs, case):
    s = _snap(tmp_path, "zstd")
    pp, name, r = _runs(s, CODEC_ZSTD)[1]
    raw_len, stored = r[5], r[6]
    assert stored > 64
    frame = {
        "declares-larger": lambda: _raw_frame(raw_len + PAGE, stored),
        "declares-smaller": lambda: _raw_frame(raw_len - PAGE, stored),
        "produces-less": lambda: _raw_frame(raw_len, stored),
        "produces-more": lambda: _rle_frame(1 << 16, raw_len // (1 << 16) + 2, stored),
        "garbage": lambda: b"\x28\xb5\x2f\xfd" + b"\xff" * (stored - 4),
    }[case]()
    assert len(frame) == stored
    _patch(pp, r[1] + 16, frame)
    want = _refused_alike(s, pp, name, r)
    if case.startswith("declares"):
        assert "zstd frame of blob declares a different size" in want
    elif case == "produces-more":
        assert f"blob decompressed to another size than {raw_len} bytes" in want
    else:
        assert "cannot decompress blob" in want


@pytest.mark.parametrize("case", ["too-long", "zero", "shifted", "sum-short", "plane-declares"])
@pytest.mark.parametrize("codec", ["shuffle4-zstd", "shuffle2-zstd"])
def test_lying_shuffle_planes(tmp_path, small_jobs, codec, case):
    s = _snap(tmp_path, codec)
    k = 4 if codec == "shuffle4-zstd" else 2
    pp, name, r = _runs(s, CODEC_IDS[codec])[0]
    with open(pp, "rb") as f:
        f.seek(r[1] + 16)
        payload = f.read(r[6])
    m = r[5] // k
    lens = list(struct.unpack_from(f"<{k}I", payload))
    z = [i for i in range(k) if lens[i] < m]        # planes stored as zstd frames
    assert z, lens
    if case == "too-long":
        lens[0] = m + 1
    elif case == "zero":
        lens[-1] = 0
    elif case == "shifted":                          # the sum still tiles the payload
        i = z[0]
        j = (i + 1) % k
        lens[i] -= 1
        lens[j] += 1
    elif case == "sum-short":
        lens[z[0]] -= 1
    if case == "plane-declares":                    # a plane's frame declares another size
        start = 4 * k + sum(lens[:z[0]])
        frame = _raw_frame(m + 8, lens[z[0]])
        _patch(pp, r[1] + 16 + start, frame)
    else:
        _patch(pp, r[1] + 16, struct.pack(f"<{k}I", *lens))
    want = _refused_alike(s, pp, name, r)
    if case in ("too-long", "zero", "sum-short"):
        assert "shuffle payload: bad plane lengths" in want
    elif case == "plane-declares":
        assert f"zstd frame of plane {z[0]} declares a different size" in want


@pytest.mark.parametrize("codec", ["lz4", "zstd", "shuffle4-zstd", "shuffle2-zstd", "none"])
def test_random_damage_never_crashes(tmp_path, small_jobs, codec):
    """Many single-byte changes in headers and payloads, one at a time: each read gives
    what the Python decoder says about the damaged blob (its error, the page checksum
    failure, or, for a change the decoder does not feel such as a zstd window size, the
    exact bytes), and never a crash."""
    s = _snap(tmp_path, codec)
    rng = np.random.default_rng(3)
    runs = _runs(s, CODEC_IDS[codec])
    br = BlobReader(s.repo.path)
    refused = 0
    for t in range(40):
        pp, name, r = runs[int(rng.integers(len(runs)))]
        before = br.read_at(name, *r[1:7], python=True)
        off = r[1] + int(rng.integers(16 + r[6]))
        old = _flip(pp, off, int(rng.integers(1, 256)))
        try:
            after = br.read_at(name, *r[1:7], python=True)
        except FormatError:
            after = None
        fresh = Repository.open(s.repo.path).snapshot(s.path.name)
        if after is not None and bytes(after) == bytes(before):
            assert read_all(fresh, IMG) == BASE
        else:
            refused += 1
            with pytest.raises(CorruptSnapshot) as e:
                read_all(fresh, IMG)
            assert f"damaged: {_reference(s.repo, name, r)} (pack {pp})" in str(e.value)
        _patch(pp, off, old)
    br.close()
    assert refused >= 30
    assert read_all(Repository.open(s.repo.path).snapshot(s.path.name), IMG) == BASE


def test_decode_job_refuses_pieces_outside_the_buffer(tmp_path):
    """The binding's own checks: a piece that would write past the job's buffer is refused
    before anything is read (ValueError, not a write out of bounds)."""
    from array import array

    s = _snap(tmp_path, "lz4")
    pp, name, r = _runs(s)[0]
    fd = os.open(pp, os.O_RDONLY)
    try:
        buf = bytearray(PAGE * 2)
        a = array("q", (fd, 0, r[1], r[2], r[3], r[4], r[5], r[6], 0, 2, PAGE))
        with pytest.raises(ValueError):
            native.decode_job(a, 1, buf, 0, b"", b"")
        a = array("q", (fd, 0, r[1], r[2], r[3], r[4], r[5], r[6], 0, 1, 0))
        assert native.decode_job(a, 1, buf, 0, b"", b"") is None
        assert bytes(buf[:PAGE]) == BASE[:PAGE]
        # a record that contradicts the format is refused as the locations check would
        a = array("q", (fd, 0, r[1], r[2], r[3], r[4], r[4] * PAGE + 1, r[6], 0, 1, 0))
        code, piece, _, msg = native.decode_job(a, 1, buf, 0, b"", b"")
        assert (code, piece, msg) == (native.DECODE_FORMAT, 0, "page blob with inconsistent page count / length")
    finally:
        os.close(fd)


# -- data blobs: one payload at a time (gs_decode_payload through store.decode_blob) -------
def _data_image() -> bytes:
    """A non-pages image of several data blobs: text, fp32, random, and a short tail."""
    rng = np.random.default_rng(11)
    fp32 = rng.standard_normal(300_000).astype(np.float32).tobytes()
    text = (b"criu image bytes " * 90_000)[:1_400_000]
    return text + fp32 + rng.bytes(200_000) + b"tail"


@pytest.mark.parametrize("codec", CODECS)
def test_data_images_read_back_through_the_native_decoder(tmp_path, codec):
    """A data image written with every codec reads back exactly, and each of its compressed
    blobs decodes natively to the very bytes the Python decoder gives."""
    data = _data_image()
    repo = Repository.open(tmp_path / "repo", create=True)
    s, _ = dump(repo, {"core-1.img": data}, compress=codec)
    assert read_all(Repository.open(repo.path).snapshot(s.path.name), "core-1.img") == data
    loc = s.reading_locations()
    br = BlobReader(repo.path)
    seen = set()
    for r in loc.iter_runs(s.image_no("core-1.img")):
        name = loc.pack(r[0])[0]
        seen.add(r[3])
        assert bytes(br.read_at(name, *r[1:7])) == bytes(br.read_at(name, *r[1:7], python=True))
    br.close()
    if codec not in ("none", "auto"):
        assert CODEC_IDS[codec] in seen     # (the random part is stored raw)


@pytest.mark.parametrize("codec", [CODEC_LZ4, CODEC_ZSTD, CODEC_SHUF4_ZSTD, CODEC_SHUF2_ZSTD])
@pytest.mark.parametrize("size", [4096 * 3 + 7, 1 << 20, (1 << 20) + 6, 4 << 20])
def test_decode_payload_matches_the_python_decoder(codec, size):
    """Payloads up to the format's largest blob (4 MiB: the shuffle codecs' planes then do
    not fit the per-thread scratch), at an offset inside their buffer, decode exactly; and
    the same payload with damage is refused or decodes to raw_len bytes (never a crash,
    never a write outside the output)."""
    from gpusnap.repo import codec as codec_mod

    rng = np.random.default_rng(size)
    raw = (rng.integers(0, 64, size // 4 + 1).astype(np.float32) / 8).tobytes()[:size]   # compresses with each
    used, payload = codec_mod.compress(raw, codec)
    assert used == codec
    buf = b"head" + payload + b"after"
    out = bytearray(size + 64)
    view = memoryview(out)[32:32 + size]
    assert native.decode_payload(buf, 4, len(payload), codec, view) is None
    assert bytes(view) == raw and out[:32] == bytes(32) and out[32 + size:] == bytes(32)
    refused = 0
    for t in range(12):
        bad = bytearray(payload)
        bad[int(rng.integers(len(bad)))] ^= int(rng.integers(1, 256))
        got = native.decode_payload(bytes(bad), 0, len(bad), codec, view)
        # a damage the decoder does not feel gives other bytes (libzstd's versions may even
        # differ on which): the blob's blake3 refuses those, see the damaged-blob test below
        if got is not None:
            refused += 1
            assert got[0] in (native.DECODE_CODEC, native.DECODE_FORMAT) and got[1]
        assert out[:32] == bytes(32) and out[32 + size:] == bytes(32)
    if codec in (CODEC_SHUF4_ZSTD, CODEC_SHUF2_ZSTD):
        # planes are mostly Huffman-coded literals, where a damaged byte is felt less often
        # than in sequences: the magic number of the first plane stored as a frame, damaged,
        # is always refused
        k = 4 if codec == CODEC_SHUF4_ZSTD else 2
        lens = struct.unpack_from(f"<{k}I", payload)
        first = next(i for i in range(k) if lens[i] < size // k)
        bad = bytearray(payload)
        bad[4 * k + sum(lens[:first])] ^= 0xFF
        got = native.decode_payload(bytes(bad), 0, len(bad), codec, view)
        assert got is not None and got[0] in (native.DECODE_CODEC, native.DECODE_FORMAT) and got[1]
        assert out[:32] == bytes(32) and out[32 + size:] == bytes(32)
        refused += 1
    assert refused                 # (damage the decoder does not feel is rare, not the rule)


def test_decode_payload_refuses_lengths_outside_the_format():
    out = bytearray(16)
    assert native.decode_payload(b"x" * 16, 0, 16, CODEC_LZ4, out)[0] == native.DECODE_FORMAT   # not smaller
    assert native.decode_payload(b"x" * 8, 0, 8, 9, out)[0] == native.DECODE_FORMAT             # no such codec
    big = bytearray((4 << 20) + 1)
    assert native.decode_payload(b"x" * 8, 0, 8, CODEC_ZSTD, big)[0] == native.DECODE_FORMAT    # past MAX_BLOB_RAW
    with pytest.raises(ValueError):
        native.decode_payload(b"x" * 8, 4, 8, CODEC_LZ4, out)                                   # outside its buffer


def test_damaged_data_blob_gives_the_python_decoders_words(tmp_path):
    """A data blob whose payload no longer decodes is refused by every reader with what
    the Python decoder says about it."""
    data = _data_image()
    repo = Repository.open(tmp_path / "repo", create=True)
    s, _ = dump(repo, {"core-1.img": data}, compress="zstd")
    loc = s.reading_locations()
    r = next(r for r in loc.iter_runs(s.image_no("core-1.img")) if r[3] == CODEC_ZSTD)
    name = loc.pack(r[0])[0]
    pp = pack_path(repo.path, name)
    _patch(pp, r[1] + 16, b"\x28\xb5\x2f\xfd" + b"\xff" * 12)
    br = BlobReader(repo.path)
    with pytest.raises(FormatError) as py:
        br.read_at(name, *r[1:7], python=True)
    with pytest.raises(FormatError) as nat:
        br.read_at(name, *r[1:7])
    br.close()
    assert str(nat.value) == str(py.value)
    with pytest.raises(CorruptSnapshot) as e:
        read_all(Repository.open(repo.path).snapshot(s.path.name), "core-1.img")
    assert str(py.value) in str(e.value) and str(pp) in str(e.value)


def test_reading_a_snapshot_loads_neither_lz4_nor_zstandard(tmp_path):
    """A restore reads every image and never needs python-lz4 or zstandard (their modules
    cost a cold restore 30-50 ms): the native library decodes every blob."""
    import subprocess
    import sys

    data = _data_image()
    repo = Repository.open(tmp_path / "repo", create=True)
    s, _ = dump(repo, {"core-1.img": data, IMG: BASE}, compress="auto")
    code = ("import sys\nfrom gpusnap.repo import Repository\n"
            f"s = Repository.open({str(repo.path)!r}).snapshot({s.path.name!r})\n"
            f"assert b''.join(s.read_image('core-1.img')) == open({str(tmp_path / 'want')!r}, 'rb').read()\n"
            f"assert len(b''.join(s.read_image({IMG!r}))) == {len(BASE)}\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('lz4', 'zstandard'))))\n")
    (tmp_path / "want").write_bytes(data)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == ""
