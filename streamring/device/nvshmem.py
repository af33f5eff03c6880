"""NVSHMEM backend: the symmetric heap on GPU memory through nvshmem4py + our CUDA library.

Start it with :meth:`NvshmemHeap.bootstrap` (``streamring.device.nvshmem_boot``: launcher,
GPU choice, UID bootstrap, cubin build). The library's kernels are launched only through the
typed launchers of :mod:`streamring.device.kernels`.

Verbs. Every one-sided verb is one tiny kernel of ``csrc/verbs.cu`` (NVSHMEM device API)
launched on this heap's stream, followed by a stream sync, so each verb is complete (in the
sense of verbs.py) when it returns:

* ``put``         -> host bytes -> pinned staging -> symmetric staging (same stream) ->
                     ``nvshmemx_putmem_block``.
* ``put_signal``  -> staging + ``nvshmemx_putmem_signal_block`` (payload, fence, signal).
* ``signal_op``   -> ``nvshmem_quiet`` + ``__threadfence_system`` + ``nvshmemx_signal_op``:
                     release (libnvshmem 3.4.5's device signal_op has no leading fence).
* ``signal_fetch``-> ``ld.acquire.sys`` of our own word (then the host reads it after the sync).
* atomics         -> quiet + fence + ``nvshmem_uint64_atomic_fetch_or/add`` (release). nvshmem4py's
                     host atomics (``nv.atomic_*``) are NOT used: they return wrong values silently.
* ``get``         -> ``nvshmemx_getmem_block`` into symmetric staging -> pinned -> host.
* ``fence``/``quiet`` -> ``nvshmem_fence``/``nvshmem_quiet`` kernels.
* ``barrier``     -> quiet, then a host barrier over MPI or torch.distributed (with deadline), quiet.

nvshmem4py's own RMA calls are avoided on the data path (they only accept pointers at the
start of an allocation). ``Region.local`` is a torch uint8 CUDA tensor viewing this PE's copy
(the protocol never touches it directly).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import kernels as K
from .kernels import DeviceLibrary, StreamRef
from .nvshmem_boot import SAFE_ENV, set_safe_env  # noqa: F401  (re-exported)
from .verbs import Region, SignalOp, SymmetricHeap, VerbError, WaitTimeout, check_span, spin_pause

STAGE_BYTES = 4 << 20
ALLOC_ALIGN = 128
_OPS = {SignalOp.SET: 0, SignalOp.ADD: 1}


@dataclass
class _Handle:
    tensor: object  # torch uint8 CUDA tensor (nvshmem4py allocation)
    ptr: int  # symmetric address of this PE's copy


class NvshmemHeap(SymmetricHeap):
    """Symmetric heap on NVSHMEM. Create with :meth:`bootstrap`."""

    name = "nvshmem"

    def __init__(self, rank: int, npes: int, device_index: int, nv, cubin: str | Path, comm=None, dist=None,
                 owns_dist: bool = False, stage_bytes: int = STAGE_BYTES):
        import torch

        self._torch = torch
        self._nv = nv
        self._rank = rank
        self._npes = npes
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)
        self.comm = comm
        self.dist = dist
        self._owns_dist = owns_dist
        self._closed = False
        self._regions: list[Region] = []
        self.stream = torch.cuda.Stream(device=self.device)
        self.sref = StreamRef(self.stream)
        self.lib = DeviceLibrary(nv, cubin)
        self.stage_bytes = int(stage_bytes)
        # Symmetric staging (collective allocation): the source of puts, the target of gets.
        self._stage = nv.tensor((self.stage_bytes,), dtype=torch.uint8)
        self._stage_ptr = int(self._stage.data_ptr())
        self._hstage = torch.empty(self.stage_bytes, dtype=torch.uint8, pin_memory=True)
        self._hstage_np = self._hstage.numpy()
        self._res_dev = torch.zeros(64, dtype=torch.int64, device=self.device)
        self._res_ptr = int(self._res_dev.data_ptr())
        self._res_host = torch.zeros(64, dtype=torch.int64, pin_memory=True)
        self._res_np = self._res_host.numpy().view(np.uint64)
        self.warm_up()
        self.barrier()

    # -- bootstrap -----------------------------------------------------------------------------
    @classmethod
    def bootstrap(cls, launcher: str = "local", cubin: str | Path | None = None,
                  symmetric_size: int | None = None) -> "NvshmemHeap":
        """Start NVSHMEM for this process under ``launcher`` ('local' | 'mpi' | 'torchrun') and
        return its heap (see :mod:`streamring.device.nvshmem_boot`). ``symmetric_size`` (bytes)
        sets ``NVSHMEM_SYMMETRIC_SIZE``; None keeps the environment's (NVSHMEM's default 1 GiB)."""
        from .nvshmem_boot import bootstrap

        st = bootstrap(launcher, cubin=cubin, symmetric_size=symmetric_size)
        return cls(st.rank, st.npes, st.device_index, st.nv, st.cubin, comm=st.comm, dist=st.dist,
                   owns_dist=st.owns_dist)

    # -- identity ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_ranks(self) -> int:
        return self._npes

    def _check_pe(self, pe: int, what: str) -> None:
        if not 0 <= int(pe) < self._npes:
            raise VerbError(f"{what}: pe {pe} outside [0, {self._npes})")

    # -- device plumbing ------------------------------------------------------------------------
    def sync(self) -> None:
        self.stream.synchronize()

    def _read_result(self, n: int = 1) -> np.ndarray:
        with self._torch.cuda.stream(self.stream):
            self._res_host[:n].copy_(self._res_dev[:n], non_blocking=True)
        self.sync()
        return self._res_np[:n].copy()

    def dummy_desc(self, scratch):
        """A RingDesc with num_chunks = 0 (ring kernels return at once) for warm-up launches."""
        from .ringdesc import DESC_INDEX, RING_DESC_WORDS

        fields = np.zeros(RING_DESC_WORDS, dtype=np.int64)
        sp = int(scratch.data_ptr())
        fields[DESC_INDEX["epoch"]] = sp + 8 * 32
        fields[DESC_INDEX["status"]] = sp + 8 * 40
        fields[DESC_INDEX["off_wake"]] = -1
        return self._torch.from_numpy(fields).to(self.device)

    def warm_up(self, stream=None) -> None:
        """Launch every kernel of the library once, harmlessly, and sync: each is then loaded in
        this context before any wait is enqueued (a module load synchronises the context, and a
        wait enqueued before it can hang). Checks that NVSHMEM's PE numbering is the launcher's."""
        torch = self._torch
        # words: 0 my_pe, 32 dummy epoch, 40.. dummy status, 64.. peer table, then zeros for the warm-ups
        scratch = torch.zeros(128 + self._npes, dtype=torch.int64, device=self.device)
        sp = int(scratch.data_ptr())
        s, res, me = self._stage_ptr, self._res_ptr, self._rank
        st = stream if stream is not None else self.sref
        lib = self.lib
        K.sr_quiet(lib, st)
        K.sr_fence(lib, st)
        K.sr_signal_fetch(lib, st, sig=s, out=res)
        K.sr_put(lib, st, dst=s + 64, src=s, nbytes=0, pe=me)
        K.sr_get(lib, st, dst=s + 64, src=s, nbytes=0, pe=me)
        K.sr_put_signal(lib, st, dst=s + 64, src=s, nbytes=0, sig=s + 8, value=0, op=0, pe=me)
        K.sr_signal_op(lib, st, sig=s + 8, value=0, op=0, pe=me)
        K.sr_atomic_fetch_or(lib, st, dst=s + 8, value=0, pe=me, out=res)
        K.sr_atomic_fetch_add(lib, st, dst=s + 8, value=0, pe=me, out=res)
        K.sr_peer_table(lib, st, base=s, out=sp + 64 * 8, npes=self._npes)
        K.sr_my_pe(lib, st, out=sp)
        self.warm_up_ring(scratch, stream=st)
        mine = scratch.cpu().numpy()[:1].view(np.int32)
        if stream is None and (int(mine[0]) != self._rank or int(mine[1]) != self._npes):
            raise RuntimeError(f"NVSHMEM says this is PE {int(mine[0])} of {int(mine[1])}, the launcher says "
                               f"{self._rank} of {self._npes}: the UID bootstrap mixed up ranks")

    def warm_up_ring(self, scratch, stream=None, dummy=None) -> None:
        """Launch every ring and self-test kernel once on a dummy descriptor (they return at once)
        and sync. Only launches (no torch allocation), so it may run with a green context current."""
        if dummy is None:
            dummy = self.dummy_desc(scratch)
        d, b, sp, me = int(dummy.data_ptr()), self._stage_ptr, int(scratch.data_ptr()), self._rank
        st = stream if stream is not None else self.sref
        lib = self.lib
        for peers in (0, sp):  # both transports (NVSHMEM and P2P) of the kernels that have two
            K.ring_publish(lib, st, d=d, buf=b, peers=peers, me=me, chunk=0, kind=0, valid=0)
            K.ring_acquire_checked(lib, st, d=d, buf=b, peers=peers, me=me, src0=0, chunk=0, valid_tab=sp, inject=0,
                                   sources=1)
            K.ring_wait_any(lib, st, d=d, buf=b, peers=peers, me=me, chunk=0, valid_tab=sp, pending=sp + 8 * 60,
                            first=0, chosen=sp + 8 * 61, max_take=1, window_ns=0, inject=0)
            K.ring_ack_chosen(lib, st, d=d, buf=b, peers=peers, me=me, chosen=sp, count=1, chunk=0)
            K.ring_ack(lib, st, d=d, buf=b, peers=peers, me=me, src0=0, chunk=0, sources=1)
            K.ring_produce(lib, st, d=d, buf=b, peers=peers, me=me, chunk=0, kind=0, inject=0, delay_cycles=0,
                           t_pub=0, block=128)
            K.ring_consume(lib, st, d=d, buf=b, peers=peers, me=me, src0=0, chunk=0, inject=0, hold_cycles=0,
                           t_acq=0, sources=1, block=128)
        K.ring_reuse_wait(lib, st, d=d, buf=b, me=me, chunk=0, inject=0)
        K.ring_drain(lib, st, d=d, buf=b, me=me)
        K.ring_advance_epoch(lib, st, d=d)
        K.ring_spin_wait(lib, st, d=d, buf=b, src0=0, chunk=0, inject=0, sources=1)
        # the expert-parallel layer's kernels: an empty ready range (ready_hi[0] == ready_hi[1] == 0 in the
        # zeroed scratch) or num_chunks = 0 makes each return at once
        z = sp + 8 * (64 + self._npes)  # zero words after the peer table
        K.ep_signal_arrivals(lib, st, d=d, comb=b, comb_peers=0, me=me, off_arrived=0, ready_list=z, ready_hi=z,
                             lo_index=0, hi_index=1, row_src=z, row_chunk=z, block_m=16, max_items=1)
        K.ep_put_rows(lib, st, d=d, comb=b, comb_peers=0, me=me, off_arrived=0, off_rows=0, y_stage=z, hidden=128, ready_list=z,
                      ready_hi=z, lo_index=0, hi_index=1, row_src=z, row_tok=z, row_chunk=z, block_m=16, max_items=1)
        K.ep_pull_slots(lib, st, d=d, buf=b, mirror=z, mirror_stride=0, src_list=z, chunk=0, sources=1)
        K.ep_wait_arrivals(lib, st, d=d, comb=b, off_arrived=0, expected=z, first_chunk=0, num_chunks=0)
        K.ep_delay(lib, st, ns=z)
        K.ring_pingpong(lib, st, d=d, buf=b, peers=0, me=me, peer=me, initiator=0, together=0, nchunks=0,
                        out_ns=z)
        K.flag_pingpong(lib, st, my_flag=z, peer_flag=z, initiator=0, iters=0, base=0, deadline_cycles=0,
                        out_ns=z + 8 * 16)
        (st.torch if isinstance(st, StreamRef) else st).synchronize()

    def peer_table(self, region: Region):
        """Device int64 tensor: ``[pe] -> pe's copy of region`` in our address space (0: not P2P)."""
        t = self._torch.zeros(self._npes, dtype=self._torch.int64, device=self.device)
        K.sr_peer_table(self.lib, self.sref, base=region.handle.ptr, out=int(t.data_ptr()), npes=self._npes)
        self.sync()
        return t

    # -- allocation ---------------------------------------------------------------------------------
    def alloc(self, name: str, nbytes: int) -> Region:
        """Collective: a symmetric region of ``nbytes`` (zeroed) on every PE.

        Checked before anything is taken, on every PE, with one verdict for all: the size is the
        same everywhere, and it fits the GPU's free memory (``HeapSizeError`` naming the bytes);
        NVSHMEM refusing it (its symmetric heap, ``NVSHMEM_SYMMETRIC_SIZE``, is full) is raised as a
        ``HeapSizeError`` that names ``nvshmem.symmetric_size`` / ``NVSHMEM_SYMMETRIC_SIZE``."""
        from .memcheck import Capacity, HeapSizeError, check_fits

        if nbytes <= 0:
            raise VerbError(f"alloc {name!r}: nbytes must be > 0, got {nbytes}")
        n = (int(nbytes) + ALLOC_ALIGN - 1) // ALLOC_ALIGN * ALLOC_ALIGN
        try:
            free, _ = self._torch.cuda.mem_get_info(self.device)
            check_fits(n, 1, capacities=[Capacity("the free memory of this PE's GPU", int(free), per_rank=True,
                                                  remedy="free the GPU, or run fewer PEs on it")],
                       what=f"alloc {name!r} (symmetric heap region)")
            problem = ""
        except HeapSizeError as exc:
            problem = str(exc)
        shared = self.allgather_obj((int(nbytes), problem))
        sizes = [v for v, _ in shared]
        if len(set(sizes)) != 1:
            raise VerbError(f"alloc {name!r}: ranks asked for different sizes {sizes} (must be symmetric)")
        bad = [(r, msg) for r, (_, msg) in enumerate(shared) if msg]
        if bad:
            raise HeapSizeError(f"{bad[0][1]} (on PE {bad[0][0]})")
        try:
            t = self._nv.tensor((n,), dtype=self._torch.uint8)
        except Exception as exc:  # noqa: BLE001 - NVSHMEM's own refusal: say which knob sizes its heap
            raise HeapSizeError(
                f"alloc {name!r}: NVSHMEM could not allocate {n:,} symmetric bytes ({type(exc).__name__}: {exc}); "
                f"its symmetric heap per PE is NVSHMEM_SYMMETRIC_SIZE="
                f"{os.environ.get('NVSHMEM_SYMMETRIC_SIZE', 'unset (1 GiB)')}: raise nvshmem.symmetric_size in the "
                f"config (or NVSHMEM_SYMMETRIC_SIZE) before NVSHMEM starts") from exc
        with self._torch.cuda.stream(self.stream):
            t.zero_()
        self.sync()
        region = Region(name=name, nbytes=n, local=t, handle=_Handle(tensor=t, ptr=int(t.data_ptr())))
        self._regions.append(region)
        # Zero everywhere before anyone may signal into this region.
        self.barrier()
        return region

    def free(self, region: Region) -> None:
        self.barrier()
        self._nv.free_tensor(region.handle.tensor)
        if region in self._regions:
            self._regions.remove(region)

    # -- RMA ----------------------------------------------------------------------------------------
    @staticmethod
    def _bytes(data: np.ndarray) -> np.ndarray:
        arr = np.ascontiguousarray(data)
        return arr.reshape(-1).view(np.uint8)

    def _stage_in(self, raw: np.ndarray, pos: int, k: int) -> None:
        self._hstage_np[:k] = raw[pos:pos + k]
        with self._torch.cuda.stream(self.stream):
            self._stage[:k].copy_(self._hstage[:k], non_blocking=True)

    def _put_bytes(self, dst: int, raw: np.ndarray, pe: int, signal=None) -> None:
        n = raw.nbytes
        pos = 0
        while True:
            k = min(self.stage_bytes, n - pos)
            last = pos + k >= n
            if k:
                self._stage_in(raw, pos, k)
            if last and signal is not None:
                sig, value, op = signal
                if pos:
                    K.sr_quiet(self.lib, self.sref)  # earlier pieces complete before the signal
                K.sr_put_signal(self.lib, self.sref, dst=dst + pos, src=self._stage_ptr, nbytes=k, sig=sig,
                                value=value, op=op, pe=pe)
            elif k:
                K.sr_put(self.lib, self.sref, dst=dst + pos, src=self._stage_ptr, nbytes=k, pe=pe)
            self.sync()  # the staging buffers are reused by the next piece
            pos += k
            if last:
                return

    def put(self, region: Region, offset: int, data: np.ndarray, pe: int) -> None:
        raw = self._bytes(data)
        check_span(region, offset, raw.nbytes, "put")
        self._check_pe(pe, "put")
        if raw.nbytes:
            self._put_bytes(region.handle.ptr + offset, raw, pe)

    def get(self, region: Region, offset: int, out: np.ndarray, pe: int) -> np.ndarray:
        contiguous = out.flags.c_contiguous
        target = out if contiguous else np.empty_like(out, order="C")
        raw = target.reshape(-1).view(np.uint8)
        check_span(region, offset, raw.nbytes, "get")
        self._check_pe(pe, "get")
        src = region.handle.ptr + offset
        n, pos = raw.nbytes, 0
        while pos < n:
            k = min(self.stage_bytes, n - pos)
            K.sr_get(self.lib, self.sref, dst=self._stage_ptr, src=src + pos, nbytes=k, pe=pe)
            with self._torch.cuda.stream(self.stream):
                self._hstage[:k].copy_(self._stage[:k], non_blocking=True)
            self.sync()
            raw[pos:pos + k] = self._hstage_np[:k]
            pos += k
        if not contiguous:
            out[...] = target
        return out

    def _op(self, op: SignalOp) -> int:
        try:
            return _OPS[op]
        except KeyError:
            raise VerbError(f"signal op {op!r} is not one of {[o.value for o in SignalOp]}") from None

    def put_signal(self, region, offset, data, sig_region, sig_offset, value, op, pe) -> None:
        raw = self._bytes(data)
        check_span(region, offset, raw.nbytes, "put_signal")
        check_span(sig_region, sig_offset, 8, "put_signal signal")
        self._check_pe(pe, "put_signal")
        code = self._op(op)
        self._put_bytes(region.handle.ptr + offset, raw, pe, signal=(sig_region.handle.ptr + sig_offset, value, code))

    def signal_op(self, sig_region, sig_offset, value, op, pe) -> None:
        check_span(sig_region, sig_offset, 8, "signal_op")
        self._check_pe(pe, "signal_op")
        code = self._op(op)
        K.sr_signal_op(self.lib, self.sref, sig=sig_region.handle.ptr + sig_offset, value=value, op=code, pe=pe)
        self.sync()

    def signal_fetch(self, sig_region: Region, sig_offset: int) -> int:
        check_span(sig_region, sig_offset, 8, "signal_fetch")
        if sig_offset % 8:
            raise VerbError(f"signal_fetch: offset {sig_offset} is not 8-byte aligned")
        K.sr_signal_fetch(self.lib, self.sref, sig=sig_region.handle.ptr + sig_offset, out=self._res_ptr)
        return int(self._read_result(1)[0])

    def _fetch_op(self, kernel, region: Region, offset: int, value: int, pe: int, what: str) -> int:
        check_span(region, offset, 8, what)
        self._check_pe(pe, what)
        if offset % 8:
            raise VerbError(f"{what}: offset {offset} is not 8-byte aligned")
        kernel(self.lib, self.sref, dst=region.handle.ptr + offset, value=value, pe=pe, out=self._res_ptr)
        return int(self._read_result(1)[0])

    def atomic_fetch_or(self, region, offset, value, pe) -> int:
        return self._fetch_op(K.sr_atomic_fetch_or, region, offset, value, pe, "atomic_fetch_or")

    def atomic_fetch_add(self, region, offset, value, pe) -> int:
        return self._fetch_op(K.sr_atomic_fetch_add, region, offset, value, pe, "atomic_fetch_add")

    # -- ordering -------------------------------------------------------------------------------------
    def fence(self) -> None:
        K.sr_fence(self.lib, self.sref)
        self.sync()

    def quiet(self) -> None:
        K.sr_quiet(self.lib, self.sref)
        self.sync()

    def barrier(self, deadline: float | None = None) -> None:
        self.quiet()
        start = time.monotonic()
        if self.comm is not None:
            if deadline is None:
                self.comm.Barrier()
            else:
                req = self.comm.Ibarrier()
                while not req.Test():
                    if time.monotonic() > deadline:
                        raise WaitTimeout("barrier over all PEs (a PE is stalled or dead)", time.monotonic() - start)
                    spin_pause()
        elif self.dist is not None:
            work = self.dist.barrier(async_op=True)
            if deadline is None:
                work.wait()
            else:
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise WaitTimeout("barrier over all PEs (a PE is stalled or dead)", time.monotonic() - start)
                    spin_pause()
        self.quiet()

    # -- host collectives ---------------------------------------------------------------------------------
    def allgather_obj(self, obj) -> list:
        if self.comm is not None:
            return self.comm.allgather(obj)
        if self.dist is not None:
            out = [None] * self._npes
            self.dist.all_gather_object(out, obj)
            return out
        return [obj]

    def allgather_int(self, value: int) -> list[int]:
        return [int(v) for v in self.allgather_obj(int(value))]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sync()
            for r in list(self._regions):
                self.free(r)
            self.barrier()
            self._nv.free_tensor(self._stage)
            self._nv.finalize()
        finally:
            if self._owns_dist and self.dist is not None and self.dist.is_initialized():
                self.dist.destroy_process_group()
