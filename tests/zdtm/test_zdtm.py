"""CRIU's own zdtm static tests, each dumped with `gpusnap dump --exit` and restored with
`gpusnap restore`, judged by the test's own PASS/FAIL (tests/zdtm/harness.py says how).
Before each dump, `gpusnap doctor PID` gives its verdict: it must say "ready" (no failing
check) exactly when the dump then succeeds.

A test that fails through gpusnap is run through plain CRIU with the same mechanics: if plain
CRIU passes it, gpusnap broke something and the test fails; if plain CRIU fails it too, the
machine or CRIU cannot do it here, and it is an expected failure that says so. The sources come
from Debian's CRIU 4.2.1 source package (tests/zdtm/build.sh, cached in $ZDTM_ROOT); set
ZDTM_STATIC to a built test/zdtm/static to skip the build, or ZDTM=0 to leave these out.
Sources that cannot be fetched or built fail every test here, loudly: `make test`'s set-up
(scripts/test-deps.sh) fetches and builds them first.
ZDTM_VIA=lazy restores every test with `--via lazy` (those CRIU marks `nolazy` skipped).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import harness

NAMES, SKIPPED = harness.read_list()
XFAIL = harness.read_xfail()
# zdtm's MAP_HUGETLB tests need reserved huge pages
HUGE = {"maps09", "maps10"}
HUGE_PAGES = 8

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


@pytest.fixture
def huge_pages(request):
    """Reserve a few huge pages for the MAP_HUGETLB tests; give the setting back afterwards."""
    if request.node.callspec.params["name"] not in HUGE:
        yield
        return
    knob = Path("/proc/sys/vm/nr_hugepages")
    before = int(knob.read_text())
    if before < HUGE_PAGES:
        try:
            knob.write_text(str(HUGE_PAGES))
        except OSError as e:
            pytest.skip(f"cannot reserve huge pages here: {e}")
    try:
        yield
    finally:
        if before < HUGE_PAGES:
            knob.write_text(str(before))


def _params():
    out = [pytest.param(n, id=n, marks=[pytest.mark.xfail(reason=XFAIL[n], strict=False)] if n in XFAIL else [])
           for n in NAMES]
    out += [pytest.param(n, id=n, marks=pytest.mark.skip(reason=why)) for n, why in SKIPPED.items()]
    return out


@pytest.mark.parametrize("name", _params())
def test_zdtm(name, static, huge_pages, tmp_path):
    if os.environ.get("ZDTM_VIA") == "lazy" and "nolazy" in str(harness.desc(static, name).get("flags", "")).split():
        # a lazy restore copies each process's pages on its own: pages a parent and child
        # shared copy-on-write come back as two copies, which these tests check for
        pytest.skip("CRIU's own suite does not restore it lazily (nolazy)")
    o = harness.run_one(static, name, "gpusnap", tmp_path)
    if o.doctor is not None:   # `doctor PID` predicts the dump (issue 32): ready iff it succeeds
        dumped = o.stage not in ("start", "dump")
        assert (o.doctor == "ok") == dumped, (f"{name}: doctor said {o.doctor!r} before a dump that "
                                              f"{'succeeded' if dumped else 'failed: ' + o.detail}")
    if o.passed:
        return
    ref = harness.run_one(static, name, "criu", tmp_path)
    if not ref.passed:
        pytest.xfail(f"plain CRIU fails it too here ({ref.stage}: {ref.detail[-200:]})")
    pytest.fail(f"{name}: plain CRIU passes, gpusnap fails at {o.stage}:\n{o.detail}")


def test_list_is_consistent(static):
    """Every listed test exists in this zdtm, none is listed twice, every skip says why."""
    assert len(NAMES) == len(set(NAMES)) and not set(NAMES) & set(SKIPPED)
    assert all(why for why in SKIPPED.values())
    assert set(XFAIL) <= set(NAMES)
    missing = [n for n in [*NAMES, *SKIPPED] if not (static / f"{n}.c").exists()]
    assert not missing, missing
