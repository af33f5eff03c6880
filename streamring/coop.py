"""Cooperative roles on one rank: generators that yield instead of blocking.

A rank's producers, consumer and combiner are generators; :func:`run_roles`
steps them round-robin so that route and layout publish in random order and
the consumer works while later chunks are still produced, all on one thread
(no MPI thread-safety needed). Every wait has the ring's watchdog deadline.
"""

from __future__ import annotations

import time

from .device.verbs import SymmetricHeap, spin_pause
from .protocol import Ring


def wait_for(ring: Ring, pred, what: str, waits: list | None = None):
    """Yield until ``pred()`` holds; :class:`~streamring.protocol.WatchdogError` with the ring state after the deadline."""
    yield from ring.wait_steps(pred, what, waits)


def sleep_for(seconds: float):
    """Yield until ``seconds`` have passed."""
    if seconds <= 0:
        return
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        yield


def run_roles(roles: list, heap: SymmetricHeap) -> None:
    """Step every generator until all are exhausted; errors propagate at once."""
    live = list(roles)
    while live:
        for g in list(live):
            try:
                next(g)
            except StopIteration:
                live.remove(g)
        heap.progress()
        spin_pause()
