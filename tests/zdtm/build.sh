#!/usr/bin/env bash
# Build CRIU's zdtm static tests (the whole static suite of its Makefile) from Debian's source of the
# CRIU gpusnap uses (4.2.1, sid's criu_4.2.1.orig.tar.xz, fetched with a private apt configuration
# as scripts/setup.sh does), into $ZDTM_ROOT (default /var/tmp/gpusnap-zdtm). Quick when done.
# Prints the path of test/zdtm/static on success.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# the release setup.sh installed (4.2.1, or sid's newer one once sid has moved on)
CRIU_VERSION=${CRIU_VERSION:-$(/usr/local/sbin/criu --version 2>/dev/null | sed -n 's/^Version: *//p')}
CRIU_VERSION=${CRIU_VERSION:-4.2.1}
root=${ZDTM_ROOT:-/var/tmp/gpusnap-zdtm}
src=$root/criu-$CRIU_VERSION
tarball=criu_$CRIU_VERSION.orig.tar.xz
log=$root/build.log
mkdir -p "$root"

debian_mirror() {
  local m
  m=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | grep -v security | head -n1 || true)
  [ -n "$m" ] || m=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  echo "${m:-http://deb.debian.org/debian}"
}

fetch() {
  # a tarball given, or one left by an earlier fetch, saves the download
  for c in "${ZDTM_TARBALL:-}" "$root/$tarball" /tmp/sidapt/src/$tarball; do
    if [ -n "$c" ] && [ -f "$c" ]; then
      [ "$c" = "$root/$tarball" ] || cp "$c" "$root/$tarball"
      return 0
    fi
  done
  local tmp o
  tmp=$(mktemp -d "$root/apt.XXXXXX")
  mkdir -p "$tmp/lists/partial" "$tmp/src"
  printf 'deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg check-valid-until=no] %s sid main\n' \
    "$(debian_mirror)" >"$tmp/sources.list"
  o=(-o "Dir::Etc::sourcelist=$tmp/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$tmp/lists"
     -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root)
  apt-get "${o[@]}" update >>"$log" 2>&1
  # apt wants an exact version (no wildcard): the Debian revision of sid's package of this release
  local version
  version=$(apt-cache "${o[@]}" showsrc criu 2>>"$log" | sed -n "s/^Version: \($CRIU_VERSION-.*\)/\1/p" | head -n1) || true
  [ -n "$version" ] || { echo "sid's sources have no criu $CRIU_VERSION (see $log)" >&2; rm -rf "$tmp"; exit 1; }
  (cd "$tmp/src" && apt-get "${o[@]}" source --download-only --tar-only "criu=$version") >>"$log" 2>&1 || true
  [ -f "$tmp/src/$tarball" ] || { echo "could not fetch $tarball (see $log)" >&2; rm -rf "$tmp"; exit 1; }
  mv "$tmp/src/$tarball" "$root/$tarball"
  rm -rf "$tmp"
}

if [ ! -f "$src/test/zdtm/static/Makefile" ]; then
  fetch
  tar -C "$root" -xf "$root/$tarball"
fi
make -C "$src/test/zdtm/lib" >>"$log" 2>&1
# the whole static suite: every test of the Makefile's $(TST)
tests=$(make -s --no-print-directory -C "$src/test/zdtm/static" --eval 'gpusnap-tst: ; @echo $(TST)' gpusnap-tst)
# -k: one test that does not build here must not stop the others (the list says which, and why)
make -C "$src/test/zdtm/static" -j"$(nproc)" -k $tests >>"$log" 2>&1 || true
echo "$src/test/zdtm/static"
