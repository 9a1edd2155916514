import os
import random

import pytest

from gpusnap.repo import Repository
from gpusnap.repo.maint.prune import Selection, execute_prune, plan_prune, snapshots_info
from gpusnap.repo.maint.verify import verify
from gpusnap.render.maint import prune_lines, verify_lines, verify_summary
from repo_helpers import PAGE, dump, read_all, text_page


def info(*items):
    return [{"id": i, "name": n, "created": c} for i, n, c in items]


def test_plan_keep_last_per_name():
    s = info(("a1", "a", 1), ("b1", "b", 2), ("a2", "a", 3), ("a3", "a", 4), ("b2", "b", 5))
    p = plan_prune(s, 1)
    assert sorted(p.delete) == ["a1", "a2", "b1"] and sorted(p.keep) == ["a3", "b2"]
    p = plan_prune(s, 2, name="a")
    assert p.delete == ["a1"] and sorted(p.keep) == ["a2", "a3", "b1", "b2"]
    assert plan_prune(s, 10).delete == []
    assert sorted(plan_prune(s, 0, name="b").delete) == ["b1", "b2"]
    assert plan_prune([], 3) == Selection()
    # input order does not matter; ties broken by id
    assert sorted(plan_prune(list(reversed(s)), 1).delete) == ["a1", "a2", "b1"]
    t = info(("x2", "x", 5), ("x1", "x", 5))
    assert plan_prune(t, 1).delete == ["x1"]
    with pytest.raises(ValueError):
        plan_prune(s, -1)


def _history(repo, n=5):
    """n dumps of a job whose state changes a little each time (+ a frozen base)."""
    rnd = random.Random(8)
    base = [os.urandom(PAGE) for _ in range(200)]
    out = []
    for k in range(n):
        moving = [os.urandom(PAGE) for _ in range(40)] + [text_page(rnd) for _ in range(10)]
        img = b"".join(base[:100] + moving + base[100:]) + bytes(PAGE * 20)
        snap, _ = dump(repo, {"pages-1.img": img, "core-1.img": b"core%d" % k * 50})
        out.append((snap, img))
    return out


def test_prune_keeps_survivors_and_frees_space(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    hist = _history(repo)
    size_before = sum(p.stat().st_size for p in (repo.path / "packs").rglob("*") if p.is_file())
    plan = plan_prune(snapshots_info(repo), 2)
    dry = execute_prune(repo, plan, dry_run=True)
    assert len(dry["snapshots_deleted"]) == 3 and len(repo.snapshots()) == 5
    res = execute_prune(repo, plan)
    assert res["snapshots_deleted"] == dry["snapshots_deleted"]
    assert len(repo.snapshots()) == 2
    rep = verify(repo)
    assert rep.ok, rep.problems
    for snap, img in hist[-2:]:
        s = repo.snapshot(snap.path.name)
        assert read_all(s, "pages-1.img") == img
    size_after = sum(p.stat().st_size for p in (repo.path / "packs").rglob("*") if p.is_file())
    assert size_after < size_before * 0.75
    assert len(list((repo.path / "index").iterdir())) == 1
    # a new dump after prune still dedups against the survivors
    snap, st = dump(repo, {"pages-1.img": hist[-1][1]})
    assert st["pages_raw"] + st["pages_compressed"] == 0


def test_prune_cleans_interrupted_dump(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    hist = _history(repo, 2)
    with repo.writer_lock():
        w = repo.new_snapshot("dead", pack_target=64 * 1024)
        s = w.image_sink("pages-1.img")
        s.write(os.urandom(PAGE * 100))
        s.close()
        w.packer.finish()          # packs renamed into place, then the process "dies"
    assert len(w.packer.done) >= 2
    (repo.path / "tmp" / "pack-x.tmp").write_bytes(b"partial")
    assert verify(repo).ok
    res = execute_prune(repo, plan_prune(snapshots_info(repo), 10))
    assert res["packs_deleted"] >= 2 and res["leftovers_removed"] >= 2
    assert not list((repo.path / "tmp").iterdir())
    assert not [p for p in (repo.path / "snapshots").iterdir() if p.name.startswith(".")]
    assert verify(repo).ok
    for snap, img in hist:
        assert read_all(repo.snapshot(snap.path.name), "pages-1.img") == img


class Crash(Exception):
    pass


STEPS = ["snapshot-renamed", "snapshots-deleted", "packs-rewritten", "index-written", "locations-one",
         "locations-written", "index-deleted-one",
         "index-replaced", "pack-deleted"]


@pytest.mark.parametrize("step", STEPS)
def test_crash_mid_prune_still_verifies(tmp_path, step):
    repo = Repository.open(tmp_path / "repo", create=True)
    hist = _history(repo, 4)

    def fault(s):
        if s == step:
            raise Crash(s)

    plan = plan_prune(snapshots_info(repo), 1)
    with pytest.raises(Crash):
        execute_prune(repo, plan, _fault=fault)
    repo = Repository.open(repo.path)        # as after a restart
    rep = verify(repo)
    assert rep.ok, (step, rep.problems)
    survivors = {s.path.name for s in repo.snapshots()}
    for snap, img in hist:
        if snap.path.name in survivors:
            assert read_all(repo.snapshot(snap.path.name), "pages-1.img") == img
    # the next prune finishes the job
    execute_prune(repo, plan_prune(snapshots_info(repo), 1))
    assert verify(repo).ok and len(repo.snapshots()) == 1
    assert read_all(repo.snapshots()[0], "pages-1.img") == hist[-1][1]
    assert not list((repo.path / "tmp").iterdir())


def test_prune_skips_a_broken_snapshot_and_keeps_data(tmp_path):
    """An unreadable snapshot never blocks the retention of the others, and is never deleted;
    while it is unreadable no data goes (it may need any of it)."""
    repo = Repository.open(tmp_path / "repo", create=True)
    hist = _history(repo, 3)
    (hist[0][0].path / "manifest").write_bytes(b"garbage")
    packs_before = sorted((repo.path / "packs").rglob("*"))
    res = execute_prune(repo, plan_prune(snapshots_info(repo), 1))
    assert res["snapshots_deleted"] == [hist[1][0].path.name]
    assert hist[0][0].path.is_dir() and res["unreadable"] and "data_kept" in res
    assert sorted((repo.path / "packs").rglob("*")) == packs_before
    assert read_all(repo.snapshot(hist[2][0].path.name), "pages-1.img") == hist[2][1]


def test_plan_accepts_snapshot_objects_and_cli_helpers(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    hist = _history(repo, 3)
    with repo.writer_lock():               # the CLI holds the lock; execute_prune re-enters it
        plan = plan_prune(repo.snapshots(), keep_last=1)
        res = execute_prune(repo, plan, dry_run=False)
    assert plan.remove == [h[0].id for h in hist[:2]]
    assert res.to_dict()["snapshots_deleted"] == [h[0].path.name for h in hist[:2]]
    assert any("deleted snapshot" in line for line in prune_lines(res))
    rep = verify(repo)
    assert rep.ok and "all good" in verify_summary(rep) and verify_lines(rep)
    from gpusnap.render.snapshots import snapshot_stats as render
    from gpusnap.repo.maint.usage import inspect_snapshot
    r = inspect_snapshot(repo, repo.snapshots()[0])
    assert r["pages_total"] == 270 and r["bytes_unique"] > 0

    class Out:
        lines = []

        def print(self, s):
            self.lines.append(s)
    o = Out()
    render(r, o)
    assert any("pages:" in line for line in o.lines)


# -- plan, then execute (issue 9 item 5) -------------------------------------------------------

def _listing(root, skip=()):
    """Every entry under root with its kind, size, mode and mtime: what 'nothing changed' means."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            if rel.split(os.sep)[0] in skip:
                continue
            st = os.lstat(p)
            out[rel] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _messy_history(tmp_path):
    """A history with something of every kind for prune: packs to delete and to rewrite,
    an orphan pack of an interrupted dump, crash leftovers, a log of a snapshot."""
    repo = Repository.open(tmp_path / "repo", create=True)
    hist = _history(repo, 5)
    with repo.writer_lock():
        w = repo.new_snapshot("dead", pack_target=64 * 1024)
        s = w.image_sink("pages-1.img")
        s.write(os.urandom(PAGE * 40))
        s.close()
        w.packer.finish()                   # packs in place, no index: the dump "died"
    (repo.path / "tmp" / "pack-x.tmp").write_bytes(b"partial")
    (repo.path / "snapshots" / ".del-old").mkdir()
    (repo.path / "logs").mkdir(mode=0o700, exist_ok=True)
    (repo.path / "logs" / f"{hist[0][0].path.name}-dump.log").write_text("log")
    return repo, hist


def test_planning_changes_nothing_on_disk(tmp_path):
    from gpusnap.repo.maint.prune import plan

    repo, hist = _messy_history(tmp_path)
    before = _listing(repo.path)
    doomed = plan_prune(repo.snapshots(), 2).delete
    p1 = plan(repo, doomed)
    p2 = plan(Repository.open(repo.path), doomed)
    assert _listing(repo.path) == before
    assert p1.to_dict() == p2.to_dict()
    whys = {(d.action, d.why) for d in p1.packs}
    assert {("delete", "unused"), ("delete", "orphan"), ("rewrite", "small"), ("rewrite", "mostly unused")} <= whys
    assert p1.remove == [h[0].path.name for h in hist[:3]]
    assert "tmp/pack-x.tmp" in p1.leftovers and "snapshots/.del-old" in p1.leftovers
    assert f"logs/{hist[0][0].path.name}-dump.log" in p1.leftovers
    t = p1.totals()
    assert t["to_free"] > 0 and t["used"] + t["unused"] == sum(d.stored for d in p1.packs)
    # the CLI's dry run: only the lock files are touched (the writer lock says who holds it)
    from conftest import run_gpusnap, run_json
    dry = run_json("prune", "--keep-last", "2", "--dry-run", "--repo", repo.path)
    human = run_gpusnap("prune", "--keep-last", "2", "--dry-run", "--repo", repo.path)
    assert human.returncode == 0, human.stderr
    assert _listing(repo.path, skip=("locks",)) == {k: v for k, v in before.items() if not k.startswith("locks")}
    from gpusnap.repo.maint.prune import measure_rewrite
    measure_rewrite(repo, p1)          # the dry run reports what the rewrite would write, exactly
    assert dry["plan"] == p1.to_dict()
    for d in p1.packs:
        if d.action != "keep":
            assert f"would {d.action} pack {d.pack.hex()[:16]}" in human.stdout
    for n in p1.remove:
        assert f"would delete snapshot {n}" in human.stdout


def test_dry_run_is_the_plan_that_executes(tmp_path):
    from conftest import run_json

    repo, hist = _messy_history(tmp_path)
    packs_before = {p.name for p in (repo.path / "packs").rglob("*") if p.is_file()}
    dry = run_json("prune", "--keep-last", "2", "--dry-run", "--repo", repo.path)
    real = run_json("prune", "--keep-last", "2", "--repo", repo.path)
    assert real["plan"] == dry["plan"] and not real["dry_run"] and dry["dry_run"]
    assert real["snapshots_deleted"] == dry["snapshots_deleted"] == [h[0].path.name for h in hist[:3]]
    packs_after = {p.name for p in (repo.path / "packs").rglob("*") if p.is_file()}
    plan = dry["plan"]
    going = {d["pack"] for d in plan["packs"] if d["action"] != "keep"}
    kept = {d["pack"] for d in plan["packs"] if d["action"] == "keep"}
    assert going and going <= packs_before and not going & packs_after        # exactly those went
    assert kept <= packs_after
    assert len(packs_after - packs_before) == real["packs_written"]            # and the rewrites came
    assert real["packs_deleted"] == sum(d["action"] == "delete" for d in plan["packs"])
    assert real["packs_rewritten"] == sum(d["action"] == "rewrite" for d in plan["packs"])
    assert real["leftovers_removed"] == len(plan["leftovers"]) == dry["leftovers_removed"]
    repo = Repository.open(repo.path)
    assert verify(repo).ok
    for snap, img in hist[-2:]:
        assert read_all(repo.snapshot(snap.path.name), "pages-1.img") == img
    # nothing left to do: the next plan keeps every pack
    again = run_json("prune", "--dry-run", "--repo", repo.path)["plan"]
    assert again["snapshots_remove"] == [] and {d["action"] for d in again["packs"]} == {"keep"}


def test_a_stale_plan_is_refused(tmp_path):
    from gpusnap.errors import RepositoryError
    from gpusnap.repo.maint.prune import execute, locked, plan

    repo, hist = _messy_history(tmp_path)
    p = plan(repo, plan_prune(repo.snapshots(), 2).delete)
    dump(repo, {"pages-1.img": os.urandom(PAGE * 4)})          # a new index file since the plan
    with locked(repo), pytest.raises(RepositoryError, match="changed since prune's plan"):
        execute(repo, p)
    assert len(repo.snapshots()) == 6
    with pytest.raises(RepositoryError, match="exclusive lock"):
        execute(repo, plan(repo))


def test_prune_forget_and_retention_share_one_lock_policy(tmp_path):
    """A restore reading (the readers lock held shared, by another process's fd) makes prune,
    forget --prune and a dump's retention refuse the same way, before anything changes; a
    dry run (shared) goes on."""
    import fcntl

    from gpusnap.errors import RepositoryLocked
    from gpusnap.ops import forget as forget_mod
    from gpusnap.repo.maint import prune as prune_mod

    repo, hist = _messy_history(tmp_path)
    before = _listing(repo.path, skip=("locks",))
    def retention():                        # what a dump holding the writer lock runs
        with repo.writer_lock():
            return prune_mod.retain(repo, "job", 1)

    fd = os.open(repo.path / "locks" / "readers", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        errors = []
        for call in (lambda: prune_mod.run(repo, keep_last=1),
                     lambda: forget_mod.forget(repo, [], keep_last=1, prune=True),
                     lambda: forget_mod.forget(repo, [hist[0][0].id]),
                     retention):
            with pytest.raises(RepositoryLocked) as e:
                call()
            errors.append((e.value.message, e.value.hint))
        assert len(set(errors)) == 1, errors
        assert _listing(repo.path, skip=("locks",)) == before
        assert prune_mod.run(repo, keep_last=1, dry_run=True)["snapshots_deleted"]
    finally:
        os.close(fd)
    assert len(prune_mod.run(repo, keep_last=1)["snapshots_deleted"]) == 4


def test_prune_keeps_a_pack_that_holds_only_data_a_kept_snapshot_needs(tmp_path):
    """Snapshots of data images only (no pages): each pack holds nothing but data blobs, so
    what decides whether it stays is whether a kept snapshot uses them."""
    repo = Repository.open(tmp_path / "repo", create=True)
    imgs = [os.urandom(30000) for _ in range(3)]
    for img in imgs:
        dump(repo, {"core-1.img": img}, compress="none")
    res = execute_prune(repo, plan_prune(snapshots_info(repo), 1))
    assert len(res["snapshots_deleted"]) == 2 and res["packs_deleted"] >= 2
    repo = Repository.open(repo.path)
    [kept] = repo.snapshots()
    assert read_all(kept, "core-1.img") == imgs[-1]
    assert verify(repo).ok
