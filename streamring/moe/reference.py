"""The layer's one float64 reference, what every path of the layer is checked against, and its one tolerance rule:
:func:`reference_forward_f64` (the model in float64, written independently of the kernels and of
:mod:`streamring.moe.math`; all tokens or the ones asked for), :func:`reference_tolerance` (how far a path may be
from it: the float32 pipeline element-wise, the FP8 block path by norm) and :func:`compare_to_reference`
(the element-wise comparison, skipping routing flips)."""

from __future__ import annotations

import math as _math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .math import QUANT_BLOCK, MoEShape, _check_tensor, quantize_act_fp8
from .routers import _check_x, route
from .weights import MoEWeights

__all__ = ["reference_forward_f64", "reference_tolerance", "ReferenceComparison",
           "compare_to_reference"]


# --------------------------------------------------------------------------- #
# whole-layer paths
# --------------------------------------------------------------------------- #
def _check_layer_inputs(x: torch.Tensor, weights: MoEWeights, shape: MoEShape) -> None:
    """The whole-layer paths' argument checks (ValueError naming the argument)."""
    if not isinstance(shape, MoEShape):
        raise ValueError(f"shape must be a MoEShape, got {type(shape).__name__}")
    if not isinstance(weights, MoEWeights):
        raise ValueError(f"weights must be a MoEWeights, got {type(weights).__name__}")
    weights.validate(shape)
    _check_x(x, shape)


def _dequant_f64_reference(w: torch.Tensor, s: Optional[torch.Tensor]) -> torch.Tensor:
    """float64 dequantization written independently of dequantize_weight_fp8_block."""
    wd = w.to(torch.float64)
    if s is None:
        return wd
    sd = s.to(torch.float64).repeat_interleave(QUANT_BLOCK, dim=-2)
    sd = sd.repeat_interleave(QUANT_BLOCK, dim=-1)
    return wd * sd


def reference_forward_f64(x: torch.Tensor, weights: MoEWeights, shape: MoEShape,
                          return_routing: bool = False, routing: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                          tokens=None):
    """Independent float64 reference of the layer (no blocks, no caches).

    * routing: :func:`route` with ``dtype=torch.float64`` from the unquantized x;
    * activations: ``quantize_act_fp8(x)`` (the ring format is part of the
      model), dequantized in float64;
    * weights: dequantized in float64 (exact: fp8 x float32 scale fits in a
      double);
    * per expert: ``(silu(x w1^T) * (x w3^T)) w2^T`` in float64 over all its
      tokens at once, accumulated into y with the float64 routing weights.

    Expected difference of a path to it: :func:`reference_tolerance` (the
    float32 pipeline element-wise; the FP8 block path, which re-quantizes the
    intermediate, by norm).  Tokens whose selected experts differ between
    float32 and float64 routing (near-ties) must be excluded from an
    element-wise comparison (:func:`compare_to_reference`).

    ``routing=(topk_idx, topk_weights)`` replaces the router (a given routing,
    e.g. a synthetic one; masked routes ``-1`` contribute nothing).
    ``tokens`` (indices into ``x``, e.g. a sample of a large batch): the
    reference of those tokens only (``routing`` is indexed likewise); every
    token's reference depends on that token alone, so it equals those rows
    of the whole batch's.

    Returns:
        ``y`` float64 ``[T, H]`` (``[len(tokens), H]``), or
        ``(y, topk_idx_f64, topk_weights_f64)``.
    """
    _check_layer_inputs(x, weights, shape)
    if tokens is not None:
        x = x[tokens]
        routing = None if routing is None else (routing[0][tokens], routing[1][tokens])
    if routing is None:
        idx, w = route(x, weights, shape, dtype=torch.float64)
    else:
        idx, w = routing[0].to(torch.int64), routing[1].to(torch.float64)
    x_fp8, x_sf = quantize_act_fp8(x)
    t, h = x.shape
    xd = x_fp8.to(torch.float64) * x_sf.to(torch.float64).repeat_interleave(QUANT_BLOCK, dim=1)
    y = torch.zeros(t, h, dtype=torch.float64, device=x.device)
    for e in range(shape.num_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w1 = _dequant_f64_reference(weights.w1[e], None if weights.w1_scale is None
                                    else weights.w1_scale[e])
        w3 = _dequant_f64_reference(weights.w3[e], None if weights.w3_scale is None
                                    else weights.w3_scale[e])
        w2 = _dequant_f64_reference(weights.w2[e], None if weights.w2_scale is None
                                    else weights.w2_scale[e])
        xe = xd[tok]
        a = torch.nn.functional.silu(xe @ w1.T) * (xe @ w3.T)
        out = a @ w2.T
        y.index_add_(0, tok, out * w[tok, slot][:, None])
    if return_routing:
        return y, idx, w
    return y


#: the FP8 block path's relative Frobenius bound (:func:`reference_tolerance` says why)
_FP8_BLOCKS_REL_TOL = 0.03


def reference_tolerance(shape: MoEShape, *, fp8_blocks: bool = False) -> Tuple[float, float]:
    """``(rtol, atol)``: how far a path of the layer may be from :func:`reference_forward_f64`.

    ``fp8_blocks=True``: the FP8 block path (the kernels of the expert-parallel
    layer), whose intermediate is re-quantized to FP8 e4m3 (up to 2^-4 relative
    per element, about 1.4 % over a layer) and whose outputs are rounded to
    bf16: ``(0.03, 0.0)``, a bound on the relative Frobenius error over the
    compared tokens, ``||y - y_ref|| <= rtol * ||y_ref||`` (an element-wise bound
    would not hold where the terms cancel).

    Otherwise the float32 pipeline, element-wise
    (``|y - y_ref| <= atol + rtol * |y_ref|``, :func:`compare_to_reference`).
    Both sides use the same fp8-quantized activations and the same stored
    weights, so the *only* differences are float32 rounding in the fp32 path
    (routing is compared separately: tokens whose expert set differs are
    excluded).  With unit roundoff ``u = 2**-24`` the error sources are:

    * dequantizing x and the weights to float32 (one rounding each, relative u);
    * the gate/up dot products over H terms and the down dot product over I
      terms; float32 accumulation of n random-signed terms has an error that
      grows like ``sqrt(n) * u * sum|terms|`` (the worst case ``n * u`` is never
      approached by BLAS kernels, which additionally block the sum);
    * silu / sigmoid / softmax (a few ulp), the routing dot product over H, and
      the k-term combine.

    The total path length is ``n = H + I + k``; we take
    ``rtol = max(1e-5, 16 * sqrt(n) * u)`` (16 = margin for the max over
    ``T*H`` elements, about 5 standard deviations, times ~3 for the chained
    error sources), e.g. 1.3e-5 for H=256, I=256 and 9e-5 for H=7168, I=2048.
    ``atol = rtol`` because the error is proportional to the magnitude of the
    summed terms rather than to the (possibly cancelled) output; this assumes
    O(1) outputs as produced by :meth:`MoEWeights.random` with O(1) inputs —
    scale ``atol`` by the output magnitude for other weights.
    """
    if not isinstance(shape, MoEShape):
        raise ValueError(f"shape must be a MoEShape, got {type(shape).__name__}")
    shape.validate()
    if fp8_blocks:
        return _FP8_BLOCKS_REL_TOL, 0.0
    n = shape.hidden + shape.intermediate + shape.topk
    rtol = max(1e-5, 16.0 * _math.sqrt(n) * 2.0 ** -24)
    return rtol, rtol


@dataclass
class ReferenceComparison:
    """Result of :func:`compare_to_reference`.

    Attributes:
        ok: all compared elements satisfy ``|y - y_ref| <= atol + rtol * |y_ref|``.
        num_tokens: T.
        num_compared: tokens compared (same expert set in f32 and f64 routing).
        num_excluded: tokens excluded because routing differs.
        excluded_tokens: their indices.
        max_abs_err: max ``|y - y_ref|`` over compared tokens.
        max_err_ratio: max of ``|y - y_ref| / (atol + rtol*|y_ref|)`` (ok iff <= 1).
        worst_token: token of that maximum (-1 if nothing compared).
        rtol, atol: tolerances used.
    """

    ok: bool
    num_tokens: int
    num_compared: int
    num_excluded: int
    excluded_tokens: List[int]
    max_abs_err: float
    max_err_ratio: float
    worst_token: int
    rtol: float
    atol: float

    def __str__(self) -> str:
        return (f"ReferenceComparison(ok={self.ok}, compared={self.num_compared}/"
                f"{self.num_tokens}, excluded={self.num_excluded} (routing differs), "
                f"max_abs_err={self.max_abs_err:.3g}, max_err_ratio={self.max_err_ratio:.3g} "
                f"at token {self.worst_token}, rtol={self.rtol:.3g}, atol={self.atol:.3g})")


def _tolerances(shape: Optional[MoEShape], rtol: Optional[float], atol: Optional[float]) -> tuple:
    """``(rtol, atol)``: the given ones, else :func:`reference_tolerance` of ``shape``, else 1e-4 each."""
    d_rtol, d_atol = reference_tolerance(shape) if shape is not None else (1e-4, 1e-4)
    rtol, atol = d_rtol if rtol is None else rtol, d_atol if atol is None else atol
    if not (rtol >= 0 and atol >= 0):
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    return rtol, atol


def compare_to_reference(y: torch.Tensor, y_ref: torch.Tensor, topk_idx_f32: torch.Tensor,
                         topk_idx_f64: torch.Tensor, *, shape: Optional[MoEShape] = None,
                         rtol: Optional[float] = None, atol: Optional[float] = None
                         ) -> ReferenceComparison:
    """Compare a float32 output to the float64 reference, skipping routing flips.

    A token is excluded when the *set* of its selected experts differs between
    float32 and float64 routing (a near-tie flipped); a mere reordering of the
    same experts is compared (it only changes the float32 summation order).

    Args:
        y: ``[T, H]`` output of the float32 pipeline.
        y_ref: ``[T, H]`` output of :func:`reference_forward_f64`.
        topk_idx_f32, topk_idx_f64: int64 ``[T, k]`` routing of both paths.
        shape: if given and rtol/atol are None, use :func:`reference_tolerance`.
        rtol, atol: explicit tolerances (default 1e-4 each without ``shape``).
    Returns:
        :class:`ReferenceComparison` (check ``.ok``; ``str()`` for a report).
    """
    _check_tensor("y", y, dtypes=(torch.float32, torch.float64), ndim=2)
    _check_tensor("y_ref", y_ref, dtypes=(torch.float32, torch.float64), shape=tuple(y.shape))
    t = y.shape[0]
    _check_tensor("topk_idx_f32", topk_idx_f32, dtype=torch.int64, ndim=2)
    if topk_idx_f32.shape[0] != t:
        raise ValueError(f"topk_idx_f32 must have shape [{t}, k], got {list(topk_idx_f32.shape)}")
    _check_tensor("topk_idx_f64", topk_idx_f64, dtype=torch.int64,
                  shape=tuple(topk_idx_f32.shape))
    rtol, atol = _tolerances(shape, rtol, atol)
    same = (topk_idx_f32.sort(dim=1).values == topk_idx_f64.to(topk_idx_f32.device)
            .sort(dim=1).values).all(dim=1)
    excluded = (~same).nonzero().flatten().tolist()
    yd = y.to(torch.float64)
    rd = y_ref.to(device=y.device, dtype=torch.float64)
    err = (yd - rd).abs()
    ratio = err / (atol + rtol * rd.abs())
    same_d = same.to(y.device)
    keep = same_d[:, None].expand_as(err)
    n_cmp = int(same_d.sum())
    if n_cmp and y.shape[1]:
        err_k = torch.where(keep, err, torch.zeros_like(err))
        ratio_k = torch.where(keep, ratio, torch.zeros_like(ratio))
        max_abs = float(err_k.max())
        row_max = ratio_k.amax(dim=1)
        worst = int(row_max.argmax())
        max_ratio = float(row_max[worst])
        if _math.isnan(max_abs) or _math.isnan(max_ratio):
            max_abs, max_ratio = float("nan"), float("nan")
    else:
        max_abs, max_ratio, worst = 0.0, 0.0, -1
    ok = bool(max_ratio <= 1.0) if not _math.isnan(max_ratio) else False
    return ReferenceComparison(ok=ok, num_tokens=t, num_compared=n_cmp,
                               num_excluded=len(excluded), excluded_tokens=excluded,
                               max_abs_err=max_abs, max_err_ratio=max_ratio, worst_token=worst,
                               rtol=float(rtol), atol=float(atol))
