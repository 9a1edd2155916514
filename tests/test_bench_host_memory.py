"""scripts/host_memory.py: the benchmark holds the VM's free page reporting off for its run and
puts the kernel's setting back, whatever happens in between. (The kernel's parameters are read
from a directory of their own here, so the suite never changes this machine's setting.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import host_memory  # noqa: E402


def _params(tmp_path: Path, order: str = "9") -> Path:
    (tmp_path / "page_reporting_order").write_text(order + "\n")
    (tmp_path / "reported_kib").write_text("1000\n")
    return tmp_path


def test_reporting_is_held_off_during_the_run_and_put_back(tmp_path):
    params = _params(tmp_path)
    with host_memory.HostBacked(params=params, warm=64 << 20) as held:
        assert (params / "page_reporting_order").read_text().strip() == "11"
        (params / "reported_kib").write_text(str(1000 + 3 * 1024) + "\n")
    assert (params / "page_reporting_order").read_text().strip() == "9"
    assert held.summary["page_reporting"] == "held off for the run (order 9 -> 11)"
    assert held.summary["faulted_in_gib"] == 0.1          # 64 MiB, rounded
    assert held.summary["reported_during_run_mib"] == 3   # what the host still took back


def test_the_setting_is_put_back_when_the_run_fails(tmp_path):
    params = _params(tmp_path, "7")
    with pytest.raises(RuntimeError):
        with host_memory.HostBacked(params=params, warm=0):
            raise RuntimeError("a dump failed")
    assert (params / "page_reporting_order").read_text().strip() == "7"


def test_without_page_reporting_nothing_is_touched(tmp_path):
    with host_memory.HostBacked(params=tmp_path / "absent", warm=64 << 20) as held:
        pass
    assert held.summary == {"page_reporting": "none (memory stays backed)"}
    assert not (tmp_path / "absent").exists()


def test_fault_in_touches_what_it_is_asked_for():
    assert host_memory.fault_in(3 << 20) == 3 << 20
    assert host_memory.fault_in(0) == 0


def test_the_setting_is_put_back_when_the_benchmark_is_terminated(tmp_path):
    """`timeout` or `kill` sends SIGTERM: the run unwinds and the order is put back."""
    import signal
    import subprocess
    import time

    params = _params(tmp_path)
    code = ("import sys, time; sys.path.insert(0, %r); import host_memory\n"
            "with host_memory.HostBacked(params=__import__('pathlib').Path(%r), warm=0):\n"
            "    print('in', flush=True); time.sleep(60)\n") % (str(ROOT / "scripts"), str(params))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "in"
    assert (params / "page_reporting_order").read_text().strip() == "11"
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM and time.monotonic() - t < 30
    assert (params / "page_reporting_order").read_text().strip() == "9"
