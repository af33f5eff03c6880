"""One MoE layer's weights: the one type engineers make and hold (:class:`MoEWeights`), its views, and the ways in.

:class:`MoEWeights` holds a layer's router and its experts (all of them, or a rank's), bf16 or FP8 with 128x128
block scales; every buffer's ``prepare_weights`` takes it once per layer. What the FP8 layer's kernels read are
views made by its methods (:mod:`streamring.moe.weight_views`): :meth:`MoEWeights.fp8_blocks` (the FP8 block
layout of the expert GEMMs: gate and up stacked, the router in bf16) and :meth:`MoEWeights.pe_slice` (a PE's
experts of that layout with the global router: what an :class:`~streamring.moe.ep_buffer.EPBuffer` keeps per
layer). :meth:`MoEWeights.random` and :meth:`MoEWeights.random_fp8` are random layers (the CLI's, tests',
benchmarks'), not a checkpoint's.

Two ways in from a model's tensors, both returning a :class:`MoEWeights`:

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

import math as _math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from .math import (FP8_DTYPE, QUANT_BLOCK, WEIGHT_DTYPES, _check_finite, _check_tensor, dequantize_weight_fp8_block,
                   quantize_weight_fp8_block)
from .routing import router_of
from .shape import MoEShape, _is_int
from .weight_views import FP8BlocksView, PESliceView

__all__ = ["MoEWeights", "weights_from_float", "weights_from_fp8", "ExpertTensors"]


@dataclass(eq=False)
class MoEWeights:
    """Weights of one MoE layer (all experts, or a rank's: ``experts=`` of :func:`weights_from_float`), on a single
    device; the FP8 layer reads its views (:meth:`fp8_blocks`, :meth:`pe_slice`).

    Attributes:
        router_weight: float32 ``[E, H]``; logits = x @ router_weight.T.
        correction_bias: float32 ``[E]`` or None, for a router that reads it
            (``uses_bias``: deepseek_v3 adds it to the scores for *selection
            only*; the returned weights do not include it).
        w1, w3: ``[E, I, H]`` (gate and up projections).
        w2: ``[E, H, I]`` (down projection).
            bf16, or float8_e4m3fn together with the block scales below.
        w1_scale, w3_scale: float32 ``[E, I/128, H/128]`` (fp8 only, else None).
        w2_scale: float32 ``[E, H/128, I/128]`` (fp8 only, else None).

    Dequantized float32 expert weights are cached per object by
    :meth:`dequantized_expert`; call :meth:`clear_cache` after mutating weights.
    """

    router_weight: torch.Tensor
    correction_bias: Optional[torch.Tensor]
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    w1_scale: Optional[torch.Tensor] = None
    w3_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    _cache: Dict[Tuple[int, torch.dtype], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    # -- properties ---------------------------------------------------------
    @property
    def num_experts(self) -> int:
        """E, from ``router_weight.shape[0]``."""
        return int(self.router_weight.shape[0])

    @property
    def hidden(self) -> int:
        """H, from ``w1.shape[2]``."""
        return int(self.w1.shape[2])

    @property
    def intermediate(self) -> int:
        """I, from ``w1.shape[1]``."""
        return int(self.w1.shape[1])

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.w1.device

    @property
    def is_fp8(self) -> bool:
        """True when expert weights are stored as float8_e4m3fn + block scales."""
        return self.w1.dtype == FP8_DTYPE

    # -- validation ---------------------------------------------------------
    def validate(self, shape: MoEShape) -> "MoEWeights":
        """Check shapes, dtypes, device consistency and finiteness against ``shape``.

        Also validates ``shape`` itself.  Raises ValueError naming the field.
        Returns ``self``.
        """
        if not isinstance(shape, MoEShape):
            raise ValueError(f"shape must be a MoEShape, got {type(shape).__name__}")
        shape.validate()
        e, h, i = shape.num_experts, shape.hidden, shape.intermediate
        _check_tensor("router_weight", self.router_weight, dtype=torch.float32, shape=(e, h))
        _check_finite("router_weight", self.router_weight)
        if self.correction_bias is not None:
            _check_tensor("correction_bias", self.correction_bias, dtype=torch.float32,
                          shape=(e,))
            _check_finite("correction_bias", self.correction_bias)
        wdt = torch.bfloat16 if shape.weight_dtype == "bf16" else FP8_DTYPE
        for name, shp in (("w1", (e, i, h)), ("w3", (e, i, h)), ("w2", (e, h, i))):
            t = getattr(self, name)
            _check_tensor(name, t, shape=shp)
            if t.dtype != wdt:
                raise ValueError(
                    f"{name} must have dtype {wdt} for weight_dtype={shape.weight_dtype!r}, "
                    f"got {t.dtype}")
        scale_shapes = (("w1_scale", (e, i // QUANT_BLOCK, h // QUANT_BLOCK)),
                        ("w3_scale", (e, i // QUANT_BLOCK, h // QUANT_BLOCK)),
                        ("w2_scale", (e, h // QUANT_BLOCK, i // QUANT_BLOCK)))
        for name, shp in scale_shapes:
            s = getattr(self, name)
            if shape.weight_dtype == "bf16":
                if s is not None:
                    raise ValueError(f"{name} must be None for weight_dtype='bf16'")
            else:
                if s is None:
                    raise ValueError(
                        f"{name} must be a float32 tensor of shape {list(shp)} for "
                        f"weight_dtype='fp8', got None")
                _check_tensor(name, s, dtype=torch.float32, shape=shp)
                _check_finite(name, s)
                if not bool((s > 0).all()):
                    raise ValueError(f"{name} must be > 0 everywhere")
        dev = self.router_weight.device
        for name in ("correction_bias", "w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"):
            t = getattr(self, name)
            if t is not None and t.device != dev:
                raise ValueError(
                    f"{name} must be on the same device as router_weight ({dev}), got {t.device}")
        for name in ("w1", "w3", "w2"):
            _check_finite(name, getattr(self, name))
        return self

    # -- construction -------------------------------------------------------
    @classmethod
    def random(cls, shape: MoEShape, seed: int, device="cpu",
               with_bias: Optional[bool] = None, bias_std: float = 0.1) -> "MoEWeights":
        """Deterministic random weights with O(1) outputs for O(1) inputs.

        Every tensor is drawn from ``N(0, 1/fan_in)`` (router and w1/w3:
        fan_in = H; w2: fan_in = I) by a CPU ``torch.Generator`` seeded with
        ``seed``, expert by expert, then cast (bf16) or block-quantized (fp8)
        and moved to ``device``; the result is therefore identical on every
        device.

        Args:
            shape: validated layer shape.
            seed: int seed.
            device: target device.
            with_bias: create ``correction_bias`` (``N(0, bias_std)``); default:
                whether the shape's router reads one (``uses_bias``).
            bias_std: std of the correction bias.
        """
        if not isinstance(shape, MoEShape):
            raise ValueError(f"shape must be a MoEShape, got {type(shape).__name__}")
        shape.validate()
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if with_bias is None:
            with_bias = router_of(shape.router).uses_bias
        e, h, i = shape.num_experts, shape.hidden, shape.intermediate
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        f32 = torch.float32
        router_weight = torch.randn(e, h, generator=g, dtype=f32) / _math.sqrt(h)
        bias = torch.randn(e, generator=g, dtype=f32) * bias_std if with_bias else None
        fp8 = shape.weight_dtype == "fp8"
        wdt = FP8_DTYPE if fp8 else torch.bfloat16
        w1 = torch.empty(e, i, h, dtype=wdt, device=device)
        w3 = torch.empty(e, i, h, dtype=wdt, device=device)
        w2 = torch.empty(e, h, i, dtype=wdt, device=device)
        if fp8:
            hb, ib = h // QUANT_BLOCK, i // QUANT_BLOCK
            s1 = torch.empty(e, ib, hb, dtype=f32, device=device)
            s3 = torch.empty(e, ib, hb, dtype=f32, device=device)
            s2 = torch.empty(e, hb, ib, dtype=f32, device=device)
        else:
            s1 = s3 = s2 = None
        for ex in range(e):
            for dst, sdst, rows, cols in ((w1, s1, i, h), (w3, s3, i, h), (w2, s2, h, i)):
                w = torch.randn(rows, cols, generator=g, dtype=f32) / _math.sqrt(cols)
                if fp8:
                    q, s = quantize_weight_fp8_block(w)
                    dst[ex].copy_(q.to(device))
                    sdst[ex].copy_(s.to(device))
                else:
                    dst[ex].copy_(w.to(torch.bfloat16).to(device))
        return cls(router_weight=router_weight.to(device),
                   correction_bias=None if bias is None else bias.to(device),
                   w1=w1, w3=w3, w2=w2, w1_scale=s1, w3_scale=s3, w2_scale=s2)

    @classmethod
    def random_fp8(cls, shape: MoEShape, seed: int, device) -> "MoEWeights":
        """Random FP8 weights generated *on* ``device`` by a generator of that device (the full DeepSeek-V3
        shape in seconds on a GPU), whatever ``shape.weight_dtype`` says.

        Same distribution as :meth:`random` (N(0, 1/fan_in), 128x128 block scales) but a different stream of
        numbers (and a bf16-valued router: the FP8 layer routes with bf16 router weights); use it for
        benchmarks and the FP8 layer's checks, not for cross-device comparisons. Gate and up are drawn as one
        ``[2I, H]`` matrix per expert and stored as the two halves of one ``[E, 2I, H]`` tensor, so
        :meth:`fp8_blocks` takes them without a copy.
        """
        e, h, i = shape.num_experts, shape.hidden, shape.intermediate
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        w13 = torch.empty(e, 2 * i, h, dtype=FP8_DTYPE, device=device)
        w13_sf = torch.empty(e, 2 * i // QUANT_BLOCK, h // QUANT_BLOCK, dtype=torch.float32, device=device)
        w2 = torch.empty(e, h, i, dtype=FP8_DTYPE, device=device)
        w2_sf = torch.empty(e, h // QUANT_BLOCK, i // QUANT_BLOCK, dtype=torch.float32, device=device)
        for ex in range(e):
            q, s = quantize_weight_fp8_block(torch.randn(2 * i, h, generator=g, device=device) / _math.sqrt(h))
            w13[ex].copy_(q)
            w13_sf[ex].copy_(s)
            q, s = quantize_weight_fp8_block(torch.randn(h, i, generator=g, device=device) / _math.sqrt(i))
            w2[ex].copy_(q)
            w2_sf[ex].copy_(s)
        router = (torch.randn(e, h, generator=g, device=device) / _math.sqrt(h)).to(torch.bfloat16)
        bias = torch.randn(e, generator=g, device=device) * 0.1 if router_of(shape.router).uses_bias else None
        ib = i // QUANT_BLOCK
        return cls(router_weight=router.float(), correction_bias=bias, w1=w13[:, :i], w3=w13[:, i:], w2=w2,
                   w1_scale=w13_sf[:, :ib], w3_scale=w13_sf[:, ib:], w2_scale=w2_sf)

    # -- placement ----------------------------------------------------------
    def local_experts(self, rank: int, num_ranks: int) -> range:
        """Experts owned by ``rank`` under contiguous placement (E/num_ranks each).

        Rank ``r`` owns ``range(r * E/num_ranks, (r + 1) * E/num_ranks)``.
        """
        if not _is_int(num_ranks) or num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
        if self.num_experts % num_ranks != 0:
            raise ValueError(
                f"num_ranks must divide num_experts={self.num_experts}, got {num_ranks}")
        if not _is_int(rank) or not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be an int in [0, {num_ranks}), got {rank!r}")
        per = self.num_experts // num_ranks
        return range(rank * per, (rank + 1) * per)

    # -- dequantization -----------------------------------------------------
    def dequantized_expert(self, e: int, dtype: torch.dtype = torch.float32
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantized ``(w1 [I, H], w3 [I, H], w2 [H, I])`` of expert ``e``, cached.

        bf16 weights are cast; fp8 weights are multiplied by their 128x128 block
        scales in ``dtype``.  Results are cached per ``(e, dtype)`` on this object.

        Args:
            e: expert index in ``[0, E)``.
            dtype: torch.float32 (default) or torch.float64.
        """
        if not _is_int(e) or not 0 <= e < self.num_experts:
            raise ValueError(f"e must be an int in [0, {self.num_experts}), got {e!r}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        key = (e, dtype)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        out = []
        for name in ("w1", "w3", "w2"):
            w = getattr(self, name)[e]
            if w.dtype == FP8_DTYPE:
                s = getattr(self, name + "_scale")
                if s is None:
                    raise ValueError(f"{name}_scale must be set for fp8 {name}, got None")
                out.append(dequantize_weight_fp8_block(w, s[e], dtype).contiguous())
            else:
                out.append(w.to(dtype).contiguous())
        res = (out[0], out[1], out[2])
        self._cache[key] = res
        return res

    def clear_cache(self) -> None:
        """Drop all cached dequantized expert weights."""
        self._cache.clear()

    # -- views ---------------------------------------------------------------
    def to_fp8(self, device=None) -> "MoEWeights":
        """These weights with FP8 experts: FP8 ones (with their scales) as they are (``self``); bf16 ones moved to
        ``device`` (default: theirs) and quantized there, expert by expert, with 128x128 block scales."""
        if self.is_fp8:
            return self
        dev = self.device if device is None else device
        q = {}
        for name in ("w1", "w3", "w2"):
            t = getattr(self, name).to(dev)
            qs = [quantize_weight_fp8_block(t[e].float()) for e in range(t.shape[0])]
            q[name] = torch.stack([a for a, _ in qs])
            q[f"{name}_scale"] = torch.stack([s for _, s in qs])
        return MoEWeights(router_weight=self.router_weight.to(dev), correction_bias=None if self.correction_bias
                          is None else self.correction_bias.to(dev), **q)

    def fp8_blocks(self, device=None) -> FP8BlocksView:
        """These weights in the FP8 block layout the expert GEMMs read (:class:`FP8BlocksView`): gate and up
        stacked into ``w1 [E, 2I, H]`` (no copy where they are the two halves of one such tensor, as
        :meth:`random_fp8` makes them; else concatenated), the router in bf16; bf16 weights are quantized first
        (:meth:`to_fp8` on ``device``), FP8 ones stay where they are."""
        w = self.to_fp8(device)
        return FP8BlocksView(w1=_stacked(w.w1, w.w3), w1_sf=_stacked(w.w1_scale, w.w3_scale),
                             w2=w.w2.contiguous(), w2_sf=w.w2_scale.contiguous(),
                             router=w.router_weight.to(torch.bfloat16).contiguous(),
                             bias=None if w.correction_bias is None else w.correction_bias.float().contiguous())

    def pe_slice(self, routing: MoEShape, pe: int, num_pes: int, device) -> PESliceView:
        """PE ``pe``'s share of these weights (all experts, or that PE's already) for the expert-parallel layer on
        ``device``, routed by ``routing`` (:class:`PESliceView`: its experts of :meth:`fp8_blocks`, the global
        router and bias). Errors name the field (a shape, the device, the dtype, a bias the router needs). Given all
        experts, only that PE's are laid out (and, bf16 ones, quantized): the same values as slicing the whole layout."""
        E = routing.num_experts
        w = self
        if self.w1.shape[0] == E and _is_int(num_pes) and num_pes > 1 and E % num_pes == 0 and _is_int(pe) \
                and 0 <= pe < num_pes:
            lo, hi = pe * E // num_pes, (pe + 1) * E // num_pes
            w = replace(self, **{n: getattr(self, n)[lo:hi] for n in ("w1", "w3", "w2")},
                        **{n: None if getattr(self, n) is None else getattr(self, n)[lo:hi]
                           for n in ("w1_scale", "w3_scale", "w2_scale")})
        return PESliceView.of(w.fp8_blocks(device), routing, pe, num_pes, device)


def _stacked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``cat([a, b], dim=1)`` of two ``[E, R, C]`` tensors, contiguous: without a copy where ``a`` and ``b`` already
    are the two halves of one contiguous ``[E, 2R, C]`` tensor (the same values either way)."""
    e, r, c = a.shape
    halves = (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
              and a.stride() == b.stride() == (2 * r * c, c, 1)
              and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
              and b.data_ptr() == a.data_ptr() + r * c * a.element_size())
    if halves:
        return a.as_strided((e, 2 * r, c), (2 * r * c, c, 1))
    return torch.cat([a, b], dim=1).contiguous()


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
