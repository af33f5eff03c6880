"""The MoE layer's library API on real MPI ranks (see tests/helpers/mp_scenarios.py)."""

import pytest

SCRIPT = "tests/helpers/mp_scenarios.py"


@pytest.mark.parametrize("ranks", [2, 4])
def test_moe_api_epochs_weights_and_errors(mpirun, ranks):
    """The API; and on 2 ranks, in the same job: each bad argument of forward (an expert id of 99 in a given
    routing among them) raises on every rank before anything is published, and the same buffer's next
    streamed and batch calls equal a fresh buffer's, bitwise."""
    names = "moe_api,bad_arguments_leave_the_buffer_usable" if ranks == 2 else "moe_api"
    r = mpirun(ranks, SCRIPT, names, timeout=400)
    assert r.rc == 0 and [ln for ln in r.out.splitlines() if ln.startswith("SCENARIO OK")] == [
        f"SCENARIO OK {n}" for n in names.split(",")], r


@pytest.mark.parametrize("ranks", [2, 3])
def test_fuzzed_forward_inputs(mpirun, ranks):
    """hypothesis on every rank (derandomized: the same examples everywhere)."""
    r = mpirun(ranks, SCRIPT, "fuzz_forward", "auto", "15", timeout=500)
    assert r.rc == 0 and "SCENARIO OK" in r.out, r


def test_recovery_after_watchdog_needs_rebuild_and_rebuild_works(mpirun):
    r = mpirun(2, SCRIPT, "recovery_after_watchdog", timeout=120)
    assert r.rc == 0 and "SCENARIO OK" in r.out, r


def test_bitwise_oracle(mpirun):
    """Fixed inputs at top-k 3, 5 and every expert: batch, streamed (both schedulers) and the single-process
    batch compared byte for byte on every rank (a failure names the rank, case, path and first differing bits)."""
    r = mpirun(3, SCRIPT, "bitwise_oracle", timeout=300)
    assert r.rc == 0 and "SCENARIO OK" in r.out, r
