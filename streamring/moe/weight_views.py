"""The views of one layer's :class:`~streamring.moe.weights.MoEWeights` that the FP8 layer reads, made only by its
methods (never by hand): :class:`FP8BlocksView` (:meth:`MoEWeights.fp8_blocks`: the FP8 block layout the expert
GEMMs and the producer read) and :class:`PESliceView` (:meth:`MoEWeights.pe_slice`: a PE's experts of that
layout with the global router, what :class:`~streamring.moe.ep_buffer.EPBuffer` takes per layer).

The field names here are what the kernels and every GEMM backend read (``w1``, ``w1_sf``, ``w2``, ``w2_sf``,
``router``, ``bias``; a slice's ``routing`` and ``fw``): a backend outside the package reads them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .math import FP8_DTYPE
from .shape import MoEShape


@dataclass
class FP8BlocksView:
    """One layer's weights laid out for the block GEMMs (made by :meth:`MoEWeights.fp8_blocks`).

    ``w1`` is gate and up stacked: ``[E, 2I, H]`` fp8 with ``w1_sf [E, 2I/128, H/128]``;
    ``w2`` ``[E, H, I]`` fp8 with ``w2_sf [E, H/128, I/128]``; ``router`` bf16 ``[E, H]``;
    ``bias`` float32 ``[E]`` or None (deepseek_v3 selection bias).
    """

    w1: torch.Tensor
    w1_sf: torch.Tensor
    w2: torch.Tensor
    w2_sf: torch.Tensor
    router: torch.Tensor
    bias: Optional[torch.Tensor]

    def local(self, rank: int, num_ranks: int) -> "FP8BlocksView":
        """This PE's experts of a full set (rank ``r`` holds experts ``[r * E/R, (r+1) * E/R)``), as views of
        these tensors; the router and bias stay global (every PE routes its own tokens over all experts)."""
        e = self.w1.shape[0]
        if e % num_ranks or not 0 <= rank < num_ranks:
            raise ValueError(f"cannot split {e} experts over {num_ranks} ranks for rank {rank}")
        lo, hi = rank * e // num_ranks, (rank + 1) * e // num_ranks
        return FP8BlocksView(w1=self.w1[lo:hi], w1_sf=self.w1_sf[lo:hi], w2=self.w2[lo:hi],
                             w2_sf=self.w2_sf[lo:hi], router=self.router, bias=self.bias)


@dataclass
class PESliceView:
    """One MoE layer's weights as an :class:`EPBuffer` PE takes them (made by :meth:`MoEWeights.pe_slice`,
    which :meth:`EPBuffer.prepare_weights` calls).

    Attributes:
        routing: the layer's :class:`MoEShape` (router kind, groups, scaling; sizes equal the buffer's).
        fw: this PE's experts (``w1 [E/R, 2I, H]``, ``w2 [E/R, H, I]``, FP8 with 128x128 scales)
            and the global router (bf16 ``[E, H]``) and bias, an :class:`FP8BlocksView`.
    """

    routing: MoEShape
    fw: FP8BlocksView

    @classmethod
    def of(cls, fw: FP8BlocksView, routing: MoEShape, pe: int, num_pes: int, device) -> "PESliceView":
        """PE ``pe``'s slice of ``fw`` (all experts, or that PE's already) on ``device``, routed by ``routing``;
        checked: shapes, device, FP8 dtypes, the bias a router reads. Errors name the field."""
        E, E_loc, H, I = routing.num_experts, routing.num_experts // num_pes, routing.hidden, routing.intermediate
        if fw.w1.shape[0] == E and E_loc != E:
            fw = fw.local(pe, num_pes)
        want = {"w1": (E_loc, 2 * I, H), "w1_sf": (E_loc, 2 * I // 128, H // 128), "w2": (E_loc, H, I),
                "w2_sf": (E_loc, H // 128, I // 128), "router": (E, H)}
        for f, shp in want.items():
            t = getattr(fw, f)
            if tuple(t.shape) != shp:
                raise ValueError(f"weights.{f} must have shape {list(shp)} (all {E} experts or this PE's {E_loc}), "
                                 f"got {list(t.shape)}")
            if t.device != device:
                raise ValueError(f"weights.{f} is on {t.device}, the buffer on {device}")
        if fw.w1.dtype != FP8_DTYPE or fw.w2.dtype != FP8_DTYPE:
            raise ValueError(f"weights.w1/w2 must be float8_e4m3fn here, got {fw.w1.dtype}/{fw.w2.dtype}")
        if routing.router == "deepseek_v3" and fw.bias is None:
            raise ValueError("routing.router 'deepseek_v3' needs weights.correction_bias [num_experts]")
        return cls(routing=routing, fw=fw)
