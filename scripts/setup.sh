#!/usr/bin/env bash
# Everything gpusnap needs on a fresh Debian 12 or 13 machine, as root; quick when already done.
#   - Python 3, python3-venv, build tools (cmake, gcc), BLAKE3's C sources (librust-blake3-dev),
#     CA certificates (pip fetches from PyPI over HTTPS), iproute2 (doctor's `ss`)
#   - CRIU 4.2.1 built from Debian's source package into /opt/gpusnap/criu-4.2.1 (binary, plugin
#     headers and pycriu of one build), linked as /usr/local/sbin/criu; sid's newest release
#     >= 4.2 instead once sid no longer has 4.2.1
#   - .venv with gpusnap in editable mode, and that pycriu made importable in it
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
apt_update() { [ $apt_updated = 1 ] || { quiet apt-get update -q; apt_updated=1; }; }
log=$(mktemp /tmp/gpusnap-setup.XXXXXX.log)
quiet() { "$@" >>"$log" 2>&1 || { tail -n 30 "$log" >&2; die "failed: $* (full output in $log)"; }; }

pkgs=()
for t in cmake:cmake gcc:gcc make:make pkg-config:pkg-config; do
  command -v "${t%%:*}" >/dev/null 2>&1 || pkgs+=("${t#*:}")
done
# gcc only recommends the C library's headers; a minimal system does not have them
[ -f /usr/include/stdio.h ] || pkgs+=(libc6-dev)
# pip checks PyPI's certificate against the system's CAs, which a minimal system lacks
[ -f /etc/ssl/certs/ca-certificates.crt ] || pkgs+=(ca-certificates)
# gpusnap doctor finds the peers of a job's unix sockets with ss
command -v ss >/dev/null 2>&1 || pkgs+=(iproute2)
# a job that had a terminal, restored from none (cron, a script, --json), gets its pane in a
# new tmux session (gpusnap/ops/restore_terminal.py)
command -v tmux >/dev/null 2>&1 || pkgs+=(tmux)
[ -x /usr/bin/python3 ] || pkgs+=(python3)
/usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || pkgs+=(python3-venv)
compgen -G '/usr/share/cargo/registry/blake3-*/c/blake3.c' >/dev/null || pkgs+=(librust-blake3-dev)
[ -f /usr/include/lz4.h ] || pkgs+=(liblz4-dev)
[ -f /usr/include/zstd.h ] || pkgs+=(libzstd-dev)
if [ ${#pkgs[@]} -gt 0 ]; then
  say "installing ${pkgs[*]}"
  apt_update
  quiet apt-get install -y -q --no-install-recommends "${pkgs[@]}"
fi
/usr/bin/python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python >= 3.11 is required"

# CRIU: gpusnap needs >= 4.2 (4.1 cannot dump a process holding an AF_INET socket on kernels
# >= 6.16). Debian ships 4.2 only in sid, whose binaries would pull sid's libc and Python, so
# CRIU is built here from Debian's own upstream tarball (sid's source package, fetched by apt with
# a private configuration that changes no system source) against this release's -dev packages,
# and installed under its own prefix. The binary, the plugin headers and pycriu come from that one
# build, so they always match. docs/setup.md says why in full.
# 4.2.1 is the release gpusnap is tested with. sid moves on: once it no longer has 4.2.1, its
# newest release >= CRIU_MIN is built instead (and set-up says so), so a bare machine still sets
# up. GPUSNAP_CRIU_VERSION asks for another release (to check that path).
CRIU_VERSION=${GPUSNAP_CRIU_VERSION:-4.2.1}
CRIU_MIN=4.2
criu_version=""          # the release in use: set below, from a build here or a new one
criu_build_deps=(gcc make pkg-config xz-utils protobuf-compiler protobuf-c-compiler libprotobuf-dev
  libprotobuf-c-dev libnl-3-dev libnet1-dev libcap-dev libaio-dev libgnutls28-dev
  libnftables-dev libbsd-dev uuid-dev iptables)

# A complete build of release $1 under /opt/gpusnap/criu-$1.
criu_built() {
  local p=/opt/gpusnap/criu-$1
  [ -x "$p/sbin/criu" ] && [ -f "$p/include/criu/criu-plugin.h" ] &&
    [ -f "$p/python/pycriu/images/pb.py" ] &&
    [ "$("$p/sbin/criu" --version 2>/dev/null | sed -n 's/^Version: *//p')" = "$1" ]
}

. "$here/scripts/debian-mirror.sh"

archive_keyring() {
  local k
  for k in /usr/share/keyrings/debian-archive-keyring.pgp /usr/share/keyrings/debian-archive-keyring.gpg; do
    [ -f "$k" ] && { echo "$k"; return; }
  done
  die "Debian's archive keyring is missing (apt-get install debian-archive-keyring)"
}

# criu_<version>.orig.tar.xz of sid's source package into $1, with a private apt configuration
# that has only sid's deb-src: the system's sources stay as they are. sid's Release can be past
# its Valid-Until on a mirror; the check is off for this source only (its signature is still
# checked, and apt checks the tarball against the signed index).
fetch_criu_source() {
  local dir=$1 mirror o version all v up
  local mirrors=("$(debian_mirror)")
  [ "${mirrors[0]}" = http://deb.debian.org/debian ] || mirrors+=(http://deb.debian.org/debian)
  for mirror in "${mirrors[@]}"; do
    rm -rf "$dir/apt" && mkdir -p "$dir/apt/lists/partial"
    printf 'deb-src [signed-by=%s check-valid-until=no] %s sid main\n' "$(archive_keyring)" "$mirror" \
      >"$dir/apt/sources.list"
    o=(-o "Dir::Etc::sourcelist=$dir/apt/sources.list" -o Dir::Etc::sourceparts=-
       -o "Dir::State::Lists=$dir/apt/lists" -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root)
    apt-get "${o[@]}" update >>"$log" 2>&1 || { say "cannot read sid's sources from $mirror"; continue; }
    # apt wants an exact version: the Debian revision of sid's package of this upstream release,
    # else (sid has moved on) sid's newest release >= CRIU_MIN
    all=$(apt-cache "${o[@]}" showsrc criu 2>>"$log" | sed -n 's/^Version: //p') || true
    version=$(printf '%s\n' $all | grep -m1 "^$CRIU_VERSION-") || version=""
    if [ -z "$version" ]; then
      for v in $all; do
        up=${v#*:}; up=${up%-*}
        dpkg --compare-versions "$up" ge "$CRIU_MIN" || continue
        [ -z "$version" ] || dpkg --compare-versions "$v" gt "$version" || continue
        version=$v
      done
      if [ -z "$version" ]; then
        say "sid's sources at $mirror have no criu >= $CRIU_MIN (they have: $(echo $all))"
        continue
      fi
      say "sid no longer has criu $CRIU_VERSION (the release gpusnap is tested with): building $version"
    fi
    up=${version#*:}; up=${up%-*}
    (cd "$dir" && apt-get "${o[@]}" source --download-only --tar-only "criu=$version" >>"$log" 2>&1) || true
    if [ -f "$dir/criu_$up.orig.tar.xz" ]; then
      criu_version=$up
      return 0
    fi
    say "could not download criu_$up.orig.tar.xz (criu $version) from $mirror"
  done
  die "could not fetch CRIU's source (criu $CRIU_VERSION, or >= $CRIU_MIN) from Debian's sid sources (see $log)"
}

build_criu() {
  local tmp o
  say "building CRIU from Debian's source package (about a minute)"
  apt_update
  quiet apt-get install -y -q --no-install-recommends "${criu_build_deps[@]}"
  tmp=$(mktemp -d /tmp/gpusnap-criu.XXXXXX)
  mkdir -p "$tmp/src"
  fetch_criu_source "$tmp/src"      # sets criu_version
  local criu_prefix=/opt/gpusnap/criu-$criu_version
  tar -C "$tmp/src" -xf "$tmp/src/criu_$criu_version.orig.tar.xz"
  local s="$tmp/src/criu-$criu_version"
  quiet make -C "$s" -j"$(nproc)" criu
  quiet make -C "$s" -j"$(nproc)" lib
  rm -rf "$criu_prefix.new"
  install -D -m 0755 "$s/criu/criu" "$criu_prefix.new/sbin/criu"
  install -D -m 0644 "$s/criu/include/criu-plugin.h" "$criu_prefix.new/include/criu/criu-plugin.h"
  install -D -m 0644 "$s/criu/include/criu-log.h" "$criu_prefix.new/include/criu/criu-log.h"
  mkdir -p "$criu_prefix.new/python"
  cp -r "$s/lib/pycriu" "$criu_prefix.new/python/"
  find "$criu_prefix.new/python" -name Makefile -delete
  rm -rf "$criu_prefix" && mv "$criu_prefix.new" "$criu_prefix"
  rm -rf "$tmp"
}

# a build made earlier: the tested release, else the newest other one >= CRIU_MIN
for v in "$CRIU_VERSION" $(ls -1d /opt/gpusnap/criu-* 2>/dev/null | sed 's|.*/criu-||' | sort -rV); do
  dpkg --compare-versions "$v" ge "$CRIU_MIN" && criu_built "$v" && { criu_version=$v; break; }
done
[ -n "$criu_version" ] || build_criu
criu_built "$criu_version" || die "CRIU $criu_version did not build (see $log)"
criu_prefix=/opt/gpusnap/criu-$criu_version
# /usr/local/sbin comes before /usr/sbin on root's PATH, so this shadows any Debian criu 4.1;
# gpusnap itself looks here first whatever PATH says (gpusnap/criu/runner.py).
ln -sfn "$criu_prefix/sbin/criu" /usr/local/sbin/criu

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

# pycriu comes from the same CRIU build; a .pth file makes it importable in the venv.
pyc_dir=$criu_prefix/python
site=$($venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/debian-pycriu.pth"
echo "$pyc_dir" >"$site/gpusnap-pycriu.pth"
$venv/bin/python -c 'import pycriu.images' || die "pycriu is not importable in $venv"

# Byte-compile gpusnap and pycriu now: where PYTHONDONTWRITEBYTECODE is set, every run
# would otherwise compile them again (about 0.1 s per command).
quiet $venv/bin/python -m compileall -q gpusnap "$pyc_dir"

say "building native/ with CMake"
quiet cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGPUSNAP_CRIU_INCLUDE="$criu_prefix/include"
quiet cmake --build build -j"$(nproc)"

rm -f "$log"
say "ready in $SECONDS s: CRIU $("$criu_prefix/sbin/criu" --version | sed -n 's/^Version: *//p') (/usr/local/sbin/criu), $($venv/bin/python --version), native build in build/"
