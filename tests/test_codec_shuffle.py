"""Byte-shuffle codecs (codec 3 shuffle4-zstd, 4 shuffle2-zstd; native/pages/gs_shuffle.c via
gpusnap/repo/native.py) and the per-group "auto" choice: round trips for every length (also
non-multiples of the element size), native AVX2 == native portable == the pure-Python
reference (tests/page_reference.py), payload
layout as docs/format.md §3 describes it, malformed payloads -> FormatError (never a crash),
and what auto picks for float, random, text and zero-heavy data."""

from __future__ import annotations

import os
import random
import struct

import pytest
from hypothesis import given, settings, strategies as st

import page_reference as ref
from gpusnap.repo import codec as C, native
from gpusnap.repo.format import CODEC_LZ4, CODEC_NONE, CODEC_SHUF2_ZSTD, CODEC_ZSTD, CODEC_SHUF4_ZSTD, CODECS, FormatError, check_blob_fields, KIND_DATA, parse_blob_header
from repo_helpers import PAGE, dump, read_all

np = pytest.importorskip("numpy")

FUZZ = settings(max_examples=300, deadline=None)
LENGTHS = list(range(0, 140)) + [255, 256, 257, 1023, 4095, 4096, 4097, 65533, 65534, 65535, 65536, 65537]


def _fp32(n_floats, std=0.02, seed=0):
    return np.random.default_rng(seed).normal(0, std, n_floats).astype(np.float32).tobytes()


def _bf16(n, seed=0):
    f = np.random.default_rng(seed).normal(0, 0.02, n).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _ref_shuffle(b, k):
    m = len(b) // k
    return bytes(b[j * k + i] for i in range(k) for j in range(m)) + b[m * k:]


# -- the shuffle itself -------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 4])
def test_reference_shuffle_matches_definition(k):
    r = random.Random(k)
    for n in range(0, 70):
        b = bytes(r.getrandbits(8) for _ in range(n))
        assert ref.shuffle(b, k) == _ref_shuffle(b, k)
        assert ref.unshuffle(_ref_shuffle(b, k), k) == b


@pytest.mark.parametrize("k", [2, 4])
def test_native_equals_reference_all_lengths(k):
    r = random.Random(7 + k)
    for n in LENGTHS:
        b = r.randbytes(n)
        want = ref.shuffle(b, k)
        assert native.shuffle(b, k) == want, n
        assert native.shuffle(b, k, native.SHUFFLE_PORTABLE) == want, n
        assert native.unshuffle(want, k) == b, n
        assert native.unshuffle(want, k, native.SHUFFLE_PORTABLE) == b, n
        assert ref.unshuffle(want, k) == b, n
        out = bytearray(b"\xaa" * (n + 3))              # into a bigger buffer: only its head
        native.shuffle_into(b, k, out)
        assert out[:n] == want and out[n:] == b"\xaa" * 3, n
        native.unshuffle_into(want, k, memoryview(out)[:n], native.SHUFFLE_PORTABLE)
        assert out[:n] == b and out[n:] == b"\xaa" * 3, n


def test_shuffle_into_rejects_short_or_read_only_output():
    b = os.urandom(100)
    for out in (bytearray(99), b"x" * 100, memoryview(bytearray(100)).toreadonly()):
        with pytest.raises(ValueError):
            native.shuffle_into(b, 4, out)


def test_native_accepts_buffers_and_rejects_bad_k():
    b = os.urandom(1000)
    assert native.shuffle(bytearray(b), 4) == native.shuffle(memoryview(b), 4) == ref.shuffle(b, 4)
    for k in (0, 1, 3, 8):
        with pytest.raises(ValueError):
            native.shuffle(b, k)
        with pytest.raises(ValueError):
            ref.shuffle(b, k)


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_plane_bits(impl):
    f = native.plane_bits if impl == "native" else ref.plane_bits
    assert f(bytes(4096), 1024, 4, 1, 1024) == [0, 0, 0, 0]
    assert f(b"", 0, 3, 1, 0) == [8000, 8000, 8000]
    rb = f(os.urandom(1 << 16), 1 << 14, 4, 1, 1 << 14)
    assert all(7950 <= x <= 8000 for x in rb)
    two = bytes(range(2)) * 2048                       # 1 bit per byte
    assert f(two, 0, 1, 1, 4096) == [1000]
    with pytest.raises(ValueError):
        f(bytes(100), 50, 3, 1, 10)                   # plane 2 outside the buffer
    with pytest.raises(ValueError):
        f(bytes(100), 1, 1, 0, 10)


def test_plane_bits_native_equals_reference():
    r = random.Random(3)
    datas = [os.urandom(65536), _fp32(16384), bytes(r.choices(b"abcab  \0", k=9999)), _bf16(20000)]
    for d in datas:
        for args in [(len(d) // 4, 4, 1, len(d) // 4), (1, 4, 32, (len(d) // 4 - 1) // 8 + 1),
                     (1, 2, 6, 1000), (0, 1, 1, len(d)), (len(d) // 4, 4, 7, 100),
                     # the one-pass path for 4 interleaved planes (the codec's sample and estimate)
                     (1, 4, 4, len(d) // 4), (1, 4, 8, 3), (1, 4, 4, 0), (1, 4, 3, 100)]:
            assert native.plane_bits(d, *args) == ref.plane_bits(d, *args), args


# -- codec round trips ----------------------------------------------------------------------------
@pytest.mark.parametrize("codec", [CODEC_SHUF4_ZSTD, CODEC_SHUF2_ZSTD])
def test_roundtrip_all_lengths(codec):
    r = random.Random(codec)
    k = C.SHUFFLE_K[codec]
    for n in LENGTHS:
        for data in (r.randbytes(n), bytes(n), _fp32((n + 3) // 4)[:n], _bf16((n + 1) // 2)[:n]):
            payload = C.encode_shuffled(data, k)
            if n < k:
                assert payload is None
                continue
            assert C.decode_shuffled(payload, k, n) == data, n
            c, p = C.compress(data, codec)
            assert c in (codec, CODEC_NONE)
            assert C.decompress(p, c, n) == data
            if c != CODEC_NONE:
                check_blob_fields(KIND_DATA, c, 0, n, len(p))


@given(data=st.binary(max_size=5000), codec=st.sampled_from([CODEC_SHUF4_ZSTD, CODEC_SHUF2_ZSTD, C.CODEC_AUTO]))
@FUZZ
def test_roundtrip_fuzz(data, codec):
    c, p = C.compress(data, codec)
    assert c in CODECS
    assert C.decompress(p, c, len(data)) == data


def test_payload_layout_is_documented_one():
    """docs/format.md §3: k u32 plane lengths, planes (zstd frame or raw), tail."""
    data = _fp32(1000) + b"xyz"                         # 4003 bytes: m = 1000, tail 3
    p = C.encode_shuffled(data, 4)
    lens = struct.unpack_from("<4I", p)
    assert len(p) == 16 + sum(lens) + 3 and p.endswith(b"xyz")
    sh = ref.shuffle(data, 4)
    pos = 16
    for i, ln in enumerate(lens):
        seg = p[pos:pos + ln]
        plane = sh[i * 1000:(i + 1) * 1000]
        if ln == 1000:
            assert seg == plane
        else:
            import zstandard
            assert seg[:4] == b"\x28\xb5\x2f\xfd"
            assert zstandard.ZstdDecompressor().decompress(seg, max_output_size=1000) == plane
        pos += ln
    assert lens[3] < 1000 and lens[0] == 1000            # exponent plane compressed, low mantissa raw


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_native_and_reference_payloads_identical(monkeypatch, impl):
    """The reference gives the same stored bytes (the plane estimate and shuffle agree)."""
    data = _fp32(16384, seed=4) + _bf16(5000, seed=5)[:4097]
    want = C.compress(data, C.CODEC_AUTO)
    if impl == "reference":
        monkeypatch.setattr(native, "shuffle", ref.shuffle)
        monkeypatch.setattr(native, "unshuffle", ref.unshuffle)
        monkeypatch.setattr(native, "shuffle_into", lambda d, k, out: out.__setitem__(slice(0, len(d)), ref.shuffle(d, k)))
        monkeypatch.setattr(native, "unshuffle_into", lambda d, k, out: out.__setitem__(slice(0, len(d)), ref.unshuffle(d, k)))
        monkeypatch.setattr(native, "plane_bits", ref.plane_bits)
    assert C.compress(data, C.CODEC_AUTO) == want
    assert C.decompress(want[1], want[0], len(data)) == data


# -- malformed payloads -------------------------------------------------------------------------
def _valid_payload(k=4):
    return C.encode_shuffled(_fp32(1024, seed=9)[:4096 - 1], k)   # 4095 bytes: a tail


@given(payload=st.binary(max_size=400), raw_len=st.integers(0, 5000),
       codec=st.sampled_from([CODEC_SHUF4_ZSTD, CODEC_SHUF2_ZSTD]))
@FUZZ
def test_decompress_garbage_is_format_error(payload, raw_len, codec):
    try:
        out = C.decompress(payload, codec, raw_len)
    except FormatError:
        return
    assert len(out) == raw_len


@given(st.data())
@FUZZ
def test_decompress_mutated_payload(data):
    k = data.draw(st.sampled_from([4, 2]))
    codec = CODEC_SHUF4_ZSTD if k == 4 else CODEC_SHUF2_ZSTD
    p = bytearray(_valid_payload(k))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(p) - 1))
        p[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(p)))
        p = p[:cut] + bytes(data.draw(st.binary(max_size=20)))
    raw_len = data.draw(st.sampled_from([4095, 4096, 4094, 1, 0, 3, 8191]))
    try:
        out = C.decompress(bytes(p), codec, raw_len)
    except FormatError:
        out = None
    else:
        assert len(out) == raw_len
    into = bytearray(raw_len)
    try:
        C.decompress_into(bytes(p), codec, memoryview(into))
    except FormatError:
        assert out is None
    else:
        assert into == out


@pytest.mark.parametrize("codec", [CODEC_NONE, CODEC_LZ4, CODEC_ZSTD, CODEC_SHUF4_ZSTD, CODEC_SHUF2_ZSTD])
def test_decompress_into_writes_exactly_its_view(codec):
    """What restore decodes in place (reader.assemble) is what decompress() returns, and
    nothing outside the view is touched."""
    r = random.Random(codec)
    for n in (1, 3, 4, 5, 4095, 4096, 65536, 65539):
        for data in (r.randbytes(n), bytes(n), _fp32((n + 3) // 4)[:n]):
            c, p = C.compress(data, codec)
            buf = bytearray(b"\xaa" * (n + 20))
            C.decompress_into(p, c, memoryview(buf)[10:10 + n])
            assert buf[10:10 + n] == data and buf[:10] == buf[10 + n:] == b"\xaa" * 10, (c, n)
            if c != CODEC_NONE:
                with pytest.raises(FormatError):
                    C.decompress_into(p, c, memoryview(bytearray(n + 1)))


def test_specific_malformed_payloads():
    good = _valid_payload(4)
    lens = list(struct.unpack_from("<4I", good))
    body = good[16:]
    bad = [
        b"",                                                   # no header
        good[:15],                                             # short header
        struct.pack("<4I", 0, *lens[1:]) + body,               # zero-length plane
        struct.pack("<4I", 1024, *lens[1:]) + body,            # plane longer than m
        struct.pack("<4I", lens[0] - 1, *lens[1:]) + body,     # lengths do not add up
        good[:-1],                                             # tail missing
        good + b"\0",                                          # trailing byte
    ]
    for p in bad:
        with pytest.raises(FormatError):
            C.decompress(p, CODEC_SHUF4_ZSTD, 4095)
    with pytest.raises(FormatError):
        C.decompress(good, CODEC_SHUF4_ZSTD, 3)                # shorter than one element
    # a zstd plane that decodes to another size, or declares one
    import zstandard
    z = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(500))
    p = struct.pack("<2I", len(z), 500) + z + bytes(500)
    with pytest.raises(FormatError):
        C.decompress(p, CODEC_SHUF2_ZSTD, 2000)
    z = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(500))
    p = struct.pack("<2I", len(z), 1000) + z + bytes(1000)
    with pytest.raises(FormatError):
        C.decompress(p, CODEC_SHUF2_ZSTD, 2000)


# -- auto ---------------------------------------------------------------------------------------
def test_auto_choices():
    G = 16 * PAGE
    fp32 = _fp32(G // 4)
    c, p = C.compress(fp32, C.CODEC_AUTO)
    assert c == CODEC_SHUF4_ZSTD and len(p) < 0.86 * G
    c, p = C.compress(_bf16(G // 2), C.CODEC_AUTO)
    assert c == CODEC_SHUF4_ZSTD and len(p) < 0.72 * G
    c, p = C.compress(os.urandom(G), C.CODEC_AUTO)
    assert c == CODEC_NONE and len(p) == G
    r = random.Random(1)
    words = [bytes(r.choices(b"abcdefghij_", k=r.randint(2, 9))) for _ in range(200)]
    text = b" ".join(r.choices(words, k=G))[:G]
    c, p = C.compress(text, C.CODEC_AUTO)
    assert c == CODEC_LZ4
    c, p = C.compress(bytes(G - 10) + b"x" * 10, C.CODEC_AUTO)
    assert c == CODEC_LZ4 and len(p) < 400
    for d in (fp32, text, b"", b"abc"):
        c, p = C.compress(d, C.CODEC_AUTO)
        assert C.decompress(p, c, len(d)) == d


def test_codec_names():
    assert C.codec_id("auto") == C.CODEC_AUTO and C.codec_name(C.CODEC_AUTO) == "auto"
    assert C.codec_id("shuffle4-zstd") == CODEC_SHUF4_ZSTD and C.codec_id("shuffle2-zstd") == CODEC_SHUF2_ZSTD
    with pytest.raises(ValueError):
        C.codec_id("gzip")


@pytest.mark.parametrize("compress", ["auto", "shuffle4-zstd", "shuffle2-zstd"])
def test_repository_roundtrip(tmp_path, compress):
    """Through the writer and reader: float pages go through the shuffle codec and come back."""
    data = _fp32(64 * PAGE // 4, seed=11) + os.urandom(3 * PAGE) + bytes(2 * PAGE) + _bf16(8 * PAGE // 2)
    images = {"pages-1.img": data, "core-1.img": _fp32(3000) + b"tail"}
    from gpusnap.repo import Repository
    repo = Repository.open(tmp_path / "repo", create=True)
    snap, stats = dump(repo, images, compress=compress)
    for fn, d in images.items():
        assert read_all(snap, fn) == d
    assert snap.manifest["compress"] == compress
    assert stats["pages_compressed"] >= 72
    assert stats["bytes_new_stored"] < 0.9 * stats["bytes_new_raw"]
    codecs = set()
    for pack in (tmp_path / "repo" / "packs").rglob("*"):       # walk the blob headers (format.md §3)
        if pack.is_file():
            b = pack.read_bytes()
            pos = 16
            while pos < len(b) - 16:
                h = parse_blob_header(b, pos)
                codecs.add(h.codec)
                pos += 16 + h.stored_len
    assert codecs & {CODEC_SHUF4_ZSTD, CODEC_SHUF2_ZSTD}


def test_choices_are_every_codec_and_auto():
    """The one list `dump --compress` and the completions take: every stored codec, and auto."""
    assert C.CHOICES[0] == "auto" and C.CHOICES[-1] == "none"
    assert sorted(C.codec_id(n) for n in C.CHOICES) == sorted([C.CODEC_AUTO, *CODECS])
    data = _fp32(4096)
    for n in C.CHOICES:
        c, p = C.compress(data, C.codec_id(n))
        assert C.decompress(p, c, len(data)) == data
