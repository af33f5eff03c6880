"""One MoE layer's weights as an :class:`~streamring.moe.ep_buffer.EPBuffer` takes them: this PE's experts in FP8 with
128x128 scales and the global router (:class:`LayerWeights`, made once per layer by :func:`prepare_layer_weights`)."""

from __future__ import annotations

from dataclasses import dataclass

from . import ep_config as CFG
from .blocks import FP8, FastWeights
from .math import MoEShape, MoEWeights


@dataclass
class LayerWeights:
    """One MoE layer's weights, prepared for an :class:`EPBuffer` (:meth:`EPBuffer.prepare_weights`).

    Attributes:
        routing: the layer's :class:`MoEShape` (router kind, groups, scaling; sizes equal the buffer's).
        fw: this PE's experts (``w1 [E/R, 2I, H]``, ``w2 [E/R, H, I]``, FP8 with 128x128 scales)
            and the global router (bf16 ``[E, H]``) and bias.
    """

    routing: MoEShape
    fw: FastWeights



def prepare_layer_weights(weights, sh: MoEShape, shape: MoEShape, pe: int, num_pes: int, device) -> LayerWeights:
    """``weights`` (:class:`~streamring.moe.math.MoEWeights`: bf16 ones quantized to FP8 with 128x128 block scales,
    FP8 ones with their scales taken as they are; or :class:`~streamring.moe.blocks.FastWeights`; all experts or PE
    ``pe``'s) as a layer of a buffer of ``shape`` on ``device``, routed by ``sh`` (sizes equal ``shape``'s). Errors
    name the field."""
    for f in ("hidden", "intermediate", "num_experts", "topk"):
        if getattr(sh, f) != getattr(shape, f):
            raise ValueError(f"routing.{f}={getattr(sh, f)} differs from the buffer's shape.{f}="
                             f"{getattr(shape, f)}: a buffer serves layers of one size")
    if isinstance(weights, MoEWeights):
        fw = FastWeights.from_moe_weights(CFG.fp8_weights(weights, sh, device))
    elif isinstance(weights, FastWeights):
        fw = weights
    else:
        raise ValueError(f"weights must be a MoEWeights or a FastWeights, got {type(weights).__name__}")
    E, E_loc, H, I = sh.num_experts, sh.num_experts // num_pes, sh.hidden, sh.intermediate
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
    if fw.w1.dtype != FP8 or fw.w2.dtype != FP8:
        raise ValueError(f"weights.w1/w2 must be float8_e4m3fn here, got {fw.w1.dtype}/{fw.w2.dtype}")
    if sh.router == "deepseek_v3" and fw.bias is None:
        raise ValueError("routing.router 'deepseek_v3' needs weights.correction_bias [num_experts]")
    return LayerWeights(routing=sh, fw=fw)
