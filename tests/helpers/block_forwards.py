"""Forwards of the single-process block path that only the tests run: the batch-ready path on one consumer
(the reference a buffer's output must equal bitwise) and a float32 torch emulation of exactly what the kernels
compute (the reference the kernels must equal)."""

from __future__ import annotations

import torch

from streamring.moe.blocks import BlockConsumer, Producer, moe_forward
from streamring.moe.math import MoEShape, dequantize_act_fp8, dequantize_weight_fp8_block, quantize_act_fp8
from streamring.moe.routers import select_experts
from streamring.moe.weight_views import FP8BlocksView


def batch_forward(x, fw: FP8BlocksView, shape: MoEShape, prod: Producer, bc: BlockConsumer, scratch: dict,
                  out: torch.Tensor) -> None:
    """The batch-ready path: produce the whole batch, then one dispatch, seal and GEMM pass."""
    t = x.shape[0]
    idx, w = scratch["idx"][:t], scratch["w"][:t]
    q, sf = scratch["q"][:t], scratch["sf"][:t]
    prod.route(x, fw, shape, idx, w)
    prod.layout(x, q, sf)
    moe_forward(idx, w, q, sf, fw, bc, out)


def emulate_forward(x, fw: FP8BlocksView, shape: MoEShape) -> torch.Tensor:
    """Float32 torch emulation of exactly what the kernels compute: same routing,
    same activation and ``h`` quantization rules, per-(token, k) bf16 rows, k-ordered combine."""
    t, H = x.shape
    logits = x.float() @ fw.router.float().t()
    idx, w = select_experts(logits, fw.bias, shape)
    q, sf = quantize_act_fp8(x.float())
    xd = dequantize_act_fp8(q, sf)
    w1 = dequantize_weight_fp8_block(fw.w1, fw.w1_sf)
    w2 = dequantize_weight_fp8_block(fw.w2, fw.w2_sf)
    I = shape.intermediate
    out = torch.zeros(t, H, dtype=torch.float32)
    for tok in range(t):
        for j in range(shape.topk):
            e = int(idx[tok, j])
            gu = xd[tok] @ w1[e].t()
            h = torch.nn.functional.silu(gu[:I]) * gu[I:]
            hq, hs = quantize_act_fp8(h[None, :])
            y = (dequantize_act_fp8(hq, hs)[0] @ w2[e].t()) * w[tok, j]
            out[tok] += y.to(torch.bfloat16).float()
    return out.to(torch.bfloat16)
