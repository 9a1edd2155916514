"""The commit's crash consistency, open-time recovery and `gpusnap repair`, on real
repositories (real files, the real fault hook; no CRIU: tests/test_faults.py does the same
through real dumps).

A fault lands through the product's own hook (gpusnap/system/faults.py): the point sends the
process SIGUSR1, whose handler raises like dump.py's SIGTERM handler does, so the commit
unwinds exactly as it does for a signal in a real dump.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal

import pytest

from gpusnap.errors import NoSpace
from gpusnap.repo import Repository
from gpusnap.system import faults
from gpusnap.repo.maint.repair import repair
from gpusnap.repo.index import RepoIndex, write_index_file
from gpusnap.repo.store import pack_path
from gpusnap.repo.maint.verify import verify
from conftest import run_gpusnap
from repo_helpers import PAGE, read_all, text_page

COMMIT_POINTS = ["commit:start", "pack:renamed", "commit:packs-durable", "commit:index-renamed",
                 "commit:locations-written", "commit:manifest-written", "commit:snapshot-renamed",
                 "commit:done"]
# the snapshot exists once the commit renamed its directory
COMMITTED_AT = {"commit:snapshot-renamed", "commit:done"}
NAMED_AT = {"commit:index-renamed", "commit:locations-written", "commit:manifest-written"} | COMMITTED_AT


class Crash(BaseException):
    """What the signal handler raises (as dump.py's _Terminate, a BaseException)."""


@contextlib.contextmanager
def fault_at(*points):
    def handler(signum, frame):
        raise Crash(points)

    old = signal.signal(signal.SIGUSR1, handler)
    for p in points:
        faults._POINTS[p] = signal.SIGUSR1
    try:
        yield
    finally:
        for p in points:
            faults._POINTS.pop(p, None)
        signal.signal(signal.SIGUSR1, old)


def dump(repo, images: dict, name="job", **kw):
    """One snapshot through the library, unwound as dump.py unwinds a failed dump (abort in
    a finally)."""
    with repo.writer_lock():
        w = repo.new_snapshot(name, compress="lz4", **kw)
        try:
            for fn, data in images.items():
                s = w.image_sink(fn)
                for i in range(0, len(data), 65536 + 4096 * 3 + 100):
                    s.write(memoryview(data)[i:i + 65536 + 4096 * 3 + 100])
                s.close()
            snap = w.commit()
        finally:
            w.abort()
    return snap, w.stats


def _images(seed: int, new_pages: int = 60):
    rnd = random.Random(seed)
    base = [text_page(random.Random(1)) for _ in range(30)] + [random.Random(2).randbytes(PAGE) for _ in range(30)]
    fresh = [rnd.randbytes(PAGE) for _ in range(new_pages)]
    return {"pages-1.img": b"".join(base + fresh) + bytes(PAGE * 8), "core-1.img": b"core-%d" % seed * 400}


def _packs(repo):
    return sorted(p for p in (repo.path / "packs").rglob("*") if p.is_file())


def _all_read_back(repo, expected: dict):
    """Every listed snapshot reads back exactly; -> their dir names."""
    names = []
    for s in repo.snapshots():
        imgs = expected[s.path.name]
        for fn, data in imgs.items():
            assert read_all(s, fn) == data, (s.path.name, fn)
        names.append(s.path.name)
    return names


@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_interrupted_commit_keeps_every_named_byte(tmp_path, point):
    repo = Repository.open(tmp_path / "repo", create=True)
    expected = {}
    for k in range(2):
        imgs = _images(k)
        snap, _ = dump(repo, imgs, name="good")
        expected[snap.path.name] = imgs
    victim = _images(10, new_pages=200)
    n_index = len(os.listdir(repo.path / "index"))
    with fault_at(point), pytest.raises(Crash):
        dump(repo, victim, name="victim", pack_target=128 * 1024)   # several packs
    repo = Repository.open(repo.path)            # as after a restart
    listed = {s.path.name: s for s in repo.snapshots()}
    committed = [n for n in listed if n.startswith("victim-")]
    assert bool(committed) == (point in COMMITTED_AT)
    for n in committed:
        expected[n] = victim
    rep = verify(repo)
    assert rep.ok, rep.problems
    named = len(os.listdir(repo.path / "index")) > n_index
    assert named == (point in NAMED_AT)
    if not named:
        # an abort before the index exists leaves nothing behind: no orphan pack
        assert not [x for x in rep.notes if "not referenced" in x], rep.notes
    # the next dump of the same state succeeds and reads back; when the victim's index got
    # into index/ its pages are reused (they are there), never assumed without being there
    snap, st = dump(repo, victim, name="next")
    expected[snap.path.name] = victim
    if named:
        assert st["pages_raw"] + st["pages_compressed"] == 0
    assert verify(repo).ok
    assert len(_all_read_back(repo, expected)) == 3 + len(committed)


def test_a_second_signal_during_the_abort(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    good, _ = dump(repo, _images(0), name="good")
    victim = _images(3, new_pages=100)
    with fault_at("commit:index-renamed"), pytest.raises(Crash):
        with fault_at("abort:start"):
            dump(repo, victim, name="victim")
    repo = Repository.open(repo.path)
    assert verify(repo).ok
    snap, st = dump(repo, victim, name="next")
    assert read_all(snap, "pages-1.img") == victim["pages-1.img"]
    assert read_all(repo.snapshot(good.path.name), "pages-1.img") == _images(0)["pages-1.img"]


def test_full_disk_in_every_commit_write(tmp_path, tmpfs):
    """ENOSPC at every 4 KiB step of free space through a whole dump, commit included (the
    window of the old bug): the dump fails with NoSpace or succeeds, the repository always
    verifies, and the next dump (after space is freed) reads back."""
    fs = tmpfs(8 << 20)
    base = Repository.open(fs / "base", create=True)
    first = _images(0)
    s0, _ = dump(base, first, name="good")
    victim = _images(5, new_pages=24)
    # how much the victim's dump needs: measure once on a copy with room
    trial = Repository.open(fs / "trial", create=True)
    dump(trial, first, name="good")
    before = _used(fs)
    dump(trial, victim, name="victim")
    need = _used(fs) - before
    _rmtree(fs / "trial")
    outcomes = {"failed, nothing named": 0, "failed, index kept": 0, "committed": 0}
    for free in range(0, need + 2 * PAGE, PAGE):
        work = fs / "work"
        _copytree(base.path, work)
        repo = Repository.open(work)
        filler = _fill(fs, free)
        n_index = len(os.listdir(work / "index"))
        try:
            dump(repo, victim, name="victim")
            outcome = "committed"
        except (NoSpace, OSError) as e:     # (a sink's close() passes the OSError on; the streamer maps it)
            assert isinstance(e, NoSpace) or e.errno == 28, e
            outcome = "failed, index kept" if len(os.listdir(work / "index")) > n_index else "failed, nothing named"
        outcomes[outcome] += 1
        os.unlink(filler)
        repo = Repository.open(work)
        rep = verify(repo)
        assert rep.ok, (free, rep.problems)
        assert not os.listdir(work / "tmp"), free
        snap, _ = dump(repo, victim, name="next")
        assert read_all(snap, "pages-1.img") == victim["pages-1.img"], free
        assert read_all(repo.snapshot(s0.path.name), "pages-1.img") == first["pages-1.img"]
        assert verify(repo).ok, free
        _rmtree(work)
    # the scan went through all three outcomes, the middle one being the old bug's window
    assert all(outcomes.values()), outcomes
    print(f"ENOSPC scan: {need // PAGE + 2} free-space steps of 4 KiB: {outcomes}")


def test_open_recovery_quarantines_an_index_naming_a_missing_pack(tmp_path):
    """The state the old abort left behind (an index naming deleted packs), or any lost pack:
    the next writer sets that index aside, reports the snapshots that needed it, and its dump
    stores those pages again instead of pointing at nothing."""
    repo = Repository.open(tmp_path / "repo", create=True)
    a = _images(0)
    s_a, _ = dump(repo, a, name="a")
    a_index = os.listdir(repo.path / "index")
    b = _images(1, new_pages=100)
    s_b, _ = dump(repo, b, name="b")
    victim_index = [n for n in os.listdir(repo.path / "index") if n not in a_index]
    b_packs = {b.pack for b in RepoIndex.load(repo.path, victim_index).blobs}
    for ph in b_packs:
        os.unlink(pack_path(repo.path, ph))
    repo = Repository.open(repo.path)
    with repo.writer_lock():
        pass
    assert (repo.path / "quarantine" / f"index-{victim_index[0]}").exists()
    assert not (repo.path / "index" / victim_index[0]).exists()
    assert any(s_b.path.name in line and "damaged" in line for line in repo.recovery), repo.recovery
    assert not any(s_a.path.name in line for line in repo.recovery)
    # the next dump of b's state does not deduplicate against the lost pages
    snap, st = dump(repo, b, name="b2")
    assert st["pages_raw"] + st["pages_compressed"] >= 100
    assert read_all(snap, "pages-1.img") == b["pages-1.img"]
    rep = verify(repo)
    assert rep.affected_snapshots in ([], [s_b.path.name])   # b heals if its packs came back identical
    assert read_all(repo.snapshot(s_a.path.name), "pages-1.img") == a["pages-1.img"]


def test_repair_of_a_lost_pack_and_its_dry_run(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    a = _images(0)
    s_a, _ = dump(repo, a, name="a")
    before = sorted(os.listdir(repo.path / "index"))
    s_b, _ = dump(repo, _images(1, new_pages=100), name="b")
    lost = [n for n in os.listdir(repo.path / "index") if n not in before]
    for ph in {b.pack for b in RepoIndex.load(repo.path, lost).blobs}:
        os.unlink(pack_path(repo.path, ph))
    state = sorted(str(p) for p in repo.path.rglob("*"))
    r = run_gpusnap("repair", "--repo", repo.path, "--dry-run")
    assert r.returncode == 19 and s_b.path.name in r.stderr and s_a.path.name not in r.stderr, r.stderr
    assert "would move index/" + lost[0] in r.stdout + r.stderr
    assert sorted(str(p) for p in repo.path.rglob("*")) == state      # a dry run changes nothing
    r = run_gpusnap("repair", "--repo", repo.path)
    assert r.returncode == 19 and s_b.path.name in r.stderr
    assert (repo.path / "quarantine" / f"index-{lost[0]}").exists()
    assert read_all(Repository.open(repo.path).snapshot(s_a.path.name), "pages-1.img") == a["pages-1.img"]


def test_dump_never_dedups_against_a_truncated_pack(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    b = _images(1, new_pages=100)
    dump(repo, b, name="b")
    (pp,) = _packs(repo)
    os.truncate(pp, pp.stat().st_size // 2)
    snap, st = dump(repo, b, name="b2")
    assert st["pages_raw"] + st["pages_compressed"] > 0
    assert read_all(snap, "pages-1.img") == b["pages-1.img"]


# -- gpusnap repair ------------------------------------------------------------------------------

def _history(repo, n=3):
    expected = {}
    for k in range(n):
        imgs = _images(k, new_pages=40)
        snap, _ = dump(repo, imgs, name="job", pack_target=64 * 1024)
        expected[snap.path.name] = imgs
    return expected


def test_repair_rebuilds_a_deleted_index_from_the_packs(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    expected = _history(repo)
    for n in os.listdir(repo.path / "index"):
        os.unlink(repo.path / "index" / n)
    assert not verify(repo, read_data=False).ok
    dry = repair(repo, dry_run=True)
    assert dry.changed and dry.ok and dry.blobs_recovered == dry.blobs_indexed > 0
    assert not os.listdir(repo.path / "index")            # dry run: nothing written
    rep = repair(repo)
    assert rep.ok and rep.changed and rep.packs_rehashed == rep.packs_scanned   # no index: every pack read
    assert [rep.index_written] == os.listdir(repo.path / "index")
    assert verify(repo).ok
    _all_read_back(Repository.open(repo.path), expected)
    again = repair(repo)
    assert not again.changed and again.packs_confirmed == again.packs_scanned   # names confirm the ids
    assert os.listdir(repo.path / "index") == [rep.index_written]


def test_repair_trusts_the_packs_not_a_lying_index(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    expected = _history(repo, 2)
    idx = RepoIndex.load(repo.path)
    # an index file with a valid checksum that claims other ids for the same blobs
    lies = {}
    for b in idx.blobs:
        ids = bytes(reversed(b.ids))
        lies.setdefault(b.pack, []).append(dataclasses.replace(b, ids=ids))
    liar, _ = write_index_file(repo.path, sorted(lies.items()))
    truth = sorted(n for n in os.listdir(repo.path / "index") if n != liar.name)
    for n in truth:
        os.unlink(repo.path / "index" / n)
    assert not verify(repo, read_data=False).ok
    rep = repair(repo)
    assert rep.ok and rep.index_quarantined == [liar.name]
    assert (repo.path / "quarantine" / f"index-{liar.name}").exists()
    assert verify(repo).ok
    _all_read_back(Repository.open(repo.path), expected)


def test_repair_leaves_out_damaged_blobs_and_names_the_snapshots(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    expected = _history(repo, 2)
    first = sorted(expected)[0]
    s = repo.snapshot(first)
    idx = repo.index()
    rec = next(r for r in s.iter_page_refs("pages-1.img") if r[0] == "pages")
    b = idx.blobs[idx.page_table().get(rec[1][:16]) >> 8]
    pp = pack_path(repo.path, b.pack)
    data = bytearray(pp.read_bytes())
    data[b.offset + 16 + b.stored_len // 2] ^= 0x40
    pp.write_bytes(bytes(data))
    # without --read-data the pack's name confirms the indexed ids: nothing to change
    assert not repair(repo).changed
    rep = repair(repo, read_data=True)
    assert rep.blobs_damaged == 1 and rep.changed and first in rep.snapshots_damaged
    assert len(rep.index_quarantined) >= 1
    r = run_gpusnap("repair", "--repo", repo.path, "--read-data")
    assert r.returncode == 19 and first in r.stderr, r.stderr
    r = run_gpusnap("repair", "--repo", repo.path, "--json")
    assert r.returncode == 19
    (line,) = r.stdout.splitlines()
    assert first in json.loads(line)["snapshots_damaged"]
    others = {n: v for n, v in expected.items() if n != first}
    for n, imgs in others.items():
        if n not in rep.snapshots_damaged:
            assert read_all(repo.snapshot(n), "pages-1.img") == imgs["pages-1.img"]


def test_repair_keeps_the_blobs_before_a_cut(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    imgs = _images(4, new_pages=120)
    snap, _ = dump(repo, imgs, name="job")
    (pp,) = _packs(repo)
    os.truncate(pp, pp.stat().st_size * 2 // 3)
    rep = repair(repo)
    assert rep.changed and 0 < rep.blobs_indexed and snap.path.name in rep.snapshots_damaged
    assert any("trailer" in p for p in rep.problems), rep.problems
    # what the packs still hold is indexed; the next dump stores only what was cut
    snap2, st = dump(repo, imgs, name="job")
    assert 0 < st["pages_raw"] + st["pages_compressed"] < 120
    assert read_all(snap2, "pages-1.img") == imgs["pages-1.img"]


def test_repair_cli_on_a_healthy_repository(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    _history(repo, 2)
    r = run_gpusnap("repair", "--repo", repo.path, "--dry-run")
    assert r.returncode == 0 and "nothing to repair" in r.stdout, r.stdout + r.stderr
    r = run_gpusnap("repair", "--repo", repo.path, "--json")
    assert r.returncode == 0
    d = json.loads(r.stdout)
    assert d["ok"] and not d["changed"] and d["packs_scanned"] == d["packs_confirmed"] > 0


# -- helpers: a small tmpfs for the full-disk scan ----------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts = []

    def mount(size: int):
        d = tmp_path / f"tmpfs{len(mounts)}"
        d.mkdir()
        import subprocess
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(d)], check=True)
        mounts.append(d)
        return d

    yield mount
    import subprocess
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _used(fs) -> int:
    st = os.statvfs(fs)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _fill(fs, free: int):
    """A file taking all but `free` bytes of the filesystem."""
    st = os.statvfs(fs)
    avail = st.f_bavail * st.f_frsize
    p = fs / "filler"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if avail > free:
            os.posix_fallocate(fd, 0, avail - free)
    finally:
        os.close(fd)
    st = os.statvfs(fs)
    assert st.f_bavail * st.f_frsize == min(free, avail)
    return p


def _copytree(src, dst):
    import shutil
    shutil.copytree(src, dst, symlinks=True)
    for dp, dn, fns in os.walk(dst):
        os.chmod(dp, 0o700)


def _rmtree(p):
    import shutil
    shutil.rmtree(p)
