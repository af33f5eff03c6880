"""The seal's ``call_from``: the range of the GEMM call that computes the partial blocks is laid out expert by
expert (each expert's partial block right after its full blocks), the same blocks with the same row counts as
without it, and nothing outside that range moves. Through the real block allocator (``alloc_blocks``, the Triton
interpreter off the GPU), with the seal decided on the device as the grouped dispatch step decides it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from streamring.moe import blocks as B  # noqa: E402
from streamring.moe.math import MoEShape  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _consumer(E, block_m, rows, steps, seal_by_expert=True):
    shape = MoEShape(hidden=128, intermediate=128, num_experts=E, topk=2, router="softmax", block_m=block_m)
    bc = B.BlockConsumer(shape, rows, steps + 1, block_m, DEV, seal_by_expert=seal_by_expert)
    bc.begin()
    return bc


def _run(step_counts, E, block_m, call_from_step, seal_by_expert=True):
    """Dispatch steps of ``step_counts`` (rows per expert), the last one sealing on the device (pending mask 0);
    ``call_from_step``: the seal's ``call_from`` as an offset back from the sealing step (None: not given)."""
    bc = _consumer(E, block_m, sum(int(c.sum()) for c in step_counts) + 1, len(step_counts), seal_by_expert)
    pending = torch.zeros(1, dtype=torch.int64, device=DEV)
    last = len(step_counts) - 1
    for i, counts in enumerate(step_counts):
        bc._alloc_blocks(counts.to(DEV), i + 1, seal=False)
    bc.seal(last, if_none_pending=pending,
            call_from=None if call_from_step is None else last - call_from_step)
    n = int(bc.ready_hi[last + 1])
    return bc, bc.ready_list[:n].tolist(), bc.ready_hi[:last + 2].tolist()


def _expert_runs(bc, ids):
    return bc.block_expert[torch.tensor(ids, dtype=torch.long, device=DEV)].tolist() if ids else []


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("back", [0, 1])
def test_the_sealing_range_is_laid_out_expert_by_expert(seed, back):
    gen = torch.Generator().manual_seed(seed)
    E, block_m = 5, 16
    step_counts = [torch.randint(0, 3 * block_m, (E,), generator=gen, dtype=torch.int32) for _ in range(3)]
    bc_plain, plain, hi_plain = _run(step_counts, E, block_m, None)
    bc, grouped, hi = _run(step_counts, E, block_m, back)
    assert hi == hi_plain, "the ready counts changed"
    lo = hi[len(step_counts) - 1 - back]
    # outside the call's range nothing moves; inside it the same blocks with the same routed rows
    assert grouped[:lo] == plain[:lo]
    assert sorted(grouped[lo:]) == sorted(plain[lo:])
    assert bc.block_rows[:len(grouped)].tolist() == bc_plain.block_rows[:len(plain)].tolist()
    ex = _expert_runs(bc, grouped[lo:])
    assert ex == sorted(ex), f"the range is not expert by expert: experts {ex}"
    for e in set(ex):
        mine = [b for b, x in zip(grouped[lo:], ex) if x == e]
        own = bc.expert_blocks[e].tolist()
        start = own.index(mine[0])
        assert own[start:start + len(mine)] == mine, f"expert {e}'s blocks out of its own order: {mine}"
        rows = bc.block_rows[torch.tensor(mine, device=DEV)].tolist()
        assert all(r == block_m for r in rows[:-1]), f"expert {e}: a partial block before a full one: {rows}"


def test_without_call_from_the_partial_blocks_stay_at_the_end():
    """The negative control of the check above: the allocator's own order puts every partial block after every
    full block of the step, which the expert-by-expert check rejects."""
    E, block_m = 3, 16
    counts = [torch.tensor([20, 40, 5], dtype=torch.int32)]  # full blocks of experts 0 and 1, then partials
    bc, plain, hi = _run(counts, E, block_m, None)
    ex = _expert_runs(bc, plain)
    assert ex != sorted(ex), ex
    bc, grouped, hi = _run(counts, E, block_m, 0)
    assert _expert_runs(bc, grouped) == [0, 0, 1, 1, 1, 2]


def test_a_consumer_without_seal_by_expert_keeps_the_allocators_order_given_call_from():
    """The consumer owns the layout choice (EPTuning.seal_by_expert reaches only its constructor): callers always
    pass ``call_from``, and ``seal_by_expert=False`` keeps the allocator's order."""
    E, block_m = 3, 16
    counts = [torch.tensor([20, 40, 5], dtype=torch.int32)]
    bc_plain, plain, _ = _run(counts, E, block_m, None)
    bc, off, _ = _run(counts, E, block_m, 0, seal_by_expert=False)
    assert off == plain
    assert _expert_runs(bc, off) == _expert_runs(bc_plain, plain) != [0, 0, 1, 1, 1, 2]


def test_a_seal_that_does_not_happen_moves_nothing():
    """A source still pending: the seal makes nothing ready and the dispatch's range keeps its order."""
    E, block_m = 3, 16
    bc = _consumer(E, block_m, 200, 2)
    bc._alloc_blocks(torch.tensor([40, 20, 33], dtype=torch.int32, device=DEV), 1, seal=False)
    before = bc.ready_list[:int(bc.ready_hi[1])].tolist()
    bc.seal(0, if_none_pending=torch.ones(1, dtype=torch.int64, device=DEV), call_from=0)
    assert bc.ready_list[:int(bc.ready_hi[1])].tolist() == before


def test_call_from_after_the_seal_is_refused():
    bc = _consumer(3, 16, 100, 2)
    with pytest.raises(ValueError, match="by_expert_from"):
        bc.seal(0, call_from=2)
