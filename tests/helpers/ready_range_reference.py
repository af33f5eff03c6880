"""Pure-Python references of what the device makes of a ready range (``ready_list[ready_hi[lo_index] :
ready_hi[hi_index]]``): the CUTLASS setup kernel's groups (``gemm.cutlass``) and DeepGEMM's
``m_indices`` (``gemm.deep_gemm.ready_m_indices``). Both share one reading of the range and its status
bits (``gemm.cutlass.STATUS_BITS``); the tests compare the device with these."""

from __future__ import annotations


def ready_items(ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, block_expert,
                num_experts: int) -> tuple[list, int]:
    """``(items, status)``: each item of the (clamped) range as ``(block id, expert)``, or None where the
    block id or its expert is out of range; ``status`` ORs the STATUS_BITS of what was wrong. A range
    outside the list or negative gives no items. Takes lists or CPU tensors."""
    rl = [int(v) for v in ready_list]
    be = [int(v) for v in block_expert]
    hv = [int(v) for v in ready_hi]
    lo, hi = hv[lo_index], hv[hi_index]
    status, n = 0, hi - lo
    if n > 0 and (lo < 0 or hi > len(rl)):
        status |= 16
        n = 0
    if n < 0:
        status |= 2
        n = 0
    if n > max_items:
        status |= 1
        n = max_items
    items = []
    for i in range(n):
        b = rl[lo + i]
        if not 0 <= b < len(be):
            status |= 4
            items.append(None)
        elif not 0 <= be[b] < num_experts:
            status |= 8
            items.append(None)
        else:
            items.append((b, be[b]))
    return items, status


def ready_groups(ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, block_expert, block_m: int,
                 num_experts: int) -> tuple[list[tuple[int, int, int]], int]:
    """What the CUTLASS setup kernel makes of a ready range: ``([(m_rows, row0, expert), ...], status)``.
    Runs of consecutive block ids of one expert become one group; invalid items break runs. Groups
    ``len(result) .. max_items-1`` have ``m = 0``."""
    items, status = ready_items(ready_list, ready_hi, lo_index, hi_index, max_items, block_expert, num_experts)
    groups: list[list[int]] = []  # [first_bid, expert, blocks]
    prev = None
    for it in items:
        if it is not None and prev is not None and it[0] == prev[0] + 1 and it[1] == prev[1]:
            groups[-1][2] += 1
        elif it is not None:
            groups.append([it[0], it[1], 1])
        prev = it
    return [(nb * block_m, b * block_m, e) for b, e, nb in groups], status


def m_indices(ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, block_expert, num_experts: int,
              block_m: int) -> tuple[list[int], int]:
    """``gemm.deep_gemm.ready_m_indices`` in plain Python: ``(m_indices, status)``, the expert on every row of
    a ready block, -1 elsewhere."""
    items, status = ready_items(ready_list, ready_hi, lo_index, hi_index, max_items, block_expert, num_experts)
    per_block = [-1] * len(block_expert)
    for it in items:
        if it is not None:
            per_block[it[0]] = it[1]
    return [e for e in per_block for _ in range(block_m)], status
