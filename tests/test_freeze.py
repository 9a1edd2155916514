"""The freeze decoupled from the ingest (issue 10), through the real CRIU as root: CRIU's
bytes are staged (memory up to the budget, a spill file beyond it), the job resumes, and
the page pipeline stores them afterwards. Whatever the staging, the restored job finishes
with exactly the result of an uninterrupted run; a dump killed between the gate and the
commit leaves the job running, no snapshot and no staging behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, run_gpusnap, run_json
from gpusnap import staging as st
from restore_helpers import restore_and_finish

pytestmark = [pytest.mark.criu, pytest.mark.slow]

KW = dict(steps=300, mb=96, threads=3)


def _dump_and_check(job, repo, budget: str) -> dict:
    info = run_json("dump", job.pid, "--repo", repo, "--staging-budget", budget)
    stg = info["staging"]
    assert stg["budget"] == st.parse_size(budget)
    assert stg["staged_bytes"] == info["bytes_raw"]          # every byte CRIU sent went through staging
    assert stg["memory_peak"] <= stg["budget"]
    ph = info["phases"]
    assert list(ph) == ["preflight", "staging", "criu", "storing", "commit"]
    assert 0 < info["frozen_seconds"] <= ph["criu"]           # CRIU's own figure, inside its run
    assert not list((repo / "tmp").glob(f"{st.PREFIX}*"))
    return info


def test_tiny_budget_spills_to_a_file_and_the_restored_job_finishes_identically(sample_job, repo, reference):
    expected = reference(**KW)
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(10)
    info = _dump_and_check(job, repo, "1M")
    assert info["staging"]["spilled_bytes"] > (KW["mb"] << 20) * 0.9   # (nearly) all of it spilled
    # written around the page cache from bounce buffers (the test's filesystem takes O_DIRECT)
    assert info["staging"]["spill_mode"] == "direct"
    assert info["staging"]["budget_choice"] == "--staging-budget"
    at = job.steps_done()
    job.wait_steps(at + 5)                      # it runs on after the dump
    job.kill()
    restore_and_finish(job, info["snapshot"], repo, expected)


def test_large_budget_stages_in_memory_only_and_inspect_shows_the_freeze(sample_job, repo, reference):
    expected = reference(**KW)
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(10)
    info = _dump_and_check(job, repo, "1G")
    assert info["staging"]["spilled_bytes"] == 0
    assert info["staging"]["memory_peak"] >= KW["mb"] << 20
    shown = run_json("inspect", info["snapshot"], "--repo", repo)
    assert shown["meta"]["frozen_seconds"] == info["frozen_seconds"]
    assert shown["meta"]["dump_seconds"] >= info["frozen_seconds"]
    tp = shown["meta"]["throughput"]
    assert tp == info["throughput"] and tp["bytes"] == info["bytes_raw"]
    assert tp["criu_mb_s"] > 0 and tp["storing_mb_s"] > 0 and tp["dump_mb_s"] > 0
    assert tp["spill_mode"] is None and tp["spilled_bytes"] == 0 and tp["staging_budget"] == 1 << 30
    text = run_gpusnap("inspect", info["snapshot"], "--repo", repo, check=True).stdout
    assert f"job stood frozen {info['frozen_seconds']:.2f} s" in text
    assert "MB/s from CRIU into staging" in text and "(--staging-budget)" in text
    job.kill()
    restore_and_finish(job, info["snapshot"], repo, expected)


def test_ingest_during_the_stream_through_few_reused_slots_restores_identically(sample_job, repo, reference):
    """The ingest overlapping CRIU's stream (as from 4 cores on) with a budget of four slots:
    slots are released and refilled while the page groups of earlier ones still point into
    them (staging.Hold), the rest spills. The restored job finishes identically."""
    expected = reference(**KW)
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(10)
    info = run_json("dump", job.pid, "--repo", repo, "--staging-budget", str(4 * st.SEG),
                    env={"GPUSNAP_INGEST_OVERLAP": "1"})
    stg = info["staging"]
    assert stg["overlap"] is True and stg["staged_bytes"] == info["bytes_raw"]
    assert stg["memory_peak"] <= stg["budget"] and stg["spilled_bytes"] > 0
    job.kill()
    restore_and_finish(job, info["snapshot"], repo, expected)


@pytest.mark.parametrize("budget, overlap", [("1G", "0"), (str(4 * st.SEG), "1")])
def test_an_arena_in_huge_pages_restores_identically(sample_job, repo, reference, budget, overlap):
    """The arena in transparent huge pages, as where the machine keeps its memory (this VM's
    free page reporting keeps it in 4 KiB pages by default): the whole job staged, and four
    slots released (MADV_DONTNEED across huge pages) and refilled while CRIU streams."""
    expected = reference(**KW)
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(10)
    info = run_json("dump", job.pid, "--repo", repo, "--staging-budget", budget,
                    env={"GPUSNAP_ARENA_THP": "1", "GPUSNAP_INGEST_OVERLAP": overlap})
    stg = info["staging"]
    assert stg["arena_huge_pages"] is True
    assert stg["staged_bytes"] == info["bytes_raw"] and stg["memory_peak"] <= stg["budget"]
    assert (stg["spilled_bytes"] > 0) is (overlap == "1")
    job.kill()
    restore_and_finish(job, info["snapshot"], repo, expected)


def test_peak_memory_is_bounded_by_the_staging_budget(sample_job, repo):
    """gpusnap's own VmHWM stays within the budget plus a fixed overhead (the interpreter,
    the index, the pipeline's bounded queues), however large the job is."""
    job = sample_job(steps=300, mb=256, threads=2, step_ms=20)
    job.wait_steps(5)
    budget = 16 << 20
    info = run_json("dump", job.pid, "--repo", repo, "--staging-budget", str(budget))
    assert info["bytes_raw"] > 256 << 20
    assert info["staging"]["memory_peak"] <= budget
    assert info["peak_rss_bytes"] < budget + (112 << 20), info["peak_rss_bytes"] >> 20
    assert info["peak_rss_bytes"] < info["bytes_raw"] // 2


def test_kill_9_after_the_gate_leaves_the_job_running_and_nothing_behind(sample_job, repo, reference, tmp_path):
    kw = dict(steps=250, mb=64, threads=2)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(5)
    hold = tmp_path / "held.json"
    env = dict(os.environ, GPUSNAP_TEST_HOLD=f"after-gate:{hold}")
    dumper = subprocess.Popen([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--staging-budget", "1M",
                               "--json"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not hold.exists():
            assert dumper.poll() is None, dumper.communicate()
            assert time.monotonic() < deadline, "the dump never reached the gate"
            time.sleep(0.05)
        held = json.loads(hold.read_text())
        assert held["pid"] == dumper.pid and held["staging"]["spilled_bytes"] > 0
        # the spill file lives on the repository's filesystem, open but without a name
        links = [os.readlink(f"/proc/{dumper.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{dumper.pid}/fd")]
        spill = [ln for ln in links if ln.startswith(str(repo / "tmp")) and ln.endswith("(deleted)")]
        assert spill, links
        at = job.steps_done()
        job.wait_steps(at + 3)                 # the gate opened: the job runs while gpusnap stores
    finally:
        dumper.send_signal(signal.SIGKILL)
        dumper.communicate(timeout=30)
    assert dumper.returncode == -signal.SIGKILL

    at = job.steps_done()
    job.wait_steps(at + 5)                     # still running, not frozen
    listing = run_json("ls", "--repo", repo)
    assert listing["snapshots"] == []          # no partial snapshot visible
    assert not list((repo / "tmp").glob(f"{st.PREFIX}*"))

    # the next run cleans a named spill file a crash left (the named fallback's window)
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = repo / "tmp" / f"{st.PREFIX}{dead.pid}-deadbeef"
    leftover.write_bytes(b"\0" * 4096)
    info = run_json("dump", job.pid, "--repo", repo, "--staging-budget", "1M")
    assert not leftover.exists()
    assert [s["id"] for s in run_json("ls", "--repo", repo)["snapshots"]] == [info["id"]]
    assert run_gpusnap("verify", "--repo", repo).returncode == 0
    # the job was never harmed: it finishes with the uninterrupted result
    assert job.result() == expected


def test_the_native_gate_exits_at_once_and_fails_safe(tmp_path):
    """The action script CRIU runs inside the freeze: other actions pass at once; at
    post-dump, no gpusnap to answer means a non-zero exit (so CRIU resumes the job)."""
    import socket
    import threading

    from gpusnap.criu.gate import native_gate

    gate = native_gate()
    if gate is None:
        pytest.skip("native gate not built (cmake --build build)")
    sock = tmp_path / "g.sock"
    env = dict(os.environ, CRTOOLS_SCRIPT_ACTION="pre-dump")
    assert subprocess.run([gate, sock, "5"], env=env).returncode == 0
    env["CRTOOLS_SCRIPT_ACTION"] = "post-dump"
    assert subprocess.run([gate, sock, "5"], env=env).returncode == 1      # nobody listening
    for answer, rc in ((b"1", 0), (b"0", 1), (b"", 1)):
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.unlink(missing_ok=True)
        srv.bind(str(sock))
        srv.listen(1)

        def reply():
            conn, _ = srv.accept()
            if answer:
                conn.sendall(answer)
            conn.close()

        t = threading.Thread(target=reply)
        t.start()
        assert subprocess.run([gate, sock, "5"], env=env).returncode == rc, answer
        t.join()
        srv.close()


def test_without_the_gate_a_dump_is_refused_untouched(sample_job, repo):
    """The native gate is the one gate (no Python fallback): without it a dump stops with
    exit 27 before CRIU runs; the job runs on and nothing is stored."""
    job = sample_job(steps=400, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    r = run_gpusnap("dump", job.pid, "--repo", repo, "--json", env={"GPUSNAP_GATE": "/nonexistent"})
    assert r.returncode == 27, r.stdout + r.stderr
    assert "post-dump gate" in json.loads(r.stdout)["message"]
    seen = job.steps_done()
    job.wait_steps(seen + 3)                   # still running, not frozen
    assert run_json("ls", "--repo", repo)["snapshots"] == []
    job.kill()


def test_a_gate_on_a_path_with_a_space_still_protects_the_pages(sample_job, repo, reference, tmp_path):
    """CRIU runs its action script through `sh -c PATH`: a gate installed under a path with a
    space is reached through a plain name in the dump's private directory."""
    from gpusnap.criu.gate import native_gate

    d = tmp_path / "with space"
    d.mkdir()
    gate = d / "gpusnap-gate"
    gate.write_bytes(native_gate().read_bytes())
    gate.chmod(0o755)
    kw = dict(steps=200, mb=32, threads=2)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(5)
    info = run_json("dump", job.pid, "--repo", repo, env={"GPUSNAP_GATE": str(gate)})
    job.kill()
    restore_and_finish(job, info["snapshot"], repo, expected)



def test_default_budget_is_chosen_from_the_machine_and_never_more_than_the_job(sample_job, repo):
    """No --staging-budget: half the available memory, at most the job's own memory
    plus 16 MiB; the choice is reported. A 96 MiB job gets about its size."""
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(10)
    info = run_json("dump", job.pid, "--repo", repo)
    stg = info["staging"]
    assert stg["budget_choice"].startswith("the job's ") and "MiB of memory + 16 MiB" in stg["budget_choice"]
    assert (KW["mb"] << 20) <= stg["budget"] < 512 << 20      # (the interpreter adds its own)
    assert stg["spilled_bytes"] == 0 and stg["memory_peak"] <= stg["budget"]
    job.kill()


@pytest.fixture
def pipe_max_size():
    """Set fs.pipe-max-size for the test (root may write it), put back after."""
    path = "/proc/sys/fs/pipe-max-size"
    before = open(path).read().strip()

    def set_(n: int) -> None:
        with open(path, "w") as f:
            f.write(f"{n}\n")

    try:
        set_(int(before))
    except OSError as e:        # /proc/sys read-only (some containers): nothing to vary
        pytest.skip(f"cannot set fs.pipe-max-size here: {e}")
    yield set_
    set_(int(before))


@pytest.mark.parametrize("limit", [1 << 20, 4 << 20])
def test_pages_stream_through_pipes_as_large_as_allowed(sample_job, repo, reference, pipe_max_size, limit):
    """The pages pipes are 4 MiB (a shorter freeze) where fs.pipe-max-size or CAP_SYS_RESOURCE
    allows it, else as large as fs.pipe-max-size allows; doctor says which; either way the
    restored job finishes as an uninterrupted run."""
    from gpusnap.ops import preflight
    from gpusnap.criu.streamer import CAPTURE_PIPE_SIZE

    pipe_max_size(limit)
    expected = reference(**KW)
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(10)
    info = _dump_and_check(job, repo, "1G")
    may_exceed = preflight.has_cap(preflight.CAP_SYS_RESOURCE, preflight.cap_eff())
    want = CAPTURE_PIPE_SIZE if may_exceed else min(limit, CAPTURE_PIPE_SIZE)
    assert info["staging"]["pages_pipe"] == want, info["staging"]
    check = [c for c in run_json("doctor")["checks"] if c["name"] == "pipe size"][0]
    assert check["status"] == ("ok" if want == CAPTURE_PIPE_SIZE else "info"), check
    assert "fs.pipe-max-size" in (check["fix"] or "") or check["status"] == "ok"
    job.kill()
    restore_and_finish(job, info["snapshot"], repo, expected)
