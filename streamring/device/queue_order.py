"""The work-item order of the persistent expert consumer, in plain Python (no torch, no Triton).

The kernel (``streamring.device.persistent_moe``) computes the same mapping in Triton; the model
checker (``streamring.verify.queue``) and the tests use this one, and the tests compare the two.

A work item is (layer, ready-list position, 128-column N-tile). Claim index ``t`` (an atomic counter
shared by every CTA of the persistent grid) maps to an item in a fixed order over the ready list:

* positions are taken in groups of ``group`` consecutive positions, and inside a group's layer
  the position varies fastest (``pos = g * group + r % group``, ``tile = r // group``), so CTAs that
  claim consecutive items run the same weight tile on different blocks together (L2-cache reuse);
* the order of the phases is ``L1(0), L1(1), L2(0), L1(2), L2(1), ..., L1(n), L2(n - 1)``: each group's
  L2 items come after the NEXT group's L1 items, so by the time a CTA claims an L2 item of group g
  the L1 items of g were claimed a whole group earlier (they rarely still run);
* a claim whose position is not ready waits; after the seal, positions past the final count are
  no-ops and a claim at or past :func:`total_items` ends the CTA.

Why it cannot deadlock: every item depends only on items with a *smaller* claim index (an L2 item
of group g on the L1 items of g, all claimed earlier) and on the dispatch's publications, and a
claimed item belongs to a CTA that is running (it claimed it). See ``persistent_moe``'s docstring.
"""

from __future__ import annotations

L1, L2 = 0, 1
# the ready word (int32): number of ready positions, plus SEALED once the seal published the final count
SEALED = 1 << 30
COUNT_MASK = SEALED - 1
# the queue's int32 control words: [CLAIM] claim counter, [READY] ready word, then l1_done[cap], l2_done[cap]
CTRL_CLAIM, CTRL_READY = 0, 1
CTRL_WORDS = 4


def _check(nt1: int, nt2: int, group: int) -> None:
    for name, v in (("nt1", nt1), ("nt2", nt2), ("group", group)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def item_of(t: int, nt1: int, nt2: int, group: int) -> tuple[int, int, int]:
    """``(layer L1|L2, ready-list position, N-tile)`` of claim index ``t`` (see the module doc)."""
    _check(nt1, nt2, group)
    s1 = group * nt1
    pair = group * (nt1 + nt2)
    if t < s1:
        layer, g, r = L1, 0, t
    else:
        q, w = divmod(t - s1, pair)
        q += 1
        layer, g, r = (L1, q, w) if w < s1 else (L2, q - 1, w - s1)
    return layer, g * group + r % group, r // group


def total_items(n: int, nt1: int, nt2: int, group: int) -> int:
    """Claim indices of a forward with ``n`` ready positions: every claim ``t >= total_items`` ends a CTA.

    (The last pair's L1 items lie past ``n``: they are claimed and skipped, a few cheap no-ops.)"""
    _check(nt1, nt2, group)
    groups = -(-n // group)
    return group * nt1 + groups * group * (nt1 + nt2)


def item_order(n: int, nt1: int, nt2: int, group: int) -> list[tuple[int, int, int]]:
    """The items computed for ``n`` ready positions, in claim order (no-ops left out)."""
    out = []
    for t in range(total_items(n, nt1, nt2, group)):
        layer, pos, tile = item_of(t, nt1, nt2, group)
        if pos < n:
            out.append((layer, pos, tile))
    return out
