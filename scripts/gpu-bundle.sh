#!/usr/bin/env bash
# Prepare gpu-bundle/ (git-ignored) for scripts/gpu-e2e.sh on a GPU machine without network:
#   gpu-bundle/root/      CRIU 4.x and every shared library it needs (glibc included), extracted
#                         from this machine's Debian packages with dpkg-deb -x
#   gpu-bundle/bin/criu   a wrapper that runs that CRIU through the bundled dynamic loader, so
#                         it works whatever glibc the target has
#   gpu-bundle/plugins/   the CUDA plugin, freshly built (build/plugins/gpusnap_cuda.so), and
#                         NATIVE.sha256: the digest of the native sources it was built from
#   gpu-bundle/lib/       the page library (build/lib/libgpusnap_pages.so), and in deps/ the
#                         libzstd and liblz4 it links, for a target without them
#   gpu-bundle/wheels/    gpusnap's Python dependencies, cuda-bindings (the one CUDA backend) and
#                         cuda-pathfinder included, for the CPython versions $GPUSNAP_BUNDLE_PYTHONS
#   gpu-bundle/python/    Debian's pycriu (pure Python)
#   gpu-bundle/MANIFEST   what is in it
# Needs network (apt, pip) and root for apt-get download; run from the repository, after
# scripts/setup.sh. The bundle travels with the working tree: it must stay well under 64 MiB.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
B=${GPUSNAP_BUNDLE:-$here/gpu-bundle}
# Each CPython version costs ~14 MiB of binary wheels (7 of them cuda-bindings), next to ~22 MiB
# shared (CRIU, glibc, pure-Python wheels): three versions make ~64 MiB, over the limit, so the
# default is the two a PyTorch machine most likely runs (3.11: pytorch/pytorch images, Debian 12;
# 3.12: NGC images, Ubuntu 24.04). For another, name it: GPUSNAP_BUNDLE_PYTHONS="3.12 3.13".
# gpu-e2e.sh stops at once, naming the bundle's versions, on a Python the bundle has no wheels for.
PY_VERSIONS=${GPUSNAP_BUNDLE_PYTHONS:-"3.11 3.12"}   # gpusnap needs Python >= 3.11
# cuda-python as pyproject.toml pins it (>=12.8) brings cuda-bindings, cuda-pathfinder and cuda-core;
# gpusnap imports only cuda.bindings.driver and cuda.pathfinder, so cuda-core (6.5 MB a version,
# and numpy with it) stays out. 12.x, not 13.x: cuda-bindings 13 needs an r580+ driver, 12.9 runs
# on r570 (the first with the checkpoint API gpu-e2e.sh accepts) and on every newer one.
CUDA_BINDINGS=${GPUSNAP_BUNDLE_CUDA_BINDINGS:-"cuda-bindings>=12.8,<13"}
LIMIT_MB=56

say() { printf '\033[1m[bundle]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[bundle] error:\033[0m %s\n' "$*" >&2; exit 1; }

criu_bin=$(command -v criu || true)
[ -n "$criu_bin" ] || die "criu is not installed here (run scripts/setup.sh first)"
criu_bin=$(readlink -f "$criu_bin")
[ -x .venv/bin/pip ] || die ".venv is missing (run scripts/setup.sh)"
[ -f build/CMakeCache.txt ] || die "build/ is not configured (run scripts/setup.sh)"
# the plugin and page library of this checkout, not whatever build/ last held
# (and the fake driver, for the check of the wheels below)
cmake --build build --target gpusnap_cuda gpusnap_pages fake_cuda >/dev/null \
  || die "cmake --build build --target gpusnap_cuda gpusnap_pages fake_cuda failed"

rm -rf "$B"
mkdir -p "$B"/{debs,root,bin,plugins,wheels,python}

# ---------------------------------------------------------------- CRIU and its libraries
# the packages owning criu (none when setup built it into /opt/gpusnap: the binary itself is
# copied below) and every library ldd resolves for it, at their installed versions
criu_pkg=$(dpkg -S "$criu_bin" 2>/dev/null | cut -d: -f1 || true)
pkgs=()
[ -n "$criu_pkg" ] && pkgs+=("$criu_pkg")
while read -r lib; do
  [ -n "$lib" ] || continue
  owner=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || true)
  owner=${owner%%:*}
  [ -n "$owner" ] || die "no package owns $lib"
  pkgs+=("$owner")
done < <(ldd "$criu_bin" | awk '/=>/ {print $3} /ld-linux/ {print $1}' | sort -u)
mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | sort -u)
say "downloading ${#pkgs[@]} packages: ${pkgs[*]}"
(
  cd "$B/debs"
  for p in "${pkgs[@]}"; do
    v=$(dpkg-query -W -f='${Version}' "$p")
    apt-get download -q "$p=$v" >/dev/null 2>&1 || apt-get download -q "$p" >/dev/null \
      || die "apt-get download $p failed"
  done
)
for d in "$B"/debs/*.deb; do dpkg-deb -x "$d" "$B/root"; done
[ -n "$criu_pkg" ] || install -D -m 0755 "$criu_bin" "$B/root/usr/sbin/criu"
rm -rf "$B/debs"
# keep only what runs: binaries and shared libraries
rm -rf "$B"/root/usr/share "$B"/root/usr/include "$B"/root/etc "$B"/root/usr/lib/*/gconv \
       "$B"/root/usr/libexec "$B"/root/usr/lib/*/audit "$B"/root/var 2>/dev/null || true
find "$B/root" -name '*.a' -delete
for f in "$B"/root/usr/bin/* "$B"/root/usr/sbin/*; do
  case "$(basename "$f")" in criu) ;; *) rm -f "$f" ;; esac
done
[ -x "$B/root/usr/sbin/criu" ] || die "criu is not in the extracted packages"
# the loader as a regular file of the bundle: lib64/ld-linux-x86-64.so.2 is an absolute
# symlink to the *system's* loader, and CRIU run through that one has it as its executable,
# which a restored job maps too: the restorer's PR_SET_MM_MAP then fails with EBUSY
ld_so=$(cd "$B/root" && find . -name ld-linux-x86-64.so.2 -type f | sed 's|^\./||' | head -n1 || true)
[ -n "$ld_so" ] || die "no dynamic loader in the bundle (libc6 missing?)"

cat >"$B/bin/criu" <<EOF
#!/bin/sh
# CRIU from the gpusnap bundle, run by the bundled loader with the bundled libraries first.
# System directories stay on the search path after them: the CUDA plugin dlopen()s the
# machine's own libcuda.so.1.
B=\$(cd "\$(dirname "\$0")/.." && pwd)
L="\$B/root/usr/lib/x86_64-linux-gnu:\$B/root/lib/x86_64-linux-gnu"
for d in /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu /usr/lib64 /lib64 /usr/local/cuda/compat /usr/lib/wsl/lib; do
  [ -d "\$d" ] && L="\$L:\$d"
done
[ -n "\${LD_LIBRARY_PATH:-}" ] && L="\$LD_LIBRARY_PATH:\$L"
exec "\$B/root/$ld_so" --library-path "\$L" "\$B/root/usr/sbin/criu" "\$@"
EOF
chmod +x "$B/bin/criu"
"$B/bin/criu" --version >/dev/null || die "the bundled criu does not start"

# ---------------------------------------------------------------- plugin, page library
cp build/plugins/gpusnap_cuda.so "$B/plugins/"
mkdir -p "$B/lib"
cp build/lib/libgpusnap_pages.so "$B/lib/"   # gpusnap needs it (no Python fallback)
# the codec libraries it links (libzstd, liblz4), for a target without them: gpu-e2e.sh points
# the loader here only when the target's own are missing
mkdir -p "$B/lib/deps"
for so in $(ldd build/lib/libgpusnap_pages.so | awk '$1 ~ /^lib(zstd|lz4)\.so/ {print $3}'); do
  cp -L "$so" "$B/lib/deps/"
done
[ "$(ls "$B/lib/deps" | wc -l)" = 2 ] || die "libzstd and liblz4 of the page library not found (ldd build/lib/libgpusnap_pages.so)"
# what they were built from: gpu-e2e.sh compares it with the checkout it runs in (native_digest
# is the same function there)
native_digest() {
  find native \( -path native/tests -o -path native/gate -o -path native/criu_shim \) -prune -o \
       -type f \( -name '*.c' -o -name '*.h' -o -name exports.map \) -print | LC_ALL=C sort \
    | xargs cat | sha256sum | cut -d' ' -f1
}
native_digest >"$B/plugins/NATIVE.sha256"

# ---------------------------------------------------------------- Python
# pycriu of the same CRIU build: next to a setup-built CRIU, else the one .venv carries
pycriu=$(.venv/bin/python -c 'import os, pycriu; print(os.path.dirname(pycriu.__file__))' 2>/dev/null \
         || ls -d .venv/pycriu-*/pycriu 2>/dev/null | head -n1)
[ -n "$pycriu" ] && [ -d "$pycriu" ] || die "pycriu not found (run scripts/setup.sh)"
cp -r "$pycriu" "$B/python/"
find "$B/python" -name __pycache__ -prune -exec rm -rf {} +
# the runtime dependencies of gpusnap with cuda-bindings in place of cuda-python (see
# CUDA_BINDINGS above), minus numpy (16 MB a version; the GPU machine's PyTorch environment brings
# its own, and gpu-e2e.sh stops at once where it does not)
mapfile -t reqs < <(.venv/bin/python - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for d in deps:
    if not re.match(r"cuda-python|cuda-bindings|numpy", d):
        print(d)
EOF
)
reqs+=("$CUDA_BINDINGS")
say "downloading wheels for Python $PY_VERSIONS: ${reqs[*]}"
pip_log=$(mktemp)
trap 'rm -f "$pip_log"' EXIT
for v in $PY_VERSIONS; do
  .venv/bin/pip download -q --only-binary=:all: --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --implementation cp \
    --python-version "$v" -d "$B/wheels" "${reqs[@]}" >"$pip_log" 2>&1 \
    || { cat "$pip_log" >&2; die "pip download for Python $v failed"; }
  tag=cp${v/./}
  ls "$B/wheels"/cuda_bindings-*-"$tag"-*.whl >/dev/null 2>&1 || die "no cuda-bindings wheel for Python $v"
done
ls "$B/wheels"/cuda_pathfinder-*.whl >/dev/null 2>&1 || die "no cuda-pathfinder wheel"
! ls "$B/wheels"/cuda_core-*.whl "$B/wheels"/numpy-*.whl >/dev/null 2>&1 \
  || die "cuda-core or numpy came into the wheels (a dependency changed?): they do not fit"

# ---------------------------------------------------------------- check the CUDA backend
# For each bundled version with an interpreter here: the wheels unpacked as gpu-e2e.sh does (into
# a bare directory, no pip), a clean environment, gpusnap's driver probe against the project's fake
# driver (build/fake_cuda): it must find the fake's GPU and its checkpoint API through the bundled
# cuda-bindings. Not a real driver, but the import, libcuda's loading and every call the probe
# makes are the ones the GPU machine runs.
checked=()
for v in $PY_VERSIONS; do
  py=$(command -v "python$v" 2>/dev/null) && py=$("$py" -c 'import sys; print(sys.executable)' 2>/dev/null) \
    || { say "Python $v: no interpreter here, its wheels are not checked"; continue; }
  d=$(mktemp -d)
  "$py" - "$B/wheels" "$d" <<'EOF'
import os, re, sys, zipfile
tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
for f in os.listdir(sys.argv[1]):
    m = re.match(r"[^-]+-[^-]+-([^-]+)-([^-]+)-[^-]+\.whl$", f)
    if m and (m[1] == tag or m[2] in ("abi3", "none")):
        zipfile.ZipFile(os.path.join(sys.argv[1], f)).extractall(sys.argv[2])
EOF
  out=$(env -i PATH=/usr/bin:/bin PYTHONPATH="$d:$here" LD_LIBRARY_PATH="$here/build/fake_cuda" \
        "$py" -s - "$d" 2>&1 <<'EOF'
import sys
import cuda.bindings as b
import gpusnap.gpu.probe as p
d = p.probe_inprocess().to_dict()
assert b.__file__.startswith(sys.argv[1]), b.__file__
assert d["available"] and d["checkpoint_api"] and [g["name"] for g in d["gpus"]] == ["Fake CUDA GPU"], d
g = d["gpus"][0]
print("cuda-bindings %s: CUDA %s, checkpoint API, %s %s" % (b.__version__, d["cuda_version"], g["name"], g["uuid"]))
EOF
  ) \
    || { rm -rf "$d"; die "Python $v: the bundled CUDA backend does not work: $(tail -n 3 <<<"$out")"; }
  rm -rf "$d"
  say "Python $v ($py): driver probe on the fake driver: $out"
  checked+=("$v")
done
[ "${#checked[@]}" -gt 0 ] || say "warning: no bundled Python version is installed here: the CUDA wheels are unchecked"

# ---------------------------------------------------------------- record, size
{
  echo "gpusnap GPU bundle, made $(date -u +%FT%TZ) on $(hostname) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "criu: $("$B/bin/criu" --version | tr '\n' ' ')"
  echo "plugin: $(sha256sum "$B/plugins/gpusnap_cuda.so" | cut -d' ' -f1)"
  echo "native sources: $(cat "$B/plugins/NATIVE.sha256") (gpu-e2e.sh refuses a bundle built from other ones)"
  echo "pythons: $PY_VERSIONS (checked on the fake driver here: ${checked[*]:-none})"
  echo "packages: ${pkgs[*]}"
  echo "wheels:"; (cd "$B/wheels" && ls -1)
} >"$B/MANIFEST"
size_mb=$(du -sm "$B" | cut -f1)
say "gpu-bundle: ${size_mb} MiB ($(du -sh "$B/root" | cut -f1) CRIU+libs, $(du -sh "$B/wheels" | cut -f1) wheels)"
[ "$size_mb" -le "$LIMIT_MB" ] \
  || die "the bundle is ${size_mb} MiB, more than ${LIMIT_MB} MiB (fewer GPUSNAP_BUNDLE_PYTHONS than '$PY_VERSIONS')"
say "ready: $B"
