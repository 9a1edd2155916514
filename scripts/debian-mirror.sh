# Sourced by setup.sh and fresh-machine.sh. debian_mirror prints the Debian mirror this machine's
# apt uses for its own release (a deb822 stanza or a one-line `deb` entry whose suite is the
# release's codename), else http://deb.debian.org/debian.
debian_mirror() {
  local codename m
  codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
  if [ -n "$codename" ]; then
    m=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk -v c="$codename" '
      function flush() { if (ok && uri != "") { print uri; exit } ok = 0; uri = "" }
      /^[[:space:]]*$/ { flush(); next }
      /^URIs:/ { uri = $2 }
      /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == c) ok = 1 }
      END { flush() }') || true
    [ -n "$m" ] || m=$(sed -E 's/\[[^]]*\]//' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
      awk -v c="$codename" '$1 == "deb" && $3 == c {print $2; exit}') || true
  fi
  echo "${m:-http://deb.debian.org/debian}"
}
