"""The cooperative role scheduler (streamring.ring.roles): a rank whose roles only wait out delays leaves its
core; a role that waits on the ring keeps the rank polling."""

import time

from streamring.ring import roles


class CountingHeap:
    """Only what run_roles calls on a heap: progress (counted)."""

    def __init__(self):
        self.progress_calls = 0

    def progress(self):
        self.progress_calls += 1


def _sleeper(seconds):
    yield from roles.sleep_for(seconds)


def _ring_waiter(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        yield  # what Ring.wait_steps yields while its predicate is false


def test_a_rank_whose_roles_only_sleep_gives_its_core_away():
    heap = CountingHeap()
    cpu0, t0 = time.process_time(), time.monotonic()
    roles.run_roles([_sleeper(0.2), _sleeper(0.3)], heap)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    assert wall >= 0.3
    # polling (sched_yield on an idle core) burns the whole wall time; sleeping burns next to none
    assert cpu < 0.3 * wall, (cpu, wall)
    # and the heap still makes progress at least every few MAX_IDLE_SLEEP_S
    assert heap.progress_calls >= wall / roles.MAX_IDLE_SLEEP_S / 4, heap.progress_calls


def test_a_role_waiting_on_the_ring_keeps_the_rank_polling(monkeypatch):
    # while a role waits on the ring the scheduler never sleeps (each round: progress, then sched_yield);
    # counted through time.sleep, not a rate of rounds, which another process's load would change
    slept = []
    real_sleep = time.sleep
    monkeypatch.setattr(roles.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    heap = CountingHeap()
    roles.run_roles([_sleeper(0.05), _ring_waiter(0.1)], heap)
    assert slept == [], slept
    assert heap.progress_calls > 1
    # the control: the same sleeper alone makes the scheduler sleep
    roles.run_roles([_sleeper(0.05)], heap)
    assert slept and max(slept) <= roles.MAX_IDLE_SLEEP_S
