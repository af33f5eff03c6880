"""The ring's rules and its defences against a hostile peer, deterministically, on real ranks.

Each test runs one mpiexec job of tests/helpers/mp_ring_rules.py (scripted with barriers: no result depends on
timing). tests/mutate.py plants a bug per rule and shows these tests fail for it.
"""

import pytest

SCRIPT = "tests/helpers/mp_ring_rules.py"
WINDOWS = ["shared", "separate"]  # Allocate_shared and Win.Allocate (the multi-node code path)


def _ok(r, *scenarios):
    assert r.rc == 0 and all(f"SCENARIO OK {s}" in r.out for s in scenarios), r


@pytest.mark.parametrize("window", WINDOWS)
def test_hostile_peer_table(mpirun, window):
    """Every metadata word, topk_idx entry and generation word a peer controls, at boundary values
    (E, -1, -2, token base +- 1, valid count + 1, an older epoch, a later lap, ...): refused with a
    ProtocolViolation naming the source rank and field, or accepted where the value is legal (-1 routes,
    timestamps, rows beyond the valid count); never a byte read outside the chunk's rows, never one written."""
    r = mpirun(3, SCRIPT, "hostile_table", env={"STREAMRING_TEST_WINDOW": window})
    _ok(r, "hostile_table")
    assert "82 rows refused or accepted as required on 3 ranks" in r.out, r


@pytest.mark.parametrize("window", WINDOWS)
def test_scripted_ring_rules(mpirun, window):
    """Both generations before a read, reuse only after the last acknowledgement, the mask cleared, payload
    before generation, the drain, an older epoch's same-sequence word is older; and freeing a region
    while an equal-looking one leaked (a failed forward's buffers) does not crash."""
    r = mpirun(3, SCRIPT, "scripted_ring", "leaked_region_close", env={"STREAMRING_TEST_WINDOW": window})
    _ok(r, "scripted_ring", "leaked_region_close")


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("window", WINDOWS)
def test_publish_bad_inputs_nothing_half_published(mpirun, ranks, window):
    r = mpirun(ranks, SCRIPT, "publish_bad_inputs", env={"STREAMRING_TEST_WINDOW": window})
    _ok(r, "publish_bad_inputs")


def test_waiting_rank_gives_its_core_away(mpirun):
    """Two ranks on one core: the CPU a waiter burns per handoff sits nearer a sched_yield loop's than a
    never-yielding loop's (a whole time slice), both measured in the same run (see the scenario's doc)."""
    r = mpirun(2, SCRIPT, "waiting_gives_core_away", timeout=120)
    _ok(r, "waiting_gives_core_away")
