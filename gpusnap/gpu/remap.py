"""Which GPU each of a snapshot's GPUs becomes at restore time (pure functions).

    gpusnap restore DIR --gpu-map OLD=NEW[,OLD=NEW...]

OLD names a GPU of the snapshot, NEW a GPU of this machine, each by index (as nvidia-smi
numbers them: PCI bus order), by UUID ('GPU-…', or a unique prefix of one) or by PCI bus id.
The result is a list of (old_uuid, new_uuid) pairs that gpusnap hands to the CUDA plugin as

    GPUSNAP_GPU_MAP="GPU-old=GPU-new,GPU-old2=GPU-new2"

and the plugin to cuCheckpointProcessRestore as gpuPairs. When the pairs are not all
identities the list covers *every* GPU the snapshot's processes used (identity pairs
included), so the driver always gets a complete, one-to-one mapping.

Each process also gets its own pairs, for the GPUs it used (GPUSNAP_GPU_MAP_<pid>; the
per-process facts come from NVML's compute processes when nvidia-smi could tell at dump
time, else from the /dev/nvidiaN files it held). Moving a process to other GPUs needs the
driver's restore-time remapping, which came with r580: an older driver is refused with
a message saying so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from gpusnap.errors import GpuMismatch, UsageError

GPU_MAP_ENV = "GPUSNAP_GPU_MAP"
# cuCheckpointProcessRestore honours gpuPairs from this driver branch on
MIN_REMAP_DRIVER = 580
_UUID_BODY = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

Pair = tuple[str, str]


# ---------------------------------------------------------------- parsing

def parse_gpu_map(spec: str | Iterable[str] | None) -> list[Pair]:
    """'0=1,GPU-ab…=GPU-cd…' (or several such strings) → [('0','1'), ('GPU-ab…','GPU-cd…')].

    Tokens are not resolved here. Raises UsageError on bad syntax or a GPU mapped twice.
    """
    if spec is None:
        return []
    specs = [spec] if isinstance(spec, str) else list(spec)
    pairs: list[Pair] = []
    for s in specs:
        for item in re.split(r"[,\s]+", s.strip()):
            if not item:
                continue
            if item.count("=") != 1:
                raise UsageError(f"bad --gpu-map entry {item!r}: expected OLD=NEW",
                                 hint="e.g. --gpu-map 0=1 or --gpu-map GPU-1a2b…=GPU-3c4d…; "
                                      "several pairs separated by commas")
            old, new = (x.strip() for x in item.split("="))
            if not old or not new:
                raise UsageError(f"bad --gpu-map entry {item!r}: OLD and NEW must both be given")
            if old.upper().startswith("MIG-") or new.upper().startswith("MIG-"):
                raise UsageError(f"--gpu-map {item}: MIG instances cannot be checkpointed "
                                 "(CUDA checkpoint does not support MIG)")
            pairs.append((old, new))
    olds = [o for o, _ in pairs]
    dup = sorted({o for o in olds if olds.count(o) > 1})
    if dup:
        raise UsageError(f"--gpu-map names {', '.join(dup)} more than once")
    return pairs


def format_gpu_map_env(pairs: Sequence[Pair]) -> str:
    """[(old, new), …] → 'GPU-old=GPU-new,…' (the value of $GPUSNAP_GPU_MAP)."""
    return ",".join(f"{o}={n}" for o, n in pairs)


def parse_gpu_map_env(value: str | None) -> list[Pair]:
    """The inverse of format_gpu_map_env."""
    if not value:
        return []
    return [tuple(x.split("=", 1)) for x in value.split(",") if x]  # type: ignore[misc]


def _canon_uuid(tok: str) -> str:
    t = tok.strip().lower()
    if t.startswith("gpu-"):
        t = t[4:]
    return "GPU-" + t


def _norm_bus(tok: str) -> str:
    parts = tok.strip().lower().split(":")
    if len(parts) == 3:
        return f"{parts[0][-4:].rjust(4, '0')}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"0000:{parts[0]}:{parts[1]}"
    return tok.strip().lower()


def _describe(g: dict[str, Any]) -> str:
    idx = g.get("index")
    name = g.get("name") or "unknown GPU"
    return f"{'#' + str(idx) + ' ' if idx is not None else ''}{name} ({g.get('uuid')})"


def _list(gpus: Sequence[dict[str, Any]]) -> str:
    return "; ".join(_describe(g) for g in gpus) if gpus else "none"


def resolve_gpu(token: str, gpus: Sequence[dict[str, Any]], where: str) -> dict[str, Any]:
    """Find the GPU `token` names among `gpus` (index, UUID or unique UUID prefix, bus id).

    Raises UsageError naming the GPUs there are when it matches none or several.
    """
    tok = token.strip()
    if tok.isdigit():
        hits = [g for g in gpus if g.get("index") is not None and int(g["index"]) == int(tok)]
    elif ":" in tok:
        hits = [g for g in gpus if g.get("pci_bus_id") and _norm_bus(g["pci_bus_id"]) == _norm_bus(tok)]
    else:
        want = _canon_uuid(tok).lower()
        exact = [g for g in gpus if g.get("uuid") and g["uuid"].lower() == want]
        hits = exact or [g for g in gpus if g.get("uuid") and g["uuid"].lower().startswith(want)
                         and len(want) >= len("GPU-") + 4]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise UsageError(f"--gpu-map: {tok!r} is not a GPU of {where}",
                         hint=f"GPUs of {where}: {_list(gpus)}")
    raise UsageError(f"--gpu-map: {tok!r} matches several GPUs of {where}: {_list(hits)}",
                     hint="give more of the UUID")


# ---------------------------------------------------------------- the plan

@dataclass
class GpuRestorePlan:
    pairs: list[Pair] = field(default_factory=list)   # for $GPUSNAP_GPU_MAP; [] = no remap
    used: list[str] = field(default_factory=list)     # UUIDs the snapshot's processes used
    warnings: list[str] = field(default_factory=list)
    per_process: dict[int, list[Pair]] = field(default_factory=dict)  # pid -> its own pairs

    @property
    def env_value(self) -> str:
        return format_gpu_map_env(self.pairs)

    def env(self) -> dict[str, str]:
        """Environment to add to CRIU's for the plugin ({} when nothing is remapped):
        GPUSNAP_GPU_MAP for every process, GPUSNAP_GPU_MAP_<pid> for those whose GPUs are known."""
        if not self.pairs:
            return {}
        out = {GPU_MAP_ENV: self.env_value}
        out.update({f"{GPU_MAP_ENV}_{pid}": format_gpu_map_env(p) for pid, p in self.per_process.items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"pairs": [list(p) for p in self.pairs], "used": self.used,
                "warnings": self.warnings, "env": self.env()}


def _recorded_gpus(recorded: dict[str, Any]) -> list[dict[str, Any]]:
    gpus = recorded.get("gpus")
    if gpus is None and isinstance(recorded.get("driver"), dict):
        gpus = recorded["driver"].get("gpus")
    return list(gpus or [])


def _recorded_procs(recorded: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Per-process entries as [{pid, gpus, device_files?}], from either recorded shape:
    a list of dicts (gpu_manifest()) or a {pid: [uuid, ...]} mapping (process_gpus())."""
    procs = recorded.get("processes")
    if procs is None:
        return None
    if isinstance(procs, dict):
        return [{"pid": int(k), "gpus": list(v or [])} for k, v in procs.items()]
    return [p for p in procs if isinstance(p, dict)]


def used_gpus(recorded: dict[str, Any] | None,
              cuda_pids: Iterable[int] = ()) -> tuple[list[dict[str, Any]], int]:
    """(the recorded GPUs the snapshot's processes used, in index order; the number of CUDA
    processes). `recorded` is gpu_manifest()'s shape ({driver, gpus, processes: [...]}) or
    {driver: driver_info(), processes: {pid: [uuid]}}; `cuda_pids` are processes the plugin
    reported as CUDA processes at dump time (they count even when no GPU was recorded)."""
    cuda = {int(p) for p in cuda_pids or ()}
    if not recorded:
        return [], len(cuda)
    gpus = _recorded_gpus(recorded)
    by_uuid = {g.get("uuid"): g for g in gpus}
    procs = _recorded_procs(recorded)
    if procs is None:  # no per-process list: trust the 'used' flags
        used_ids = [g["uuid"] for g in gpus if g.get("used")]
        nproc = max(1 if used_ids else 0, len(cuda))
    else:
        used_ids = []
        for p in procs:
            for u in p.get("gpus") or []:
                if u not in used_ids:
                    used_ids.append(u)
        holders = {int(p["pid"]) for p in procs if p.get("gpus") or p.get("device_files")}
        nproc = len(holders | cuda)
    out = [by_uuid.get(u) or {"uuid": u, "index": None, "name": None} for u in used_ids]
    out.sort(key=lambda g: (g.get("index") is None, g.get("index") or 0, g.get("uuid") or ""))
    return out, nproc


def plan_gpu_restore(recorded: dict[str, Any] | None, current: dict[str, Any] | None,
                     gpu_map: str | Iterable[str] | Sequence[Pair] | None = None, *,
                     strict_kind: bool = True, cuda_pids: Iterable[int] = ()) -> GpuRestorePlan:
    """Decide the GPU pairs for a restore, or refuse with GpuMismatch.

    recorded: the snapshot's GPU section (gpu_manifest()); None/{} for a CPU-only snapshot.
    current:  driver_info() of this machine, None without a driver.
    gpu_map:  the --gpu-map value(s), or already parsed pairs.
    strict_kind: refuse to move a process onto a GPU of another model.
    cuda_pids: processes the plugin checkpointed at dump time (the manifest's cuda_pids).
    """
    if gpu_map is None or isinstance(gpu_map, str):
        raw = parse_gpu_map(gpu_map)
    else:
        items = list(gpu_map)
        raw = parse_gpu_map(items) if all(isinstance(x, str) for x in items) else \
            parse_gpu_map([f"{o}={n}" for o, n in items])
    used, nproc = used_gpus(recorded, cuda_pids)
    plan = GpuRestorePlan(used=[g["uuid"] for g in used])
    if not used and not nproc:
        if raw:
            plan.warnings.append("the snapshot's processes used no GPU; --gpu-map ignored")
        return plan

    what = f"the snapshot has {nproc} CUDA process(es)" + (
        f" using {len(used)} GPU(s): {_list(used)}" if used else "")
    if not current:
        raise GpuMismatch(f"{what}, but this machine has no NVIDIA driver",
                          hint="restore it on a machine with an NVIDIA driver (r570 or newer) "
                               "and GPUs of the same kind")
    cur = list(current.get("gpus") or [])
    if not current.get("checkpoint_api", True):
        raise GpuMismatch(f"{what}, but this machine's NVIDIA driver "
                          f"({current.get('driver_version') or current.get('cuda_version') or '?'}) "
                          "has no CUDA checkpoint API",
                          hint="update the NVIDIA driver to r570 (CUDA 12.8) or newer")
    if not cur:
        raise GpuMismatch(f"{what}, but the NVIDIA driver here reports no GPU",
                          hint="check nvidia-smi; restore on a machine with the same GPUs")

    recorded_gpus = _recorded_gpus(recorded or {}) or used
    used_uuids = {g["uuid"] for g in used}
    cur_by_uuid = {g["uuid"]: g for g in cur}

    mapping: dict[str, dict[str, Any]] = {}  # old uuid -> current gpu
    explicit: set[str] = set()
    for old_tok, new_tok in raw:
        old = resolve_gpu(old_tok, recorded_gpus, "the snapshot")
        new = resolve_gpu(new_tok, cur, "this machine")
        if old["uuid"] not in used_uuids:
            plan.warnings.append(f"--gpu-map {old_tok}={new_tok}: the snapshot's processes "
                                 f"did not use {_describe(old)}; ignored")
            continue
        mapping[old["uuid"]] = new
        explicit.add(old["uuid"])

    missing = []
    for g in used:
        if g["uuid"] in mapping:
            continue
        if g["uuid"] in cur_by_uuid:
            mapping[g["uuid"]] = cur_by_uuid[g["uuid"]]
        else:
            missing.append(g)

    if missing:
        taken = {m["uuid"] for m in mapping.values()}
        free = [g for g in cur if g["uuid"] not in taken]
        suggestion = []
        for g in missing:
            cand = next((c for c in free if not g.get("name") or c.get("name") == g.get("name")), None)
            if cand is None:
                suggestion = []
                break
            free.remove(cand)
            suggestion.append(f"{g.get('index') if g.get('index') is not None else g['uuid']}="
                              f"{cand.get('index')}")
        hint = (f"map them onto GPUs of this machine, e.g. --gpu-map {','.join(suggestion)}"
                if suggestion else f"this machine has: {_list(cur)}; map the missing GPUs with "
                                   "--gpu-map OLD=NEW (index or UUID)")
        raise GpuMismatch(f"the snapshot's GPU(s) {_list(missing)} are not on this machine "
                          f"and no --gpu-map says where they go", hint=hint)

    targets: dict[str, str] = {}
    for old_uuid, new in mapping.items():
        if new["uuid"] in targets:
            other = targets[new["uuid"]]
            implicit = [u for u in (other, old_uuid) if u not in explicit]
            hint = (f"{implicit[0]} is here and stays where it was unless you map it too "
                    "(e.g. swap two GPUs: --gpu-map 0=1,1=0)" if implicit
                    else "each of the snapshot's GPUs needs a GPU of its own")
            raise GpuMismatch(f"two of the snapshot's GPUs ({other} and {old_uuid}) would both "
                              f"land on {_describe(new)}", hint=hint)
        targets[new["uuid"]] = old_uuid

    if strict_kind:
        rec_by_uuid = {g["uuid"]: g for g in recorded_gpus} | {g["uuid"]: g for g in used}
        for old_uuid, new in mapping.items():
            a, b = rec_by_uuid.get(old_uuid, {}).get("name"), new.get("name")
            if a and b and a != b:
                raise GpuMismatch(f"{old_uuid} was a {a}, but {new['uuid']} is a {b}: a CUDA "
                                  "restore needs the same kind of GPU",
                                  hint="restore on a machine with the same GPU model")

    ordered = [(g["uuid"], mapping[g["uuid"]]["uuid"]) for g in used]
    if any(o != n for o, n in ordered):
        _check_remap_driver(current, ordered)
        plan.pairs = ordered
        for p in _recorded_procs(recorded or {}) or []:
            mine = [(o, n) for o, n in ordered if o in (p.get("gpus") or [])]
            if mine and str(p.get("pid", "")).isdigit():
                plan.per_process[int(p["pid"])] = mine
    return plan


def driver_branch(info: dict[str, Any] | None) -> int | None:
    """570 for driver 570.133.20; from the CUDA version (13.0 came with r580) when the
    module's version is unknown; None when neither is known."""
    v = str((info or {}).get("driver_version") or "")
    if v.split(".")[0].isdigit():
        return int(v.split(".")[0])
    cv = str((info or {}).get("cuda_version") or "")
    try:
        major, minor = (int(x) for x in cv.split(".")[:2])
    except ValueError:
        return None
    return 580 if (major, minor) >= (13, 0) else 570 if (major, minor) >= (12, 8) else 0


def _check_remap_driver(current: dict[str, Any] | None, pairs: list[Pair]) -> None:
    branch = driver_branch(current)
    if branch is not None and branch < MIN_REMAP_DRIVER:
        moved = ", ".join(f"{o} -> {n}" for o, n in pairs if o != n)
        raise GpuMismatch(
            f"the restore would move GPU state ({moved}), but this machine's NVIDIA driver "
            f"({(current or {}).get('driver_version') or (current or {}).get('cuda_version')}) cannot remap "
            f"GPUs on restore: that needs r{MIN_REMAP_DRIVER} or newer",
            hint=f"update the driver to r{MIN_REMAP_DRIVER}+ (CUDA 13.0), or restore where the snapshot's "
                 "GPUs are (same UUIDs) without --gpu-map")


def check_restore_compat(recorded: dict[str, Any] | None, current: dict[str, Any] | None,
                         gpu_map: str | Iterable[str] | Sequence[Pair] | None = None, *,
                         strict_kind: bool = True, cuda_pids: Iterable[int] = ()) -> list[Pair]:
    """The (old_uuid, new_uuid) pairs for $GPUSNAP_GPU_MAP ([] when no GPU moves).

    Raises GpuMismatch when the snapshot's GPUs are not all here and not remapped, when GPUs
    would collide, differ in kind, or when this machine has no driver (or no checkpoint API)
    but the snapshot has CUDA processes; UsageError for a malformed --gpu-map.
    """
    return plan_gpu_restore(recorded, current, gpu_map, strict_kind=strict_kind,
                            cuda_pids=cuda_pids).pairs


def is_uuid(tok: str) -> bool:
    return bool(_UUID_BODY.match(_canon_uuid(tok)[4:]))
