"""The layer's extension points, used from this file alone: a GEMM backend and a router defined and registered
here run end to end through :class:`~streamring.moe.ep_buffer.EPBuffer` on the emulated device (one PE on the
CPU, ``tests/helpers/emulated_device.py``), touching no package file.

* ``TorchReferenceExperts`` (``gemm="torch_reference"``): the expert GEMMs in plain torch, block by block over
  the ready range it reads on the host: L1 (gate and up), SwiGLU and the FP8 re-quantisation of the
  intermediate with 1x128 scales as the Triton path does, L2 times the routing weight, one bf16 rounding;
* ``softmax_top_k`` (``router="test_softmax_topk"``): softmax over the experts, the top k, renormalised; a
  plain function, so the producers run it and copy its answer (no kernel of its own).

Checked: the buffer resolves and runs both (their calls are counted), streamed output equals batch bitwise, and
both are within the FP8 path's tolerance of the float64 reference of the layer (which routes through the same
registered router). Also that a registration is refused where it would be ambiguous, and that a backend is
refused, by name, what its capabilities do not declare.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from emulated_device import EmulatedHeap  # noqa: E402
from ep_case import bits  # noqa: E402

from streamring.gemm.backends import (GemmBackend, backend, names, refuse_unsupported, register_backend,  # noqa: E402
                                      unregister_backend)
from streamring.moe.ep_buffer import EPBuffer  # noqa: E402
from streamring.moe.math import (MoEShape, dequantize_act_fp8, dequantize_weight_fp8_block,  # noqa: E402
                                 quantize_act_fp8)
from streamring.moe.reference import reference_forward_f64, reference_tolerance  # noqa: E402
from streamring.moe.routing import register_router, router_names, unregister_router  # noqa: E402
from streamring.moe.tuning import EPTuning  # noqa: E402
from streamring.moe.weights import MoEWeights  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU emulation of one PE")

FP8 = torch.float8_e4m3fn
CALLS = {"gemm": 0, "router": 0}


class TorchReferenceExperts(GemmBackend):
    """L1 + SwiGLU + FP8 re-quantisation and L2 x routing weight in plain torch (slow; tiny shapes only). It
    reads the ready range on the host, so it runs eagerly only (no CUDA graph): enough on the emulated device."""

    name = "torch_reference"  # capabilities: the defaults (no capped grid, no owner rows, every block size)

    def __init__(self, bc):
        self.bc = bc

    def compute(self, lo_index, hi_index, max_items, mw, *, max_ctas=None, expect_items=None, out=None,
                direct=None) -> None:
        refuse_unsupported(self.name, max_ctas=max_ctas, out=out, direct=direct)
        CALLS["gemm"] += 1
        bc, bm, inter = self.bc, self.bc.block_m, self.bc.shape.intermediate
        lo, hi = int(bc.ready_hi[lo_index]), int(bc.ready_hi[hi_index])
        for b in bc.ready_list[lo: lo + min(hi - lo, max_items)].tolist():
            e, n = int(bc.block_expert[b]), int(bc.block_rows[b])
            rows = slice(b * bm, b * bm + n)
            a = dequantize_act_fp8(bc.a[rows].view(FP8), bc.a_sf[rows])
            gu = a @ dequantize_weight_fp8_block(mw.w1[e], mw.w1_sf[e]).t()
            h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            h = dequantize_act_fp8(*quantize_act_fp8(h))
            y = (h @ dequantize_weight_fp8_block(mw.w2[e], mw.w2_sf[e]).t()) * bc.row_weight[rows, None]
            bc.y[rows] = y.to(torch.bfloat16)


def softmax_top_k(logits, bias, shape):
    """Softmax over the experts, the top ``shape.topk``, renormalised (row-local; ``bias`` is not read)."""
    CALLS["router"] += 1
    w, idx = torch.topk(torch.softmax(logits, dim=-1), shape.topk, dim=-1, sorted=True)
    return idx.to(torch.int64), w / w.sum(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def registered():
    register_backend(TorchReferenceExperts)
    register_router("test_softmax_topk", softmax_top_k)
    yield
    unregister_backend(TorchReferenceExperts.name)
    unregister_router("test_softmax_topk")


def test_a_backend_and_a_router_from_a_test_file_run_through_the_buffer(registered):
    assert "torch_reference" in names() and "test_softmax_topk" in router_names()
    shape = MoEShape(hidden=128, intermediate=128, num_experts=4, topk=2, router="test_softmax_topk",
                     weight_dtype="fp8", block_m=16).validate()
    mw = MoEWeights.random_fp8(shape, 5, "cpu")
    assert mw.correction_bias is None  # the router reads no correction bias, so random weights carry none
    buf = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=2, tokens_per_slot=16,
                   gemm="torch_reference", tuning=EPTuning(policy="serialized"))
    try:
        assert buf.gemm == "torch_reference" and buf.gemm_choice.source.startswith("asked for explicitly")
        w = buf.prepare_weights(mw)
        x = torch.randn(37, 128, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
        before = dict(CALLS)
        yb = buf.forward(x, w).clone()
        ys = buf.forward(x, w, streaming=True).clone()
        st = buf.status()
    finally:
        buf.close()
    assert st["violations"] == 0 and st["timeouts"] == 0 and st["bad_routes"] == 0, st
    # batch: one GEMM call; streamed: one per dispatch step (3 chunks), the last with the seal
    assert CALLS["gemm"] - before["gemm"] == 1 + 3, CALLS
    assert CALLS["router"] - before["router"] == 1 + 3, CALLS  # the producer routes each chunk it publishes
    assert torch.equal(bits(ys), bits(yb))
    ref = reference_forward_f64(x, mw, shape)
    rel = float((yb.double() - ref).norm() / ref.norm())
    assert rel < reference_tolerance(shape, fp8_blocks=True)[0], rel


def test_registrations_are_checked_and_capabilities_refuse_by_name(registered):
    with pytest.raises(ValueError, match="registered already"):
        register_backend(type("Other", (GemmBackend,), {"name": "torch_reference"}))
    with pytest.raises(ValueError, match="GemmBackend subclass"):
        register_backend(object)
    with pytest.raises(ValueError, match="other than 'auto'"):
        register_backend(type("Auto", (GemmBackend,), {"name": "auto"}))
    with pytest.raises(ValueError, match="registered already"):
        register_router("test_softmax_topk", softmax_top_k)
    with pytest.raises(ValueError, match="router must be one of .*got 'nope'"):
        MoEShape(hidden=128, intermediate=128, num_experts=4, topk=2, router="nope").validate()
    assert backend("torch_reference") is TorchReferenceExperts
    with pytest.raises(ValueError, match="'triton' is built in"):
        unregister_backend("triton")
    with pytest.raises(ValueError, match="max_ctas must be None for gemm='torch_reference'"):
        refuse_unsupported("torch_reference", max_ctas=4)
    with pytest.raises(ValueError, match=r"direct= .* not implemented for gemm='torch_reference' \(only for "
                                         r"\['triton'\]\)"):
        refuse_unsupported("torch_reference", direct=())
