"""Routing a layer's tokens on the reference path: the router logits on fixed row blocks (:func:`route`) and the
built-in routers' rules in torch (``softmax_topk``, ``deepseek_v3``), registered by name in
:mod:`streamring.moe.routing`. Row-local and in fixed order, by the rules of :mod:`streamring.moe.math`."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .math import _ACT_DTYPES, ROUTER_BLOCK_ROWS, _check_tensor, _first_nonfinite_row, _fixed_rows_matmul, _rowwise
from .routing import router_of
from .shape import MoEShape
from .weights import MoEWeights

__all__ = ["select_experts", "softmax_topk", "deepseek_v3", "route", "route_f64"]


def _check_x(x, shape: MoEShape, name: str = "x") -> None:
    _check_tensor(name, x, dtypes=_ACT_DTYPES, ndim=2)
    if x.shape[1] != shape.hidden:
        raise ValueError(f"{name} must have shape [T, {shape.hidden}] (hidden), "
                         f"got {list(x.shape)}")
    bad = _first_nonfinite_row(x)
    if bad >= 0:
        raise ValueError(f"{name} contains NaN/Inf at token {bad}")


def _ordered_row_sum(w: torch.Tensor) -> torch.Tensor:
    """``sum_j w[:, j]`` accumulated left to right (fixed order), keepdim."""
    acc = w[:, 0:1].clone()
    for j in range(1, w.shape[1]):
        acc = acc + w[:, j:j + 1]
    return acc


def select_experts(logits: torch.Tensor, correction_bias: Optional[torch.Tensor], shape: MoEShape
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts and their weights from router ``logits`` ``[T, E]`` by the router ``shape.router`` names
    (:mod:`streamring.moe.routing`: its ``select``), used by :func:`route` (CPU/torch path, float32 or float64
    logits). The GPU producers run the same router through ``streamring.moe.blocks.select_experts_into`` (the
    built-in ones in one kernel; ``tests/unit/test_blocks.py`` holds the two equal). Returns ``(topk_idx int64
    [T, k], topk_weights [T, k])`` in the dtype of ``logits``.
    """
    return router_of(shape.router).function()(logits, correction_bias, shape)


def softmax_topk(logits: torch.Tensor, correction_bias: Optional[torch.Tensor], shape: MoEShape
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``softmax_topk`` router: ``p = softmax(logits)``; ``topk_idx, w = topk(p, k)``; if
    ``shape.renormalize``, ``w /= sum(w)`` (the sum in the fixed order j = 0..k-1). Row-local; no bias."""
    k = shape.topk
    probs = torch.softmax(logits, dim=-1)
    topk_w, topk_idx = torch.topk(probs, k, dim=-1, sorted=True)
    if shape.renormalize:
        topk_w = topk_w / _ordered_row_sum(topk_w)
    return topk_idx.to(torch.int64), topk_w.contiguous()


def deepseek_v3(logits: torch.Tensor, correction_bias: Optional[torch.Tensor], shape: MoEShape
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``deepseek_v3`` router: ``s = sigmoid(logits)``; ``sel = s + correction_bias`` (0 if None); group
    score = sum of the top-2 ``sel`` of each of ``n_group`` groups (the single value if a group holds one
    expert); keep the ``topk_group`` best groups, mask the other experts' ``sel`` to -inf;
    ``topk_idx = topk(sel, k)``; ``w = s[topk_idx]``; if ``norm_topk_prob`` ``w /= (sum(w) + 1e-20)``;
    ``w *= routed_scaling_factor``. Sums over the k weights run in the fixed order j = 0..k-1. Row-local."""
    t, e = logits.shape
    k = shape.topk
    dev, dtype = logits.device, logits.dtype
    scores = _rowwise(torch.sigmoid, logits)
    if correction_bias is not None:
        sel = scores + correction_bias.to(device=dev, dtype=dtype)[None, :]
    else:
        sel = scores
    g = shape.n_group
    epg = e // g
    grouped = sel.reshape(t, g, epg)
    if epg == 1:
        group_scores = grouped[..., 0]
    else:
        top2 = torch.topk(grouped, 2, dim=-1, sorted=True).values
        group_scores = top2[..., 0] + top2[..., 1]
    group_idx = torch.topk(group_scores, shape.topk_group, dim=-1, sorted=True).indices
    group_mask = torch.zeros(t, g, dtype=torch.bool, device=dev)
    group_mask.scatter_(1, group_idx, True)
    expert_mask = group_mask[:, :, None].expand(t, g, epg).reshape(t, e)
    sel_masked = sel.masked_fill(~expert_mask, float("-inf"))
    topk_idx = torch.topk(sel_masked, k, dim=-1, sorted=True).indices
    topk_w = scores.gather(1, topk_idx)
    if shape.norm_topk_prob:
        topk_w = topk_w / (_ordered_row_sum(topk_w) + 1e-20)
    topk_w = topk_w * shape.routed_scaling_factor
    return topk_idx.to(torch.int64), topk_w.contiguous()


def route(x: torch.Tensor, weights: MoEWeights, shape: MoEShape,
          dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Select experts and routing weights for each token.

    Computed in ``dtype`` (float32 for the runtime, float64 for the reference)
    from the *unquantized* ``x``: ``logits = x @ router_weight.T``.  Logits are
    computed on fixed blocks of :data:`ROUTER_BLOCK_ROWS` zero-padded rows, so a
    token's routing is bitwise independent of the other tokens in ``x``. The
    experts and weights are the router's (:func:`select_experts`).

    Args:
        x: ``[T, H]`` bf16 / float32 / float64, finite.
        weights: layer weights (router_weight, correction_bias are used).
        shape: layer shape.
        dtype: torch.float32 or torch.float64.
    Returns:
        ``(topk_idx int64 [T, k], topk_weights dtype [T, k])``.
    """
    if not isinstance(shape, MoEShape):
        raise ValueError(f"shape must be a MoEShape, got {type(shape).__name__}")
    shape.validate()
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    _check_x(x, shape)
    e, k = shape.num_experts, shape.topk
    if weights.router_weight.shape != (e, shape.hidden):
        raise ValueError(f"weights.router_weight must have shape [{e}, {shape.hidden}], "
                         f"got {list(weights.router_weight.shape)}")
    if weights.correction_bias is not None and weights.correction_bias.shape != (e,):
        raise ValueError(f"weights.correction_bias must have shape [{e}], "
                         f"got {list(weights.correction_bias.shape)}")
    t = x.shape[0]
    dev = x.device
    if t == 0:
        return (torch.empty(0, k, dtype=torch.int64, device=dev),
                torch.empty(0, k, dtype=dtype, device=dev))

    rw_t = weights.router_weight.to(device=dev, dtype=dtype).t()
    xd = x.to(dtype)
    blocks = []
    for start in range(0, t, ROUTER_BLOCK_ROWS):
        chunk = xd[start:start + ROUTER_BLOCK_ROWS]
        buf = torch.zeros(ROUTER_BLOCK_ROWS, shape.hidden, dtype=dtype, device=dev)
        buf[:chunk.shape[0]] = chunk
        blocks.append(_fixed_rows_matmul(buf, rw_t)[:chunk.shape[0]])
    logits = torch.cat(blocks, dim=0)  # [T, E]

    return select_experts(logits, weights.correction_bias, shape)


def route_f64(x: torch.Tensor, weights: MoEWeights, shape: MoEShape
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` in float64 (reference): returns ``(int64 [T,k], float64 [T,k])``."""
    return route(x, weights, shape, dtype=torch.float64)
