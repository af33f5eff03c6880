"""How an :class:`~streamring.moe.ep_buffer.EPBuffer` schedules its forwards: the switches an engine
normally leaves alone (plain data; no GPU imports).

Every field has the default that the measured tables chose (``docs/performance.md``); each other
value either wins in some measured row or is a correctness fallback. Options that lost everywhere
they were measured are not offered (``docs/performance.md``, "Retired options", keeps the
measurements that retired them).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..ring.policies import EP_SOURCE_ORDERS, PROGRESS_POLICIES, REFUSED_POLICIES, SOURCE_ORDERS

#: progress policies of the streamed path (``REFUSED_POLICIES`` are named with the reason they are refused)
EP_POLICIES = PROGRESS_POLICIES
BLOCK_MS = (16, 32, 64, 128)


#: the largest forward (rows per PE) whose streamed steps group the sources ready together, with GEMMs that
#: launch a CTA per tile (``EPTuning.group_max_tokens``)
GROUP_MAX_TOKENS = 1024


class EPTuning(BaseModel):
    """The scheduling switches of an :class:`~streamring.moe.ep_buffer.EPBuffer` (frozen; errors name the field
    and its allowed values).

    Attributes:
        block_m: rows per expert block, one of ``BLOCK_MS``; ``None``: 128 where CUTLASS or DeepGEMM compute
            the experts (asked for, or what ``gemm="auto"`` resolves to at 128: CUTLASS's one-block tiles measured
            fastest at every size, DeepGEMM takes 128 only), else the shape's ``block_m``
            (``ep_config.resolve_block_and_gemm``).
        policy: progress policy of the streamed path (``EP_POLICIES``): ``spin_kernel`` (one-thread acquire
            kernels with a deadline; producer and dispatch streams at high priority), ``stream_wait``
            (``cuStreamWaitValue64`` on the ring's doorbells: no SM held while waiting), ``green_ctx``
            (producer and consumer on disjoint SM partitions, ``producer_sms`` for the producer),
            ``serialized`` (one stream, chunk by chunk: the correctness fallback). The batch path always runs
            serialized.
        source_order: the streamed dispatch order (``EP_SOURCE_ORDERS``; default ``ready``: each step takes the
            sources that are ready together, in the order they publish, so a late source delays only its own
            rows and on-time sources share one GEMM call). ``arrival`` needs every chunk of a
            forward in its own slot (``num_slots >= chunks``): a consumer that takes all of one source's chunks
            before the next's could otherwise wait for a slot that only its own later acknowledgement frees.
        transport: ``auto`` (NVLink loads/stores where every peer is reachable, else NVSHMEM RMA), ``p2p`` or
            ``nv`` (RMA even between GPUs of one host: how the inter-node path is tested on one host).
        consumer: ``per_chunk`` (an L1 and an L2 grid per dispatch step; any GEMM and transport) or
            ``persistent`` (one kernel per forward claiming ready blocks from a device queue; Triton GEMMs over
            P2P, ``reserved_sms`` SMs left to the producer and the dispatch).
        reserved_sms: the persistent consumer's SMs left to the producer and the dispatch (at least 1: with none
            they starve and the queue's deadline ends the forward with an error).
        producer_sms: ``green_ctx``: SMs of the producer partition (a multiple of 8).
        group_max_tokens: ``ready`` order on several PEs (per-chunk consumer): forwards of at most this many rows
            per PE (``x.shape[0]``; a captured graph's capture size) group the sources that are ready together
            into one dispatch step and one GEMM call (one weight pass, as the batch path); larger ones take a
            step per source, whose dispatch overlaps the previous step's GEMMs. 0: never group. ``None`` (the
            default): :data:`GROUP_MAX_TOKENS` (1024) with a GEMM backend that launches a CTA per tile (Triton),
            every size with one whose own grid is persistent (CUTLASS, DeepGEMM:
            ``gemm.backends.Capabilities.persistent_grid``): that grid holds every SM until its call ends, so a
            step per source queues the next source's dispatch behind the previous call and splits the weight
            pass in two (docs/performance.md measures both schedules). A chunk still
            has a step per PE: with Triton GEMMs the steps after the one that took every source are calls over
            an empty range, each launching CTAs for one late source's blocks (``grid_bounds.grouped_step_expect``),
            a cost that grows with the PEs (docs/performance.md).
        ready_window_us: grouped steps: how long a dispatch step that found a chunk's first ready source keeps
            taking the chunk's other sources as they become ready (0: only those ready at once). Sources that
            publish within it share the step; a source later than it gets a step of its own. The window costs at
            most its length once per chunk when a source is late.
        chunk_gemm_ctas: the persistent grid size of every streamed GEMM call but the forward's last (while a
            later source or chunk may still be being produced; ``None``: the backend's own grid, except at decode
            sizes, where a capped persistent grid leaves a few SMs free: ``ep_experts.EPExperts.grid_ctas``);
            fewer CTAs than the GPU holds leave room for the producer and the dispatch's ready wait.
        streamed_grid_waves: CTAs per SM of every streamed GEMM call with a GEMM backend that can run its
            persistent grid in waves (CUTLASS: ``gemm.backends.Capabilities.waves``). Its one-CTA-per-SM grid
            holds every SM until the call ends, so the next source's dispatch, a late PE's producer and the result
            puts would wait for the whole call; a grid of this many CTAs per SM runs in waves, each CTA taking a
            share of the tiles, and those higher-priority kernels get SMs as CTAs retire. 1 (the default): the
            backend's own grid; 2 and 4 measured no faster (docs/performance.md). The batch path always runs the
            backend's own grid.
        dispatch_beside_grid: whether a streamed dispatch step may run beside the previous step's GEMM call when
            that call's grid holds every SM (a backend's own persistent grid: CUTLASS, DeepGEMM; not a capped grid,
            not Triton's CTA-per-tile grids, for which the switch changes nothing). False (the default): the step
            waits for that call to end. Reason: beside such a grid the step's spinning ready wait holds an SM of
            this process's share, a CTA of the statically scheduled grid waits for one, and the whole call ends with
            that CTA; behind it the call runs at its on-time speed and a late producer costs less (kernel traces
            and paired runs: docs/performance.md, "The dispatch behind a full grid"). True: the dispatch beside the
            grid, an experiment (``bench.ep_layer --dispatch-beside-grid``). Correctness does not depend on it
            (False only adds dependencies: a GEMM call never waits on a later dispatch step).
        seal_by_expert: whether the seal lays the range of the GEMM call that computes the partial blocks out
            expert by expert (each expert's partial block right after its full blocks:
            ``BlockConsumer(seal_by_expert=)``, its one reader), so that call reads each expert's weights in one run
            of tiles. True (the default): measured faster for both paths, the batch path's one call included
            (docs/performance.md, "The seal's call expert by expert"). False: the allocator's order, every partial
            block after every full block of the range, a second pass over the weights at the end of the call
            (``bench.ep_layer --seal-after-full-blocks``). Outputs are the same bits either way: only the order of
            the blocks in the call's range changes.
        high_priority_puts: whether the result puts (``ep_put_rows``, stream ``u``) run at the high priority of
            the producer and the dispatch where the policy raises them (``spin_kernel``). ``None`` (the default):
            high with a GEMM backend that launches a CTA per tile (Triton), whose next call's CTAs the puts then
            precede; the default priority with one whose own grid is persistent (CUTLASS, DeepGEMM:
            ``gemm.backends.Capabilities.persistent_grid``), where no CTA of a running call leaves an SM to them
            anyway and the kernels they meet are the next dispatch step's: a put's CTAs then leave the dispatch's
            CTAs the SMs they free, so a late source's dispatch after a call is not slowed by that call's puts
            (kernel traces: docs/performance.md). Only scheduling changes: the puts' stores and release ADDs are
            the same, so outputs are the same bits.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_m: Optional[Literal[BLOCK_MS]] = None  # type: ignore[valid-type]
    policy: Literal[EP_POLICIES] = "spin_kernel"  # type: ignore[valid-type]
    source_order: Literal[EP_SOURCE_ORDERS] = "ready"  # type: ignore[valid-type]
    transport: Literal["auto", "p2p", "nv"] = "auto"
    consumer: Literal["per_chunk", "persistent"] = "per_chunk"
    reserved_sms: int = Field(16, ge=1)
    producer_sms: int = Field(16, ge=8)
    group_max_tokens: Optional[int] = Field(None, ge=0)
    ready_window_us: float = Field(50.0, ge=0, le=1000)
    chunk_gemm_ctas: Optional[int] = Field(None, ge=1)
    streamed_grid_waves: int = Field(1, ge=1, le=16)
    dispatch_beside_grid: bool = False
    seal_by_expert: bool = True
    high_priority_puts: Optional[bool] = None

    def puts_at_high_priority(self, *, persistent_grid: bool) -> bool:
        """Whether the result puts run at the high priority (:attr:`high_priority_puts`; ``None``: unless the GEMM
        backend's own grid is persistent, ``persistent_grid``)."""
        return not persistent_grid if self.high_priority_puts is None else self.high_priority_puts

    def groups_sources(self, ranks: int, rows: int, *, persistent_grid: bool) -> bool:
        """Whether a streamed forward of ``rows`` rows per PE on ``ranks`` PEs groups the sources that are ready
        together into one dispatch step and one GEMM call: the ready order on several PEs with the per-chunk
        consumer, up to ``group_max_tokens`` rows (``None``: up to :data:`GROUP_MAX_TOKENS`, or every size
        with GEMMs whose own grid is persistent, ``persistent_grid``). Larger forwards take a step per source:
        there, with Triton GEMMs, a step's dispatch overlaps the previous step's GEMMs, and grouping measured
        slower on time than a step per source (docs/performance.md)."""
        limit = self.group_max_tokens
        if limit is None:
            limit = rows if persistent_grid else GROUP_MAX_TOKENS
        return (self.source_order == "ready" and ranks > 1 and self.consumer == "per_chunk"
                and rows <= limit)

    @field_validator("policy", mode="before")
    @classmethod
    def _refused_policy(cls, v):
        if v in REFUSED_POLICIES:
            raise ValueError(f"policy {v!r} is refused by the expert-parallel layer: {REFUSED_POLICIES[v]}; "
                             f"use one of {list(EP_POLICIES)}")
        return v

    @field_validator("producer_sms")
    @classmethod
    def _multiple_of_8(cls, v):
        if v % 8:
            raise ValueError(f"producer_sms must be a multiple of 8 (green contexts split SMs in groups of 8), "
                             f"got {v}")
        return v


#: the CPU layer's schedulers: ``chunk_local`` (RFC option 1) and ``reservation`` (option 2, blocks filled across
#: chunks; ``streamring.moe.layer``'s module doc)
SCHEDULERS = ("chunk_local", "reservation")


class MoETuning(BaseModel):
    """The switches of a :class:`~streamring.moe.layer.MoEBuffer`, the CPU reference layer (frozen; errors name the
    field and its allowed values). Its streamed path's consumer:

    Attributes:
        scheduler: ``chunk_local`` (each chunk's blocks on their own) or ``reservation`` (per-expert blocks filled
            across chunks, sealed at the end of the stream).
        block_m: rows per expert block; ``None``: the shape's ``block_m``.
        source_order: ``rank`` (a chunk's sources in rank order) or ``ready`` (any ready source first).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    scheduler: Literal[SCHEDULERS] = "chunk_local"  # type: ignore[valid-type]
    block_m: Optional[int] = Field(None, ge=1)
    source_order: Literal[SOURCE_ORDERS] = "rank"  # type: ignore[valid-type]
