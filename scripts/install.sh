#!/usr/bin/env bash
# `make install` / `make uninstall`: gpusnap as a system command, for root and for users.
#
#   scripts/install.sh            install (set-up runs it: `make setup`, `make demo`, `make test`)
#   scripts/install.sh uninstall  remove everything install put in place
#
# What install puts in place (all of it listed in $PREFIX/installed, which uninstall reads):
#   /opt/gpusnap/venv          a copy of the checkout's .venv, with gpusnap itself copied in
#                              (not an editable link): it keeps working when the checkout is
#                              moved or deleted, and users can run it even when the checkout is
#                              private (a clone under /root, mode 0700)
#   /usr/local/lib/gpusnap/    the native parts (page library, post-dump gate, CUDA plugin),
#                              where gpusnap looks when it does not run from a checkout
#   /usr/local/bin/gpusnap     the command (a two-line wrapper: python -I, so a directory the
#                              user stands in can never shadow gpusnap's modules)
#   completions for bash (/usr/share/bash-completion/completions/gpusnap), zsh
#   (/usr/local/share/zsh/site-functions/_gpusnap) and fish
#   (/usr/share/fish/vendor_completions.d/gpusnap.fish)
# CRIU (/opt/gpusnap/criu-*, /usr/local/sbin/criu) is set-up's, not install's: uninstall keeps it.
# Run again after changing the checkout (set-up does): only what changed is copied.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
PREFIX=${GPUSNAP_PREFIX:-/opt/gpusnap}
venv=$PREFIX/venv
lib=/usr/local/lib/gpusnap
bin=/usr/local/bin/gpusnap
bash_c=/usr/share/bash-completion/completions/gpusnap
zsh_c=/usr/local/share/zsh/site-functions/_gpusnap
fish_c=/usr/share/fish/vendor_completions.d/gpusnap.fish
manifest=$PREFIX/installed

say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[install] error:\033[0m %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (sudo make ${1:-install})"
umask 022

uninstall() {
  local f
  if [ -f "$manifest" ]; then
    while IFS= read -r f; do
      [ -n "$f" ] || continue
      case $f in
        */) rmdir "$f" 2>/dev/null || true ;;          # a directory install created, if now empty
        *) rm -rf -- "$f" ;;
      esac
    done < <(tac "$manifest")
  fi
  rm -f "$manifest"
  rmdir "$PREFIX" 2>/dev/null || true                   # kept while CRIU lives there
  say "removed gpusnap's command, its copy in $venv, $lib and its shell completions"
}

[ "${1:-install}" = uninstall ] && { uninstall; exit 0; }
[ "${1:-install}" = install ] || die "usage: scripts/install.sh [install|uninstall]"

[ -x .venv/bin/python ] && [ -f build/lib/libgpusnap_pages.so ] || die "run \`make setup\` first (no .venv or build/ here)"

# Directories install creates (uninstall removes them again when empty), then files.
new=()
mkdirs() {
  local d p
  for d in "$@"; do
    p=""
    for part in ${d//\// }; do
      p="$p/$part"
      [ -d "$p" ] || { mkdir -m 0755 "$p"; new+=("$p/"); }
    done
  done
}
mkdirs "$PREFIX" "$lib/bin" "$lib/plugins" "$(dirname "$bin")" "$(dirname "$bash_c")" "$(dirname "$zsh_c")" \
  "$(dirname "$fish_c")"

py=$(.venv/bin/python -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
site=lib/$py/site-packages
stamp=$venv/.copied-from
# The dependencies: copied again only when the checkout's .venv changed (set-up reinstalled it).
if [ ! -x "$venv/bin/python" ] || [ ! -f "$stamp" ] || [ .venv/.gpusnap-installed -nt "$stamp" ] ||
   [ "$(cat "$stamp")" != "$here" ]; then
  say "copying the checkout's .venv to $venv"
  rm -rf "$venv.tmp"
  /usr/bin/python3 -m venv --without-pip "$venv.tmp"
  cp -a .venv/$site/. "$venv.tmp/$site/"
  # the editable install points back into the checkout: the copy gets gpusnap itself instead
  rm -rf "$venv.tmp/$site"/__editable__*gpusnap* "$venv.tmp/$site"/gpusnap-*.dist-info \
    "$venv.tmp/$site"/__pycache__/__editable__*
  rm -rf "$venv"
  mv "$venv.tmp" "$venv"
  echo "$here" >"$stamp"
fi
# gpusnap's own code: every time (small), so the command is always the checkout's
rm -rf "$venv/$site/gpusnap.tmp"
cp -a gpusnap "$venv/$site/gpusnap.tmp"
find "$venv/$site/gpusnap.tmp" -name __pycache__ -prune -exec rm -rf {} +
"$venv/bin/python" -m compileall -q "$venv/$site/gpusnap.tmp" >/dev/null
rm -rf "$venv/$site/gpusnap"
mv "$venv/$site/gpusnap.tmp" "$venv/$site/gpusnap"

install -m 0755 build/lib/libgpusnap_pages.so "$lib/libgpusnap_pages.so"
install -m 0755 build/bin/gpusnap-gate "$lib/bin/gpusnap-gate"
[ -f build/plugins/gpusnap_cuda.so ] && install -m 0755 build/plugins/gpusnap_cuda.so "$lib/plugins/gpusnap_cuda.so"

tmp=$(mktemp "$bin.XXXXXX")
cat >"$tmp" <<EOF
#!/bin/sh
# gpusnap, installed by \`make install\` from $here; \`make uninstall\` removes it.
[ -x $venv/bin/python ] || { echo "gpusnap: $venv is gone; run \\\`make install\\\` in a gpusnap checkout (as root)" >&2; exit 127; }
exec $venv/bin/python -I -m gpusnap "\$@"
EOF
chmod 0755 "$tmp"
mv "$tmp" "$bin"

install -m 0644 completions/gpusnap.bash "$bash_c"
install -m 0644 completions/_gpusnap "$zsh_c"
install -m 0644 completions/gpusnap.fish "$fish_c"

# What uninstall removes: the directories created now or by an earlier install, then the files.
{
  [ -f "$manifest" ] && grep '/$' "$manifest" || true
  printf '%s\n' ${new[@]+"${new[@]}"}
  printf '%s\n' "$venv" "$lib/libgpusnap_pages.so" "$lib/bin/gpusnap-gate" "$lib/plugins/gpusnap_cuda.so" "$bin" \
    "$bash_c" "$zsh_c" "$fish_c"
} | awk '!seen[$0]++' >"$manifest.tmp"
mv "$manifest.tmp" "$manifest"
say "gpusnap is $bin (for every user; a copy in $venv: it does not need this checkout); completions for bash, zsh and fish installed"
