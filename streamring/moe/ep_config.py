"""The sizes, switches and GEMMs of an :class:`~streamring.moe.ep_buffer.EPBuffer` checked before anything is
allocated (errors name the field and its allowed values), the bytes a buffer of given sizes holds, and what a
measured plan and a buffer must share for the measurement to decide for the buffer. No GPU imports here."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..gemm import choice as GC
from ..gemm.backends import CAPABILITIES
from ..ring.layout import CombineLayout, RingLayout
from . import layer_choice
from .shape import MoEShape
from .tuning import BLOCK_MS, EPTuning

def cutlass_unavailable_reason() -> Optional[str]:
    """Why the CUTLASS GEMM library is not taken here (``None`` when it loads). Never builds anything:
    the library is built ahead with ``python -m streamring.gemm.build --out .gemm-build``."""
    why = GC.available_impls(128)["cutlass"]
    return why or None


def resolve_gemm(gemm: str, shape: MoEShape, num_ranks: int, max_tokens_per_rank: int,
                 block_m: int) -> "GC.LayerChoice":
    """The expert GEMMs ``gemm`` stands for in a buffer of these sizes (``"auto"``: the fastest available
    implementation of the measured table, ``streamring/gemm/choice.py``, at the buffer's rows per
    expert; an explicit one: its own fastest variants). Every path of one buffer runs the result, so a
    streamed-vs-batch comparison never measures two GEMMs' rounding."""
    if gemm != "auto" and gemm not in CAPABILITIES:
        raise ValueError(f"gemm must be one of {('auto',) + tuple(CAPABILITIES)}, got {gemm!r}")
    if gemm == "auto":
        # a whole-layer measurement of several backends decides first (streamring/moe/layer_choice.py: what each
        # backend's path costs around its GEMMs decides at decode sizes); the GEMM table where none applies
        setting = dict(ranks=num_ranks, experts_per_pe=shape.num_experts // num_ranks, hidden=shape.hidden,
                       intermediate=shape.intermediate, topk=shape.topk, block_m=block_m)
        row = layer_choice.choose(setting, max_tokens_per_rank, GC.available_impls(block_m))
        if row is not None:
            choice = GC.resolve_layer(row.impl, block_m, shape, [max_tokens_per_rank] * num_ranks)
            return replace(choice, source=f"{row.source}; its GEMMs: {choice.source}")
    return GC.resolve_layer(gemm, block_m, shape, [max_tokens_per_rank] * num_ranks)


#: the block size a buffer left at ``EPTuning.block_m=None`` takes where CUTLASS or DeepGEMM compute its experts
WIDE_BLOCK_M = 128
#: the backends that run a buffer of an open block size on :data:`WIDE_BLOCK_M`-row blocks
WIDE_BLOCK_GEMMS = ("cutlass", "deep_gemm")


def open_block_m(impl: str, shape: MoEShape) -> int:
    """The block size of a buffer left at ``EPTuning.block_m=None`` whose experts ``impl`` computes (a backend's
    name): :data:`WIDE_BLOCK_M` for CUTLASS and DeepGEMM, the shape's ``block_m`` otherwise
    (:func:`resolve_block_and_gemm` says why)."""
    return WIDE_BLOCK_M if impl in WIDE_BLOCK_GEMMS else shape.block_m


def resolve_block_and_gemm(gemm: str, shape: MoEShape, num_ranks: int, max_tokens_per_rank: int,
                           block_m: Optional[int]) -> tuple[int, "GC.LayerChoice"]:
    """``(block_m, GEMMs)`` of a buffer. An explicit ``block_m`` is kept and the GEMMs resolved for it
    (:func:`resolve_gemm`). ``None`` (the default): :data:`WIDE_BLOCK_M` where the GEMMs are CUTLASS or DeepGEMM -
    asked for by name, or what ``"auto"`` resolves to at that block size - else the shape's ``block_m``.

    Why 128 for CUTLASS: its one-block tiles (a tile is one 128-row block, no per-group tensormap update) measured
    faster than its grouped tiles at every size tried, from decode to 8192 tokens per PE, and at decode sizes a
    block as large as the rows per expert reads each expert's weights once (docs/performance.md, "The block size
    of CUTLASS buffers"). DeepGEMM's contiguous layout takes 128-row blocks only. Triton keeps the shape's block
    size: it measured slower on 128-row blocks.
    """
    if block_m is None and gemm == "auto":
        wide = resolve_gemm(gemm, shape, num_ranks, max_tokens_per_rank, WIDE_BLOCK_M)
        if wide.impl in WIDE_BLOCK_GEMMS:
            return WIDE_BLOCK_M, wide
    bm = block_m if block_m is not None else open_block_m(gemm, shape)
    return bm, resolve_gemm(gemm, shape, num_ranks, max_tokens_per_rank, bm)



def schedule(chunks: int, source_order: str, ready_window_us: Optional[float], R: int) -> tuple:
    """What a measured plan and a buffer must share for the measurement to decide for the buffer: the ready
    order's grouped steps (any window) are a schedule of their own; with one chunk, arrival and one source
    per ready step are one schedule (a step per source, in the order they publish; arrival differs only in
    how it takes later chunks)."""
    if source_order == "ready" and R > 1 and ready_window_us is not None:
        return chunks, "ready, grouped"
    if chunks == 1 and source_order in ("ready", "arrival"):
        return 1, "a step per source"
    return chunks, source_order


def check_tuning(tu: EPTuning, R: int, chunks: int, slots: int) -> None:
    """What ``tu`` needs of this job's sizes; errors name the field."""
    if tu.source_order != "rank" and R > 64:
        raise ValueError(f"tuning.source_order {tu.source_order!r} supports up to 64 PEs, got {R}")
    if tu.source_order == "arrival" and slots < chunks:
        raise ValueError(f"tuning.source_order 'arrival' needs num_slots >= the chunks of a forward "
                         f"(max_tokens_per_rank / tokens_per_slot = {chunks}), got num_slots={slots}: a consumer "
                         f"taking all of one source's chunks first could wait for a slot only its own later "
                         f"acknowledgement frees")
    if tu.source_order == "arrival" and tu.policy == "stream_wait":
        raise ValueError("tuning.source_order 'arrival' with policy 'stream_wait' would wait for every source's "
                         "doorbell of a chunk before taking any: use policy 'spin_kernel'")


def check_sizes(shape: MoEShape, R: int, max_tokens_per_rank, num_slots, tokens_per_slot, block_m):
    """Validated ``(max_tokens, tokens_per_slot, num_slots, block_m)``; errors name the field."""
    if not isinstance(shape, MoEShape):
        raise ValueError(f"shape must be a MoEShape, got {type(shape).__name__}")
    if shape.num_experts % R:
        raise ValueError(f"shape.num_experts={shape.num_experts} must be a multiple of the {R} PEs")
    if shape.hidden % 128 or shape.intermediate % 128:
        raise ValueError(f"shape.hidden={shape.hidden} and shape.intermediate={shape.intermediate} must be multiples "
                         f"of 128 (one FP8 scale per 128 columns)")
    if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
        raise ValueError(f"max_tokens_per_rank must be an int >= 1, got {max_tokens_per_rank!r}")
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
    C = max_tokens_per_rank if tokens_per_slot is None else tokens_per_slot
    if not isinstance(C, int) or not 1 <= C <= max_tokens_per_rank:
        raise ValueError(f"tokens_per_slot must be an int in [1, max_tokens_per_rank={max_tokens_per_rank}], "
                         f"got {tokens_per_slot!r}")
    bm = shape.block_m if block_m is None else block_m
    if bm not in BLOCK_MS:
        raise ValueError(f"block_m must be one of {BLOCK_MS}, got {bm!r}")
    return max_tokens_per_rank, C, num_slots, bm


def check_layer_routing(routing: MoEShape, shape: MoEShape) -> None:
    """A layer's ``routing`` serves a buffer of ``shape`` only with its sizes; errors name the field."""
    for f in ("hidden", "intermediate", "num_experts", "topk"):
        if getattr(routing, f) != getattr(shape, f):
            raise ValueError(f"routing.{f}={getattr(routing, f)} differs from the buffer's shape.{f}="
                             f"{getattr(shape, f)}: a buffer serves layers of one size")


def memory_report(shape: MoEShape, num_ranks: int, *, max_tokens_per_rank: int, num_slots: int = 2,
                  tokens_per_slot: Optional[int] = None, block_m: Optional[int] = None, gemm: str = "triton") -> dict:
    """Bytes per PE of an :class:`EPBuffer` of these sizes, without allocating anything. ``gemm``: the backend that
    computes the experts (a key of ``gemm.backends.CAPABILITIES``); ``block_m=None`` takes the block size a buffer
    left at ``EPTuning.block_m=None`` takes with that backend (:func:`open_block_m`).

    Returns a dict: ``symmetric`` (both rings + the combine area: what NVSHMEM's heap must hold),
    ``one_layer_ring_and_combine`` (the streamed ring + the combine area: what a buffer per layer would
    hold at the least), ``ratio`` (symmetric / one layer), ``local`` (the expert blocks' scratch and
    the producer's, on the GPU outside the symmetric heap) and each part.
    """
    R, H, Kk, E, I = num_ranks, shape.hidden, shape.topk, shape.num_experts, shape.intermediate
    if gemm not in CAPABILITIES:
        raise ValueError(f"gemm must be one of {tuple(CAPABILITIES)}, got {gemm!r}")
    block_m = open_block_m(gemm, shape) if block_m is None else block_m
    M, C, S, bm = check_sizes(shape, R, max_tokens_per_rank, num_slots, tokens_per_slot, block_m)
    lay = dict(num_ranks=R, hidden=H, topk=Kk, num_experts=E)
    nch_s = -(-M // C)
    batch_ring = RingLayout(num_slots=1, tokens_per_slot=M, **lay).nbytes
    stream_ring = RingLayout(num_slots=min(S, nch_s), tokens_per_slot=C, **lay).nbytes
    cap = max(M, nch_s * C)
    combine = CombineLayout(max_tokens=cap, topk=Kk, hidden=H, max_chunks=max(nch_s, 1)).nbytes
    E_loc = E // R
    max_blocks = -(-(R * cap) * Kk // bm) + E_loc
    rows = max_blocks * bm
    local = rows * (H + H // 128 * 4 + I + I // 128 * 4 + 4 + 4 + 8 + 4)  # a, a_sf, h1, h1_sf, weight, src, tok, chunk
    if not CAPABILITIES[gemm].owner_rows:
        local += rows * (2 * I * 2 + I // 128 * 4 + H * 2)  # bf16 L1 output, L2 scales, local y
    sym = batch_ring + stream_ring + combine
    one = stream_ring + combine
    return {"symmetric": sym, "batch_ring": batch_ring, "stream_ring": stream_ring, "combine": combine,
            "one_layer_ring_and_combine": one, "ratio": sym / one, "local": local}




def consumer_gemm(gemm: str, tuning: EPTuning) -> str:
    """``gemm`` as the tuning's consumer can run it: ``"auto"`` under ``consumer="persistent"`` is the one backend
    whose tile functions make the persistent kernel (``Capabilities.persistent``: Triton), so a machine with
    faster GEMMs built does not turn a persistent consumer's open choice into an error; anything else is kept
    (:func:`check_gemm` refuses an explicit backend the consumer cannot run, naming the field)."""
    if gemm == "auto" and tuning.consumer == "persistent":
        runs = [name for name, cap in CAPABILITIES.items() if cap.persistent]
        if len(runs) == 1:
            return runs[0]
    return gemm


def check_gemm(tuning: EPTuning, gemm: str, on_gpu: bool) -> None:
    """What ``tuning`` needs of the resolved GEMMs and of the device; errors name the field."""
    cap = CAPABILITIES[gemm]
    if tuning.consumer == "persistent" and (not cap.persistent or tuning.transport == "nv"
                                            or tuning.policy == "green_ctx"):
        raise ValueError(f"tuning.consumer 'persistent' runs the Triton GEMMs storing straight into the owners over "
                         f"P2P: it needs gemm 'triton' (got {gemm!r}), transport 'auto' or 'p2p' (got "
                         f"{tuning.transport!r}) and a policy other than 'green_ctx' (got {tuning.policy!r})")
    if tuning.chunk_gemm_ctas is not None and not cap.max_ctas:
        raise ValueError(f"tuning.chunk_gemm_ctas must be None with gemm {gemm!r} (it sizes its own grid)")
    if not on_gpu and tuning.policy != "serialized":
        raise ValueError(f"policy {tuning.policy!r} needs a GPU (streams); off the GPU only 'serialized' runs")
