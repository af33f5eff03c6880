"""Cooperative roles on one rank: generators that yield instead of blocking.

A rank's producers, consumer and combiner are generators; :func:`run_roles`
steps them round-robin so that route and layout publish in random order and
the consumer works while later chunks are still produced, all on one thread
(no MPI thread-safety needed). Every wait has the ring's watchdog deadline.
"""

from __future__ import annotations

import time

from ..device.verbs import SymmetricHeap, spin_pause
from .protocol import Ring


def wait_for(ring: Ring, pred, what: str, waits: list | None = None):
    """Yield until ``pred()`` holds; :class:`~streamring.ring.protocol.WatchdogError` with the ring state after
    the deadline."""
    yield from ring.wait_steps(pred, what, waits)


# The longest the scheduler sleeps while every role sleeps (it calls the heap's progress at least
# this often): the delays are what the stress configs ask for, not time to poll in.
MAX_IDLE_SLEEP_S = 0.002


def sleep_for(seconds: float):
    """Yield until ``seconds`` have passed; each yield is the time it ends (``time.monotonic``), so
    that :func:`run_roles` can sleep while every role sleeps."""
    if seconds <= 0:
        return
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        yield until


def run_roles(roles: list, heap: SymmetricHeap) -> None:
    """Step every generator until all are exhausted; errors propagate at once.

    A role that waits on the ring yields None and is polled again at once (after the heap's progress
    and :func:`~streamring.device.verbs.spin_pause`); when every live role is in :func:`sleep_for`,
    the rank sleeps until the first of them ends (at most ``MAX_IDLE_SLEEP_S``) instead of polling:
    with more ranks than cores, a rank that only waits out a delay then leaves the core to those
    with work."""
    live = list(roles)
    while live:
        polling, sleep_ends = False, []
        for g in list(live):
            try:
                until = next(g)
            except StopIteration:
                live.remove(g)
                continue
            if until is None:
                polling = True  # a role waits on the ring
            else:
                sleep_ends.append(until)
        heap.progress()
        pause = 0.0 if polling or not sleep_ends else min(sleep_ends) - time.monotonic()
        if pause > 0:
            time.sleep(min(pause, MAX_IDLE_SLEEP_S))
        else:
            spin_pause()
