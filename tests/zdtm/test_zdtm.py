"""CRIU's own zdtm static suite, every test of its Makefile, through gpusnap: each test dumped
with `gpusnap dump --exit` as zdtm dumps, and (where plain CRIU can) dumped leaving it running,
killed as in a crash and restored; judged by the test's own PASS/FAIL (tests/zdtm/harness.py
says how; tests/zdtm/list.txt says which tests run in which kind, and why the others do not).
Before each dump, `gpusnap doctor PID` gives its verdict: it must say "ready" (no failing
check) exactly when the dump then succeeds.

A test that fails through gpusnap is run through plain CRIU with the same mechanics: if plain
CRIU passes it, gpusnap broke something and the test fails; if plain CRIU fails it too this
time, it is an expected failure that says so. Tests that plain CRIU fails here (list.txt's
criu-fails) run through gpusnap too, for doctor's verdict, and are expected to fail; so are
the few that gpusnap does not pass yet (gpusnap-fails, each with its reason).
The sources come from Debian's CRIU source package (tests/zdtm/build.sh, cached in
$ZDTM_ROOT); set ZDTM_STATIC to a built test/zdtm/static to skip the build, or ZDTM=0 to leave
these out. Sources that cannot be fetched or built fail every test here, loudly: `make test`'s
set-up (scripts/test-deps.sh) fetches and builds them first.
ZDTM_VIA=lazy restores every test with `--via lazy` (those CRIU marks `nolazy` skipped).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import harness

ENTRIES = harness.read_entries()
HUGE_PAGES = 8      # zdtm's MAP_HUGETLB and SHM_HUGETLB tests need reserved huge pages

pytestmark = [pytest.mark.criu, pytest.mark.slow]


@pytest.fixture(scope="module")
def static() -> Path:
    if os.environ.get("ZDTM") == "0":
        pytest.skip("ZDTM=0: the zdtm suite is switched off")
    if os.geteuid() != 0:
        pytest.skip("zdtm tests run as root")
    try:
        return harness.build()
    except Exception as e:  # noqa: BLE001 - CRIU's parity check must not turn into a green run
        pytest.fail(f"the zdtm tests could not be fetched or built (make test's set-up, "
                    f"scripts/test-deps.sh, fetches them; ZDTM=0 leaves them out on purpose): {e}")


@pytest.fixture(scope="module")
def huge_pages():
    """Reserve a few huge pages for the module; give the setting back afterwards."""
    knob = Path("/proc/sys/vm/nr_hugepages")
    before = int(knob.read_text())
    if before < HUGE_PAGES:
        try:
            knob.write_text(str(HUGE_PAGES))
        except OSError:
            pass        # the HUGETLB tests then fail with plain CRIU too, and say so
    yield
    if before < HUGE_PAGES:
        knob.write_text(str(before))


def _params():
    out = []
    for e in ENTRIES.values():
        if e.status == "skip":
            out.append(pytest.param(e.name, "-", id=e.name, marks=pytest.mark.skip(reason=e.reason)))
        for kind in e.kinds:
            out.append(pytest.param(e.name, kind, id=f"{e.name}-{kind}"))
    return out


@pytest.mark.parametrize(("name", "kind"), _params())
def test_zdtm(name, kind, static, huge_pages, tmp_path):
    entry = ENTRIES[name]
    if os.environ.get("ZDTM_VIA") == "lazy" and "nolazy" in str(harness.desc(static, name).get("flags", "")).split():
        # a lazy restore copies each process's pages on its own: pages a parent and child
        # shared copy-on-write come back as two copies, which these tests check for
        pytest.skip("CRIU's own suite does not restore it lazily (nolazy)")
    o = harness.run_isolated(static, name, "gpusnap", tmp_path, kind)
    assert o.stage != "harness", o.detail
    blind = "doctor cannot see it" in entry.reason     # listed: a state /proc does not show
    if o.doctor is not None and not blind:   # `doctor PID` predicts the dump: ready iff it succeeds
        dumped = o.stage not in ("start", "dump")
        assert (o.doctor == "ok") == dumped, (f"{name}: doctor said {o.doctor!r} before a dump that "
                                              f"{'succeeded' if dumped else 'failed: ' + o.detail}")
    if o.passed:
        return
    if entry.status == "criu-fails":
        pytest.xfail(f"plain CRIU fails it here too ({entry.reason}); gpusnap at {o.stage}: {o.detail[-200:]}")
    if entry.status == "gpusnap-fails":
        pytest.xfail(f"known: {entry.reason}; gpusnap at {o.stage}: {o.detail[-200:]}")
    ref = harness.run_isolated(static, name, "criu", tmp_path, kind)
    if not ref.passed:
        pytest.xfail(f"plain CRIU failed it too this time ({ref.stage}: {ref.detail[-200:]})")
    pytest.fail(f"{name} ({kind}): plain CRIU passes, gpusnap fails at {o.stage}:\n{o.detail}")


def test_list_names_the_whole_suite(static):
    """list.txt has one line for every test of zdtm's Makefile, no other, each skip with its reason."""
    suite = harness.suite(static)
    assert sorted(ENTRIES) == sorted(suite), (sorted(set(suite) - set(ENTRIES)), sorted(set(ENTRIES) - set(suite)))
    assert all(e.reason for e in ENTRIES.values() if e.status != "run")
    # what zdtm's own descriptions keep out of a host-flavour run is skipped
    for e in ENTRIES.values():
        why = harness.zdtm_rule_skip(static, e.name)
        if why is not None:
            assert e.status == "skip", f"{e.name}: zdtm would not run it here ({why}), list.txt runs it"
