"""gpusnap.gpu.driver: degrades cleanly without a driver; inventory and state through a
minimal libcuda.so.1 (tests/data/mini_libcuda.c) via cuda-python and via ctypes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.gpu import driver as d

ROOT = Path(__file__).resolve().parents[1]
HERE_HAS_DRIVER = d.probe_inprocess().available


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
                      gpus=[d.GpuInfo(0, "GPU-x", "H200", 1, "0000:19:00.0")], backend="ctypes",
                      states={12: "locked"})
    q = d.DriverProbe.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q == p
    assert q.info() == {"driver_version": "570.1", "cuda_version": "12.8", "checkpoint_api": True,
                        "gpus": [{"index": 0, "uuid": "GPU-x", "name": "H200", "memory_bytes": 1,
                                  "pci_bus_id": "0000:19:00.0"}]}


# ---------------------------------------------------------------- no driver

def test_no_driver_inprocess():
    _no_driver_here()
    p = d.probe_inprocess([1])
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


def test_no_driver_ctypes_backend(monkeypatch):
    _no_driver_here()
    monkeypatch.setenv("GPUSNAP_CUDA_BACKEND", "ctypes")
    p = d.probe_inprocess()
    assert not p.available and "no NVIDIA driver" in p.reason


def test_module_main_prints_one_json_object():
    r = subprocess.run([sys.executable, "-m", "gpusnap.gpu.driver", "1"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0
    obj = json.loads(r.stdout)
    assert set(obj) >= {"available", "reason", "gpus", "checkpoint_api", "states"}


def test_probe_child_failure_is_a_clean_result(monkeypatch):
    monkeypatch.setattr(sys, "executable", shutil.which("sleep") or "/bin/sleep")
    # `sleep -m gpusnap.gpu.driver` fails at once; a clean failure result either way
    p = d.probe([5], timeout=5)
    assert not p.available and p.states == {5: None} and p.reason


# ---------------------------------------------------------------- a minimal driver

@pytest.fixture(scope="session")
def mini_cuda(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    out = {}
    for flavour, defs in (("r570", []), ("old", ["-DMINI_CUDA_NO_CHECKPOINT"])):
        dd = tmp_path_factory.mktemp(f"minicuda-{flavour}")
        subprocess.run([cc, "-shared", "-fPIC", "-Wall", "-Werror", *defs, "-o",
                        str(dd / "libcuda.so.1"), str(ROOT / "tests/data/mini_libcuda.c"), "-ldl"],
                       check=True)
        out[flavour] = dd
    return out


def _probe_with(libdir: Path, pids: list[int], **env) -> dict:
    e = dict(os.environ, LD_LIBRARY_PATH=str(libdir), **env)
    code = ("import json,sys; from gpusnap.gpu import driver as d; "
            "print(json.dumps(d.probe([int(x) for x in sys.argv[1:]]).to_dict()))")
    r = subprocess.run([sys.executable, "-c", code, *map(str, pids)], env=e, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("backend", ["cuda-python", "ctypes"])
def test_inventory_and_state_with_mini_driver(mini_cuda, backend):
    cuda_pid = os.getpid()
    env = {"MINI_CUDA_CUDA_PID": str(cuda_pid), "MINI_CUDA_STATE": "1"}
    if backend == "ctypes":
        env["GPUSNAP_CUDA_BACKEND"] = "ctypes"
    p = _probe_with(mini_cuda["r570"], [cuda_pid, 1], **env)
    assert p["available"] and p["reason"] is None
    assert p["backend"] == backend
    assert p["cuda_version"] == "13.0" and p["checkpoint_api"] is True
    # indices follow the PCI bus order (device 0 of the driver sits on bus 9a)
    assert [g["pci_bus_id"] for g in p["gpus"]] == ["0000:19:00.0", "0000:9a:00.0"]
    assert [g["index"] for g in p["gpus"]] == [0, 1]
    assert p["gpus"][1]["uuid"] == "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf"
    assert p["gpus"][0]["name"] == "NVIDIA H200" and p["gpus"][0]["memory_bytes"] == 150754820096
    assert p["states"] == {str(cuda_pid): "locked", "1": None}


@pytest.mark.parametrize("backend", ["cuda-python", "ctypes"])
def test_driver_without_checkpoint_api(mini_cuda, backend):
    env = {"GPUSNAP_CUDA_BACKEND": "ctypes"} if backend == "ctypes" else {}
    p = _probe_with(mini_cuda["old"], [1], MINI_CUDA_CUDA_PID="1", **env)
    assert p["available"] and p["checkpoint_api"] is False
    assert len(p["gpus"]) == 2
    assert p["states"] == {"1": None}


def test_project_fake_driver_if_built():
    """The plugin tests' fake driver (native/, built at build/fake_cuda) must satisfy the wrapper too."""
    fake = ROOT / "build" / "fake_cuda"
    if not (fake / "libcuda.so.1").exists():
        pytest.skip("build/fake_cuda/libcuda.so.1 not built")
    p = _probe_with(fake, [os.getpid()])
    assert p["available"], p["reason"]
    assert p["checkpoint_api"] is True
    assert p["states"][str(os.getpid())] in (None, "running")


def test_resume_process_without_driver_is_a_clean_result():
    _no_driver_here()
    r = d.resume_process(os.getpid())
    assert r["pid"] == os.getpid() and r["after"] is None and "no NVIDIA driver" in r["error"]


def test_resume_with_mini_driver_reports_driver_errors(mini_cuda):
    e = dict(os.environ, LD_LIBRARY_PATH=str(mini_cuda["r570"]), MINI_CUDA_CUDA_PID="1",
             MINI_CUDA_STATE="2")
    r = subprocess.run([sys.executable, "-m", "gpusnap.gpu.driver", "--resume", "1"], env=e,
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    res = json.loads(r.stdout)
    assert res["before"] == "checkpointed" and "cuCheckpointProcessRestore" in res["error"]
