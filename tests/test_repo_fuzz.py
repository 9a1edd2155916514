"""Hypothesis fuzzing of every on-disk parser: malformed input -> FormatError, nothing else."""

import io
import json

import blake3
import pytest
from hypothesis import assume, given, settings, strategies as st

from gpusnap.repo import format as F
from gpusnap.repo.codec import decompress, compress
from gpusnap.repo.format import FormatError

FUZZ = settings(max_examples=400, deadline=None)


def _valid_index():
    blobs = [F.Blob(b"\x01" * 32, 16, F.KIND_PAGES, F.CODEC_LZ4, 2, 2 * F.PAGE_SIZE, 100, bytes(range(32))),
             F.Blob(b"\x02" * 32, 132, F.KIND_DATA, F.CODEC_NONE, 0, 10, 10, bytes(32))]
    return F.encode_index([b"\x01" * 32, b"\x02" * 32], blobs)


def _valid_pack():
    import lz4.block
    parts = [F.encode_pack_header()]
    p1 = lz4.block.compress(bytes(8192), store_size=False)
    parts += [F.encode_blob_header(F.KIND_PAGES, F.CODEC_LZ4, 2, 8192, len(p1)), p1]
    parts += [F.encode_blob_header(F.KIND_DATA, F.CODEC_NONE, 0, 5, 5), b"hello"]
    parts.append(F.encode_pack_trailer(2))
    return b"".join(parts)


def _valid_manifest():
    body = {"format": "gpusnap-snapshot", "version": 1, "repo_id": "0" * 32, "name": "job", "created": 1.5,
            "meta": {}, "stats": {},
            "images": [{"name": "pages-1.img", "type": "pages", "size": 8192, "digest": "a" * 64,
                        "pagelist": "pl-000000", "pagelist_size": 42},
                       {"name": "core-1.img", "type": "blob", "size": 3, "digest": "b" * 64, "blobs": ["c" * 64]}]}
    return F.encode_manifest(body)[0]


def _valid_pagelist():
    return (F.encode_pl_zero(3) + F.encode_pl_pages([bytes(16), b"\x01" * 16]) + F.encode_pl_tail(100, bytes(32)))


def mutations(valid: bytes):
    """Random edits of a valid file: flips, truncations, insertions, splices - and pure noise."""
    return st.one_of(
        st.binary(max_size=600),
        st.tuples(st.integers(0, len(valid) - 1), st.integers(1, 255)).map(
            lambda t: valid[:t[0]] + bytes([valid[t[0]] ^ t[1]]) + valid[t[0] + 1:]),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=40)).map(
            lambda t: valid[:t[0]] + t[1] + valid[t[0]:]),
        st.tuples(st.integers(0, len(valid)), st.binary(max_size=40)).map(
            lambda t: valid[:t[0]] + t[1] + valid[t[0] + len(t[1]):]),
    )


def test_valid_samples_parse():
    F.parse_index(_valid_index())
    assert len(F.parse_pack(_valid_pack())) == 2
    F.parse_manifest(_valid_manifest())
    pl = _valid_pagelist()
    assert len(list(F.iter_pagelist(io.BytesIO(pl).read, 5 * F.PAGE_SIZE + 100))) == 3


@FUZZ
@given(mutations(_valid_index()))
def test_fuzz_index(data):
    """An index file is checksummed: every change is refused."""
    assume(data != _valid_index())
    with pytest.raises(FormatError):
        F.parse_index(data)


@FUZZ
@given(st.data())
def test_fuzz_index_rehashed(d):
    """Mutate the body but fix the checksum, so the structural checks are exercised."""
    v = _valid_index()[:-32]
    body = d.draw(mutations(v))
    try:
        idx = F.parse_index(body + blake3.blake3(body).digest())
    except FormatError:
        return
    for b in idx.blobs:
        assert b.pack in idx.packs
        F.check_blob_fields(b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len)


@FUZZ
@given(mutations(_valid_pack()))
def test_fuzz_pack(data):
    try:
        blobs = F.parse_pack(data)
    except FormatError:
        return
    for off, h in blobs:
        assert off + 16 + h.stored_len <= len(data) - 16


@FUZZ
@given(mutations(F.encode_blob_header(F.KIND_PAGES, F.CODEC_ZSTD, 3, 3 * 4096, 500)))
def test_fuzz_blob_header(data):
    try:
        F.parse_blob_header(data, 0)
    except FormatError:
        pass


@FUZZ
@given(mutations(_valid_manifest()))
def test_fuzz_manifest(data):
    """A manifest is checksummed: every change is refused."""
    assume(data != _valid_manifest())
    with pytest.raises(FormatError):
        F.parse_manifest(data)


@FUZZ
@given(st.data())
def test_fuzz_manifest_digits(d):
    """A digit changed to another digit keeps the JSON valid and well formed: the checksum
    alone refuses it."""
    valid = _valid_manifest()
    body = valid[:-F.MANIFEST_TRAILER_LEN]
    at = d.draw(st.sampled_from([i for i, c in enumerate(body) if chr(c).isdigit()]))
    digit = d.draw(st.sampled_from([c for c in b"0123456789" if c != body[at]]))
    changed = body[:at] + bytes([digit]) + body[at + 1:]
    with pytest.raises(FormatError, match="checksum"):
        F.parse_manifest(changed + valid[-F.MANIFEST_TRAILER_LEN:])


@FUZZ
@given(st.data())
def test_fuzz_manifest_rehashed(d):
    body = _valid_manifest()[:-F.MANIFEST_TRAILER_LEN]
    body = d.draw(mutations(body))
    data = body + F.MANIFEST_TRAILER_PREFIX + blake3.blake3(body).hexdigest().encode() + b"\n"
    try:
        m, _ = F.parse_manifest(data)
    except FormatError:
        return
    for im in m["images"]:
        assert F.valid_image_name(im["name"])


@FUZZ
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=20),
       st.sampled_from(["images", "name", "created", "meta", "version", "stats"]))
def test_fuzz_manifest_schema(value, key):
    m = json.loads(_valid_manifest()[:-F.MANIFEST_TRAILER_LEN])
    m[key] = value
    try:
        F.check_manifest(m)
    except FormatError:
        pass
    m = json.loads(_valid_manifest()[:-F.MANIFEST_TRAILER_LEN])
    m["images"][0][key if key != "images" else "size"] = value
    try:
        F.check_manifest(m)
    except FormatError:
        pass


@FUZZ
@given(mutations(_valid_pagelist()), st.integers(0, 1 << 40))
def test_fuzz_pagelist(data, size):
    try:
        n = 0
        for rec in F.iter_pagelist(io.BytesIO(data).read, size):
            n += 1
            assert n < 10000
    except FormatError:
        pass


@FUZZ
@given(mutations(F.encode_config(F.make_config("0" * 32, 1.0))))
def test_fuzz_config(data):
    try:
        F.parse_config(data)
    except FormatError:
        pass


@FUZZ
@given(st.binary(max_size=300), st.sampled_from([F.CODEC_NONE, F.CODEC_LZ4, F.CODEC_ZSTD, 7]),
       st.integers(0, 1 << 22))
def test_fuzz_decompress(payload, codec, raw_len):
    try:
        out = decompress(payload, codec, raw_len)
    except FormatError:
        return
    assert len(out) == raw_len


@FUZZ
@given(st.binary(max_size=3000), st.sampled_from([F.CODEC_LZ4, F.CODEC_ZSTD]), st.data())
def test_fuzz_decompress_mutated(raw, codec, d):
    if not raw:
        return
    c, payload = compress(raw, codec)
    assert decompress(payload, c, len(raw)) == raw
    bad = d.draw(mutations(payload)) if payload else b""
    try:
        out = decompress(bad, c, len(raw))
    except FormatError:
        return
    assert len(out) == len(raw)
