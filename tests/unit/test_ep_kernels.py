"""The data kernels of the expert-parallel GPU layer: index arithmetic, on any machine.

``ep_triton.ep_gather`` / ``ep_place_rows`` read every source's slot through per-source
distances (``delta``), ``expert_l2(direct=...)`` stores every result row into its owner's
combine rows through per-owner distances, ``combine_owner`` reduces a token's k rows. Here the
"copies" that would be other PEs' symmetric buffers are separate tensors of this process, so
the distances and offsets these kernels compute are exercised under Triton's CPU interpreter
(natively on a GPU). This tests *kernel arithmetic only*: the protocol between real PEs (the
generations, acknowledgements, arrival counts) runs on real processes on the GPU machine
(``launch/gpu_check.sh``, ``tests/gpu/test_gpu_ep.py``), never here.

Checked: the dispatch of R = 2 sources' chunks into one PE's expert blocks equals, row for
row, what the single-source block path computes; the owners' reduced outputs equal the
single-process batch output bitwise, for several chunkings; routes to other PEs, masked
routes, rows past a source's valid count and corrupt ids (E, -2) are never copied (corrupt
ones are counted); padding rows of sealed blocks are never stored into an owner.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

import queue_case  # noqa: E402
from block_forwards import batch_forward  # noqa: E402
from conftest import quick_subset  # noqa: E402
from streamring.device import ep_triton as K  # noqa: E402
from streamring.device import moe_triton as MT  # noqa: E402
from streamring.moe import blocks as B  # noqa: E402
from streamring.moe.weights import MoEWeights  # noqa: E402
from streamring.moe.math import MoEShape  # noqa: E402
from streamring.ring.layout import RingLayout, StreamPlan  # noqa: E402
from bench import block_paths  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py says why)
R = 2


def shape_() -> MoEShape:
    return MoEShape(hidden=256, intermediate=256, num_experts=8, topk=3, router="deepseek_v3", n_group=4,
                    topk_group=2, routed_scaling_factor=2.5, weight_dtype="fp8", block_m=16)


class FakePE(queue_case.FakePE):
    """One 'PE' of the data path (``queue_case.FakePE``: its ring copy, its expert blocks, its routing) with
    its combine rows, poisoned: every routed (token, k) row must be written."""

    def __init__(self, me, shape, fw_full, layout, tokens, chunk, num_steps):
        super().__init__(me, shape, fw_full, layout, tokens, chunk, num_steps, 16, DEV)
        self.comb = torch.full((max(tokens) * shape.topk, shape.hidden), float("nan"), dtype=torch.bfloat16,
                               device=DEV)


def run_ep(shape, fw, xs, chunk, corrupt=None, per_source=False, grouped=None, pull="route"):
    """Every fake PE produces its chunks, dispatches every source's chunk (at once, or one source per
    dispatch step in a PE-specific order: the ready-order path), runs its blocks (L2 straight into
    the owners' combine rows), then every owner reduces. Returns the outputs.

    ``grouped`` (a list of R-long source lists, -1 padded, one per dispatch step of every chunk): the
    ready order's grouped steps (``ring_wait_any`` with ``max_take`` = R): each step's list has R
    places, the step that leaves no source pending in the last chunk seals on the device
    (``seal(if_none_pending=...)``) and its GEMM call has the partial blocks; the closing seal then
    makes nothing ready. Every -1 place must gather as "not mine" (checked here). ``pull``: as
    :meth:`BlockConsumer.dispatch_ep` takes it."""
    tokens = [x.shape[0] for x in xs]
    plan = StreamPlan(epoch=1, tokens_per_rank=tuple(tokens), tokens_per_slot=chunk)
    C = max(1, plan.num_chunks)
    layout = RingLayout(num_ranks=R, num_slots=C, tokens_per_slot=chunk, hidden=shape.hidden, topk=shape.topk,
                        num_experts=shape.num_experts)
    steps = len(grouped) if grouped is not None else (R if per_source else 1)
    pes = [FakePE(r, shape, fw, layout, tokens, chunk, C * steps) for r in range(R)]
    pending = torch.zeros(1, dtype=torch.int64, device=DEV)
    valid_tab = torch.tensor([[plan.chunk_tokens(r, c)[1] for r in range(R)] for c in range(C)], dtype=torch.int32,
                             device=DEV)
    src_all = torch.arange(R, dtype=torch.int32, device=DEV)
    for p in pes:
        p.bc.begin()
    for c in range(C):  # every chunk in its own slot: no reuse needed here
        for r, p in enumerate(pes):
            base, n = plan.chunk_tokens(r, c)
            if n:
                idx, w, q, sf = p.views(c, n)
                prod = B.Producer(n, shape.num_experts, DEV)
                prod.route(xs[r][base:base + n], fw, shape, idx, w)
                prod.layout(xs[r][base:base + n], q, sf)
                p.idx[base:base + n].copy_(idx)
                if corrupt is not None and r == 1:
                    corrupt(idx)
        for p in pes:
            L = layout
            delta = torch.tensor([q.ring.data_ptr() - p.ring.data_ptr() for q in pes], dtype=torch.int64, device=DEV)
            comb_delta = torch.tensor([(q.comb.data_ptr() - p.comb.data_ptr()) // 2 for q in pes], dtype=torch.int64,
                                      device=DEV)
            p.comb_delta = comb_delta
            # rank order: one dispatch of every source; per source: one step per source, the PE's
            # own chunk last on PE 0 and first on PE 1 (an arbitrary order, as the device decides)
            groups = [src_all] if not per_source else [src_all[j:j + 1] for j in (range(R) if p.me else range(R - 1, -1, -1))]
            if grouped is not None:
                groups = [torch.tensor(g, dtype=torch.int32, device=DEV) for g in grouped]
                pending.fill_((1 << R) - 1)
            for j, srcs in enumerate(groups):
                n = srcs.shape[0] * chunk * shape.topk
                step = c * len(groups) + j
                K.ep_gather(p.ring.view(torch.int64), p.ring.view(torch.float32), delta // 8, delta // 4, srcs,
                            valid_tab, c, p.me * p.E_loc, L.topk_idx_off(c) // 8, L.topk_weights_off(c) // 4,
                            p.flat_e[:n], p.flat_w[:n], p.bad, num_ranks=R, tokens_per_slot=chunk, topk=shape.topk,
                            local_experts=p.E_loc, num_experts=shape.num_experts)
                if grouped is not None:
                    for place, src in enumerate(grouped[j]):
                        per = chunk * shape.topk
                        if src < 0:
                            assert (p.flat_e[place * per:(place + 1) * per] == p.E_loc).all(), \
                                f"a -1 place of step {step} gathered routes"
                p.bc.dispatch_ep(c, p.flat_e[:n], p.flat_w[:n], srcs, (p.ring, p.ring.view(torch.float32)),
                                 (delta, delta // 4), (L.x_off(c), L.x_sf_off(c) // 4), step=step, pull=pull)
                if grouped is not None:
                    for src in grouped[j]:
                        if src >= 0:
                            pending.bitwise_and_(~(1 << src))
                    if c == C - 1:
                        p.bc.seal(step, if_none_pending=pending)
                p.bc.compute(step, step + 1, p.bc.max_blocks, p.fw, out=p.comb,
                             direct=(p.bc.row_src, p.bc.row_tok, comb_delta))
    for p in pes:
        n = C * steps
        p.bc.seal(n)
        if grouped is not None:  # the device-decided seal already made every partial block ready
            assert int(p.bc.ready_hi[n + 1]) == int(p.bc.ready_hi[n]), "a second seal made blocks ready again"
        p.bc.compute(n, n + 1, p.bc.max_blocks, p.fw, out=p.comb, direct=(p.bc.row_src, p.bc.row_tok, p.comb_delta))
    outs = []
    for r, p in enumerate(pes):
        out = torch.zeros(tokens[r], shape.hidden, dtype=torch.bfloat16, device=DEV)
        K.combine_owner(p.comb[: tokens[r] * shape.topk], p.idx[: tokens[r]], out, topk=shape.topk)
        outs.append(out)
    return outs, pes


def single_batch(shape, fw, x):
    T = x.shape[0]
    bc = B.BlockConsumer(shape, T, 2, 16, DEV)
    y = torch.zeros_like(x)
    batch_forward(x, fw, shape, B.Producer(T, shape.num_experts, DEV), bc, block_paths.scratch_buffers(shape, T, DEV), y)
    return y


@pytest.fixture(scope="module")
def setup():
    shape = shape_()
    fw = MoEWeights.random_fp8(shape, 11, DEV).fp8_blocks()
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(t, shape.hidden, generator=g).to(torch.bfloat16).to(DEV) for t in (9, 5)]
    refs = [single_batch(shape, fw, x) for x in xs]
    return shape, fw, xs, refs


@pytest.fixture(scope="module")
def ep_runs(setup):
    """``ep_runs(chunk, per_source)``: :func:`run_ep`'s ``(outs, pes)`` for the module's inputs in the plain
    dispatch orders, run once per (chunk, order) in a module and shared by the tests that check them (they
    only read the outputs, counters and block bookkeeping)."""
    shape, fw, xs, _ = setup
    runs = {}

    def run(chunk, per_source=False):
        if (chunk, per_source) not in runs:
            runs[chunk, per_source] = run_ep(shape, fw, xs, chunk, per_source=per_source)
        return runs[chunk, per_source]

    return run


def _bits(t):
    return t.contiguous().view(torch.int16)


EP_CASES = [(9, False), (4, False), (1, False), (4, True)]


@pytest.mark.parametrize("chunk,per_source", quick_subset(
    EP_CASES, quick=[(4, True)], reason="Triton's CPU interpreter runs the GPU kernels here, 1 to 3 s a case on 2 cores",
    ids=[f"{c}-{p}" for c, p in EP_CASES]))
def test_ep_data_path_equals_the_single_process_batch_bitwise(setup, ep_runs, chunk, per_source):
    shape, fw, xs, refs = setup
    outs, pes = ep_runs(chunk, per_source)
    for r in range(R):
        assert torch.equal(_bits(outs[r]), _bits(refs[r])), f"owner {r}, chunk {chunk}: differs from the batch path"
        assert int(pes[r].bad.item()) == 0
    # every (token, k) row of every owner was written exactly where the owner reads it (poisoned otherwise)
    for r, p in enumerate(pes):
        n = xs[r].shape[0] * shape.topk
        assert not torch.isnan(p.comb[:n].float()).any(), f"owner {r}: a routed (token, k) row was never stored"


GROUPED = {"all-in-one-step": [[1, 0], [-1, -1]], "one-per-step": [[1, -1], [0, -1]]}
GROUPED_CASES = [(9, "all-in-one-step", "route"), (4, "one-per-step", "token"), (4, "all-in-one-step", "token")]


@pytest.mark.parametrize("chunk,grouping,pull", quick_subset(
    GROUPED_CASES, quick=[(4, "all-in-one-step", "token")],
    reason="Triton's CPU interpreter runs the GPU kernels here, 1 to 3 s a case on 2 cores"))
def test_grouped_ready_steps_equal_the_single_process_batch_bitwise(setup, ep_runs, chunk, grouping, pull):
    """The ready order's grouped steps: -1 places of a step's source list dispatch nothing, the seal
    decided on the device (no source pending after the last chunk's step) puts the partial blocks into
    that step's GEMM call, and the closing seal adds nothing; every row is still stored once."""
    shape, fw, xs, refs = setup
    outs, pes = run_ep(shape, fw, xs, chunk, grouped=GROUPED[grouping], pull=pull)
    ref_pes = ep_runs(chunk, per_source=True)[1]
    for r in range(R):
        assert torch.equal(_bits(outs[r]), _bits(refs[r])), f"owner {r}, chunk {chunk}: differs from the batch path"
        assert int(pes[r].bad.item()) == 0
    total_routes = sum(x.shape[0] for x in xs) * shape.topk
    assert sum(int((p.bc.row_src >= 0).sum()) for p in pes) == total_routes
    # no block was allocated for a -1 place: the same blocks as a source per step (rows of one expert from the
    # same sources, whatever the grouping), so nothing is computed and thrown away
    E = pes[0].E_loc
    assert [int(p.bc.state[E]) for p in pes] == [int(q.bc.state[E]) for q in ref_pes]


def test_a_seal_with_a_source_pending_makes_nothing_ready():
    """The conditional seal (``seal(if_none_pending=...)``) waits for an empty mask; an unconditional seal
    after it seals once."""
    shape = shape_()
    bc = B.BlockConsumer(shape, 8, 3, 16, DEV)
    bc.begin()
    counts = torch.zeros(shape.num_experts, dtype=torch.int32, device=DEV)
    counts[0], counts[3] = 5, 20  # expert 0: one partial block; expert 3: one full block and a partial one
    bc._alloc_blocks(counts, 1, seal=False)
    assert int(bc.ready_hi[1]) == 1
    pending = torch.tensor([2], dtype=torch.int64, device=DEV)
    bc.seal(1, if_none_pending=pending)
    assert int(bc.ready_hi[2]) == 1, "sealed while a source was pending"
    pending.zero_()
    bc.seal(2, if_none_pending=pending)
    assert int(bc.ready_hi[3]) == 3
    assert sorted(bc.block_rows[bc.ready_list[1:3].long()].tolist()) == [4, 5]
    bc.seal(3)
    assert int(bc.ready_hi[4]) == 3, "a second seal made the partial blocks ready again"


def test_corrupt_routes_are_counted_and_never_indexed(setup):
    shape, fw, xs, _ = setup
    E = shape.num_experts

    def corrupt(idx):
        idx[0, 0] = E       # one past the last expert
        idx[-1, -1] = -2    # below the masked marker

    outs, pes = run_ep(shape, fw, xs, 9, corrupt=corrupt)
    # both PEs read source 1's chunk: each counts both corrupt ids once
    assert [int(p.bad.item()) for p in pes] == [2, 2]
    # the corrupt routes were dropped (no row copied for them, nothing stored for them)
    rows_expected = sum(int((p.flat_e < p.E_loc).sum()) for p in pes)
    assert rows_expected == sum(int((p.bc.row_src >= 0).sum()) for p in pes)


@pytest.mark.slow(reason="Triton's CPU interpreter runs the GPU kernels here, 1 to 3 s a case on 2 cores")
def test_rows_past_valid_and_other_pes_routes_are_not_dispatched(setup, ep_runs):
    shape, fw, xs, _ = setup
    _, pes = ep_runs(4)
    total_routes = sum(x.shape[0] for x in xs) * shape.topk  # every (token, k), each served by exactly one PE
    assert sum(int((p.bc.row_src >= 0).sum()) for p in pes) == total_routes
    for p in pes:  # every copied row is one of this PE's experts' and has a valid owner and combine row
        rows = (p.bc.row_src >= 0).nonzero().flatten()
        srcs, toks = p.bc.row_src[rows].long(), p.bc.row_tok[rows]
        assert ((srcs >= 0) & (srcs < R)).all()
        for s in range(R):
            sel = srcs == s
            assert (toks[sel] < xs[s].shape[0] * shape.topk).all()


@pytest.mark.slow(reason="Triton's CPU interpreter runs the GPU kernels here, 1 to 3 s a case on 2 cores")
def test_the_bitwise_check_catches_a_wrong_owner_distance(setup, monkeypatch):
    """Negative control: L2 rows stored with the owner distances of the wrong PE (every row into the
    consumer's own combine rows) are caught by the comparison above."""
    shape, fw, xs, refs = setup
    real = MT.expert_l2

    def wrong_owner(*a, direct=None, **kw):
        if direct is not None:
            direct = (direct[0], direct[1], torch.zeros_like(direct[2]))
        return real(*a, direct=direct, **kw)

    monkeypatch.setattr(MT, "expert_l2", wrong_owner)
    outs, _ = run_ep(shape, fw, xs, 9)
    assert not all(torch.equal(_bits(outs[r]), _bits(refs[r])) for r in range(R))
