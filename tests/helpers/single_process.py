"""The quantized pipeline of :mod:`streamring.moe.math` on all tokens at once in one process: the reference the
reference layer's distributed and streamed paths must equal bitwise per token (tests only; the package's float64
reference is :func:`streamring.moe.reference.reference_forward_f64`)."""

from __future__ import annotations

import torch

from streamring.moe.math import MoEShape, combine, expert_pool_forward, quantize_act_fp8
from streamring.moe.reference import _check_layer_inputs
from streamring.moe.routers import route
from streamring.moe.weights import MoEWeights


def batch_forward_single(x: torch.Tensor, weights: MoEWeights, shape: MoEShape,
                         return_routing: bool = False):
    """Single-process whole-batch forward of the quantized pipeline (reference
    for the distributed/streamed paths, which must match it bitwise per token).

    Steps: :func:`route` (float32, unquantized x) -> :func:`quantize_act_fp8`
    -> for each expert e, the rows routed to it in token order ->
    :func:`expert_pool_forward` with ``shape.block_m`` -> :func:`combine`.

    Args:
        x: ``[T, H]`` bf16 / float32 / float64, finite.
        weights: validated against ``shape``.
        shape: layer shape.
        return_routing: also return ``(topk_idx, topk_weights)``.
    Returns:
        ``y`` float32 ``[T, H]``, or ``(y, topk_idx, topk_weights)``.
    """
    _check_layer_inputs(x, weights, shape)
    topk_idx, topk_w = route(x, weights, shape)
    x_fp8, x_sf = quantize_act_fp8(x)
    t, k, h = x.shape[0], shape.topk, shape.hidden
    contrib = torch.zeros(t, k, h, dtype=torch.float32, device=x.device)
    for e in range(shape.num_experts):
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)  # row-major: token order
        if tok.numel() == 0:
            continue
        contrib[tok, slot] = expert_pool_forward(x_fp8[tok], x_sf[tok], e, weights,
                                                 shape.block_m)
    y = combine(contrib, topk_w, topk_idx)
    if return_routing:
        return y, topk_idx, topk_w
    return y
