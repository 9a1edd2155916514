"""A SIGTERM/SIGHUP whose exception lands in a finalizer (Python prints and drops exceptions
raised in `__del__`) still interrupts the command: system/interrupt.py keeps it and raises it
again where work becomes visible and on the way out (the flake behind an import that said
"Exception ignored in _OutBuf.__del__" and exited 0)."""

import os
import signal

import pytest

from gpusnap.system import interrupt


class _SignalsInDel:
    def __init__(self, sig):
        self.sig = sig

    def __del__(self):
        os.kill(os.getpid(), self.sig)
        for _ in range(100):    # the handler runs at one of these instructions, inside __del__
            pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_swallowed_by_a_finalizer_interrupts_on_the_way_out(sig):
    after = []
    with pytest.raises(interrupt.Terminated) as e:
        with interrupt.as_exception():
            _SignalsInDel(sig)
            after.append("went on")
    assert e.value.args == (sig,)
    assert after == ["went on"]         # dropped there, so the body did go on: raised at the end


def test_check_raises_it_before_work_becomes_visible_and_only_once():
    with pytest.raises(interrupt.Terminated):
        with interrupt.as_exception():
            _SignalsInDel(signal.SIGTERM)
            with pytest.raises(interrupt.Terminated):
                interrupt.check()
            interrupt.check()           # raised once; nothing pending now
            raise interrupt.Terminated(signal.SIGTERM)


def test_other_unraisable_exceptions_still_reach_the_previous_hook():
    import sys
    seen = []
    old = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(type(u.exc_value))
    try:
        class Bad:
            def __del__(self):
                raise ValueError("x")
        with interrupt.as_exception():
            Bad()
    finally:
        sys.unraisablehook = old
    assert seen == [ValueError]
