"""What one :class:`~streamring.moe.ep_buffer.EPBuffer` forward enqueues, and why the order is correct.

The buffer is a composition of parts, each with its own module and the ordering argument of what it does:
the rings (``ep_rings``), the producer (``ep_producer``: router, top-k, FP8 layout, publications), the dispatch
(``ep_dispatch``: acquire, copy into the expert blocks, acknowledge), the experts (``ep_experts``: the GEMM backend
over ready ranges, the delivery of the result rows), the owners' combine area (``ep_combine``: arrival counts, the
owner's reduce) and the progress policy's streams (``ring.progress``). This module orders them. Per chunk c
(slot s = c % S) on every PE::

    producer stream                          dispatch stream (enqueued first)
    reuse_wait(c)  (every ack of c - S)      [stream_wait: doorbells of c]
    router + top-k -> slot s idx/weights     acquire_checked(c) / wait_any: both generations of the step's
    publish(ROUTE, c) (+ metadata words:       sources (acquire, deadline), their metadata words checked,
      chunk, base, valid count)                each source's valid count learned
    FP8 quant -> slot s x / x_sf             [transport nv: RMA-get every source's slot s]
    publish(LAYOUT, c)                       gather + copy the routed rows into my expert blocks
                                             ack(c)  <- early input_consumed: the slot is not read after the copy
                                             event(step)
                                             GEMM stream: wait event(step); L1+SwiGLU, L2 of the blocks the step
                                             made ready (the last step's: in the seal's call); rows delivered to
                                             their owners, then the owners' arrived[chunk] ADDed (release)
    [a persistent-grid backend (CUTLASS, DeepGEMM), unless EPTuning(dispatch_beside_grid=True): each dispatch
     step also waits for the previous step's GEMM call where that call's grid holds every SM]
    after the last chunk: seal -> one GEMM call over the last step's blocks and the partial blocks; then (as
    owner) wait arrived == expected (acquire) -> k-ordered sum -> arrived := 0; after every stream joined: ring
    drain, advance_epoch.

Ordering argument (the RFC's release/acquire, each step where its code is): producer -> consumer in
``ep_producer``; the early ``input_consumed`` in ``ep_dispatch``; consumer -> owner in ``ep_combine`` and
``ep_experts``. Across forwards: the owner resets its counts before its next forward publishes anything (the next
forward starts behind the end of this one on the caller's stream), and a consumer writes an owner's rows of a
forward only after acquiring that owner's chunk of the same forward, so neither rows nor counts are carried from
one forward to the next, whichever layer or path (batch, streamed) the two forwards belong to (they share the
combine area and the expert blocks). Bitwise: every GEMM row depends only on its own data and the owner sums the
k rows of a token in the order k = 0..K-1, so the streamed output equals the batch output bitwise whatever the
chunking, the progress policy or the arrival order.

A consumer launched ahead (:meth:`Pipeline.launch`, the RFC's question 4): its streams start behind what the
caller's stream holds at the launch (the previous forward, whose blocks and combine area they reuse) and wait on
nothing enqueued later, past that only on the ring's generations (acquire, deadline) and their own order; the
producer side, the owner's reduce and the join follow with the forward that takes it. The epoch the consumer's
waits read is the previous forward's advance (before the launch in stream order), the one its producer publishes
with.

Progress policies (``ring.policies.PROGRESS``, their streams: ``ring.progress``): the dispatch stream is enqueued
before the producer and must not block it. The batch path always runs ``serialized``.
Transports (chosen once per buffer): ``p2p`` (NVLink loads/stores through peer pointers) or ``nv`` (NVSHMEM device
RMA into a local mirror, for peers without a pointer, e.g. on another node; ``EPTuning(transport='nv')`` forces it
between GPUs of one host, so it is tested there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device.ranges import annotate as nvtx_range
from ..gemm.backends import CAPABILITIES
from .instrument import NO_INSTRUMENT


@dataclass(frozen=True)
class ForwardPlan:
    """What the host decided for one forward: its path, its rows per PE (``x.shape[0]``; a captured graph's: its
    capture size: the grids' expectations) and whether it groups the sources that are ready together."""

    path: object
    rows: int
    grouped: bool


class Pipeline:
    """The order of one forward's parts on the progress policy's streams (module doc). Holds no data of its own
    but the forward's plan and the events that order the dispatch steps before their GEMMs."""

    def __init__(self, *, heap, paths: dict, progress, producer, dispatch, experts, combine, tuning, deadline_s: float):
        self.heap, self.paths, self.progress, self.tuning = heap, paths, progress, tuning
        self.producer, self.dispatch, self.experts, self.combine = producer, dispatch, experts, combine
        self.deadline_s = deadline_s
        self.on_gpu = torch.device(heap.device).type == "cuda"
        self.instrument = NO_INSTRUMENT
        #: the last enqueued forward's plan
        self.plan: ForwardPlan | None = None
        self.max_chunks = max(p.num_chunks for p in paths.values())
        st = paths["stream"]
        self._dispatched = [torch.cuda.Event() for _ in range(st.num_chunks * st.steps)] \
            if progress.concurrent and progress.stream("g") is not progress.stream("d") else []
        # per ready index: an event after its GEMM call, which the next dispatch step waits for where that call's
        # grid holds every SM (dispatch_beside_grid)
        self._called = [torch.cuda.Event() for _ in self._dispatched] \
            if self.dispatch_waits_for_full_grids(tuning, experts.gemm) else []

    @staticmethod
    def dispatch_waits_for_full_grids(tuning, gemm: str) -> bool:
        """Whether the streamed dispatch steps are enqueued behind the previous step's GEMM call where its grid
        holds every SM (:meth:`_enqueue_consumer`): ``EPTuning.dispatch_beside_grid`` False (the
        default) and a backend with a persistent grid. Triton's CTA-per-tile grids never hold every SM: its
        dispatch steps never wait on a GEMM call."""
        return not tuning.dispatch_beside_grid and CAPABILITIES[gemm].persistent_grid

    def groups_sources(self, path, rows: int) -> bool:
        """Whether a forward of ``rows`` rows per PE on ``path`` groups the sources that are ready together
        (:meth:`EPTuning.groups_sources`; the batch path never does)."""
        return path.name == "stream" and self.tuning.groups_sources(
            self.heap.num_ranks, rows, persistent_grid=CAPABILITIES[self.experts.gemm].persistent_grid)

    def current_stream(self):
        # None off the GPU: the library's kernels then run where the heap runs them (the CPU emulation of the
        # tests), in call order
        return torch.cuda.current_stream(self.heap.device) if self.on_gpu else None

    def _begin(self, path, rows: int, stamps: bool) -> None:
        self.plan = ForwardPlan(path, rows, self.groups_sources(path, rows))
        self.instrument.begin(path, stamps)
        self.experts.gemm_calls = []

    def _consumer_resets(self) -> None:
        """Before the dispatch, on the current stream: empty blocks and queue, pulled bytes from 0."""
        self.dispatch.pull_bytes.zero_()
        self.experts.bc.begin()
        if self.experts.queue is not None:
            self.experts.queue.reset()

    # -- the forward ----------------------------------------------------------------------------------
    def enqueue(self, path, layer, x, out, num_tokens, routing, *, serialized: bool, stamps: bool,
                launched: bool = False) -> None:
        """One forward on the current stream. ``serialized``: every part on it, in order (a path's first, eager
        forward, which loads every kernel). ``launched``: its consumer side was enqueued by :meth:`launch` (same
        path, layer and rows): the producer side, the reduce and the join only."""
        if not launched:
            self._begin(path, x.shape[0], stamps)
        try:
            with nvtx_range(f"streamring EPBuffer.forward {path.name} ({path.num_chunks} chunks, {path.policy})",
                            color="purple"):
                origin = self.current_stream()
                self.producer.begin(path, num_tokens, x.shape[0])
                if launched:
                    self._enqueue_producer(path, layer, x, out, routing, origin)
                else:
                    self.instrument.stamp(path.num_chunks, 0)
                    self._consumer_resets()  # before every side: they start from empty blocks
                    if serialized or path.policy == "serialized" or not self.progress.concurrent:
                        self._enqueue_serialized(path, layer, x, out, routing)
                    else:
                        self.progress.fork(origin, ("d", "g", "u"))
                        self._enqueue_consumer(path, layer)
                        self._enqueue_producer(path, layer, x, out, routing, origin)
                path.ring.drain(origin)
                path.ring.advance_epoch(origin)
        finally:
            self.instrument.end()

    def launch(self, path, layer, rows: int, stamps: bool) -> None:
        """The consumer side of the next streamed forward, ahead of its input (module doc)."""
        self._begin(path, rows, stamps)
        self.progress.fork(self.current_stream(), ("d", "g", "u"))
        with self.progress.side("d"):
            self.instrument.stamp(path.num_chunks, 0)
            self._consumer_resets()
        self._enqueue_consumer(path, layer)

    def _enqueue_serialized(self, path, layer, x, out, routing) -> None:
        """One stream. Rank and ready orders: chunk by chunk (produce c, then its dispatch steps and GEMMs). Arrival
        order takes all of a source's chunks before the next source's, so every chunk is produced first (each in its
        own slot: no reuse wait) and then dispatched in that order."""
        C, ex, st = path.num_chunks, self.experts, self.current_stream()
        persistent = ex.queue is not None
        produced = 0
        for c, j in path.order:
            upto = C if path.source_order == "arrival" else c + 1  # the chunks this step needs published
            for k in range(produced, upto):
                self.producer.produce(path, layer, x, k, routing, st, self.instrument)
            produced = max(produced, upto)
            self._dispatch_step(path, c, j, st)
            if not persistent:
                ex.step_gemms(path, layer, self.plan, c, j, self.combine, st, None, self.instrument)
        self.instrument.stamp(C, 1)
        if persistent:
            # every block is published before the launch: one stream can never wait on itself
            ex.seal_queue(path, self.instrument)
            ex.launch_persistent(path, layer, ex.sm_count, self.combine, self.deadline_s)
        else:
            ex.seal(path, layer, self.plan, self.combine, st, None, self.instrument)
        self._reduce(path, out)

    def _dispatch_step(self, path, c: int, j: int, stream) -> None:
        self.dispatch.step(path, c, j, grouped=self.plan.grouped, bc=self.experts.bc, stream=stream,
                           instrument=self.instrument, queue=self.experts.queue)

    def _enqueue_consumer(self, path, layer) -> None:
        """The consumer side on the dispatch, GEMM and puts streams: every dispatch step, its GEMM call and the
        seal (the persistent consumer: its one launch, before any block is ready, and the queue's seal).

        Step by step, each GEMM call waits on its own dispatch step alone, never on a later one. A persistent-grid
        backend with ``EPTuning(dispatch_beside_grid=False)`` (the default; ``_called`` exists) also puts each
        dispatch step behind the previous step's GEMM call where that call's grid holds every SM
        (:meth:`EPExperts.holds_every_sm`), so no ready wait spins beside such a grid. That only adds dependencies
        to the other order (dispatch i+1 behind call i, call i behind dispatch i), so nothing waits on itself."""
        ex, pr = self.experts, self.progress
        puts = pr.stream("u") if not ex.owner_rows else None
        if ex.queue is not None:
            # its CTAs claim blocks as the dispatch publishes them, and leave reserved_sms SMs to the producer and
            # the dispatch, which must progress while they wait
            with pr.side("g"):
                ex.launch_persistent(path, layer, ex.sm_count - self.tuning.reserved_sms, self.combine,
                                     self.deadline_s)
            with pr.side("d"):
                for c, j in path.order:
                    self._dispatch_step(path, c, j, self.current_stream())
                ex.seal_queue(path, self.instrument)
            return
        if not self._dispatched:  # green_ctx: dispatch and GEMMs share a stream
            with pr.side("d"):
                st = self.current_stream()
                for c, j in path.order:
                    self._dispatch_step(path, c, j, st)
                    ex.step_gemms(path, layer, self.plan, c, j, self.combine, st, puts, self.instrument)
        else:
            for i, (c, j) in enumerate(path.order):
                with pr.side("d"):
                    if self._called and i > 0 and ex.holds_every_sm(path, i - 1, self.plan.rows):
                        self.current_stream().wait_event(self._called[i - 1])
                    self._dispatch_step(path, c, j, self.current_stream())
                    self._dispatched[i].record()
                with pr.side("g"):
                    st = self.current_stream()
                    st.wait_event(self._dispatched[i])
                    ex.step_gemms(path, layer, self.plan, c, j, self.combine, st, puts, self.instrument)
                    if self._called:
                        self._called[i].record()
        with pr.side("g"):
            ex.seal(path, layer, self.plan, self.combine, self.current_stream(), puts, self.instrument)

    def _enqueue_producer(self, path, layer, x, out, routing, origin) -> None:
        """The producer side (behind the caller's stream), the owner's reduce behind it and the GEMMs, and every
        stream joined back into the caller's."""
        pr = self.progress
        pr.fork(origin, ("p",))
        with pr.side("p"):
            st = self.current_stream()
            for c in range(path.num_chunks):
                self.producer.produce(path, layer, x, c, routing, st, self.instrument)
            self.instrument.stamp(path.num_chunks, 1)
        # one reduce after the producer and the GEMMs (green_ctx: on the consumer's partition)
        pr.stream("g").wait_stream(pr.stream("p"))
        with pr.side("g"):
            self._reduce(path, out)
        pr.join(origin)

    def _reduce(self, path, out) -> None:
        with nvtx_range(f"streamring wait arrivals + combine chunks 0..{path.num_chunks - 1}", color="red"):
            self.combine.reduce(path, out, self.producer.my_idx, self.producer.expected, self.current_stream(), 0,
                                path.num_chunks, self.instrument)
