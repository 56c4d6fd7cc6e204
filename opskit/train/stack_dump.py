"""``--stack-dump-after-mins``: every rank prints the Python stack of each of its threads when one iteration runs that
long, so that a hang leaves the evidence of which rank the others wait for (:mod:`opskit.logs.stacks` reads it back for
the watchdog). Python's ``faulthandler`` does the printing from a C thread: it works while the main thread is blocked
in a collective or a CUDA call. Re-arming it each iteration restarts faulthandler's watchdog thread: ~50 us (measured
on the 2-core development VM), against iterations of 0.1 s and more.
"""

from __future__ import annotations

import faulthandler
import sys


def arm_stack_dump(minutes: float | None) -> None:
    """Start (or restart) the timer: if this is not called again within ``minutes``, the stacks of every thread go to
    stderr once (faulthandler's ``Timeout (H:MM:SS)!`` then one ``Thread 0x...`` block per thread). None or 0: off."""
    if minutes:
        faulthandler.dump_traceback_later(minutes * 60, repeat=False, file=sys.stderr)


def disarm_stack_dump() -> None:
    """Stop the timer (training is over: nothing it could catch is left)."""
    faulthandler.cancel_dump_traceback_later()
