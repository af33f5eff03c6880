"""Kinds of lateness of one PE for ``bench.ep_layer``, beside the producer delay of its stragglers.

A PE can be late to a layer in more ways than the producer delay ``bench.ep_layer`` injects (a device-side
wait inside the producer stage, while the late PE's GPU is free). Here, each in a captured graph of its own,
paired with the batch path in the same case (both graphs built the same way):

* ``idle``: the late PE's caller stream waits ``late_ms`` before the layer (a one-thread spin on that stream,
  its length a device word: the stream idle, as when it waits on another stream's event; with ``--delay-by
  host`` a stream wait on the instrument's host-held word instead, so no kernel spins on the late PE's GPU);
* ``busy``: bf16 matmuls of about ``late_ms`` on the late PE's caller stream before the layer (a stand-in for a
  longer attention: the GPU busy);
* ``beside``: the same matmuls on another stream of the late PE, launched with the layer and joined after it
  (the graph's time is the time until both end).

The streamed graph launches its consumer ahead (``EPBuffer.launch_consumer`` at the graph's start, before the
late work) unless told not to; every graph has the buffer's node priorities (``EPBuffer.prioritize``: every
kernel but the expert GEMMs at the high priority, the caller's matmuls included), batch and streamed alike.
Stamps around the matmuls give ``other_work_ms``: how long the late PE's other work took beside each path.
"""

from __future__ import annotations

import statistics

import torch

from bench.common import Reported, log
from streamring.device import kernels as DK
from streamring.device.moe_triton import stamp
from streamring.device.streams import stream_wait_geq

#: the kinds this module measures (``producer`` is ``bench.ep_layer``'s own straggler)
KINDS = ("idle", "busy", "beside")
#: the side of the matmuls (bf16, square): big enough to fill the GPU, small enough to size ``late_ms`` finely
MATMUL_N = 4096


class LateWork:
    """One PE's late work, captured into graphs around a forward (collective only through the forward)."""

    def __init__(self, heap, buf):
        dev = heap.device
        self.heap, self.buf, self.dev = heap, buf, dev
        g = torch.Generator(device=dev).manual_seed(99 + heap.rank)
        self.a = torch.randn(MATMUL_N, MATMUL_N, generator=g, device=dev).to(torch.bfloat16)
        self.b = torch.randn(MATMUL_N, MATMUL_N, generator=g, device=dev).to(torch.bfloat16)
        self.c = torch.empty(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=dev)
        self.delay_ns = torch.zeros(1, dtype=torch.int64, device=dev)
        self.stamps = torch.zeros(2, dtype=torch.int64, device=dev)
        self.side = torch.cuda.Stream(device=dev)
        self.matmul_ms = self._calibrate()

    def _calibrate(self, n: int = 20) -> float:
        """One matmul's median time on this PE, with every PE timing at once (its share of the GPU)."""
        for _ in range(3):
            torch.matmul(self.a, self.b, out=self.c)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        self.heap.barrier()
        for _ in range(n):
            e0.record()
            torch.matmul(self.a, self.b, out=self.c)
            e1.record()
            torch.cuda.synchronize(self.dev)
            times.append(e0.elapsed_time(e1))
        return statistics.median(times)

    def matmuls_for(self, ms: float) -> int:
        return max(1, round(ms / self.matmul_ms))

    def _matmuls(self, n: int) -> None:
        stamp(self.stamps, 0)
        for _ in range(n):
            torch.matmul(self.a, self.b, out=self.c)
        stamp(self.stamps, 1)

    def graph(self, layer, x, y, routing, *, streaming: bool, kind: str, matmuls: int, launch_ahead: bool):
        """The forward in a graph of its own with this PE's part of ``kind`` (``matmuls``: 0 on a PE that is not
        late; ``idle`` reads its length from :attr:`delay_ns` at every replay)."""
        buf = self.buf
        g = torch.cuda.CUDAGraph(keep_graph=True)
        cap = torch.cuda.Stream(device=self.dev)
        cap.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=cap, capture_error_mode="thread_local"):
            if streaming and launch_ahead:
                buf.launch_consumer(layer, x.shape[0], stamps=False)
            cur = torch.cuda.current_stream()
            if kind == "idle" and buf.instrument.hold is not None:  # --delay-by host: no kernel, the GPU free
                stream_wait_geq(cur, int(buf.instrument.hold.data_ptr()), 1)
            elif kind == "idle":
                DK.ep_delay(self.heap.lib, buf.paths["stream"].ring.stream_ref(cur), ns=int(self.delay_ns.data_ptr()))
            elif kind == "busy" and matmuls:
                self._matmuls(matmuls)
            elif kind == "beside" and matmuls:
                self.side.wait_stream(cur)
                with torch.cuda.stream(self.side):
                    self._matmuls(matmuls)
            buf.forward(x, layer, streaming=streaming, out=y, routing=routing, stamps=False)
            if kind == "beside" and matmuls:
                cur.wait_stream(self.side)
        buf.prioritize(g)
        g.instantiate()
        torch.cuda.current_stream().wait_stream(cap)
        return Reported(buf, g)

    def other_work_ms(self, g, replays: int = 5) -> float | None:
        """The median time of this PE's matmuls over ``replays`` replays of ``g`` (every PE replays it)."""
        times = []
        for _ in range(replays):
            torch.cuda.synchronize(self.dev)
            self.heap.barrier()
            self.stamps.zero_()
            g.replay()
            torch.cuda.synchronize(self.dev)
            t0, t1 = self.stamps.tolist()
            if t0 and t1:
                times.append((t1 - t0) / 1e6)
        return statistics.median(times) if times else None


def measure_kinds(heap, buf, layer, x, routing, args, timed_rounds, stats) -> list[dict]:
    """Every ``args.lateness`` kind of this module, each late PE of ``args.straggler_ranks`` and each
    ``args.straggler_ms``: the streamed graph (consumer launched ahead per ``args.launch_ahead``) against the
    batch graph in the same case and the batch graph on time, replays interleaved (``timed_rounds``). Returns
    one dict per (kind, ms, rank, launch_ahead) with ``streamed``/``batch``/``batch_on_time`` stats and the late
    PE's ``other_work_ms`` beside each path (None where the kind has none)."""
    me = heap.rank
    work = LateWork(heap, buf)
    if me == 0:
        log(f"late work: one {MATMUL_N}^3 bf16 matmul {work.matmul_ms:.3f} ms on PE 0")
    y = torch.zeros_like(x)
    g0 = work.graph(layer, x, y, routing, streaming=False, kind="none", matmuls=0, launch_ahead=False)
    out = []
    aheads = {"on": [True], "off": [False], "both": [True, False]}[args.launch_ahead]
    for kind in [k for k in args.lateness if k in KINDS]:
        if any(heap.allgather_obj(args.budget.spent())):  # every PE stops at the same kind
            log(f"late work: {kind} and the kinds after it skipped: the time budget is spent")
            break
        for ms in args.straggler_ms:
            for rank in args.straggler_ranks:
                late = me == rank
                n = work.matmuls_for(ms) if late and kind != "idle" else 0
                gb = work.graph(layer, x, y, routing, streaming=False, kind=kind, matmuls=n, launch_ahead=False)
                for ahead in aheads:
                    gs = work.graph(layer, x, y, routing, streaming=True, kind=kind, matmuls=n, launch_ahead=ahead)

                    def delay(i, ns=int(ms * 1e6) if late and kind == "idle" else 0):
                        work.delay_ns.fill_(ns)
                        if buf.instrument.hold is not None:  # the idle wait is the host-held word
                            buf.instrument.set_delay(ns)

                    def on_time(i):
                        delay(i, 0)
                    t = timed_rounds(heap, [("batch_on_time", g0.replay, on_time), ("batch", gb.replay, delay),
                                            ("streamed", gs.replay, delay)], args.replays)
                    other = {}
                    if kind != "idle":
                        for name, g in (("batch", gb), ("streamed", gs)):
                            other[name] = heap.allgather_obj(work.other_work_ms(g))[rank]
                    out.append({"kind": kind, "ms": ms, "rank": rank, "launch_ahead": ahead,
                                "matmuls": heap.allgather_obj(n)[rank], **{k: stats(v) for k, v in t.items()},
                                "other_work_ms": other.get("streamed"), "other_work_batch_ms": other.get("batch")})
                    del gs
                del gb
    work.delay_ns.zero_()
    del g0
    return out
