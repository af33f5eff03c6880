"""How an :class:`~streamring.moe.ep_buffer.EPBuffer` forward runs: the pieces it enqueues on the
producer, dispatch and GEMM streams, and why their order is correct.

Per chunk c (slot s = c % S) on every PE::

    producer stream                          dispatch stream (enqueued first)
    reuse_wait(c)  (every ack of c - S)      [stream_wait: doorbells of c]
    router + top-k -> slot s idx/weights     acquire_checked(c): both generations of every
    publish(ROUTE, c) (+ metadata words:       source (acquire, deadline), their metadata words
      chunk, base, valid count)                checked, each source's valid count learned
    FP8 quant -> slot s x / x_sf             [transport nv: RMA-get every source's slot s]
    publish(LAYOUT, c)                       ep_gather: every source's routes to my experts
                                             dispatch_ep: rows copied into my expert blocks
                                             ack(c)  <- early input_consumed: the slot is not
                                                        referenced after the copy
                                             event(c)
                                             GEMM stream: wait event(c); L1+SwiGLU, L2 of the
                                             blocks dispatch c made ready (the last dispatch's:
                                             in the seal's call below); L2 stores each row in
                                             its owner's combine rows[token][k] (P2P), then
                                             ep_signal_arrivals ADDs the row counts to the
                                             owners' arrived[chunk] (release)
    after the last chunk: seal -> one GEMM call over the last dispatch's blocks and the partial
    blocks -> signal (ready order: the seal is the last source's dispatch step's, see below); then
    (as owner)
    ep_wait_arrivals (arrived == expected, acquire) -> combine_owner (k-ordered sum) ->
    arrived := 0; after every stream joined: ring drain, advance_epoch.

Ordering argument (the RFC's release/acquire, each step in one place):

* producer -> consumer: the payload kernels complete before ``ring_publish`` (stream order), whose
  release precedes the generation SET; ``acquire_checked`` acquire-loads the generations and the
  data kernels follow it in stream order (``streamring.ring.device``). The valid count is a
  metadata word written before that release, so it is covered by the same handoff; a consumer
  checks it against ``[0, tokens_per_slot]`` before indexing (a hostile count cannot reach past
  the slot, and the combine rows are sized for ``num_chunks * tokens_per_slot`` tokens).
* early ``input_consumed``: the dispatch kernels are the last readers of the slot; ``ring_ack``
  follows them in stream order and releases before its fetch_or; the owner's ``reuse_wait``
  acquires the full mask before the next write of the slot (rules 3 and 4 of the protocol).
* consumer -> owner (results): see ``csrc/ep_kernels.cu``: the rows are stored before the
  release ADD of their count; the owner acquires the full count before reading; the count is
  reset before the owner's next forward publishes anything (the next forward forks from the end of
  this one), and a consumer writes an owner's rows of a forward only after acquiring that owner's
  chunks of the same forward, so neither rows nor counts are carried from one forward to the next
  - whichever layer or path (batch, streamed) the two forwards belong to, since they share the
  combine area.
* bitwise: every GEMM row depends only on its own data (fixed tiles, fixed K order) and the owner
  sums the k results of a token in the order k = 0..K-1, so the streamed output equals the batch
  output bitwise whatever the chunking, the progress policy or the arrival order.

Dispatch orders (``EPTuning.source_order``): ``rank`` takes chunk c of every source in one step;
``ready`` takes, in each of R steps of chunk c, every source of c that is ready together: the first
one pending to become ready, then those ready within ``EPTuning.ready_window_us`` of it
(``ring_wait_any``); a step after the one that took the last source takes none and waits for nothing.
The step that leaves no source of the last chunk pending seals (``BlockConsumer.seal(if_none_pending=)``,
decided on the device), so sources that arrive together are computed in one GEMM call with the
partial blocks, as the batch path does, and a late source delays only its own rows (its step's call
has them and the seal). A grouped step is trace-equivalent to one source per step, the model
checker's ready order (``streamring.verify.ep``; the argument is beside ``ring_wait_any``);
``arrival`` takes, per step j, the j-th source to publish its chunk 0 and then that source's later
chunks (a one-bit pending mask: the same acquire, check and deadline), so a late source delays only
its own rows. Progress of ``arrival``: every chunk of a forward has its own slot (``num_slots >=
chunks``, checked), so no producer waits for an acknowledgement and every published chunk stays
takeable until taken; with fewer slots, a consumer holding on to one source while another waits for
that consumer's acknowledgement of an earlier chunk could deadlock, so it is refused.

Progress policies (``streamring.moe.tuning.EP_POLICIES``) of the streamed path: the dispatch
stream is enqueued before the producer and must not block it: ``serialized`` (one stream, chunk by
chunk), ``spin_kernel`` (one-thread acquire kernels with a deadline; producer and dispatch streams at
high priority), ``stream_wait`` (``cuStreamWaitValue64`` on the ring's doorbells, no SM held),
``green_ctx`` (producer and consumer on disjoint SM partitions; P2P transport); ``REFUSED_POLICIES``
(``streamring.ring.policies``) says why the others tried are refused. The batch path always runs ``serialized``.

Transports (chosen once per buffer): ``p2p`` (NVLink loads/stores through peer pointers: the
dispatch pulls rows from the peers' slots, L2 stores into the peers' combine rows) or ``nv``
(NVSHMEM device RMA, for peers without a pointer, e.g. on another node: every source's slot is
fetched with gets into a local mirror, L2 writes locally and ``ep_put_rows`` puts the rows).
``EPTuning(transport='nv')`` forces that path between GPUs of one host, so it is tested there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..device import kernels as DK
from ..device import ep_triton as EK
from ..device import moe_triton as K
from ..device.ranges import annotate as nvtx_range
from ..device.ringdesc import RING_LAYOUT, RING_ROUTE
from ..gemm.backends import CAPABILITIES
from ..ring.device import DeviceRing
from ..ring.layout import RingLayout
from .blocks import select_experts_into
from .grid_bounds import grouped_step_bound, grouped_step_expect, seal_bound, step_bound, step_expect
from .timeline_events import STAMP_STRIDE

if TYPE_CHECKING:  # annotations only: the buffer module imports this one
    from .ep_buffer import LayerWeights


@dataclass
class _Path:
    """One ring and how a forward runs on it (the batch path or the streamed path)."""

    name: str
    ring: DeviceRing
    chunk: int  # tokens per chunk (per slot)
    num_chunks: int  # chunks of every forward on this path (the same on every PE)
    num_slots: int
    policy: str
    source_order: str
    steps: int  # dispatch steps per chunk: 1 (every source at once) or R (ready and arrival orders)
    order: list  # the dispatch steps (chunk c, step j of c) in the order they are enqueued
    step_index: dict  # (c, j) -> its position in ``order`` (the block consumer's ready index)
    slots: list  # typed views of my slots (DeviceRing.slot_views)
    chunk_base: torch.Tensor  # int64 [num_chunks]: c * chunk
    chunk_valid: torch.Tensor  # int64 [num_chunks]: this forward's valid tokens of my chunk c
    valid_tab: torch.Tensor  # int32 [num_chunks, R]: valid tokens of every source's chunk (learned)
    deltas: tuple  # where the data kernels read each source's slot (bytes, f32, i64 elements)
    mirror: Optional[torch.Tensor] = None  # nv transport: local copies of every source's ring


class EPPipeline:
    """The per-forward pieces of :class:`~streamring.moe.ep_buffer.EPBuffer` (its base class): the rings and
    streams it builds, and what one forward enqueues on them. The buffer holds the state they use."""

    # -- construction pieces --------------------------------------------------------------------------
    def _make_path(self, name, chunk, num_slots, policy, source_order, transport, wake, ring_name) -> _Path:
        R, dev = self.R, self.dev
        sh = self.shape
        num_chunks = -(-self.max_tokens // chunk)
        S = min(num_slots, num_chunks)
        layout = RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=chunk, hidden=sh.hidden, topk=sh.topk,
                            num_experts=sh.num_experts)
        ring = DeviceRing(self.heap, layout, num_chunks, transport=transport, wake=wake, deadline_s=self.deadline_s,
                          name=ring_name)
        mirror = None
        if ring.transport == "nv":  # NVSHMEM gets into a local mirror laid out like the ring, one copy per source
            mirror = torch.zeros(R, layout.nbytes, dtype=torch.uint8, device=dev)
        steps = 1 if source_order == "rank" else R
        # arrival: step j takes the j-th source to publish its first chunk, then that source's later chunks
        if source_order == "arrival":
            order = [(c, j) for j in range(steps) for c in range(num_chunks)]
        else:
            order = [(c, j) for c in range(num_chunks) for j in range(steps)]
        return _Path(name=name, ring=ring, chunk=chunk, num_chunks=num_chunks, num_slots=S, policy=policy,
                     source_order=source_order, steps=steps, order=order,
                     step_index={cj: i for i, cj in enumerate(order)},
                     slots=[ring.slot_views(s) for s in range(S)],
                     chunk_base=torch.arange(num_chunks, dtype=torch.int64, device=dev) * chunk,
                     chunk_valid=torch.zeros(num_chunks, dtype=torch.int64, device=dev),
                     valid_tab=torch.zeros(num_chunks, R, dtype=torch.int32, device=dev),
                     deltas=ring.read_distances(mirror), mirror=mirror)

    def _make_streams(self, policy, producer_sms):
        self.green = None
        self.events = []
        self.ustream = None
        if policy == "green_ctx":
            from ..device.green import make_green_pair

            self.green = make_green_pair(self.heap.device_index, producer_sms)
            self.pstream = self.green[0].stream
            self.dstream = self.gstream = self.green[1].stream
        elif policy == "serialized":
            self.pstream = self.dstream = self.gstream = None
        else:
            # Producer and dispatch at high priority: their CTAs are scheduled before the next
            # pending CTA of a big GEMM grid, so chunk c+1 is produced and dispatched while chunk c's
            # blocks compute.
            hi = -10 if self.priority_streams else 0
            self.pstream = torch.cuda.Stream(device=self.dev, priority=hi)
            self.dstream = torch.cuda.Stream(device=self.dev, priority=hi)
            self.gstream = torch.cuda.Stream(device=self.dev, priority=0)
            # (GEMMs with a local y) the puts of the result rows: off the GEMM stream, so the next blocks'
            # GEMMs do not wait for them, and at the dispatch's priority, so their CTAs get the SMs that the
            # next call's CTAs free (memory-bound puts beside compute-bound GEMMs)
            self.ustream = torch.cuda.Stream(device=self.dev, priority=hi)
            st = self.paths["stream"]
            n_steps = st.num_chunks * st.steps
            self.events = [torch.cuda.Event() for _ in range(n_steps)]
            self.computed = [torch.cuda.Event() for _ in range(n_steps + 1)]

    # -- pieces of a forward --------------------------------------------------------------------------
    def groups_sources(self, path: _Path, rows: int) -> bool:
        """Whether a forward of ``rows`` rows per PE (``x.shape[0]``; a captured graph's: its capture size) on
        ``path`` groups the sources that are ready together (:meth:`EPTuning.groups_sources`; the batch path
        never does)."""
        return path.name == "stream" and self.tuning.groups_sources(self.R, rows)

    def _current_stream(self):
        # None off the GPU: the library's kernels then run where the heap runs them (the CPU
        # emulation of the tests), in call order
        return torch.cuda.current_stream(self.dev) if self._on_gpu else None

    def _sync(self):
        if self._on_gpu:
            torch.cuda.synchronize(self.dev)

    def _stamp(self, row, col):
        if self.stamps is not None and self._recording:
            K.stamp(self.stamps, row * STAMP_STRIDE + col)

    def _side(self, which):
        """Context manager making side ``which`` ('p' producer, 'd' dispatch, 'g' GEMMs) current."""
        stream = {"p": self.pstream, "d": self.dstream, "g": self.gstream}[which]
        if stream is None:
            return contextlib.nullcontext()
        if self.green is None:
            return torch.cuda.stream(stream)
        side = self.green[0 if which == "p" else 1]

        @contextlib.contextmanager
        def both():
            with side.current(), torch.cuda.stream(side.stream):
                yield
        return both()

    def _set_counts(self, path: _Path, num_tokens, T: int) -> None:
        """This forward's valid tokens (device): ``num_tokens_t`` and every chunk's count."""
        nt = self.num_tokens_t
        if num_tokens is None:
            nt.fill_(T)
        elif isinstance(num_tokens, int):
            nt.fill_(num_tokens)
        else:
            if not isinstance(num_tokens, torch.Tensor) or num_tokens.numel() != 1 or num_tokens.is_floating_point() \
                    or num_tokens.device != self.dev:
                raise ValueError(f"num_tokens must be None, an int or a one-element integer tensor on {self.dev}, "
                                 f"got {num_tokens!r}")
            nt.copy_(num_tokens.reshape(1))
            # a device count outside [0, T] cannot be refused without a host sync: count it, clamp it
            self.bad_counts.add_(((nt < 0) | (nt > T)).to(torch.int32))
            nt.clamp_(0, T)
        torch.sub(nt, path.chunk_base, out=path.chunk_valid)
        path.chunk_valid.clamp_(0, path.chunk)

    def _produce(self, path: _Path, layer: LayerWeights, x, c, routing=None):
        with nvtx_range(f"streamring produce chunk {c}", color="blue"):
            r, st = path.ring, self._current_stream()
            s = c % path.num_slots
            slot = path.slots[s]
            a = c * path.chunk
            n = self._chunk_rows(path, c, x.shape[0])
            self._stamp(c, 5)
            if c == 0:
                DK.ep_delay(self.heap.lib, r.stream_ref(st), ns=int(self.straggler_t.data_ptr()))
            if c >= path.num_slots:
                r.reuse_wait(st, c, inject=self._inject_bits)
            self._stamp(c, 6)
            valid = path.chunk_valid[c:c + 1]
            early = self.inject == "signal-before-payload"  # mutation: the generations before the payload
            if early:
                r.publish(st, c, RING_ROUTE, valid=valid)
                r.publish(st, c, RING_LAYOUT, valid=valid)
                DK.ep_delay(self.heap.lib, r.stream_ref(st), ns=int(self.straggler_t.data_ptr()))
            if n:
                if routing is None:
                    lg = self.logits[:n]
                    K.router_logits(x[a:a + n], layer.fw.router, lg)
                    select_experts_into(lg, layer.fw.bias, layer.routing, slot["topk_idx"][:n],
                                        slot["topk_weights"][:n])
                    idx, w, copy = slot["topk_idx"][:n], slot["topk_weights"][:n], {}
                else:
                    idx, w = routing[0][a:a + n], routing[1][a:a + n]
                    copy = {"slot_idx": slot["topk_idx"][:n], "slot_w": slot["topk_weights"][:n]}
            self._stamp(c, 7)
            if n:
                # my own view for the reduce (rows at and past this forward's count route nowhere) and the
                # owner's expected row count of the chunk (self.expected is zeroed at the forward's start)
                EK.own_routes(idx, w, self.my_idx[a:a + n], self.my_w[a:a + n], self.num_tokens_t,
                              self.expected[c:c + 1], row0=a, **copy)
            self._stamp(c, 8)
            if not early:
                r.publish(st, c, RING_ROUTE, valid=valid)
            self._stamp(c, 0)
            if n:
                self._layout(x[a:a + n], slot, n)
            self._stamp(c, 9)
            if not early:
                r.publish(st, c, RING_LAYOUT, valid=valid)
            self._stamp(c, 1)

    @staticmethod
    def _layout(x_rows, slot: dict, n: int) -> None:
        """The layout producer of one chunk: FP8 rows with 1x128 scales into my slot."""
        K.quant_rows(x_rows, slot["x"][:n], slot["x_sf"][:n])

    def _dispatch(self, path: _Path, c, j=0):
        """Dispatch step j of chunk c: every source (rank order), the j-th source of chunk c to be ready
        (ready order), or chunk c of the j-th source to publish its first chunk (arrival order)."""
        with nvtx_range(f"streamring acquire+dispatch+ack chunk {c} step {j}", color="orange"):
            r, st = path.ring, self._current_stream()
            s = c % path.num_slots
            L = r.layout
            ready = path.source_order != "rank"
            if path.policy == "stream_wait" and j == 0:
                r.wait_doorbells(st, c)
            if self._grouped:
                # every source of chunk c ready together: the first one pending (acquire, deadline), then
                # those ready within the window; the rest of the R places are -1 (the data kernels skip
                # them). A step after the one that took the last source takes none and waits for nothing.
                srcs = self.taken[j]
                r.wait_any(st, c, path.valid_tab, self.pending, j == 0, srcs, inject=self._inject_bits,
                           max_take=self.R, window_ns=self.ready_window_ns)
            elif ready:
                srcs = self.chosen[j:j + 1]
                if path.source_order == "arrival" and c > 0:
                    # the source is the one step j took at chunk 0: wait for exactly that one (a one-bit
                    # pending mask), with the same acquire, metadata check and deadline as any ready wait
                    torch.bitwise_left_shift(self.one_bit, srcs.to(torch.int64), out=self.pending_one)
                    r.wait_any(st, c, path.valid_tab, self.pending_one, False, self.chosen_again,
                               inject=self._inject_bits)
                else:
                    r.wait_any(st, c, path.valid_tab, self.pending, j == 0, srcs, inject=self._inject_bits)
            else:
                srcs = self.src_all
                r.acquire_checked(st, c, path.valid_tab, inject=self._inject_bits)
            if path.mirror is not None:
                DK.ep_pull_slots(self.heap.lib, r.stream_ref(st), d=r.desc, buf=r.buf,
                                 mirror=int(path.mirror.data_ptr()), mirror_stride=path.mirror.stride(0),
                                 src_list=int(srcs.data_ptr()), chunk=c, sources=srcs.shape[0])
            if j == 0:
                self._stamp(c, 2)
            n = srcs.shape[0] * path.chunk * self.shape.topk
            flat_e, flat_w = self.flat_e[:n], self.flat_w[:n]
            d_u8, d_f32, d_i64 = path.deltas
            ring_u8 = r.region.local
            EK.ep_gather(ring_u8.view(torch.int64), ring_u8.view(torch.float32), d_i64, d_f32, srcs, path.valid_tab, c,
                        self.me * self.E_loc, L.topk_idx_off(s) // 8, L.topk_weights_off(s) // 4, flat_e, flat_w,
                        self.bad_routes, num_ranks=self.R, tokens_per_slot=path.chunk, topk=self.shape.topk,
                        local_experts=self.E_loc, num_experts=self.shape.num_experts, pull_bytes=self.pull_bytes,
                        me=self.me, hidden=self.shape.hidden)

            def release():
                # early input_consumed: nothing reads this slot of these sources after the copy
                if ready:
                    r.ack_chosen(st, c, srcs)
                else:
                    r.ack(st, c)
            self.bc.dispatch_ep(c, flat_e, flat_w, srcs, (ring_u8, ring_u8.view(torch.float32)), (d_u8, d_f32),
                                (L.x_off(s), L.x_sf_off(s) // 4), step=path.step_index[c, j], pull="token",
                                on_slot_released=release)
            if self._grouped and c == path.num_chunks - 1:
                # the step that leaves no source of the last chunk pending seals (decided on the device), so
                # its GEMM call has the partial blocks too: sources that arrive together get one call
                self.bc.seal(path.step_index[c, j], if_none_pending=self.pending)
            if self.queue is not None:
                self.queue.publish(path.step_index[c, j])  # the persistent consumer picks the new blocks up
            if j == path.steps - 1:
                self._stamp(c, 3)

    def _gemms(self, path: _Path, layer: LayerWeights, lo, hi, max_items, expect, max_ctas=None, side_puts=False):
        bc, r = self.bc, path.ring
        st = self._current_stream()
        # host-side record of this forward's GEMM calls (ready range, bound, expectation): what
        # debug.blocks_past_expectation compares with the blocks the calls found ready
        self.gemm_calls.append((lo, hi, max_items, expect))
        if self.direct_l2:
            bc.compute(lo, hi, max_items, layer.fw, impl=self.gemm, max_ctas=max_ctas, expect_items=expect,
                       out=self.comb_rows, direct=(bc.row_src, bc.row_tok, self.comb_delta))
            DK.ep_signal_arrivals(self.heap.lib, r.stream_ref(st), d=r.desc, comb=self.comb_base,
                                  comb_peers=self.comb_peers, me=self.me, off_arrived=self.comb_layout.off_arrived,
                                  ready_list=int(bc.ready_list.data_ptr()), ready_hi=int(bc.ready_hi.data_ptr()),
                                  lo_index=lo, hi_index=hi, row_src=int(bc.row_src.data_ptr()),
                                  row_chunk=int(bc.row_chunk.data_ptr()), block_m=bc.block_m, max_items=max_items)
        else:
            bc.compute(lo, hi, max_items, layer.fw, impl=self.gemm, max_ctas=max_ctas, expect_items=expect)
            if side_puts:  # the puts read only this range's rows of y: the next GEMMs need not wait for them
                self.computed[lo].record()
                self.ustream.wait_event(self.computed[lo])
                st = self.ustream
            with torch.cuda.stream(st) if side_puts else contextlib.nullcontext():
                self._put_rows(r, st, lo, hi, max_items)

    def _put_rows(self, r, st, lo, hi, max_items):
        """The ready range's result rows (local ``y``) into their owners' combine rows, then the counts."""
        bc = self.bc
        DK.ep_put_rows(self.heap.lib, r.stream_ref(st), d=r.desc, comb=self.comb_base, me=self.me,
                       off_arrived=self.comb_layout.off_arrived, off_rows=self.comb_layout.off_rows,
                       y_stage=int(bc.y.data_ptr()), hidden=self.shape.hidden,
                       ready_list=int(bc.ready_list.data_ptr()), ready_hi=int(bc.ready_hi.data_ptr()),
                       lo_index=lo, hi_index=hi, row_src=int(bc.row_src.data_ptr()),
                       row_tok=int(bc.row_tok.data_ptr()), row_chunk=int(bc.row_chunk.data_ptr()),
                       block_m=bc.block_m, max_items=max_items)

    def _grid_ctas(self, path: _Path, sealing: bool) -> Optional[int]:
        """The ``max_ctas`` of a streamed GEMM call (None: the backend's own grid). ``tuning.chunk_gemm_ctas`` caps
        the calls while a later source may still be produced; a backend whose grid is persistent
        (``Capabilities.waves``: one CTA per SM would hold every SM until the call ends) runs every streamed
        call on ``tuning.streamed_grid_waves`` CTAs per SM, so its CTAs retire during the call and the next
        source's dispatch, a late PE's producer and the result puts (all on higher-priority streams) get SMs
        between them. The batch path keeps the backend's own grid."""
        if path.name != "stream":
            return None
        if self.chunk_gemm_ctas is not None and not sealing:
            return self.chunk_gemm_ctas
        waves = self.tuning.streamed_grid_waves
        if CAPABILITIES[self.gemm].waves and waves > 1:
            return waves * self.sm_count
        return None

    def _max_ready_per_step(self, path: _Path, j: int = 0) -> int:
        """Most blocks one dispatch step can make ready (the GEMM grid bound; grouped: :func:`grouped_step_bound`)."""
        args = (path.chunk, self.shape.topk, self.bc.block_m, self.E_loc, self.bc.max_blocks)
        if self._grouped:
            return grouped_step_bound(self.R, j, *args)
        return step_bound(self.R, path.steps, *args)

    @staticmethod
    def _chunk_rows(path: _Path, c: int, rows: int) -> int:
        """Rows of a forward of ``rows`` rows per PE in its chunk ``c`` (static: the host's count)."""
        return max(0, min(rows, (c + 1) * path.chunk) - c * path.chunk)

    def _expected_per_step(self, path: _Path, c: int, j: int = 0) -> int:
        """The blocks dispatch step ``j`` of chunk ``c`` is expected to make ready (the GEMM grid's hint:
        :func:`grouped_step_expect`, :func:`step_expect`), every source's chunk ``c`` holding as many rows as
        mine in this forward."""
        args = (self._chunk_rows(path, c, self._last_T), self.shape.topk, self.bc.block_m, self.E_loc)
        if self._grouped:
            return grouped_step_expect(self.R, j, *args)
        return step_expect(self.R, path.steps, *args)

    def _chunk_gemms(self, path: _Path, layer, c, j=0, side_puts=False):
        i = path.step_index[c, j]
        last = i == len(path.order) - 1
        if last and not self._grouped:
            # the last dispatch step's full blocks go into the seal's call beside the partial blocks: one L1
            # and one L2 pass fewer over the weights of the experts both touch (its time is stamped there)
            return
        with nvtx_range(f"streamring block GEMMs chunk {c} step {j}", color="green"):
            # the persistent (SM-sparing) grid only while a later step's source may still be being produced
            # (every step but the last, which joins the seal's call; grouped: every step of the last chunk, any
            # of which may seal); the sealed blocks take the whole GPU
            sealing = last or (self._grouped and c == path.num_chunks - 1)
            self._gemms(path, layer, i, i + 1, self._max_ready_per_step(path, j), self._expected_per_step(path, c, j),
                        self._grid_ctas(path, sealing), side_puts)
            if j == path.steps - 1:
                self._stamp(c, 4)

    def _seal(self, path: _Path, layer, side_puts=False):
        if self._grouped:  # sealed on the device by the step that took the last source, in that step's call
            self._stamp(path.num_chunks, 2)
            return
        with nvtx_range("streamring seal + GEMMs", color="red"):
            n = len(path.order)  # dispatch steps so far: the seal is the next ready index
            self.bc.seal(n)
            # with the last step's blocks: ready_list[ready_hi[n-1] : ready_hi[n+1]]
            bound = seal_bound(self._max_ready_per_step(path), self.E_loc, self.bc.max_blocks)
            c, j = path.order[-1]
            expect = seal_bound(self._expected_per_step(path, c, j), self.E_loc, self.bc.max_blocks)
            self._gemms(path, layer, n - 1, n + 1, bound, expect, self._grid_ctas(path, True), side_puts)
            self._stamp(path.order[-1][0], 4)
            self._stamp(path.num_chunks, 2)

    def _combine(self, path: _Path, out, c0: int, c1: int):
        """The owner's reduce of chunks [c0, c1): wait for their rows (acquire), sum each token's k rows."""
        with nvtx_range(f"streamring wait arrivals + combine chunks {c0}..{c1 - 1}", color="red"):
            r, st = path.ring, self._current_stream()
            DK.ep_wait_arrivals(self.heap.lib, r.stream_ref(st), d=r.desc, comb=self.comb_base,
                                off_arrived=self.comb_layout.off_arrived, expected=int(self.expected.data_ptr()),
                                first_chunk=c0, num_chunks=c1 - c0)
            T, Kk = out.shape[0], self.shape.topk
            a, b = min(T, c0 * path.chunk), min(T, c1 * path.chunk)
            if b > a:
                EK.combine_owner(self.comb_rows[a * Kk: b * Kk], self.my_idx[a:b], out[a:b], topk=Kk)
            if c1 == path.num_chunks:
                # reset before my next forward publishes anything: no count carried from one forward to the next
                self.arrived[:path.num_chunks].zero_()
                self._stamp(path.num_chunks, 3)

    def _begin(self, path: _Path, rows: int, stamps: bool) -> None:
        """The host-side state of a forward of ``rows`` rows per PE on ``path`` (its grids' expectations, whether
        it groups ready sources, its GEMM-call record and stamps), set by whichever half is enqueued first."""
        self._recording = stamps
        self._stamp_path = path
        self._grouped = self.groups_sources(path, rows)
        self._last_T = rows
        self.gemm_calls = []

    def _enqueue(self, path: _Path, layer: LayerWeights, x, out, num_tokens, routing, order, stamps, launched=False):
        """One forward. ``launched``: its consumer side was enqueued ahead by :meth:`_enqueue_launch` (same
        path, layer and rows), so only the producer side, the combine and the join are enqueued here."""
        if not launched:
            self._begin(path, x.shape[0], stamps)
        try:
            with nvtx_range(f"streamring EPBuffer.forward {path.name} ({path.num_chunks} chunks, {path.policy})",
                            color="purple"):
                self._enqueue_inner(path, layer, x, out, num_tokens, routing, order, launched)
        finally:
            self._recording = True

    def _consumer_resets(self) -> None:
        """Before the dispatch on the current stream: the dispatch (and the persistent consumer) start from empty
        blocks and queue, the pulled-bytes count from 0."""
        self.pull_bytes.zero_()
        self.bc.begin()
        if self.queue is not None:
            self.queue.reset()

    def _enqueue_launch(self, path: _Path, layer, rows: int, stamps: bool) -> None:
        """The consumer side of the next streamed forward, ahead of its input (``EPBuffer.launch_consumer``):
        the dispatch, GEMM and puts streams start behind what the current stream holds now (the previous
        forward, whose blocks, rows and combine area they reuse) and wait on nothing the caller enqueues after
        this call; past that, only on the ring's generations (acquire, with the deadline) and their own
        stream order."""
        self._begin(path, rows, stamps)
        origin = self._current_stream()
        for st in self._consumer_sides():
            st.wait_stream(origin)
        with self._side("d"):
            self._stamp(path.num_chunks, 0)
            self._consumer_resets()
        self._enqueue_consumer(path, layer)

    def _consumer_sides(self) -> list:
        return [s_ for s_ in dict.fromkeys((self.dstream, self.gstream, self.ustream)) if s_ is not None]

    def _launch_consumer(self, path: _Path, layer, ctas: int):
        """The persistent consumer of this forward: ONE launch on the current stream (see ``work_queue``)."""
        self.queue.launch(layer.fw, ctas=max(1, ctas), comb_rows=self.comb_rows, comb_delta=self.comb_delta,
                          arrived=self.arrived, arrived_delta=self.comb_arrived_delta, status=path.ring.status_t,
                          deadline_ns=int(self.deadline_s * 1e9))

    def _seal_queue(self, path: _Path):
        n = len(path.order)  # dispatch steps so far: the seal is the next ready index
        self.bc.seal(n)
        self.queue.seal(n)
        self._stamp(path.num_chunks, 2)

    def _enqueue_inner(self, path, layer, x, out, num_tokens, routing, order, launched):
        r = path.ring
        origin = self._current_stream()
        C = path.num_chunks
        self._set_counts(path, num_tokens, x.shape[0])
        self.my_idx[: C * path.chunk].fill_(-1)
        self.expected[:C].zero_()
        if launched:
            self._enqueue_producer(path, layer, x, out, routing, origin)
        else:
            self._stamp(C, 0)
            # before every side: the dispatch and the persistent consumer both start from empty blocks and queue
            self._consumer_resets()
            if path.policy == "serialized" or order == "serialized" or self.pstream is None:
                self._enqueue_serialized(path, layer, x, out, routing)
            else:
                self._enqueue_streams(path, layer, x, out, routing, origin)
        r.drain(origin)
        r.advance_epoch(origin)

    def _enqueue_serialized(self, path, layer, x, out, routing):
        """One stream. Rank and ready orders: chunk by chunk (produce c, then its dispatch steps and GEMMs).
        Arrival order takes all of a source's chunks before the next source's, so every chunk is produced
        first (each in its own slot: no reuse wait) and then dispatched in that order."""
        C, persistent = path.num_chunks, self.queue is not None
        produced = 0
        for c, j in path.order:
            upto = C if path.source_order == "arrival" else c + 1  # the chunks this step needs published
            for k in range(produced, upto):
                self._produce(path, layer, x, k, routing)
            produced = max(produced, upto)
            self._dispatch(path, c, j)
            if not persistent:
                self._chunk_gemms(path, layer, c, j)
        self._stamp(C, 1)
        if persistent:
            # every block is published before the launch: one stream can never wait on itself
            self._seal_queue(path)
            self._launch_consumer(path, layer, self.sm_count)
        else:
            self._seal(path, layer)
        self._combine(path, out, 0, C)

    def _enqueue_streams(self, path, layer, x, out, routing, origin):
        """Producer, dispatch and GEMM streams (spin_kernel, stream_wait, green_ctx), every side forked from the
        caller's stream: the consumer side is enqueued first, so the progress policy must keep its waits from
        blocking the producer."""
        for st in self._consumer_sides():
            st.wait_stream(origin)
        self._enqueue_consumer(path, layer)
        self._enqueue_producer(path, layer, x, out, routing, origin)

    def _enqueue_consumer(self, path, layer):
        """The consumer side on the dispatch, GEMM and puts streams: every dispatch step (acquire, dispatch,
        ack), the GEMM calls of its blocks and the seal (the persistent consumer: its one launch and the queue's
        seal)."""
        persistent = self.queue is not None
        side_puts = self.ustream is not None and not self.direct_l2
        if persistent:
            # launched before any block is ready: its CTAs claim blocks as the dispatch publishes them, and
            # leave reserved_sms SMs to the producer and the dispatch, which must progress while they wait
            with self._side("g"):
                self._launch_consumer(path, layer, self.sm_count - self.reserved_sms)
        with self._side("d"):
            for i, (c, j) in enumerate(path.order):
                self._dispatch(path, c, j)
                if persistent:
                    continue
                if self.events:
                    self.events[i].record()
                else:
                    self._chunk_gemms(path, layer, c, j)  # green_ctx: dispatch and GEMMs share a stream
            if persistent:
                self._seal_queue(path)
        if self.events and not persistent:
            with self._side("g"):
                for i, (c, j) in enumerate(path.order):
                    self.gstream.wait_event(self.events[i])
                    self._chunk_gemms(path, layer, c, j, side_puts)
                self._seal(path, layer, side_puts)
        elif not persistent:
            with self._side("g"):
                self._seal(path, layer, side_puts)

    def _enqueue_producer(self, path, layer, x, out, routing, origin):
        """The producer side (behind the caller's stream), the owner's reduce after it and the GEMMs, and every
        side joined back into the caller's stream."""
        self.pstream.wait_stream(origin)
        with self._side("p"):
            for c in range(path.num_chunks):
                self._produce(path, layer, x, c, routing)
            self._stamp(path.num_chunks, 1)
        # one reduce after the producer and the GEMMs (green_ctx: on the consumer's partition)
        self.gstream.wait_stream(self.pstream)
        with self._side("g"):
            self._combine(path, out, 0, path.num_chunks)
        for st in dict.fromkeys((self.pstream, *self._consumer_sides())):
            origin.wait_stream(st)
