#!/usr/bin/env bash
# The fresh-machine check: does the README's first command work on a bare Debian?
#
# For each suite (default: bookworm trixie) a `debootstrap --variant=minbase` chroot is kept,
# pristine, under $GPUSNAP_CI_CACHE/chroots/SUITE (default /var/cache/gpusnap-ci; built when
# missing). Every check runs on a fresh copy of it, so every run starts bare:
#   the checkout's HEAD cloned into /root/gpusnap, `apt-get install make` (what the README asks of a
#   machine without make), then the README's first command, as the README writes it (`sudo make
#   demo`; run as root, where a bare machine has no sudo), then `gpusnap --help` and `gpusnap doctor`
#   by name in a fresh shell (and `gpusnap --version` as user nobody): set-up installs the command.
# Exits non-zero when any suite fails. The copy and its mounts are removed on every exit path.
#
#   scripts/fresh-machine.sh [SUITE...]         as root
#   GPUSNAP_FRESH_CMD='make test' scripts/fresh-machine.sh bookworm    another command instead
#
# CRIU inside a chroot needs: the chroot's root a mount of its own (bound onto itself), fresh
# proc, sysfs, devtmpfs and devpts mounts (not rbinds of the host's), and no descriptor that
# points outside the root. All of it happens in a private mount namespace, so nothing leaks
# into the host's mount table even when this script is killed.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cache=${GPUSNAP_CI_CACHE:-/var/cache/gpusnap-ci}
say() { printf '[fresh-machine] %s\n' "$*"; }
die() { printf '[fresh-machine] error: %s\n' "$*" >&2; exit 1; }

# The README's first command: the first line of its first ```sh block, comment dropped.
readme_command() {
  awk '/^```sh/ {inblock=1; next} inblock {print; exit}' "$here/README.md" | sed 's/#.*//; s/[[:space:]]*$//'
}

. "$here/scripts/debian-mirror.sh"   # debian_mirror: the host's configured Debian mirror

# Nothing may be mounted under $1 when it is deleted (rm would walk into /dev or /proc).
mounted_under() { awk -v p="$1" '$5 == p || index($5, p "/") == 1 {found=1} END {exit !found}' /proc/self/mountinfo; }

# Processes whose root is the copy (a job left running by the command): ended by PID.
kill_inside() {
  local p r
  for p in /proc/[0-9]*; do
    r=$(readlink "$p/root" 2>/dev/null) || continue
    [ "$r" = "$1" ] && kill -9 "${p#/proc/}" 2>/dev/null || true
  done
}

remove_copy() {
  local root=$1
  [ -e "$root" ] || return 0
  kill_inside "$root"
  if mounted_under "$root"; then
    umount -R "$root" 2>/dev/null || umount -R -l "$root" 2>/dev/null || true
  fi
  mounted_under "$root" && { echo "[fresh-machine] still mounted under $root; not deleting it" >&2; return 1; }
  rm -rf --one-file-system "$root"
}

# A pristine chroot of the suite in $cache/chroots/SUITE, made once (and again when missing).
ensure_pristine() {
  local suite=$1 d=$cache/chroots/$1 t=$SECONDS
  [ -f "$d.ok" ] && [ -x "$d/usr/bin/apt-get" ] && return 0
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; } ||
      return 1
  fi
  say "$suite: debootstrap --variant=minbase $suite from $mirror (once; cached in $d)"
  mkdir -p "$cache/chroots" "$cache/logs"
  rm -f "$d.ok"
  remove_copy "$d.tmp" || return 1
  if ! debootstrap --variant=minbase "$suite" "$d.tmp" "$mirror" >"$cache/logs/debootstrap-$suite.log" 2>&1; then
    tail -n 20 "$cache/logs/debootstrap-$suite.log" >&2
    remove_copy "$d.tmp" || true
    return 1
  fi
  remove_copy "$d" && mv "$d.tmp" "$d" && date -u +%FT%TZ >"$d.ok" || return 1
  say "$suite: debootstrap took $((SECONDS - t)) s"
}

# Run a shell line in the copy's chroot with a clean environment and no descriptor but 0-2.
in_chroot() {
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      [ "$fd" -gt 2 ] && eval "exec $fd>&-"
    done
    exec chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
      PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin /bin/bash -c "$1" </dev/null
  )
}

# The host's cgroup mounts under /sys/fs/cgroup (the v2 hierarchy, or v1 hierarchies on a
# tmpfs), made afresh in the copy, as systemd makes them on any installed machine: slurmd
# (test_slurm) does not start without them.
mount_cgroups() {
  local dst=$1 dev dir type opts
  while read -r dev dir type opts _; do
    case $dir in /sys/fs/cgroup | /sys/fs/cgroup/*) ;; *) continue ;; esac
    case $type in tmpfs | cgroup | cgroup2) ;; *) continue ;; esac
    mkdir -p "$dst$dir"
    mount -t "$type" -o "$opts" "$dev" "$dst$dir"
  done </proc/self/mounts
}

# One suite's check, run in a private mount namespace: a fresh copy, its mounts, the command.
# The copy and everything in it go on every exit path (the EXIT trap).
inside() {
  suite=$1 command=$2 root=$cache/run/$1
  trap 'remove_copy "$root"' EXIT
  trap 'exit 130' INT TERM HUP
  remove_copy "$root"
  mkdir -p "$cache/run"
  local t=$SECONDS rc=0 f
  cp -a --reflink=auto "$cache/chroots/$suite" "$root"
  # networking as on any installed machine (package mirror and PyPI reachable)
  cp --remove-destination -L /etc/resolv.conf "$root/etc/resolv.conf"
  # and the CAs this network adds (an HTTPS-inspecting proxy's), where any machine on it keeps
  # them; they count once set-up installs ca-certificates, as on a real machine
  if compgen -G '/usr/local/share/ca-certificates/*' >/dev/null; then
    mkdir -p "$root/usr/local/share/ca-certificates"
    cp -a /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
  fi
  git clone -q "$here" "$root/root/gpusnap"
  git -C "$root/root/gpusnap" fetch -q "$here" HEAD
  git -C "$root/root/gpusnap" checkout -q --detach FETCH_HEAD
  mount --bind "$root" "$root"
  mount -t proc proc "$root/proc"
  mount -t sysfs sysfs "$root/sys"
  mount_cgroups "$root"
  mount -t devtmpfs devtmpfs "$root/dev"
  mkdir -p "$root/dev/pts" "$root/dev/shm"
  mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$root/dev/pts"
  mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
  say "$suite: fresh copy with $(git -C "$root/root/gpusnap" log -1 --format='%h %s' | cut -c1-60) in $((SECONDS - t)) s"

  t=$SECONDS
  in_chroot 'export DEBIAN_FRONTEND=noninteractive; apt-get update -q >/dev/null && apt-get install -y -q make >/dev/null 2>&1'
  say "$suite: apt-get install make: $((SECONDS - t)) s"
  t=$SECONDS
  say "$suite: running \`$command\` in /root/gpusnap"
  in_chroot "cd /root/gpusnap && $command" || rc=$?
  if [ $rc = 0 ] && [ -z "${GPUSNAP_FRESH_CMD:-}" ]; then
    # then gpusnap by name, as the README goes on: in a fresh shell, for root and for a user
    say "$suite: \`gpusnap --help\` and \`gpusnap doctor\` by name (and \`gpusnap --version\` as nobody)"
    in_chroot 'cd / && gpusnap --help >/dev/null && gpusnap doctor &&
      setpriv --reuid=nobody --regid=nogroup --clear-groups gpusnap --version' || rc=$?
  fi
  if [ $rc != 0 ]; then   # what set-up logged, before the copy goes
    for f in "$root"/tmp/gpusnap-setup.*.log; do
      [ -f "$f" ] && { echo "--- last lines of ${f#"$root"}:"; tail -n 40 "$f"; }
    done
  fi
  say "$suite: \`$command\` exited $rc after $((SECONDS - t)) s"
  exit $rc
}

outside() {
  [ "$(id -u)" = 0 ] || die "run as root (debootstrap, chroot and mounts need it)"
  local suites=("$@") failed=() summary=() suite t rc line
  [ ${#suites[@]} -gt 0 ] || suites=(bookworm trixie)
  command=${GPUSNAP_FRESH_CMD:-$(readme_command)}
  [ -n "$command" ] || die "no command found in README.md"
  case $command in sudo\ *) command=${command#sudo } ;; esac   # root already; a bare Debian has no sudo
  mirror=$(debian_mirror)
  for suite in "${suites[@]}"; do
    t=$SECONDS rc=0
    ensure_pristine "$suite" || rc=$?
    if [ $rc = 0 ]; then
      unshare --mount --propagation private bash "$0" --inside "$suite" "$command" || rc=$?
      # a job the command left behind keeps the namespace's mounts alive: end it, then the copy goes
      remove_copy "$cache/run/$suite" || true
    fi
    summary+=("$suite: $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - t)) s")
    [ $rc = 0 ] || failed+=("$suite")
  done
  for line in "${summary[@]}"; do say "$line"; done
  [ ${#failed[@]} = 0 ] || die "\`$command\` failed on a bare ${failed[*]}"
}

# Only definitions above: bash has read the whole script before anything runs.
if [ "${1:-}" = --inside ]; then inside "$2" "$3"; else outside "$@"; fi
