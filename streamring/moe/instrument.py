"""Test and benchmark hooks of an :class:`~streamring.moe.ep_buffer.EPBuffer`, in one object a test or benchmark
attaches explicitly (:func:`attach`): a delay of this PE's producer (the late producer of the benchmarks and of
``run.straggler``: a one-warp kernel spinning on the device, or held by the host with no SM taken), per-chunk
``%globaltimer`` stamps (the device timeline that ``streamring timeline`` draws) and a deliberate protocol
mutation (to show that the checks catch it). A buffer without one (``buf.instrument is None``, every engine's)
enqueues none of their kernels.

Collective like the buffer: attach on every PE, before the forwards (and captures) that should carry it.
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import torch

from ..device import kernels as DK
from ..device import moe_triton as K
from ..device.ringdesc import INJECT_BITS
from .timeline_events import CHUNK_EVENTS, FIRST_STEP_EVENTS, STAMP_STRIDE, TAIL_EVENTS


#: a host-held producer delay is released this long after its delay even if no launch was reported (never a hang)
HOLD_FALLBACK_S = 2.0
#: a host-held delay's release thread polls the clock for its last this many seconds (it sleeps before them)
RELEASE_SPIN_S = 0.0005


class Instrument:
    """The hooks of one buffer (made by :func:`attach`)."""

    def __init__(self, buf):
        self._buf = buf
        #: the producer's delay in ns before its first chunk (device word, read when the forward runs)
        self.delay_ns = torch.zeros(1, dtype=torch.int64, device=buf.dev)
        #: with :meth:`hold_with_host`: a pinned host word the producer's stream waits on (0: held, 1: released)
        self.hold = None
        self._held_ns = 0
        self._generation = 0
        self._launch_t0 = None  # host perf_counter at launching(): the held delay counts from there
        #: the protocol mutation of the streamed ring (``streamring.ring.policies.INJECT_MODES``; ``none``)
        self.inject = "none"
        self.inject_bits = 0
        self.stamps = None  # int64 rows of STAMP_STRIDE words: a chunk's events per row, the tail last
        self.recording = True  # whether this forward writes its stamps (a forward's ``stamps=`` argument)
        self.stamp_path = None  # the path the last stamped forward ran

    def begin(self, path, stamps: bool) -> None:
        """A forward on ``path`` starts: it writes its stamps if ``stamps``."""
        self.recording, self.stamp_path = stamps, path

    def end(self) -> None:
        self.recording = True

    # -- the late producer -------------------------------------------------------------------------
    def set_delay(self, ns: int) -> None:
        """Delay this PE's producer by ``ns`` nanoseconds in the next forwards (0: none). Device side (a spinning
        one-warp kernel), or with :meth:`hold_with_host` held by the host: the next forward's producer waits until
        :meth:`launched` (called right after the forward or its graph is enqueued) has let ``ns`` pass."""
        self.delay_ns.fill_(int(ns))
        if self.hold is not None:
            self._held_ns = int(ns)
            if ns > 0:
                self.rearm()
            else:  # released now; a pending timer of an earlier hold finds a newer generation
                self._generation += 1
                self.hold.fill_(1)

    def rearm(self) -> None:
        """With a host-held delay pending: hold the next forward's producer again (the word back to 0), each forward
        its own hold. Call when the previous forward has ended, before enqueueing the next (the benchmark's replays
        do); released by :meth:`launched`, or :data:`HOLD_FALLBACK_S` after the delay if no launch is reported
        (never a hang)."""
        if self.hold is None or not self._held_ns:
            return
        self._generation += 1
        self.hold.fill_(0)
        self._release_after(self._held_ns / 1e9 + HOLD_FALLBACK_S)

    def hold_with_host(self) -> None:
        """Hold the producer's delay with no SM taken: its stream waits (``cuStreamWaitValue64``, GEQ 1) on a
        pinned host word that a host timer sets ``delay_ns`` after the launch (:meth:`launched`), instead of a
        one-warp kernel spinning on an SM (which a statically scheduled GEMM grid beside it may need). Allocates:
        before the captures that should carry it."""
        if torch.device(self._buf.dev).type != "cuda":
            raise ValueError("hold_with_host needs a GPU buffer (a stream waits on the host word)")
        if self.hold is None:
            self.hold = torch.ones(1, dtype=torch.int64).pin_memory()

    def launching(self) -> None:
        """Just before enqueueing a forward (or replaying its graph) with a host-held delay pending: the delay counts
        from here, not from :meth:`launched`, since the GPU starts the forward while a graph's launch is still being
        enqueued (a long graph's launch takes a good part of a millisecond on the host)."""
        self._launch_t0 = time.perf_counter()

    def launched(self) -> None:
        """After enqueueing a forward (or replaying its graph) with a host-held delay pending: release the producer
        the delay after :meth:`launching` (or from now if it was not called)."""
        if self.hold is not None and self._held_ns:
            self._release_after(self._held_ns / 1e9, start=self._launch_t0)
        self._launch_t0 = None

    def _release_after(self, seconds: float, start: float | None = None) -> None:
        """Set the host word ``seconds`` after ``start`` (a ``time.perf_counter`` value; None: now) on a thread of
        its own, unless a later hold owns the word by then. The thread sleeps to :data:`RELEASE_SPIN_S` before the
        deadline and then polls the clock, yielding the GIL each turn: a plain timer wakes 0.1-0.5 ms late on a
        busy host, which a 1 ms delay cannot afford."""
        hold, gen = self.hold, self._generation
        deadline = (time.perf_counter() if start is None else start) + seconds

        def release():
            coarse = deadline - time.perf_counter() - RELEASE_SPIN_S
            if coarse > 0:
                time.sleep(coarse)
            while time.perf_counter() < deadline:
                time.sleep(0)  # yields the GIL to the thread that enqueues and synchronises
            if self._generation == gen:  # a later set_delay or rearm owns the word now
                hold.fill_(1)

        threading.Thread(target=release, name="streamring-held-delay", daemon=True).start()

    def delay(self, lib, stream, torch_stream=None) -> None:
        """Enqueue the delay on ``stream`` (a library stream ref; ``torch_stream`` the same stream as torch's): one
        thread spinning for :attr:`delay_ns`, or with :meth:`hold_with_host` a wait on the host word."""
        if self.hold is not None:
            from ..device.streams import stream_wait_geq

            st = torch_stream if torch_stream is not None else torch.cuda.current_stream(self._buf.dev)
            stream_wait_geq(st, int(self.hold.data_ptr()), 1)
            return
        DK.ep_delay(lib, stream, ns=int(self.delay_ns.data_ptr()))

    # -- the protocol mutation ----------------------------------------------------------------------
    def set_inject(self, mode: str) -> None:
        """Run the mutation ``mode`` on the streamed ring from the next forward (``none`` undoes it)."""
        if mode not in INJECT_BITS:
            raise ValueError(f"inject mode must be one of {list(INJECT_BITS)}, got {mode!r}")
        self.inject, self.inject_bits = mode, INJECT_BITS[mode]

    # -- the timeline -------------------------------------------------------------------------------
    def record_timeline(self) -> None:
        """Make every later forward record its per-chunk stamps. Allocates: before capturing a graph that
        should record them."""
        if self.stamps is None:
            rows = self._buf.pipeline.max_chunks + 1
            self.stamps = torch.zeros(rows * STAMP_STRIDE, dtype=torch.int64, device=self._buf.dev)

    def stamp(self, row: int, col: int) -> None:
        if self.stamps is not None and self.recording:
            K.stamp(self.stamps, row * STAMP_STRIDE + col)

    def timeline(self) -> dict:
        """Per-chunk device timestamps of the last stamped forward, in us. A chunk's ``acquired`` is its first
        dispatch step's, ``dispatched_acked`` and ``blocks_done`` its last step's, ``first_blocks_done`` (a chunk of
        several steps) the end of its first step's GEMM call; ``blocks_ready`` counts the blocks all its steps made
        ready; ``t0_ns`` is the forward's first stamp (``%globaltimer``, ns), the zero of the rest."""
        if self.stamps is None or self.stamp_path is None:
            raise ValueError("no timeline: call streamring.moe.debug.record_timeline(buffer) and run a forward")
        buf, p = self._buf, self.stamp_path
        st = self.stamps.view(-1, STAMP_STRIDE).cpu().numpy().astype(np.int64)
        t0 = int(st[p.num_chunks, 0])
        # first_blocks_done is written only where a chunk has several dispatch steps
        events = [ev for ev in CHUNK_EVENTS if p.steps > 1 or ev not in FIRST_STEP_EVENTS]
        chunks = [{ev: (int(st[c, CHUNK_EVENTS.index(ev)]) - t0) / 1e3 for ev in events} for c in range(p.num_chunks)]
        tail = {ev: (int(st[p.num_chunks, j]) - t0) / 1e3 for j, ev in enumerate(TAIL_EVENTS)}
        n = len(p.order)
        ready = buf.pipeline.experts.bc.ready_hi.cpu().tolist()[: n + 2]
        for c in range(p.num_chunks):
            chunks[c]["blocks_ready"] = sum(ready[i + 1] - ready[i] for i, (cc, _) in enumerate(p.order) if cc == c)
        grouped = buf.pipeline.plan.grouped
        # grouped ready steps: the seal's partial blocks are in the blocks of the step that sealed (no call of
        # its own, ready_hi[n + 1] unwritten)
        tail["seal_blocks"] = 0 if grouped else ready[n + 1] - ready[n]
        return {"chunks": chunks, "tail": tail, "t0_ns": t0, "policy": p.policy, "source_order": p.source_order,
                "chunk_tokens": p.chunk, "num_slots": p.num_slots, "block_m": buf.block_m, "rank": buf.me,
                "ranks": buf.R, "path": p.name, "grouped_steps": grouped}


class NoInstrument:
    """What the pipeline's parts call when no instrument is attached: nothing is enqueued."""

    inject = "none"
    inject_bits = 0
    recording = False

    def begin(self, path, stamps: bool) -> None:
        pass

    def end(self) -> None:
        pass

    def stamp(self, row: int, col: int) -> None:
        pass

    def delay(self, lib, stream, torch_stream=None) -> None:
        pass


NO_INSTRUMENT = NoInstrument()


def attach(buf) -> Instrument:
    """The instrument of ``buf`` (an :class:`~streamring.moe.ep_buffer.EPBuffer`), attached on first use."""
    if buf.instrument is None:
        if buf._graph_paths:
            warnings.warn("an instrument attached after EPBuffer.capture(): the graphs captured before carry none of "
                          "its kernels (producer delay, stamps, mutation); attach it before capturing", stacklevel=2)
        buf.instrument = Instrument(buf)
    return buf.instrument
