"""The streamed FP8 MoE layer on a GPU: producers publish chunks through the NVSHMEM ring,
the block-granular consumer (``streamring.moe.blocks``) acquires them, dispatches their rows
into per-expert blocks, acknowledges the slot, and runs every block that became ready.

One forward is enqueued without host synchronisation and captured as one CUDA graph; the
device epoch (``ring_advance_epoch`` at the end) makes every replay a new ring epoch, so the
generation checks stay exact across replays (RFC: ABA across CUDA-graph replay).

Per chunk c (slot s = c % num_slots)::

    producer stream (high priority)         dispatch stream (high priority, enqueued first)
    ring_reuse_wait(c)  (c >= num_slots)    [policy wait for route+layout of c]
    router + top-k -> slot s idx/weights    ring_spin_wait(c): acquire + exact generation check
    ring_publish(ROUTE, c)                  dispatch(c): sort, alloc blocks, copy rows out of s
    FP8 quant -> slot s x / x_sf            ring_ack(c)   <- early input_consumed: the slot is no
    ring_publish(LAYOUT, c)                               longer referenced after the dispatch
                                            event(c)
                                            GEMM stream: wait event(c); L1+SwiGLU, L2 of the
                                            blocks dispatch c made ready
    after the last chunk (GEMM stream): seal -> GEMMs of the partial blocks -> combine
    after every stream joined: ring_drain, ring_advance_epoch

A block made ready by dispatch c is never written by a later dispatch (later rows go to
blocks that are not full yet), so the GEMMs of chunk c and the dispatch of chunk c+1 touch
disjoint rows and may run concurrently.

Memory ordering: the producers' payload writes (torch/Triton kernels on the producer stream)
complete before ``ring_publish`` (stream order), whose release (fence) precedes the generation
store; the consumer's ``ring_spin_wait`` acquire-loads the generations and every later kernel
on the consumer stream starts after it (stream order), so the dispatch reads the published
payload. The consumer's last read of slot s is in the dispatch kernel, which completes before
``ring_ack`` (stream order; the ack kernel fences before its fetch_or); the owner's
``ring_reuse_wait`` acquires the full mask before the next write of slot s.

Progress policies (the consumer is enqueued before the producer, so its waits must not keep
the producer from running): ``serialized`` (one stream, chunk by chunk: no overlap, always
valid), ``stream_wait`` (cuStreamWaitValue64 on the ring's doorbells: no SM held while
waiting), ``spin_kernel`` (the one-thread ``ring_spin_wait`` kernel polls), ``green_ctx``
(producer and consumer on disjoint green-context SM partitions), ``pdl`` (the serialized
order with programmatic dependent launch of the GEMMs).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..device import moe_triton as K
from ..device.ranges import annotate as nvtx_range
from ..device.ringdesc import RING_LAYOUT, RING_ROUTE
from ..device_ring import DeviceRing
from ..protocol import PROGRESS_POLICIES as POLICIES  # noqa: F401  (re-exported)
from ..protocol import RingLayout
from .blocks import FP8, BlockConsumer, FastWeights, Producer
from .math import MoEShape
from .plan import PlanChoice
# per-chunk device timestamps (ns, %globaltimer): row c of ``stamps`` is chunk c, the last row the tail
from .timeline_events import CHUNK_EVENTS, STAMP_STRIDE, TAIL_EVENTS


class StreamedMoE:
    """One single-PE streamed MoE forward of exactly ``tokens`` tokens under ``plan``.

    ``heap``: a started :class:`~streamring.device.nvshmem.NvshmemHeap` (one PE: the layer's
    experts all live on this GPU). Collective over the heap's PEs (allocates the ring).
    :meth:`enqueue` puts one forward on the current stream (capturable);
    :meth:`status` returns the ring's device status (violations, timeouts, counters).
    """

    def __init__(self, heap, shape: MoEShape, fw: FastWeights, tokens: int, plan: PlanChoice, *,
                 timeline: bool = False, producer_sms: int = 16, deadline_s: float = 10.0):
        plan.validate()
        if heap.num_ranks != 1:
            raise ValueError("StreamedMoE drives one PE (all experts local); "
                             f"the heap has {heap.num_ranks} PEs")
        self.heap, self.shape, self.fw, self.plan = heap, shape, fw, plan
        self.tokens = int(tokens)
        self.chunk = min(plan.chunk_tokens, self.tokens)
        self.num_chunks = max(1, math.ceil(self.tokens / self.chunk))
        dev = heap.device
        layout = RingLayout(num_ranks=1, num_slots=plan.num_slots, tokens_per_slot=self.chunk, hidden=shape.hidden,
                            topk=shape.topk, num_experts=shape.num_experts)
        self.ring = DeviceRing(heap, layout, self.num_chunks, transport="p2p" if plan.policy == "green_ctx" else "nv",
                               wake=(plan.policy == "stream_wait"), deadline_s=deadline_s, name="moe-ring")
        L, H, Kk = layout, shape.hidden, shape.topk
        buf = self.ring.region.local
        n = self.chunk

        def view(off, nbytes, dtype, shape_):
            return buf[off: off + nbytes].view(dtype).view(*shape_)

        S = plan.num_slots
        self.slot_x = [view(L.x_off(s), n * H, FP8, (n, H)) for s in range(S)]
        self.slot_sf = [view(L.x_sf_off(s), n * L.sf_cols * 4, torch.float32, (n, L.sf_cols)) for s in range(S)]
        self.slot_idx = [view(L.topk_idx_off(s), n * Kk * 8, torch.int64, (n, Kk)) for s in range(S)]
        self.slot_w = [view(L.topk_weights_off(s), n * Kk * 4, torch.float32, (n, Kk)) for s in range(S)]
        self.prod = Producer(shape, fw, self.chunk, dev)
        self.bc = BlockConsumer(shape, self.tokens, self.num_chunks, plan.block_m, dev)
        self.stamps = torch.zeros((self.num_chunks + 1) * STAMP_STRIDE, dtype=torch.int64, device=dev) \
            if timeline else None
        self.green = None
        self.events = []
        if plan.policy == "green_ctx":
            from ..device.green import make_green_pair

            self.green = make_green_pair(heap.device_index, producer_sms)
            self.pstream = self.green[0].stream
            self.dstream = self.gstream = self.green[1].stream
        elif plan.policy in ("serialized", "pdl"):
            self.pstream = self.dstream = self.gstream = None
        else:
            # Producer and dispatch run at high priority: a waiting CTA of theirs is scheduled before
            # the next pending CTA of a big GEMM grid, so chunk c+1 is produced and dispatched while
            # the blocks of chunk c compute (without it the GPU's block scheduler drains the GEMM
            # grid first and nothing overlaps). Captured graphs keep the priority per kernel node
            # (torch instantiates with cudaGraphInstantiateFlagUseNodePriority).
            hi = -10 if plan.priority_streams() else 0
            self.pstream = torch.cuda.Stream(device=dev, priority=hi)
            self.dstream = torch.cuda.Stream(device=dev, priority=hi)
            self.gstream = torch.cuda.Stream(device=dev, priority=0)
            self.events = [torch.cuda.Event() for _ in range(self.num_chunks)]
        self.ring.set_epoch(1)

    # -- pieces --------------------------------------------------------------------------------
    def _stamp(self, row, col):
        if self.stamps is not None:
            K.stamp(self.stamps, row * STAMP_STRIDE + col)

    def _side(self, which):
        """Context manager making side ``which`` ('p' producer, 'd' dispatch, 'g' GEMMs) current."""
        import contextlib

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

    def _produce(self, x, c):
        with nvtx_range(f"streamring produce chunk {c}", color="blue"):
            r = self.ring
            st = torch.cuda.current_stream()
            s = c % self.plan.num_slots
            a, b = c * self.chunk, min(self.tokens, (c + 1) * self.chunk)
            n = b - a
            self._stamp(c, 5)
            if c >= self.plan.num_slots:
                r.reuse_wait(st, c)
            self.prod.route(x[a:b], self.slot_idx[s][:n], self.slot_w[s][:n])
            r.publish(st, c, RING_ROUTE)
            self._stamp(c, 0)
            self.prod.layout(x[a:b], self.slot_x[s][:n], self.slot_sf[s][:n])
            r.publish(st, c, RING_LAYOUT)
            self._stamp(c, 1)

    def _dispatch(self, c):
        with nvtx_range(f"streamring acquire+dispatch+ack chunk {c}", color="orange"):
            r = self.ring
            st = torch.cuda.current_stream()
            s = c % self.plan.num_slots
            a, b = c * self.chunk, min(self.tokens, (c + 1) * self.chunk)
            n = b - a
            if self.plan.policy == "stream_wait":
                r.wait_doorbells(st, c)
            # acquire + exact (epoch, chunk) generation check; the wait itself under spin_kernel
            r.spin_wait(st, c)
            self._stamp(c, 2)
            self.bc.dispatch(c, self.slot_idx[s][:n], self.slot_w[s][:n], self.slot_x[s][:n], self.slot_sf[s][:n], a)
            r.ack(st, c)
            self._stamp(c, 3)

    def _gemms(self, c):
        with nvtx_range(f"streamring block GEMMs chunk {c}", color="green"):
            n = min(self.tokens, (c + 1) * self.chunk) - c * self.chunk
            self.bc.compute(c, c + 1, self.bc.max_ready(n), self.fw, pdl=self.plan.policy == "pdl",
                            max_ctas=self.plan.chunk_gemm_ctas)
            self._stamp(c, 4)

    def _finish(self, out):
        with nvtx_range("streamring seal+combine", color="red"):
            C = self.num_chunks
            self.bc.seal(C)
            self.bc.compute(C, C + 1, self.bc.max_ready(0), self.fw, pdl=self.plan.policy == "pdl")
            self._stamp(C, 2)
            self.bc.combine(out)
            self._stamp(C, 3)

    # -- the forward ---------------------------------------------------------------------------
    def warm_up(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """One eager forward in the serialized order (no wait is enqueued before its producer),
        then a device sync: compiles and loads every kernel the policy's order will use, so no
        module load can happen while a consumer stream waits on the ring."""
        self.enqueue(x, out, order="serialized")
        torch.cuda.synchronize(self.heap.device)
        st = self.status()
        if st.get("violations") or st.get("timeouts"):
            raise RuntimeError(f"ring errors in the warm-up forward: {st}")

    def enqueue(self, x: torch.Tensor, out: torch.Tensor, order: str | None = None) -> None:
        """Enqueue one streamed forward of ``x [tokens, H]`` (bf16) into ``out`` (bf16).

        ``order='serialized'`` forces the one-stream chunk-by-chunk order (used by :meth:`warm_up`).
        """
        with nvtx_range(f"streamring StreamedMoE.enqueue ({self.num_chunks} chunks, {self.plan.policy})",
                           color="purple"):
            if x.shape != (self.tokens, self.shape.hidden) or out.shape != x.shape:
                raise ValueError(f"x and out must have shape [{self.tokens}, {self.shape.hidden}], "
                                 f"got {list(x.shape)} and {list(out.shape)}")
            r = self.ring
            origin = torch.cuda.current_stream()
            C = self.num_chunks
            if self.pstream is None or order == "serialized":  # one stream, chunk by chunk
                self._stamp(C, 0)
                self.bc.begin()
                for c in range(C):
                    self._produce(x, c)
                    self._dispatch(c)
                    self._gemms(c)
                self._stamp(C, 1)
                self._finish(out)
            else:
                for st in {self.pstream, self.dstream, self.gstream}:
                    st.wait_stream(origin)
                # the consumer is enqueued FIRST: the progress policy must keep it from blocking producers
                with self._side("d"):
                    self._stamp(C, 0)
                    self.bc.begin()
                    for c in range(C):
                        self._dispatch(c)
                        if self.events:
                            self.events[c].record()
                        else:
                            self._gemms(c)  # green_ctx: dispatch and GEMMs share the consumer's stream
                if self.events:
                    with self._side("g"):
                        for c in range(C):
                            self.gstream.wait_event(self.events[c])
                            self._gemms(c)
                with self._side("g"):
                    self._finish(out)
                with self._side("p"):
                    for c in range(C):
                        self._produce(x, c)
                    self._stamp(C, 1)
                for st in {self.pstream, self.dstream, self.gstream}:
                    origin.wait_stream(st)
            r.drain(origin)
            r.advance_epoch(origin)

    def capture(self, x: torch.Tensor, out: torch.Tensor, *, node_priority: bool = True):
        """Capture one forward into a CUDA graph and return it (instantiated).

        Call :meth:`warm_up` first. With ``node_priority`` (and a policy whose producer/dispatch
        streams are high-priority) every kernel node except the expert GEMMs is given the high
        launch priority explicitly (a captured kernel node does not keep its stream's priority).
        Measured on the H200 (``bench/probe_overlap.py``): neither this nor
        ``CUDA_GRAPHS_USE_NODE_PRIORITY=1`` made the next chunk's producer run beside the current
        chunk's GEMMs inside the graph; high-priority streams do it in eager mode.
        ``self.node_priority_report`` says how many nodes were changed (or why none).
        """
        want = node_priority and self.plan.priority_streams() and self.events != []
        g = torch.cuda.CUDAGraph(keep_graph=want)
        side = torch.cuda.Stream(device=self.heap.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
            self.enqueue(x, out)
        self.node_priority_report = "not asked" if not want else _prioritize_nodes(
            g, {int(k.function) for k in self.bc.gemm_kernels}, self.pstream.priority)
        if want:
            g.instantiate()
        torch.cuda.current_stream().wait_stream(side)
        return g

    def status(self) -> dict:
        """The ring's device status words (violations, timeouts, published, consumed, ...)."""
        return self.ring.status()

    def timeline(self) -> dict:
        """Per-chunk device timestamps of the last forward (needs ``timeline=True``), in us from start."""
        if self.stamps is None:
            raise ValueError("this StreamedMoE was made without timeline=True")
        st = self.stamps.view(-1, STAMP_STRIDE).cpu().numpy().astype(np.int64)
        t0 = int(st[self.num_chunks, 0])
        chunks = [{ev: (int(st[c, j]) - t0) / 1e3 for j, ev in enumerate(CHUNK_EVENTS)}
                  for c in range(self.num_chunks)]
        tail = {ev: (int(st[self.num_chunks, j]) - t0) / 1e3 for j, ev in enumerate(TAIL_EVENTS)}
        ready = self.bc.ready_hi.cpu().tolist()[: self.num_chunks + 2]
        for c in range(self.num_chunks):
            chunks[c]["blocks_ready"] = ready[c + 1] - ready[c]
        tail["seal_blocks"] = ready[self.num_chunks + 1] - ready[self.num_chunks]
        return {"chunks": chunks, "tail": tail, "policy": self.plan.policy, "tokens": self.tokens,
                "chunk_tokens": self.chunk, "num_slots": self.plan.num_slots, "block_m": self.plan.block_m}

    def close(self) -> None:
        self.ring.close()


def _prioritize_nodes(graph, low_funcs: set, priority: int) -> str:
    """Give every kernel node of the captured ``graph`` whose function is not in ``low_funcs``
    the launch priority ``priority`` (CUDA driver graph API). Returns a one-line report."""
    from cuda.bindings import driver as drv

    def ok(res, what):
        err = res[0] if isinstance(res, tuple) else res
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return res[1:] if isinstance(res, tuple) else ()

    try:
        cg = drv.CUgraph(int(graph.raw_cuda_graph()))
        _, count = ok(drv.cuGraphGetNodes(cg, 0), "cuGraphGetNodes(count)")
        nodes, _ = ok(drv.cuGraphGetNodes(cg, count), "cuGraphGetNodes")
        kernel_type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
        # the node-attribute flavour of the launch attribute (cuda-bindings wants these types)
        ids = getattr(drv, "CUkernelNodeAttrID", drv.CUlaunchAttributeID)
        attr = getattr(ids, "CU_KERNEL_NODE_ATTRIBUTE_PRIORITY", None)
        if attr is None:
            attr = ids.CU_LAUNCH_ATTRIBUTE_PRIORITY
        value_type = getattr(drv, "CUkernelNodeAttrValue", drv.CUlaunchAttributeValue)
        changed = kept = 0
        for node in nodes:
            (ntype,) = ok(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")
            if ntype != kernel_type:
                continue
            (params,) = ok(drv.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
            if int(params.func) in low_funcs:
                kept += 1
                continue
            val = value_type()
            val.priority = int(priority)
            ok(drv.cuGraphKernelNodeSetAttribute(node, attr, val), "cuGraphKernelNodeSetAttribute")
            changed += 1
        return f"{changed} kernel nodes set to priority {priority}, {kept} GEMM nodes left at the default"
    except Exception as exc:  # noqa: BLE001 - the graph still runs, without node priorities
        return f"node priorities not set: {type(exc).__name__}: {exc}"
