"""gpusnap.gpu.procs: finding GPU processes from /proc (real processes, no NVIDIA needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.gpu import procs
from gpusnap.render import machine as render_machine
from gpusnap.render.output import Output
from gpusnap.render.snapshots import recorded_gpus
import plugin_helpers

ROOT = Path(__file__).resolve().parents[1]

INFO = """Model: \t\t NVIDIA H200
IRQ:   \t\t 0
GPU UUID: \t GPU-4f1f0c3e-2b7d-11ef-9a3c-0242ac120002
Video BIOS: \t 96.00.9f.00.01
Bus Type: \t PCIe
DMA Size: \t 52 bits
DMA Mask: \t 0xfffffffffffff
Bus Location: \t 0000:9A:00.0
Device Minor: \t 3
GPU Excluded:\t No
"""


def test_parse_gpu_information():
    assert procs.parse_gpu_information(INFO) == {
        "minor": 3, "uuid": "GPU-4f1f0c3e-2b7d-11ef-9a3c-0242ac120002",
        "name": "NVIDIA H200", "pci_bus_id": "0000:9a:00.0"}
    assert procs.parse_gpu_information("") == {"minor": None, "uuid": None, "name": None,
                                               "pci_bus_id": None}


def test_proc_gpus_reads_a_driver_tree(tmp_path):
    for bus, minor in (("0000:9a:00.0", 1), ("0000:19:00.0", 0)):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(
            INFO.replace("0000:9A:00.0", bus).replace("Minor: \t 3", f"Minor: \t {minor}"))
    gpus = procs.proc_gpus(tmp_path)
    assert [g["minor"] for g in gpus] == [0, 1]
    mg = procs.machine_gpus(None, tmp_path)
    assert [(g["index"], g["minor"], g["pci_bus_id"]) for g in mg] == \
        [(0, 0, "0000:19:00.0"), (1, 1, "0000:9a:00.0")]
    assert procs.proc_gpus(tmp_path / "missing") == []


def test_this_machine_scan_runs():
    found = procs.gpu_processes()
    assert isinstance(found, list)
    assert all(g.pid != os.getpid() for g in found)
    json.dumps([g.to_dict() for g in found])


def test_plain_process_is_not_a_gpu_process():
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert procs.scan_process(p.pid) is None
        assert procs.process_gpus([p.pid]) == {p.pid: []}
        m = procs.gpu_manifest([p.pid])
        assert m["processes"] == [] and isinstance(m["gpus"], list)
        json.dumps(m)
    finally:
        p.kill()
        p.wait()
    assert procs.scan_process(p.pid) is None   # gone


@pytest.fixture()
def libcuda_process():
    """A real process that has a libcuda.so.1 (the fake driver, tests/fake_cuda) mapped."""
    with plugin_helpers.libcuda_process() as p:
        yield p


def test_libcuda_user_is_listed(libcuda_process):
    pid = libcuda_process.pid
    gp = procs.scan_process(pid)
    assert gp is not None and gp.libcuda and not gp.uses_gpu
    assert gp.uid == os.geteuid() and gp.cmdline.startswith(sys.executable)
    assert gp.gpus == [] and not gp.uvm and not gp.nccl
    listed = {g.pid: g for g in procs.gpu_processes()}
    assert pid in listed and listed[pid].state is None   # no driver here / not CUDA-initialised
    m = procs.gpu_manifest([pid, os.getpid()])
    assert [p["pid"] for p in m["processes"]] == [pid]
    assert m["processes"][0]["gpus"] == [] and m["processes"][0]["libcuda"] is True
    assert procs.process_gpus([pid]) == {pid: []}


def test_fd_targets_and_maps_of_self():
    with open(__file__) as f:
        assert any(t == os.path.realpath(__file__) for t in procs.fd_targets(os.getpid()))
        assert f
    assert any("python" in os.path.basename(p) or ".so" in p for p in procs.mapped_paths(os.getpid()))
    assert procs.fd_targets(2 ** 22 + 7) == []


def test_listing_to_dict_and_render():
    from rich.console import Console
    listing = procs.gpu_processes()
    d = listing.to_dict()
    json.dumps(d)
    assert set(d) == {"driver", "processes"}
    con = Console(record=True, width=120)
    render_machine.gpu_processes(listing, Output(out=con))
    assert con.export_text().strip()


def test_describe_and_render_recorded():
    from rich.console import Console
    drv = {"driver_version": "570.1", "cuda_version": "12.8", "checkpoint_api": True,
           "gpus": [{"index": 0, "uuid": "GPU-a", "name": "NVIDIA H200", "memory_bytes": 2 ** 30,
                     "pci_bus_id": "0000:19:00.0"}]}
    d = procs.describe_recorded({"driver": drv, "processes": {"7": ["GPU-a"]}})
    assert d["gpus"][0]["used"] and d["processes"] == [{"pid": 7, "gpus": ["GPU-a"]}]
    assert procs.describe_recorded(None) is None
    con = Console(record=True, width=120)
    recorded_gpus(d, con)
    recorded_gpus(procs.describe_recorded(None), con)
    text = con.export_text()
    assert "GPU-a" in text and "570.1" in text and "CPU-only" in text


def test_parse_compute_apps_sums_each_process_memory_over_its_gpus():
    """nvidia-smi's compute apps (pid, gpu_uuid, used_memory in MiB): a process on two GPUs
    has both UUIDs and the sum of its memory; a hidden figure ([N/A]) leaves it out."""
    text = ("4242, GPU-aaaa-1, 30000\n"
            "4242, GPU-bbbb-2, 1024\n"
            "77, GPU-aaaa-1, [N/A]\n"
            "No running processes found\n"
            "x, GPU-cccc, 5\n")
    gpus, mem = procs.parse_compute_apps(text)
    assert gpus == {4242: ["GPU-aaaa-1", "GPU-bbbb-2"], 77: ["GPU-aaaa-1"]}
    assert mem == {4242: 31024 << 20}
    assert procs.parse_compute_apps("") == ({}, {})
