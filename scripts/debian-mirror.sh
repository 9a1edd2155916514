# Sourced by setup.sh and fresh-machine.sh. debian_mirror prints the Debian mirror this machine's
# apt uses for its own release (a deb822 stanza or a one-line `deb` entry whose suite is the
# release's codename), else http://deb.debian.org/debian. One line, always (an awk `exit` in
# flush() used to run END's flush() again and print the mirror twice: debootstrap got both).
# (GPUSNAP_APT_ETC and GPUSNAP_OS_RELEASE point it elsewhere: tests/test_setup_scripts.py)
debian_mirror() {
  local codename m etc=${GPUSNAP_APT_ETC:-/etc/apt}
  codename=$(. "${GPUSNAP_OS_RELEASE:-/etc/os-release}" 2>/dev/null && echo "${VERSION_CODENAME:-}")
  if [ -n "$codename" ]; then
    m=$(cat "$etc"/sources.list.d/*.sources 2>/dev/null | awk -v c="$codename" '
      function flush() { if (ok && uri != "" && !done) { print uri; done = 1 } ok = 0; uri = "" }
      done { next }
      /^[[:space:]]*$/ { flush(); next }
      /^URIs:/ { uri = $2 }
      /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == c) ok = 1 }
      END { flush() }') || true
    [ -n "$m" ] || m=$(sed -E 's/\[[^]]*\]//' "$etc"/sources.list "$etc"/sources.list.d/*.list 2>/dev/null |
      awk -v c="$codename" '$1 == "deb" && $3 == c {print $2; exit}') || true
  fi
  echo "${m:-http://deb.debian.org/debian}"
}
