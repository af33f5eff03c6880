"""The ring's layout and generations: where every region lives, and what a generation word says.

:class:`RingLayout` derives every offset of the symmetric ring buffer from a few sizes (the CUDA
side receives them from :meth:`RingLayout.descriptor`), :class:`CombineLayout` the combine buffer
of the GPU layer; a generation packs ``(epoch, chunk + 1)`` into one 64-bit word
(:func:`make_gen`), and :func:`classify_gen` is rule 6 (ABA) of the ordering argument in
:mod:`streamring.ring.protocol`. :class:`StreamPlan` is what every rank agrees at ``begin_stream``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cached_property

from ..device.ringdesc import LAYOUT_FIELDS as DESC_LAYOUT_FIELDS
from ..device.ringdesc import (  # noqa: F401  (one definition, shared with the CUDA side)
    META_BASE, META_CHUNK, META_LAYOUT_GEN, META_LAYOUT_NS, META_ROUTE_GEN, META_ROUTE_NS, META_VALID,
    META_WORDS, SEQ_BITS, SEQ_MASK,
)

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

    @cached_property
    def offsets(self) -> dict[str, int]:
        """Byte offset of every region (and ``_end``), computed once per layout: the protocol reads an offset
        on every verb (a frozen layout never changes them). Callers must not modify the dict."""
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
