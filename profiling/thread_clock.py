"""Thread CPU time beside wall time, for telling a thread's waiting from its work.

A step whose wall time grows with more threads while its CPU time does not is waiting: for the
GIL, a lock, or a device that blocks rather than spins.  ``time.thread_time`` is a system call on
some kernels (about 0.5 us on the CI VM), so a pair of reads costs CPU time the wall span they
bracket does not show; :func:`clock_bias` measures that once, to be subtracted per timed call.
"""

from __future__ import annotations

import time


def clock_bias(n: int = 5000) -> float:
    """Seconds of CPU time one (thread_time, perf_counter) ... (perf_counter, thread_time) bracket
    adds beyond its wall span, averaged over ``n`` empty brackets (never negative)."""
    extra = 0.0
    for _ in range(n):
        c0, t0 = time.thread_time(), time.perf_counter()
        t1, c1 = time.perf_counter(), time.thread_time()
        extra += (c1 - c0) - (t1 - t0)
    return max(0.0, extra / n)
