"""gpusnap.gpu.driver and gpusnap.gpu.probe: degrade cleanly without a driver; inventory, state
and recovery through cuda-python (the one backend) over the fake driver (tests/fake_cuda:
build/fake_cuda, CUDA 13.0; build/fake_cuda_r550, a CUDA 12.4 driver without the checkpoint API)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.gpu import driver as d
from gpusnap.gpu import probe as gprobe
from plugin_helpers import FAKE_LIB_DIR, FAKE_LIB_DIR_R550, FakeCuda, ensure_built

ROOT = Path(__file__).resolve().parents[1]
HERE_HAS_DRIVER = gprobe.probe_inprocess().available
H200 = 150754820096                    # more than 4 GiB: only cuDeviceTotalMem_v2 can say it


def _no_driver_here():
    if HERE_HAS_DRIVER:
        pytest.skip("this machine has an NVIDIA driver")


# ---------------------------------------------------------------- pure helpers

def test_format_uuid():
    assert d.format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    # cuda-python hands out signed chars
    assert d.format_uuid([-1] * 16) == "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff"
    with pytest.raises(ValueError):
        d.format_uuid(b"short")


def test_format_cuda_version():
    assert d.format_cuda_version(12080) == "12.8"
    assert d.format_cuda_version(13000) == "13.0"
    assert d.format_cuda_version(None) is None


def test_normalize_bus_id():
    assert d.normalize_bus_id("00000000:9A:00.0") == "0000:9a:00.0"
    assert d.normalize_bus_id("0000:19:00.0") == "0000:19:00.0"
    assert d.normalize_bus_id(None) is None


def test_probe_roundtrips_through_json():
    p = d.DriverProbe(available=True, reason=None, driver_version="570.1", cuda_version="12.8",
                      cuda_version_int=12080, checkpoint_api=True,
                      gpus=[d.GpuInfo(0, "GPU-x", "H200", 1, "0000:19:00.0")], states={12: "locked"})
    q = d.DriverProbe.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q == p
    assert q.info() == {"driver_version": "570.1", "cuda_version": "12.8", "checkpoint_api": True,
                        "gpus": [{"index": 0, "uuid": "GPU-x", "name": "H200", "memory_bytes": 1,
                                  "pci_bus_id": "0000:19:00.0"}]}


# ---------------------------------------------------------------- no driver

def test_no_driver_inprocess():
    _no_driver_here()
    p = gprobe.probe_inprocess([1])
    assert not p.available and p.info() is None
    assert "no NVIDIA driver" in p.reason
    assert p.states == {1: None}
    assert p.summary().startswith("no NVIDIA driver")


def test_no_driver_isolated_and_public_api():
    _no_driver_here()
    p = d.probe([os.getpid()])
    assert not p.available and "no NVIDIA driver" in p.reason
    assert d.driver_info() is None
    assert d.checkpoint_state(os.getpid()) is None
    assert d.checkpoint_states([1, os.getpid()]) == {1: None, os.getpid(): None}
    assert d.checkpoint_states([]) == {}


def test_module_main_prints_one_json_object():
    r = subprocess.run([sys.executable, "-m", "gpusnap.gpu.probe", "1"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0
    obj = json.loads(r.stdout)
    assert set(obj) >= {"available", "reason", "gpus", "checkpoint_api", "states"}


def test_probe_child_failure_is_a_clean_result(monkeypatch):
    monkeypatch.setattr(sys, "executable", shutil.which("sleep") or "/bin/sleep")
    # `sleep -m gpusnap.gpu.probe` fails at once; a clean failure result either way
    p = d.probe([5], timeout=5)
    assert not p.available and p.states == {5: None} and p.reason


def test_resume_process_without_driver_is_a_clean_result():
    _no_driver_here()
    r = d.resume_process(os.getpid())
    assert r["pid"] == os.getpid() and r["after"] is None and "no NVIDIA driver" in r["error"]


# ---------------------------------------------------------------- the fake driver

@pytest.fixture()
def fake(tmp_path):
    ensure_built()
    f = FakeCuda(tmp_path / "fake")
    # device 0 of the driver sits on the higher bus: gpusnap must number GPUs by bus
    (f.dir / "gpus").write_text(f"GPU-b0b1b2b3-b4b5-b6b7-b8b9-babbbcbdbebf {H200} bus=9a NVIDIA H200\n"
                                f"GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf {H200} bus=19 NVIDIA H200\n")
    return f


def _probe_with(libdir: Path, fake: FakeCuda | None, pids: list[int], **env) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_ORDER", "FAKE_CUDA_DIR")}
    e.update(LD_LIBRARY_PATH=str(libdir), **env)
    if fake is not None:
        e["FAKE_CUDA_DIR"] = str(fake.dir)
    code = ("import json,sys; from gpusnap.gpu import driver as d; "
            "print(json.dumps(d.probe([int(x) for x in sys.argv[1:]]).to_dict()))")
    r = subprocess.run([sys.executable, "-c", code, *map(str, pids)], env=e, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("where", ["isolated", "inprocess"])
def test_inventory_and_state_with_the_fake_driver(fake, where):
    """The isolated child asks the driver for PCI order (CUDA_DEVICE_ORDER); in process the
    driver numbers GPUs its own way and gpusnap sorts them: the same GPU indices either way."""
    me = os.getpid()
    fake.declare(me, me, "locked")
    p = _probe_with(FAKE_LIB_DIR, fake, [me, 1],
                    **({"GPUSNAP_GPU_PROBE": "inprocess"} if where == "inprocess" else {}))
    assert p["available"] and p["reason"] is None
    assert p["cuda_version"] == "13.0" and p["cuda_version_int"] == 13000 and p["checkpoint_api"] is True
    assert [g["pci_bus_id"] for g in p["gpus"]] == ["0000:19:00.0", "0000:9a:00.0"]
    assert [g["index"] for g in p["gpus"]] == [0, 1]
    assert [g["uuid"] for g in p["gpus"]] == ["GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf",
                                              "GPU-b0b1b2b3-b4b5-b6b7-b8b9-babbbcbdbebf"]
    assert {g["name"] for g in p["gpus"]} == {"NVIDIA H200"}
    assert {g["memory_bytes"] for g in p["gpus"]} == {H200}
    assert p["states"] == {str(me): "locked", "1": None}       # pid 1 is no CUDA process
    mine = [c for c in fake.calls() if c.pid == me]
    assert [(c.call, c.rc, c.fields["state"]) for c in mine] == [("cuCheckpointProcessGetState", 0, "locked")]


def test_the_fake_driver_without_state_dir_is_a_driver_without_cuda_processes():
    ensure_built()
    p = _probe_with(FAKE_LIB_DIR, None, [os.getpid()])
    assert p["available"] and p["checkpoint_api"] is True
    assert [g["uuid"] for g in p["gpus"]] == ["GPU-fa4ec0da-0000-4000-8000-000000000001"]
    assert p["states"] == {str(os.getpid()): None}


def test_driver_without_checkpoint_api(fake):
    fake.declare(os.getpid(), os.getpid(), "locked")
    p = _probe_with(FAKE_LIB_DIR_R550, fake, [os.getpid()])
    assert p["available"] and p["reason"] is None
    assert p["cuda_version"] == "12.4" and p["checkpoint_api"] is False
    assert len(p["gpus"]) == 2
    assert p["states"] == {str(os.getpid()): None}
    assert [c.call for c in fake.calls()] == ["cuInit"]      # nothing else reached the driver


@pytest.fixture()
def sleeper():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def _resume(fake: FakeCuda, monkeypatch, pid: int, target: str = "running", lib: Path = FAKE_LIB_DIR) -> dict:
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.dir))
    return d.resume_process(pid, timeout=60, target=target)


def test_resume_brings_a_checkpointed_process_back(fake, sleeper, monkeypatch):
    fake.declare(sleeper.pid, sleeper.pid, "checkpointed")
    r = _resume(fake, monkeypatch, sleeper.pid)
    assert r == {"pid": sleeper.pid, "before": "checkpointed", "after": "running", "error": None}
    assert fake.transitions(sleeper.pid) == ["restore", "unlock"]
    assert fake.state(sleeper.pid) == "running"


def test_resume_to_locked_leaves_it_locked(fake, sleeper, monkeypatch):
    fake.declare(sleeper.pid, sleeper.pid, "checkpointed")
    r = _resume(fake, monkeypatch, sleeper.pid, target="locked")
    assert (r["before"], r["after"], r["error"]) == ("checkpointed", "locked", None)
    assert fake.transitions(sleeper.pid) == ["restore"]


def test_resume_reports_driver_errors(fake, sleeper, monkeypatch):
    fake.declare(sleeper.pid, sleeper.pid, "checkpointed")
    fake.fail("cuCheckpointProcessRestore", 999)
    r = _resume(fake, monkeypatch, sleeper.pid)
    assert r["before"] == r["after"] == "checkpointed"
    assert r["error"] == "cuCheckpointProcessRestore: CUDA_ERROR_UNKNOWN"


def test_resume_without_checkpoint_api(fake, sleeper, monkeypatch):
    fake.declare(sleeper.pid, sleeper.pid, "checkpointed")
    r = _resume(fake, monkeypatch, sleeper.pid, lib=FAKE_LIB_DIR_R550)
    assert r["after"] is None and r["error"] == "the driver has no CUDA checkpoint API"
    assert fake.state(sleeper.pid) == "checkpointed"
