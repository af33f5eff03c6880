"""The persistent expert consumer natively on one GPU, concurrently with its dispatch (skips without CUDA).

Run on the GPU machine (one H200; no NVSHMEM needed: the "PEs" are objects of one process, as in
``tests/helpers/queue_case.py``)::

    python -m pytest -q -s tests/gpu/test_gpu_persistent.py

``-s`` shows the timing lines. What runs:

* **timing** (DeepSeek-V3 expert shapes: hidden 7168, intermediate 2048, 256 experts over 2 PEs = 128
  local, top-8, 4096 tokens per PE, block_m 64): PE 0's blocks computed by the per-range path
  (``BlockConsumer.compute`` per ready range: 1 L1 + 1 L2 grid each, as ``EPBuffer``'s per-chunk consumer launches them)
  and by the persistent queue (one launch; SMs and SMs - 8 CTAs), for 1 chunk (batch) and 4 chunks;
  CUDA-event medians printed; the combine rows must be bitwise equal and the arrivals equal the routed
  rows. (GEMM-only: the dispatch runs before the timed part.)
* **concurrency**: the queue is launched FIRST on one stream while the dispatch runs on another after
  a ~20 ms sleep (``torch.cuda._sleep``), publishing each step and sealing: the correct queue waits
  and gives the per-range path's bits; ``claim-before-ready`` computes before the rows exist (its
  outputs or arrivals differ); ``l2-before-l1`` with the first group's L1 tiles stalled 2 ms computes
  L2 on stale h1 (outputs differ) while the correct queue waits for them; ``arrival-before-store`` is
  seen by an owner kernel on a third stream that acquires each chunk's arrival count and reads the
  rows at once (it finds unwritten rows; with the correct queue none).

Every kernel is compiled by a serial warm-up first: a module load while a kernel spins could hang.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch
from gpu_skip import needs_gpu

if not torch.cuda.is_available():
    # skipped here; but the modules imported below read it once, for every test module of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = [pytest.mark.gpu, needs_gpu()]

import triton  # noqa: E402 - a declared test dependency
import triton.language as tl  # noqa: E402

from queue_case import EPCase, R  # noqa: E402
from streamring.device.ringdesc import RS_WORDS, decode_status  # noqa: E402
from streamring.moe import blocks as B  # noqa: E402
from streamring.moe.weights import MoEWeights  # noqa: E402
from streamring.moe.bitwise import bit_difference, same_bits  # noqa: E402
from streamring.moe.math import MoEShape  # noqa: E402


@triton.jit
def _owner_watch_kernel(arrived_ptr, expected_ptr, rows_ptr, comb_ptr, comb_delta_ptr, out_ptr, max_spins,
                        H: tl.constexpr, ROWS: tl.constexpr):
    # one program per (owner, chunk): acquire arrived == expected, then read that chunk's rows AT ONCE
    # and count the NaN (never stored) elements; -1 if the count never came
    c = tl.program_id(0)
    want = tl.load(expected_ptr + c)
    seen = tl.atomic_add(arrived_ptr + c, 0, sem="acquire", scope="sys")
    spins = c * 0
    while (seen != want) & (spins < max_spins):
        seen = tl.atomic_add(arrived_ptr + c, 0, sem="acquire", scope="sys")
        spins += 1
    if seen == want:
        r = tl.arange(0, ROWS)
        owner = tl.load(rows_ptr + (c * ROWS + r) * 2)
        row = tl.load(rows_ptr + (c * ROWS + r) * 2 + 1)
        d = tl.load(comb_delta_ptr + tl.maximum(owner, 0))
        cols = tl.arange(0, 128)
        n = tl.sum(r * 0, axis=0)
        for h0 in range(0, H, 128):
            v = tl.load(comb_ptr + d[:, None] + tl.maximum(row, 0)[:, None] * H + h0 + cols[None, :],
                        mask=(owner >= 0)[:, None], other=0.0)
            # NaN from its bits (the interpreter's bf16 says NaN == NaN)
            b = v.to(tl.int16, bitcast=True).to(tl.int32)
            n += tl.sum(tl.sum((((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)).to(tl.int32), axis=1), axis=0)
        tl.store(out_ptr + c, n)
    else:
        tl.store(out_ptr + c, -1)


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(shape, tokens, chunk, block_m, seed=3, fw=None):
    fw = MoEWeights.random_fp8(shape, 7, DEV).fp8_blocks() if fw is None else fw
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    xs = [torch.randn(tokens, shape.hidden, generator=g, device=DEV).to(torch.bfloat16) for _ in range(R)]
    return EPCase(shape, fw, xs, chunk, block_m=block_m, dev=DEV)


def _median_ms(fn, reps):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _run_queue(case, q, combs, arrived, status, ctas, **kw):
    q.reset()
    for _, step, _ in case.steps[0]:
        q.publish(step)
    q.seal(case.nsteps)
    case.launch(q, 0, combs, arrived, status, ctas=ctas, deadline_ns=5 * 10**9, **kw)


@pytest.fixture(scope="module")
def deepseek():
    from bench.common import dsv3_shape

    shape = dsv3_shape(64)
    return shape, MoEWeights.random_fp8(shape, 7, DEV).fp8_blocks()


@pytest.mark.parametrize("chunks", [1, 4])
def test_deepseek_v3_sized_queue_against_per_range_path(deepseek, chunks):
    shape, fw = deepseek
    tokens = 4096
    case = _case(shape, tokens, tokens // chunks, 64, fw=fw)
    case.dispatch(0)
    case.seal(0)
    bc = case.pes[0].bc
    n = int(bc.ready_hi[case.nsteps + 1])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ref = case.combs()
    case.compute_per_range(0, ref)
    torch.cuda.synchronize()
    t_ref = _median_ms(lambda: case.compute_per_range(0, ref), 7)
    print(f"\n[persistent] DeepSeek-V3 experts, 128 local, top-8, {tokens} tokens/PE, {chunks} chunk(s), block_m 64: "
          f"{n} blocks, {int((bc.row_src >= 0).sum())} rows on PE 0; per-range path ({case.nsteps + 1} ranges x "
          f"L1+L2): {t_ref:.3f} ms")
    for ctas in (sms, sms - 8):
        got, arrived, status = case.combs(), case.arrived(), torch.zeros(RS_WORDS, dtype=torch.int64, device=DEV)
        q = case.queue(0, group=8)
        _run_queue(case, q, got, arrived, status, ctas)
        torch.cuda.synchronize()
        assert decode_status(status.cpu().tolist())["first_error"] is None
        for r in range(R):
            assert same_bits(got[r], ref[r]), bit_difference(got[r], ref[r], f"queue owner {r}", "per-range")
        assert torch.equal(arrived.cpu(), case.routed_rows(0))

        def once():
            arrived.zero_()
            _run_queue(case, q, got, arrived, status, ctas)
        t_q = _median_ms(once, 7)
        print(f"[persistent]   queue, {ctas} CTAs (one launch + reset/publish/seal): {t_q:.3f} ms "
              f"= {t_q / t_ref:.3f} x per-range")


# ---------------------------------------------------------------------------------------------------
# concurrency: the queue spins while the dispatch runs on another stream
# ---------------------------------------------------------------------------------------------------
SMALL = dict(hidden=1024, intermediate=512, num_experts=32, topk=4, router="deepseek_v3", n_group=4, topk_group=2,
             routed_scaling_factor=2.5, weight_dtype="fp8", block_m=64)


def _concurrent(case, inject, *, sleep_cycles=40_000_000, stall_l1_us=0, watch=False, witness_rows=None):
    """Launch the queue first (stream G), dispatch + publish + seal on stream D after a sleep; optionally an
    owner watcher on stream W (launched first). Returns (combs, arrived, status, watch counts)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    combs, arrived, status = case.combs(), case.arrived(), torch.zeros(RS_WORDS, dtype=torch.int64, device=DEV)
    q = case.queue(0, group=8)
    bc = case.pes[0].bc
    bc.begin()
    q.reset()
    torch.cuda.synchronize()
    g, d, w = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    watched = None
    if watch:
        expected = case.routed_rows(0).to(DEV).reshape(-1)
        rows, width = witness_rows
        watched = torch.zeros(R * case.C, dtype=torch.int32, device=DEV)
        with torch.cuda.stream(w):
            _owner_watch_kernel[(R * case.C,)](arrived, expected, rows, combs[0], case.comb_delta(combs, 0), watched,
                                               2 ** 24, H=case.shape.hidden, ROWS=width, num_warps=4)
    with torch.cuda.stream(g):
        case.launch(q, 0, combs, arrived, status, ctas=sms - 16, deadline_ns=5 * 10**9, inject=inject,
                    stall_l1_us=stall_l1_us)
    with torch.cuda.stream(d):
        torch.cuda._sleep(sleep_cycles)
        case.dispatch(0, on_step=q.publish)
        q.seal(case.seal(0))
    torch.cuda.synchronize()
    return combs, arrived, status, watched


def _watch_rows(case):
    """Per (owner, chunk): the (owner, combine row) pairs PE 0's experts write, padded with owner -1."""
    lo, hi = 0, case.pes[0].E_loc
    lists = []
    for r in range(R):
        for c in range(case.C):
            base, n = case.plan.chunk_tokens(r, c)
            idx = case.pes[r].idx[base:base + n].cpu()
            lists.append([(r, (base + t) * case.shape.topk + k) for t in range(n) for k in range(case.shape.topk)
                          if lo <= int(idx[t, k]) < hi])
    width = triton.next_power_of_2(max(1, max(len(x) for x in lists)))
    t = torch.full((len(lists), width, 2), -1, dtype=torch.int64)
    for i, x in enumerate(lists):
        if x:
            t[i, : len(x)] = torch.tensor(x)
    return t.to(DEV).contiguous(), width


@pytest.fixture(scope="module")
def small():
    shape = MoEShape(**SMALL)
    warm = _case(shape, 512, 128, 64, seed=1)
    ref_case = _case(shape, 512, 128, 64, seed=2)
    ref = ref_case.combs()
    ref_case.dispatch(0)
    ref_case.seal(0)
    ref_case.compute_per_range(0, ref)
    # compile every variant the tests launch, serially, before any concurrent run
    rows = _watch_rows(ref_case)  # the fresh cases route as ref_case: the same ROWS constexpr
    for inject, stall in (("none", 0), ("claim-before-ready", 0), ("none", 2000), ("l2-before-l1", 2000),
                          ("arrival-before-store", 0)):
        combs, arrived, status = warm.combs(), warm.arrived(), torch.zeros(RS_WORDS, dtype=torch.int64, device=DEV)
        warm.dispatch(0, on_step=None)
        warm.seal(0)
        q = warm.queue(0, group=8)
        _run_queue(warm, q, combs, arrived, status, 8, inject=inject, stall_l1_us=stall)
    _owner_watch_kernel[(1,)](arrived, torch.zeros(1, dtype=torch.int64, device=DEV), rows[0], combs[0],
                              warm.comb_delta(combs, 0), torch.zeros(1, dtype=torch.int32, device=DEV), 1,
                              H=shape.hidden, ROWS=rows[1], num_warps=4)
    torch.cuda._sleep(10)
    torch.cuda.synchronize()
    return shape, ref_case, ref


def _fresh(shape):
    return _case(shape, 512, 128, 64, seed=2)  # the reference's inputs, fresh (zeroed) buffers


def _equal_to_ref(case, combs, arrived, ref):
    return all(same_bits(combs[r], ref[r]) for r in range(R)) and torch.equal(arrived.cpu(), case.routed_rows(0))


def test_the_queue_waits_for_a_late_dispatch_and_equals_the_per_range_path(small):
    shape, _, ref = small
    case = _fresh(shape)
    combs, arrived, status, _ = _concurrent(case, "none")
    assert decode_status(status.cpu().tolist())["first_error"] is None
    for r in range(R):
        assert same_bits(combs[r], ref[r]), bit_difference(combs[r], ref[r], f"queue owner {r}", "per-range")
    assert torch.equal(arrived.cpu(), case.routed_rows(0))


def test_claim_before_ready_computes_before_the_rows_exist(small):
    shape, _, ref = small
    case = _fresh(shape)
    combs, arrived, status, _ = _concurrent(case, "claim-before-ready")
    assert not _equal_to_ref(case, combs, arrived, ref), "claim-before-ready went unnoticed"


def test_l2_before_l1_computes_on_stale_h1(small):
    shape, _, ref = small
    case = _fresh(shape)
    combs, arrived, status, _ = _concurrent(case, "none", sleep_cycles=1000, stall_l1_us=2000)
    assert decode_status(status.cpu().tolist())["first_error"] is None
    assert _equal_to_ref(case, combs, arrived, ref), "the correct queue with stalled L1 tiles differs"
    case = _fresh(shape)
    combs, arrived, status, _ = _concurrent(case, "l2-before-l1", sleep_cycles=1000, stall_l1_us=2000)
    assert not _equal_to_ref(case, combs, arrived, ref), "l2-before-l1 went unnoticed"


def test_arrival_before_store_is_seen_by_an_owner(small):
    # The mutant signals, pauses 200 us, then stores: the owner's read lands in that window unless the
    # watcher program was not running then. The correct queue must be clean on every try; the mutant
    # must be seen on one of three (a race that a scheduler may hide once, never three times running).
    shape, _, _ = small
    seen = []
    for attempt in range(3):
        for inject in ("none", "arrival-before-store"):
            case = _fresh(shape)
            rows = _watch_rows(case)
            _, _, status, watched = _concurrent(case, inject, sleep_cycles=1000, watch=True, witness_rows=rows)
            w = watched.cpu().tolist()
            assert -1 not in w, f"{inject}: an owner's arrival count never completed: {w}"
            print(f"\n[persistent] try {attempt}, {inject}: NaN elements an owner read right after each chunk's "
                  f"count completed: {w}")
            if inject == "none":
                assert sum(w) == 0, f"the correct queue let an owner read unwritten rows: {w}"
            else:
                seen.append(sum(w))
        if seen[-1] > 0:
            break
    assert seen[-1] > 0, f"arrival-before-store went unnoticed by the owner in {len(seen)} tries: {seen}"
