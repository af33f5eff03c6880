"""The expert-parallel MoE layer on the ring: producers, schedulers, combine.

One :class:`MoEBuffer` per rank owns the symmetric allocation (the RFC's
``get_symm_buffer_for_mega_moe(..., front_num_slots=S, front_tokens_per_slot=C)``)
and :meth:`MoEBuffer.forward` runs the layer (the RFC's
``fp8_fp4_mega_moe(..., streaming=True, stream_epoch=epoch)``).

Both paths run the same roles over a :class:`~streamring.ring.protocol.Ring`:

* **route producer** (per chunk): router GEMM + top-k of the chunk's tokens ->
  ``topk_idx``/``topk_weights`` -> ``publish_route``;
* **layout producer** (per chunk): FP8 quantisation -> ``x``/``x_sf`` -> ``publish_layout``;
* **consumer** (every rank, its local experts): acquire both generations of a
  chunk of every source, read ``topk_idx``, pull the routed token rows, run
  L1 -> SwiGLU -> L2 on expert blocks, put every result row into the source's
  ``combine[slot][token][k]`` and acknowledge (the acknowledgement is a
  release after the puts, so it also says "my contributions arrived");
* **combiner** (owner): once every rank acknowledged its chunk (acquire),
  reduce the top-k contributions with the routing weights into ``y`` and only
  then release the slot for reuse (the RFC's conservative first rule).

The **batch-ready path** is the same code on a one-slot ring whose slot holds
the whole batch (one handoff); it is the default and the correctness fallback.
The **streamed path** uses the ``num_slots`` x ``tokens_per_slot`` ring.

Schedulers (how a consumer groups rows into expert blocks):

* ``chunk_local`` (RFC option 1): per chunk, per local expert, the rows of that
  chunk, padded to ``block_m``;
* ``reservation`` (RFC option 2): each local expert has one open block that
  rows of successive chunks are appended to (a reservation of the next free
  rows). **Completion rule:** a block enters L1 when (a) it holds ``block_m``
  rows, or (b) it is *sealed*. A block is sealed at the end of the stream, and
  also *before the consumer waits for chunk n while the block holds a row of
  chunk n - num_slots or older*: the owner of that older chunk cannot publish
  chunk n into the same slot until every consumer acknowledged it, so holding
  the row any longer would deadlock the ring. A chunk of a source is
  acknowledged as soon as every row it sent to this rank went through L2 and
  its result was put back.

Every expert row's result depends only on that row (fixed-shape blocks, see
``moe.math``), and the combine sums the top-k terms in a fixed order, so the
streamed output equals the batch output bitwise whatever the chunking or the
scheduler.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from ..ring.roles import run_roles, sleep_for, wait_for
from ..device.ranges import annotate as nvtx_range
from ..device.verbs import SymmetricHeap
from ..ring.layout import MAX_EPOCH, RingLayout, StreamPlan
from ..ring.protocol import ProtocolViolation, Ring, WatchdogError
from .checks import (check_finite_rows, check_num_tokens, check_out, check_routing, check_stream_epoch, check_streaming,
                     check_x)
from .contract import DEFAULT_DEADLINE_S
from .math import (
    FP8_DTYPE,
    MoEShape,
    combine,
    expert_pool_forward,
    quantize_act_fp8,
)
from .routers import route
from .tuning import MoETuning
from .weights import MoEWeights

#: The valid row count of ``forward``'s ``x``: an int, or a 0-d / 1-element integer tensor.
NumTokens = Union[int, torch.Tensor]


@dataclass
class ForwardStats:
    """What one forward call did on this rank.

    ``experts_hit`` counts this rank's own (local) experts that computed at least one row, not the experts
    of the whole layer; ``rows_computed`` and ``blocks_run`` are this rank's expert rows and blocks."""

    mode: str
    epoch: int
    num_chunks: int
    tokens: int
    experts_hit: int = 0
    rows_computed: int = 0
    blocks_run: int = 0
    wall_s: float = 0.0
    acquire_waits_s: list = field(default_factory=list)


class MoEBuffer:
    """One rank's symmetric buffers for the MoE layer on any heap (the CPU reference layer; collective: every rank
    builds it with the same arguments). It implements :class:`~streamring.moe.contract.MoELayerBuffer`, the
    contract :class:`~streamring.moe.ep_buffer.EPBuffer` implements on GPUs.

    Args:
        heap: this rank's symmetric heap.
        shape: the layer (validated against the number of ranks).
        max_tokens_per_rank: the most tokens any rank passes to one :meth:`forward` (the batch handoff's slot).
        num_slots, tokens_per_slot: the streamed ring (``front_num_slots`` / ``front_tokens_per_slot``); default
            ``tokens_per_slot``: ``max_tokens_per_rank``.
        deadline_s: every wait gives up after this long and says what it waited for.
        tuning: the streamed consumer's switches (:class:`~streamring.moe.tuning.MoETuning`; default: chunk-local
            blocks of ``shape.block_m`` rows, sources in rank order).

    Test hooks (a protocol mutation, a late producer) are set by :mod:`streamring.moe.debug`, as for the GPU buffer.
    """

    def __init__(self, heap: SymmetricHeap, shape: MoEShape, *, max_tokens_per_rank: int, num_slots: int = 2,
                 tokens_per_slot: Optional[int] = None, deadline_s: float = DEFAULT_DEADLINE_S,
                 tuning: Optional[MoETuning] = None):
        if not isinstance(shape, MoEShape):
            raise ValueError(f"shape must be a MoEShape, got {type(shape).__name__}")
        shape.validate(heap.num_ranks)
        if tuning is None:
            tuning = MoETuning()
        elif not isinstance(tuning, MoETuning):
            raise ValueError(f"tuning must be a MoETuning, got {type(tuning).__name__}")
        if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be an int >= 1, got {max_tokens_per_rank!r}")
        self.heap, self.shape, self.tuning, self.deadline_s = heap, shape, tuning, float(deadline_s)
        self.rank, self.num_ranks = heap.rank, heap.num_ranks
        self.max_tokens_per_rank = max_tokens_per_rank
        lay = dict(num_ranks=heap.num_ranks, hidden=shape.hidden, topk=shape.topk,
                   num_experts=shape.num_experts, with_combine=True)
        C = max_tokens_per_rank if tokens_per_slot is None else tokens_per_slot
        self.stream_ring = Ring(heap, RingLayout(num_slots=num_slots, tokens_per_slot=C, **lay),
                                wait_timeout_s=deadline_s, owner_release=True, name="moe-stream-ring")
        self.batch_ring = Ring(heap, RingLayout(num_slots=1, tokens_per_slot=max_tokens_per_rank, **lay),
                               wait_timeout_s=deadline_s, owner_release=True, name="moe-batch-ring")
        per = shape.num_experts // heap.num_ranks
        self.local_experts = range(self.rank * per, (self.rank + 1) * per)
        self.last_stats: Optional[ForwardStats] = None
        self.last_routing: Optional[tuple] = None
        #: an error in the middle of a stream (None: usable): the ranks may then disagree on what was published
        #: and acknowledged, so the buffer refuses further forwards; close it and build a new one on every rank
        self.broken: Optional[str] = None
        self._errors = {"violations": 0, "timeouts": 0}
        #: the late producer of tests and benchmarks (seconds before its first chunk; ``debug.set_producer_delay``)
        self.producer_delay_s = 0.0
        self._resolved_weights = None  # (weights, expert offset) of the current call, set by its input check
        # Weights that prepare_weights checked once: forward skips their full validation (a scan of every
        # expert weight) on each call. Keyed by the object, so dropping the weights drops the entry.
        self._prepared: "weakref.WeakKeyDictionary[MoEWeights, tuple[MoEWeights, int]]" = weakref.WeakKeyDictionary()

    def prepare_weights(self, weights: MoEWeights) -> MoEWeights:
        """Check one layer's weights once (:class:`~streamring.moe.weights.MoEWeights`, all experts or this rank's
        local ones; ``streamring.moe.weights`` builds them from checkpoint tensors); returns ``weights`` itself,
        which :meth:`forward` then takes without scanning every expert weight again. Do not modify them afterwards.
        Raises ValueError naming the bad field, as :meth:`forward` would."""
        if not isinstance(weights, MoEWeights):
            raise ValueError(f"weights must be a MoEWeights, got {type(weights).__name__}")
        self._prepared[weights] = self._local_weights(weights)
        return weights

    def forward(self, x: torch.Tensor, weights: MoEWeights, *, streaming: bool = False,
                stream_epoch: Optional[int] = None, num_tokens: Optional[NumTokens] = None,
                out: Optional[torch.Tensor] = None, routing: Optional[tuple] = None) -> torch.Tensor:
        """The layer on this rank's ``x [T, hidden]`` (collective); returns ``y [T, hidden]`` in ``x``'s dtype.

        The arguments, checks and errors are the contract's (:mod:`streamring.moe.contract`). Here every rank's
        verdict on its arguments is exchanged before anything is published, so a bad argument on one rank makes
        every rank raise (naming the rank). The experts compute in float32; ``y`` is rounded to ``x``'s dtype once.
        :attr:`last_stats` says what the call did on this rank.
        """
        if self.broken:
            raise RuntimeError(f"this MoEBuffer is unusable after an error in the middle of a stream ({self.broken}); "
                               f"close() it and build a new MoEBuffer on every rank (collective)")
        ring = self.stream_ring if isinstance(streaming, (bool, np.bool_)) and streaming else self.batch_ring
        err, checked = self._check_inputs(x, weights, streaming, stream_epoch, num_tokens, out, routing, ring)
        bad = [(r, e) for r, e in enumerate(self.heap.allgather_obj(err)) if e]
        if bad:
            raise ValueError(dict(bad).get(self.rank) or "forward aborted on every rank: "
                             + "; ".join(f"rank {r}: {e}" for r, e in bad))
        n, epoch = checked["valid"], checked["epoch"]
        t0 = time.monotonic()
        plan = ring.begin_stream(epoch, n)
        stats = ForwardStats(mode="stream" if streaming else "batch", epoch=epoch, num_chunks=plan.num_chunks,
                             tokens=n)
        # Rows past the valid count stay zero / -1: the roles write only into the views of the first n rows.
        y = torch.zeros(x.shape[0], self.shape.hidden, dtype=torch.float32, device=x.device)
        routing_out = (torch.full((x.shape[0], self.shape.topk), -1, dtype=torch.int64, device=x.device),
                       torch.zeros(x.shape[0], self.shape.topk, dtype=torch.float32, device=x.device))
        run = _Forward(self, ring, plan, x[:n], weights, checked["routing"], y[:n],
                       (routing_out[0][:n], routing_out[1][:n]), stats, bool(streaming))
        try:
            with nvtx_range(f"streamring forward {stats.mode} epoch {epoch} ({plan.num_chunks} chunks)",
                            color="purple"):
                run_roles([run.route_producer(), run.layout_producer(), run.consumer(), run.combiner()], self.heap)
            ring.end_stream()
        except BaseException as exc:
            self._break(ring, exc)
            raise
        stats.wall_s = time.monotonic() - t0
        self.last_stats, self.last_routing = stats, routing_out
        if out is None:
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        return out.copy_(y)

    def _break(self, ring: Ring, exc: BaseException) -> None:
        """A failure inside a running stream: the buffer refuses further forwards (:attr:`broken`)."""
        ring.abort_stream(f"{type(exc).__name__}")
        self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        kind = "timeouts" if isinstance(exc, WatchdogError) else "violations" if isinstance(
            exc, ProtocolViolation) else None
        if kind:
            self._errors[kind] += 1

    def _check_inputs(self, x, weights, streaming, stream_epoch, num_tokens, out, routing,
                      ring) -> tuple[Optional[str], dict]:
        """This rank's verdict on the arguments of one forward (changes nothing): ``(error or None, checked)``,
        ``checked`` holding the valid row count, the epoch and the routing (checked, on the first rows)."""
        sh = self.shape
        try:
            check_streaming(streaming)
            check_x(x, sh.hidden, max_rows=self.max_tokens_per_rank)
            check_out(out, (x.shape[0], sh.hidden), x.dtype, x.device)
            n = check_num_tokens(num_tokens, int(x.shape[0]))
            epoch = check_stream_epoch(stream_epoch, streaming=bool(streaming), last=ring.last_epoch,
                                       max_epoch=MAX_EPOCH)
            check_finite_rows(x, n)
            if not isinstance(weights, MoEWeights):
                return f"weights must be a MoEWeights, got {type(weights).__name__}", {}
            if weights.w1.device != x.device:
                return f"weights are on {weights.w1.device} but x is on {x.device}: put both on one device", {}
            given = None
            if routing is not None:
                given = check_routing(routing, int(x.shape[0]), sh.topk, sh.num_experts, valid=n, device=x.device)
                given = (given[0][:n], given[1][:n])
            prepared = self._prepared.get(weights)
            self._resolved_weights = prepared if prepared is not None else self._local_weights(weights)
        except Exception as exc:  # noqa: BLE001 - any local error must reach every rank, not desync them
            return (f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)), {}
        return None, {"valid": n, "epoch": ring.last_epoch + 1 if epoch is None else epoch, "routing": given}

    def _local_weights(self, weights: MoEWeights) -> tuple[MoEWeights, int]:
        """``(weights, expert offset)``: full weights are used as they are; local-only ones are shifted."""
        sh = self.shape
        n = weights.w1.shape[0]
        if n == sh.num_experts:
            weights.validate(sh)
            return weights, 0
        per = sh.num_experts // self.num_ranks
        if n == per:
            local_shape = MoEShape(**{**sh.__dict__, "num_experts": per, "n_group": 1, "topk_group": 1,
                                      "topk": min(sh.topk, per), "router": "softmax_topk"})
            # the router weight stays global: check it by hand, experts against the local shape
            if tuple(weights.router_weight.shape) != (sh.num_experts, sh.hidden):
                raise ValueError(f"router_weight must have shape [{sh.num_experts}, {sh.hidden}], "
                                 f"got {list(weights.router_weight.shape)}")
            w = MoEWeights(router_weight=weights.router_weight[:per].contiguous(), correction_bias=None,
                           w1=weights.w1, w3=weights.w3, w2=weights.w2, w1_scale=weights.w1_scale,
                           w3_scale=weights.w3_scale, w2_scale=weights.w2_scale)
            w.validate(local_shape)
            return weights, self.local_experts.start
        raise ValueError(f"weights.w1 must hold all {sh.num_experts} experts or this rank's {per} local experts, "
                         f"got {n}")

    def status(self) -> dict:
        """What the rings recorded on this rank: ``violations`` and ``timeouts`` (forwards that died of one),
        ``first_error`` (why the buffer is :attr:`broken`, or None) and per path (``stream``, ``batch``) the
        chunks published and consumed and the last epoch."""
        paths = {name: {"published": r.stats.chunks_published, "consumed": r.stats.chunks_consumed,
                        "last_epoch": r.last_epoch, "aborted": r.aborted or None}
                 for name, r in (("stream", self.stream_ring), ("batch", self.batch_ring))}
        return {**self._errors, "first_error": self.broken, **paths}

    def check(self) -> None:
        """Raise RuntimeError if a forward died in the middle of a stream (the buffer is then :attr:`broken`:
        close it and build a new one on every rank)."""
        if self.broken:
            raise RuntimeError(f"ring errors on rank {self.rank}: {self.broken} ({self._errors}); close() it and "
                               f"build a new MoEBuffer on every rank")

    def close(self) -> None:
        """Free the symmetric buffers (collective; also after an error, before rebuilding)."""
        self.stream_ring.close()
        self.batch_ring.close()


# ----------------------------------------------------------------------------------
class _Forward:
    """The roles of one forward call on one rank."""

    def __init__(self, buf: MoEBuffer, ring: Ring, plan: StreamPlan, x, weights, routing, y, routing_out,
                 stats: ForwardStats, streaming: bool):
        self.buf, self.ring, self.plan = buf, ring, plan
        self.L = ring.layout
        tuning = buf.tuning
        self.block_m = buf.shape.block_m if tuning.block_m is None else tuning.block_m
        self.x, self.routing, self.y = x, routing, y
        self.idx_out, self.w_out = routing_out
        self.stats = stats
        self.scheduler = tuning.scheduler if streaming else "chunk_local"
        self.source_order = tuning.source_order
        self.me = buf.rank
        self.sh = buf.shape
        self.weights = weights
        self.dev = x.device
        self.full_weights, self.expert_offset = buf._resolved_weights  # checked by forward's preflight
        # the route producer's own copy of its chunks' routing, for the combiner
        self.my_routing: dict[int, tuple] = {}

    # -- producers ------------------------------------------------------------------
    def _chunk_rows(self, c):
        base, valid = self.plan.chunk_tokens(self.me, c)
        return base, valid, self.x[base:base + valid]

    def route_producer(self):
        yield from sleep_for(self.buf.producer_delay_s)
        for c in range(self.plan.num_chunks):
            yield from wait_for(self.ring, lambda: self.ring.try_reserve(c), f"reuse of my slot for chunk {c}")
            base, valid, xc = self._chunk_rows(c)
            if self.routing is not None:  # given by the caller, checked before the stream began
                idx, w = self.routing[0][base:base + valid], self.routing[1][base:base + valid]
            elif valid:
                idx, w = route(xc, self.weights, self.sh)
            else:
                idx = torch.zeros(0, self.sh.topk, dtype=torch.int64, device=self.dev)
                w = torch.zeros(0, self.sh.topk, dtype=torch.float32, device=self.dev)
            idx_np = np.ascontiguousarray(idx.cpu().numpy())
            w_np = np.ascontiguousarray(w.cpu().numpy())
            self.ring.publish_route(c, idx_np, w_np)
            self.my_routing[c] = (idx, w)
            self.idx_out[base:base + valid] = idx
            self.w_out[base:base + valid] = w
            yield

    def layout_producer(self):
        yield from sleep_for(self.buf.producer_delay_s)
        for c in range(self.plan.num_chunks):
            yield from wait_for(self.ring, lambda: self.ring.try_reserve(c), f"reuse of my slot for chunk {c}")
            base, valid, xc = self._chunk_rows(c)
            if valid:
                xq, sf = quantize_act_fp8(xc)
                x_np = np.ascontiguousarray(xq.view(torch.uint8).cpu().numpy())
                sf_np = np.ascontiguousarray(sf.cpu().numpy())
            else:
                x_np = np.zeros((0, self.sh.hidden), dtype=np.uint8)
                sf_np = np.zeros((0, self.L.sf_cols), dtype=np.float32)
            self.ring.publish_layout(c, x_np, sf_np)
            yield

    # -- consumer ---------------------------------------------------------------------
    def _acquire_all(self, c):
        for src in range(self.L.num_ranks):
            yield from wait_for(self.ring, lambda s=src: self.ring.try_acquire(s, c),
                                f"route+layout of source rank {src} chunk {c}", self.stats.acquire_waits_s)

    def _each_source_group(self, c, handle):
        """Acquire the sources of chunk ``c`` and call ``handle(srcs)`` per group: once with every
        source, acquired in rank order (``rank``), or with each group of sources that is ready,
        as soon as it is (``ready``). Yields while it waits (cooperative)."""
        if self.source_order == "rank":
            yield from self._acquire_all(c)
            handle(list(range(self.L.num_ranks)))
            return
        pending = list(range(self.L.num_ranks))
        while pending:
            got = []

            def any_ready():
                got[:] = [s for s in pending if self.ring.try_acquire(s, c)]
                return bool(got)

            yield from wait_for(self.ring, any_ready, f"route+layout of any of source ranks {pending} chunk {c}",
                                self.stats.acquire_waits_s)
            for s in got:
                pending.remove(s)
            handle(list(got))

    def _pull(self, c, sources=None):
        """Read the chunk c routing of ``sources`` (default every source); pull the rows routed to my experts.

        Returns a list of rows ``(src, chunk, t, k, expert)`` in (src, t, k)
        order with their x/x_sf, and per-source counts of my rows.
        """
        lo, hi = self.buf.local_experts.start, self.buf.local_experts.stop
        slot = c % self.L.num_slots
        rows = []
        for src in (range(self.L.num_ranks) if sources is None else sources):
            view = self.ring.read_chunk(src, c, payload=False)
            if not view.valid:
                continue
            idx = self.ring.get_rows(src, "topk_idx", slot, 0, view.valid)
            self.ring.check_topk(src, idx)
            mine = (idx >= lo) & (idx < hi)
            toks = np.nonzero(mine.any(axis=1))[0]
            if not len(toks):
                continue
            # pull contiguous runs of needed token rows
            xs = np.empty((len(toks), self.L.hidden), dtype=np.uint8)
            sfs = np.empty((len(toks), self.L.sf_cols), dtype=np.float32)
            i = 0
            while i < len(toks):
                j = i
                while j + 1 < len(toks) and toks[j + 1] == toks[j] + 1:
                    j += 1
                xs[i:j + 1] = self.ring.get_rows(src, "x", slot, int(toks[i]), j - i + 1)
                sfs[i:j + 1] = self.ring.get_rows(src, "x_sf", slot, int(toks[i]), j - i + 1)
                i = j + 1
            pos = {int(t): n for n, t in enumerate(toks)}
            for t, k in zip(*np.nonzero(mine)):
                rows.append((src, c, int(t), int(k), int(idx[t, k]), xs[pos[int(t)]], sfs[pos[int(t)]]))
        return rows

    def _run_block(self, e, rows):
        """L1 -> SwiGLU -> L2 of expert ``e`` on ``rows``; put each result into its source's combine slot."""
        x_fp8 = torch.from_numpy(np.stack([r[5] for r in rows])).to(self.dev).view(FP8_DTYPE)
        x_sf = torch.from_numpy(np.stack([r[6] for r in rows])).to(self.dev)
        out = expert_pool_forward(x_fp8, x_sf, e - self.expert_offset, self.full_weights, self.block_m)
        out_np = out.cpu().numpy()
        for n, (src, c, t, k, _, _, _) in enumerate(rows):
            self.ring.put_combine_row(src, c % self.L.num_slots, t, k, out_np[n])
        self.stats.rows_computed += len(rows)
        self.stats.blocks_run += -(-len(rows) // self.block_m)

    def consumer(self):
        if self.scheduler == "chunk_local":
            yield from self._consumer_chunk_local()
        else:
            yield from self._consumer_reservation()

    def _consumer_chunk_local(self):
        hit = set()
        for c in range(self.plan.num_chunks):
            def handle(srcs, c=c):
                rows = self._pull(c, srcs)
                by_expert: dict[int, list] = {}
                for r in rows:
                    by_expert.setdefault(r[4], []).append(r)
                for e in sorted(by_expert):
                    self._run_block(e, by_expert[e])
                    hit.add(e)
                # Every result of these sources' chunk c is put: acknowledge (release after the puts).
                for src in srcs:
                    self.ring.ack(src, c)

            yield from self._each_source_group(c, handle)
            yield
        self.stats.experts_hit = len(hit)

    def _consumer_reservation(self):
        S = self.L.num_slots
        open_blocks: dict[int, list] = {}  # expert -> rows reserved in its open block
        outstanding: dict[tuple, int] = {}  # (src, chunk) -> my rows not yet put back
        acked: set = set()
        hit = set()

        def finish(rows):
            for (src, c, *_rest) in rows:
                outstanding[(src, c)] -= 1

        pending = []  # (src, chunk) pulled but not yet acknowledged, in chunk order

        def ack_ready(upto_chunk):
            for key in [k for k in pending if k[1] <= upto_chunk and outstanding[k] == 0]:
                self.ring.ack(*key)
                acked.add(key)
                pending.remove(key)

        def seal(pred):
            for e in sorted(open_blocks):
                rows = open_blocks[e]
                if rows and pred(rows):
                    self._run_block(e, rows)
                    finish(rows)
                    open_blocks[e] = []

        for n in range(self.plan.num_chunks):
            # Progress rule: chunk n reuses the slot of chunk n - S, so rows of
            # chunk <= n - S may not wait in an open block while we wait for n.
            if n - S >= 0:
                seal(lambda rows, lim=n - S: min(r[1] for r in rows) <= lim)
                ack_ready(n - S)
            def handle(srcs, n=n):
                rows = self._pull(n, srcs)
                for src in srcs:
                    outstanding[(src, n)] = 0
                    pending.append((src, n))
                for r in rows:
                    outstanding[(r[0], n)] += 1
                for r in rows:
                    blk = open_blocks.setdefault(r[4], [])
                    blk.append(r)
                    hit.add(r[4])
                    if len(blk) == self.block_m:  # completion rule (a): the block is full
                        self._run_block(r[4], blk)
                        finish(blk)
                        open_blocks[r[4]] = []
                ack_ready(n)

            yield from self._each_source_group(n, handle)
            yield
        # End of stream: seal every partial block (completion rule (b)).
        seal(lambda rows: True)
        ack_ready(self.plan.num_chunks - 1)
        missing = [k for k in outstanding if k not in acked]
        if missing:
            raise RuntimeError(f"reservation scheduler left chunks unacknowledged: {missing[:5]}")
        self.stats.experts_hit = len(hit)

    # -- combiner (owner) -----------------------------------------------------------
    def combiner(self):
        S = self.L.num_slots
        for c in range(self.plan.num_chunks):
            slot = c % S
            yield from wait_for(self.ring, lambda: c in self.my_routing and self.ring.acks_complete(slot, c),
                                f"every rank's contributions to my chunk {c} (slot {slot})")
            base, valid = self.plan.chunk_tokens(self.me, c)
            if valid:
                contrib = self.ring.read_combine(slot, valid)
                idx, w = self.my_routing[c]
                self.y[base:base + valid] = combine(torch.from_numpy(contrib).to(self.dev), w, idx)
            del self.my_routing[c]
            # Only now may the slot take chunk c + S (conservative rule).
            self.ring.try_collect_acks(slot, c)
            yield
