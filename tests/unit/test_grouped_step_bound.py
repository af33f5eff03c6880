"""The GEMM grid bound of the ready order's grouped dispatch steps (``EPExperts.bound``) holds
for every grouping: the Triton GEMMs bound a step's ready range by it and would silently drop the blocks
past it. Random groupings of R sources over C chunks, random per-expert row counts, through the real block
allocator (``alloc_blocks``, the Triton interpreter off the GPU) and the seal decided on the device."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from streamring.moe import blocks as B  # noqa: E402
from streamring.moe.ep_experts import EPExperts  # noqa: E402
from streamring.moe.math import MoEShape  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bound(R, chunk, topk, E_loc, bc, j):
    me = SimpleNamespace(heap=SimpleNamespace(num_ranks=R), bc=bc, E_loc=E_loc)
    return EPExperts.bound(me, SimpleNamespace(chunk=chunk, steps=R), True, j)


def _groups(gen, R):
    """A random split of R sources into steps (each takes >= 1), padded with empty steps to R steps."""
    order = torch.randperm(R, generator=gen).tolist()
    cuts = sorted(torch.randperm(R - 1, generator=gen)[:int(torch.randint(0, R, (1,), generator=gen))].tolist())
    parts, last = [], 0
    for c in cuts + [R - 1]:
        parts.append(order[last:c + 1])
        last = c + 1
    return parts + [[]] * (R - len(parts))


@pytest.mark.parametrize("R,C,chunk,topk,E_loc,block_m", [(2, 1, 24, 4, 4, 16), (4, 3, 9, 4, 3, 16),
                                                          (8, 2, 5, 8, 2, 16)])
def test_no_grouped_step_makes_more_blocks_ready_than_its_bound(R, C, chunk, topk, E_loc, block_m):
    gen = torch.Generator().manual_seed(7 * R + C)
    shape = MoEShape(hidden=128, intermediate=128, num_experts=E_loc, topk=topk, router="softmax", block_m=block_m)
    bc = B.BlockConsumer(shape, R * C * chunk, C * R + 1, block_m, DEV)
    worst = 0.0
    for _ in range(3):
        bc.begin()
        pending = torch.zeros(1, dtype=torch.int64, device=DEV)
        step = 0
        for c in range(C):
            pending.fill_((1 << R) - 1)
            for j, srcs in enumerate(_groups(gen, R)):
                counts = torch.zeros(E_loc, dtype=torch.int32)
                for _src in srcs:
                    # each token of the source's chunk routes to at most min(topk, E_loc) distinct local experts
                    k = int(torch.randint(0, min(topk, E_loc) + 1, (1,), generator=gen))
                    for _tok in range(chunk):
                        counts[torch.randperm(E_loc, generator=gen)[:k]] += 1
                    pending.bitwise_and_(~(1 << _src))
                bc._alloc_blocks(counts.to(DEV), step + 1, seal=False)
                if c == C - 1:
                    bc.seal(step, if_none_pending=pending)
                made = int(bc.ready_hi[step + 1]) - int(bc.ready_hi[step])
                bound = _bound(R, chunk, topk, E_loc, bc, j)
                assert made <= bound, f"chunk {c} step {j} (sources {srcs}) made {made} blocks ready, bound {bound}"
                worst = max(worst, made / bound)
                step += 1
        assert int(pending.item()) == 0 and int(bc.state[E_loc + 2]) == 1  # every source taken, sealed once
    assert worst > 0.3  # the draws reach the bound's order, so the check is not vacuous


def test_the_bound_is_met_exactly_by_a_carried_fill_and_the_seal():
    """The worst case the bound is for: every expert carries block_m - 1 rows from the earlier chunk, then
    grouped step 1 of the last chunk takes the R - 1 sources left, completes two blocks per expert beyond its
    rows' own and seals. Any smaller bound (one block per expert less, or a step bounded by fewer sources)
    fails here."""
    R, chunk, E_loc, topk, block_m = 3, 9, 2, 2, 16  # every token routes to both local experts
    shape = MoEShape(hidden=128, intermediate=128, num_experts=E_loc, topk=topk, router="softmax", block_m=block_m)
    bc = B.BlockConsumer(shape, R * 2 * chunk, 2 * R + 1, block_m, DEV)
    bc.begin()
    pending = torch.zeros(1, dtype=torch.int64, device=DEV)
    rows = lambda tokens: torch.full((E_loc,), tokens, dtype=torch.int32, device=DEV)  # noqa: E731
    # chunk 0: one step takes the 3 sources (9 + 6 + 0 tokens): every expert holds 15 = block_m - 1 rows
    bc._alloc_blocks(rows(15), 1, seal=False)
    # chunk 1: step 0 takes a source with no tokens, step 1 the other two (9 tokens each) and seals
    pending.fill_(0b110)
    bc._alloc_blocks(rows(0), R + 1, seal=False)
    bc.seal(R, if_none_pending=pending)
    pending.zero_()
    bc._alloc_blocks(rows(2 * chunk), R + 2, seal=False)
    bc.seal(R + 1, if_none_pending=pending)
    made = int(bc.ready_hi[R + 2]) - int(bc.ready_hi[R + 1])
    assert made == E_loc * 3  # per expert: 33 rows, 2 full blocks and the sealed partial one
    assert made == _bound(R, chunk, topk, E_loc, bc, 1)
