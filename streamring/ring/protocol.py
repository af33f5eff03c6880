"""The chunk-ready ring protocol: publish/acquire/ack/reuse, and the argument for its ordering.

This module is the single source of truth of the protocol; the layout and the generation
encoding it runs on are :mod:`streamring.ring.layout`, its named choices
:mod:`streamring.ring.policies`. It knows no backend: every memory operation goes through the
verbs of ``streamring.device.verbs.SymmetricHeap`` and is argued in those terms. The CUDA side
(``device/csrc``) receives every offset and stride from :meth:`RingLayout.descriptor` instead of
re-deriving them.

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

import time
from dataclasses import dataclass, field

import numpy as np

from ..device.verbs import Region, SignalOp, SymmetricHeap, WaitTimeout, spin_pause
from . import layout as ring_layout
from .layout import (
    MAX_EPOCH, MAX_SEQ, META_BASE, META_CHUNK, META_LAYOUT_GEN, META_LAYOUT_NS, META_ROUTE_GEN, META_ROUTE_NS,
    META_VALID, META_WORDS, GenState, RingLayout, StreamPlan, gen_str,
)
from .policies import Inject

#: Extra diagnostics appended to every watchdog report (registered by the host
#: layer, e.g. which peer processes are dead or stopped). Callables returning text.
DIAGNOSTIC_HOOKS: list = []


class ProtocolViolation(RuntimeError):
    """A peer's generation or metadata broke the protocol (names rank and field)."""


class WatchdogError(RuntimeError):
    """A wait passed its deadline; the message holds every slot state this rank can see."""


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
                 inject: Inject = Inject.NONE, inject_delay_s: float = 0.02, owner_release: bool = False,
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
            # looked up per call (not bound at import): the model checker checks the same function
            st = ring_layout.classify_gen(seen, g, L.num_slots, ignore_epoch=ignore)
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
