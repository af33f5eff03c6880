"""How the Triton expert GEMMs size their grids: plain constants (no torch), shared by the kernels' launcher
(``moe_triton._grid``) and the cost model, which prices the grids."""

#: Blocks per group of the Triton GEMMs' tile order (CTAs running together read one weight tile of a group's
#: blocks); a grid's expectation is rounded up to whole groups.
GROUP_BLOCKS = 8

#: CTAs per SM of a grid's looping tail (the blocks past a call's expectation): looping CTAs keep their
#: tiles, so 1 per SM runs them 1.18x slower than one CTA per tile (the L2 kernel fits two per SM); 2, 4 and 8
#: per SM ran 1.035-1.068x, within 1 % of each other (bench.empty_grid, one H200, with and without MPS,
#: docs/results/gemm-empty-grids-1h200-mps-2026-12-03.json). 4: when other kernels share the SMs, a CTA
#: that starts late holds a quarter of the tiles one per SM would give it, for about 1 µs of empty CTAs per
#: call (11 SM-µs per 72 CTAs).
TAIL_CTAS_PER_SM = 4

#: How many more routed rows than even routing gives a call its grid is sized for
#: (``grid_bounds.uniform_blocks`` scales a call's share of the routed rows by it before rounding up to full
#: blocks; the partial blocks, one per expert, are slack already): a block past the grid runs on the looping
#: tail about 5 % slower (TAIL_SLOWDOWN in the cost model: 50-75 SM-us of a block's 900-1,400), while an
#: expected block that never comes costs its empty CTAs (~11 SM-us), so a quarter more costs about 0.2 % of a
#: 4096-token forward's GEMMs under even routing and keeps a PE loaded a quarter past its share off the tail.
EXPECT_HEADROOM = 1.25

#: How the grids are sized, as result rows record it (``bench.ep_layer``; the cost model prices each row's
#: grids by it): "expected_headroom", one CTA per tile of :func:`grid_blocks` of the blocks a call is
#: expected to have with EXPECT_HEADROOM on its routed rows, and a looping tail for any past them
#: (``moe_triton._grid``); "expected", the same without the headroom (rows measured before it); "bound",
#: one CTA per tile of the call's bound (rows without the field).
GEMM_GRID = "expected_headroom"


def grid_blocks(expect_items: int, max_items: int, group: int = GROUP_BLOCKS) -> int:
    """The blocks a Triton grid launches one CTA per tile for when its call expects ``expect_items`` of at most
    ``max_items``: rounded up to the tile order's groups of ``group`` blocks (a whole number of groups: the
    looping tail starts at a group's first tile)."""
    return -(-min(max(0, int(expect_items)), max_items) // group) * group
