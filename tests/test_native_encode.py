"""The storing phase's native compress loop (native/pages/gs_encode.c via encoder.Encoder, used
by PagesSink._store_batch) against the Python path it replaced: codec.compress() with the
sink's per-thread heuristics (skip after a group that did not compress, lz4 tried first or
not), kept here as the reference. For float, bf16, zero-heavy, text, random and mixed groups
and every codec: the native payloads decode (with the Python decoder) to exactly the groups,
the chosen codecs equal the reference's group by group with the same heuristic state after
every group, across batches of any size; and a dump through the real writer reads back
exactly, with packs whose blobs are the reference's."""

from __future__ import annotations

import random
import struct

import pytest

from gpusnap.repo import Repository, codec as C, encoder
from gpusnap.repo.format import CODEC_LZ4, CODEC_NONE, CODEC_SHUF4_ZSTD, CODEC_ZSTD, KIND_PAGES, parse_pack
from gpusnap.repo.pipeline import sinks
from repo_helpers import PAGE, dump, read_all, text_page

np = pytest.importorskip("numpy")

G = 16 * PAGE
CODECS = [C.codec_id(n) for n in C.CHOICES]        # auto and every stored codec


# -- the reference: the Python path PagesSink took per group before the native loop --------
class RefState:
    def __init__(self):
        self.skip, self.skip_next, self.lz4_futile, self.since_probe = 0, 1, 0, 0

    def tuple(self):
        return (self.skip, self.skip_next, self.lz4_futile, self.since_probe)


def ref_store(st: RefState, raw: bytes, codec: int) -> tuple[int, bytes]:
    if st.skip or codec == CODEC_NONE:
        st.skip = max(st.skip - 1, 0)
        return CODEC_NONE, raw
    lz4_first = codec != C.CODEC_AUTO or st.lz4_futile < encoder.LZ4_FUTILE or st.since_probe >= encoder.LZ4_PROBE
    c, payload = C.compress(raw, codec, lz4_first=lz4_first)
    st.since_probe = 0 if lz4_first else st.since_probe + 1
    if c == CODEC_NONE:
        payload = raw
        st.skip = st.skip_next
        st.skip_next = min(st.skip_next * 2, encoder.SKIP_MAX)
    else:
        st.skip_next = 1
    st.lz4_futile = st.lz4_futile + 1 if c == CODEC_SHUF4_ZSTD else 0
    return c, payload


def ref_run(groups, codec):
    st = RefState()
    out, states = [], []
    for g in groups:
        out.append(ref_store(st, g, codec))
        states.append(st.tuple())
    return out, states


# -- data --------------------------------------------------------------------------------------
def fp32(rng, n=G):
    return rng.normal(0, 0.02, n // 4).astype(np.float32).tobytes()


def bf16(rng, n=G):
    f = rng.normal(0, 0.02, n // 2).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def zero_heavy(rng, n=G):
    b = bytearray(n)
    for i in rng.integers(0, n, n // 200):
        b[int(i)] = int(rng.integers(1, 256))
    return bytes(b)


def text(rng, n=G):
    r = random.Random(int(rng.integers(1 << 30)))
    return b"".join(text_page(r) for _ in range(-(-n // PAGE)))[:n]


def rand(rng, n=G):
    return rng.bytes(n)


KINDS = {"fp32": fp32, "bf16": bf16, "zero": zero_heavy, "text": text, "random": rand}


def batch_of(kind: str, seed: int, count: int = 40) -> list[bytes]:
    rng = np.random.default_rng(seed)
    if kind != "mixed":
        return [KINDS[kind](rng) for _ in range(count)]
    # runs that drive the heuristics: random runs (skip doubling to SKIP_MAX), long float
    # runs (lz4 stops being tried first, probes every LZ4_PROBE groups), text after floats
    # (lz4 first again), odd sizes (partial groups, lengths not a multiple of 4, shorter
    # than one element)
    out = []
    for kind, n in [("random", 12), ("fp32", 30), ("text", 3), ("fp32", 6), ("random", 3), ("zero", 2),
                    ("bf16", 4), ("fp32", 20), ("random", 1), ("fp32", 2), ("text", 1)]:
        out += [KINDS[kind](rng) for _ in range(n)]
    out += [fp32(rng, 3 * PAGE), text(rng, 4099), fp32(rng, 4097 * 4 + 3), rand(rng, 5000), text(rng, 3),
            text(rng, 1), zero_heavy(rng, 7), fp32(rng, 64), fp32(rng, PAGE)]
    return out


def native_run(groups, codec, batch_sizes=None, enc=None, in_place=True):
    """Encode groups in batches (sizes from batch_sizes, cycled; default: one batch) with one
    encoder -> ([(codec, payload)], [state after each batch's last group]). in_place=False:
    an output buffer of just the groups' size (payloads also built in scratch and copied)."""
    enc = enc or encoder.Encoder(encoder.encoder_params())
    out, states = [], []
    i = 0
    k = 0
    while i < len(groups):
        size = len(groups) - i if not batch_sizes else batch_sizes[k % len(batch_sizes)]
        k += 1
        part = groups[i:i + size]
        res, buf = enc.encode(part, codec, in_place=in_place)
        off = 0
        for j, g in enumerate(part):
            c, ln = res[2 * j], res[2 * j + 1]
            if c == CODEC_NONE:
                assert ln == len(g)
                out.append((c, g))
            else:
                out.append((c, bytes(buf[off:off + ln])))
                off += ln
        states.append(tuple(enc.state))
        i += size
    return out, states


def check_same(groups, got, want):
    """got (native) and want (reference): same codec per group, payloads that decode to the
    group, sizes within 1 % of the group per group and within 1 % of the reference's in all
    (the system's libzstd 1.5.4 frames some level-3 zstd groups a few bytes differently
    from python-zstandard's bundled 1.5.7)."""
    assert [c for c, _ in got] == [c for c, _ in want]
    for g, (c, p), (_, q) in zip(groups, got, want):
        assert bytes(C.decompress(p, c, len(g))) == g
        assert abs(len(p) - len(q)) <= len(g) // 100
    total = sum(len(p) for _, p in got)
    ref_total = sum(len(q) for _, q in want)
    assert abs(total - ref_total) <= ref_total // 100


# -- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", CODECS, ids=[C.codec_name(c) for c in CODECS])
@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_batch_equals_python_path(kind, codec):
    groups = batch_of(kind, seed=len(kind))
    want, want_states = ref_run(groups, codec)
    got, states = native_run(groups, codec)
    check_same(groups, got, want)
    assert states == [want_states[-1]]


@pytest.mark.parametrize("codec", [C.CODEC_AUTO, CODEC_LZ4, CODEC_ZSTD], ids=["auto", "lz4", "zstd"])
def test_state_sequence_group_by_group(codec):
    """One group per call: the heuristic state after every group is the reference's."""
    groups = batch_of("mixed", seed=5)
    want, want_states = ref_run(groups, codec)
    got, states = native_run(groups, codec, batch_sizes=[1])
    check_same(groups, got, want)
    assert states == want_states
    # the mix really drives the heuristics: skips, lz4 no longer first, probes, codec changes
    assert max(s[0] for s in want_states) == encoder.SKIP_MAX or codec != C.CODEC_AUTO
    if codec == C.CODEC_AUTO:
        assert max(s[2] for s in want_states) > encoder.LZ4_PROBE
        assert max(s[3] for s in want_states) == encoder.LZ4_PROBE
        assert {CODEC_NONE, CODEC_LZ4, CODEC_SHUF4_ZSTD} <= {c for c, _ in want}


@pytest.mark.parametrize("sizes", [[1, 2, 3], [7], [16, 1], [5, 30]])
def test_state_carried_across_batches(sizes):
    """Batches of any size with one encoder give what one batch gives (the sink's thread keeps
    its state from batch to batch); a fresh encoder starts from the initial state."""
    groups = batch_of("mixed", seed=11)
    want, want_states = ref_run(groups, C.CODEC_AUTO)
    enc = encoder.Encoder(encoder.encoder_params())
    got, states = native_run(groups, C.CODEC_AUTO, batch_sizes=sizes, enc=enc)
    check_same(groups, got, want)
    ends = []
    i = k = 0
    while i < len(groups):
        i = min(i + sizes[k % len(sizes)], len(groups))
        k += 1
        ends.append(want_states[i - 1])
    assert states == ends
    again, _ = native_run(groups[:20], C.CODEC_AUTO)          # a fresh encoder
    assert [c for c, _ in again] == [c for c, _ in want[:20]]
    enc.close()
    with pytest.raises(ValueError):
        enc.encode(groups[:1], C.CODEC_AUTO)


@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_payloads_byte_identical(kind):
    """auto (the default), lz4, the shuffle codecs and none: the native payloads are the
    Python path's byte for byte, so packs keep their names. liblz4 is called as python-lz4
    calls it (a fresh stream: LZ4_compress_default frames some inputs differently), the
    plane frames come from the native plane compressor on both paths. Plain zstd
    (level 3, not the default) is left out: there the two versions differ by a few bytes on
    some groups (the 1 % checks above hold)."""
    groups = batch_of(kind, seed=3, count=12)
    for codec in CODECS:
        if codec != CODEC_ZSTD:
            want, _ = ref_run(groups, codec)
            got, _ = native_run(groups, codec)
            assert got == want, C.codec_name(codec)


@pytest.mark.parametrize("codec", CODECS, ids=[C.codec_name(c) for c in CODECS])
def test_output_without_room(codec):
    """An output buffer of just the groups' size: attempts that do not fit in place are made
    in scratch buffers and copied; the result is the same."""
    groups = batch_of("mixed", seed=4)
    want = native_run(groups, codec)[0]
    assert native_run(groups, codec, in_place=False)[0] == want
    # one group per batch: no room beyond the group itself for any attempt
    assert native_run(groups, codec, batch_sizes=[1], in_place=False)[0] == want


def test_buffers_other_than_bytes():
    """bytearray and memoryview groups (the sink hands bytes) encode the same."""
    groups = batch_of("mixed", seed=2)[:30]
    got, _ = native_run(groups, C.CODEC_AUTO)
    views, _ = native_run([bytearray(g) if i % 2 else memoryview(g) for i, g in enumerate(groups)], C.CODEC_AUTO)
    assert [(c, bytes(p)) for c, p in views] == got


def test_bad_arguments():
    enc = encoder.Encoder(encoder.encoder_params())
    with pytest.raises(RuntimeError, match="bad arguments"):
        enc.encode([b"x" * 100], 9)
    assert enc.encode([], C.CODEC_AUTO)[0] == []
    bad = dict(encoder.encoder_params(), window_log=99)          # zstd refuses it
    with pytest.raises(MemoryError):
        encoder.Encoder(bad)


# -- through the real writer -------------------------------------------------------------------
@pytest.fixture
def repo(tmp_path):
    return Repository.open(tmp_path / "repo", create=True)


def _pack_blobs(repo):
    out = []
    for p in sorted((repo.path / "packs").rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            for off, h in parse_pack(data):
                out.append((h, data[off + 16:off + 16 + h.stored_len]))
    return out


@pytest.mark.parametrize("compress", ["auto", "zstd", "shuffle2-zstd", "none"])
def test_repository_round_trip(repo, monkeypatch, compress):
    """A pages image of every kind through repo.new_snapshot (one compressor thread, so blobs
    lie in group order): it reads back exactly, the packs' blobs are the reference's choices
    for the same groups, and the counters add up to what the packs hold."""
    monkeypatch.setattr(sinks, "COMPRESS_WORKERS", 1)
    rng = np.random.default_rng(7)
    pages = []
    for kind, n in [("fp32", 200), ("random", 90), ("text", 40), ("fp32", 300), ("bf16", 64), ("zero", 32),
                    ("random", 20), ("fp32", 100)]:
        data = KINDS[kind](rng, n * PAGE)
        pages += [data[i * PAGE:(i + 1) * PAGE] for i in range(n)]
    pages.insert(100, pages[5])           # a page seen before (dedup)
    pages.insert(300, bytes(PAGE))        # a zero page
    img = b"".join(pages)
    snap, stats = dump(repo, {"pages-1.img": img}, compress=compress)
    assert read_all(snap, "pages-1.img") == img

    blobs = [(h, p) for h, p in _pack_blobs(repo) if h.kind == KIND_PAGES]
    raws = [bytes(C.decompress(p, h.codec, h.raw_len)) for h, p in blobs]
    # the groups are the new pages in order, GROUP_PAGES at a time
    new = [p for i, p in enumerate(pages) if p != bytes(PAGE) and p not in pages[:i]]
    assert b"".join(raws) == b"".join(new)
    assert [h.n_pages for h, _ in blobs[:-1]] == [16] * (len(blobs) - 1)
    want, _ = ref_run(raws, C.codec_id(compress))
    got = [(h.codec, p) for h, p in blobs]
    check_same(raws, got, want)
    assert stats["pages_compressed"] == sum(h.n_pages for h, _ in blobs if h.codec != CODEC_NONE)
    assert stats["pages_raw"] == sum(h.n_pages for h, _ in blobs if h.codec == CODEC_NONE)
    assert stats["bytes_new_raw"] == len(b"".join(new))
    assert stats["bytes_new_stored"] == sum(h.stored_len for h, _ in blobs)
    if compress == "auto":
        assert {CODEC_NONE, CODEC_LZ4, CODEC_SHUF4_ZSTD} <= {h.codec for h, _ in blobs}


# -- data blobs (DataSink: one blob at a time, the heuristics afresh for each) ----------------
@pytest.mark.parametrize("codec", CODECS, ids=[C.codec_name(c) for c in CODECS])
def test_data_blobs_are_codec_compress(codec):
    """encoder.encode_blob, which stores every non-pages image's 1 MiB blobs, chooses what
    codec.compress(chunk, codec) chooses for each blob, whatever the blob before it was (a
    random blob that did not compress must not make the next one skip compression), and its
    payloads decode to the blob."""
    rng = np.random.default_rng(21)
    blobs = [rand(rng, 1 << 20), text(rng, 1 << 20), fp32(rng, 1 << 20), zero_heavy(rng, 300_001),
             rand(rng, 70_000), bf16(rng, 1 << 20), text(rng, 5)]
    for b in blobs:
        got_codec, payload = encoder.encode_blob(b, codec)
        want_codec, want = C.compress(b, codec)
        assert got_codec == want_codec
        assert bytes(C.decompress(bytes(payload), got_codec, len(b))) == b
        if codec != CODEC_ZSTD:          # (see test_payloads_byte_identical)
            assert bytes(payload) == bytes(want)


def test_plane_params_are_zstandards():
    """codec.PLANE_PARAMS (the numbers the native encoder takes) are the zstandard
    parameters the Python path compresses planes with."""
    import zstandard

    assert C.PLANE_PARAMS["strategy"] == zstandard.STRATEGY_FAST
    p = C.plane_params()
    for k, v in C.PLANE_PARAMS.items():
        assert getattr(p, k) == v, k
    assert encoder.encoder_params()["window_log"] == 17


def _exponent_planes(seed: int, count: int) -> list[bytes]:
    """Plane 3 (sign and exponent) of `count` fp32 groups of weights, Adam moments and
    second moments, as shuffle4-zstd compresses them."""
    rng = np.random.default_rng(seed)
    planes = []
    for k in range(count):
        a = [rng.normal(0, 0.02, G // 4), rng.normal(0, 1e-3, G // 4),
             (1e-3 * np.exp(rng.normal(0, 0.75, G // 4))) ** 2 * rng.gamma(8, 1 / 8, G // 4)][k % 3]
        sh = bytearray(G)
        C.native.shuffle_into(a.astype(np.float32).tobytes(), 4, sh)
        planes.append(bytes(sh[3 * (G // 4):]))
    return planes


def test_plane_frames_accelerated_with_their_literals_coded():
    """The plane compressor (codec.PLANE_ACCEL): the match finder accelerated, every literal
    still Huffman-coded. On float exponent planes its frames are no larger than those of
    the plain PLANE_PARAMS (python-zstandard's), decode to the plane with python-zstandard,
    and compress (a targetLength without the literal mode would store the literals raw:
    a frame as large as the plane)."""
    import zstandard

    assert C.PLANE_ACCEL > 0
    plain = zstandard.ZstdCompressor(compression_params=C.plane_params())
    comp = C.plane_compressor()
    ours = theirs = 0
    for plane in _exponent_planes(5, 12):
        z = comp.compress(plane)
        assert zstandard.ZstdDecompressor().decompress(z, max_output_size=len(plane)) == plane
        assert len(z) < 0.6 * len(plane)
        ours += len(z)
        theirs += len(plain.compress(plane))
    assert ours <= theirs


def test_encoder_and_python_codec_share_the_plane_compressor():
    """A shuffle4-zstd payload of the native encoder holds, plane for plane, the frames of
    codec.plane_compressor() (so export and prune's repacking write the dump's bytes)."""
    rng = np.random.default_rng(8)
    g = fp32(rng)
    (c, payload), = native_run([g], C.CODEC_SHUF4_ZSTD)[0]
    assert c == CODEC_SHUF4_ZSTD
    m = len(g) // 4
    lens = struct.unpack_from("<4I", payload)
    sh = bytearray(len(g))
    C.native.shuffle_into(g, 4, sh)
    comp, pos = C.plane_compressor(), 16
    for i, ln in enumerate(lens):
        part = bytes(payload[pos:pos + ln])
        assert part == (bytes(sh[i * m:(i + 1) * m]) if ln == m else comp.compress(bytes(sh[i * m:(i + 1) * m])))
        pos += ln
    assert lens[3] < m            # the exponent plane is a frame


def test_plane_frames_without_acceleration_are_zstandards():
    """PLANE_ACCEL 0 (what a libzstd without the literal mode falls back to) compresses
    planes byte for byte as python-zstandard does with PLANE_PARAMS."""
    import zstandard

    plain = zstandard.ZstdCompressor(compression_params=C.plane_params())
    comp = C.plane_compressor(accel=0)
    for plane in _exponent_planes(6, 6) + [bytes(range(256)) * 64, b""]:
        assert comp.compress(plane) == plain.compress(plane)
    comp.close()
    with pytest.raises(ValueError):
        comp.compress(b"x")
    with pytest.raises(ValueError):
        C.native.PlaneCompressor([1, 2, 3])     # not the 8 parameters


def test_a_dump_loads_neither_lz4_nor_zstandard(tmp_path):
    """The storing pipeline (pages and data images, every codec choice of auto) runs on the
    native encoder alone: a fresh interpreter that writes a snapshot has not imported
    python-lz4 or zstandard, whose loading would otherwise fall inside CRIU's stream."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, numpy as np\nsys.path.insert(0, %r)\n"
            "from gpusnap.repo import Repository\nfrom repo_helpers import dump, read_all\n"
            "rng = np.random.default_rng(1)\n"
            "pages = rng.normal(0, 0.02, 1 << 18).astype(np.float32).tobytes() + bytes(1 << 16) + rng.bytes(1 << 16)\n"
            "data = b'core image ' * 100000 + rng.bytes(300000)\n"
            "repo = Repository.open(%r, create=True)\n"
            "s, _ = dump(repo, {'pages-1.img': pages, 'core-1.img': data}, compress='auto')\n"
            "assert read_all(s, 'pages-1.img') == pages and read_all(s, 'core-1.img') == data\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('lz4', 'zstandard'))))\n"
            ) % (str(Path(__file__).parent), str(tmp_path / "repo"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == ""


# -- the sample: auto stores a group raw without an attempt when 1/16 of it shows no gain -------
def _no_sample_params():
    return {**encoder.encoder_params(), "sample_slices": 0}


def test_random_group_stored_raw_without_an_attempt():
    """A random group is stored raw on the sample's word alone: the encoder counts it as
    sampled_raw, not tried; with the skip heuristic on top, only the groups it lets through
    are sampled, and none of a random run is compressed in full."""
    rng = np.random.default_rng(31)
    g = rand(rng)
    assert C.sample_says_raw(g)
    enc = encoder.Encoder()
    res, out = enc.encode([g], C.CODEC_AUTO)
    assert res == [CODEC_NONE, len(g)] and len(out) == 0
    assert enc.stats() == {"tried": 0, "sampled_raw": 1, "skipped": 0}
    # the heuristics after a group stored raw are those after a failed attempt
    assert tuple(enc.state) == (1, 2, 0, 0)
    groups = [rand(rng) for _ in range(40)]
    enc = encoder.Encoder()
    res, _ = enc.encode(groups, C.CODEC_AUTO)
    st = enc.stats()
    assert set(res[0::2]) == {CODEC_NONE}
    assert st["tried"] == 0 and st["sampled_raw"] + st["skipped"] == 40 and st["skipped"] > st["sampled_raw"]
    # the Python codec decides the same, without compressing
    assert C.compress(g, C.CODEC_AUTO) == (CODEC_NONE, g)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "zero", "text", "mixed"])
def test_compressible_groups_unchanged_by_the_sample(kind):
    """Float, text and zero-heavy groups (and the heuristic-driving mix) are never stored raw
    on the sample's word: the codecs, payloads and heuristic states are those of an encoder
    without the sample, so every compressed size stays what it was."""
    groups = batch_of(kind, 41)
    got, states = native_run(groups, C.CODEC_AUTO, batch_sizes=[1])
    want, want_states = native_run(groups, C.CODEC_AUTO, batch_sizes=[1],
                                   enc=encoder.Encoder(_no_sample_params()))
    assert [c for c, _ in got] == [c for c, _ in want]
    assert [p for _, p in got] == [p for _, p in want]
    assert states == want_states
    if kind != "mixed":
        assert not any(C.sample_says_raw(g) for g in groups)
        enc = encoder.Encoder()
        enc.encode(groups, C.CODEC_AUTO)
        assert enc.stats()["sampled_raw"] == 0


def test_fp32_group_sizes_as_before():
    """An fp32 group compresses with shuffle4-zstd to exactly the size an encoder without
    the sample gives, lz4 tried first or not."""
    rng = np.random.default_rng(43)
    g = fp32(rng)
    assert not C.sample_says_raw(g)
    for first in (True, False):
        c, p = C.compress(g, C.CODEC_AUTO, lz4_first=first)
        assert c == CODEC_SHUF4_ZSTD and len(p) < 0.9 * len(g)
    (c1, p1), = native_run([g], C.CODEC_AUTO)[0]
    (c0, p0), = native_run([g], C.CODEC_AUTO, enc=encoder.Encoder(_no_sample_params()))[0]
    assert (c1, p1) == (c0, p0) and c1 == CODEC_SHUF4_ZSTD


def test_sample_sees_what_order0_entropy_does_not():
    """Groups of random bytes that still compress go the full way: one random page repeated
    (high entropy, but lz4 finds the repeats in the sample), random pages with one text page
    among them (the text slice gains), random pages whose middle is zeros."""
    rng = np.random.default_rng(47)
    page = rng.bytes(PAGE)
    repeated = page * 16
    assert not C.sample_says_raw(repeated)
    r = random.Random(5)
    one_text = b"".join(text_page(r) if i == 9 else rng.bytes(PAGE) for i in range(16))
    assert not C.sample_says_raw(one_text)
    holes = b"".join(rng.bytes(1024) + bytes(2048) + rng.bytes(1024) for _ in range(16))
    assert not C.sample_says_raw(holes)
    for g, want in ((repeated, CODEC_LZ4), (holes, CODEC_LZ4)):
        enc = encoder.Encoder()
        res, _ = enc.encode([g], C.CODEC_AUTO)
        assert res[0] == want and enc.stats()["tried"] == 1
    # as codec.compress decides for each
    for g in (repeated, one_text, holes):
        assert encoder.encode_blob(g, C.CODEC_AUTO)[0] == C.compress(g, C.CODEC_AUTO)[0]


def test_sample_only_for_long_enough_groups_and_lz4_first():
    """Groups shorter than twice the sample (a page, 7 KiB) are always attempted; with
    lz4 not first (after groups where shuffle4-zstd won) no sample is taken; explicit codecs
    never sample."""
    rng = np.random.default_rng(53)
    small = rand(rng, PAGE)
    assert not C.sample_says_raw(small)
    assert C.sample_says_raw(rand(rng, 2 * PAGE))       # 2 slices of 2 KiB in 8 KiB
    assert C.sample_says_raw(rand(rng, 3 * PAGE + 5))   # 3 of 1364 B
    enc = encoder.Encoder()
    enc.encode([small], C.CODEC_AUTO)
    assert enc.stats() == {"tried": 1, "sampled_raw": 0, "skipped": 0}
    enc = encoder.Encoder()
    enc.state[:] = (0, 1, encoder.LZ4_FUTILE, 0)        # lz4 not first
    res, _ = enc.encode([rand(rng)], C.CODEC_AUTO)
    assert res[0] == CODEC_NONE and enc.stats()["tried"] == 1
    enc = encoder.Encoder()
    res, _ = enc.encode([rand(rng)], CODEC_LZ4)
    assert res[0] == CODEC_NONE and enc.stats() == {"tried": 1, "sampled_raw": 0, "skipped": 0}


def test_stats_of_a_closed_encoder():
    enc = encoder.Encoder()
    enc.close()
    with pytest.raises(ValueError):
        enc.stats()
