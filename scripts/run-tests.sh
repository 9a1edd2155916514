#!/usr/bin/env bash
# The whole test suite: the plugin's host tests (ctest), then pytest (real CRIU, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "make test needs root: the tests dump and restore real processes with CRIU" >&2; exit 1; }
bash scripts/test-deps.sh
(cd build && ctest --output-on-failure)
set +e
.venv/bin/python -m pytest -ra "$@"
rc=$?
set -e
# pytest's 5 means "no tests collected": that is a failure here, never a silent pass
[ $rc = 5 ] && { echo "no tests were collected" >&2; exit 1; }
exit $rc
