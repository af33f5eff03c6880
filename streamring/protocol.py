"""The chunk-ready ring protocol: layout, generations, publish/acquire/ack/reuse.

This module is the single source of truth of the protocol. It knows no
backend: every memory operation goes through the verbs of
``streamring.device.verbs.SymmetricHeap`` and is argued in those terms. The
CUDA side (``device/csrc``) receives every offset and stride from
:meth:`RingLayout.descriptor` instead of re-deriving them.

Roles, for source (owner) rank ``r``, slot ``s = c % num_slots`` and chunk ``c``
of the stream of epoch ``e``, generation ``g = make_gen(e, c + 1)``:

    route producer (on r):   reserve(s, c) -> write topk_idx/topk_weights/meta
                             -> fence -> route_ready_gen[r][s] := g  at every rank
    layout producer (on r):  reserve(s, c) -> write x/x_sf
                             -> fence -> layout_ready_gen[r][s] := g at every rank
    consumer (on d):         wait route_ready_gen[r][s] == g and layout_ready_gen[r][s] == g
                             (acquire) -> read r's slot -> ack: fetch_or(bit d) into
                             r's ack_mask[s] (release) -> consumed_gen[r][s] := g (own record)
    owner (on r):            ack_mask[s] full (acquire) -> consumed_gen[r][s] := g
                             -> ack_mask[s] := 0 -> slot may take chunk c + num_slots

Ordering argument, step by step (the model checker in ``streamring.verify``
explores these same steps over every interleaving):

1. *Payload before generation.* The producer's payload stores are local
   stores into its own symmetric segment; ``signal_op`` has release semantics
   (backends fence first), so a consumer that observes ``g`` observes them.
2. *Acquire before read.* ``signal_fetch`` is an acquire: the consumer's payload
   reads (``get``) are issued after it and cannot be satisfied earlier.
3. *Reuse only after every acknowledgement.* The consumer's ``fetch_or`` is a
   release issued after its reads have completed (``get`` completes on return),
   so once the owner observes the full mask (acquire) no read of chunk ``c``
   is outstanding, and overwriting the slot with chunk ``c + S`` is safe.
4. *Mask reset.* The owner clears the mask before it publishes chunk
   ``c + S``; no consumer can acknowledge ``c + S`` before that publish, and
   every acknowledgement of ``c`` is already in the mask (it was full). So a
   bit can never be carried from one chunk to the next.
5. *Independent generations.* Route and layout write disjoint payload bytes
   and disjoint metadata words, and each has its own generation word, so
   they may complete in either order; the consumer needs both.
6. *ABA.* A generation carries the epoch: leftovers of epoch ``e - 1`` (same
   slot, same chunk index) never equal ``make_gen(e, c + 1)``. Within an
   epoch the sequence is ``c + 1``, which grows by ``S`` per ring wrap, so
   the value of the previous lap is strictly older. A value that is neither
   the expected one nor older is a violation (:class:`ProtocolViolation`).
7. *Empty and uneven ranks.* Every rank publishes the same number of chunks
   per stream (the maximum over ranks, agreed at ``begin_stream``); a rank
   with fewer tokens publishes zero-token chunks. So every consumer's wait
   for ``(r, c)`` is matched by a publish and nobody blocks on a rank with
   no tokens.
8. *Stream end.* ``end_stream`` drains: the owner waits for the full masks of
   its last ``min(S, num_chunks)`` chunks, so the next epoch starts with every
   slot acknowledged and every mask zero.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .device.ringdesc import LAYOUT_FIELDS as DESC_LAYOUT_FIELDS
from .device.ringdesc import (  # noqa: F401  (one definition, shared with the CUDA side)
    META_BASE, META_CHUNK, META_LAYOUT_GEN, META_LAYOUT_NS, META_ROUTE_GEN, META_ROUTE_NS, META_VALID,
    META_WORDS, SEQ_BITS, SEQ_MASK,
)
from .device.verbs import Region, SignalOp, SymmetricHeap, WaitTimeout, spin_pause

# --------------------------------------------------------------------------------------
# Generations
# --------------------------------------------------------------------------------------
EPOCH_BITS = 31  # keep generations below 2**63 (signed 64-bit on every side)
MAX_EPOCH = (1 << EPOCH_BITS) - 1
MAX_SEQ = SEQ_MASK


def make_gen(epoch: int, seq: int) -> int:
    """Pack a 64-bit generation ``(epoch, sequence)``; ``seq = chunk + 1`` so 0 means "never"."""
    if not 1 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch {epoch} outside [1, {MAX_EPOCH}]")
    if not 1 <= seq <= MAX_SEQ:
        raise ValueError(f"sequence {seq} outside [1, {MAX_SEQ}]")
    return (epoch << SEQ_BITS) | seq


def split_gen(gen: int) -> tuple[int, int]:
    """Unpack a generation into ``(epoch, sequence)``."""
    return gen >> SEQ_BITS, gen & SEQ_MASK


def gen_str(gen: int) -> str:
    """Readable form of a generation for diagnostics."""
    if gen == 0:
        return "0"
    e, s = split_gen(gen)
    return f"e{e}:c{s - 1}"


class GenState(enum.Enum):
    """How an observed generation relates to the expected one."""

    READY = "ready"
    OLDER = "older"  # not yet published: keep waiting
    VIOLATION = "violation"  # newer than expected, or from a wrong slot


class Inject(enum.Enum):
    """Deliberate protocol mutations, used to prove the checkers can fail."""

    NONE = "none"
    SKIP_ACQUIRE = "skip-acquire"
    SIGNAL_BEFORE_PAYLOAD = "signal-before-payload"
    SKIP_ACK_WAIT = "skip-ack-wait"
    IGNORE_EPOCH = "ignore-epoch"


INJECT_MODES = tuple(m.value for m in Inject if m is not Inject.NONE)

# The order in which a consumer takes the sources of one chunk: rank order (the default, model-
# checked up to 3 ranks), or any source whose chunk is ready first (an RFC later optimisation,
# model-checked at 2 ranks; see streamring.verify).
SOURCE_ORDERS = ("rank", "ready")
# The expert-parallel GPU layer's dispatch orders: the ring's two and ``arrival`` (sources in the order their
# first chunk is published, all of a source's chunks before the next source's; streamring.moe.ep_buffer)
EP_SOURCE_ORDERS = SOURCE_ORDERS + ("arrival",)

# How a consumer that is enqueued on a GPU *before* its producers still lets them run (the RFC's
# "progress mechanism"); one definition for the config, the device ring, its self-test and the
# GPU MoE layer:
#   serialized  - producer then consumer, chunk by chunk, on one stream: no overlap, always valid;
#   stream_wait - the consumer stream blocks in cuStreamWaitValue64 on the ring's doorbell words
#                 (no SM held while it waits), then the exact generation check runs;
#   spin_kernel - a one-thread-per-source kernel polls the generations (acquire, with a deadline);
#   green_ctx   - producer and consumer on disjoint green-context SM partitions (P2P transport);
#   pdl         - the serialized order with programmatic dependent launch of the expert GEMMs
#                 (the ring kernels themselves run as in serialized).
PROGRESS_POLICIES = ("serialized", "stream_wait", "spin_kernel", "green_ctx", "pdl")

# Progress policies the expert-parallel GPU layer refuses, with the measured reason (docs/gpu.md); the
# device ring's own self-test still runs them.
REFUSED_POLICIES = {
    "pdl": "its serialized order overlaps nothing (1.17x batch at 4 chunks on one H200), and one measured run's "
           "streamed output was not bitwise equal to batch where every other policy's was (not reproduced by "
           "bench.pdl_probe since, docs/performance.md); it gains nothing to weigh against that doubt",
}

# The expert GEMM implementations of the GPU layer ("auto": the fastest available one of the measured table,
# streamring/moe/gemm_choice.py).
GEMM_CHOICES = ("auto", "triton", "cutlass", "deep_gemm")


def classify_gen(observed: int, expected: int, num_slots: int, ignore_epoch: bool = False) -> GenState:
    """Compare a generation word with the expected one (rule 6 of the module doc).

    ``OLDER`` covers: 0 (never published), any earlier epoch, and an earlier
    lap of the same slot in the same epoch. Everything else that is not equal
    is a violation (a later generation, or a sequence of another slot).
    ``ignore_epoch`` is the ``ignore-epoch`` mutation: compare sequences only.
    """
    if ignore_epoch:
        observed &= SEQ_MASK
        expected &= SEQ_MASK
    if observed == expected:
        return GenState.READY
    if observed == 0:
        return GenState.OLDER
    oe, os_ = split_gen(observed)
    ee, es = split_gen(expected)
    if oe < ee:
        return GenState.OLDER
    if oe == ee and os_ < es and (es - os_) % num_slots == 0:
        return GenState.OLDER
    return GenState.VIOLATION


#: Extra diagnostics appended to every watchdog report (registered by the host
#: layer, e.g. which peer processes are dead or stopped). Callables returning text.
DIAGNOSTIC_HOOKS: list = []


class ProtocolViolation(RuntimeError):
    """A peer's generation or metadata broke the protocol (names rank and field)."""


class WatchdogError(RuntimeError):
    """A wait passed its deadline; the message holds every slot state this rank can see."""


# --------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------
ALIGN = 128
SF_BLOCK = 128  # one float32 scale per token per 128 columns of x


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class RingLayout:
    """Where every region of the ring lives inside one symmetric buffer.

    Derived once from a few sizes; the Python and CUDA sides both use these
    offsets (see :meth:`descriptor`). All offsets are in bytes from the start
    of the buffer and aligned to 128 bytes.

    Signal words (uint64, written only through signal/atomic verbs):
        route_ready_gen[src][slot], layout_ready_gen[src][slot],
        consumed_gen[src][slot], ack_mask[slot][mask_words]
    Slot payload (written by the owner's producers, read by every consumer):
        meta[slot][8] int64, x[slot][tokens][hidden] fp8 e4m3 (bytes),
        x_sf[slot][tokens][hidden/128] float32, topk_idx[slot][tokens][topk] int64,
        topk_weights[slot][tokens][topk] float32
    Combine (written by consumers into the owner, read by the owner), optional:
        combine[slot][tokens][topk][hidden] float32
    Doorbells of the GPU ``stream_wait`` progress policy (uint64 lap numbers):
        wake[route|layout][src][slot]
    """

    num_ranks: int
    num_slots: int
    tokens_per_slot: int
    hidden: int
    topk: int
    num_experts: int
    with_combine: bool = False

    def __post_init__(self):
        problems = []
        if self.num_ranks < 1:
            problems.append(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.num_slots < 1:
            problems.append(f"ring.num_slots must be >= 1, got {self.num_slots}")
        if self.tokens_per_slot < 1:
            problems.append(f"ring.tokens_per_slot must be >= 1, got {self.tokens_per_slot}")
        if self.hidden < SF_BLOCK or self.hidden % SF_BLOCK:
            problems.append(f"hidden must be a positive multiple of {SF_BLOCK}, got {self.hidden}")
        if self.num_experts < 1:
            problems.append(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.topk <= max(self.num_experts, 1):
            problems.append(f"topk must be in [1, num_experts={self.num_experts}], got {self.topk}")
        if problems:
            raise ValueError("invalid ring layout: " + "; ".join(problems))

    # -- sizes -----------------------------------------------------------------------------
    @property
    def mask_words(self) -> int:
        """64-bit words per acknowledgement bitmask: ceil(num_ranks / 64)."""
        return math.ceil(self.num_ranks / 64)

    @property
    def sf_cols(self) -> int:
        return self.hidden // SF_BLOCK

    def _sizes(self) -> list[tuple[str, int]]:
        R, S, C, H, K = self.num_ranks, self.num_slots, self.tokens_per_slot, self.hidden, self.topk
        sizes = [
            ("route_ready_gen", R * S * 8),
            ("layout_ready_gen", R * S * 8),
            ("consumed_gen", R * S * 8),
            ("ack_mask", S * self.mask_words * 8),
            ("meta", S * META_WORDS * 8),
            ("x", S * C * H),
            ("x_sf", S * C * self.sf_cols * 4),
            ("topk_idx", S * C * K * 8),
            ("topk_weights", S * C * K * 4),
        ]
        if self.with_combine:
            sizes.append(("combine", S * C * K * H * 4))
        # doorbells of the GPU stream_wait policy: [route|layout][src][slot] lap numbers
        sizes.append(("wake", 2 * R * S * 8))
        return sizes

    @property
    def offsets(self) -> dict[str, int]:
        off, out = 0, {}
        for name, size in self._sizes():
            out[name] = off
            off += _align(size)
        out["_end"] = off
        return out

    @property
    def nbytes(self) -> int:
        """Total bytes of the symmetric buffer per rank."""
        return self.offsets["_end"]

    # -- word offsets of signals -----------------------------------------------------------
    def route_gen_off(self, src: int, slot: int) -> int:
        return self.offsets["route_ready_gen"] + (src * self.num_slots + slot) * 8

    def layout_gen_off(self, src: int, slot: int) -> int:
        return self.offsets["layout_ready_gen"] + (src * self.num_slots + slot) * 8

    def consumed_gen_off(self, src: int, slot: int) -> int:
        return self.offsets["consumed_gen"] + (src * self.num_slots + slot) * 8

    def ack_word_off(self, slot: int, word: int) -> int:
        return self.offsets["ack_mask"] + (slot * self.mask_words + word) * 8

    def full_mask(self, word: int) -> int:
        """Expected value of ack word ``word`` once every rank acknowledged."""
        lo = word * 64
        n = min(64, self.num_ranks - lo)
        return (1 << n) - 1

    # -- payload offsets ------------------------------------------------------------------------
    def meta_off(self, slot: int) -> int:
        return self.offsets["meta"] + slot * META_WORDS * 8

    def x_off(self, slot: int, token: int = 0) -> int:
        return self.offsets["x"] + (slot * self.tokens_per_slot + token) * self.hidden

    def x_sf_off(self, slot: int, token: int = 0) -> int:
        return self.offsets["x_sf"] + (slot * self.tokens_per_slot + token) * self.sf_cols * 4

    def topk_idx_off(self, slot: int, token: int = 0) -> int:
        return self.offsets["topk_idx"] + (slot * self.tokens_per_slot + token) * self.topk * 8

    def topk_weights_off(self, slot: int, token: int = 0) -> int:
        return self.offsets["topk_weights"] + (slot * self.tokens_per_slot + token) * self.topk * 4

    def combine_off(self, slot: int, token: int = 0, k: int = 0) -> int:
        if not self.with_combine:
            raise ValueError("this layout has no combine region (with_combine=False)")
        return self.offsets["combine"] + ((slot * self.tokens_per_slot + token) * self.topk + k) * self.hidden * 4

    def descriptor(self) -> dict[str, int]:
        """Every size, offset and stride the device side needs (mirrors ``RingDesc`` in csrc)."""
        o = self.offsets
        d = {
            "num_ranks": self.num_ranks,
            "num_slots": self.num_slots,
            "tokens_per_slot": self.tokens_per_slot,
            "hidden": self.hidden,
            "topk": self.topk,
            "num_experts": self.num_experts,
            "mask_words": self.mask_words,
            "sf_cols": self.sf_cols,
            "off_route_ready_gen": o["route_ready_gen"],
            "off_layout_ready_gen": o["layout_ready_gen"],
            "off_consumed_gen": o["consumed_gen"],
            "off_ack_mask": o["ack_mask"],
            "off_meta": o["meta"],
            "off_x": o["x"],
            "off_x_sf": o["x_sf"],
            "off_topk_idx": o["topk_idx"],
            "off_topk_weights": o["topk_weights"],
            "off_combine": o.get("combine", -1),
            "stride_x_slot": self.tokens_per_slot * self.hidden,
            "stride_x_sf_slot": self.tokens_per_slot * self.sf_cols * 4,
            "stride_topk_idx_slot": self.tokens_per_slot * self.topk * 8,
            "stride_topk_weights_slot": self.tokens_per_slot * self.topk * 4,
            "meta_words": META_WORDS,
            "total_bytes": self.nbytes,
        }
        d = {k: d[k] for k in DESC_LAYOUT_FIELDS} if tuple(d) == DESC_LAYOUT_FIELDS else None
        if d is None:
            raise AssertionError("RingLayout.descriptor() keys differ from device/ringdesc.LAYOUT_FIELDS")
        return d


@dataclass(frozen=True)
class CombineLayout:
    """The owner's combine area of the expert-parallel GPU layer (one symmetric buffer per PE).

    Unlike the ring's slot-indexed ``combine`` region (the CPU layer, whose consumers acknowledge
    only after their results are back), these rows are indexed by the owner's *logical token*, so
    a consumer may acknowledge a slot right after copying its rows out (the RFC's early
    ``input_consumed``) and deliver the results whenever its expert blocks run:

        arrived[max_chunks] uint64    rows of chunk c delivered (consumers ADD with release; the
                                      owner waits for its expected count with acquire, then resets
                                      the word to 0 before its next epoch publishes anything)
        rows[max_tokens][topk][hidden] bf16   the result of (token, k), routing weight applied
    """

    max_tokens: int
    topk: int
    hidden: int
    max_chunks: int

    def __post_init__(self):
        for name in ("max_tokens", "topk", "hidden", "max_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"CombineLayout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def off_arrived(self) -> int:
        return 0

    @property
    def off_rows(self) -> int:
        return _align(self.max_chunks * 8)

    @property
    def rows_bytes(self) -> int:
        return self.max_tokens * self.topk * self.hidden * 2

    @property
    def nbytes(self) -> int:
        """Total bytes of the symmetric combine buffer per PE."""
        return self.off_rows + _align(self.rows_bytes)


# --------------------------------------------------------------------------------------
# Stream plan
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamPlan:
    """What every rank agreed at ``begin_stream``."""

    epoch: int
    tokens_per_rank: tuple[int, ...]
    tokens_per_slot: int

    @property
    def num_chunks(self) -> int:
        """Chunks per rank this stream (the maximum over ranks; shorter ranks pad with empty chunks)."""
        return max((math.ceil(t / self.tokens_per_slot) for t in self.tokens_per_rank), default=0)

    def chunk_tokens(self, rank: int, chunk: int) -> tuple[int, int]:
        """``(token_base, valid_count)`` of ``rank``'s chunk ``chunk``."""
        base = chunk * self.tokens_per_slot
        valid = max(0, min(self.tokens_per_slot, self.tokens_per_rank[rank] - base))
        return base, valid

    def gen(self, chunk: int) -> int:
        return make_gen(self.epoch, chunk + 1)


@dataclass
class ChunkView:
    """A consumer's copy of one source chunk (metadata checked)."""

    src: int
    chunk: int
    gen: int
    token_base: int
    valid: int
    topk_idx: np.ndarray | None = None  # [valid, topk] int64
    topk_weights: np.ndarray | None = None  # [valid, topk] float32
    x: np.ndarray | None = None  # [valid, hidden] uint8 (fp8 e4m3 bits)
    x_sf: np.ndarray | None = None  # [valid, hidden/128] float32
    publish_ns: int = 0


@dataclass
class RingStats:
    """Counters of one rank, for tables and JSON."""

    chunks_published: int = 0
    chunks_consumed: int = 0
    bytes_read: int = 0
    acquire_waits_s: list = field(default_factory=list)
    reuse_waits_s: list = field(default_factory=list)


# --------------------------------------------------------------------------------------
# The ring
# --------------------------------------------------------------------------------------
class Ring:
    """One rank's endpoint of the chunk-ready ring over a symmetric heap.

    Non-blocking ``try_*`` steps are the protocol; the blocking helpers wrap
    them in a deadline (``wait_timeout_s``) and raise :class:`WatchdogError`
    with :meth:`dump_state` when it passes. Nothing here allocates per chunk.
    """

    def __init__(self, heap: SymmetricHeap, layout: RingLayout, wait_timeout_s: float = 30.0,
                 inject: Inject = Inject.NONE, inject_delay_s: float = 0.002, owner_release: bool = False,
                 name: str = "ring"):
        if layout.num_ranks != heap.num_ranks:
            raise ValueError(f"layout.num_ranks={layout.num_ranks} but the heap has {heap.num_ranks} ranks")
        if wait_timeout_s <= 0:
            raise ValueError(f"wait_timeout_s must be > 0, got {wait_timeout_s}")
        self.heap = heap
        self.layout = layout
        self.me = heap.rank
        self.wait_timeout_s = float(wait_timeout_s)
        self.inject = inject
        self.inject_delay_s = inject_delay_s
        # owner_release: the slot is reusable only after the owner itself has
        # released it (the MoE combine reduces the chunk's contributions first:
        # the RFC's conservative rule). Then try_reserve never collects acks.
        self.owner_release = owner_release
        self.buf: Region = heap.alloc(name, layout.nbytes)
        self.plan: StreamPlan | None = None
        self.last_epoch = 0
        self.stats = RingStats()
        # The ring never touches its memory except through the verbs (puts to
        # itself included), so it runs unchanged on host- and device-memory heaps.
        # which chunk each of my slots last carried in the current stream (-1: none)
        self._slot_chunk = [-1] * layout.num_slots
        self._collected = [0] * layout.num_slots  # generation whose acks were collected (slot free)
        self.aborted = ""  # why a stream was aborted on this ring ('' = never)

    # -- stream lifecycle ---------------------------------------------------------------
    def begin_stream(self, epoch: int, num_tokens: int) -> StreamPlan:
        """Collectively start a stream (epoch) with this rank's token count.

        Epochs must increase on the same buffers and be the same on every rank.
        Every rank's arguments are exchanged in one collective *before* any check
        raises, so a bad argument on one rank makes every rank raise (naming it)
        and the ranks' collectives stay matched.
        """
        err = None
        if self.aborted:
            err = (f"this ring was aborted in the middle of a stream ({self.aborted}); acknowledgement state "
                   f"may be stale: close() it and allocate a new Ring")
        elif not isinstance(num_tokens, int) or num_tokens < 0:
            err = f"num_tokens must be an int >= 0, got {num_tokens!r}"
        elif not isinstance(epoch, int) or epoch <= self.last_epoch or epoch > MAX_EPOCH:
            err = (f"stream_epoch must be in ({self.last_epoch}, {MAX_EPOCH}] (greater than the last epoch used on "
                   f"these buffers), got {epoch!r}")
        elif self.plan is not None:
            err = "begin_stream called twice without end_stream"
        shared = self.heap.allgather_obj((epoch, num_tokens, err))
        bad = [(r, e) for r, (_, _, e) in enumerate(shared) if e]
        if bad:
            mine = dict(bad).get(self.me)
            raise ValueError(mine if mine else "begin_stream refused on every rank: "
                             + "; ".join(f"rank {r}: {e}" for r, e in bad))
        epochs = [e for e, _, _ in shared]
        if len(set(epochs)) != 1:
            raise ValueError(f"ranks started different epochs: {epochs} (stream_epoch must be the same on every rank)")
        tokens = tuple(int(t) for _, t, _ in shared)
        plan = StreamPlan(epoch=epoch, tokens_per_rank=tokens, tokens_per_slot=self.layout.tokens_per_slot)
        if plan.num_chunks > MAX_SEQ:
            raise ValueError(f"{plan.num_chunks} chunks exceed the {MAX_SEQ} sequence numbers of one epoch")
        self.plan = plan
        self.last_epoch = epoch
        self._slot_chunk = [-1] * self.layout.num_slots
        return plan

    def end_stream(self) -> None:
        """Drain: wait until every chunk this rank published was acknowledged by every rank."""
        for _ in self.drain_steps():
            self.heap.progress()
            spin_pause()

    def drain_steps(self):
        """Generator form of :meth:`end_stream` (yields while it would wait; cooperative roles step it)."""
        plan = self._need_plan()
        deadline = time.monotonic() + self.wait_timeout_s
        for slot, chunk in enumerate(self._slot_chunk):
            if chunk >= 0 and self.owner_release and self._collected[slot] != plan.gen(chunk):
                raise RuntimeError(f"end_stream: my chunk {chunk} (slot {slot}) was never released by its owner "
                                   f"role (owner_release=True needs try_collect_acks(slot, chunk) for every "
                                   f"chunk)")
            if chunk >= 0:
                yield from self.wait_steps(lambda s=slot, c=chunk: self.try_collect_acks(s, c),
                                           f"drain: acknowledgements of my chunk {chunk} (slot {slot})",
                                           deadline=deadline)
        self.plan = None

    def abort_stream(self, reason: str = "aborted") -> None:
        """Give up the current stream after an error.

        The ranks may disagree on what was published and acknowledged (masks can
        hold bits of the aborted stream), so the ring is not reused: a later
        ``begin_stream`` refuses on every rank. Free it and allocate a new one.
        """
        if self.plan is not None:
            self.aborted = reason
        self.plan = None

    def _need_plan(self) -> StreamPlan:
        if self.plan is None:
            raise RuntimeError("no stream: call begin_stream(epoch, num_tokens) first")
        return self.plan

    # -- owner: acknowledgements and reuse ------------------------------------------------------
    def acks_complete(self, slot: int, chunk: int) -> bool:
        """Owner: has every rank acknowledged ``chunk`` in ``slot``? (acquire; records nothing)"""
        plan = self._need_plan()
        return self._collected[slot] == plan.gen(chunk) or self.ack_mask_full(slot)

    def try_collect_acks(self, slot: int, chunk: int) -> bool:
        """Owner: if every rank acknowledged ``chunk`` in ``slot``, record it and clear the mask."""
        plan = self._need_plan()
        g = plan.gen(chunk)
        if self._collected[slot] == g:
            return True
        L = self.layout
        # acquire: the consumers' reads of this slot completed before their fetch_or
        if not self.ack_mask_full(slot):
            return False
        # Record first, then clear: a consumer cannot ack chunk + S before we publish it,
        # and we publish it only after this returns (rule 4).
        self.heap.signal_op(self.buf, L.consumed_gen_off(self.me, slot), g, SignalOp.SET, self.me)
        for w in range(L.mask_words):
            self.heap.signal_op(self.buf, L.ack_word_off(slot, w), 0, SignalOp.SET, self.me)
        self._collected[slot] = g
        return True

    def try_reserve(self, chunk: int) -> bool:
        """Producer: may this rank write its slot for ``chunk`` now? (rule 3)

        True once every acknowledgement of ``chunk - num_slots`` has arrived.
        Both producers of a chunk call it; the first collects the acks.
        """
        plan = self._need_plan()
        S = self.layout.num_slots
        if not 0 <= chunk < plan.num_chunks:
            raise ValueError(f"chunk {chunk} outside [0, {plan.num_chunks}) of this stream")
        slot = chunk % S
        prev = chunk - S
        if prev >= 0 and self.inject is not Inject.SKIP_ACK_WAIT:
            if self.owner_release:
                if self._collected[slot] != plan.gen(prev):
                    return False
            elif not self.try_collect_acks(slot, prev):
                return False
        self._slot_chunk[slot] = chunk
        return True

    def ack_mask_full(self, slot: int) -> bool:
        """Is ``slot``'s acknowledgement mask full right now? (acquire loads of every word)"""
        L = self.layout
        return all(self.heap.signal_fetch(self.buf, L.ack_word_off(slot, w)) == L.full_mask(w)
                   for w in range(L.mask_words))

    # -- producers ----------------------------------------------------------------------
    def _check_chunk_arrays(self, chunk: int, arrays: dict[str, tuple[np.ndarray, tuple, np.dtype]]) -> int:
        plan = self._need_plan()
        _, valid = plan.chunk_tokens(self.me, chunk)
        for name, (arr, tail, dtype) in arrays.items():
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
            if arr.dtype != dtype:
                raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {arr.dtype}")
            if arr.ndim != 1 + len(tail) or arr.shape[1:] != tail or arr.shape[0] != valid:
                raise ValueError(
                    f"{name} must have shape ({valid}, {', '.join(map(str, tail))}) for chunk {chunk} "
                    f"(valid tokens of this rank's chunk; tokens_per_slot={self.layout.tokens_per_slot}), "
                    f"got {tuple(arr.shape)}"
                )
        return valid

    def _publish(self, offset_fn, gen: int) -> None:
        # Release to every rank (the owner included: its own consumer reads too).
        for pe in range(self.layout.num_ranks):
            self.heap.signal_op(self.buf, offset_fn(pe), gen, SignalOp.SET, pe)

    def publish_route(self, chunk: int, topk_idx: np.ndarray, topk_weights: np.ndarray) -> None:
        """Route producer: write ``topk_idx``/``topk_weights`` + metadata of ``chunk``, then publish.

        Call only after :meth:`try_reserve` returned True. Inputs are validated
        before any byte is written: an error leaves the slot untouched.
        """
        L = self.layout
        valid = self._check_chunk_arrays(chunk, {
            "topk_idx": (topk_idx, (L.topk,), np.dtype(np.int64)),
            "topk_weights": (topk_weights, (L.topk,), np.dtype(np.float32)),
        })
        if valid and (topk_idx.min() < -1 or topk_idx.max() >= L.num_experts):
            bad = topk_idx[(topk_idx < -1) | (topk_idx >= L.num_experts)]
            raise ValueError(f"topk_idx values must be in [-1, {L.num_experts}), got {int(bad.flat[0])}")
        plan = self._need_plan()
        slot, g = chunk % L.num_slots, plan.gen(chunk)
        base, _ = plan.chunk_tokens(self.me, chunk)

        def write():
            h, me = self.heap, self.me
            if valid:
                h.put(self.buf, L.topk_idx_off(slot), topk_idx, me)
                h.put(self.buf, L.topk_weights_off(slot), topk_weights, me)
            # Route owns meta words 0..4, layout owns 5..6: disjoint, so either order is safe.
            meta = np.array([chunk, base, valid, g, time.monotonic_ns()], dtype=np.int64)
            h.put(self.buf, L.meta_off(slot), meta, me)

        self._write_then_publish(write, lambda pe: L.route_gen_off(self.me, slot), g)

    def publish_layout(self, chunk: int, x: np.ndarray, x_sf: np.ndarray) -> None:
        """Layout producer: write ``x`` (fp8 e4m3 bits as uint8) and ``x_sf`` of ``chunk``, then publish."""
        L = self.layout
        valid = self._check_chunk_arrays(chunk, {
            "x": (x, (L.hidden,), np.dtype(np.uint8)),
            "x_sf": (x_sf, (L.sf_cols,), np.dtype(np.float32)),
        })
        plan = self._need_plan()
        slot, g = chunk % L.num_slots, plan.gen(chunk)

        def write():
            h, me = self.heap, self.me
            if valid:
                h.put(self.buf, L.x_off(slot), x, me)
                h.put(self.buf, L.x_sf_off(slot), x_sf, me)
            meta = np.array([g, time.monotonic_ns()], dtype=np.int64)
            h.put(self.buf, L.meta_off(slot) + META_LAYOUT_GEN * 8, meta, me)

        self._write_then_publish(write, lambda pe: L.layout_gen_off(self.me, slot), g)

    def _write_then_publish(self, write, offset_fn, gen: int) -> None:
        if self.inject is Inject.SIGNAL_BEFORE_PAYLOAD:
            # Mutation: the generation goes out before the payload it guards.
            self._publish(offset_fn, gen)
            time.sleep(self.inject_delay_s)
            write()
            self.heap.fence()
        else:
            write()
            # Rule 1: signal_op is a release; the payload stores above are ordered before it.
            self._publish(offset_fn, gen)
        self.stats.chunks_published += 1

    # -- consumer -------------------------------------------------------------------------------
    def gen_state(self, src: int, chunk: int) -> GenState:
        """Consumer: state of source ``src``'s chunk (both generations, acquire)."""
        plan = self._need_plan()
        L = self.layout
        slot, g = chunk % L.num_slots, plan.gen(chunk)
        if self.inject is Inject.SKIP_ACQUIRE:
            return GenState.READY
        ignore = self.inject is Inject.IGNORE_EPOCH
        worst = GenState.READY
        for field_name, off in (("route_ready_gen", L.route_gen_off(src, slot)),
                                ("layout_ready_gen", L.layout_gen_off(src, slot))):
            seen = self.heap.signal_fetch(self.buf, off)
            st = classify_gen(seen, g, L.num_slots, ignore_epoch=ignore)
            if st is GenState.VIOLATION:
                raise ProtocolViolation(
                    f"rank {self.me}: {field_name}[src={src}][slot={slot}] = {gen_str(seen)} ({seen:#x}) while "
                    f"expecting {gen_str(g)}: neither the expected generation nor an older one"
                )
            if st is GenState.OLDER:
                worst = GenState.OLDER
        return worst

    def try_acquire(self, src: int, chunk: int) -> bool:
        """Consumer: True once both generations of ``(src, chunk)`` equal the expected one."""
        return self.gen_state(src, chunk) is GenState.READY

    def read_chunk(self, src: int, chunk: int, payload: bool = True) -> ChunkView:
        """Consumer: copy the metadata (checked) and, if ``payload``, the whole chunk from ``src``.

        Call only after :meth:`try_acquire` returned True. Metadata of a peer is
        validated before use so a bad peer cannot make us read out of range.
        """
        plan = self._need_plan()
        L = self.layout
        slot, g = chunk % L.num_slots, plan.gen(chunk)
        meta = np.empty(META_WORDS, dtype=np.int64)
        self.heap.get(self.buf, L.meta_off(slot), meta, src)
        view = self._check_meta(src, chunk, slot, g, meta)
        if payload:
            v = view.valid
            view.topk_idx = self.get_rows(src, "topk_idx", slot, 0, v)
            view.topk_weights = self.get_rows(src, "topk_weights", slot, 0, v)
            view.x = self.get_rows(src, "x", slot, 0, v)
            view.x_sf = self.get_rows(src, "x_sf", slot, 0, v)
            self.check_topk(src, view.topk_idx)
        return view

    def get_rows(self, src: int, what: str, slot: int, first: int, count: int) -> np.ndarray:
        """Pull ``count`` token rows starting at ``first`` of ``src``'s slot field ``what``."""
        L = self.layout
        if not (0 <= first and first + count <= L.tokens_per_slot):
            raise ValueError(f"rows [{first}, {first + count}) outside the slot's {L.tokens_per_slot} tokens")
        spec = {
            "x": (L.x_off, np.uint8, L.hidden),
            "x_sf": (L.x_sf_off, np.float32, L.sf_cols),
            "topk_idx": (L.topk_idx_off, np.int64, L.topk),
            "topk_weights": (L.topk_weights_off, np.float32, L.topk),
        }[what]
        off_fn, dtype, width = spec
        out = np.empty((count, width), dtype=dtype)
        if count:
            self.heap.get(self.buf, off_fn(slot, first), out, src)
            self.stats.bytes_read += out.nbytes
        return out

    def _check_meta(self, src: int, chunk: int, slot: int, g: int, meta: np.ndarray) -> ChunkView:
        plan = self._need_plan()
        exp_base, exp_valid = plan.chunk_tokens(src, chunk)
        checks = [
            ("chunk_index", int(meta[META_CHUNK]), chunk),
            ("token_base", int(meta[META_BASE]), exp_base),
            ("valid_count", int(meta[META_VALID]), exp_valid),
        ]
        if self.inject is Inject.NONE:
            checks += [("route_gen", int(meta[META_ROUTE_GEN]), g), ("layout_gen", int(meta[META_LAYOUT_GEN]), g)]
        for name, seen, want in checks:
            if seen != want:
                raise ProtocolViolation(
                    f"rank {self.me}: metadata of source rank {src} slot {slot} chunk {chunk}: {name} = {seen}, "
                    f"expected {want} (tokens_per_slot={self.layout.tokens_per_slot}, source tokens="
                    f"{plan.tokens_per_rank[src]})"
                )
        return ChunkView(src=src, chunk=chunk, gen=g, token_base=exp_base, valid=exp_valid,
                         publish_ns=max(int(meta[META_ROUTE_NS]), int(meta[META_LAYOUT_NS])))

    def check_topk(self, src: int, topk_idx: np.ndarray) -> None:
        """Consumer: raise :class:`ProtocolViolation` (naming ``src``) unless every entry of a peer's
        ``topk_idx`` is an expert or -1 (a masked route): a hostile value never indexes anything."""
        E = self.layout.num_experts
        if topk_idx.size and (topk_idx.min() < -1 or topk_idx.max() >= E):
            bad = topk_idx[(topk_idx < -1) | (topk_idx >= E)]
            raise ProtocolViolation(
                f"rank {self.me}: topk_idx from source rank {src} holds {int(bad.flat[0])}, outside [-1, {E})"
            )

    def put_combine_row(self, src: int, slot: int, token: int, k: int, row: np.ndarray) -> None:
        """Consumer: put one float32 result row (``hidden`` values) into source ``src``'s combine
        area at ``(slot, token, k)``. Complete on return; the later :meth:`ack` (a release) makes
        it visible to the owner together with the acknowledgement."""
        self.heap.put(self.buf, self.layout.combine_off(slot, token, k), row, src)

    def read_combine(self, slot: int, valid: int) -> np.ndarray:
        """Owner: my combine area of ``slot`` (``[valid, topk, hidden]`` float32); call only after
        :meth:`acks_complete` (every consumer's puts are complete before its acknowledgement)."""
        out = np.empty((valid, self.layout.topk, self.layout.hidden), dtype=np.float32)
        if valid:
            self.heap.get(self.buf, self.layout.combine_off(slot, 0, 0), out, self.me)
        return out

    def ack(self, src: int, chunk: int) -> None:
        """Consumer: acknowledge ``(src, chunk)``: our reads (and combine puts) are complete (release)."""
        plan = self._need_plan()
        L = self.layout
        slot, g = chunk % L.num_slots, plan.gen(chunk)
        word, bit = divmod(self.me, 64)
        # Own record of what we consumed from src (diagnostics, stress checker),
        # written BEFORE the acknowledgement: the fetch_or below is a release, so an
        # owner that saw our bit also sees this record. Row src == me belongs to
        # the owner role (set when every rank acknowledged).
        if src != self.me:
            self.heap.signal_op(self.buf, L.consumed_gen_off(src, slot), g, SignalOp.SET, self.me)
        old = self.heap.atomic_fetch_or(self.buf, L.ack_word_off(slot, word), 1 << bit, src)
        if old & (1 << bit) and self.inject is Inject.NONE:
            raise ProtocolViolation(
                f"rank {self.me}: ack bit already set in rank {src}'s ack_mask[slot={slot}] when acknowledging "
                f"chunk {chunk}: the owner did not clear it (double acknowledgement)"
            )
        self.stats.chunks_consumed += 1

    # -- waiting ----------------------------------------------------------------------------
    def wait_steps(self, pred, what: str, waits: list | None = None, deadline: float | None = None):
        """Generator: yields while ``pred()`` is False (cooperative roles step it).

        Raises :class:`WatchdogError` with :meth:`dump_state` once ``deadline``
        (default: now + ``wait_timeout_s``) has passed; appends the time waited
        to ``waits``.
        """
        start = time.monotonic()
        deadline = start + self.wait_timeout_s if deadline is None else deadline
        while not pred():
            now = time.monotonic()
            if now > deadline:
                raise WatchdogError(
                    f"rank {self.me}: watchdog: waited {now - start:.2f}s (wait_timeout_s={self.wait_timeout_s}) "
                    f"for {what}\n{self.dump_state()}"
                ) from WaitTimeout(what, now - start)
            yield
        if waits is not None:
            waits.append(time.monotonic() - start)

    def wait_until(self, pred, what: str, waits: list | None = None, deadline: float | None = None) -> None:
        """Blocking :meth:`wait_steps`: spin (with progress and yield) until ``pred()``."""
        for _ in self.wait_steps(pred, what, waits, deadline):
            self.heap.progress()
            spin_pause()

    def reserve(self, chunk: int) -> None:
        """Blocking :meth:`try_reserve` with the watchdog deadline."""
        self.wait_until(lambda: self.try_reserve(chunk),
                        f"reuse of my slot {chunk % self.layout.num_slots} for chunk {chunk} "
                        f"(acknowledgements of chunk {chunk - self.layout.num_slots})", self.stats.reuse_waits_s)

    def acquire(self, src: int, chunk: int) -> None:
        """Blocking :meth:`try_acquire` with the watchdog deadline."""
        self.wait_until(lambda: self.try_acquire(src, chunk),
                        f"route+layout generations {gen_str(self._need_plan().gen(chunk))} of source rank {src} "
                        f"(chunk {chunk}, slot {chunk % self.layout.num_slots})", self.stats.acquire_waits_s)

    # -- diagnostics --------------------------------------------------------------------------
    def dump_state(self) -> str:
        """Every slot state this rank can see: generations per source and its own masks."""
        L = self.layout
        rows = [f"ring state seen by rank {self.me} (stream epoch "
                f"{self.plan.epoch if self.plan else '-'}, {L.num_ranks} ranks x {L.num_slots} slots):"]
        sig = lambda off: self.heap.signal_fetch(self.buf, off)  # noqa: E731
        for src in range(L.num_ranks):
            for s in range(L.num_slots):
                rows.append(
                    f"  src {src} slot {s}: route_ready_gen={gen_str(sig(L.route_gen_off(src, s)))} "
                    f"layout_ready_gen={gen_str(sig(L.layout_gen_off(src, s)))} "
                    f"consumed_gen={gen_str(sig(L.consumed_gen_off(src, s)))}"
                )
        for s in range(L.num_slots):
            words = [sig(L.ack_word_off(s, w)) for w in range(L.mask_words)]
            missing = [r for r in range(L.num_ranks) if not (words[r // 64] >> (r % 64)) & 1]
            rows.append(f"  my slot {s}: chunk={self._slot_chunk[s]} ack_mask="
                        + ",".join(f"{w:#x}" for w in words) + f" missing acks from ranks {missing}")
        for hook in DIAGNOSTIC_HOOKS:
            extra = hook()
            if extra:
                rows.append(extra)
        return "\n".join(rows)

    def close(self) -> None:
        """Free the symmetric buffer (collective)."""
        self.heap.free(self.buf)
