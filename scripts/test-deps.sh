#!/usr/bin/env bash
# Programs only the test suite needs, installed from Debian by `make test` (quick once done):
#   slurmd slurmctld slurm-client munge  a one-machine Slurm cluster (tests/test_slurm.py)
#   redis-server                         a real server dumped while serving (sockets tests)
#   zsh fish                             the shell completions are loaded in each shell
#   tmux screen                          terminal jobs restored into panes (test_restore_terminal)
#   cron                                 a real cron daemon runs a schedule (test_schedule_daemon)
#   podman runc                          a real container the preflight must recognise (test_containers)
#   docker.io                            a dockerd the Docker tests start on their own socket (test_docker)
#   openssh-server openssh-client        a real sshd on 127.0.0.1 that `gpusnap copy --to ssh://` goes through (test_copy)
#   CRIU's zdtm tests                    built from Debian's CRIU source (tests/zdtm/build.sh)
#   python3-protobuf                     the zdtm hooks import CRIU's pycriu with Debian's python3
# Their services are never started or enabled by this: the tests start their own instances on
# 127.0.0.1 and stop them by PID.
set -euo pipefail
say() { printf '\033[1m[test-deps]\033[0m %s\n' "$*"; }

want=()
for t in /usr/sbin/slurmd:slurmd /usr/sbin/slurmctld:slurmctld /usr/bin/sbatch:slurm-client \
         /usr/sbin/munged:munge /usr/bin/redis-server:redis-server /usr/bin/zsh:zsh /usr/bin/fish:fish \
         /usr/bin/tmux:tmux /usr/bin/screen:screen /usr/sbin/cron:cron /usr/bin/podman:podman \
         /usr/sbin/runc:runc /usr/sbin/dockerd:docker.io /usr/sbin/sshd:openssh-server /usr/bin/ssh:openssh-client \
         /usr/lib/python3/dist-packages/google/protobuf/__init__.py:python3-protobuf; do
  [ -e "${t%%:*}" ] || want+=("${t#*:}")   # (-e: python3-protobuf is a module, not a program)
done
zdtm() {
  # CRIU's own tests (tests/zdtm): fetched and built here, so that the suite runs them; one that
  # cannot be fetched stops the set-up here rather than turning the parity check into a green run
  [ "${ZDTM:-1}" = 0 ] && return 0
  say "CRIU's zdtm tests (tests/zdtm/build.sh; quick once built)"
  bash "$(dirname "$0")/../tests/zdtm/build.sh" >/dev/null ||
    { echo "[test-deps] error: could not fetch or build CRIU's zdtm tests (ZDTM=0 leaves them out)" >&2; exit 1; }
}
[ ${#want[@]} -gt 0 ] || { zdtm; exit 0; }

say "installing ${want[*]} (for the tests only; their services stay off)"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp /tmp/gpusnap-test-deps.XXXXXX.log)
# invoke-rc.d asks policy-rc.d whether it may start a service: 101 means no.
policy=/usr/sbin/policy-rc.d
had_policy=0; [ -e "$policy" ] && had_policy=1
if [ $had_policy = 0 ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"
fi
trap '[ $had_policy = 1 ] || rm -f "$policy"' EXIT
{ apt-get update -q && apt-get install -y -q --no-install-recommends "${want[@]}"; } >>"$log" 2>&1 ||
  { tail -n 20 "$log" >&2; echo "[test-deps] error: could not install ${want[*]} (full output in $log)" >&2; exit 1; }
# On a systemd machine the packages enabled their units for the next boot: only those just installed.
if [ -d /run/systemd/system ]; then
  for p in "${want[@]}"; do
    case $p in slurmd|slurmctld|munge|redis-server|cron) systemctl disable --quiet "$p" >/dev/null 2>&1 || true ;;
      openssh-server) systemctl disable --quiet ssh >/dev/null 2>&1 || true ;;   # its unit is ssh.service
    esac
  done
fi
# docker.io's units are docker.socket and docker.service (the tests start a dockerd of their own)
if [ -d /run/systemd/system ] && [[ " ${want[*]} " == *" docker.io "* ]]; then
  systemctl disable --quiet docker.socket docker.service >/dev/null 2>&1 || true
fi
rm -f "$log"
zdtm
