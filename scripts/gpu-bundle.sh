#!/usr/bin/env bash
# Prepare gpu-bundle/ (git-ignored) for scripts/gpu-e2e.sh on a GPU machine without network:
#   gpu-bundle/root/      CRIU 4.x and every shared library it needs (glibc included), extracted
#                         from this machine's Debian packages with dpkg-deb -x
#   gpu-bundle/bin/criu   a wrapper that runs that CRIU through the bundled dynamic loader, so
#                         it works whatever glibc the target has
#   gpu-bundle/plugins/   the built CUDA plugin (build/plugins/gpusnap_cuda.so)
#   gpu-bundle/wheels/    gpusnap's Python dependencies for CPython 3.11-3.13 (cuda-python is
#                         left out for size, yet gpusnap.gpu needs it: install it on the target)
#   gpu-bundle/python/    Debian's pycriu (pure Python)
#   gpu-bundle/MANIFEST   what is in it
# Needs network (apt, pip) and root for apt-get download; run from the repository, after
# scripts/setup.sh. The bundle travels with the working tree: it must stay well under 64 MiB.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
B=${GPUSNAP_BUNDLE:-$here/gpu-bundle}
PY_VERSIONS=${GPUSNAP_BUNDLE_PYTHONS:-"3.11 3.12 3.13"}   # gpusnap needs Python >= 3.11
LIMIT_MB=56

say() { printf '\033[1m[bundle]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[bundle] error:\033[0m %s\n' "$*" >&2; exit 1; }

criu_bin=$(command -v criu || true)
[ -n "$criu_bin" ] || die "criu is not installed here (run scripts/setup.sh first)"
criu_bin=$(readlink -f "$criu_bin")
[ -f build/plugins/gpusnap_cuda.so ] || die "build/plugins/gpusnap_cuda.so is missing (cmake --build build)"
[ -x .venv/bin/pip ] || die ".venv is missing (run scripts/setup.sh)"

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

# ---------------------------------------------------------------- plugin
cp build/plugins/gpusnap_cuda.so "$B/plugins/"
# the native page scanner (optional: gpusnap falls back to Python without it)
mkdir -p "$B/lib"
[ -f build/lib/libgpusnap_pages.so ] && cp build/lib/libgpusnap_pages.so "$B/lib/"

# ---------------------------------------------------------------- Python
# pycriu of the same CRIU build: next to a setup-built CRIU, else the one .venv carries
pycriu=$(.venv/bin/python -c 'import os, pycriu; print(os.path.dirname(pycriu.__file__))' 2>/dev/null \
         || ls -d .venv/pycriu-*/pycriu 2>/dev/null | head -n1)
[ -n "$pycriu" ] && [ -d "$pycriu" ] || die "pycriu not found (run scripts/setup.sh)"
cp -r "$pycriu" "$B/python/"
find "$B/python" -name __pycache__ -prune -exec rm -rf {} +
# the runtime dependencies of gpusnap, minus cuda-python (about 12 MB a Python version) and
# numpy (the GPU machine's PyTorch brings its own, and three copies would not fit)
mapfile -t reqs < <(.venv/bin/python - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for d in deps:
    if not re.match(r"cuda-python|cuda-bindings|numpy", d):
        print(d)
EOF
)
say "downloading wheels for Python $PY_VERSIONS: ${reqs[*]}"
pip_log=$(mktemp)
trap 'rm -f "$pip_log"' EXIT
for v in $PY_VERSIONS; do
  .venv/bin/pip download -q --only-binary=:all: --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --implementation cp \
    --python-version "$v" -d "$B/wheels" "${reqs[@]}" >"$pip_log" 2>&1 \
    || { cat "$pip_log" >&2; die "pip download for Python $v failed"; }
done

# ---------------------------------------------------------------- record, size
{
  echo "gpusnap GPU bundle, made $(date -u +%FT%TZ) on $(hostname) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "criu: $("$B/bin/criu" --version | tr '\n' ' ')"
  echo "plugin: $(sha256sum "$B/plugins/gpusnap_cuda.so" | cut -d' ' -f1) (gpu-e2e.sh refuses a plugin older than the checkout)"
  echo "packages: ${pkgs[*]}"
  echo "wheels:"; (cd "$B/wheels" && ls -1)
} >"$B/MANIFEST"
size_mb=$(du -sm "$B" | cut -f1)
say "gpu-bundle: ${size_mb} MiB ($(du -sh "$B/root" | cut -f1) CRIU+libs, $(du -sh "$B/wheels" | cut -f1) wheels)"
[ "$size_mb" -le "$LIMIT_MB" ] || die "the bundle is ${size_mb} MiB, more than ${LIMIT_MB} MiB"
say "ready: $B"
