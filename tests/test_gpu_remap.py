"""gpusnap.gpu.remap: --gpu-map parsing and restore compatibility (pure logic)."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusnap.errors import GpuMismatch, UsageError
from gpusnap.gpu.remap import GPU_MAP_ENV, check_restore_compat, format_gpu_map_env, is_uuid, parse_gpu_map, parse_gpu_map_env, plan_gpu_restore, resolve_gpu, used_gpus


def U(n: int) -> str:
    return f"GPU-{n:08x}-0000-0000-0000-{n:012x}"


def gpu(i: int, uid: int, name: str = "NVIDIA H200", bus: str | None = None) -> dict:
    return {"index": i, "uuid": U(uid), "name": name, "memory_bytes": 150 << 30,
            "pci_bus_id": bus or f"0000:{0x19 + i:02x}:00.0"}


def machine(*gpus: dict, checkpoint_api: bool = True, driver: str = "580.65.06") -> dict:
    cuda = "13.0" if driver.startswith("58") else "12.8"
    return {"driver_version": driver, "cuda_version": cuda,
            "checkpoint_api": checkpoint_api, "gpus": list(gpus)}


def recorded(gpus: list[dict], procs: list[list[int]]) -> dict:
    """A snapshot's GPU section: the machine's GPUs, and per process the UUIDs it used."""
    used = {U(u) for p in procs for u in p}
    return {"driver": machine(*gpus),
            "gpus": [g | {"used": g["uuid"] in used} for g in gpus],
            "processes": [{"pid": 100 + i, "comm": "python", "gpus": [U(u) for u in p],
                           "device_files": ["/dev/nvidiactl"] + [f"/dev/nvidia{u}" for u in p]}
                          for i, p in enumerate(procs)]}


OLD2 = [gpu(0, 0xA0), gpu(1, 0xA1)]          # snapshot machine: two H200s
NEW2 = [gpu(0, 0xB0), gpu(1, 0xB1)]          # another machine: two other H200s


# ---------------------------------------------------------------- parse

def test_parse_empty():
    assert parse_gpu_map(None) == [] and parse_gpu_map("") == [] and parse_gpu_map([]) == []


def test_parse_pairs_and_lists():
    assert parse_gpu_map("0=1") == [("0", "1")]
    assert parse_gpu_map(" 0=1, 1=0 ") == [("0", "1"), ("1", "0")]
    assert parse_gpu_map(["0=1", f"{U(1)}={U(2)}"]) == [("0", "1"), (U(1), U(2))]
    assert parse_gpu_map("0=1,,") == [("0", "1")]


@pytest.mark.parametrize("bad", ["0", "0=", "=1", "0=1=2", "0:1", "0=1,2", "MIG-abc=0"])
def test_parse_rejects(bad):
    with pytest.raises(UsageError) as e:
        parse_gpu_map(bad)
    assert e.value.exit_code == 2


def test_parse_rejects_duplicate_old():
    with pytest.raises(UsageError, match="more than once"):
        parse_gpu_map("0=1,0=2")


def test_env_format_roundtrip():
    pairs = [(U(1), U(2)), (U(2), U(1))]
    v = format_gpu_map_env(pairs)
    assert v == f"{U(1)}={U(2)},{U(2)}={U(1)}"
    assert parse_gpu_map_env(v) == pairs
    assert parse_gpu_map_env("") == [] and parse_gpu_map_env(None) == []
    assert GPU_MAP_ENV == "GPUSNAP_GPU_MAP"


def test_is_uuid():
    assert is_uuid(U(5)) and is_uuid(U(5)[4:]) and not is_uuid("0") and not is_uuid("GPU-12")


# ---------------------------------------------------------------- resolve

def test_resolve_by_index_uuid_prefix_bus():
    assert resolve_gpu("1", NEW2, "x")["uuid"] == U(0xB1)
    assert resolve_gpu(U(0xB0), NEW2, "x")["uuid"] == U(0xB0)
    assert resolve_gpu(U(0xB0).upper().replace("GPU-", "gpu-"), NEW2, "x")["uuid"] == U(0xB0)
    assert resolve_gpu(U(0xB0)[4:], NEW2, "x")["uuid"] == U(0xB0)      # without 'GPU-'
    assert resolve_gpu("GPU-000000b1", NEW2, "x")["uuid"] == U(0xB1)   # unique prefix
    assert resolve_gpu("0000:1a:00.0", NEW2, "x")["uuid"] == U(0xB1)   # bus id
    assert resolve_gpu("00000000:1A:00.0", NEW2, "x")["uuid"] == U(0xB1)
    assert resolve_gpu("1a:00.0", NEW2, "x")["uuid"] == U(0xB1)


def test_resolve_errors_name_the_gpus():
    with pytest.raises(UsageError, match="not a GPU of this machine") as e:
        resolve_gpu("7", NEW2, "this machine")
    assert U(0xB0) in e.value.hint
    with pytest.raises(UsageError, match="several"):
        resolve_gpu("GPU-0000", NEW2, "x")
    with pytest.raises(UsageError):  # too short a prefix matches nothing on purpose
        resolve_gpu("GPU-", NEW2, "x")


# ---------------------------------------------------------------- compat: no GPU involved

def test_cpu_only_snapshot_needs_nothing():
    assert check_restore_compat(None, None) == []
    assert check_restore_compat({}, None) == []
    rec = recorded(OLD2, [[]])
    rec["processes"] = []
    assert check_restore_compat(rec, None) == []
    assert check_restore_compat(rec, machine(*NEW2)) == []


def test_gpu_map_on_cpu_snapshot_is_ignored_with_a_warning():
    plan = plan_gpu_restore(recorded(OLD2, []), machine(*NEW2), "0=1")
    assert plan.pairs == [] and plan.env() == {} and "ignored" in plan.warnings[0]


# ---------------------------------------------------------------- compat: same machine

def test_same_gpus_no_pairs():
    rec = recorded(OLD2, [[0xA0], [0xA1]])
    assert check_restore_compat(rec, machine(*OLD2)) == []


def test_gpus_renumbered_but_present_no_pairs():
    # same UUIDs, other indices (e.g. a card moved slot): UUIDs are what count
    cur = [gpu(0, 0xA1), gpu(1, 0xA0)]
    assert check_restore_compat(recorded(OLD2, [[0xA0, 0xA1]]), machine(*cur)) == []


def test_identity_map_is_no_pairs():
    rec = recorded(OLD2, [[0xA0]])
    assert check_restore_compat(rec, machine(*OLD2), "0=0") == []


def test_swap_on_same_machine():
    rec = recorded(OLD2, [[0xA0], [0xA1]])
    pairs = check_restore_compat(rec, machine(*OLD2), "0=1,1=0")
    assert pairs == [(U(0xA0), U(0xA1)), (U(0xA1), U(0xA0))]


def test_moving_onto_a_gpu_in_use_by_the_snapshot_needs_both_mapped():
    rec = recorded(OLD2, [[0xA0], [0xA1]])
    with pytest.raises(GpuMismatch, match="both") as e:
        check_restore_compat(rec, machine(*OLD2), "0=1")
    assert "swap" in e.value.hint and e.value.exit_code == 13


def test_moving_to_an_unused_gpu_on_same_machine():
    rec = recorded(OLD2, [[0xA0]])
    assert check_restore_compat(rec, machine(*OLD2), "0=1") == [(U(0xA0), U(0xA1))]


# ---------------------------------------------------------------- compat: other machine

def test_other_machine_refused_without_map_and_hint_suggests_one():
    rec = recorded(OLD2, [[0xA0], [0xA1]])
    with pytest.raises(GpuMismatch, match="not on this machine") as e:
        check_restore_compat(rec, machine(*NEW2))
    assert U(0xA0) in e.value.message and U(0xA1) in e.value.message
    assert "--gpu-map 0=0,1=1" in e.value.hint


def test_other_machine_suggested_map_works():
    rec = recorded(OLD2, [[0xA0], [0xA1]])
    pairs = check_restore_compat(rec, machine(*NEW2), "0=0,1=1")
    assert pairs == [(U(0xA0), U(0xB0)), (U(0xA1), U(0xB1))]


def test_other_machine_by_uuid_and_partial_usage():
    rec = recorded(OLD2, [[0xA1]])          # only GPU 1 was used
    pairs = check_restore_compat(rec, machine(*NEW2), [f"{U(0xA1)}={U(0xB0)}"])
    assert pairs == [(U(0xA1), U(0xB0))]


def test_map_given_as_pairs():
    rec = recorded(OLD2, [[0xA1]])
    assert check_restore_compat(rec, machine(*NEW2), [("1", "0")]) == [(U(0xA1), U(0xB0))]


def test_partial_map_still_refuses_the_rest():
    rec = recorded(OLD2, [[0xA0, 0xA1]])
    with pytest.raises(GpuMismatch) as e:
        check_restore_compat(rec, machine(*NEW2), "0=0")
    assert U(0xA1) in e.value.message and U(0xA0) not in e.value.message
    assert "1=1" in e.value.hint


def test_map_covers_everything_when_one_gpu_moves():
    # A0 stays (present here), A1 moves to new C0: the plugin gets a complete mapping
    cur = [gpu(0, 0xA0), gpu(1, 0xC0)]
    rec = recorded(OLD2, [[0xA0, 0xA1]])
    assert check_restore_compat(rec, machine(*cur), "1=1") == [(U(0xA0), U(0xA0)), (U(0xA1), U(0xC0))]


def test_two_olds_onto_one_new_refused():
    rec = recorded(OLD2, [[0xA0, 0xA1]])
    with pytest.raises(GpuMismatch, match="both") as e:
        check_restore_compat(rec, machine(*NEW2), "0=0,1=0")
    assert "own" in e.value.hint


def test_fewer_gpus_here_refused_no_suggestion():
    rec = recorded(OLD2, [[0xA0, 0xA1]])
    with pytest.raises(GpuMismatch) as e:
        check_restore_compat(rec, machine(gpu(0, 0xB0)))
    assert "this machine has" in e.value.hint


def test_unknown_old_or_new_is_a_usage_error():
    rec = recorded(OLD2, [[0xA0]])
    with pytest.raises(UsageError, match="the snapshot"):
        check_restore_compat(rec, machine(*NEW2), "5=0")
    with pytest.raises(UsageError, match="this machine"):
        check_restore_compat(rec, machine(*NEW2), "0=5")


def test_map_of_an_unused_gpu_is_ignored_with_warning():
    rec = recorded(OLD2, [[0xA0]])
    plan = plan_gpu_restore(rec, machine(*NEW2), "0=1,1=0")
    assert plan.pairs == [(U(0xA0), U(0xB1))]
    assert any("did not use" in w for w in plan.warnings)
    assert plan.env() == {"GPUSNAP_GPU_MAP": f"{U(0xA0)}={U(0xB1)}",
                          "GPUSNAP_GPU_MAP_100": f"{U(0xA0)}={U(0xB1)}"}
    assert plan.to_dict()["pairs"] == [[U(0xA0), U(0xB1)]]


def test_other_kind_refused_unless_not_strict():
    rec = recorded(OLD2, [[0xA0]])
    cur = machine(gpu(0, 0xB0, name="NVIDIA A100-SXM4-80GB"))
    with pytest.raises(GpuMismatch, match="same kind"):
        check_restore_compat(rec, cur, "0=0")
    assert check_restore_compat(rec, cur, "0=0", strict_kind=False) == [(U(0xA0), U(0xB0))]


# ---------------------------------------------------------------- compat: no driver here

def test_no_driver_with_cuda_processes_refused():
    with pytest.raises(GpuMismatch, match="no NVIDIA driver") as e:
        check_restore_compat(recorded(OLD2, [[0xA0]]), None)
    assert "1 CUDA process" in e.value.message and e.value.hint


def test_cuda_process_without_gpu_device_still_needs_a_driver():
    # holds /dev/nvidiactl only (cuInit done, no device opened): still a CUDA process
    rec = recorded(OLD2, [[]])
    rec["processes"][0]["device_files"] = ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    with pytest.raises(GpuMismatch, match="no NVIDIA driver"):
        check_restore_compat(rec, None)
    assert check_restore_compat(rec, machine(*NEW2)) == []


def test_driver_without_checkpoint_api_refused():
    with pytest.raises(GpuMismatch, match="no CUDA checkpoint API") as e:
        check_restore_compat(recorded(OLD2, [[0xA0]]), machine(*OLD2, checkpoint_api=False))
    assert "r570" in e.value.hint


def test_driver_without_gpus_refused():
    with pytest.raises(GpuMismatch, match="no GPU"):
        check_restore_compat(recorded(OLD2, [[0xA0]]), machine())


def test_malformed_map_wins_over_everything():
    with pytest.raises(UsageError):
        check_restore_compat(None, None, "garbage")


# ---------------------------------------------------------------- recorded shapes

def test_used_gpus_from_processes_and_flags():
    rec = recorded(OLD2, [[0xA1], [0xA1, 0xA0]])
    used, n = used_gpus(rec)
    assert [g["uuid"] for g in used] == [U(0xA0), U(0xA1)] and n == 2
    flags_only = {"gpus": [OLD2[0] | {"used": False}, OLD2[1] | {"used": True}]}
    used, n = used_gpus(flags_only)
    assert [g["uuid"] for g in used] == [U(0xA1)] and n == 1
    assert used_gpus(None) == ([], 0)


def test_used_gpu_missing_from_recorded_list_still_checked():
    rec = {"gpus": [], "processes": [{"pid": 1, "gpus": [U(0xA0)], "device_files": ["/dev/nvidia0"]}]}
    with pytest.raises(GpuMismatch):
        check_restore_compat(rec, machine(*NEW2))
    assert check_restore_compat(rec, machine(*NEW2), f"{U(0xA0)}=1") == [(U(0xA0), U(0xB1))]


# ---------------------------------------------------------------- properties

@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 6), data=st.data())
def test_any_permutation_onto_a_new_machine_is_a_bijection(n, data):
    old = [gpu(i, 0x100 + i) for i in range(n)]
    new = [gpu(i, 0x200 + i) for i in range(n)]
    perm = data.draw(st.permutations(range(n)))
    used = data.draw(st.lists(st.integers(0, n - 1), min_size=1, unique=True))
    rec = recorded(old, [[0x100 + u for u in used]])
    spec = ",".join(f"{i}={perm[i]}" for i in range(n))
    pairs = check_restore_compat(rec, machine(*new), spec)
    assert sorted(o for o, _ in pairs) == sorted(U(0x100 + u) for u in used)
    assert len({nn for _, nn in pairs}) == len(pairs)
    assert all(nn == U(0x200 + perm[int(o[4:12], 16) - 0x100]) for o, nn in pairs)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 5), data=st.data())
def test_permutation_on_same_machine_pairs_or_nothing(n, data):
    gpus = [gpu(i, 0x100 + i) for i in range(n)]
    perm = data.draw(st.permutations(range(n)))
    rec = recorded(gpus, [[0x100 + i for i in range(n)]])   # all GPUs used
    pairs = check_restore_compat(rec, machine(*gpus), ",".join(f"{i}={perm[i]}" for i in range(n)))
    if list(perm) == list(range(n)):
        assert pairs == []
    else:
        assert len(pairs) == n and {p[1] for p in pairs} == {g["uuid"] for g in gpus}


def _expected_outcome(olds, news) -> tuple[str, str]:
    """What a map of the snapshot's two GPUs onto this machine's two must give, worked out
    independently of remap.py: (outcome, what the message says)."""
    for o, n in zip(olds, news):                          # each pair, in the order given
        if o not in ("0", "1"):
            return "UsageError", f"{o!r} is not a GPU of the snapshot"
        if n not in ("0", "1"):
            return "UsageError", f"{n!r} is not a GPU of this machine"
    if len(set(news)) < len(news):
        return "GpuMismatch", "two of the snapshot's GPUs"
    if len(olds) < 2:                                     # a GPU of the snapshot left unmapped
        return "GpuMismatch", "the snapshot's GPU(s) #"
    return "ok", ""


def test_exhaustive_small_maps_never_crash():
    """Every map over 2+2 GPUs either yields a bijection or the refusal it must give (the
    exception class and its reason), nothing else; each kind of outcome is met."""
    rec = recorded(OLD2, [[0xA0, 0xA1]])
    toks = ["0", "1", "2"]
    seen = {"ok": 0, "UsageError": 0, "GpuMismatch": 0}
    for k in range(3):
        for olds in itertools.permutations(toks, k):
            for news in itertools.product(toks, repeat=k):
                spec = ",".join(f"{o}={n}" for o, n in zip(olds, news))
                want, says = _expected_outcome(olds, news)
                seen[want] += 1
                if want == "ok":
                    pairs = check_restore_compat(rec, machine(*NEW2), spec)
                    assert len({n for _, n in pairs}) == len(pairs) == 2, spec
                    assert dict(pairs) == {U(0xA0 + int(o)): U(0xB0 + int(n)) for o, n in zip(olds, news)}, spec
                else:
                    with pytest.raises(GpuMismatch if want == "GpuMismatch" else UsageError, match=re.escape(says)):
                        check_restore_compat(rec, machine(*NEW2), spec)
    assert seen == {"ok": 4, "UsageError": 51, "GpuMismatch": 9}, seen


# ---------------------------------------------------------------- the dump's other recorded shape

def test_process_gpus_mapping_shape():
    """{driver: driver_info(), processes: {pid: [uuid]}} as gpusnap.ops.dump records it (JSON keys)."""
    rec = {"driver": machine(*OLD2), "processes": {"101": [U(0xA1)], "102": []}}
    assert check_restore_compat(rec, machine(*OLD2)) == []
    with pytest.raises(GpuMismatch, match="not on this machine") as e:
        check_restore_compat(rec, machine(*NEW2))
    assert "--gpu-map 1=0" in e.value.hint
    assert check_restore_compat(rec, machine(*NEW2), "1=0") == [(U(0xA1), U(0xB0))]
    with pytest.raises(GpuMismatch, match="1 CUDA process.*no NVIDIA driver"):
        check_restore_compat(rec, None)


def test_cuda_pids_alone_need_a_driver():
    with pytest.raises(GpuMismatch, match="2 CUDA process"):
        check_restore_compat(None, None, cuda_pids=[5, 6])
    assert check_restore_compat(None, machine(*NEW2), cuda_pids=[5]) == []
    rec = {"driver": machine(*OLD2), "processes": {"101": [U(0xA0)]}}
    with pytest.raises(GpuMismatch, match="2 CUDA process"):
        check_restore_compat(rec, None, cuda_pids=[101, 102])


# ---------------------------------------------------------------- per process, driver branch

def test_each_process_gets_its_own_pairs():
    rec = recorded(OLD2, [[0xA0], [0xA1]])
    plan = plan_gpu_restore(rec, machine(*NEW2), "0=0,1=1")
    assert plan.per_process == {100: [(U(0xA0), U(0xB0))], 101: [(U(0xA1), U(0xB1))]}
    env = plan.env()
    assert env["GPUSNAP_GPU_MAP_100"] == f"{U(0xA0)}={U(0xB0)}"
    assert env["GPUSNAP_GPU_MAP_101"] == f"{U(0xA1)}={U(0xB1)}"
    assert env[GPU_MAP_ENV] == f"{U(0xA0)}={U(0xB0)},{U(0xA1)}={U(0xB1)}"


def test_no_remap_no_env():
    rec = recorded(OLD2, [[0xA0], [0xA1]])
    assert plan_gpu_restore(rec, machine(*OLD2)).env() == {}


@pytest.mark.parametrize("drv", ["570.133.20", "575.51.03"])
def test_remap_needs_r580(drv):
    rec = recorded(OLD2, [[0xA0]])
    with pytest.raises(GpuMismatch, match="r580") as e:
        check_restore_compat(rec, machine(*NEW2, driver=drv), "0=0")
    assert drv in e.value.message and "r580" in e.value.hint
    # without a move, an older driver restores as it is
    assert check_restore_compat(rec, machine(*OLD2, driver=drv)) == []


def test_driver_branch_from_cuda_version_when_module_unknown():
    from gpusnap.gpu.remap import driver_branch
    assert driver_branch({"driver_version": None, "cuda_version": "13.0"}) == 580
    assert driver_branch({"driver_version": None, "cuda_version": "12.8"}) == 570
    assert driver_branch({"driver_version": "580.1", "cuda_version": "12.8"}) == 580
    assert driver_branch(None) is None
