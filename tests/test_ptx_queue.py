"""The persistent consumer's memory-ordering instructions in its sm_90 PTX (``tests/ptx_queue.py``).

Triton compiles for ``GPUTarget("cuda", 90, 32)`` without a GPU (its bundled ptxas); where the
installed Triton cannot, the test is skipped with the reason. The GPU machine's Triton is 3.6:
run ``/tmp/t36/bin/python tests/ptx_queue.py`` (or the same there) for that version.
"""

from __future__ import annotations

import pytest

import ptx_queue as PQ


@pytest.fixture(scope="module")
def ptx():
    try:
        return {bm: PQ.persistent_ptx(bm) for bm in (64, 16)} | {"publish": PQ.publish_ptx()}
    except Exception as exc:  # noqa: BLE001 - no CUDA backend or ptxas in this Triton
        pytest.skip(f"this Triton cannot compile sm_90 PTX here: {type(exc).__name__}: {exc}")


def test_every_ordering_instruction_is_where_the_protocol_needs_it(ptx):
    for bm in (64, 16):
        assert PQ.check_persistent(ptx[bm], bm) == [], f"block_m {bm}"
    assert PQ.check_publish(ptx["publish"]) == []


def test_the_checker_catches_a_missing_fence_and_a_non_coherent_load(ptx):
    """Negative controls on edited PTX text: the checks are not vacuous."""
    text = ptx[64]
    no_fence = "\n".join(l for l in text.splitlines() if "fence.acq_rel.gpu" not in l)
    assert any("l1_done release" in f for f in PQ.check_persistent(no_fence, 64))
    no_sc = "\n".join(l for l in text.splitlines() if "fence.sc.sys" not in l)
    assert any("arrived release" in f for f in PQ.check_persistent(no_sc, 64))
    nc = text.replace("ld.global.b32", "ld.global.nc.b32", 1)
    assert any("non-coherent" in f for f in PQ.check_persistent(nc, 64))
    unbroadcast = text.replace("ld.global.gpu.acquire.b32", "ld.global.gpu.relaxed.b32")
    assert any("acquire loads" in f for f in PQ.check_persistent(unbroadcast, 64))
