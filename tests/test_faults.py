"""Rank failure: a rank killed or hung mid-stream ends the job promptly, named, with no orphan or leak."""

import subprocess
import time
from pathlib import Path

import pytest

SHM = Path("/dev/shm")


def _segments():
    return {p.name for p in SHM.glob("mpich_shm_*")} if SHM.is_dir() else set()


@pytest.mark.parametrize("at,kind", [("publish", "kill"), ("consume", "kill"), ("ack", "kill"), ("consume", "hang"),
                                     ("publish", "hang")])
def test_rank_failure_is_named_and_cleaned_up(cli, at, kind):
    before = _segments()
    marker = f"fault-{at}-{kind}"
    t0 = time.monotonic()
    r = cli("stress", "--ranks", 3, "--set", "wait_timeout_s=3", "--set", "stress.chunks_per_rank=60",
            "--set", f"stress.fault={{rank: 1, at: {at}, after_chunks: 4, kind: {kind}}}",
            "--set", f"stress.seed={len(marker)}", timeout=90)
    elapsed = time.monotonic() - t0
    assert r.rc != 0, r
    assert elapsed < 3 + 30, elapsed  # within the watchdog deadline plus start-up
    # a surviving rank's watchdog shows the slot states and names the dead/stopped peer
    assert "watchdog" in r.err and "route_ready_gen" in r.err and "ack_mask" in r.err, r
    assert "rank 1 (pid" in r.err and ("zombie" in r.err or "not running" in r.err or "stopped" in r.err), r
    # the launcher names the failed rank
    assert "rank 1 (pid" in r.err and "the failed rank" in r.err, r
    # no orphan rank, no leaked shared-memory segment
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "python -m streamring stress"], capture_output=True, text=True).stdout
    assert left.strip() == "", left
    assert _segments() - before == set()
