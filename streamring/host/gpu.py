"""GPU host helpers: the device-side ring, progress policies, CUDA-graph capture/replay.

This module drives the kernels of ``streamring/device/csrc/ring.cu`` on an
:class:`~streamring.device.nvshmem.NvshmemHeap`. Everything here except the pure
helpers at the top (descriptor packing, header parsing) needs a CUDA GPU; imports
of torch / cuda.* are lazy so ``import streamring.host.gpu`` works anywhere.

Progress policies (``cfg.nvshmem.progress``), i.e. how a consumer that is enqueued
*before* its producers still lets them run:

* ``stream_wait`` - the consumer stream blocks in ``cuStreamWaitValue64`` (stream memory
  operations: no SM held) until the producer's *doorbell* word says the chunk is there,
  then the consume kernel (acquire + verify + ack) runs. A captured graph bakes the
  waited value, so the doorbell carries an epoch-free value: the lap of the slot within
  the stream (``chunk // num_slots + 1``), waited with GEQ; every consumer resets its
  doorbells of a slot to 0 on the slot's last lap *before* it acknowledges, so the owner's
  next-epoch doorbell (which needs that acknowledgement first) can never be lost. The
  generation check itself stays exact in the consume kernel (it carries the device epoch).
* ``spin_kernel`` - the consumer stream runs a one-thread-per-source spin kernel
  (``ring_spin_wait``: acquire loads with a clock64 deadline) before the consume kernel.
  Holds one SM slot per waiting source while it waits.
* ``green_ctx`` - producer and consumer on streams of two green contexts: the producer gets
  ``cfg.nvshmem.producer_sms`` SMs (multiple of 8), the consumer the remaining SMs (a
  disjoint split through the driver; torch's ``GreenContext.create`` as the fallback),
  so a consumer can never take the producer's SMs. Kernels there use the P2P transport
  (peer pointers), because NVSHMEM's device state is initialised only in the primary
  context. Waits as in spin_kernel.
* ``serialized`` - producer then consumer, chunk by chunk, on one stream. Always valid;
  no overlap.

The synthetic streamed sequence (:func:`enqueue_stream`): per chunk, owner reuse wait
(chunk >= num_slots), route and layout producers (alternating order) that write a
pattern and publish, a consumer per source that acquires, verifies the pattern on the
device, acknowledges; then the owner's drain and ``ring_advance_epoch``. It is captured
into one ``torch.cuda.CUDAGraph`` and replayed with the device-side epoch
(:func:`graph_check`); the device status words count violations and timeouts.

Run the check under MPI (one process per PE)::

    mpiexec -n 2 python3 -m streamring.host.gpu graph --policies all --replays 10000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..protocol import RingLayout, make_gen

POLICIES = ("stream_wait", "spin_kernel", "green_ctx", "serialized")
CSRC = Path(__file__).resolve().parents[1] / "device" / "csrc"

# -- mirrors of ring_desc.cuh (defined in the device layer) ---------------------------------------
from ..device.ringdesc import (  # noqa: E402,F401
    CLOCK_HZ, DESC_FIELDS, DESC_INDEX, ERROR_NAMES, INJECT_BITS, LAYOUT_FIELDS, RING_DESC_WORDS, RING_LAYOUT,
    RING_ROUTE, RS_ABORT, RS_BAD_SEEN, RS_BAD_WANT, RS_CONSUMED, RS_FIRST_ERROR, RS_PUBLISHED, RS_TIMEOUTS,
    RS_VIOLATIONS, RS_WORDS, STREAM_FIELDS, check_header, decode_status, pack_desc, parse_struct_fields,
)


# --------------------------------------------------------------------------------------------
# Device-side ring state
# --------------------------------------------------------------------------------------------
class GpuRing:
    """A ring buffer in symmetric memory + its device descriptor, epoch and status words.

    Collective (allocates a region). ``wake`` adds the doorbell words of the stream_wait
    policy after the layout's bytes. ``timestamps`` adds per-chunk publish/acquire
    %globaltimer stamps (for the latency benchmark).
    """

    def __init__(self, heap, layout: RingLayout, num_chunks: int, *, wake: bool = False,
                 deadline_s: float = 10.0, timestamps: bool = False):
        import torch

        if layout.num_ranks != heap.num_ranks:
            raise ValueError(f"layout.num_ranks={layout.num_ranks} but the heap has {heap.num_ranks} PEs")
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        self.heap = heap
        self.layout = layout
        self.num_chunks = int(num_chunks)
        R = layout.num_ranks
        # the doorbell words are a region of the one RingLayout; -1 tells the kernels not to ring them
        self.off_wake = layout.offsets["wake"] if wake else -1
        self.region = heap.alloc("gpu-ring", layout.nbytes)
        self.buf = self.region.handle.ptr
        dev = heap.device
        self.epoch_t = torch.zeros(1, dtype=torch.int64, device=dev)
        self.status_t = torch.zeros(RS_WORDS, dtype=torch.int64, device=dev)
        self.deadline_cycles = int(deadline_s * CLOCK_HZ)
        desc = pack_desc(layout, epoch_ptr=self.epoch_t.data_ptr(), num_chunks=self.num_chunks,
                         status_ptr=self.status_t.data_ptr(), deadline_cycles=self.deadline_cycles,
                         off_wake=self.off_wake)
        self.desc_t = torch.from_numpy(desc).to(dev)
        self.desc = int(self.desc_t.data_ptr())
        self.peers_t = heap.peer_table(self.region)
        self.peers = int(self.peers_t.data_ptr())
        self.p2p_ok = bool((self.peers_t != 0).all().item())
        if timestamps:
            self.t_pub_t = torch.zeros(self.num_chunks, dtype=torch.int64, device=dev)
            self.t_acq_t = torch.zeros(R * self.num_chunks, dtype=torch.int64, device=dev)
            self.t_pub, self.t_acq = int(self.t_pub_t.data_ptr()), int(self.t_acq_t.data_ptr())
        else:
            self.t_pub = self.t_acq = 0
        heap.sync()

    def set_epoch(self, epoch: int) -> None:
        self.epoch_t.fill_(int(epoch))
        self.heap._torch.cuda.synchronize(self.heap.device)

    def epoch(self) -> int:
        return int(self.epoch_t.item())

    def status(self) -> dict:
        return decode_status(self.status_t.cpu().tolist())

    def wake_addr(self, kind: int, src: int, slot: int) -> int:
        L = self.layout
        return self.buf + self.off_wake + ((kind * L.num_ranks + src) * L.num_slots + slot) * 8

    def words(self, off: int, count: int) -> np.ndarray:
        """This PE's copy of ``count`` uint64 words at byte offset ``off`` (device -> host)."""
        t = self.region.local[off: off + 8 * count].cpu().numpy()
        return t.view(np.uint64)

    def check_quiescent(self, last_epoch: int) -> list[str]:
        """After a drained stream: my ack masks are 0 and consumed_gen[me][s] = the last chunk of each slot."""
        L, me, n = self.layout, self.heap.rank, self.num_chunks
        problems = []
        masks = self.words(L.offsets["ack_mask"], L.num_slots * L.mask_words)
        if masks.any():
            problems.append(f"ack masks not cleared after drain: {[hex(int(x)) for x in masks]}")
        cons = self.words(L.consumed_gen_off(me, 0), L.num_slots)
        for s in range(min(L.num_slots, n)):
            last = s + ((n - 1 - s) // L.num_slots) * L.num_slots
            want = make_gen(last_epoch, last + 1)
            if int(cons[s]) != want:
                problems.append(f"consumed_gen[me][{s}] = {int(cons[s]):#x}, expected {want:#x}")
        return problems

    def close(self) -> None:
        self.heap.free(self.region)


# --------------------------------------------------------------------------------------------
# Green contexts
# --------------------------------------------------------------------------------------------
class _GreenSide:
    """One green context: its torch stream, a cuda.core stream ref, and how to make it current."""

    def __init__(self, stream, push, pop, sms: int, how: str, keep=None):
        from ..device.nvshmem import StreamRef

        self.stream = stream
        self.sref = StreamRef(stream)
        self._push, self._pop = push, pop
        self.sms = sms
        self.how = how
        self._keep = keep

    @contextlib.contextmanager
    def current(self):
        self._push()
        try:
            yield
        finally:
            self._pop()


def _drv_check(res, what: str):
    from cuda.bindings import driver

    err = res[0] if isinstance(res, tuple) else res
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


def make_green_pair(device_index: int, producer_sms: int) -> tuple[_GreenSide, _GreenSide]:
    """Producer green context of ``producer_sms`` SMs and a consumer one of the remaining SMs.

    Uses the driver's disjoint split (``cuDevSmResourceSplitByCount`` + remainder). Falls back
    to ``torch.cuda.green_contexts.GreenContext.create(num_sms=N)`` for both sides when that
    fails (torch carves every context from the same first SMs, so the sides may overlap:
    recorded in ``how``).
    """
    import torch

    if producer_sms % 8 or producer_sms < 8:
        raise ValueError(f"producer_sms must be a positive multiple of 8, got {producer_sms}")
    total = torch.cuda.get_device_properties(device_index).multi_processor_count
    try:
        from cuda.bindings import driver

        dev = _drv_check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        sm_type = driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        # Split the SMs of the current (primary) context: under MPS a client only has its share
        # of the device's SMs, and splitting the whole device's asks for SMs it cannot have.
        try:
            cur = _drv_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
            res = _drv_check(driver.cuCtxGetDevResource(cur, sm_type), "cuCtxGetDevResource")
        except Exception:  # noqa: BLE001
            res = _drv_check(driver.cuDeviceGetDevResource(dev, sm_type), "cuDeviceGetDevResource")
        groups, nb, remainder = _drv_check(driver.cuDevSmResourceSplitByCount(1, res, 0, producer_sms),
                                           "cuDevSmResourceSplitByCount")
        if nb < 1:
            raise RuntimeError("cuDevSmResourceSplitByCount made no group")
        sides = []
        for rsrc, label in ((groups[0], "producer"), (remainder, "consumer")):
            desc = _drv_check(driver.cuDevResourceGenerateDesc([rsrc], 1), f"cuDevResourceGenerateDesc({label})")
            gctx = _drv_check(driver.cuGreenCtxCreate(desc, dev, int(driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)),
                              f"cuGreenCtxCreate({label})")
            ctx = _drv_check(driver.cuCtxFromGreenCtx(gctx), "cuCtxFromGreenCtx")
            cs = _drv_check(driver.cuGreenCtxStreamCreate(gctx, int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), 0),
                            "cuGreenCtxStreamCreate")
            ts = torch.cuda.ExternalStream(int(cs), device=torch.device("cuda", device_index))
            sms = int(rsrc.sm.smCount) if hasattr(rsrc, "sm") else -1

            def push(ctx=ctx):
                _drv_check(driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")

            def pop():
                _drv_check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")

            sides.append(_GreenSide(ts, push, pop, sms, "driver split (disjoint)", keep=(gctx, cs, desc)))
        return sides[0], sides[1]
    except Exception as exc:  # noqa: BLE001 - fall back to torch's API
        driver_err = f"{type(exc).__name__}: {exc}"
    from torch.cuda.green_contexts import GreenContext

    cons_sms = max(8, (total - producer_sms) // 8 * 8)
    sides = []
    for n in (producer_sms, cons_sms):
        try:
            gc = GreenContext.create(num_sms=n, device_id=device_index)
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"green contexts unavailable: driver split: {driver_err}; torch GreenContext.create"
                               f"(num_sms={n}): {exc}") from exc
        gc.set_context()
        try:
            st = gc.Stream()
        finally:
            gc.pop_context()
        sides.append(_GreenSide(st, gc.set_context, gc.pop_context, n,
                                f"torch GreenContext (may overlap; driver split failed: {driver_err})", keep=gc))
    return sides[0], sides[1]


# --------------------------------------------------------------------------------------------
# Stream memory operations
# --------------------------------------------------------------------------------------------
def stream_wait_geq(torch_stream, addr: int, value: int) -> None:
    """Enqueue ``cuStreamWaitValue64(stream, addr, value, GEQ)`` (no SM held while blocked)."""
    from cuda.bindings import driver

    flag = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    st = driver.CUstream(int(torch_stream.cuda_stream))
    try:
        res = driver.cuStreamWaitValue64(st, driver.CUdeviceptr(int(addr)), driver.cuuint64_t(int(value)), int(flag))
    except TypeError:
        res = driver.cuStreamWaitValue64(st, driver.CUdeviceptr(int(addr)), driver.cuuint64_t(int(value)), flag)
    _drv_check(res, "cuStreamWaitValue64")


# --------------------------------------------------------------------------------------------
# The synthetic streamed sequence
# --------------------------------------------------------------------------------------------
class StreamedSequence:
    """Enqueues one stream (epoch) of the synthetic producer/consumer sequence under a policy."""

    def __init__(self, heap, ring: GpuRing, policy: str, *, inject: int = 0, delay_cycles: int = 0,
                 hold_cycles: int = 0, producer_sms: int = 16):
        import torch

        if policy not in POLICIES:
            raise ValueError(f"progress policy {policy!r} is not one of {POLICIES}")
        self.heap, self.ring, self.policy = heap, ring, policy
        self.inject = int(inject)
        self.delay = int(delay_cycles)
        self.hold = int(hold_cycles)
        self.green = None
        self.green_how = ""
        if policy == "green_ctx":
            if not ring.p2p_ok:
                raise RuntimeError("green_ctx needs load/store (P2P) access to every PE's buffer (nvshmem_ptr was NULL)")
            self.green = make_green_pair(heap.device_index, producer_sms)
            self.green_how = f"{self.green[0].how}; producer {self.green[0].sms} SMs, consumer {self.green[1].sms} SMs"
            self.pstream, self.cstream = self.green[0].stream, self.green[1].stream
            self.xport = "p2p"
        elif policy == "serialized":
            self.pstream = self.cstream = None
            self.xport = "nv"
        else:
            self.pstream = torch.cuda.Stream(device=heap.device)
            self.cstream = torch.cuda.Stream(device=heap.device)
            self.xport = "nv"
        if policy == "stream_wait" and ring.off_wake < 0:
            raise ValueError("the stream_wait policy needs a GpuRing made with wake=True")

    def warm_up(self) -> None:
        """Load every kernel in every context used, before any wait is enqueued."""
        if self.green is None:
            return
        scratch = self.heap._torch.zeros(64 + self.heap.num_ranks, dtype=self.heap._torch.int64,
                                         device=self.heap.device)
        dummy = self.heap.dummy_desc(scratch)
        names = ("ring_reuse_wait", "ring_drain", "ring_advance_epoch", "ring_spin_wait",
                 "ring_publish_p2p", "ring_produce_p2p", "ring_consume_p2p")
        for side in self.green:
            with side.current():
                self.heap.warm_up_ring(scratch, stream=side.sref, kernels=names, dummy=dummy)
        self.heap._torch.cuda.synchronize(self.heap.device)

    # -- kernel launches --------------------------------------------------------------------
    def _launch(self, side, name, grid, block, *args):
        if side is None:
            self.heap.launch(name, grid, block, *args, stream=self._origin_ref)
        elif self.green is not None:
            with side.current():
                self.heap.launch(name, grid, block, *args, stream=side.sref)
        else:
            self.heap.launch(name, grid, block, *args, stream=side)

    def _ops(self):
        r, h = self.ring, self.heap
        me = np.int32(h.rank)
        inj = np.int32(self.inject)
        R = r.layout.num_ranks
        x = self.xport

        def reuse(side, c):
            self._launch(side, "ring_reuse_wait", 1, 1, r.desc, r.buf, me, np.int64(c), inj)

        def produce(side, c, kind):
            self._launch(side, f"ring_produce_{x}", 1, 256, r.desc, r.buf, r.peers, me, np.int64(c), np.int32(kind),
                         inj, np.int64(self.delay), r.t_pub)

        def spin(side, c):
            self._launch(side, "ring_spin_wait", R, 1, r.desc, r.buf, np.int64(0), np.int64(c), inj)

        def consume(side, c):
            self._launch(side, f"ring_consume_{x}", R, 256, r.desc, r.buf, r.peers, me, np.int64(0), np.int64(c),
                         inj, np.int64(self.hold), r.t_acq)

        def tail(side):
            self._launch(side, "ring_drain", 1, 1, r.desc, r.buf, me)
            self._launch(side, "ring_advance_epoch", 1, 1, r.desc)

        return reuse, produce, spin, consume, tail

    def enqueue(self, origin) -> None:
        """Enqueue one epoch on ``origin`` (a torch stream; the capture stream when capturing)."""
        from ..device.nvshmem import StreamRef

        self._origin_ref = StreamRef(origin)
        reuse, produce, spin, consume, tail = self._ops()
        n, S, R = self.ring.num_chunks, self.ring.layout.num_slots, self.ring.layout.num_ranks
        kinds = lambda c: (RING_ROUTE, RING_LAYOUT) if c % 2 == 0 else (RING_LAYOUT, RING_ROUTE)  # noqa: E731
        if self.policy == "serialized":
            for c in range(n):
                reuse(None, c)
                for k in kinds(c):
                    produce(None, c, k)
                consume(None, c)
            tail(None)
            return
        if self.green is not None:
            pside, cside = self.green
        else:
            from ..device.nvshmem import StreamRef as _SR

            pside, cside = _SR(self.pstream), _SR(self.cstream)
        self.pstream.wait_stream(origin)
        self.cstream.wait_stream(origin)
        # The consumer is enqueued FIRST: the progress policy must keep it from blocking producers.
        for c in range(n):
            if self.policy == "stream_wait":
                if not self.inject & INJECT_BITS["skip-acquire"]:
                    lap = c // S + 1
                    for src in range(R):
                        for k in (RING_ROUTE, RING_LAYOUT):
                            stream_wait_geq(self.cstream, self.ring.wake_addr(k, src, c % S), lap)
            else:
                spin(cside, c)
            consume(cside, c)
        for c in range(n):
            reuse(pside, c)
            for k in kinds(c):
                produce(pside, c, k)
        origin.wait_stream(self.pstream)
        origin.wait_stream(self.cstream)
        tail(None)


# --------------------------------------------------------------------------------------------
# Capture and replay with device-side epochs
# --------------------------------------------------------------------------------------------
def _agree(heap, ok: bool) -> bool:
    return all(bool(v) for v in heap.allgather_obj(bool(ok)))


def graph_check(heap, policy: str, *, replays: int = 10000, num_slots: int = 4, num_chunks: int = 6,
                tokens_per_slot: int = 32, producer_sms: int = 16, inject: str = "none", delay_us: float = 0.0,
                hold_us: float = 0.0, deadline_s: float = 10.0, check_every: int = 1000, capture: bool = True,
                first_epoch: int = 1) -> dict:
    """Capture the synthetic stream under ``policy`` once and replay it ``replays`` times.

    Collective. Returns this PE's result dict; ``ok`` is the expectation: no violation, no
    timeout, every (src, chunk) consumed in every epoch, the epoch advanced once per replay
    and the ring quiescent at the end (for ``inject != 'none'`` the expectation is the
    opposite: the checks must detect the mutation).
    """
    import torch

    R = heap.num_ranks
    layout = RingLayout(num_ranks=R, num_slots=num_slots, tokens_per_slot=tokens_per_slot, hidden=128, topk=4,
                        num_experts=64)
    res = {"policy": policy, "pes": R, "rank": heap.rank, "inject": inject, "replays_asked": replays,
           "num_slots": num_slots, "num_chunks": num_chunks, "mode": "", "ok": False, "error": None}
    ring = GpuRing(heap, layout, num_chunks, wake=(policy == "stream_wait"), deadline_s=deadline_s)
    seq = None
    try:
        err = None
        try:
            seq = StreamedSequence(heap, ring, policy, inject=INJECT_BITS[inject],
                                   delay_cycles=int(delay_us * 1e-6 * CLOCK_HZ),
                                   hold_cycles=int(hold_us * 1e-6 * CLOCK_HZ), producer_sms=producer_sms)
            seq.warm_up()
            res["green"] = seq.green_how
        except Exception as exc:  # noqa: BLE001 - reported, and every PE skips together
            err = f"{type(exc).__name__}: {exc}"
        if not _agree(heap, err is None):
            res["error"] = err or "another PE could not set this policy up"
            res["mode"] = "not run"
            return res
        ring.set_epoch(first_epoch)
        origin = torch.cuda.Stream(device=heap.device)
        heap.barrier()
        # 1) one eager epoch: validates the sequence before it is baked into a graph
        t0 = time.perf_counter()
        with torch.cuda.stream(origin):
            seq.enqueue(origin)
        origin.synchronize()
        res["eager_epoch_ms"] = (time.perf_counter() - t0) * 1e3
        st = ring.status()
        res["after_eager"] = st
        # 2) capture
        graph = None
        mode = "eager loop"
        if capture and not st["aborted"]:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=origin, capture_error_mode="thread_local"):
                    seq.enqueue(origin)
                mode = "cuda graph"
            except Exception as exc:  # noqa: BLE001
                graph = None
                mode = f"eager loop (capture failed: {type(exc).__name__}: {str(exc)[:200]})"
        if not _agree(heap, graph is not None):
            if graph is not None:
                mode = "eager loop (capture failed on another PE)"
            graph = None
        res["mode"] = mode
        heap.barrier()
        # 3) replays
        done = 0
        t0 = time.perf_counter()
        with torch.cuda.stream(origin):
            while done < replays:
                k = min(check_every, replays - done)
                for _ in range(k):
                    if graph is not None:
                        graph.replay()
                    else:
                        seq.enqueue(origin)
                done += k
                origin.synchronize()
                if ring.status()["aborted"]:
                    break
        wall = time.perf_counter() - t0
        torch.cuda.synchronize(heap.device)
        st = ring.status()
        epochs = 1 + done
        res.update(st)
        res["replays"] = done
        res["us_per_replay"] = wall / max(done, 1) * 1e6
        res["us_per_chunk"] = wall / max(done * num_chunks, 1) * 1e6
        res["epoch_end"] = ring.epoch()
        res["expected_consumed"] = epochs * num_chunks * R
        res["expected_published"] = epochs * num_chunks * 2
        problems = []
        if inject == "none":
            if st["violations"]:
                problems.append(f"{st['violations']} violations")
            if st["timeouts"]:
                problems.append(f"{st['timeouts']} timeouts")
            if st["consumed"] != res["expected_consumed"]:
                problems.append(f"consumed {st['consumed']} != {res['expected_consumed']}")
            if st["published"] != res["expected_published"]:
                problems.append(f"published {st['published']} != {res['expected_published']}")
            if res["epoch_end"] != first_epoch + epochs:
                problems.append(f"epoch {res['epoch_end']} != {first_epoch + epochs}")
            if done != replays:
                problems.append(f"stopped after {done} of {replays} replays")
            heap.barrier()  # every PE drained: masks must be clear now
            problems += ring.check_quiescent(first_epoch + epochs - 1)
            res["ok"] = not problems
        else:
            res["detected"] = st["violations"] + st["timeouts"] > 0
            res["ok"] = res["detected"]
            if not res["detected"]:
                problems.append(f"inject={inject} was NOT detected (no violation, no timeout)")
        res["problems"] = problems
        del graph
        return res
    finally:
        torch.cuda.synchronize(heap.device)
        try:
            heap.barrier()
        finally:
            ring.close()


# --------------------------------------------------------------------------------------------
# Command line (run under mpiexec / torchrun; one process per PE)
# --------------------------------------------------------------------------------------------
def _bootstrap():
    from ..device.nvshmem import NvshmemHeap
    from .launch import detect_launcher

    launcher = detect_launcher()
    return NvshmemHeap.bootstrap(launcher=launcher.value)


def _table(rows: list[dict]) -> str:
    head = f"{'policy':<12} {'inject':<22} {'PEs':>3} {'mode':<11} {'replays':>7} {'us/replay':>9} {'viol':>5} " \
           f"{'tmo':>4} {'consumed':>9} {'result':<6}"
    out = [head, "-" * len(head)]
    for r in rows:
        mode = "graph" if r.get("mode") == "cuda graph" else ("n/a" if r.get("mode") == "not run" else "eager")
        out.append(f"{r['policy']:<12} {r['inject']:<22} {r['pes']:>3} {mode:<11} {r.get('replays', 0):>7} "
                   f"{r.get('us_per_replay', 0):>9.1f} {r.get('violations', 0):>5} {r.get('timeouts', 0):>4} "
                   f"{r.get('consumed', 0):>9} {r.get('verdict', '?'):<6}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streamring.host.gpu")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("graph", help="capture the synthetic stream and replay it with device-side epochs")
    g.add_argument("--policies", default="all", help=f"comma list of {POLICIES} or 'all'")
    g.add_argument("--replays", type=int, default=10000)
    g.add_argument("--slots", type=int, default=4)
    g.add_argument("--chunks", type=int, default=6)
    g.add_argument("--producer-sms", type=int, default=16)
    g.add_argument("--controls", action="store_true",
                   help="also run the negative controls (each inject mode must be detected)")
    g.add_argument("--control-replays", type=int, default=40)
    g.add_argument("--deadline-s", type=float, default=10.0)
    g.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    heap = _bootstrap()
    policies = POLICIES if args.policies == "all" else tuple(p.strip() for p in args.policies.split(","))
    runs = [dict(policy=p, replays=args.replays) for p in policies]
    if args.controls:
        runs += [
            dict(policy="spin_kernel", inject="skip-acquire", delay_us=50.0),
            dict(policy="spin_kernel", inject="signal-before-payload", delay_us=50.0),
            dict(policy="spin_kernel", inject="ignore-epoch", delay_us=50.0),
            dict(policy="spin_kernel", inject="skip-ack-wait", delay_us=50.0, hold_us=300.0, num_slots=2),
        ]
    rows = []
    for spec in runs:
        spec = dict(spec)
        ctl = spec.get("inject", "none") != "none"
        kw = dict(replays=args.control_replays if ctl else spec.pop("replays"), num_slots=spec.pop("num_slots", args.slots),
                  num_chunks=args.chunks, producer_sms=args.producer_sms,
                  deadline_s=0.5 if ctl else args.deadline_s, check_every=10 if ctl else 1000)
        spec.pop("replays", None)
        t0 = time.perf_counter()
        try:
            r = graph_check(heap, **spec, **kw)
        except Exception as exc:  # noqa: BLE001 - one policy's failure must not hide the others
            r = {"policy": spec["policy"], "inject": spec.get("inject", "none"), "pes": heap.num_ranks,
                 "ok": False, "error": f"{type(exc).__name__}: {exc}", "mode": "crashed"}
        r["wall_s"] = time.perf_counter() - t0
        all_r = heap.allgather_obj(r)
        merged = dict(all_r[0])
        merged["ok"] = all(x.get("ok") for x in all_r)
        for key in ("violations", "timeouts", "consumed"):
            merged[key] = sum(int(x.get(key, 0) or 0) for x in all_r)
        merged["per_pe"] = all_r
        if merged.get("mode") == "not run" and spec["policy"] == "green_ctx" and heap.num_ranks > 1:
            merged["verdict"] = "n/a"  # green contexts under MPS: reported, not counted
        else:
            merged["verdict"] = "PASS" if merged["ok"] else "FAIL"
        rows.append(merged)
        if heap.rank == 0:
            print(f"[gpu graph] {spec['policy']} inject={spec.get('inject', 'none')}: {merged['verdict']} "
                  f"mode={merged.get('mode')} replays={merged.get('replays')} "
                  f"us/replay={merged.get('us_per_replay', 0):.1f} problems={[x.get('problems') for x in all_r]} "
                  f"errors={[x.get('error') for x in all_r if x.get('error')]} "
                  f"first_error={[x.get('first_error') for x in all_r if x.get('first_error')]}", flush=True)
    code = 0 if all(r["verdict"] in ("PASS", "n/a") for r in rows) else 1
    if heap.rank == 0:
        print(_table(rows), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    heap.barrier()
    heap.close()
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
