# gpusnap: every target sets up what it needs first (idempotent; quick once done).
# Run as root: CRIU dumps and restores real processes.

VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup install uninstall demo test test-fast bench bench-growth completions fresh-machine clean mutate

setup:
	@bash scripts/setup.sh
	@bash scripts/install.sh

# gpusnap on PATH (/usr/local/bin/gpusnap, for every user) and its shell completions; setup runs it
install: setup

uninstall:
	@bash scripts/install.sh uninstall

demo: setup
	@$(PY) -m gpusnap.samples.demo

test: setup
	@bash scripts/run-tests.sh

test-fast: setup
	@$(PY) -m pytest -q -m "not slow"

bench: setup
	@$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install -q 'matplotlib>=3.6'
	@$(PY) scripts/bench.py
	@$(PY) scripts/bench_writers.py
	@$(PY) scripts/bench_tiers.py
	@$(PY) scripts/bench.py --sizes 0.5,1,2,4,8 --kinds random,fp32

bench-growth: setup
	@$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install -q 'matplotlib>=3.6'
	@$(PY) scripts/bench.py --sizes 0.5,1,2,4,8 --kinds random,fp32

completions: setup
	@$(PY) scripts/gen_completions.py

# the mutation check: each one-line break of an integrity, locking, retention or guardian check
# must fail the tests that name it (scripts/mutate.py; its table is in docs/testing.md)
mutate: setup
	@$(PY) scripts/mutate.py

# the README's first command on bare Debian 12 and 13 chroots (what .ci/run checks first)
fresh-machine:
	@bash scripts/fresh-machine.sh

clean:
	rm -rf build .pytest_cache .hypothesis
