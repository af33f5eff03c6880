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

#: How the grids are sized, as result rows record it (``bench.ep_layer``; the cost model prices each row's
#: grids by it): "expected", one CTA per tile of the blocks a call is expected to have and a looping tail for
#: any past them (``moe_triton._grid``); rows without it were measured with one CTA per tile of the call's
#: bound ("bound").
GEMM_GRID = "expected"
