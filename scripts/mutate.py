"""The mutation check (`make mutate`): break one line of the integrity, locking, retention or
guardian code at a time, in a scratch copy of the tree, and run the tests that name that
feature; every mutation must make them fail. A mutation that survives means a check no test
would notice is missing: add the test (docs/testing.md).

Why a list of one-line mutations rather than mutmut or cosmic-ray: those generate thousands
of operator mutants per module, and each mutant here means dumping real processes with the
real CRIU (seconds per test, minutes per module), so a full run would take days on two cores;
and most of their mutants would not touch a check at all. The list names each check the
project promises (docs/format.md's checksums and bounds, the locks of docs/faults.md, what
retention deletes, what the guardian does when gpusnap dies) with the tests that should
notice it, so the run is deterministic, takes minutes, and its table says which check is
guarded by which test.

    python scripts/mutate.py                 # every mutation; a table on stdout; 1 if one survives
    python scripts/mutate.py -k guardian     # those whose id contains "guardian"
    python scripts/mutate.py --list          # the list, nothing run
    python scripts/mutate.py --markdown F    # also write the table (markdown) to F

Each mutation is one exact line of a file (it must occur exactly once, or the script stops:
the product moved on and the list must follow) replaced by another. The scratch copy (in
$MUTATE_DIR, default /var/tmp/gpusnap-mutate-<hash of the checkout's path>: one per checkout,
so runs in two worktrees never refresh each other's copy; a run holds it locked) is the
tracked and untracked-but-not-ignored
files of the checkout (git ls-files), a link to .venv and a build of its own (the plugin
tests build in the tree they run from); the checkout itself is never written.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Mutation:
    id: str
    path: str           # relative to the root
    old: str            # one line, stripped of its indentation, occurring exactly once
    new: str            # what replaces it (same indentation)
    tests: list[str]    # pytest arguments: files, node ids, -k expressions
    why: str = ""       # what the mutation breaks
    needs: str = ""     # tests expected from another branch (say which), if not yet here
    extra: list[str] = field(default_factory=list)
    # where the same check lives in another layout of the code (path, line, occurrence or 0),
    # tried in turn when `path` has no such line
    alt: list[tuple[str, str, int]] = field(default_factory=list)
    where: str = ""                                       # (set when applied: the file mutated)
    tests_run: list[str] = field(default_factory=list)    # (set when run: m.tests present here)


T_CORRUPT = "tests/test_repo_corruption.py"
T_FUZZ = "tests/test_repo_fuzz.py"
T_BOUNDS = "tests/test_format_bounds.py"
T_EXPORT = "tests/test_export.py"
T_INTEGRITY = "tests/test_integrity_checks.py"     # (helper importb's tests, where they have landed)
T_EXPORT_FUZZ = "tests/test_export_fuzz.py"
T_LOCK = "tests/test_repo_lock.py"
T_CONC = "tests/test_concurrent_writers.py"
T_TIERS_W = "tests/test_tiers_writers.py"
T_HOSTLOCK = "tests/test_hostlock.py"
T_PRUNE = "tests/test_repo_prune.py"
T_RET = "tests/test_retention.py"
T_FORGET = "tests/test_forget.py"
T_PF = "tests/test_plugin_failures.py"
T_SCHED = "tests/test_schedule.py"

MUTATIONS: list[Mutation] = [
    # -- integrity: the repository's formats (docs/format.md) and the reader ----------------------
    Mutation("manifest-checksum", "gpusnap/repo/format/manifest.py",
             "if h.encode() != want:", "if False:",
             [T_BOUNDS, T_CORRUPT, T_FUZZ], "the manifest's blake3 trailer is not checked"),
    Mutation("manifest-schema", "gpusnap/repo/format/manifest.py",
             "check_manifest(m)", "pass",
             [T_FUZZ, T_CORRUPT], "a manifest whose checksum holds is accepted whatever it says"),
    Mutation("manifest-trailer-shape", "gpusnap/repo/format/manifest.py",
             "if not trailer.startswith(MANIFEST_TRAILER_PREFIX) or not trailer.endswith(b\"\\n\"):",
             "if False:", [T_BOUNDS, T_FUZZ, T_CORRUPT], "a manifest without its trailer line is parsed"),
    Mutation("pack-trailer-count", "gpusnap/repo/format/pack.py",
             "if len(out) != n_blobs:", "if False:",
             [T_BOUNDS, T_FUZZ, "tests/test_pack_names.py"], "a pack whose trailer miscounts its blobs is accepted"),
    Mutation("pack-blob-bounds", "gpusnap/repo/format/pack.py",
             "if nxt > end:", "if False:",
             [T_BOUNDS, T_FUZZ, "tests/test_pack_names.py"], "a blob that runs past the end of its pack is accepted"),
    Mutation("pagelist-coverage", "gpusnap/repo/format/pagelist.py",
             "if covered != image_size:", "if False:",
             [T_BOUNDS, T_FUZZ, "tests/test_locations_native.py"], "a page list shorter than its image is accepted"),
    Mutation("reader-blob-checksum", "gpusnap/repo/reader.py",
             "if blob_id(data) != bid:", "if False:",
             [T_BOUNDS, T_CORRUPT], "a data blob is not checked against its id when read"),
    Mutation("reader-image-digest", "gpusnap/repo/reader.py",
             "if n != im[\"size\"] or h.hexdigest() != im[\"digest\"]:", "if n != im[\"size\"]:",
             [T_BOUNDS, T_CORRUPT], "an image read back is not checked against its recorded digest"),
    Mutation("reader-page-checksum", "gpusnap/repo/reader.py",
             "raise snap.corrupt(f\"a page of {name} fails its checksum\", _pack_of_page(job, reader, detail))",
             "return", [T_CORRUPT], "a page that fails its checksum is handed to CRIU"),
    # -- integrity: import (an export file) ---------------------------------------------------------
    Mutation("import-page-checksum", "gpusnap/ops/import_.py",
             "if native.verify(pages, k, ids[o * 16:(o + k) * 16], b\"\\x01\" * k) >= 0:", "if False:",
             [T_EXPORT, T_INTEGRITY, T_EXPORT_FUZZ], "import does not check each page against its id",
             needs="helper importb's tests (damage under a recomputed trailer)",
             alt=[("gpusnap/ops/import_stream.py", "if native.verify(pages, k, ids[o * 16:(o + k) * 16], b\"\\x01\" * k) >= 0:", 0)]),
    Mutation("import-tail-checksum", "gpusnap/ops/import_.py",
             "if blake3.blake3(tail).digest() != rec[2]:", "if False:",
             [T_EXPORT, T_INTEGRITY, T_EXPORT_FUZZ], "import does not check an image's last partial page",
             needs="helper importb's tests (damage under a recomputed trailer)",
             alt=[("gpusnap/ops/import_stream.py", "if blake3.blake3(tail).digest() != rec[2]:", 0)]),
    Mutation("import-image-checksum", "gpusnap/ops/import_.py",
             "if h.hexdigest() != im[\"digest\"]:", "if False:",
             [T_EXPORT, T_INTEGRITY, T_EXPORT_FUZZ], "import does not check a blob image against its digest",
             needs="helper importb's tests (damage under a recomputed trailer)",
             alt=[("gpusnap/ops/import_stream.py", "if h.hexdigest() != im[\"digest\"]:", 2)]),
    Mutation("import-pagelist-checksum", "gpusnap/ops/import_.py",
             "if len(pl) != im[\"pagelist_size\"] or blake3.blake3(pl).hexdigest() != im[\"digest\"]:",
             "if False:", [T_EXPORT, T_INTEGRITY, T_EXPORT_FUZZ], "import does not check a page list against its digest",
             needs="helper importb's tests (damage under a recomputed trailer)",
             alt=[("gpusnap/ops/import_stream.py", "if h.hexdigest() != im[\"digest\"]:", 1)]),
    Mutation("import-file-trailer", "gpusnap/ops/import_.py",
             "if trailer != expect:", "if False:",
             [T_EXPORT, T_INTEGRITY, T_EXPORT_FUZZ], "import does not check the export file's whole-file checksum",
             alt=[("gpusnap/ops/import_stream.py", "if trailer != expect:", 0)]),
    Mutation("import-trailing-bytes", "gpusnap/ops/import_.py",
             "if f.read(1):", "if False:",
             [T_EXPORT, T_INTEGRITY, T_EXPORT_FUZZ], "bytes after an export file's trailer are ignored",
             alt=[("gpusnap/ops/import_stream.py", "if src.f.read(1):", 0)]),
    # -- integrity: copy's receiving end (gpusnap serve) --------------------------------------------
    Mutation("serve-page-checksum", "gpusnap/ops/serve.py",
             "if native.verify(pages, k, ids[a * 16:(a + k) * 16], b\"\\x01\" * k) >= 0:", "if False:",
             ["tests/test_copy.py"], "copy's receiver does not check each page against its id"),
    Mutation("serve-frame-head", "gpusnap/ops/copy_wire.py",
             "if tag not in want or reserved or stored_len > limit or raw_len > limit:", "if False:",
             ["tests/test_copy.py"], "a copy frame of another kind, or over its limit, is accepted"),
    # -- tiers: a snapshot not yet copied is never pruned (ops/prune.py, repo/copies.py) ------------
    Mutation("tiers-never-prune-uncopied", "gpusnap/ops/prune.py",
             "return (lambda: ()) if prune_uncopied else (lambda: copies.uncopied_ids(repo.path))",
             "return lambda: ()",
             ["tests/test_tiers.py::test_pending_records_protect_from_retention_and_are_swept",
              "tests/test_tiers.py::test_retention_per_tier_never_deletes_an_uncopied_snapshot"],
             "--keep-last deletes snapshots a tiered dump has not copied yet"),
    Mutation("tiers-pending-read-under-lock", "gpusnap/repo/maint/prune.py",
             "delete = doomed()", "pass",
             [f"{T_TIERS_W}::test_retention_reads_the_pending_records_under_the_exclusive_lock"],
             "retention deletes what another writer marked pending while it waited for the exclusive lock",
             extra=["occurrence=2"]),
    Mutation("tiers-sweep-locked", "gpusnap/repo/copies.py",
             "if repo.holds_exclusive():", "if True:",
             [f"{T_TIERS_W}::test_records_of_gone_snapshots_are_swept_only_under_prunes_locks"],
             "the copies/ records are swept while a writer may be between its commit and its record"),
    Mutation("tiers-prune-sweeps", "gpusnap/repo/maint/prune.py",
             "copies.sweep(repo)      # the copy records (docs/format.md §14) of snapshots that are gone", "pass",
             [f"{T_TIERS_W}::test_records_of_gone_snapshots_are_swept_only_under_prunes_locks"],
             "a prune leaves the copies/ records of the snapshots it deleted"),
    # -- the cron line ------------------------------------------------------------------------------
    Mutation("cron-config-dir", "gpusnap/ops/schedule/backends.py",
             "cmd = \" \".join([*words, \"schedule\", \"run\", s.name, \"--config-dir\", "
             "safe_word(\"--config-dir\", s.config_dir)])",
             "cmd = \" \".join([*words, \"schedule\", \"run\", s.name])",
             [f"{T_SCHED}::test_job_gone_is_reported_after_runs_in_a_row",
              f"{T_SCHED}::test_the_cron_command_dumps_keeps_the_last_n_and_logs_json"],
             "the cron line no longer says where the schedule's spec is"),
    # -- locking: the repository's writer and readers locks, the machine-wide job locks ------------
    Mutation("writer-lock", "gpusnap/repo/locking.py",
             "op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH",
             "op = fcntl.LOCK_SH",
             [T_LOCK], "a prune runs beside a writer on this machine (the exclusive flock taken shared)"),
    Mutation("writer-lock-holder", "gpusnap/repo/locking.py",
             "if not isinstance(info, dict) or not info:", "if True:",
             [T_LOCK, "tests/test_old_repository.py"], "the locked-repository error no longer names an older holder"),
    # (the lock-file ones name their tests: the whole of T_CONC runs real dumps first, and with a
    # dead process's lock file never taken over its SIGKILL test's prune waits out its 600 s
    # --lock-wait, so the run timed out before the test that catches it)
    Mutation("lock-file-exclusive", "gpusnap/repo/lockfile.py",
             "if exclusive:", "if False:",
             [f"{T_CONC}::test_prune_waits_for_writers_and_writers_wait_for_prune"],
             "an exclusive lock file is kept out only by other exclusive ones (prune beside writers)"),
    Mutation("lock-file-stale-remote", "gpusnap/repo/lockfile.py",
             "return now - self.refreshed > stale_after()", "return now - self.refreshed > 0",
             [f"{T_CONC}::test_a_refreshed_lock_file_keeps_others_out_until_it_stops"],
             "another machine's lock file counts as stale although it is refreshed"),
    Mutation("lock-file-stale-local", "gpusnap/repo/lockfile.py",
             'return st is None or st.state in ("Z", "X") or st.starttime != self.start', "return False",
             [f"{T_CONC}::test_stale_lock_files_are_taken_over"],
             "a dead process's lock file on this machine is never taken over"),
    Mutation("readers-lock-exclusive", "gpusnap/repo/repository.py",
             "ok = lockwait.flock(fd, fcntl.LOCK_EX, self.lock_wait, on_wait)",
             "ok = lockwait.flock(fd, fcntl.LOCK_SH, self.lock_wait, on_wait)",
             [T_LOCK], "a prune deletes data while a restore reads it (taken shared)"),
    Mutation("readers-lock-shared", "gpusnap/repo/repository.py",
             "fcntl.flock(fd, fcntl.LOCK_SH)", "pass",
             [T_LOCK], "a restore reads without holding the readers lock"),
    Mutation("lock-file-trust", "gpusnap/repo/fsutil.py",
             "bad = untrusted_reason(st, want_dir=False)", "bad = None",
             [T_LOCK, "tests/test_repo_trust.py"], "a lock file another user owns or can write is taken"),
    Mutation("lock-file-hardlink", "gpusnap/repo/fsutil.py",
             "if bad is None and st.st_nlink != 1:", "if False:",
             [T_LOCK, "tests/test_repo_trust.py"], "a lock file hard-linked to another file is taken (and truncated)"),
    Mutation("hostlock-try", "gpusnap/system/hostlock.py",
             "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
             [T_HOSTLOCK], "two dumps or restores of one job at once", extra=["occurrence=1"]),
    Mutation("hostlock-wait", "gpusnap/system/hostlock.py",
             "fcntl.flock(fd, fcntl.LOCK_EX)", "pass",
             [T_HOSTLOCK], "a second dump or restore of a job goes on instead of waiting"),
    Mutation("hostlock-private-dir", "gpusnap/system/hostlock.py",
             "if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:",
             "if not stat.S_ISDIR(st.st_mode):",
             [T_HOSTLOCK], "the lock directory may belong to another user"),
    # -- retention: what forget and prune delete ----------------------------------------------------
    Mutation("retention-keep-count", "gpusnap/repo/maint/prune_plan.py",
             "cut = len(items) - keep_last if keep_last < len(items) else 0",
             "cut = len(items) - keep_last + 1 if keep_last < len(items) else 0",
             [T_RET, T_PRUNE], "--keep-last N keeps N-1"),
    Mutation("retention-other-names", "gpusnap/repo/maint/prune_plan.py",
             "if name is not None and gname != name:", "if False:",
             [T_RET, T_PRUNE, T_FORGET], "--name N also thins the snapshots of other names"),
    Mutation("retention-newest", "gpusnap/repo/maint/prune_plan.py",
             "items = sorted(groups[gname], key=lambda s: (s[\"created\"], s[\"id\"]))",
             "items = sorted(groups[gname], key=lambda s: (s[\"created\"], s[\"id\"]), reverse=True)",
             [T_RET, T_PRUNE], "retention keeps the oldest, not the newest"),
    Mutation("retention-zero-needs-all", "gpusnap/ops/prune.py",
             "if keep_last == 0 and not all_:", "if False:",
             [T_FORGET, T_RET], "--keep-last 0 --name N deletes every snapshot of N without --all"),
    Mutation("retention-zero-needs-name", "gpusnap/ops/prune.py",
             "if keep_last == 0 and name is None:", "if False:",
             [T_FORGET, T_RET], "--keep-last 0 alone deletes every snapshot of the repository"),
    Mutation("prune-unused-pack", "gpusnap/repo/maint/prune_plan.py",
             "if used == 0:", "if used < 0:",
             [T_RET, T_PRUNE], "a pack no snapshot uses is rewritten, not deleted"),
    Mutation("prune-used-data", "gpusnap/repo/maint/prune_plan.py",
             "used += sz if bno in used_data else 0", "used += 0",
             [T_PRUNE, T_RET], "prune counts data blobs a snapshot still needs as unused"),
    Mutation("prune-missing-pages", "gpusnap/repo/maint/prune_plan.py",
             "if not used_slots.add(pages):", "if False:",
             [T_PRUNE, T_RET], "prune goes on when a kept snapshot needs pages the index lacks"),
    # -- the guardian of dump --exit ----------------------------------------------------------------
    Mutation("guardian-resume", "gpusnap/ops/guardian.py",
             "os.kill(pid, signal.SIGCONT)", "pass",
             [f"{T_PF}::test_exit_dump_sigkilled_after_criu_job_runs_on"],
             "gpusnap killed before the commit leaves the job stopped for ever"),
    Mutation("guardian-done-or-died", "gpusnap/ops/guardian.py",
             "if b\"D\" in buf:", "if True:",
             [f"{T_PF}::test_exit_dump_sigkilled_after_criu_job_runs_on"],
             "the guardian takes gpusnap's death for 'settled'"),
    Mutation("guardian-committed", "gpusnap/ops/guardian.py",
             "if b\"C\" in buf:", "if False:",
             [f"{T_PF}::test_exit_dump_sigkilled_after_commit_job_is_killed_and_restores"],
             "after the commit the guardian resumes the job instead of finishing --exit"),
    Mutation("guardian-told-committed", "gpusnap/ops/guardian.py",
             "self._send(b\"C\")", "pass",
             [f"{T_PF}::test_exit_dump_sigkilled_after_commit_job_is_killed_and_restores"],
             "gpusnap never tells the guardian the snapshot is committed"),
    Mutation("guardian-gpu-settle", "gpusnap/ops/guardian.py",
             "problems = report.settle_after_failed_dump(report.read(a.report), [p for p in cuda if p in resumed])",
             "problems = []",
             [f"{T_PF}::test_exit_dump_sigkilled_after_criu_job_runs_on"],
             "the job resumes with its CUDA processes still checkpointed and locked"),
]


def default_dir() -> str:
    """The scratch copy's home for this checkout (another worktree's run has its own)."""
    import hashlib

    return f"/var/tmp/gpusnap-mutate-{hashlib.blake2b(str(ROOT).encode(), digest_size=4).hexdigest()}"


def hold_dir(d: Path) -> None:
    """The scratch copy is this run's until it exits (flock on d/lock): a second run on the same
    copy would refresh the tree under the first (its tests then "not here", or mutated code)."""
    import fcntl

    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"another mutate run uses {d}: wait for it, or give this one --dir / $MUTATE_DIR") from None
    globals()["_held_dir_fd"] = fd       # held until the process exits


def refresh_tree(dst: Path) -> None:
    """dst: a copy of the checkout's tracked (and untracked, not ignored) files, and a build
    of its native code and plugin of its own (build/, kept between runs: incremental)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    if dst.exists():
        for e in dst.iterdir():
            if e.name != "build":
                shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()
    for f in files:
        if not f:
            continue
        src = ROOT / os.fsdecode(f)
        if not src.is_file():         # (deleted in the work tree, not yet committed)
            continue
        d = dst / os.fsdecode(f)
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, d, follow_symlinks=False)
    (dst / ".venv").symlink_to((ROOT / ".venv").resolve())
    build = dst / "build"
    if not (build / "CMakeCache.txt").exists():
        subprocess.run(["cmake", "-S", str(dst), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        f"-DGPUSNAP_CRIU_INCLUDE={criu_include()}"], check=True, capture_output=True)
    r = subprocess.run(["cmake", "--build", str(build), f"-j{os.cpu_count() or 1}"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the scratch copy's build failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def criu_include() -> str:
    """The CRIU plugin headers the checkout's own build uses (make setup's CRIU)."""
    cache = ROOT / "build" / "CMakeCache.txt"
    if cache.exists():
        m = re.search(r"^GPUSNAP_CRIU_INCLUDE:\w+=(.*)$", cache.read_text(), re.M)
        if m:
            return m.group(1)
    found = sorted(Path("/opt/gpusnap").glob("criu-*/include"))
    if not found:
        raise SystemExit("no CRIU plugin headers: run `make setup` first")
    return str(found[-1])


def _locate(tree: Path, m: Mutation) -> tuple[Path, str, int | None]:
    """(file, line, occurrence) of the check in this tree: m.path, else the first of m.alt
    that holds the line."""
    occ = next((int(x.split("=")[1]) for x in m.extra if x.startswith("occurrence=")), None)
    for path, old, o in [(m.path, m.old, occ or 0), *m.alt]:
        p = tree / path
        if p.is_file() and any(ln.strip() == old for ln in p.read_text().splitlines()):
            return p, old, o or None
    return tree / m.path, m.old, occ


def tests_here(tree: Path, m: Mutation) -> list[str]:
    """m.tests less the files not in this tree (tests another branch brings)."""
    return [t for t in m.tests if t.startswith("-") or (tree / t.split("::")[0]).exists()]


def apply(tree: Path, m: Mutation) -> str:
    """Mutate the copy; return the original text to put back."""
    p, old, occ = _locate(tree, m)
    m.where = str(p.relative_to(tree))
    text = p.read_text()
    lines = text.splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if ln.strip() == old]
    if occ is None and len(hits) != 1:
        raise SystemExit(f"{m.id}: {m.where} has {len(hits)} lines `{old}` (want exactly one): update the list")
    if occ is not None and len(hits) < occ:
        raise SystemExit(f"{m.id}: {m.where} has {len(hits)} lines `{old}` (want occurrence {occ})")
    i = hits[(occ or 1) - 1]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + m.new + "\n"
    new = "".join(lines)
    ast.parse(new)     # a mutation must be a program, not a syntax error the tests "catch"
    p.write_text(new)
    return text


def put_back(tree: Path, m: Mutation, text: str) -> None:
    (tree / m.where).write_text(text)


def run_one(tree: Path, m: Mutation, timeout: float) -> tuple[str, list[str], float, str]:
    """-> (verdict, failed tests, seconds, output tail). verdict: caught | SURVIVED | error."""
    m.tests_run = tests_here(tree, m)
    if not m.tests_run:       # (pytest with no file would run the whole suite)
        return "error (none of its tests is here)", [], 0.0, ""
    orig = apply(tree, m)
    t0 = time.monotonic()
    try:
        args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
                "--no-header", "-rfE", *tests_here(tree, m)]
        # every gpusnap the tests start imports the copy's code, the .venv's console script
        # (an editable install of the checkout) included
        env = {**os.environ, "PYTHONPATH": str(tree)}
        # its own session: on a timeout or an interrupt, pytest and every job it started go
        p = subprocess.Popen(args, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, rc = f"{p.communicate()[0]}\ntimed out after {timeout:.0f} s", -1
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    finally:
        put_back(tree, m, orig)
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, re.M)
    if rc == 1 and failed:
        verdict = "caught"
    elif rc == 0:
        verdict = "SURVIVED"
    else:
        verdict = f"error (pytest exit {rc})"
    return verdict, failed, time.monotonic() - t0, out[-3000:]


def table(rows) -> str:
    out = ["| mutation | what it breaks | tests run | verdict | caught by |",
           "| --- | --- | --- | --- | --- |"]
    for m, verdict, failed, secs in rows:
        tests = ", ".join(t.replace("tests/", "") for t in m.tests_run)
        by = ", ".join(f.replace("tests/", "") for f in failed[:2]) or (m.needs and f"expected: {m.needs}") or "-"
        out.append(f"| `{m.id}` ({m.where.replace('gpusnap/', '')}) | {m.why} | {tests} | {verdict} ({secs:.0f} s) "
                   f"| {by} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only mutations whose id contains this")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--markdown", type=Path, help="write the table (markdown) here too")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutation")
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("MUTATE_DIR", default_dir())),
                    help="the scratch copy's home (its build/ is kept between runs)")
    ap.add_argument("--baseline", action="store_true",
                    help="run the chosen mutations' tests on the unmutated copy (they must pass)")
    a = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if a.k in m.id]
    if a.list:
        with tempfile.TemporaryDirectory(prefix="gpusnap-mutate.") as d:
            for m in chosen:
                dst = Path(d) / m.path
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / m.path, dst)
                for path, _, _ in m.alt:
                    if (ROOT / path).exists():
                        (Path(d) / path).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy(ROOT / path, Path(d) / path)
                apply(Path(d), m)
        for m in chosen:
            print(f"{m.id:28} {m.where}: {m.old}  ->  {m.new}\n{'':28} tests: {' '.join(m.tests)}")
        return 0
    # a TERM unwinds like Ctrl-C: the mutated line is put back, pytest and its jobs are killed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if os.geteuid() != 0:
        print("make mutate runs the tests, which dump real processes with CRIU: run it as root", file=sys.stderr)
        return 1
    rows, survived = [], []
    tree = a.dir / "tree"
    hold_dir(a.dir)
    refresh_tree(tree)
    for m in chosen:      # every line is where the list says, before anything runs
        put_back(tree, m, apply(tree, m))
    if a.baseline:        # the chosen mutations' tests pass on the unmutated copy
        tests = list(dict.fromkeys(t for m in chosen for t in tests_here(tree, m)))
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                            "--no-header", "-rfEs", *tests], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
        return p.returncode
    t_all = time.monotonic()
    for n, m in enumerate(chosen, 1):
        verdict, failed, secs, tail = run_one(tree, m, a.timeout)
        rows.append((m, verdict, failed, secs))
        print(f"[{n}/{len(chosen)}] {m.id}: {verdict} in {secs:.0f} s"
              + (f" by {failed[0]}" if failed else ""), flush=True)
        if verdict != "caught":
            survived.append(m.id)
            print(f"--- {m.id}\n{tail}", file=sys.stderr)
    total = time.monotonic() - t_all
    md = table(rows)
    print("\n" + md + f"\n\n{len(rows) - len(survived)} of {len(rows)} mutations caught in {total:.0f} s")
    if a.markdown:
        a.markdown.write_text(md + "\n")
    if survived:
        print(f"not caught: {', '.join(survived)} (a missing test: add one that fails with that line broken)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("mutate: interrupted (the scratch copy's line is put back)", file=sys.stderr)
        sys.exit(130)
