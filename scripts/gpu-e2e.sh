#!/usr/bin/env bash
# gpusnap end-to-end on a real NVIDIA GPU: a small PyTorch training job is dumped mid-run
# (--exit), restored, dumped again while it runs (incremental), and must finish with the same
# weights as an uninterrupted run. Prints a table; exits non-zero on any failure.
#
# For a lent GPU machine without network (no apt, no pip): CRIU, its libraries, the plugin
# and the Python wheels come from gpu-bundle/, made beforehand by scripts/gpu-bundle.sh.
# PyTorch must be on the machine. Run as root from the repository:
#
#   scripts/gpu-e2e.sh                       # the GPU run
#   GPUSNAP_E2E_DEVICE=cpu scripts/gpu-e2e.sh   # dry run of the same plumbing, no GPU needed
#
# Environment: GPUSNAP_E2E_DEVICE=cuda|cpu, GPUSNAP_E2E_STEPS (600), GPUSNAP_E2E_TIMEOUT (540 s,
# whole run), PYTHON (interpreter with torch), GPUSNAP_BUNDLE (gpu-bundle/), OUT (collect logs),
# GPUSNAP_E2E_BUNDLE_CRIU=1 (use the bundle's CRIU even where a CRIU >= 4 is installed).
# Exit: 0 same weights; 1 weights differ; 2 set-up problem; 3 dump/restore failed; 124 timeout.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

if [ -z "${GPUSNAP_E2E_INNER:-}" ]; then
  # one deadline for everything (timeout kills its whole process group on expiry)
  export GPUSNAP_E2E_INNER=1
  exec timeout -k 20 "${GPUSNAP_E2E_TIMEOUT:-540}" bash "$0" "$@"
fi

DEVICE=${GPUSNAP_E2E_DEVICE:-cuda}
STEPS=${GPUSNAP_E2E_STEPS:-600}
STEP_SLEEP=${GPUSNAP_E2E_STEP_SLEEP:-0.02}
DUMP_AT=$((STEPS * 3 / 10))     # first dump (--exit) at this step
GAP=$((STEPS / 10))             # second, incremental dump: this many steps after the restore
B=${GPUSNAP_BUNDLE:-$here/gpu-bundle}
T0=$(date +%s)

say() { printf '\033[1m[e2e %3ds]\033[0m %s\n' "$(($(date +%s) - T0))" "$*"; }
die() { local rc=$1; shift; printf '\033[31m[e2e] FAILED:\033[0m %s\n' "$*" >&2; exit "$rc"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", b-a}'; }
mib() { awk -v b="${1:-0}" 'BEGIN{ if (b=="" || b=="null") print "-"; else printf "%.1f MiB", b/1048576 }'; }

[ "$(id -u)" = 0 ] || die 2 "run as root (CRIU needs it)"
case "$DEVICE" in cuda|cpu) ;; *) die 2 "GPUSNAP_E2E_DEVICE must be cuda or cpu" ;; esac

work=$(mktemp -d /tmp/gpusnap-e2e.XXXXXX)
repo=$work/repo
logs=$work/logs
mkdir -p "$logs"
touch "$work/.start"
job_pids=()

collect() {
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT/e2e"
  cp -r "$logs/." "$OUT/e2e/" 2>/dev/null || true
  # CRIU's own logs, wherever gpusnap kept them (repository, work directories)
  find "$repo" "$work"/*.log /tmp/gpusnap-* -maxdepth 4 \( -name '*.log' -o -name 'cuda-report' \) \
       -newer "$work/.start" -size -20M 2>/dev/null | while read -r f; do
    dst="$OUT/e2e/criu/$(echo "${f#/}" | tr / _)"
    mkdir -p "$OUT/e2e/criu"; cp "$f" "$dst" 2>/dev/null || true
  done
}
cleanup() {
  local rc=$?
  for p in "${job_pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  collect
  if [ "${GPUSNAP_E2E_KEEP:-0}" = 1 ] || [ "$rc" != 0 ]; then
    say "work directory kept: $work"
  else
    rm -rf "$work"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'say "interrupted (deadline?)"; exit 124' TERM INT

# ---------------------------------------------------------------- the machine, for the record
say "machine: $(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi >"$logs/nvidia-smi.txt" 2>&1 || true
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv >>"$logs/nvidia-smi.txt" 2>&1 || true
  sed -n '1,20p' "$logs/nvidia-smi.txt"
elif [ "$DEVICE" = cuda ]; then
  die 2 "nvidia-smi not found: no NVIDIA driver here (GPUSNAP_E2E_DEVICE=cpu for a dry run)"
fi

# ---------------------------------------------------------------- Python: torch + gpusnap deps
want_torch=$([ "$DEVICE" = cuda ] && echo 1 || echo 0)
PY=
for c in ${PYTHON:-} python3 python3.13 python3.12 python3.11 /opt/conda/bin/python /usr/local/bin/python3; do
  command -v "$c" >/dev/null 2>&1 || continue
  "$c" - "$want_torch" <<'EOF' 2>/dev/null || continue
import sys
assert sys.version_info >= (3, 11)
if sys.argv[1] == "1":
    import torch
    assert torch.cuda.is_available()
EOF
  PY=$(command -v "$c"); break
done
[ -n "$PY" ] || die 2 "no Python >= 3.11$([ "$want_torch" = 1 ] && echo ' with a CUDA-enabled PyTorch') (set PYTHON=...)"
say "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

if [ -d "$B/wheels" ]; then
  venv=$work/venv
  if "$PY" -m venv --system-site-packages --without-pip "$venv" >/dev/null 2>&1; then
    VPY=$venv/bin/python
  else
    say "python -m venv unavailable; using $PY with PYTHONPATH"
    VPY=$PY
  fi
  site=$work/site
  mkdir -p "$site"
  # unpack the wheels that fit this interpreter (no pip, no index: plain zip extraction)
  "$VPY" - "$B/wheels" "$site" <<'EOF'
import os, re, sys, zipfile
wheels, site = sys.argv[1], sys.argv[2]
tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
best = {}
for f in sorted(os.listdir(wheels)):
    m = re.match(r"([^-]+)-([^-]+)-([^-]+)-([^-]+)-([^-]+)\.whl$", f)
    if not m:
        continue
    name, ver, py, abi, plat = m.groups()
    if not (py == tag or abi == "abi3" or abi == "none"):
        continue
    key = name.lower().replace("_", "-")
    parse = lambda v: tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", v))
    if key not in best or parse(ver) > parse(best[key][0]):
        best[key] = (ver, f)
for key, (ver, f) in sorted(best.items()):
    zipfile.ZipFile(os.path.join(wheels, f)).extractall(site)
print("wheels:", ", ".join(f"{k} {v[0]}" for k, v in sorted(best.items())))
EOF
  export PYTHONPATH="$here:$site:$B/python${PYTHONPATH:+:$PYTHONPATH}"
elif [ -x "$here/.venv/bin/python" ]; then
  say "no bundle at $B: using the development .venv"
  VPY=$here/.venv/bin/python
  export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
else
  die 2 "no bundle at $B (make it with scripts/gpu-bundle.sh where there is network)"
fi
gpusnap() { "$VPY" -m gpusnap "$@"; }
"$VPY" -c 'import gpusnap.cli, lz4, zstandard, blake3, typer, rich' \
  || die 2 "gpusnap's Python dependencies do not import with $VPY"

# ---------------------------------------------------------------- CRIU and the plugin
sys_criu=$(command -v criu || true)
if [ "${GPUSNAP_E2E_BUNDLE_CRIU:-0}" != 1 ] && [ -n "$sys_criu" ] \
   && "$sys_criu" --version 2>/dev/null | grep -Eq 'Version: *([4-9]|[1-9][0-9])\.'; then
  export GPUSNAP_CRIU=$sys_criu
elif [ -x "$B/bin/criu" ]; then
  export GPUSNAP_CRIU=$B/bin/criu
  export PATH="$B/bin:$PATH"
else
  die 2 "no CRIU >= 4.0 and none in $B"
fi
"$GPUSNAP_CRIU" --version >/dev/null 2>&1 || die 2 "$GPUSNAP_CRIU does not run"
say "criu: $GPUSNAP_CRIU ($("$GPUSNAP_CRIU" --version | sed -n 's/^Version: *//p'))"
if [ -f "$B/plugins/gpusnap_cuda.so" ]; then
  export GPUSNAP_PLUGIN_DIR=$B/plugins
elif [ -f "$here/build/plugins/gpusnap_cuda.so" ]; then
  export GPUSNAP_PLUGIN_DIR=$here/build/plugins
elif [ "$DEVICE" = cuda ]; then
  die 2 "the CUDA plugin gpusnap_cuda.so is in neither $B/plugins nor build/plugins"
fi
say "plugin dir: ${GPUSNAP_PLUGIN_DIR:-none}"
[ -f "$B/lib/libgpusnap_pages.so" ] && export GPUSNAP_NATIVE_LIB=$B/lib/libgpusnap_pages.so

say "gpusnap doctor / ps (for the record)"
gpusnap doctor >"$logs/doctor.txt" 2>&1 || true
gpusnap doctor --json >"$logs/doctor.json" 2>/dev/null || true
gpusnap ps >"$logs/ps-before.txt" 2>&1 || true
sed -n '1,60p' "$logs/doctor.txt"

# ---------------------------------------------------------------- the job
train=(scripts/gpu_train.py --device "$DEVICE" --steps "$STEPS" --step-sleep "$STEP_SLEEP")
# a session of its own, no terminal, output to a file; stays our child so that we reap it
start_job() {  # start_job NAME -> sets JOB_PID
  local name=$1
  (cd "$work" && exec "$VPY" -c 'import os, sys; os.setsid(); os.execv(sys.executable, [sys.executable] + sys.argv[1:])' \
     "$here/${train[0]}" "${train[@]:1}" --out "$work/$name.json" --pidfile "$work/$name.pid" \
     </dev/null >"$work/$name.log" 2>&1) &
  JOB_PID=$!
  job_pids+=("$JOB_PID")
}
last_step() { grep -Eo '^step [0-9]+' "$1" 2>/dev/null | tail -n1 | cut -d' ' -f2 || true; }
wait_step() {  # wait_step LOG STEP SECONDS
  local t=0 s
  while [ "$t" -lt $(($3 * 10)) ]; do
    s=$(last_step "$1"); [ -n "$s" ] && [ "$s" -ge "$2" ] && return 0
    grep -q '^DONE' "$1" 2>/dev/null && return 1
    sleep 0.1; t=$((t + 1))
  done
  return 1
}
wait_done() {  # wait_done LOG OUTJSON SECONDS (the restored job is not our child: poll)
  local t=0
  while [ "$t" -lt $(($3 * 10)) ]; do
    [ -s "$2" ] && grep -q '^DONE' "$1" 2>/dev/null && return 0
    sleep 0.1; t=$((t + 1))
  done
  return 1
}
json_get() { "$VPY" -c 'import json,sys; d=json.load(open(sys.argv[1])); v=d.get(sys.argv[2]); print("" if v is None else v)' "$1" "$2"; }
gpu_mem_of() {  # MiB used by PID per nvidia-smi ("" when unknown)
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
    | awk -F', *' -v p="$1" '$1==p {print $2}' | head -n1
}

say "1/4 reference run, uninterrupted ($STEPS steps on $DEVICE)"
start_job ref
wait "$JOB_PID" || die 2 "the reference run failed: $(tail -n 5 "$work/ref.log")"
cp "$work/ref.log" "$logs/ref.log"
ref_hash=$(json_get "$work/ref.json" hash)
ref_secs=$(json_get "$work/ref.json" seconds)
gpu_mem=$(json_get "$work/ref.json" gpu_mem_bytes)
say "reference: hash ${ref_hash:0:16}…  ($(json_get "$work/ref.json" impl), ${ref_secs}s of training)"

say "2/4 second run: dump --exit at step $DUMP_AT"
start_job run
pid=$JOB_PID
wait_step "$work/run.log" 1 240 || die 3 "the job did not start: $(tail -n 5 "$work/run.log")"
[ "$(cat "$work/run.pid")" = "$pid" ] || die 2 "pid mismatch: $(cat "$work/run.pid") vs $pid"
gpusnap ps >"$logs/ps-during.txt" 2>&1 || true
gpusnap doctor "$pid" >"$logs/doctor-pid.txt" 2>&1 || true
wait_step "$work/run.log" "$DUMP_AT" 240 || die 3 "the job never reached step $DUMP_AT: $(tail -n 5 "$work/run.log")"
smi_mem=$(gpu_mem_of "$pid")
at1=$(last_step "$work/run.log")
t=$(now)
timeout 180 "$VPY" -m gpusnap dump "$pid" --exit --repo "$repo" --name e2e --json \
  >"$logs/dump1.json" 2>"$logs/dump1.err" || die 3 "gpusnap dump --exit failed: $(tail -n 20 "$logs/dump1.err")"
dump1_wall=$(secs "$t" "$(now)")
wait "$pid" 2>/dev/null || true   # reap it: its PID must be free for the restore
[ -d "/proc/$pid" ] && die 3 "the job still runs after dump --exit"
snap1=$(json_get "$logs/dump1.json" snapshot)
say "dumped at step $at1 in ${dump1_wall}s: $snap1"

say "3/4 restore"
t=$(now)
timeout 180 "$VPY" -m gpusnap restore "$snap1" --repo "$repo" --json \
  >"$logs/restore.json" 2>"$logs/restore.err" || die 3 "gpusnap restore failed: $(tail -n 20 "$logs/restore.err")"
restore_wall=$(secs "$t" "$(now)")
rpid=$(json_get "$logs/restore.json" pid)
[ -n "$rpid" ] || die 3 "gpusnap restore printed no pid"
job_pids+=("$rpid")
say "restored as PID $rpid in ${restore_wall}s"

at_restore=$(last_step "$work/run.log")
DUMP2_AT=$(( ${at_restore:-$at1} + GAP ))
say "4/4 incremental dump of the restored job at step $DUMP2_AT (it keeps running)"
dump2_ok=1
if [ "$DUMP2_AT" -ge "$STEPS" ]; then
  dump2_ok=0; say "the restored job is too close to its end for a second dump (raise GPUSNAP_E2E_STEPS)"
elif wait_step "$work/run.log" "$DUMP2_AT" 240; then
  t=$(now)
  if timeout 180 "$VPY" -m gpusnap dump "$rpid" --repo "$repo" --name e2e --json \
       >"$logs/dump2.json" 2>"$logs/dump2.err"; then
    dump2_wall=$(secs "$t" "$(now)")
  else
    dump2_ok=0; say "second dump failed: $(tail -n 5 "$logs/dump2.err")"
  fi
else
  dump2_ok=0; say "the restored job did not reach step $DUMP2_AT: $(tail -n 3 "$work/run.log")"
fi
wait_done "$work/run.log" "$work/run.json" 300 || die 3 "the restored job did not finish: $(tail -n 5 "$work/run.log")"
cp "$work/run.log" "$logs/run.log"
run_hash=$(json_get "$work/run.json" hash)

# ---------------------------------------------------------------- report
field() { [ -s "$1" ] && json_get "$1" "$2" || echo ""; }
row() { printf '  %-34s %s\n' "$1" "$2"; }
echo
echo "gpusnap GPU end-to-end ($DEVICE, $STEPS steps)"
row "GPU memory (torch max allocated)" "$(mib "$gpu_mem")"
row "GPU memory (nvidia-smi, the job)" "${smi_mem:+$smi_mem MiB}${smi_mem:--}"
row "dump --exit: raw CRIU images" "$(mib "$(field "$logs/dump1.json" bytes_raw)")"
row "dump --exit: stored" "$(mib "$(field "$logs/dump1.json" bytes_stored)")"
row "dump --exit: time" "$(field "$logs/dump1.json" seconds)s (wall ${dump1_wall}s)"
row "restore: time" "${restore_wall}s"
if [ "$dump2_ok" = 1 ]; then
  row "incremental dump: raw" "$(mib "$(field "$logs/dump2.json" bytes_raw)")"
  row "incremental dump: stored (new)" "$(mib "$(field "$logs/dump2.json" bytes_stored)")"
  row "incremental dump: time" "$(field "$logs/dump2.json" seconds)s (wall ${dump2_wall}s)"
else
  row "incremental dump" "FAILED"
fi
row "reference hash" "$ref_hash"
row "restored-run hash" "$run_hash"
echo

if [ "$ref_hash" != "$run_hash" ]; then
  die 1 "the restored job finished with different weights"
fi
[ "$dump2_ok" = 1 ] || die 3 "same weights, but the incremental dump of the restored job failed"
say "PASS: same weights after dump, kill, restore"
