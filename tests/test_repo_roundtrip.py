import os
import random
import stat
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gpusnap.errors import RepositoryError, SnapshotNotFound, UsageError
from gpusnap.repo import Repository
from repo_helpers import PAGE, dump, file_tree_size, read_all, text_page


@pytest.fixture
def repo(tmp_path):
    return Repository.open(tmp_path / "repo", create=True)


def test_create_open_and_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        repo = Repository.open(tmp_path / "r", create=True)
        dump(repo, {"pages-1.img": os.urandom(PAGE * 40), "core-1.img": b"core" * 100})
    finally:
        os.umask(old)
    for dp, dns, fns in os.walk(repo.path):
        assert stat.S_IMODE(os.stat(dp).st_mode) == 0o700, dp
        for f in fns:
            assert stat.S_IMODE(os.stat(os.path.join(dp, f)).st_mode) == 0o600, (dp, f)
    assert Repository.open(tmp_path / "r").config["id"] == repo.config["id"]


def test_open_errors(tmp_path):
    with pytest.raises(RepositoryError):
        Repository.open(tmp_path / "nothing")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(RepositoryError):
        Repository.open(tmp_path / "full", create=True)
    r = Repository.open(tmp_path / "r", create=True)
    cfg = (r.path / "config").read_text().replace('"version": 1', '"version": 99')
    (r.path / "config").write_text(cfg)
    with pytest.raises(RepositoryError, match="version 99"):
        Repository.open(r.path)


def test_roundtrip_counts_exact(repo):
    rnd = random.Random(1)
    a = os.urandom(PAGE)
    pages = [a, bytes(PAGE), bytes(PAGE), os.urandom(PAGE), a, text_page(rnd), bytes(PAGE), text_page(rnd)]
    img = b"".join(pages)
    snap, stats = dump(repo, {"pages-1.img": img, "core-1.img": b"c" * 10, "empty.img": b""})
    assert read_all(snap, "pages-1.img") == img
    assert read_all(snap, "core-1.img") == b"c" * 10
    assert read_all(snap, "empty.img") == b""
    assert stats["pages_total"] == 8
    assert stats["pages_zero"] == 3
    assert stats["pages_dedup"] == 1             # the second `a`
    assert stats["pages_compressed"] + stats["pages_raw"] == 4
    assert stats["bytes_raw"] == len(img) + 10
    assert snap.stats == {**snap.stats, **{k: stats[k] for k in ("pages_total", "pages_zero", "pages_dedup")}}
    im = snap.image("pages-1.img")
    assert im["size"] == len(img) and im["pages"] == 8
    assert sorted(snap.image_names()) == ["core-1.img", "empty.img", "pages-1.img"]
    assert snap.has_image("core-1.img") and not snap.has_image("nope")
    snap.check_structure()


def test_compression_counts(repo):
    rnd = random.Random(2)
    img = b"".join(text_page(rnd) for _ in range(64)) + os.urandom(PAGE * 64)
    snap, st = dump(repo, {"pages-1.img": img}, group_pages=16)
    assert st["pages_compressed"] == 64 and st["pages_raw"] == 64
    assert read_all(snap, "pages-1.img") == img
    for codec in ("zstd", "none"):
        snap, st = dump(repo, {"pages-2.img": b"".join(text_page(rnd) for _ in range(20))}, compress=codec)
        assert st["pages_compressed"] == (20 if codec == "zstd" else 0)
        assert st["pages_raw"] == (0 if codec == "zstd" else 20)
    with pytest.raises(UsageError):
        with repo.writer_lock():
            repo.new_snapshot("x", compress="gzip")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.lists(st.sampled_from(["zero", "rand", "text", "dup", "half"]), max_size=40),
       tail=st.binary(max_size=5000), chunk=st.sampled_from([None, 1, 4096, 10000, 1 << 20]),
       codec=st.sampled_from(["lz4", "zstd", "none"]), group=st.sampled_from([1, 3, 16]))
def test_roundtrip_arbitrary(tmp_path_factory, spec, tail, chunk, codec, group):
    repo = Repository.open(tmp_path_factory.mktemp("r") / "repo", create=True)
    rnd = random.Random(len(spec))
    pages = []
    for s in spec:
        if s == "zero":
            pages.append(bytes(PAGE))
        elif s == "rand":
            pages.append(os.urandom(PAGE))
        elif s == "text":
            pages.append(text_page(rnd))
        elif s == "half":
            pages.append(bytes(PAGE // 2) + os.urandom(PAGE // 2))
        else:
            pages.append(pages[0] if pages else bytes(PAGE))
    img = b"".join(pages)
    other = tail
    snap, st = dump(repo, {"pages-7.img": img + tail[:100], "files.img": other}, compress=codec, chunk=chunk,
                    group_pages=group)
    assert read_all(snap, "pages-7.img") == img + tail[:100]
    assert read_all(snap, "files.img") == other
    assert st["pages_total"] == len(pages)
    assert st["pages_zero"] == sum(p == bytes(PAGE) for p in pages)
    assert st["pages_total"] == st["pages_zero"] + st["pages_dedup"] + st["pages_compressed"] + st["pages_raw"]
    nonzero = [p for p in pages if p != bytes(PAGE)]
    assert st["pages_dedup"] == len(nonzero) - len(set(nonzero))


def test_second_identical_snapshot_stores_little(repo):
    rnd = random.Random(3)
    img = b"".join(rnd.choice([os.urandom(PAGE), text_page(rnd), bytes(PAGE)]) for _ in range(2000))
    images = {"pages-1.img": img, "pages-2.img": os.urandom(PAGE * 500),
              "core-1.img": os.urandom(3000), "mm-1.img": os.urandom(300000)}
    s1, st1 = dump(repo, images)
    s2, st2 = dump(repo, images)
    assert st2["bytes_stored"] < 0.05 * st1["bytes_stored"]
    assert st2["pages_dedup"] == st2["pages_total"] - st2["pages_zero"]
    assert st2["bytes_stored"] == file_tree_size(s2.path)     # nothing but the snapshot dir is new
    for fn, data in images.items():
        assert read_all(s2, fn) == data


def test_relocated_data_is_deduplicated(repo):
    bufs = [os.urandom(PAGE) for _ in range(1500)]
    img1 = b"".join(bufs) + bytes(PAGE * 100)
    s1, st1 = dump(repo, {"pages-1.img": img1})
    # the job moved its buffer: new offset, other images, shuffled order, split across processes
    shuffled = bufs[:]
    random.Random(4).shuffle(shuffled)
    img2 = os.urandom(PAGE * 10) + bytes(PAGE * 3) + b"".join(shuffled[:1000])
    img3 = b"".join(shuffled[1000:])
    s2, st2 = dump(repo, {"pages-2.img": img2, "pages-3.img": img3})
    assert st2["pages_dedup"] == 1500
    assert st2["bytes_stored"] < 0.05 * st1["bytes_stored"] + PAGE * 12
    assert read_all(s2, "pages-2.img") == img2 and read_all(s2, "pages-3.img") == img3


def test_random_data_overhead(repo):
    img = os.urandom(PAGE * 4096)
    snap, st = dump(repo, {"pages-1.img": img}, chunk=1 << 20)
    assert st["pages_raw"] == 4096
    assert st["bytes_stored"] <= 1.01 * len(img)
    assert st["bytes_stored"] == file_tree_size(repo.path) - (repo.path / "config").stat().st_size


def test_zero_heavy_is_small(repo):
    rnd = random.Random(5)
    img = b"".join(bytes(PAGE) if rnd.random() < 0.9 else text_page(rnd) for _ in range(3000))
    snap, st = dump(repo, {"pages-1.img": img})
    assert st["bytes_stored"] < 0.2 * len(img)
    assert read_all(snap, "pages-1.img") == img


def test_concurrent_sinks(repo):
    shared = [os.urandom(PAGE) for _ in range(300)]
    rnd = random.Random(6)
    images = {}
    for k in range(8):
        pages = [rnd.choice(shared) if rnd.random() < 0.5 else
                 (bytes(PAGE) if rnd.random() < 0.3 else os.urandom(PAGE)) for _ in range(400)]
        images[f"pages-{k}.img"] = b"".join(pages)
        images[f"core-{k}.img"] = b"same core" * 1000       # identical small images dedup too
    with repo.writer_lock():
        w = repo.new_snapshot("conc")
        errs = []

        def feed(fn, data):
            try:
                s = w.image_sink(fn)
                r = random.Random(fn)
                i = 0
                while i < len(data):
                    n = r.choice([1000, 4096, 50000, 1 << 20])
                    s.write(data[i:i + n])
                    i += n
                s.close()
            except Exception as e:     # pragma: no cover
                errs.append(e)

        ths = [threading.Thread(target=feed, args=kv) for kv in images.items()]
        [t.start() for t in ths]
        [t.join() for t in ths]
        assert not errs
        snap = w.commit()
    st = w.stats
    all_pages = [d[i:i + PAGE] for fn, d in images.items() if fn.startswith("pages") for i in range(0, len(d), PAGE)]
    nonzero = [p for p in all_pages if p != bytes(PAGE)]
    assert st["pages_total"] == len(all_pages)
    assert st["pages_dedup"] == len(nonzero) - len(set(nonzero))     # exact across concurrent sinks
    assert st["blobs_dedup"] == 7
    out = {}

    def rd(fn):
        out[fn] = read_all(snap, fn)
    ths = [threading.Thread(target=rd, args=(fn,)) for fn in images]
    [t.start() for t in ths]
    [t.join() for t in ths]
    assert out == images


def test_snapshot_lookup(repo):
    s1, _ = dump(repo, {"core-1.img": b"1"}, name="a")
    s2, _ = dump(repo, {"core-1.img": b"2"}, name="b")
    s3, _ = dump(repo, {"core-1.img": b"3"}, name="a", meta={"pid": 42})
    assert [s.id for s in repo.snapshots()] == [s1.id, s2.id, s3.id]
    assert repo.snapshot("a").id == s3.id
    assert repo.snapshot(str(s2.path)).id == s2.id
    assert repo.snapshot(s1.path.name).id == s1.id
    assert repo.snapshot(s1.id[:8]).id == s1.id
    assert s3.manifest["meta"] == {"pid": 42}
    for bad in ("zzz", "/etc", "../x", ".", ""):
        with pytest.raises(SnapshotNotFound):
            repo.snapshot(bad)


def test_commit_meta_and_abort(repo):
    with repo.writer_lock():
        w = repo.new_snapshot("x", meta={"a": 1})
        s = w.image_sink("pages-1.img")
        s.write(os.urandom(PAGE * 3000))
        s.close()
        w.abort()
    assert repo.snapshots() == []
    assert not [p for p in (repo.path / "snapshots").iterdir()]
    with repo.writer_lock():
        w = repo.new_snapshot("x", meta={"a": 1})
        s = w.image_sink("pages-1.img")
        s.write(b"x" * PAGE)
        with pytest.raises(RepositoryError):
            w.commit()                     # sink not closed: refused, nothing visible
    assert repo.snapshots() == []
    snap, _ = dump(repo, {"core-1.img": b"x"}, meta={"a": 1})
    with repo.writer_lock():
        w = repo.new_snapshot("y", meta={"a": 1})
        w.image_sink("core.img").close()
        snap = w.commit({"b": 2})
    assert snap.manifest["meta"] == {"a": 1, "b": 2}
    with pytest.raises(RepositoryError):
        repo.new_snapshot("z")             # no writer lock held


def test_memory_bounded_read(repo):
    """read_image yields chunks of at most 1 MiB and never the whole image."""
    img = os.urandom(PAGE * 1024) + bytes(PAGE * 2048) + os.urandom(PAGE * 600)
    snap, _ = dump(repo, {"pages-1.img": img}, chunk=1 << 20)
    sizes = [len(c) for c in snap.read_image("pages-1.img")]
    assert max(sizes) <= 1 << 20 and sum(sizes) == len(img)


@pytest.mark.parametrize("workers", [1, 4])
def test_compressor_threads_keep_counts_exact(repo, monkeypatch, workers):
    """Groups compressed by several threads at once: every page comes back, and the counts
    (compressed + raw + dedup + zero = total) are exact; auto picks the float codec for
    float data and lz4 for text whatever thread sees them."""
    import numpy as np
    from gpusnap.repo.pipeline import sinks
    monkeypatch.setattr(sinks, "COMPRESS_WORKERS", workers)
    rnd = random.Random(9)
    floats = np.random.default_rng(2).normal(0, 0.02, 600 * PAGE // 4).astype(np.float32).tobytes()
    pages = [floats[i * PAGE:(i + 1) * PAGE] for i in range(600)]
    pages += [text_page(rnd) for _ in range(200)] + [os.urandom(PAGE) for _ in range(300)] + [bytes(PAGE)] * 50
    rnd.shuffle(pages)
    img = b"".join(pages) + b"".join(pages[:100])
    snap, st_ = dump(repo, {"pages-1.img": img}, compress="auto")
    assert read_all(snap, "pages-1.img") == img
    assert st_["pages_total"] == 1250
    assert st_["pages_zero"] == 50 + sum(p == bytes(PAGE) for p in pages[:100])
    assert st_["pages_compressed"] + st_["pages_raw"] + st_["pages_dedup"] + st_["pages_zero"] == 1250
    codecs = {im_codec for im_codec in _blob_codecs(repo)}
    assert {"lz4", "shuffle4-zstd", "none"} <= codecs, codecs


def _blob_codecs(repo):
    from gpusnap.repo.codec import codec_name
    idx = repo.index()
    return [codec_name(b.codec) for b in idx.blobs if b.kind == 1]
