#!/usr/bin/env bash
# Everything gpusnap needs on a fresh Debian 12 or 13 machine, as root; quick when already done.
#   - CRIU >= 4.0 and libcriu-dev (Debian 13: its own; Debian 12: from trixie, pinned low)
#   - build tools (cmake, gcc), python3-venv
#   - .venv with gpusnap in editable mode, and Debian's pycriu made importable in it
#   - the CMake build of native/ (the CRIU plugin) into build/
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root: CRIU and the packages below need it (sudo make setup)"
[ "$(uname -m)" = x86_64 ] || die "gpusnap supports Linux x86-64 only (this is $(uname -m))"
. /etc/os-release
codename=${VERSION_CODENAME:-}
case "$codename" in
  trixie|bookworm) ;;
  *) say "warning: untested distribution '${PRETTY_NAME:-unknown}'; trying the Debian 13 path" ; codename=trixie ;;
esac

export DEBIAN_FRONTEND=noninteractive
apt_updated=0
apt_update() { [ $apt_updated = 1 ] || { apt-get update -q >/dev/null; apt_updated=1; }; }

criu_ok() {
  command -v criu >/dev/null 2>&1 || return 1
  local v; v=$(criu --version 2>/dev/null | sed -n 's/^Version: *//p')
  [ -n "$v" ] && [ "${v%%.*}" -ge 4 ] 2>/dev/null
}

suite_opt=()
if [ "$codename" = bookworm ]; then
  # CRIU 3.17 (Debian 12's) cannot run on recent kernels and lacks the device plugin hooks:
  # take CRIU 4.x from trixie, pinned at priority 100 so nothing else moves unless asked.
  suite_opt=(-t trixie)
  src=/etc/apt/sources.list.d/gpusnap-trixie.sources
  if [ ! -f "$src" ]; then
    mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | grep -v security | head -n1 || true)
    [ -n "$mirror" ] || mirror=$(awk '/^deb .*bookworm /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    [ -n "$mirror" ] || mirror=http://deb.debian.org/debian
    say "adding Debian trixie ($mirror) for CRIU 4.x, pinned low"
    cat >"$src" <<EOF
Types: deb
URIs: $mirror
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    cat >/etc/apt/preferences.d/gpusnap-trixie <<'EOF'
Package: *
Pin: release n=trixie
Pin-Priority: 100
EOF
    apt_updated=0
  fi
fi

need=()
criu_ok || need+=(criu)
[ -f /usr/include/criu/criu-plugin.h ] || need+=(libcriu-dev)
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]} ${suite_opt[*]}"
  apt_update
  apt-get install -y -q --no-install-recommends "${suite_opt[@]}" "${need[@]}" >/dev/null
fi
criu_ok || die "CRIU >= 4.0 is required but '$(criu --version 2>/dev/null | head -n1)' is installed"

tools=()
for t in cmake:cmake gcc:gcc make:make pkg-config:pkg-config; do
  command -v "${t%%:*}" >/dev/null 2>&1 || tools+=("${t#*:}")
done
python3 -c 'import ensurepip, venv' 2>/dev/null || tools+=(python3-venv)
/usr/bin/python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python >= 3.11 is required"
if [ ${#tools[@]} -gt 0 ]; then
  say "installing ${tools[*]}"
  apt_update
  apt-get install -y -q --no-install-recommends "${tools[@]}" >/dev/null
fi

# pycriu: Debian's python3-pycriu matches the installed CRIU, but installing it on Debian 12
# would replace the system Python with trixie's. It is pure Python, so we unpack the .deb
# of the same version into the venv and point a .pth file at it; protobuf comes from pip.
venv=.venv
if [ ! -x $venv/bin/python ]; then
  say "creating $venv"
  /usr/bin/python3 -m venv $venv
fi
stamp=$venv/.gpusnap-installed
if [ ! -f $stamp ] || [ pyproject.toml -nt $stamp ]; then
  say "installing gpusnap and its dependencies into $venv"
  $venv/bin/pip install -q --upgrade pip >/dev/null
  $venv/bin/pip install -q -e '.[test]'
  touch $stamp
fi
criu_ver=$(dpkg-query -W -f='${Version}' criu)
pyc_dir=$venv/pycriu-$criu_ver
if [ ! -d "$pyc_dir" ]; then
  say "unpacking Debian's python3-pycriu $criu_ver into $venv"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  apt_update
  (cd "$tmp" && apt-get download -q "python3-pycriu=$criu_ver" >/dev/null 2>&1) \
    || die "could not download python3-pycriu=$criu_ver"
  dpkg-deb -x "$tmp"/python3-pycriu_*.deb "$tmp/x"
  rm -rf $venv/pycriu-*
  mkdir -p "$pyc_dir"
  cp -r "$tmp/x/usr/lib/python3/dist-packages/pycriu" "$pyc_dir/"
fi
site=$($venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$here/$pyc_dir" >"$site/debian-pycriu.pth"
$venv/bin/python -c 'import pycriu.images' || die "pycriu is not importable in $venv"

say "building native/ with CMake"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" >/dev/null

say "ready: CRIU $(criu --version | sed -n 's/^Version: *//p'), $($venv/bin/python --version), plugin in build/plugins"
