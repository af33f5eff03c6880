"""How a streamed MoE forward is scheduled on a GPU (plain data; no GPU imports).

Used by the adaptive policy (``streamring.moe.adaptive``) and executed by
``streamring.moe.ep_buffer``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol import PROGRESS_POLICIES as POLICIES  # the one definition of the progress policies


@dataclass
class PlanChoice:
    """How one forward is streamed: ``chunk_tokens`` per chunk (``>= tokens``: batch path)."""

    chunk_tokens: int
    num_slots: int
    block_m: int
    policy: str
    # producer + dispatch streams at high priority; None: the policy's default (spin_kernel: on,
    # stream_wait: off - a forward with high-priority streams and a consumer blocked in
    # cuStreamWaitValue64 hung once on the H200, see docs/results/gpu-layer-2026-11-29.md)
    high_priority: bool | None = None
    # persistent grid size of the per-chunk GEMMs (None: one CTA per tile). Fewer CTAs than the
    # GPU holds leave slots free for the producer and dispatch kernels of later chunks.
    chunk_gemm_ctas: int | None = None

    @classmethod
    def batch(cls, block_m: int = 64) -> "PlanChoice":
        """The batch-ready path: one slot holding the whole batch, one chunk, one stream."""
        return cls(chunk_tokens=1 << 30, num_slots=1, block_m=block_m, policy="serialized")

    def priority_streams(self) -> bool:
        """Whether the producer and dispatch streams run at high priority (``high_priority``, or
        the policy's default when it is None: on for spin_kernel only)."""
        return self.high_priority if self.high_priority is not None else self.policy == "spin_kernel"

    def validate(self) -> "PlanChoice":
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.policy == "stream_wait" and self.high_priority:
            # cuStreamWaitValue64 has no deadline: a forward of this combination hung on the H200
            raise ValueError("high_priority=True is refused with policy 'stream_wait' (a consumer blocked in "
                             "cuStreamWaitValue64 has no deadline, and this combination hung once on the H200); "
                             "use policy 'spin_kernel' (waits with a deadline) or high_priority=None/False")
        if self.chunk_gemm_ctas is not None and self.chunk_gemm_ctas < 1:
            raise ValueError(f"chunk_gemm_ctas must be None or >= 1, got {self.chunk_gemm_ctas}")
        return self
