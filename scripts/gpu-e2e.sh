#!/usr/bin/env bash
# gpusnap end-to-end on a real NVIDIA GPU, one run of at most ~7 minutes, one verdict line.
#
# A deterministic PyTorch training job carrying an ~8 GB seeded tensor on the GPU runs once
# uninterrupted (the reference), then again through every path a user meets:
#   A  dump --exit, restore                     (the plugin's pids, states and results checked)
#   B  a dump during a long kernel with a short lock timeout: must FAIL, the job keeps RUNNING
#   C  dump leaving the job running (it must go on), then kill it and restore that snapshot
# and must end with exactly the reference's per-step loss lines, weights hash and tensor sum.
# After every dump and restore a new training step must appear within 20 s; on any timeout
# the thread states of the job are captured before anything is killed.
#
# For a lent GPU machine without network: CRIU, its libraries, the plugin and the Python
# wheels (cuda-bindings, gpusnap's CUDA backend, included) come from gpu-bundle/
# (scripts/gpu-bundle.sh). PyTorch must be on the machine.
# Run as root from the repository:
#
#   scripts/gpu-e2e.sh                           # the GPU run
#   GPUSNAP_E2E_DEVICE=cpu scripts/gpu-e2e.sh    # dry run of the same plumbing, no GPU needed
#
# Environment: GPUSNAP_E2E_DEVICE=cuda|cpu, GPUSNAP_E2E_STEPS (400), GPUSNAP_E2E_BALLAST_GB (8 on
# cuda, 0 on cpu), GPUSNAP_E2E_TIMEOUT (420 s, whole run), GPUSNAP_E2E_PHASE (90 s, each phase),
# PYTHON (interpreter with torch), GPUSNAP_BUNDLE (gpu-bundle/), OUT (logs are copied there),
# GPUSNAP_E2E_BUNDLE_CRIU=1 (the bundle's CRIU even where a CRIU >= 4 is installed).
# Exit: 0 PASS; 1 results differ; 2 environment; 3 a dump/restore/plugin check failed; 124 deadline.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

if [ -z "${GPUSNAP_E2E_INNER:-}" ]; then
  # one deadline for everything; the verdict line is printed even when it strikes
  export GPUSNAP_E2E_INNER=1
  rc=0
  timeout -k 15 "${GPUSNAP_E2E_TIMEOUT:-420}" bash "$0" "$@" || rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "VERDICT: FAIL (deadline: the whole run took more than ${GPUSNAP_E2E_TIMEOUT:-420} s)"
    rc=124
  fi
  exit "$rc"
fi

DEVICE=${GPUSNAP_E2E_DEVICE:-cuda}
STEPS=${GPUSNAP_E2E_STEPS:-400}
STEP_SLEEP=${GPUSNAP_E2E_STEP_SLEEP:-0.02}
PHASE=${GPUSNAP_E2E_PHASE:-90}
if [ "$DEVICE" = cuda ]; then BALLAST=${GPUSNAP_E2E_BALLAST_GB:-8}; else BALLAST=${GPUSNAP_E2E_BALLAST_GB:-0}; fi
LONG_AT=$((STEPS / 2))          # path B: the long kernel runs before this step
LONG_SECS=${GPUSNAP_E2E_LONG_KERNEL_S:-25}
LOCK_MS=${GPUSNAP_E2E_SHORT_LOCK_MS:-500}
A_AT=$((STEPS / 5))             # path A: dump --exit at this step
C_AT=$((STEPS * 7 / 10))        # path C: leave-running dump at this step
B=${GPUSNAP_BUNDLE:-$here/gpu-bundle}
T0=$(date +%s)
PHASE_NAME=setup

say() { printf '\033[1m[e2e %3ds]\033[0m %s\n' "$(($(date +%s) - T0))" "$*"; }
VERDICT_LINE=
CLEANUP=0
verdict() {  # printed last, by cleanup (directly before cleanup is installed)
  VERDICT_LINE="VERDICT: $*"
  [ "$CLEANUP" = 1 ] || echo "${VERDICT_LINE:0:400}"
}
die() {
  local rc=$1; shift
  printf '\033[31m[e2e] FAILED in %s:\033[0m %s\n' "$PHASE_NAME" "$*" >&2
  verdict "FAIL ($PHASE_NAME): $*"
  exit "$rc"
}
phase() { PHASE_NAME=$1; say "== $*"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", b-a}'; }
gbs() { awk -v b="${1:-0}" -v s="${2:-0}" 'BEGIN{ if (s<=0 || b=="") print "-"; else printf "%.2f GB/s", b/1e9/s }'; }
mib() { awk -v b="${1:-0}" 'BEGIN{ if (b=="" || b=="null") print "-"; else printf "%.1f MiB", b/1048576 }'; }

[ "$(id -u)" = 0 ] || die 2 "run as root (CRIU needs it)"
case "$DEVICE" in cuda|cpu) ;; *) die 2 "GPUSNAP_E2E_DEVICE must be cuda or cpu" ;; esac

work=$(mktemp -d /tmp/gpusnap-e2e.XXXXXX)
repo=$work/repo
logs=${OUT:+$OUT/e2e}
logs=${logs:-$work/logs}
mkdir -p "$logs"
touch "$work/.start"
job_pids=()

collect() {
  # CRIU's logs and gpusnap's guardian log, wherever gpusnap kept them
  if [ -d "$repo/logs" ]; then
    mkdir -p "$logs/criu"
    find "$repo/logs" -maxdepth 1 -type f -newer "$work/.start" -size -50M -exec cp {} "$logs/criu/" \; 2>/dev/null || true
  fi
  cp "$work"/*.log "$work"/*.json "$logs/" 2>/dev/null || true
}
cleanup() {
  local rc=$?
  set +e   # collect whatever there is
  for p in "${job_pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  collect
  [ -z "$VERDICT_LINE" ] || echo "${VERDICT_LINE:0:400}" >"$logs/verdict.txt"
  if [ "${GPUSNAP_E2E_KEEP:-0}" = 1 ]; then
    say "work directory kept: $work"; say "logs: $logs"
  else
    sleep 0.5; rm -rf "$work"
    # without OUT the logs lived in the work directory
    if [ -n "${OUT:-}" ]; then say "logs: $logs"; else say "logs removed with $work (OUT=DIR or GPUSNAP_E2E_KEEP=1 keeps them)"; fi
  fi
  [ -z "$VERDICT_LINE" ] || echo "${VERDICT_LINE:0:400}"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 124' TERM INT
CLEANUP=1

# ---------------------------------------------------------------- environment: fail fast
phase env "the machine"
say "machine: $(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
DRIVER=-
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi >"$logs/nvidia-smi.txt" 2>&1 || true
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version,persistence_mode --format=csv \
    >"$logs/gpus.csv" 2>&1 || true
  cat "$logs/gpus.csv"
  DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')
  PERSIST=$(nvidia-smi --query-gpu=persistence_mode --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')
  say "driver $DRIVER, persistence mode $PERSIST"
  if [ "$DEVICE" = cuda ] && [ "${DRIVER%%.*}" -lt 570 ] 2>/dev/null; then
    die 2 "driver $DRIVER has no CUDA checkpoint API (needs r570 or newer)"
  fi
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
  # unpack the wheels that fit this interpreter (no pip, no index: plain zip extraction); a
  # package the bundle has only for other Python versions (cuda-bindings, blake3...) stops here
  unpacked=$("$VPY" - "$B/wheels" "$site" 2>&1 <<'EOF'
import os, re, sys, zipfile
wheels, site = sys.argv[1], sys.argv[2]
tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
best, other = {}, {}
for f in sorted(os.listdir(wheels)):
    m = re.match(r"([^-]+)-([^-]+)-([^-]+)-([^-]+)-([^-]+)\.whl$", f)
    if not m:
        continue
    name, ver, py, abi, plat = m.groups()
    if not (py == tag or abi == "abi3" or abi == "none"):
        other.setdefault(name.lower().replace("_", "-"), set()).add(py)
        continue
    key = name.lower().replace("_", "-")
    parse = lambda v: tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", v))
    if key not in best or parse(ver) > parse(best[key][0]):
        best[key] = (ver, f)
missing = sorted(set(other) - set(best))
if missing:
    has = sorted({f"{p[2]}.{p[3:]}" for v in other.values() for p in v if p.startswith("cp")})
    print(f"the bundle has no {', '.join(missing)} wheel for Python {sys.version_info[0]}.{sys.version_info[1]}"
          f" (it has {', '.join(has)}): remake it with GPUSNAP_BUNDLE_PYTHONS naming this version,"
          " or set PYTHON= to one of those")
    sys.exit(3)
for key, (ver, f) in sorted(best.items()):
    zipfile.ZipFile(os.path.join(wheels, f)).extractall(site)
print("wheels:", ", ".join(f"{k} {v[0]}" for k, v in sorted(best.items())))
EOF
  ) || die 2 "$(tail -n1 <<<"$unpacked")"
  say "$unpacked"
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
# numpy is not in the bundle: dump and restore do not use it (verify, prune and ls sizes do,
# and this check runs none of them)
# the one CUDA backend of gpusnap: without it gpusnap sees no driver and dumps no GPU state
cuda_py=$("$VPY" -c 'import cuda.bindings.driver, cuda.pathfinder, cuda.bindings as b; print(b.__version__, b.__file__)' 2>&1) \
  || die 2 "import cuda.bindings.driver fails with $VPY${site:+ and $site}: $(tail -n1 <<<"$cuda_py")"
say "cuda-bindings: $cuda_py"
"$VPY" -m gpusnap.gpu.probe >"$logs/probe.json" 2>&1 || die 2 "python -m gpusnap.gpu.probe failed: $(tail -n1 "$logs/probe.json")"
probe=$("$VPY" - "$logs/probe.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
ok = d["available"] and d["checkpoint_api"] and d["gpus"]
what = []
if d["available"]:
    what.append("CUDA %s, checkpoint API %s, %d GPU(s): %s" % (
        d["cuda_version"], "yes" if d["checkpoint_api"] else "no", len(d["gpus"]),
        ", ".join(g["name"] for g in d["gpus"]) or "none"))
if d["reason"]:
    what.append("(%s)" % d["reason"])
print("ok" if ok else "no", " ".join(what))
EOF
) || die 2 "the driver probe gave no JSON: $(tail -n1 "$logs/probe.json")"
say "driver probe (cuda-bindings): ${probe#* }"
[ "$DEVICE" != cuda ] || [ "${probe%% *}" = ok ] \
  || die 2 "gpusnap's driver probe does not see a usable GPU with the checkpoint API:${probe#no}"

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
# gpu-bundle/ is git-ignored and travels to the GPU machine beside the checkout, so a bundle made
# before the native code last changed would test an old plugin against new Python: refuse it. The
# digest is the one gpu-bundle.sh records (the same function); build/ on that machine, if any,
# is the caller's own.
native_digest() {
  find native \( -path native/tests -o -path native/gate -o -path native/criu_shim \) -prune -o \
       -type f \( -name '*.c' -o -name '*.h' -o -name exports.map \) -print | LC_ALL=C sort \
    | xargs cat | sha256sum | cut -d' ' -f1
}
if [ "${GPUSNAP_PLUGIN_DIR:-}" = "$B/plugins" ] \
   && [ "$(cat "$B/plugins/NATIVE.sha256" 2>/dev/null)" != "$(native_digest)" ]; then
  die 2 "$B was built from other native sources than this checkout's: rerun scripts/gpu-bundle.sh"
fi
if [ -f "$B/lib/libgpusnap_pages.so" ]; then
  export GPUSNAP_NATIVE_LIB=$B/lib/libgpusnap_pages.so
  # the codec libraries it links: the target's own, else the bundle's copies
  if command -v ldd >/dev/null && ldd "$GPUSNAP_NATIVE_LIB" | grep -q "not found" && [ -d "$B/lib/deps" ]; then
    export LD_LIBRARY_PATH="$B/lib/deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "libzstd/liblz4 from the bundle ($B/lib/deps): the target has none"
  fi
  if command -v ldd >/dev/null && ldd "$GPUSNAP_NATIVE_LIB" | grep -q "not found"; then
    die 2 "the page library cannot load here: $(ldd "$GPUSNAP_NATIVE_LIB" | grep "not found" | tr -s ' \t' ' ')"
  fi
fi

"$GPUSNAP_CRIU" check >"$logs/criu-check.txt" 2>&1 || {
  cat "$logs/criu-check.txt" >&2
  [ "${GPUSNAP_E2E_IGNORE_CHECK:-0}" = 1 ] || die 2 "criu check failed (GPUSNAP_E2E_IGNORE_CHECK=1 to go on anyway)"
}
say "criu check: $(tail -n1 "$logs/criu-check.txt")"
gpusnap doctor >"$logs/doctor.txt" 2>&1 || true
gpusnap doctor --json >"$logs/doctor.json" 2>/dev/null || true

# ---------------------------------------------------------------- helpers
train=(scripts/gpu_train.py --device "$DEVICE" --steps "$STEPS" --step-sleep "$STEP_SLEEP"
       --ballast-gb "$BALLAST" --long-kernel-at "$LONG_AT" --long-kernel-secs "$LONG_SECS")
start_job() {  # start_job NAME -> JOB_PID; a session of its own, no terminal, output to a file
  local name=$1
  (cd "$work" && exec "$VPY" -c 'import os, sys; os.setsid(); os.execv(sys.executable, [sys.executable] + sys.argv[1:])' \
     "$here/${train[0]}" "${train[@]:1}" --out "$work/$name.json" --pidfile "$work/$name.pid" \
     --log "$work/$name.log" </dev/null >/dev/null 2>&1) &
  JOB_PID=$!
  job_pids+=("$JOB_PID")
}
last_step() { grep -Eo '^step [0-9]+' "$1" 2>/dev/null | tail -n1 | cut -d' ' -f2 || true; }
capture() {  # capture PID LABEL: thread states, kernel stacks, GPU view, before anything is killed
  local pid=$1 f="$logs/state-$2.txt"
  (
    set +e   # a thread that ends while we read it must not end the script
    echo "== $(date -u +%FT%TZ) pid $pid ($2)"
    cat "/proc/$pid/status" 2>/dev/null | grep -E '^(State|TracerPid|VmRSS|VmHWM|Threads)' || echo "gone"
    for t in /proc/"$pid"/task/*; do
      [ -d "$t" ] || continue
      echo "-- tid ${t##*/} $(cut -d' ' -f3 "$t/stat" 2>/dev/null) $(cat "$t/comm" 2>/dev/null) wchan=$(cat "$t/wchan" 2>/dev/null)"
      cat "$t/stack" 2>/dev/null | head -n 12
    done
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1
    ps -eo pid,ppid,stat,etime,cmd | grep -E 'criu|gpusnap|gpu_train' | grep -v grep
  ) >"$f" 2>&1
  say "captured the state of $pid in $f"
}
wait_step() {  # wait_step LOG STEP SECONDS PID: step STEP appears (the job may be a restored one)
  local t=0 s
  while [ "$t" -lt $(($3 * 10)) ]; do
    s=$(last_step "$1"); [ -n "$s" ] && [ "$s" -ge "$2" ] && return 0
    grep -q '^DONE' "$1" 2>/dev/null && return 0
    sleep 0.1; t=$((t + 1))
  done
  capture "$4" "wait-step-$2"
  return 1
}
nlines() { grep -c '^step ' "$1" 2>/dev/null || true; }
progresses() {  # progresses LOG PID WHAT: a new step line within 20 s
  local n0 t=0; n0=$(nlines "$1")
  while [ "$(nlines "$1")" -le "$n0" ]; do
    t=$((t + 1))
    [ "$t" -lt 200 ] || { capture "$2" "stalled"; die 3 "$3: no new training step within 20 s (state captured)"; }
    grep -q '^DONE' "$1" 2>/dev/null && return 0
    sleep 0.1
  done
}
state_of() { awk '{print $3}' "/proc/$1/stat" 2>/dev/null || echo gone; }
json_get() { "$VPY" -c 'import json,sys; d=json.load(open(sys.argv[1])); v=d.get(sys.argv[2]); print("" if v is None else v)' "$1" "$2"; }
run_gp() {  # run_gp LABEL ARGS...: gpusnap under the phase timeout, --json to $logs/LABEL.json;
  # on timeout the job's, gpusnap's and CRIU's thread states are captured before anything is killed
  local label=$1; shift
  "$VPY" -m gpusnap "$@" --json >"$logs/$label.json" 2>"$logs/$label.err" &
  local gp=$! t=0 rc=0
  while kill -0 "$gp" 2>/dev/null; do
    t=$((t + 1))
    if [ "$t" -ge $((PHASE * 10)) ]; then
      capture "${pid:-0}" "$label-timeout-job"
      capture "$gp" "$label-timeout-gpusnap"
      for c in $(pgrep -x criu 2>/dev/null) $(pgrep -f 'root/usr/sbin/criu' 2>/dev/null); do capture "$c" "$label-timeout-criu-$c"; done
      kill -TERM "$gp" 2>/dev/null; sleep 10; kill -9 "$gp" 2>/dev/null
      wait "$gp" 2>/dev/null || true
      return 124
    fi
    sleep 0.1
  done
  wait "$gp" || rc=$?
  return "$rc"
}
criu_log_of() {  # the CRIU log gpusnap kept for snapshot dir $1 and kind dump|restore
  ls -t "$repo/logs/$(basename "$1")-$2.log" 2>/dev/null | head -n1
}
check_plugin_dump() {  # PID SNAPSHOT JSON: the plugin found PID and checkpointed it into the image
  [ "$DEVICE" = cuda ] || return 0
  local got; got=$(json_get "$3" cuda_pids)
  [ "$got" = "[$1]" ] || die 3 "the dump found CUDA processes $got, expected [$1]"
  local log; log=$(criu_log_of "$2" dump)
  [ -n "$log" ] || die 3 "no CRIU dump log kept for $2"
  grep -q "gpusnap_cuda: checkpoint pid=$1 took" "$log" || die 3 "the plugin did not checkpoint $1 ($log)"
  grep -q "gpusnap_cuda: resume pid=$1: state checkpointed" "$log" || die 3 "the image of $1 is not checkpointed ($log)"
}
check_plugin_restore() {  # PID SNAPSHOT
  [ "$DEVICE" = cuda ] || return 0
  local log; log=$(criu_log_of "$2" restore)
  [ -n "$log" ] || die 3 "no CRIU restore log kept for $2"
  grep -q "gpusnap_cuda: restore pid=$1: CUDA process, restore thread [0-9]*, state checkpointed" "$log" \
    || die 3 "the plugin did not restore $1 from a checkpointed image ($log)"
  ! grep -q "Error.*gpusnap_cuda" "$log" || die 3 "the plugin logged errors at restore: $(grep 'Error.*gpusnap_cuda' "$log" | head -n 3)"
}
max_gap() {  # max_gap LOG FROM_LINE: the longest pause between steps since then (the freeze, seen by the job)
  grep -E '^step ' "$1" | tail -n +"$2" | grep -Eo 't=[0-9.]+' | cut -d= -f2 \
    | awk 'NR>1 && $1-p>m {m=$1-p} {p=$1} END {printf "%.2f", m}' || true
}
losses() {  # one line per step; a step written twice (a job killed after a leave-running
  # dump, then restored from it) must be written the same both times, else both copies stay
  grep -E '^step [0-9]+/' "$1" | sed 's/ t=.*//' | awk '{
    split($2, a, "/"); i = a[1] + 0
    if (!(i in seen)) { seen[i] = $0; order[++n] = i } else if (seen[i] != $0) { extra[i] = extra[i] "\n" $0 }
  } END { for (k = 1; k <= n; k++) { print seen[order[k]]; if (order[k] in extra) printf "%s\n", substr(extra[order[k]], 2) } }' || true
}
mem_avail() { awk '/MemAvailable/{printf "%.0f\n", $2*1024}' /proc/meminfo; }
sample_mem() {  # sample_mem FILE &: the lowest MemAvailable while it runs
  local low; low=$(mem_avail)
  while :; do local m; m=$(mem_avail); [ "$m" -lt "$low" ] && low=$m; echo "$low" >"$1"; sleep 0.2; done
}
timed_dump() {  # timed_dump LABEL PID ARGS...: sets SECS; host memory low-water to $logs/LABEL.mem
  local label=$1 pid=$2; shift 2
  sample_mem "$work/$label.mem" & local sp=$!
  local t; t=$(now)
  local rc=0
  run_gp "$label" dump "$pid" --repo "$repo" --name e2e "$@" || rc=$?
  SECS=$(secs "$t" "$(now)")
  kill "$sp" 2>/dev/null; wait "$sp" 2>/dev/null || true
  return "$rc"
}

# ---------------------------------------------------------------- reference
phase reference "uninterrupted run: $STEPS steps on $DEVICE, ${BALLAST} GB tensor"
mem0=$(mem_avail)
start_job ref
ref_pid=$JOB_PID
( sleep $((PHASE * 2)); kill -0 "$ref_pid" 2>/dev/null && { capture "$ref_pid" reference-timeout; kill -9 "$ref_pid"; } ) 2>/dev/null &
watchdog=$!
wait "$ref_pid" || die 2 "the reference run failed: $(tail -n 5 "$work/ref.log")"
kill "$watchdog" 2>/dev/null || true
ref_hash=$(json_get "$work/ref.json" hash)
ref_sum=$(json_get "$work/ref.json" ballast_sum_end)
gpu_mem=$(json_get "$work/ref.json" gpu_mem_bytes)
[ "$(json_get "$work/ref.json" ballast_sum_start)" = "$ref_sum" ] || die 1 "the reference tensor changed by itself"
say "reference: hash ${ref_hash:0:16}…, tensor sum ${ref_sum:-none}, $(json_get "$work/ref.json" seconds)s"

# ---------------------------------------------------------------- A: dump --exit, restore
phase A "dump --exit at step $A_AT, restore"
start_job run
pid=$JOB_PID
wait_step "$work/run.log" 1 "$PHASE" "$pid" || die 3 "the job did not start: $(tail -n 3 "$work/run.log")"
gpusnap doctor "$pid" >"$logs/doctor-pid.txt" 2>&1 || true   # for the record
wait_step "$work/run.log" "$A_AT" "$PHASE" "$pid" || die 3 "the job never reached step $A_AT: $(tail -n 3 "$work/run.log")"
[ "$(last_step "$work/run.log")" -lt "$LONG_AT" ] || die 2 "the job ran past step $LONG_AT before the first dump (raise GPUSNAP_E2E_STEPS)"
timed_dump dumpA "$pid" --exit || { capture "$pid" dumpA; die 3 "dump --exit failed: $(tail -n 5 "$logs/dumpA.err"; tail -c 400 "$logs/dumpA.json")"; }
dumpA_s=$SECS
snapA=$(json_get "$logs/dumpA.json" snapshot)
wait "$pid" 2>/dev/null || true
[ -d "/proc/$pid" ] && die 3 "the job still runs after dump --exit"
check_plugin_dump "$pid" "$snapA" "$logs/dumpA.json"
say "dumped in ${dumpA_s}s ($(gbs "$gpu_mem" "$dumpA_s") of GPU memory): $snapA"
# the arena counts the GPU memory (NVML) the checkpoint brings into host memory: nothing of the
# device memory should spill while the job is frozen when the budget holds it
say "staging: $("$VPY" -c 'import json,sys; s=json.load(open(sys.argv[1])).get("staging") or {}; n=lambda k: (s.get(k) or 0) >> 20
print("budget %d MiB (%s), arena %d MiB, staged %d MiB, spilled %d MiB, arena short: %s" % (n("budget"), s.get("budget_choice"),
      n("arena_bytes"), n("staged_bytes"), n("spilled_bytes"), s.get("arena_short")))' "$logs/dumpA.json" 2>&1)"
t=$(now)
run_gp restoreA restore "$snapA" --repo "$repo" || die 3 "restore failed: $(tail -c 600 "$logs/restoreA.json")"
restoreA_s=$(secs "$t" "$(now)")
rpid=$(json_get "$logs/restoreA.json" pid)
[ "$rpid" = "$pid" ] || die 3 "restored as PID '$rpid', expected $pid"
job_pids+=("$rpid")
check_plugin_restore "$pid" "$snapA"
progresses "$work/run.log" "$pid" "after the restore"
say "restored in ${restoreA_s}s ($(gbs "$gpu_mem" "$restoreA_s")); training goes on"

# ---------------------------------------------------------------- B: a lock that must time out
phase B "dump during a ${LONG_SECS}s kernel with a ${LOCK_MS} ms lock timeout must fail, job RUNNING"
B_result=skipped
if [ "$DEVICE" = cuda ]; then
  t=0; until grep -q '^LONGKERNEL start' "$work/run.log"; do
    t=$((t + 1)); [ "$t" -lt $((PHASE * 10)) ] || { capture "$pid" long-kernel; die 3 "the long kernel never started"; }
    sleep 0.1
  done
  sleep 1
  ! grep -q '^LONGKERNEL end' "$work/run.log" || die 3 "the long kernel ended before the dump began (raise GPUSNAP_E2E_LONG_KERNEL_S)"
  rc=0; timed_dump dumpB "$pid" --gpu-lock-timeout "$LOCK_MS" || rc=$?
  [ "$rc" = 12 ] || { capture "$pid" dumpB; die 3 "expected exit 12 (GPU checkpoint failed), got $rc: $(tail -c 400 "$logs/dumpB.json")"; }
  grep -q "cuCheckpointProcessLock" "$logs/dumpB.json" || die 3 "the failure does not name the lock: $(tail -c 400 "$logs/dumpB.json")"
  st=$(state_of "$pid"); case "$st" in R|S|D) ;; *) capture "$pid" dumpB; die 3 "after the failed dump the job is in state $st" ;; esac
  [ "$(awk '/^State/{print $2}' "/proc/$pid/status")" != t ] || die 3 "after the failed dump the job is still traced"
  t=0; until grep -q '^LONGKERNEL end' "$work/run.log"; do   # the kernel runs on; then training must
    t=$((t + 1)); [ "$t" -lt $((PHASE * 10)) ] || { capture "$pid" long-kernel-end; die 3 "the long kernel never ended after the failed dump"; }
    sleep 0.1
  done
  progresses "$work/run.log" "$pid" "after the failed dump"
  B_result="failed as it must (exit 12 in ${SECS}s), job state $st, training goes on"
else
  say "no GPU: nothing to lock"
fi

# ---------------------------------------------------------------- C: leave running, kill, restore
phase C "dump at step $C_AT leaving the job running, then kill it and restore that snapshot"
wait_step "$work/run.log" "$C_AT" "$PHASE" "$pid" || die 3 "the job never reached step $C_AT"
nC0=$(nlines "$work/run.log")
timed_dump dumpC "$pid" || { capture "$pid" dumpC; die 3 "dump failed: $(tail -c 400 "$logs/dumpC.json")"; }
dumpC_s=$SECS
snapC=$(json_get "$logs/dumpC.json" snapshot)
check_plugin_dump "$pid" "$snapC" "$logs/dumpC.json"
progresses "$work/run.log" "$pid" "after the leave-running dump"
freeze_C=$(max_gap "$work/run.log" "$nC0")
memlow=$(cat "$work/dumpC.mem" 2>/dev/null || echo "$mem0")
kill -9 "$pid"; while [ -d "/proc/$pid" ]; do sleep 0.1; done
t=$(now)
run_gp restoreC restore "$snapC" --repo "$repo" || die 3 "restore of the leave-running snapshot failed: $(tail -c 600 "$logs/restoreC.json")"
restoreC_s=$(secs "$t" "$(now)")
check_plugin_restore "$pid" "$snapC"
progresses "$work/run.log" "$pid" "after the second restore"
t=0; until [ -s "$work/run.json" ] && grep -q '^DONE' "$work/run.log"; do
  t=$((t + 1)); [ "$t" -lt $((PHASE * 10)) ] || { capture "$pid" finish; die 3 "the restored job did not finish"; }
  sleep 0.1
done
run_hash=$(json_get "$work/run.json" hash)
run_sum=$(json_get "$work/run.json" ballast_sum_end)

# ---------------------------------------------------------------- compare, report
phase compare "results against the reference"
losses "$work/ref.log" >"$work/ref.losses"; losses "$work/run.log" >"$work/run.losses"
nloss=$(wc -l <"$work/ref.losses")
loss_diff=$(diff "$work/ref.losses" "$work/run.losses" | grep -c '^[<>]' || true)
diff "$work/ref.losses" "$work/run.losses" >"$logs/loss.diff" 2>&1 || true
raw=$(json_get "$logs/dumpA.json" bytes_raw)
row() { printf '  %-40s %s\n' "$1" "$2"; }
echo
echo "gpusnap GPU end-to-end ($DEVICE, driver $DRIVER, $STEPS steps, ${BALLAST} GB tensor)"
row "GPU memory (torch max allocated)" "$(mib "$gpu_mem")"
row "A dump --exit" "${dumpA_s}s, $(gbs "$gpu_mem" "$dumpA_s") GPU, images $(mib "$raw"), stored $(mib "$(json_get "$logs/dumpA.json" bytes_stored)")"
row "A restore" "${restoreA_s}s, $(gbs "$gpu_mem" "$restoreA_s") GPU"
row "B short lock timeout" "$B_result"
row "C dump leaving it running" "${dumpC_s}s, $(gbs "$gpu_mem" "$dumpC_s") GPU, stored $(mib "$(json_get "$logs/dumpC.json" bytes_stored)") (dedup)"
row "C freeze seen by the job" "${freeze_C}s (longest gap between steps)"
row "C host memory low-water during dump" "$(mib "$memlow") available (of $(mib "$mem0") before)"
row "C restore after kill" "${restoreC_s}s, $(gbs "$gpu_mem" "$restoreC_s") GPU"
row "CRIUgpu, Llama 3.1 8B on H100 (paper)" "77 s dump / 39 s restore of 56 GB: 0.73 / 1.44 GB/s"
row "loss lines equal to the reference" "$((nloss - loss_diff / 2)) of $nloss"
row "weights hash" "${run_hash:0:16}… (reference ${ref_hash:0:16}…)"
row "tensor sum on the device" "${run_sum:-none} (reference ${ref_sum:-none})"
echo
[ "$loss_diff" = 0 ] || die 1 "$((loss_diff / 2)) loss line(s) differ from the reference ($logs/loss.diff)"
[ "$run_hash" = "$ref_hash" ] || die 1 "the restored job finished with different weights"
[ "$run_sum" = "$ref_sum" ] || die 1 "the GPU tensor came back different (sum $run_sum, reference $ref_sum)"
PHASE_NAME=done
verdict "PASS ($DEVICE, driver $DRIVER): $nloss loss lines, weights and ${BALLAST} GB tensor identical after dump --exit+restore, a failed dump ($([ "$DEVICE" = cuda ] && echo 'job kept running' || echo 'skipped: cpu')), and leave-running dump+kill+restore; dump ${dumpA_s}s / restore ${restoreA_s}s; freeze ${freeze_C}s"
