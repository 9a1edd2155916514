"""forget, prune's guards, ls --name and totals, logs removed with their snapshot: on real
repositories (snapshots written through the repository's own writer), through the CLI."""

import os

import pytest

from conftest import run_gpusnap, run_json
from gpusnap.ops.prune import sweep_logs
from gpusnap.errors import UsageError
from gpusnap.render import human_bytes
from gpusnap.repo import Repository
from gpusnap.repo.maint.verify import verify
from repo_helpers import PAGE, dump, read_all


def _repo(tmp_path, names=("a", "a", "a", "b", "b")):
    repo = Repository.open(tmp_path / "repo", create=True)
    shared = os.urandom(PAGE * 50)
    images = []
    for k, n in enumerate(names):
        img = shared + os.urandom(PAGE * 30)
        snap, _ = dump(repo, {"pages-1.img": img, "core-1.img": b"core%d" % k * 40}, name=n)
        images.append((snap, img))
    return repo, images


def _names(repo_path):
    return [(s["name"], s["dir"]) for s in run_json("ls", "--repo", repo_path)["snapshots"]]


def test_human_bytes_is_the_one_formatter():
    assert human_bytes(0) == "0 B" and human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(5 << 30) == "5.0 GiB"
    assert human_bytes(None) == "-"


def test_forget_one_snapshot_then_prune_frees_its_data(tmp_path):
    repo, images = _repo(tmp_path)
    victim, _ = images[1]
    before = run_json("ls", "--repo", repo.path)
    dry = run_json("forget", victim.id, "--dry-run", "--repo", repo.path)
    assert [f["dir"] for f in dry["snapshots_forgotten"]] == [victim.path.name]
    assert len(_names(repo.path)) == 5                     # dry run changed nothing
    res = run_json("forget", victim.id, "--repo", repo.path)
    assert [f["dir"] for f in res["snapshots_forgotten"]] == [victim.path.name]
    assert victim.path.name not in [d for _, d in _names(repo.path)]
    # its data stays until prune; prune alone (no --keep-last) frees it and keeps every snapshot
    pr = run_json("prune", "--repo", repo.path)
    assert pr["snapshots_deleted"] == [] and pr["bytes_freed"] > 30 * PAGE * 0.9
    after = run_json("ls", "--repo", repo.path)
    assert after["totals"]["snapshots"] == 4
    assert after["totals"]["bytes_stored"] < before["totals"]["bytes_stored"]
    rep = verify(Repository.open(repo.path))
    assert rep.ok, rep.problems
    for snap, img in images[:1] + images[2:]:
        assert read_all(Repository.open(repo.path).snapshot(snap.path.name), "pages-1.img") == img


def test_forget_keep_last_per_name_and_prune_flag(tmp_path):
    repo, images = _repo(tmp_path)
    res = run_json("forget", "--name", "a", "--keep-last", "1", "--prune", "--repo", repo.path)
    assert [f["dir"] for f in res["snapshots_forgotten"]] == [images[0][0].path.name, images[1][0].path.name]
    assert res["prune"]["bytes_freed"] > 0
    assert [n for n, _ in _names(repo.path)] == ["a", "b", "b"]
    # without --name the retention is per name: keep 1 of each
    run_json("forget", "--keep-last", "1", "--repo", repo.path)
    assert [n for n, _ in _names(repo.path)] == ["a", "b"]


def test_a_name_with_several_snapshots_is_not_guessed(tmp_path):
    repo, images = _repo(tmp_path)
    proc = run_gpusnap("forget", "a", "--repo", repo.path)
    assert proc.returncode == UsageError.exit_code and "names 3 snapshots" in proc.stderr
    assert len(_names(repo.path)) == 5


@pytest.mark.parametrize("cmd", ["prune", "forget"])
def test_deleting_every_snapshot_needs_name_and_all(tmp_path, cmd):
    repo, _ = _repo(tmp_path)
    for args in (["--keep-last", "0"], ["--keep-last", "0", "--all"], ["--keep-last", "0", "--name", "a"]):
        proc = run_gpusnap(cmd, *args, "--repo", repo.path)
        assert proc.returncode == UsageError.exit_code, (args, proc.stderr)
        assert "hint:" in proc.stderr
    assert len(_names(repo.path)) == 5
    dry = run_json(cmd, "--keep-last", "0", "--name", "a", "--all", "--dry-run", "--repo", repo.path)
    assert len(dry.get("snapshots_deleted", dry.get("snapshots_forgotten", []))) == 3
    assert len(_names(repo.path)) == 5
    run_json(cmd, "--keep-last", "0", "--name", "a", "--all", "--repo", repo.path)
    assert [n for n, _ in _names(repo.path)] == ["b", "b"]


def test_keep_last_help_says_per_name():
    for cmd in ("prune", "forget"):
        text = " ".join(run_gpusnap(cmd, "--help", check=True, env={"COLUMNS": "200"}).stdout.split())
        assert "of each name" in text


def test_ls_name_filter_and_totals_in_human_units(tmp_path):
    repo, _ = _repo(tmp_path)
    data = run_json("ls", "--name", "b", "--repo", repo.path)
    assert [s["name"] for s in data["snapshots"]] == ["b", "b"]
    assert data["totals"]["snapshots"] == 5 and data["totals"]["names"] == 2
    assert 0 < data["totals"]["bytes_stored"] < data["totals"]["bytes_raw"]
    proc = run_gpusnap("ls", "--repo", repo.path, check=True)
    assert "KiB" in proc.stdout and "5 snapshot(s) of 2 name(s)" in proc.stderr
    proc = run_gpusnap("prune", "--keep-last", "1", "--repo", repo.path, check=True)
    assert "freed" in proc.stdout and ("KiB" in proc.stdout or "MiB" in proc.stdout)


def test_logs_go_with_their_snapshot(tmp_path):
    repo, images = _repo(tmp_path)
    logs = repo.path / "logs"
    logs.mkdir(exist_ok=True)
    for snap, _ in images:
        (logs / f"{snap.path.name}-dump.log").write_text("log")
        (logs / f"{snap.path.name}-restore-2.log").write_text("log")
    (logs / "failed-dump-a-1.log").write_text("a failed dump: no snapshot, kept")
    def kept(snap):
        return [n for n in (f"{snap.path.name}-dump.log", f"{snap.path.name}-restore-2.log") if (logs / n).exists()]

    run_json("forget", images[0][0].path.name, "--repo", repo.path)
    assert kept(images[0][0]) == [] and len(kept(images[1][0])) == 2
    run_json("prune", "--keep-last", "1", "--name", "b", "--repo", repo.path)
    assert kept(images[3][0]) == [] and len(kept(images[4][0])) == 2
    assert (logs / "failed-dump-a-1.log").exists()
    assert sweep_logs(Repository.open(repo.path)) == 0


def test_remove_snapshot_needs_the_writer_lock(tmp_path):
    repo, images = _repo(tmp_path, names=("a",))
    from gpusnap.errors import RepositoryError
    with pytest.raises(RepositoryError):
        repo.remove_snapshot(images[0][0])
    with repo.writer_lock():
        repo.remove_snapshot(images[0][0])
    assert repo.snapshots() == [] and not any(n.startswith(".del-") for n in os.listdir(repo.path / "snapshots"))


@pytest.mark.criu
def test_real_logs_are_unique_kept_with_their_snapshot_and_removed_with_it(sample_job, tmp_path, undumpable):
    """Two failed dumps in a row keep two logs; a snapshot's dump and restore logs are named
    after it, never overwrite each other, and go when the snapshot goes."""
    import json

    from conftest import kill_pids
    repo = tmp_path / "repo"
    # CRIU itself fails on it (the preflight lets it through)
    logs = []
    for _ in range(2):
        proc = run_gpusnap("dump", undumpable.pid, "--repo", repo, "--json")
        assert proc.returncode == 8, proc.stdout
        logs.append(json.loads(proc.stdout)["criu_log"])
    assert logs[0] != logs[1] and all(os.path.isfile(p) for p in logs)

    job = sample_job(steps=100000, mb=4, threads=1, step_ms=20)
    job.wait_steps(2)
    d = run_json("dump", job.pid, "--repo", repo, "--name", "logged")
    snapdir = os.path.basename(d["snapshot"])
    job.kill()
    for _ in range(2):
        r = run_json("restore", d["snapshot"])
        kill_pids([r["pid"], *r.get("pids", []), *job.pids])
        job.pids = job.pids or [r["pid"]]
        import time
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in job.pids):
            time.sleep(0.05)
    kept = sorted(n for n in os.listdir(repo / "logs") if n.startswith(snapdir + "-"))
    assert kept == [f"{snapdir}-dump.log", f"{snapdir}-restore-2.log", f"{snapdir}-restore.log"], kept
    # a retention by dump --keep-last takes the logs of what it prunes
    r = run_json("restore", d["snapshot"])
    try:
        d2 = run_json("dump", r["pid"], "--repo", repo, "--name", "logged", "--keep-last", "1")
    finally:
        kill_pids([r["pid"], *r.get("pids", []), *job.pids])
    assert d2["pruned"] and not [n for n in os.listdir(repo / "logs") if n.startswith(snapdir + "-")]
    snapdir2 = os.path.basename(d2["snapshot"])
    assert (repo / "logs" / f"{snapdir2}-dump.log").is_file()
    run_json("forget", snapdir2, "--repo", repo)
    assert not (repo / "logs" / f"{snapdir2}-dump.log").exists()
    assert all(os.path.isfile(p) for p in logs)      # failed dumps belong to no snapshot: kept


def test_an_unreadable_snapshot_can_be_forgotten_by_its_directory(tmp_path):
    """A snapshot whose manifest is damaged keeps prune from deleting data (it may need any of
    it); naming its directory forgets it, and prune frees the data again."""
    repo, images = _repo(tmp_path, names=("a", "a", "b"))
    broken = images[1][0].path
    m = broken / "manifest"
    data = bytearray(m.read_bytes())
    data[10] ^= 1
    m.write_bytes(bytes(data))
    held = run_json("prune", "--repo", repo.path)                        # frees nothing while it is there
    assert held["data_kept"] and held["bytes_freed"] == 0 and broken.exists()
    assert "gpusnap forget DIR" in run_gpusnap("prune", "--repo", repo.path).stderr
    proc = run_gpusnap("forget", "a", "--repo", repo.path)                # by name: only readable ones count
    assert proc.returncode == 0 and broken.exists()
    res = run_json("forget", broken.name, "--repo", repo.path)
    assert [f["dir"] for f in res["snapshots_forgotten"]] == [broken.name] and not broken.exists()
    assert run_json("prune", "--repo", repo.path)["bytes_freed"] > 0
    assert verify(Repository.open(repo.path)).ok
    assert [n for n, _ in _names(repo.path)] == ["b"]


def test_forget_prune_dry_run_is_the_plan_it_runs(tmp_path):
    """forget --prune is one prune plan (the snapshots to drop, an unreadable one named by its
    directory included, and the packs to free); its dry run prints that plan, which then runs."""
    repo, images = _repo(tmp_path, names=("a", "a", "b"))
    broken = images[1][0].path
    m = broken / "manifest"
    m.write_bytes(m.read_bytes()[:-1] + b"\0")
    dry = run_json("forget", broken.name, images[0][0].path.name, "--prune", "--dry-run", "--repo", repo.path)
    assert broken.exists() and len(_names(repo.path)) == 2
    plan = dry["prune"]["plan"]
    assert sorted(plan["snapshots_remove"]) == sorted([broken.name, images[0][0].path.name])
    assert plan["data_kept"] is None and dry["prune"]["bytes_freed"] > 0
    assert any(d["action"] != "keep" for d in plan["packs"])
    real = run_json("forget", broken.name, images[0][0].path.name, "--prune", "--repo", repo.path)
    assert real["prune"]["plan"] == plan and not broken.exists()
    assert [n for n, _ in _names(repo.path)] == ["b"]
    r = Repository.open(repo.path)
    assert verify(r).ok and read_all(r.snapshots()[0], "pages-1.img") == images[2][1]
