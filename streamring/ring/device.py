"""The chunk-ready ring on a GPU: the protocol's device form, one typed method per ring kernel.

:class:`DeviceRing` owns one ring in NVSHMEM symmetric memory (laid out by
:class:`~streamring.ring.layout.RingLayout`, the same layout the host-verb ring uses), its device
descriptor (``RingDesc``: every offset and stride from ``RingLayout.descriptor()``, so the
CUDA side re-derives nothing), the device epoch word and the status words. Its methods enqueue
the ring kernels of ``streamring/device/csrc/ring_kernels.cu`` on a stream; they are the steps of
the protocol (``streamring.ring.protocol``, rules 1-8) done by the device:

====================  ======================================================================
``reuse_wait(c)``     owner: every ack of chunk ``c - S`` (acquire) before slot ``c % S`` is
                      rewritten; records ``consumed_gen`` and clears the mask (rules 3, 4)
``publish(c, kind)``  producer: release, then the route or layout generation of ``c`` at every
                      PE (rule 1); the payload was written by earlier kernels of the stream
``spin_wait(c)``      consumer: acquire both generations of ``c`` of every source, exact
                      (epoch, chunk) check, deadline (rules 2, 6)
``ack(c)``            consumer: release, then my bit in every source's mask (rule 3); the
                      reads of the slot were done by earlier kernels of the stream
``drain()``           owner, end of stream: the last acks of every slot (rule 8)
``advance_epoch()``   the next CUDA-graph replay is the next epoch (no ABA across replays)
====================  ======================================================================

The transport is chosen once per ring: ``"nv"`` (NVSHMEM device API; works for any peer) or
``"p2p"`` (plain loads/stores through peer pointers; needed in green contexts, where NVSHMEM's
device state does not exist, and only possible when every peer is load/store reachable).

Waits never hang: every device wait has a deadline (``deadline_s``) and records what it waited
for in the status words (:meth:`status`: source, chunk, seen and wanted generation). Imports of
torch / cuda.* are lazy: the module imports without a GPU.
"""

from __future__ import annotations

import time

import numpy as np

from ..device import kernels as K
from ..device.kernels import as_stream_ref
from ..device.ringdesc import (CLOCK_HZ, ERROR_CODES, RING_LAYOUT, RING_ROUTE, RS_WORDS, WB_KINDS, WB_WORDS,
                                decode_beacon, decode_status, describe_status, gen_text, mask_ranks, pack_desc)
from .layout import RingLayout, make_gen
from .protocol import DIAGNOSTIC_HOOKS, ProtocolViolation, WatchdogError

TRANSPORTS = ("nv", "p2p", "auto")


class DeviceRing:
    """A ring buffer in symmetric memory + its device descriptor, epoch and status words.

    Collective (allocates a region on every PE). Args:
        heap: a started :class:`~streamring.device.nvshmem.NvshmemHeap`.
        layout: the ring's layout (``layout.num_ranks`` must equal the heap's PEs).
        num_chunks: chunks per stream (the same on every PE; baked into the descriptor).
        transport: ``"nv"``, ``"p2p"`` or ``"auto"`` (P2P when every PE is load/store reachable,
            else NVSHMEM; see the module doc). The choice is in :attr:`transport`.
        wake: also ring the doorbell words of the ``stream_wait`` progress policy.
        deadline_s: every device wait gives up after this long and records a timeout.
        timestamps: keep per-chunk publish/acquire ``%globaltimer`` stamps (latency benchmark).
    """

    def __init__(self, heap, layout: RingLayout, num_chunks: int, *, transport: str = "nv", wake: bool = False,
                 deadline_s: float = 10.0, timestamps: bool = False, name: str = "gpu-ring"):
        import torch

        if layout.num_ranks != heap.num_ranks:
            raise ValueError(f"layout.num_ranks={layout.num_ranks} but the heap has {heap.num_ranks} PEs")
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.heap = heap
        self.lib = heap.lib
        self.layout = layout
        self.num_chunks = int(num_chunks)
        self.me = heap.rank
        R = layout.num_ranks
        # the doorbell words are a region of the one RingLayout; -1 tells the kernels not to ring them
        self.off_wake = layout.offsets["wake"] if wake else -1
        self.region = heap.alloc(name, layout.nbytes)
        self.buf = self.region.handle.ptr
        dev = heap.device
        self.epoch_t = torch.zeros(1, dtype=torch.int64, device=dev)
        self.status_t = torch.zeros(RS_WORDS, dtype=torch.int64, device=dev)
        # pinned host memory: the device writes it through its UVA mapping (cudaHostAlloc memory is
        # device-accessible at the same address), and the host can read it after a device fault
        self.wait_beacon_t = torch.zeros(WB_WORDS, dtype=torch.int64, pin_memory=torch.device(dev).type == "cuda")
        self.deadline_cycles = int(deadline_s * CLOCK_HZ)
        desc = pack_desc(layout, epoch_ptr=self.epoch_t.data_ptr(), num_chunks=self.num_chunks,
                         status_ptr=self.status_t.data_ptr(), deadline_cycles=self.deadline_cycles,
                         off_wake=self.off_wake, wait_beacon_ptr=self.wait_beacon_t.data_ptr())
        self.desc_t = torch.from_numpy(desc).to(dev)
        self.desc = int(self.desc_t.data_ptr())
        self.peers_t = heap.peer_table(self.region)
        self.p2p_ok = bool((self.peers_t != 0).all().item())
        if transport == "auto":
            transport = "p2p" if self.p2p_ok else "nv"
        if transport == "p2p" and not self.p2p_ok:
            raise RuntimeError("transport 'p2p' needs load/store access to every PE's ring (nvshmem_ptr was NULL "
                               "for some PE: another node?); use transport 'nv'")
        self.transport = transport
        # what the kernels receive as `peers`: the table (P2P) or nullptr (NVSHMEM device API)
        self.peers = int(self.peers_t.data_ptr()) if transport == "p2p" else 0
        if timestamps:
            self.t_pub_t = torch.zeros(self.num_chunks, dtype=torch.int64, device=dev)
            self.t_acq_t = torch.zeros(R * self.num_chunks, dtype=torch.int64, device=dev)
            self.t_pub, self.t_acq = int(self.t_pub_t.data_ptr()), int(self.t_acq_t.data_ptr())
        else:
            self.t_pub = self.t_acq = 0
        self.deadline_s = float(deadline_s)
        self._poll = None  # (side stream, pinned words): status_now()'s copy, made at its first use
        self._refs: dict = {}
        heap.sync()

    # -- streams ---------------------------------------------------------------------------------
    def stream_ref(self, stream):
        """A cached :class:`~streamring.device.kernels.StreamRef` of a torch stream (or the StreamRef
        itself), for launching kernels of the library on that stream (``None``: the heap's library
        has no streams, e.g. a CPU emulation, and runs kernels in call order)."""
        if stream is None:
            return None
        key = stream.handle if hasattr(stream, "handle") and hasattr(stream, "core") else int(stream.cuda_stream)
        ref = self._refs.get(key)
        if ref is None:
            ref = self._refs[key] = as_stream_ref(stream)
        return ref

    def _sources(self, sources):
        return self.layout.num_ranks if sources is None else int(sources)

    # -- the ring kernels, one method each ----------------------------------------------------------
    def reuse_wait(self, stream, chunk: int, inject: int = 0) -> None:
        """Owner: enqueue the reuse wait of my slot before writing ``chunk`` (no-op below S)."""
        K.ring_reuse_wait(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, me=self.me, chunk=chunk,
                          inject=inject)

    def publish(self, stream, chunk: int, kind: int, valid) -> None:
        """Producer: enqueue the metadata words of my slot (``valid`` tokens of ``chunk``) and the
        release of my ``kind`` (RING_ROUTE/RING_LAYOUT) generation of ``chunk`` at every PE.

        ``valid`` is an int in ``[0, tokens_per_slot]`` or a one-element int64 tensor on the ring's device
        (read by the kernel when it runs: a count that changes between replays of a captured graph;
        the producer keeps it in range, consumers check it, see ``check_meta`` in ring_kernels.cu)."""
        if kind not in (RING_ROUTE, RING_LAYOUT):
            raise ValueError(f"kind must be RING_ROUTE ({RING_ROUTE}) or RING_LAYOUT ({RING_LAYOUT}), got {kind}")
        if isinstance(valid, int):
            if not 0 <= valid <= self.layout.tokens_per_slot:
                raise ValueError(f"valid must be in [0, tokens_per_slot={self.layout.tokens_per_slot}], got {valid}")
            count, ptr = valid, 0
        else:
            if valid.dtype != self.heap._torch.int64 or valid.numel() != 1 or valid.device != self.epoch_t.device:
                raise ValueError(f"valid must be an int or a one-element int64 tensor on {self.epoch_t.device}, got "
                                 f"{valid.dtype} {list(valid.shape)} on {valid.device}")
            count, ptr = 0, int(valid.data_ptr())
        K.ring_publish(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, peers=self.peers, me=self.me,
                       chunk=chunk, kind=kind, valid=count, valid_ptr=ptr)

    def acquire_checked(self, stream, chunk: int, valid_tab, inject: int = 0, src0: int = 0,
                        sources: int | None = None) -> None:
        """Consumer: enqueue the acquire of ``chunk`` of sources ``src0 ..`` and the check of their
        metadata words; each source's valid token count goes to ``valid_tab[chunk, src]`` (device
        int32 ``[num_chunks, num_ranks]``; 0 where a word was wrong, recorded in :meth:`status`)."""
        K.ring_acquire_checked(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, peers=self.peers, me=self.me,
                               src0=src0, chunk=chunk, valid_tab=int(valid_tab.data_ptr()), inject=inject,
                               sources=self._sources(sources))

    def spin_wait(self, stream, chunk: int, inject: int = 0, src0: int = 0, sources: int | None = None) -> None:
        """Consumer: enqueue the acquire of both generations of ``chunk`` of sources ``src0 ..``."""
        K.ring_spin_wait(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, src0=src0, chunk=chunk,
                         inject=inject, sources=self._sources(sources))

    def wait_any(self, stream, chunk: int, valid_tab, pending, first: bool, chosen, inject: int = 0,
                 max_take: int = 1, window_ns: int = 0) -> None:
        """Consumer, ready order: enqueue the acquire (and metadata check) of whichever source of
        ``chunk`` still in the device bitmask ``pending`` (uint64) is ready first, then (``max_take`` > 1)
        of the pending sources ready within ``window_ns`` of it, up to ``max_take``; their indices go to
        the device int32 ``chosen[0:max_take]`` (-1 past the last; all -1, with no wait, when nothing is
        pending). ``first`` resets ``pending`` to every source."""
        if self.layout.num_ranks > 64:
            raise ValueError(f"ready order supports up to 64 PEs, the ring has {self.layout.num_ranks}")
        if not 1 <= max_take <= chosen.numel():
            raise ValueError(f"max_take must be in [1, {chosen.numel()}] (the places of chosen), got {max_take}")
        K.ring_wait_any(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, peers=self.peers, me=self.me,
                        chunk=chunk, valid_tab=int(valid_tab.data_ptr()), pending=int(pending.data_ptr()),
                        first=int(first), chosen=int(chosen.data_ptr()), max_take=max_take,
                        window_ns=int(window_ns), inject=inject)

    def ack_chosen(self, stream, chunk: int, chosen) -> None:
        """Consumer, ready order: enqueue the acknowledgement of ``chunk`` of the sources in the device int32
        ``chosen`` (every place; -1 places are skipped)."""
        K.ring_ack_chosen(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, peers=self.peers, me=self.me,
                          chosen=int(chosen.data_ptr()), count=chosen.numel(), chunk=chunk)

    def ack(self, stream, chunk: int, src0: int = 0, sources: int | None = None) -> None:
        """Consumer: enqueue the acknowledgement of ``chunk`` of sources ``src0 ..`` (after their reads)."""
        K.ring_ack(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, peers=self.peers, me=self.me,
                   src0=src0, chunk=chunk, sources=self._sources(sources))

    def drain(self, stream) -> None:
        """Owner: enqueue the end-of-stream drain (every slot's last acks; masks left zero)."""
        K.ring_drain(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, me=self.me)

    def advance_epoch(self, stream) -> None:
        """Enqueue the device epoch increment (last in a captured forward)."""
        K.ring_advance_epoch(self.lib, self.stream_ref(stream), d=self.desc)

    def produce(self, stream, chunk: int, kind: int, inject: int = 0, delay_cycles: int = 0, block: int = 256):
        """Self-test producer: fill my slot's ``kind`` payload of ``chunk`` with the pattern, publish."""
        K.ring_produce(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, peers=self.peers, me=self.me,
                       chunk=chunk, kind=kind, inject=inject, delay_cycles=delay_cycles, t_pub=self.t_pub,
                       block=block)

    def consume(self, stream, chunk: int, inject: int = 0, hold_cycles: int = 0, src0: int = 0,
                sources: int | None = None, block: int = 256) -> None:
        """Self-test consumer: acquire, check the pattern and ack ``chunk`` of sources ``src0 ..``."""
        K.ring_consume(self.lib, self.stream_ref(stream), d=self.desc, buf=self.buf, peers=self.peers, me=self.me,
                       src0=src0, chunk=chunk, inject=inject, hold_cycles=hold_cycles, t_acq=self.t_acq,
                       sources=self._sources(sources), block=block)

    def wait_doorbells(self, torch_stream, chunk: int, src0: int = 0, sources: int | None = None) -> None:
        """Progress policy ``stream_wait``: block ``torch_stream`` (no SM held) until every source's
        route and layout doorbells of ``chunk``'s slot show its lap. Needs ``wake=True``. The exact
        generation check still follows (:meth:`spin_wait`, which then finds them ready)."""
        from ..device.streams import stream_wait_geq

        if self.off_wake < 0:
            raise RuntimeError("wait_doorbells needs a ring made with wake=True")
        S = self.layout.num_slots
        lap = chunk // S + 1
        for src in range(src0, src0 + self._sources(sources)):
            for kind in (RING_ROUTE, RING_LAYOUT):
                stream_wait_geq(torch_stream, self.wake_addr(kind, src, chunk % S), lap)

    # -- typed views of this PE's copy ------------------------------------------------------------
    def slot_views(self, slot: int) -> dict:
        """Typed tensor views of my copy of ``slot``, laid out by the ring's :class:`RingLayout`:
        ``x`` float8_e4m3fn ``[C, hidden]``, ``x_sf`` float32 ``[C, hidden/128]``, ``topk_idx`` int64
        ``[C, topk]`` and ``topk_weights`` float32 ``[C, topk]`` (C = tokens per slot)."""
        torch = self.heap._torch
        L, u8 = self.layout, self.region.local
        C, H, Kk = L.tokens_per_slot, L.hidden, L.topk

        def view(off, nbytes, dtype, shape):
            return u8[off: off + nbytes].view(dtype).view(*shape)

        return {"x": view(L.x_off(slot), C * H, torch.float8_e4m3fn, (C, H)),
                "x_sf": view(L.x_sf_off(slot), C * L.sf_cols * 4, torch.float32, (C, L.sf_cols)),
                "topk_idx": view(L.topk_idx_off(slot), C * Kk * 8, torch.int64, (C, Kk)),
                "topk_weights": view(L.topk_weights_off(slot), C * Kk * 4, torch.float32, (C, Kk))}

    def read_distances(self, mirror=None):
        """Where the data kernels read each source's copy of the ring: int64 tensors ``(bytes,
        float32 elements, int64 elements)`` ``[num_ranks]`` from my copy's base. Without ``mirror``,
        the P2P peer mappings (0 for myself); with ``mirror`` (uint8 ``[num_ranks, ring bytes]``, a
        local copy per source filled by NVSHMEM gets), the rows of the mirror."""
        torch = self.heap._torch
        if mirror is None:
            delta = self.peers_t - self.buf
        else:
            rows = torch.arange(self.layout.num_ranks, dtype=torch.int64, device=self.peers_t.device)
            delta = rows * mirror.stride(0) + (int(mirror.data_ptr()) - self.buf)
        return delta.contiguous(), (delta // 4).contiguous(), (delta // 8).contiguous()

    # -- host side ---------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Set the device epoch word (before the first forward; later forwards advance it)."""
        self.epoch_t.fill_(int(epoch))
        if self.epoch_t.is_cuda:
            self.heap._torch.cuda.synchronize(self.heap.device)

    def epoch(self) -> int:
        return int(self.epoch_t.item())

    def status(self) -> dict:
        """The device status words: violations, timeouts, aborted, consumed, published, first error."""
        return decode_status(self.status_t.cpu().tolist())

    def status_now(self) -> dict:
        """The status words as they are now, while kernels of a forward may still run: copied on a
        side stream of its own into pinned memory (:meth:`status` would wait behind the forward)."""
        torch = self.heap._torch
        if self._poll is None:
            self._poll = (torch.cuda.Stream(device=self.heap.device),
                          torch.zeros(RS_WORDS, dtype=torch.int64, pin_memory=True))
        stream, host = self._poll
        with torch.cuda.stream(stream):
            host.copy_(self.status_t, non_blocking=True)
        stream.synchronize()
        return decode_status(host.tolist())

    def wait_forward(self, done, host_deadline_s: float) -> tuple[bool, dict]:
        """Wait for the CUDA event ``done`` (recorded after a forward) without blocking in the driver.

        Every device wait of the ring ends at its deadline and records where it waited, and after the
        first timeout every later wait gives up at once, so a forward whose peer died or stopped still
        ends within about ``deadline_s``. ``host_deadline_s`` bounds what has no device deadline (a
        ``cuStreamWaitValue64`` of the stream_wait policy, a kernel that never ends). Returns
        ``(finished, status)``: :meth:`status` when the forward finished, else :meth:`status_now`.
        """
        t0 = time.monotonic()
        end = t0 + host_deadline_s
        pause = 50e-6
        try:
            while not done.query():
                if time.monotonic() > end:
                    return False, self.status_now()
                time.sleep(pause)
                pause = min(pause * 2, 0.01)  # quick for a short forward, a light poll for a long wait
        except RuntimeError as exc:  # torch.AcceleratorError: the context is lost, status_t with it
            # blamed on a peer only with evidence of one: a device wait still pending on it (the beacon), or
            # the host's diagnostics naming a dead or stopped peer; any other fault stays what it is
            if self.slow_waits() or any(hook() for hook in DIAGNOSTIC_HOOKS):
                raise WatchdogError(self.describe_fault(exc, time.monotonic() - t0)) from exc
            raise
        return True, self.status()

    def slow_waits(self) -> dict:
        """``{kind: wait}`` of the device waits that went slow in the last forward (:func:`decode_beacon`).
        Read from pinned host memory: it works after the device faulted. :meth:`clear_wait_beacon` first."""
        return decode_beacon(self.wait_beacon_t.tolist())

    def clear_wait_beacon(self) -> None:
        """Zero the wait beacon (host memory; call it while no forward of this ring runs)."""
        self.wait_beacon_t.zero_()

    def describe_fault(self, exc: BaseException, elapsed_s: float | None = None) -> str:
        """The message of a forward whose device context failed (``exc``: the CUDA error): what the device
        waits that went slow waited for (the wait beacon; a source's chunk first), why a peer's death can
        end this PE's context, and the host's diagnostics (dead or stopped peers, under the local launcher)."""
        cuda = (str(exc).splitlines() or ["?"])[0]
        waits = self.slow_waits()
        why = ("the likely cause: a peer's process died, taking its memory with it, and this PE's next access "
               "to that memory faulted (under MPS a dead client's heap is unmapped at once)")
        said = []
        for kind in WB_KINDS:  # a source's chunk first: what a dead peer is named by
            w = waits.get(kind)
            if w is None:
                continue
            slot = f", slot {w['chunk'] % self.layout.num_slots}"
            if kind == "acquire":
                said.append(f"route+layout generation {gen_text(w['want'])} of source rank {w['src']} "
                            f"(chunk {w['chunk']}{slot})")
            elif kind == "acquire_any":
                said.append(f"chunk {w['chunk']} of any of the source ranks {mask_ranks(w['want'])} (ready source "
                            f"order)")
            elif kind == "ack":
                step = "the reuse of my slot" if w["code"] == ERROR_CODES["RE_REUSE_TIMEOUT"] else "the drain"
                ranks = [64 * w["src"] + r for r in mask_ranks(w["want"])]
                said.append(f"the acknowledgements of my chunk {w['chunk']}{slot} from ranks {ranks} ({step})")
            else:
                said.append(f"the result rows of my chunk {w['chunk']} ({w['want']} expected)")
        if said:
            line = (f"rank {self.me}: watchdog: the device waited for {said[0]}, then its context failed ({cuda}): "
                    f"{why}" + (f"; it also waited for {'; '.join(said[1:])}" if said[1:] else ""))
        else:
            line = (f"rank {self.me}: watchdog: the device failed during the forward ({cuda}) before any of its "
                    f"waits went slow: {why}")
        if elapsed_s is not None:
            line += f"; noticed {elapsed_s:.2f}s after the forward's launch"
        extra = [text for text in (hook() for hook in DIAGNOSTIC_HOOKS) if text]
        return "\n".join([line, "device status: lost with the context; this process cannot use the GPU again",
                          *extra])

    def check(self, st: dict, *, finished: bool = True, host_deadline_s: float | None = None,
              elapsed_s: float | None = None) -> None:
        """Raise when ``st`` (:meth:`status`, optionally with ``bad_routes``) holds an error, or when the
        forward did not finish (``finished=False``): a :class:`~streamring.ring.protocol.WatchdogError` for
        timeouts and unfinished forwards, a :class:`~streamring.ring.protocol.ProtocolViolation` for the rest.
        The first line names what the device waited for or refused (source rank, chunk, generation:
        :func:`~streamring.device.ringdesc.describe_status`); the host's diagnostics follow (which peer
        processes are dead or stopped, under the local launcher); ``elapsed_s``, the host's time from the
        forward's launch to this check, ends the first line."""
        line = describe_status(st, pe=self.me, num_slots=self.layout.num_slots, deadline_s=self.deadline_s)
        if finished and not line:
            return
        if not finished:
            line = (f"rank {self.me}: watchdog: the forward did not finish within {host_deadline_s:g}s (the host's "
                    f"deadline; every device wait has wait_timeout_s={self.deadline_s:g}): something without a "
                    f"device deadline is stuck (a cuStreamWaitValue64 of the stream_wait policy, or a kernel); "
                    + (line.split(": ", 1)[1] if line else f"device status {st}"))
        if elapsed_s is not None:
            line += f"; noticed {elapsed_s:.2f}s after the forward's launch"
        extra = [text for text in (hook() for hook in DIAGNOSTIC_HOOKS) if text]
        message = "\n".join([line, f"device status: {st}", *extra])
        if not finished or st.get("timeouts"):
            raise WatchdogError(message)
        raise ProtocolViolation(message)

    def wake_addr(self, kind: int, src: int, slot: int) -> int:
        L = self.layout
        return self.buf + self.off_wake + ((kind * L.num_ranks + src) * L.num_slots + slot) * 8

    def words(self, off: int, count: int) -> np.ndarray:
        """This PE's copy of ``count`` uint64 words at byte offset ``off`` (device -> host)."""
        t = self.region.local[off: off + 8 * count].cpu().numpy()
        return t.view(np.uint64)

    def check_quiescent(self, last_epoch: int) -> list[str]:
        """After a drained stream: my ack masks are 0 and consumed_gen[me][s] = the last chunk of each slot."""
        L, me, n = self.layout, self.me, self.num_chunks
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
        """Free the ring's symmetric region (collective)."""
        self.heap.free(self.region)
