"""Everything knowable before the ranks start is checked there, once (exit 2, one message, no rank line):
the symmetric heap's size against the node (and on the ranks, every ``alloc``), the config against the
number of ranks, the ``--json`` path, the GPU backend's requirements."""

import os
import time

import pytest

from conftest import FileWatcher
from streamring.device.memcheck import Capacity, HeapSizeError, check_fits, fmt_bytes

RANK_LINE = "[streamring rank"


# ----------------------------------------------------------------------------------------------
# the heap's size
# ----------------------------------------------------------------------------------------------
def test_check_fits_gives_bytes_capacity_and_keys():
    shm = Capacity("free /dev/shm", 3_999, remedy="mount a larger /dev/shm")
    check_fits(1_000, 4, capacities=[Capacity("free /dev/shm", 4_000)])  # exactly fits
    with pytest.raises(HeapSizeError) as e:
        check_fits(1_000, 4, capacities=[shm], what="the ring", keys="ring.num_slots (now 4)")
    msg = str(e.value)
    assert "1,000 bytes per rank x 4 ranks = 4,000 bytes" in msg and "but free /dev/shm is 3,999 bytes" in msg, msg
    assert "ring.num_slots (now 4)" in msg and "mount a larger /dev/shm" in msg, msg
    # a per-rank reservation (NVSHMEM_SYMMETRIC_SIZE) is not shared by the ranks
    sym = Capacity("NVSHMEM_SYMMETRIC_SIZE", 1_000, per_rank=True)
    check_fits(1_000, 8, capacities=[sym])
    with pytest.raises(HeapSizeError, match="1,001 bytes per rank, but NVSHMEM_SYMMETRIC_SIZE is 1,000 bytes"):
        check_fits(1_001, 8, capacities=[sym])
    # the default capacities are this machine's: a petabyte per rank never fits
    with pytest.raises(HeapSizeError, match="MemAvailable|/dev/shm"):
        check_fits(1 << 50, 1)
    assert fmt_bytes(3 * 1024**3) == "3,221,225,472 bytes (3.0 GiB)"


@pytest.mark.parametrize("command,sets,key", [
    ("run", ["run.tokens_per_rank=1000000000"], "run.tokens_per_rank"),
    ("stress", ["ring.num_slots=4096", "ring.tokens_per_slot=1048576"], "ring.tokens_per_slot (now 1048576)"),
])
def test_oversized_heap_is_refused_before_any_rank_starts(cli, command, sets, key):
    args = [command]
    for s in sets:
        args += ["--set", s]
    t0 = time.monotonic()
    with FileWatcher(os.getpid()) as w:
        r = cli(*args, json_out=False, timeout=120)
    assert r.rc == 2, r
    assert time.monotonic() - t0 < 30, r  # no rank, no allocation
    assert r.err.count("needs ") == 1 and "per rank x 4 ranks = " in r.err and key in r.err, r
    assert RANK_LINE not in r.err and "Traceback" not in r.err, r
    assert not any(f.startswith("/dev/shm") for f in w.files), w.files  # MPI never started


def test_heap_alloc_checks_the_size_on_every_rank_and_stays_usable(mpirun):
    """The heap's own check (ranks started by mpirun) and the CLI's byte count of `run` against the real rings."""
    r = mpirun(2, "tests/helpers/mp_scenarios.py", "alloc_size_check", timeout=120)
    assert r.rc == 0 and "SCENARIO OK" in r.out, r


# ----------------------------------------------------------------------------------------------
# the config against the ranks, the --json path, the backend
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["run", "--ranks", 3], "num_experts must be divisible by num_ranks=3"),
    (["stress", "--ranks", 3, "--set", "stress.chunks_per_rank=[1, 2]"], "a list needs one entry per rank (3)"),
    (["stress", "--set", "stress.fault={rank: 7, at: ack}"], "stress.fault.rank must be in [0, 4)"),
    (["stress", "--json", "/nonexistent-dir-of-streamring/out.json"], "does not exist"),
], ids=["experts-vs-ranks", "list-length", "fault-rank", "json-dir"])
def test_launch_time_errors_once_before_ranks(cli, args, needle):
    t0 = time.monotonic()
    r = cli(*args, json_out=False, timeout=120)
    assert r.rc == 2, r
    assert r.err.count(needle) == 1 and RANK_LINE not in r.err and "launcher" not in r.err, r
    assert time.monotonic() - t0 < 30, r


def test_launch_time_errors_under_mpirun_are_printed_once(mpirun):
    r = mpirun(3, "-m", "streamring", "stress", "--set", "stress.tokens_per_chunk=[1, 2]")
    assert r.rc == 2 and r.err.count("one entry per rank") == 1 and RANK_LINE not in r.err, r


def test_nvshmem_without_a_gpu_is_one_clear_error(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = cli("run", "--backend", "nvshmem", json_out=False, timeout=120)
    assert r.rc == 2, r
    assert r.err.count("needs a CUDA GPU") == 1 and "Traceback" not in r.err and RANK_LINE not in r.err, r
    assert len(r.err.strip().splitlines()) <= 2, r



def test_pdl_is_refused_before_launch():
    """The EP GPU layer refuses ``pdl`` (see ring.policies.REFUSED_POLICIES): the run's config check says so
    before any rank starts, with the policies it offers; the host-verb path allows it."""
    from streamring.config import ConfigError, load_config
    from streamring.runner import check_run_job

    fp8 = ["backend=nvshmem", "nvshmem.progress=pdl", "layer.weight_dtype=fp8"]
    for ranks in (1, 2):
        with pytest.raises(ConfigError, match=r"nvshmem.progress=pdl is refused .* use one of \['serialized', "):
            check_run_job(load_config(None, fp8), ranks)
    check_run_job(load_config(None, fp8 + ["run.gpu_path=host_verbs"]), 2)
    check_run_job(load_config(None, ["backend=nvshmem", "nvshmem.progress=spin_kernel", "layer.weight_dtype=fp8"]), 2)
