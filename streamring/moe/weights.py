"""One layer's weights from a model's tensors: bf16/float experts, or FP8 checkpoint tensors as they are.

Two ways in, both returning a :class:`~streamring.moe.math.MoEWeights` that a buffer's
``prepare_weights`` takes once per layer:

* :func:`weights_from_float`: bf16 / float16 / float32 expert weights (a bf16 checkpoint, a model's
  parameters), quantised here to FP8 e4m3 with one float32 scale per 128x128 block
  (:func:`~streamring.moe.math.quantize_weight_fp8_block`), or kept in bf16.
* :func:`weights_from_fp8`: FP8 checkpoint tensors, taken bit for bit: ``weight`` float8_e4m3fn
  ``[out, in]`` with its ``weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``
  (DeepSeek-V3's FP8 checkpoints, transformers' ``FineGrainedFP8``).

**The scale convention.** ``weight_scale_inv`` is a dequantisation *multiplier*:
``w ~= weight.float() * weight_scale_inv`` per 128x128 block (transformers' ``Fp8Dequantize``
multiplies by it; its ``Fp8Quantize`` stores ``weight_scale_inv = 1 / (448 / amax)`` and quantises
``w * 448 / amax``). :class:`MoEWeights`' ``w*_scale`` is the same quantity (``amax / 448``,
dequantised as ``w_fp8 * scale``), so the checkpoint's tensor becomes ``w*_scale`` unchanged.
Two differences are harmless: an all-zero block gets ``1.0`` there and ``1e-12 / 448`` here
(zero codes either way), and ``1 / (448 / amax)`` may differ from ``amax / 448`` in the last bit
(the scale is used as stored). UE8M0 scales (``float8_e8m0fnu``, powers of two) are widened to
float32 exactly.

The expert arguments take a stacked tensor ``[E, out, in]`` or anything indexable by expert id that
gives ``[out, in]`` tensors (a list of a checkpoint's per-expert tensors, a lazy sequence): only the
experts kept (``experts=``, e.g. a rank's ``buffer.local_experts``) are read. The router stays global.

Roles in a SwiGLU expert: ``gate`` (``w1``, ``[I, H]``), ``up`` (``w3``, ``[I, H]``), ``down``
(``w2``, ``[H, I]``): ``down(silu(gate(x)) * up(x))``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from .math import FP8_DTYPE, QUANT_BLOCK, WEIGHT_DTYPES, MoEWeights, quantize_weight_fp8_block

__all__ = ["weights_from_float", "weights_from_fp8", "ExpertTensors"]

#: A stacked ``[E, out, in]`` tensor, or anything indexable by expert id giving ``[out, in]`` tensors.
ExpertTensors = Union[torch.Tensor, Sequence[torch.Tensor], Any]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _router(router_weight, correction_bias, device):
    if not isinstance(router_weight, torch.Tensor) or router_weight.ndim != 2:
        got = list(router_weight.shape) if isinstance(router_weight, torch.Tensor) else type(router_weight).__name__
        raise ValueError(f"router_weight must be a 2-D tensor [num_experts, hidden], got {got}")
    if not router_weight.dtype.is_floating_point:
        raise ValueError(f"router_weight must be a floating tensor, got {router_weight.dtype}")
    e = int(router_weight.shape[0])
    dev = torch.device(device) if device is not None else router_weight.device
    # The router runs in float32 (as transformers' DeepSeek-V3 router does: weight.type(float32)).
    rw = router_weight.detach().to(device=dev, dtype=torch.float32).contiguous()
    bias = None
    if correction_bias is not None:
        if not isinstance(correction_bias, torch.Tensor) or tuple(correction_bias.shape) != (e,):
            got = list(correction_bias.shape) if isinstance(correction_bias, torch.Tensor) else \
                type(correction_bias).__name__
            raise ValueError(f"correction_bias must be a tensor of shape [{e}] (num_experts), got {got}")
        bias = correction_bias.detach().to(device=dev, dtype=torch.float32).contiguous()
    return rw, bias, e, dev


def _kept(experts, e: int) -> range:
    if experts is None:
        return range(e)
    if not isinstance(experts, range) or experts.step != 1 or not 0 <= experts.start < experts.stop <= e:
        raise ValueError(f"experts must be None or a contiguous range within [0, {e}) (e.g. buffer.local_experts), "
                         f"got {experts!r}")
    return experts


def _expert(name: str, tensors: ExpertTensors, e: int, num_experts: int) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        if tensors.ndim != 3 or tensors.shape[0] != num_experts:
            raise ValueError(f"{name} must be [num_experts={num_experts}, out, in] or a per-expert sequence of "
                             f"[out, in] tensors, got a tensor of shape {list(tensors.shape)}")
    elif hasattr(tensors, "__len__") and len(tensors) != num_experts:
        raise ValueError(f"{name} must hold num_experts={num_experts} experts, got {len(tensors)}")
    t = tensors[e]
    if not isinstance(t, torch.Tensor) or t.ndim != 2:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}[{e}] must be a 2-D tensor [out, in], got {got}")
    return t.detach()


def _check_block_dims(name: str, t: torch.Tensor, e: int) -> None:
    rows, cols = t.shape
    if rows % QUANT_BLOCK or cols % QUANT_BLOCK:
        raise ValueError(f"{name}[{e}] must have both dimensions multiples of {QUANT_BLOCK} (the layer keeps one "
                         f"scale per 128x128 block; hidden and intermediate must be multiples of 128), "
                         f"got {list(t.shape)}")


def _check_roles(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, hidden: int, e: int) -> None:
    i = gate.shape[0]
    if tuple(gate.shape) != (i, hidden):
        raise ValueError(f"gate[{e}] must have shape [intermediate, hidden={hidden}], got {list(gate.shape)}")
    if tuple(up.shape) != (i, hidden):
        raise ValueError(f"up[{e}] must have shape [intermediate={i}, hidden={hidden}] like gate, got "
                         f"{list(up.shape)}")
    if tuple(down.shape) != (hidden, i):
        raise ValueError(f"down[{e}] must have shape [hidden={hidden}, intermediate={i}], got {list(down.shape)}")


def weights_from_float(router_weight: torch.Tensor, gate: ExpertTensors, up: ExpertTensors, down: ExpertTensors, *,
                       correction_bias: Optional[torch.Tensor] = None, weight_dtype: str = "fp8",
                       experts: Optional[range] = None, device=None) -> MoEWeights:
    """One layer's weights from bf16 / float16 / float32 expert tensors.

    Args:
        router_weight: ``[E, H]``, any float dtype (used in float32).
        gate, up: ``[E, I, H]`` or a per-expert sequence of ``[I, H]`` (``w1``, ``w3``).
        down: ``[E, H, I]`` or a per-expert sequence of ``[H, I]`` (``w2``).
        correction_bias: ``[E]`` or None (DeepSeek-V3's ``e_score_correction_bias``), used in float32.
        weight_dtype: ``"fp8"`` (quantise to float8_e4m3fn with one float32 scale per 128x128 block,
            ``scale = amax / 448``) or ``"bf16"`` (cast). Must equal the buffer's ``shape.weight_dtype``.
        experts: the experts to keep (a contiguous range such as ``buffer.local_experts``), None = all;
            only these are read from ``gate``/``up``/``down``.
        device: where the weights go (default: ``router_weight``'s device).
    Returns:
        :class:`MoEWeights` with ``len(experts)`` experts and the global router.
    Raises:
        ValueError: naming the bad argument, its shape or dtype and what is allowed.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    rw, bias, num_experts, dev = _router(router_weight, correction_bias, device)
    hidden = int(rw.shape[1])
    out = {"w1": [], "w3": [], "w2": [], "w1_scale": [], "w3_scale": [], "w2_scale": []}
    for e in _kept(experts, num_experts):
        ts = {}
        for role, key, src in (("gate", "w1", gate), ("up", "w3", up), ("down", "w2", down)):
            t = _expert(role, src, e, num_experts)
            if t.dtype not in _FLOAT_DTYPES:
                raise ValueError(f"{role}[{e}] must be bfloat16, float16 or float32 (FP8 tensors go through "
                                 f"weights_from_fp8), got {t.dtype}")
            _check_block_dims(role, t, e)
            ts[key] = t
        _check_roles(ts["w1"], ts["w3"], ts["w2"], hidden, e)
        for key, t in ts.items():
            if weight_dtype == "fp8":
                q, s = quantize_weight_fp8_block(t.to(dev))
                out[key].append(q)
                out[key + "_scale"].append(s)
            else:
                out[key].append(t.to(device=dev, dtype=torch.bfloat16))
    scales = {k: torch.stack(out[k]) if weight_dtype == "fp8" else None for k in ("w1_scale", "w3_scale", "w2_scale")}
    return MoEWeights(router_weight=rw, correction_bias=bias, w1=torch.stack(out["w1"]), w3=torch.stack(out["w3"]),
                      w2=torch.stack(out["w2"]), **scales)


def weights_from_fp8(router_weight: torch.Tensor, gate: ExpertTensors, gate_scale_inv: ExpertTensors,
                     up: ExpertTensors, up_scale_inv: ExpertTensors, down: ExpertTensors,
                     down_scale_inv: ExpertTensors, *, correction_bias: Optional[torch.Tensor] = None,
                     experts: Optional[range] = None, device=None) -> MoEWeights:
    """One layer's weights from FP8 checkpoint tensors, taken as they are (for ``weight_dtype="fp8"``).

    Args:
        router_weight: ``[E, H]``, any float dtype (used in float32).
        gate, up: float8_e4m3fn ``[E, I, H]`` or per-expert ``[I, H]`` (checkpoint ``gate_proj.weight``,
            ``up_proj.weight``).
        gate_scale_inv, up_scale_inv: float32 (or UE8M0) ``[E, I/128, H/128]`` or per-expert
            ``[I/128, H/128]``: the checkpoint's ``weight_scale_inv``, a dequantisation multiplier
            (``w = weight * weight_scale_inv`` per 128x128 block), used unchanged as ``w*_scale``.
        down: float8_e4m3fn ``[E, H, I]`` or per-expert ``[H, I]`` (``down_proj.weight``).
        down_scale_inv: ``[E, H/128, I/128]`` or per-expert ``[H/128, I/128]``.
        correction_bias: ``[E]`` or None (``e_score_correction_bias``), used in float32.
        experts: the experts to keep (a contiguous range such as ``buffer.local_experts``), None = all;
            only these are read.
        device: where the weights go (default: ``router_weight``'s device).
    Returns:
        :class:`MoEWeights` (FP8) with ``len(experts)`` experts and the global router.
    Raises:
        ValueError: naming the bad argument, its shape or dtype and what is allowed (e.g. a scale grid
        that is not one scale per 128x128 block, or a dimension that is not a multiple of 128).
    """
    rw, bias, num_experts, dev = _router(router_weight, correction_bias, device)
    hidden = int(rw.shape[1])
    out = {"w1": [], "w3": [], "w2": [], "w1_scale": [], "w3_scale": [], "w2_scale": []}
    roles = (("gate", "w1", gate, gate_scale_inv), ("up", "w3", up, up_scale_inv),
             ("down", "w2", down, down_scale_inv))
    for e in _kept(experts, num_experts):
        ts = {}
        for role, key, src, src_s in roles:
            t = _expert(role, src, e, num_experts)
            if t.dtype != FP8_DTYPE:
                raise ValueError(f"{role}[{e}] must be {FP8_DTYPE} (float weights go through weights_from_float), "
                                 f"got {t.dtype}")
            _check_block_dims(role, t, e)
            s = _expert(f"{role}_scale_inv", src_s, e, num_experts)
            if s.dtype != torch.float32 and (_E8M0 is None or s.dtype != _E8M0):
                raise ValueError(f"{role}_scale_inv[{e}] must be float32 (or float8_e8m0fnu), got {s.dtype}")
            want = (t.shape[0] // QUANT_BLOCK, t.shape[1] // QUANT_BLOCK)
            if tuple(s.shape) != want:
                raise ValueError(f"{role}_scale_inv[{e}] must have shape {list(want)} (one scale per 128x128 block "
                                 f"of {role}[{e}] {list(t.shape)}), got {list(s.shape)}")
            ts[key] = (t, s)
        _check_roles(ts["w1"][0], ts["w3"][0], ts["w2"][0], hidden, e)
        for key, (t, s) in ts.items():
            out[key].append(t.to(dev))
            out[key + "_scale"].append(s.to(device=dev, dtype=torch.float32))
    return MoEWeights(router_weight=rw, correction_bias=bias, **{k: torch.stack(v) for k, v in out.items()})
