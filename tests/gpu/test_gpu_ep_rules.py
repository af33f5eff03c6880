"""The EP layer's handoff rules on one GPU, each shown where a broken rule would change what is computed.

Needs a CUDA GPU and nvshmem4py (skips otherwise, with the reason). ``python tests/mutate.py --gpu``
plants a bug per rule and runs these tests in the mutated copy:

* a consumer that copies its rows slowly still gets its own chunk: the slot is acknowledged only after
  the copy (acknowledging first lets the owner overwrite the slot while the copy waits);
* the owner's arrival counters start from zero in every forward (a counter carried over lets the owner
  reduce before this forward's rows arrived, and counts past its expectation);
* the ring's self-test under stress: every acquired payload is the published one (spin and stream-wait
  consumers against a producer reusing 2 slots, thousands of graph replays; two PEs on two GPUs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ep_case import ep_env  # noqa: F401 - the module-scoped fixture `env`
from ep_case import bits, random_x
from gpu_skip import needs_gpu

ROOT = Path(__file__).resolve().parents[2]


pytestmark = [pytest.mark.gpu, needs_gpu("nvshmem.core", "cuda.core", "triton")]


def _buffer(heap, shape, T, policy, name, deadline_s):
    from streamring.moe.ep_buffer import EPBuffer
    from streamring.moe.tuning import EPTuning

    return EPBuffer(heap, shape, max_tokens_per_rank=T, num_slots=2, tokens_per_slot=40, gemm="triton",
                    deadline_s=deadline_s, tuning=EPTuning(block_m=16, policy=policy), name=name)


def _batch_out(heap, shape, mw, x):
    """The batch-ready path's output of ``x`` (Triton GEMMs, a buffer of its own), the reference of the
    streamed ones."""
    buf = _buffer(heap, shape, x.shape[0], "serialized", "rules-batch", 10.0)
    try:
        return buf.forward(x.clone(), buf.prepare_weights(mw)).clone()
    finally:
        buf.close()


def test_slow_copy_keeps_its_slot(env):
    """Each dispatch waits 2 ms (device side) before it copies its rows out of the slot, while the producer
    stream runs ahead (spin_kernel: 4 chunks through 2 slots, so chunk c + 2 reuses chunk c's slot). The
    slot's acknowledgement follows the copy, so the producer's reuse wait holds chunk c + 2 back and every
    copied row is chunk c's: the output equals the batch layer's bit for bit, in every replay."""
    import torch

    from streamring.device import kernels as DK

    heap, shape, mw = env
    T = 157
    buf = _buffer(heap, shape, T, "spin_kernel", "rules-slow-copy", 5.0)
    hold = torch.full((1,), 2_000_000, dtype=torch.int64, device=heap.device)
    real = buf.pipeline.experts.bc.dispatch_ep
    ring = buf.paths["stream"].ring

    def slow_copy(*args, **kw):
        DK.ep_delay(heap.lib, ring.stream_ref(torch.cuda.current_stream()), ns=int(hold.data_ptr()))
        return real(*args, **kw)

    buf.pipeline.experts.bc.dispatch_ep = slow_copy
    try:
        w = buf.prepare_weights(mw)
        x = random_x(shape, T, 21, heap.device)
        y = torch.zeros_like(x)
        buf.forward(x, w, streaming=True, out=y)
        g = buf.capture(x, w, y, streaming=True)
        for seed in (22, 23):
            x2 = random_x(shape, T, seed, heap.device)
            x.copy_(x2)
            y.fill_(float("nan"))
            st = buf.replay(g)
            want = _batch_out(heap, shape, mw, x2)
            assert torch.equal(bits(y), bits(want)), f"seed {seed}: a slowly copied chunk got other rows; {st}"
    finally:
        buf.close()


@pytest.mark.parametrize("policy", ["serialized", "spin_kernel"])
def test_arrival_counters_start_from_zero_every_forward(env, policy):
    """Three forwards with new inputs through one captured graph: the owner's arrived[chunk] counters are
    reset after each reduce, so every forward's reduce waits for exactly its own rows (a counter carried
    over passes the wait at once with stale rows, then counts past the expectation: RE_COMBINE_COUNT)."""
    import torch

    heap, shape, mw = env
    T = 101
    buf = _buffer(heap, shape, T, policy, "rules-counters", 2.0)
    try:
        w = buf.prepare_weights(mw)
        x = random_x(shape, T, 31, heap.device)
        y = torch.zeros_like(x)
        buf.forward(x, w, streaming=True, out=y)
        g = buf.capture(x, w, y, streaming=True)
        for seed in (32, 33, 34):
            x2 = random_x(shape, T, seed, heap.device)
            x.copy_(x2)
            y.fill_(float("nan"))
            st = buf.replay(g)  # raises on RE_COMBINE_COUNT / RE_COMBINE_TIMEOUT
            assert torch.equal(bits(y), bits(_batch_out(heap, shape, mw, x2))), f"seed {seed}; {st}"
            assert int(buf.pipeline.combine.arrived.abs().sum().item()) == 0, f"arrived counters left {buf.pipeline.combine.arrived.tolist()}"
    finally:
        buf.close()


def _gpu_check(tmp_path, pes: int, *args: str) -> list:
    out = tmp_path / f"gpu-check-{pes}.json"
    cmd = [sys.executable, "-m", "streamring", "gpu-check", "--json", str(out), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_COMM_WORLD", "HYDRA_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if pes > 1:
        from streamring.host.launch import _is_openmpi, find_mpiexec

        mpiexec = find_mpiexec()
        cmd = [mpiexec, "-n", str(pes), *(["--oversubscribe", "--bind-to", "none"] if _is_openmpi(mpiexec) else []),
               *cmd]
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0 and out.exists(), f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_ring_selftest_under_stress(tmp_path):
    """The device ring alone (``streamring gpu-check``): spin and stream-wait consumers check every word of
    every acquired payload against the pattern of its (source, generation) while the producer reuses 2
    slots; 3000 graph replays of 8 chunks each. On two GPUs it runs on two PEs too (NVLink loads)."""
    import torch

    args = ("--policies", "spin_kernel,stream_wait", "--replays", "3000", "--slots", "2", "--chunks", "8")
    runs = [_gpu_check(tmp_path, 1, *args)]
    if torch.cuda.device_count() >= 2:
        runs.append(_gpu_check(tmp_path, 2, *args))
    for rows in runs:
        bad = [(r["policy"], r.get("violations"), r.get("timeouts")) for r in rows if r.get("verdict") != "PASS"]
        assert not bad, f"payload or generation errors under stress: {bad}"
