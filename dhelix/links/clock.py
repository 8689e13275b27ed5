"""Waiting on the host without oversleeping: the paced link's waits end when the modelled
transfer ends or a peer's data lands, not a timer tick later.

A GPU waits for a collective on a stream, to the microsecond. A host thread that sleeps
wakes late: Linux adds a thread's timer slack (50 µs by default) to every sleep, and a
VM's timer adds more (`time.sleep(20e-6)` took 93 µs here, `time.sleep(1e-3)` 1084 µs).
The paced link waits up to twice per collective, so that tax, ~0.1 ms a collective, fell
on every step, most on megatron's synchronous collectives, each of which sleeps to its
modelled end (measured: docs/links.md). Here: the timer slack is set to 1 ns for the
waiting thread, a wait sleeps until shortly before its end and then yields the core in a
loop until the end — only where every local rank has a core of its own: with more
ranks than cores a yield hands the core to another rank for a whole time slice, a worse
oversleep than the timer's, so there the waits sleep plainly (slack still 1 ns).
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

# a sleep with 1 ns slack still wakes ~30-50 µs late here: sleep until this long before
# the end, then yield
SPIN_S = 80e-6
# how long a poll yields before it falls back to sleeping (a peer that is this late is
# not about to post)
POLL_SPIN_S = 200e-6
_PR_SET_TIMERSLACK = 29
# False: plain sleeps with the default slack, as before these waits (for measuring what
# they buy: scripts/own_cost_inproc.py --ab clock)
FINE = True
# paced time runs at this share of its modelled length: below 1 only while an emulated
# run's untimed first step runs (`train/emulate.py` `warm_up`), so that a warm-up costs a
# fraction of a timed step; the pacer and the paced link both scale by it
SCALE = 1.0
_slack = {}          # thread -> the timer slack set on it
_OWN = None          # every local rank has a core of its own (`_own_core`)


def fine_timer() -> None:
    """Set the calling thread's timer slack to 1 ns (Linux; elsewhere nothing); with
    FINE off, back to Linux's default 50 µs."""
    tid, want = threading.get_ident(), 1 if FINE else 50_000
    if _slack.get(tid) == want:
        return
    _slack[tid] = want
    try:
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, want, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _own_core() -> bool:
    """Every rank on this machine has a core to itself (LOCAL_WORLD_SIZE <= cores)."""
    global _OWN
    if _OWN is None:
        _OWN = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= (os.cpu_count() or 1)
    return _OWN


def sleep_until(t: float) -> None:
    """Return at perf_counter() >= t, holding no core for all but the last SPIN_S."""
    fine_timer()
    left = t - time.perf_counter()
    if not (FINE and _own_core()):
        if left > 0:
            time.sleep(left)
        return
    if left > SPIN_S:
        time.sleep(left - SPIN_S)           # releases the GIL, holds no core
    while time.perf_counter() < t:
        time.sleep(0)                       # sched_yield


def poll(cond, give_up_at: float, on_timeout) -> None:
    """Wait until `cond()`: yield for POLL_SPIN_S, then sleep 20 µs at a time; call
    `on_timeout()` (which raises) once time.monotonic() passes `give_up_at`."""
    fine_timer()
    spin_until = time.perf_counter() + (POLL_SPIN_S if FINE and _own_core() else 0.0)
    while not cond():
        if time.perf_counter() < spin_until:
            time.sleep(0)
            continue
        if time.monotonic() > give_up_at:
            on_timeout()
        time.sleep(20e-6)
