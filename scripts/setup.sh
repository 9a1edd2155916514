#!/usr/bin/env bash
# Everything gpusnap needs on a fresh Debian 12 or 13 machine, as root; quick when already done.
#   - CRIU >= 4.0 and the matching libcriu-dev (Debian 13: its own; Debian 12: from trixie,
#     pinned low so nothing else moves)
#   - build tools (cmake, gcc), python3-venv, BLAKE3's C sources (librust-blake3-dev)
#   - .venv with gpusnap in editable mode, and Debian's pycriu made importable in it
#   - the CMake build of native/ (the CRIU plugin, the page scanner) into build/
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root: CRIU and the packages below need it (sudo make setup)"
[ "$(uname -m)" = x86_64 ] || die "gpusnap supports Linux x86-64 only (this is $(uname -m))"
[ -f /etc/debian_version ] || die "this set-up is written for Debian 12 or 13"

export DEBIAN_FRONTEND=noninteractive
apt_updated=0
apt_update() { [ $apt_updated = 1 ] || { apt-get update -q >/dev/null; apt_updated=1; }; }
major() { local v=${1#*:}; echo "${v%%.*}"; }
log=$(mktemp /tmp/gpusnap-setup.XXXXXX.log)
quiet() { "$@" >>"$log" 2>&1 || { tail -n 30 "$log" >&2; die "failed: $* (full output in $log)"; }; }

criu_ok() {
  command -v criu >/dev/null 2>&1 || return 1
  local v; v=$(criu --version 2>/dev/null | sed -n 's/^Version: *//p')
  [ -n "$v" ] && [ "$(major "$v")" -ge 4 ] 2>/dev/null
}

add_trixie() {
  # CRIU 3.17 (Debian 12's) cannot start on recent kernels and lacks the device plugin hooks.
  # Take CRIU 4.x from trixie, pinned at priority 100 so nothing else is upgraded unless asked.
  local src=/etc/apt/sources.list.d/gpusnap-trixie.sources mirror
  [ -f "$src" ] && return 0
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | grep -v security | head -n1 || true)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $3 ~ /^(bookworm|trixie)$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=http://deb.debian.org/debian
  say "adding Debian trixie ($mirror) for CRIU 4.x, pinned low"
  printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" >"$src"
  printf 'Package: *\nPin: release n=trixie\nPin-Priority: 100\n' >/etc/apt/preferences.d/gpusnap-trixie
  apt_updated=0
}

# The suite is chosen by what apt offers, not by the release name: a Debian 12 machine that
# took libc from trixie for CRIU reports itself as trixie afterwards.
if ! criu_ok; then
  apt_update
  cand=$(apt-cache policy criu 2>/dev/null | sed -n 's/^ *Candidate: *//p')
  if [ -n "$cand" ] && [ "$cand" != "(none)" ] && [ "$(major "$cand")" -ge 4 ]; then
    say "installing criu $cand"
    quiet apt-get install -y -q --no-install-recommends criu
  else
    add_trixie
    apt_update
    say "installing criu from trixie (this system offers ${cand:-none})"
    quiet apt-get install -y -q --no-install-recommends -t trixie criu
  fi
fi
criu_ok || die "CRIU >= 4.0 is required but '$(criu --version 2>/dev/null | head -n1)' is installed"
criu_ver=$(dpkg-query -W -f='${Version}' criu 2>/dev/null) || die "criu is not installed from a Debian package"

# The plugin header and the Python bindings must match the installed CRIU exactly.
if [ "$(dpkg-query -W -f='${Version}' libcriu-dev 2>/dev/null || true)" != "$criu_ver" ]; then
  say "installing libcriu-dev $criu_ver"
  apt_update
  quiet apt-get install -y -q --no-install-recommends "libcriu-dev=$criu_ver"
fi

pkgs=()
for t in cmake:cmake gcc:gcc make:make pkg-config:pkg-config; do
  command -v "${t%%:*}" >/dev/null 2>&1 || pkgs+=("${t#*:}")
done
/usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || pkgs+=(python3-venv)
compgen -G '/usr/share/cargo/registry/blake3-*/c/blake3.c' >/dev/null || pkgs+=(librust-blake3-dev)
[ -f /usr/include/lz4.h ] || pkgs+=(liblz4-dev)
/usr/bin/python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python >= 3.11 is required"
if [ ${#pkgs[@]} -gt 0 ]; then
  say "installing ${pkgs[*]}"
  apt_update
  quiet apt-get install -y -q --no-install-recommends "${pkgs[@]}"
fi

venv=.venv
if [ ! -x $venv/bin/python ]; then
  say "creating $venv"
  quiet /usr/bin/python3 -m venv $venv
fi
stamp=$venv/.gpusnap-installed
if [ ! -f $stamp ] || [ pyproject.toml -nt $stamp ]; then
  say "installing gpusnap and its dependencies into $venv"
  quiet $venv/bin/pip install -q --upgrade pip
  quiet $venv/bin/pip install -q -e '.[test]'
  touch $stamp
fi

# pycriu: Debian's python3-pycriu matches the installed CRIU, but installing it on Debian 12
# would replace the system Python with trixie's. It is pure Python, so the .deb of the same
# version is unpacked into the venv and a .pth file points at it; protobuf comes from pip.
pyc_dir=$venv/pycriu-$criu_ver
if [ ! -d "$pyc_dir/pycriu" ]; then
  say "unpacking Debian's python3-pycriu $criu_ver into $venv"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  apt_update
  (cd "$tmp" && apt-get download -q "python3-pycriu=$criu_ver" >>"$log" 2>&1) \
    || die "could not download python3-pycriu=$criu_ver"
  dpkg-deb -x "$tmp"/python3-pycriu_*.deb "$tmp/x"
  rm -rf $venv/pycriu-*
  mkdir -p "$pyc_dir"
  cp -r "$tmp/x/usr/lib/python3/dist-packages/pycriu" "$pyc_dir/"
fi
site=$($venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$here/$pyc_dir" >"$site/debian-pycriu.pth"
$venv/bin/python -c 'import pycriu.images' || die "pycriu is not importable in $venv"

# Byte-compile gpusnap and pycriu now: where PYTHONDONTWRITEBYTECODE is set, every run
# would otherwise compile them again (about 0.1 s per command).
quiet $venv/bin/python -m compileall -q gpusnap "$pyc_dir"

say "building native/ with CMake"
quiet cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
quiet cmake --build build -j"$(nproc)"

rm -f "$log"
say "ready: CRIU $(criu --version | sed -n 's/^Version: *//p'), $($venv/bin/python --version), native build in build/"
