"""The static shape of an MoE layer (:class:`MoEShape`) and its allowed values.

No torch here: the local launcher validates a run's layer against the number of ranks before any
rank starts (``runner.check_run_job``), in a process that computes nothing. :mod:`streamring.moe.math`
re-exports every name.
"""

from __future__ import annotations

import math as _math
from dataclasses import dataclass

from .routing import router_names, router_of

#: Width of a quantization block (activations: 1x128, weights: 128x128).
QUANT_BLOCK = 128
#: Allowed values of :attr:`MoEShape.weight_dtype`.
WEIGHT_DTYPES = ("bf16", "fp8")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class MoEShape:
    """Static configuration of an MoE layer.

    Attributes:
        hidden: model width H (multiple of 128).
        intermediate: expert FFN width I (multiple of 128).
        num_experts: number of routed experts E.
        topk: experts per token k, ``1 <= k <= E``.
        router: a registered router's name (:mod:`streamring.moe.routing`); built in:
            ``'softmax_topk'`` (Mixtral: softmax, top-k, optional renormalisation)
            and ``'deepseek_v3'`` (sigmoid scores, correction bias for selection,
            group-limited top-k).
        renormalize: softmax_topk only: renormalise the k weights to sum to 1.
        n_group: deepseek_v3: number of expert groups (E % n_group == 0).
        topk_group: deepseek_v3: groups a token may pick experts from.
        routed_scaling_factor: deepseek_v3: factor applied to the final weights.
        norm_topk_prob: deepseek_v3: normalise the k weights to sum to 1.
        weight_dtype: ``'bf16'`` or ``'fp8'`` (float8_e4m3fn + 128x128 scales).
        block_m: rows per expert block (fixed GEMM row count).
    """

    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    router: str = "softmax_topk"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    weight_dtype: str = "bf16"
    block_m: int = 16

    def validate(self, num_ranks: int = 1) -> "MoEShape":
        """Check every field; raise ValueError naming the field and allowed values.

        Args:
            num_ranks: number of expert-parallel ranks; ``num_experts`` must be
                divisible by it.
        Returns:
            ``self`` (for chaining).
        """
        if not _is_int(num_ranks) or num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
        for name in ("hidden", "intermediate", "num_experts", "topk", "n_group",
                     "topk_group", "block_m"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.hidden % QUANT_BLOCK != 0:
            raise ValueError(f"hidden must be a multiple of {QUANT_BLOCK}, got {self.hidden}")
        if self.intermediate % QUANT_BLOCK != 0:
            raise ValueError(
                f"intermediate must be a multiple of {QUANT_BLOCK}, got {self.intermediate}")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(
                f"topk must satisfy 1 <= topk <= num_experts={self.num_experts}, got {self.topk}")
        if self.num_experts % num_ranks != 0:
            raise ValueError(
                f"num_experts must be divisible by num_ranks={num_ranks}, got {self.num_experts}")
        if self.router not in router_names():
            raise ValueError(f"router must be one of {router_names()}, got {self.router!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}")
        for name in ("renormalize", "norm_topk_prob"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool (True/False), got {v!r}")
        if self.num_experts % self.n_group != 0:
            raise ValueError(
                f"n_group must divide num_experts={self.num_experts}, got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"topk_group must satisfy 1 <= topk_group <= n_group={self.n_group}, "
                f"got {self.topk_group}")
        rsf = self.routed_scaling_factor
        if (not isinstance(rsf, (int, float)) or isinstance(rsf, bool)
                or not _math.isfinite(rsf) or rsf <= 0):
            raise ValueError(
                f"routed_scaling_factor must be a finite float > 0, got {rsf!r}")
        check = router_of(self.router).check
        if check is not None:
            check(self)
        return self
