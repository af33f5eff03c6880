"""Pure math of one MoE layer (no communication, no ring).

This module is shared by the *batch* path (all tokens of a step are routed and
grouped at once) and the *streamed* path (tokens arrive in chunks through the
ring and are processed as they come).  Both paths must produce **bitwise
identical** per-token outputs when they are fed the same token rows, so every
computation here is written so that the result for one row depends only on that
row's own data, never on which other rows happen to be processed alongside it
or on the position of the row inside a batch.  The rules that make that hold:

* **Fixed-shape GEMMs.**  Expert matmuls always run on blocks of exactly
  ``block_m`` rows (callers / :func:`expert_pool_forward` zero-pad the last
  block); router matmuls always run on blocks of :data:`ROUTER_BLOCK_ROWS` rows.
  A BLAS library may pick a different kernel (and thus a different summation
  order) for a different ``M``; with ``M`` fixed the same kernel runs for every
  row.  On CPU the row count is additionally rounded up to a multiple of
  :data:`CPU_GEMM_ROW_QUANTUM` (16): with MKL 2024.2 we observed that for
  ``M == 7`` a row's result depended on its position in the block, while every
  multiple of 16 that we tried was position independent.
* **Row-wise transcendental functions on CPU.**  PyTorch's CPU elementwise
  kernels compute SIMD lanes with SLEEF and the loop tail with libm; the two can
  differ by one ulp, and which elements land in the tail depends on the tensor
  size and on the thread split.  On CPU ``silu`` and ``sigmoid`` are therefore
  applied one row at a time, so every row goes through the identical code path.
  (CUDA elementwise kernels evaluate the same functor for every element.)
  Plain ``+ - * /``, ``abs``, ``max``, ``clamp`` and dtype conversions are
  correctly rounded on every path and need no such care.
* **Fixed-order reductions over ``k``.**  Routing-weight normalisation and the
  final combine are explicit Python loops over ``j = 0..k-1`` of elementwise
  ops, never a reduction kernel whose order may vary.
* **TF32 must stay off** on CUDA (``torch.backends.cuda.matmul.allow_tf32``
  is False by default); otherwise the float32 path no longer matches the
  float64 reference within :func:`~streamring.moe.reference.reference_tolerance`.

Data formats
------------
* Activations on the ring are FP8 (``float8_e4m3fn``) with one float32 scale per
  token per 128 hidden columns (:func:`quantize_act_fp8`).
* Expert weights are either bf16 or FP8 with 128x128 block scales
  (:func:`quantize_weight_fp8_block`).  They are dequantized to float32 once and
  cached (:meth:`~streamring.moe.weights.MoEWeights.dequantized_expert`; the weights' home is
  :mod:`streamring.moe.weights`, which builds on this module).
* Routing is computed in float32 from the *unquantized* activations (:mod:`streamring.moe.routers`).

Every invalid input raises :class:`ValueError` whose message names the offending
argument and the allowed values or shape.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

# (the shape needs no torch: the launcher's pre-launch check validates a shape without it)
from .shape import QUANT_BLOCK, WEIGHT_DTYPES, MoEShape, _is_int

__all__ = ["FP8_DTYPE", "FP8_MAX", "QUANT_BLOCK", "ROUTER_BLOCK_ROWS", "CPU_GEMM_ROW_QUANTUM", "WEIGHT_DTYPES",
           "MoEShape", "quantize_weight_fp8_block", "dequantize_weight_fp8_block", "quantize_act_fp8",
           "dequantize_act_fp8", "expert_block_forward", "expert_pool_forward", "combine"]

#: FP8 storage dtype used for activations on the ring and for fp8 weights.
FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite magnitude of ``float8_e4m3fn``.
FP8_MAX = 448.0
#: Lower clamp of every amax before it becomes a scale (zero blocks -> zeros, not NaN).
AMAX_EPS = 1e-12
#: Router logits are computed on fixed blocks of this many rows (zero padded).
ROUTER_BLOCK_ROWS = 64
#: On CPU every GEMM's row count is rounded up to a multiple of this.
CPU_GEMM_ROW_QUANTUM = 16

_ACT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


# -- small helpers ----------------------------------------------------------- #
def _check_tensor(name: str, t, *, dtype=None, dtypes=None, shape=None, ndim=None) -> None:
    """Raise ValueError unless ``t`` is a tensor with the given dtype/shape."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _first_nonfinite_row(t: torch.Tensor) -> int:
    """Index of the first row of a 2-D tensor holding NaN/Inf, or -1."""
    bad = ~torch.isfinite(t.float() if t.dtype == FP8_DTYPE else t).all(dim=-1)
    if bool(bad.any()):
        return int(bad.nonzero()[0, 0])
    return -1


def _check_finite(name: str, t: torch.Tensor) -> None:
    tf = t.float() if t.dtype == FP8_DTYPE else t
    if not bool(torch.isfinite(tf).all()):
        raise ValueError(f"{name} must be finite (contains NaN/Inf)")


def _rowwise(fn, t: torch.Tensor) -> torch.Tensor:
    """Apply elementwise ``fn`` so that each row of 2-D ``t`` gets identical treatment.

    On CPU the function is applied one row at a time (see the module docstring:
    SIMD body and scalar tail of PyTorch CPU kernels may differ by an ulp).  On
    other devices it is applied to the whole tensor.
    """
    if t.device.type != "cpu" or t.shape[0] <= 1:
        return fn(t)
    out = torch.empty_like(t)
    for r in range(t.shape[0]):
        out[r] = fn(t[r].contiguous())
    return out


def _fixed_rows_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t`` for a fixed-shape ``a`` whose rows must be position independent.

    ``a`` is copied into a fresh contiguous buffer (so pointer alignment is the
    same on every call); on CPU its row count is rounded up with zero rows to a
    multiple of :data:`CPU_GEMM_ROW_QUANTUM`.  Returns ``a.shape[0]`` rows.
    """
    m = a.shape[0]
    mp = m
    if a.device.type == "cpu":
        q = CPU_GEMM_ROW_QUANTUM
        mp = ((m + q - 1) // q) * q
    buf = torch.zeros((mp, a.shape[1]), dtype=a.dtype, device=a.device)
    buf[:m] = a
    return torch.matmul(buf, b_t)[:m]


# --------------------------------------------------------------------------- #
# fp8 quantization
# --------------------------------------------------------------------------- #
def quantize_weight_fp8_block(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to float8_e4m3fn with one scale per 128x128 block.

    Args:
        w: floating tensor ``[..., R, C]`` with ``R % 128 == 0`` and
           ``C % 128 == 0``; must be finite.  Computation is in float32.
    Returns:
        ``(w_fp8 [..., R, C] float8_e4m3fn, scale [..., R/128, C/128] float32)``
        with ``scale = max(amax(block), 1e-12) / 448`` and
        ``w ~= w_fp8.float() * scale`` (see :func:`dequantize_weight_fp8_block`).
    """
    _check_tensor("w", w, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64))
    if w.dim() < 2 or w.shape[-1] % QUANT_BLOCK or w.shape[-2] % QUANT_BLOCK:
        raise ValueError(
            f"w must have shape [..., R, C] with R and C multiples of {QUANT_BLOCK}, "
            f"got {list(w.shape)}")
    _check_finite("w", w)
    *lead, r, c = w.shape
    wb = w.to(torch.float32).reshape(*lead, r // QUANT_BLOCK, QUANT_BLOCK, c // QUANT_BLOCK,
                                     QUANT_BLOCK)
    amax = wb.abs().amax(dim=(-3, -1)).clamp_min(AMAX_EPS)  # [..., R/128, C/128]
    scale = amax / FP8_MAX
    q = (wb / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(*lead, r, c), scale.contiguous()


def dequantize_weight_fp8_block(w_fp8: torch.Tensor, scale: torch.Tensor,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_weight_fp8_block`: ``w_fp8 * scale`` in ``dtype``.

    Args:
        w_fp8: float8_e4m3fn ``[..., R, C]``.
        scale: float32 ``[..., R/128, C/128]``.
        dtype: float32 or float64 result dtype (the product is computed in it).
    """
    _check_tensor("w_fp8", w_fp8, dtype=FP8_DTYPE)
    if w_fp8.dim() < 2 or w_fp8.shape[-1] % QUANT_BLOCK or w_fp8.shape[-2] % QUANT_BLOCK:
        raise ValueError(
            f"w_fp8 must have shape [..., R, C] with R and C multiples of {QUANT_BLOCK}, "
            f"got {list(w_fp8.shape)}")
    *lead, r, c = w_fp8.shape
    _check_tensor("scale", scale, dtype=torch.float32,
                  shape=(*lead, r // QUANT_BLOCK, c // QUANT_BLOCK))
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    wb = w_fp8.to(dtype).reshape(*lead, r // QUANT_BLOCK, QUANT_BLOCK, c // QUANT_BLOCK,
                                 QUANT_BLOCK)
    out = wb * scale.to(dtype)[..., :, None, :, None]
    return out.reshape(*lead, r, c)


def quantize_act_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to the ring format.

    One float32 scale per token per 128 hidden columns:
    ``x_sf[t, b] = max(amax(|x[t, 128b:128b+128]|), 1e-12) / 448`` and
    ``x_fp8 = clamp(x / x_sf, -448, 448)`` rounded to nearest-even
    float8_e4m3fn.  The computation is done in float32 (a float64 ``x`` is first
    rounded to float32).  An all-zero block gives zero codes and a tiny scale,
    so it dequantizes to exact zeros rather than NaN.

    Non-finite input is **rejected** (ValueError ``'x contains NaN/Inf at token
    i'``) instead of being propagated: a NaN/Inf would poison the block's scale
    (turning every element of the 128-column block into NaN or 0) and there is
    no meaningful fp8 encoding for it; failing loudly at the producer is the
    only way to locate the bad token.  Likewise a float64 value that overflows
    float32 is rejected.

    Args:
        x: ``[T, H]`` bf16 / float32 / float64, ``H % 128 == 0``.
    Returns:
        ``(x_fp8 [T, H] float8_e4m3fn, x_sf [T, H/128] float32)``, both contiguous.
    """
    _check_tensor("x", x, dtypes=_ACT_DTYPES, ndim=2)
    t, h = x.shape
    if h % QUANT_BLOCK != 0:
        raise ValueError(f"x must have shape [T, H] with H a multiple of {QUANT_BLOCK}, "
                         f"got {list(x.shape)}")
    bad = _first_nonfinite_row(x)
    if bad >= 0:
        raise ValueError(f"x contains NaN/Inf at token {bad}")
    xf = x.to(torch.float32)
    if x.dtype == torch.float64:
        bad = _first_nonfinite_row(xf)
        if bad >= 0:
            raise ValueError(f"x contains values outside the float32 range at token {bad}")
    xb = xf.reshape(t, h // QUANT_BLOCK, QUANT_BLOCK)
    amax = xb.abs().amax(dim=-1).clamp_min(AMAX_EPS)
    sf = amax / FP8_MAX
    q = (xb / sf[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(t, h).contiguous(), sf.contiguous()


def dequantize_act_fp8(x_fp8: torch.Tensor, x_sf: torch.Tensor) -> torch.Tensor:
    """Dequantize ring-format activations: ``x_fp8.float() * x_sf`` per 128 columns.

    Args:
        x_fp8: float8_e4m3fn ``[T, H]``, ``H % 128 == 0``.
        x_sf: float32 ``[T, H/128]``.
    Returns:
        float32 ``[T, H]`` (a fresh contiguous tensor).
    """
    _check_tensor("x_fp8", x_fp8, dtype=FP8_DTYPE, ndim=2)
    t, h = x_fp8.shape
    if h % QUANT_BLOCK != 0:
        raise ValueError(f"x_fp8 must have shape [T, H] with H a multiple of {QUANT_BLOCK}, "
                         f"got {list(x_fp8.shape)}")
    _check_tensor("x_sf", x_sf, dtype=torch.float32, shape=(t, h // QUANT_BLOCK))
    xb = x_fp8.to(torch.float32).reshape(t, h // QUANT_BLOCK, QUANT_BLOCK)
    return (xb * x_sf[..., None]).reshape(t, h)


# --------------------------------------------------------------------------- #
# expert compute
# --------------------------------------------------------------------------- #
def _check_expert_inputs(x_fp8, x_sf, e, weights, rows_name: str) -> None:
    # ``weights`` is a :class:`~streamring.moe.weights.MoEWeights`, recognised by what these functions read of it
    # (that module builds on this one, so the class is not imported here)
    if not all(hasattr(weights, a) for a in ("dequantized_expert", "hidden", "num_experts")):
        raise ValueError(f"weights must be a MoEWeights, got {type(weights).__name__}")
    h = weights.hidden
    _check_tensor("x_fp8" + rows_name, x_fp8, dtype=FP8_DTYPE, ndim=2)
    if x_fp8.shape[1] != h:
        raise ValueError(f"x_fp8{rows_name} must have shape [n, {h}] (hidden), "
                         f"got {list(x_fp8.shape)}")
    _check_tensor("x_sf" + rows_name, x_sf, dtype=torch.float32,
                  shape=(x_fp8.shape[0], h // QUANT_BLOCK))
    if not _is_int(e) or not 0 <= e < weights.num_experts:
        raise ValueError(f"e must be an int in [0, {weights.num_experts}), got {e!r}")


def expert_block_forward(x_fp8_block: torch.Tensor, x_sf_block: torch.Tensor, e: int,
                         weights) -> torch.Tensor:
    """SwiGLU expert ``e`` on one fixed-shape block of rows.

    ``out = (silu(x @ w1.T) * (x @ w3.T)) @ w2.T`` with ``x`` dequantized to
    float32, float32 dequantized weights, and the intermediate kept in float32.

    The block's row count ``block_m`` is the GEMM ``M``; callers must always use
    the same ``block_m`` (pad partial blocks with zero rows).  Under that
    contract a row's output is bitwise independent of the other rows of the
    block and of its position in the block (see the module docstring).

    Args:
        x_fp8_block: float8_e4m3fn ``[block_m, H]``.
        x_sf_block: float32 ``[block_m, H/128]``.
        e: expert index in ``[0, E)``.
        weights: the layer's :class:`~streamring.moe.weights.MoEWeights`.
    Returns:
        float32 ``[block_m, H]``.
    """
    _check_expert_inputs(x_fp8_block, x_sf_block, e, weights, "_block")
    if x_fp8_block.shape[0] < 1:
        raise ValueError("x_fp8_block must have shape [block_m, H] with block_m >= 1, got 0 rows")
    w1, w3, w2 = weights.dequantized_expert(e)
    dev = x_fp8_block.device
    if w1.device != dev:
        raise ValueError(f"x_fp8_block must be on the weights' device {w1.device}, got {dev}")
    x = dequantize_act_fp8(x_fp8_block, x_sf_block)  # fresh [bm, H] float32
    h1 = _fixed_rows_matmul(x, w1.t())
    h3 = _fixed_rows_matmul(x, w3.t())
    act = _rowwise(torch.nn.functional.silu, h1) * h3
    return _fixed_rows_matmul(act, w2.t())


def expert_pool_forward(x_fp8: torch.Tensor, x_sf: torch.Tensor, e: int,
                        weights, block_m: int) -> torch.Tensor:
    """Run expert ``e`` on all ``n`` rows routed to it, ``block_m`` rows at a time.

    Rows are split into consecutive blocks of ``block_m``; the last block is
    zero padded to ``block_m`` rows; each block goes through
    :func:`expert_block_forward`.

    Args:
        x_fp8: float8_e4m3fn ``[n, H]`` (n may be 0).
        x_sf: float32 ``[n, H/128]``.
        e: expert index.
        weights: the layer's :class:`~streamring.moe.weights.MoEWeights`.
        block_m: rows per block (>= 1).
    Returns:
        float32 ``[n, H]``.
    """
    _check_expert_inputs(x_fp8, x_sf, e, weights, "")
    if not _is_int(block_m) or block_m < 1:
        raise ValueError(f"block_m must be an int >= 1, got {block_m!r}")
    n, h = x_fp8.shape
    dev = x_fp8.device
    out = torch.empty(n, h, dtype=torch.float32, device=dev)
    for start in range(0, n, block_m):
        m = min(block_m, n - start)
        xb = torch.zeros(block_m, h, dtype=FP8_DTYPE, device=dev)
        sb = torch.zeros(block_m, h // QUANT_BLOCK, dtype=torch.float32, device=dev)
        xb[:m] = x_fp8[start:start + m]
        sb[:m] = x_sf[start:start + m]
        out[start:start + m] = expert_block_forward(xb, sb, e, weights)[:m]
    return out


# --------------------------------------------------------------------------- #
# combine
# --------------------------------------------------------------------------- #
def combine(contrib: torch.Tensor, topk_weights: torch.Tensor,
            topk_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weighted sum of the k expert outputs of every token, in fixed order.

    ``y[t] = sum_{j=0..k-1, topk_idx[t,j] != -1} topk_weights[t,j] * contrib[t,j]``
    computed as an explicit loop over ``j`` with one float32 multiply and one
    float32 add per term (no fused or reordered reduction), starting from 0.
    Routes with ``topk_idx == -1`` (masked/dropped) are skipped exactly, i.e.
    whatever ``contrib`` holds for them (even NaN) does not reach ``y``.

    Args:
        contrib: float32 ``[T, k, H]``; ``contrib[t, j]`` is the output of expert
            ``topk_idx[t, j]`` for token t.
        topk_weights: float32 ``[T, k]``.
        topk_idx: int64 ``[T, k]`` with values >= -1, or None (all routes valid).
    Returns:
        float32 ``[T, H]``.
    """
    _check_tensor("contrib", contrib, dtype=torch.float32, ndim=3)
    t, k, h = contrib.shape
    _check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(t, k))
    if topk_idx is not None:
        _check_tensor("topk_idx", topk_idx, dtype=torch.int64, shape=(t, k))
        if t * k and int(topk_idx.min()) < -1:
            raise ValueError("topk_idx values must be >= -1 (-1 = masked route)")
    y = torch.zeros(t, h, dtype=torch.float32, device=contrib.device)
    for j in range(k):
        term = contrib[:, j, :] * topk_weights[:, j:j + 1]
        if topk_idx is None:
            y = y + term
        else:
            valid = (topk_idx[:, j] >= 0)[:, None]
            y = torch.where(valid, y + term, y)
    return y
