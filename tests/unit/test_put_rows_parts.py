"""``ep_put_rows``'s CTAs per ready block (streamring.device.kernels.put_rows_parts) and the emulated kernel's
parts: a block's rows split over several CTAs copy the same rows and add the same counts."""

from __future__ import annotations

import numpy as np
import pytest

from streamring.device import kernels as DK


@pytest.mark.parametrize("block_m,max_items,parts", [
    (16, 2080, 1),   # the default block size at prefill: one CTA per block, as before
    (128, 288, 1),   # prefill (4096 tokens, 128-row blocks): max_items blocks already fill the grid
    (128, 48, 16),   # decode (256 tokens, 32 experts): few blocks, sixteen CTAs each
    (16, 94, 2),     # decode with 16-row blocks: never fewer than 8 rows a CTA
    (64, 255, 8),    # just under the split's bound
    (128, 200, 10),  # at most 2048 CTAs in all
    (32, 0, 4),
])
def test_parts_split_only_small_grids(block_m, max_items, parts):
    assert DK.put_rows_parts(block_m, max_items) == parts


def test_the_parts_can_be_fixed_for_an_a_b(monkeypatch):
    monkeypatch.setenv("STREAMRING_PUT_ROWS_PARTS", "1")
    assert DK.put_rows_parts(128, 48) == 1
    monkeypatch.setenv("STREAMRING_PUT_ROWS_PARTS", "0")
    with pytest.raises(ValueError, match="STREAMRING_PUT_ROWS_PARTS"):
        DK.put_rows_parts(128, 48)


def _arrays(block_m, blocks, hidden, seed=0):
    rng = np.random.default_rng(seed)
    rows = block_m * blocks
    src = np.zeros(rows, np.int32)
    src[rng.random(rows) < 0.2] = -1  # padding rows
    tok = rng.permutation(rows).astype(np.int64)
    chunk = (np.arange(rows) // (block_m // 2 + 3) % 3).astype(np.int32)  # runs that cross the parts' edges
    y = rng.integers(0, 2**16, size=(rows, hidden), dtype=np.uint16)
    return src, tok, chunk, y


@pytest.mark.parametrize("parts", [2, 5, 8])
def test_emulated_parts_copy_the_same_rows_and_counts(parts):
    from tests.helpers.emulated_device import EmulatedLibrary

    block_m, blocks, hidden = 64, 3, 16
    src, tok, chunk, y = _arrays(block_m, blocks, hidden)
    ready_list = np.array([2, 0, 1], np.int32)
    ready_hi = np.array([0, 3], np.int32)
    out = {}
    for p in (1, parts):
        comb = np.zeros(8 * 4 + block_m * blocks * hidden * 2, np.uint8)
        EmulatedLibrary().ep_put_rows(
            (blocks, p), d=0, comb=comb.ctypes.data, comb_peers=0, me=0, off_arrived=0, off_rows=32,
            y_stage=y.ctypes.data, hidden=hidden, ready_list=ready_list.ctypes.data, ready_hi=ready_hi.ctypes.data,
            lo_index=0, hi_index=1, row_src=src.ctypes.data, row_tok=tok.ctypes.data, row_chunk=chunk.ctypes.data,
            block_m=block_m)
        out[p] = comb.copy()
    assert np.array_equal(out[1], out[parts])
    counts = out[1][:32].view(np.uint64)
    assert counts[:3].sum() == (src >= 0).sum() > 0  # every valid row counted once
