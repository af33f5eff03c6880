"""NVSHMEM backend: the symmetric heap on GPU memory through nvshmem4py + our CUDA library.

Bootstrap (``NvshmemHeap.bootstrap(launcher, cfg)``):

* ``mpi``: rank/size from mpi4py; PE 0 makes an NVSHMEM unique id and broadcasts it
  over ``MPI.COMM_WORLD`` (UID bootstrap; nvshmem's own MPI plugin is not used, so
  any MPI that mpi4py is bound to works);
* ``torchrun``: ``torch.distributed`` (gloo) from the environment; the id travels
  with ``broadcast_object_list``;
* ``local``: one PE, a fresh id.

One GPU per local rank (``local_rank % torch.cuda.device_count()``); several PEs
on one GPU work under MPS (docs/gpu.md). ``NVSHMEM_DISABLE_NVLS=1``,
``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are always set
before NVSHMEM starts: NVLink multicast is never used.

Verbs. Every one-sided verb is one tiny kernel of ``csrc/ring.cu`` (nvshmem device
API) launched with cuda.core on this heap's stream, followed by a stream sync, so
each verb is complete (in the sense of verbs.py) when it returns:

* ``put``         -> host bytes -> pinned staging -> symmetric staging (same stream) ->
                     ``nvshmemx_putmem_block``. Not ordered with later ops without fence/quiet
                     (we are stricter: the kernel has finished).
* ``put_signal``  -> staging + ``nvshmemx_putmem_signal_block`` (payload, fence, signal).
* ``signal_op``   -> ``nvshmem_quiet`` + ``__threadfence_system`` + ``nvshmemx_signal_op``:
                     release (libnvshmem 3.4.5's device signal_op has no leading fence).
* ``signal_fetch``-> ``ld.acquire.sys`` of our own word (then the host reads it after the sync).
* atomics         -> quiet + fence + ``nvshmem_uint64_atomic_fetch_or/add`` (release). nvshmem4py's
                     host atomics (``nv.atomic_*``) are NOT used: they return wrong values silently.
* ``get``         -> ``nvshmemx_getmem_block`` into symmetric staging -> pinned -> host.
* ``fence``/``quiet`` -> ``nvshmem_fence``/``nvshmem_quiet`` kernels.
* ``barrier``     -> quiet, then a host barrier over MPI or torch.distributed (with deadline), quiet.

nvshmem4py's own RMA calls are avoided on the data path (they only accept pointers at
the start of an allocation). ``Region.local`` is a torch uint8 CUDA tensor viewing
this PE's copy (the protocol never touches it directly).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .verbs import Region, SignalOp, SymmetricHeap, VerbError, WaitTimeout, check_span, spin_pause

#: always exported before NVSHMEM / NCCL / torch symmetric memory start
SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
STAGE_BYTES = 4 << 20
ALLOC_ALIGN = 128

VERB_KERNELS = (
    "sr_put", "sr_get", "sr_put_signal", "sr_signal_op", "sr_signal_fetch", "sr_atomic_fetch_or",
    "sr_atomic_fetch_add", "sr_fence", "sr_quiet", "sr_peer_table", "sr_my_pe",
)
RING_KERNELS = (
    "ring_reuse_wait", "ring_drain", "ring_advance_epoch", "ring_spin_wait",
    "ring_publish_nv", "ring_produce_nv", "ring_consume_nv",
    "ring_publish_p2p", "ring_produce_p2p", "ring_consume_p2p", "ring_ack_nv", "ring_ack_p2p",
)
ALL_KERNELS = VERB_KERNELS + RING_KERNELS
_OPS = {SignalOp.SET: 0, SignalOp.ADD: 1}


def set_safe_env() -> None:
    """Export the multicast-off variables (always, overriding anything set before)."""
    for k, v in SAFE_ENV.items():
        os.environ[k] = v


class StreamRef:
    """A torch stream seen by cuda.core (``core``, a borrowed ``cuda.core.Stream``) and by
    nvshmem4py (``__cuda_stream__``). The torch stream must outlive this object."""

    def __init__(self, torch_stream):
        self.torch = torch_stream
        self.handle = int(torch_stream.cuda_stream)
        try:
            from cuda.core import Stream

            self.core = Stream.from_handle(self.handle)
        except Exception:  # noqa: BLE001 - older cuda.core: launch() takes the protocol object itself
            self.core = None

    def __cuda_stream__(self):
        return (0, self.handle)


class DeviceLibrary:
    """The cubin of ``csrc/ring.cu`` loaded with cuda.core and registered with NVSHMEM.

    Every kernel handle is fetched here; :meth:`NvshmemHeap.warm_up` launches each once so
    the module is loaded in the context before any wait is enqueued (loading synchronises).
    """

    def __init__(self, nv, cubin_path: str | Path):
        from cuda.core import LaunchConfig, ObjectCode, launch

        self.path = Path(cubin_path)
        self.obj = ObjectCode.from_cubin(self.path.read_bytes())
        self.kernels = {name: self.obj.get_kernel(name) for name in ALL_KERNELS}
        # A cuda.core ObjectCode is a CUlibrary: library_init, not module_init.
        self.nvobj = nv.NvshmemKernelObject.from_obj(self.obj)
        nv.library_init(self.nvobj)
        self._LaunchConfig = LaunchConfig
        self._launch = launch
        self._configs: dict = {}

    def launch(self, stream, name: str, grid: int, block: int, *args) -> None:
        cfg = self._configs.get((grid, block))
        if cfg is None:
            cfg = self._configs[(grid, block)] = self._LaunchConfig(grid=grid, block=block)
        core = getattr(stream, "core", None)
        self._launch(core if core is not None else stream, cfg, self.kernels[name], *args)


@dataclass
class _Handle:
    tensor: object  # torch uint8 CUDA tensor (nvshmem4py allocation)
    ptr: int  # symmetric address of this PE's copy


def _u64(v: int) -> np.uint64:
    return np.uint64(int(v) & 0xFFFFFFFFFFFFFFFF)


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
    def bootstrap(cls, launcher: str = "local", cfg=None, cubin: str | Path | None = None) -> "NvshmemHeap":
        """Start NVSHMEM for this process under ``launcher`` ('local' | 'mpi' | 'torchrun')."""
        set_safe_env()
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the nvshmem backend needs a CUDA GPU, and torch sees none "
                               "(torch.cuda.is_available() is False)")
        try:
            import nvshmem.core as nv
        except ImportError as exc:
            raise RuntimeError(
                "the nvshmem backend needs nvshmem4py (`pip install nvshmem4py-cu13`; on the test machine install "
                f"the carried wheel, see docs/gpu.md): {exc}") from exc
        from cuda.core import Device

        comm = dist = None
        owns_dist = False
        if launcher == "mpi":
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            rank, size = comm.Get_rank(), comm.Get_size()
            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
            local_rank = node.Get_rank()
            node.Free()
        elif launcher == "torchrun":
            import torch.distributed as td

            if not td.is_initialized():
                td.init_process_group(backend="gloo")
                owns_dist = True
            dist = td
            rank, size = td.get_rank(), td.get_world_size()
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        elif launcher == "local":
            rank, size, local_rank = 0, 1, 0
        else:
            raise ValueError(f"launcher {launcher!r} is not one of ['local', 'mpi', 'torchrun']")

        ndev = torch.cuda.device_count()
        dev = local_rank % ndev
        torch.cuda.set_device(dev)
        device = Device(dev)
        device.set_current()
        cubin = cubin or cls._build_collectively(rank, local_rank, comm, dist)

        uid = nv.get_unique_id(empty=(rank != 0))
        raw = np.asarray(uid._data).view(np.uint8)
        if comm is not None:
            comm.Bcast(raw, root=0)
        elif dist is not None:
            box = [raw.tobytes() if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            raw[:] = np.frombuffer(box[0], dtype=np.uint8)
        nv.init(device=device, uid=uid, rank=rank, nranks=size, initializer_method="uid")
        return cls(rank, size, dev, nv, cubin, comm=comm, dist=dist, owns_dist=owns_dist)

    @staticmethod
    def _build_collectively(rank: int, local_rank: int, comm, dist) -> Path:
        """Local rank 0 builds the cubin (or hits the cache), then the others load it."""
        from .build import BuildError, build_cubin

        err = None
        path = None
        if local_rank == 0:
            try:
                path = build_cubin()
            except BuildError as exc:
                err = str(exc)
        if comm is not None:
            errs = comm.allgather(err)
        elif dist is not None:
            errs = [None] * dist.get_world_size()
            dist.all_gather_object(errs, err)
        else:
            errs = [err]
        bad = [e for e in errs if e]
        if bad:
            raise BuildError(bad[0])
        return path if path is not None else build_cubin()

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
    def launch(self, name: str, grid: int, block: int, *args, stream=None) -> None:
        """Launch a kernel of our library on ``stream`` (a StreamRef / cuda.core stream; default ours)."""
        self.lib.launch(stream if stream is not None else self.sref, name, grid, block, *args)

    def sync(self) -> None:
        self.stream.synchronize()

    def _read_result(self, n: int = 1) -> np.ndarray:
        with self._torch.cuda.stream(self.stream):
            self._res_host[:n].copy_(self._res_dev[:n], non_blocking=True)
        self.sync()
        return self._res_np[:n].copy()

    def warm_up(self, stream=None) -> None:
        """Launch every kernel once, harmlessly, so each is loaded before any wait is enqueued."""
        torch = self._torch
        me = np.int32(self._rank)
        s = self._stage_ptr
        scratch = torch.zeros(64 + self._npes, dtype=torch.int64, device=self.device)
        sp = int(scratch.data_ptr())
        L = self.launch
        kw = {"stream": stream}
        L("sr_quiet", 1, 1, **kw)
        L("sr_fence", 1, 1, **kw)
        L("sr_signal_fetch", 1, 1, s, self._res_ptr, **kw)
        L("sr_put", 1, 128, s + 64, s, _u64(0), me, **kw)
        L("sr_get", 1, 128, s + 64, s, _u64(0), me, **kw)
        L("sr_put_signal", 1, 128, s + 64, s, _u64(0), s + 8, _u64(0), np.int32(0), me, **kw)
        L("sr_signal_op", 1, 1, s + 8, _u64(0), np.int32(0), me, **kw)
        L("sr_atomic_fetch_or", 1, 1, s + 8, _u64(0), me, self._res_ptr, **kw)
        L("sr_atomic_fetch_add", 1, 1, s + 8, _u64(0), me, self._res_ptr, **kw)
        L("sr_peer_table", 1, 32, s, sp + 64 * 8, np.int32(self._npes), **kw)
        L("sr_my_pe", 1, 1, sp, **kw)
        self.warm_up_ring(scratch, stream=stream)
        self.sync() if stream is None else stream.torch.synchronize()
        mine = scratch.cpu().numpy()[:1].view(np.int32)
        if stream is None and (int(mine[0]) != self._rank or int(mine[1]) != self._npes):
            raise RuntimeError(f"NVSHMEM says this is PE {int(mine[0])} of {int(mine[1])}, the launcher says "
                               f"{self._rank} of {self._npes}: the UID bootstrap mixed up ranks")

    def dummy_desc(self, scratch):
        """A RingDesc with num_chunks = 0 (ring kernels return at once) for warm-up launches."""
        from .ringdesc import DESC_INDEX, RING_DESC_WORDS

        fields = np.zeros(RING_DESC_WORDS, dtype=np.int64)
        sp = int(scratch.data_ptr())
        fields[DESC_INDEX["epoch"]] = sp + 8 * 32
        fields[DESC_INDEX["status"]] = sp + 8 * 40
        fields[DESC_INDEX["off_wake"]] = -1
        return self._torch.from_numpy(fields).to(self.device)

    def warm_up_ring(self, scratch, stream=None, kernels=RING_KERNELS, dummy=None) -> None:
        """Launch the ring kernels once on a dummy descriptor (they return at once) and sync.

        Only launches (no torch allocation), so it may run with a green context current.
        """
        if dummy is None:
            dummy = self.dummy_desc(scratch)
        dp = int(dummy.data_ptr())
        sp = int(scratch.data_ptr())
        z = np.int64(0)
        me = np.int32(self._rank)
        kw = {"stream": stream}
        for name in kernels:
            if name == "ring_reuse_wait":
                self.launch(name, 1, 1, dp, self._stage_ptr, me, z, np.int32(0), **kw)
            elif name == "ring_drain":
                self.launch(name, 1, 1, dp, self._stage_ptr, me, **kw)
            elif name == "ring_advance_epoch":
                self.launch(name, 1, 1, dp, **kw)
            elif name == "ring_spin_wait":
                self.launch(name, 1, 1, dp, self._stage_ptr, z, z, np.int32(0), **kw)
            elif name.startswith("ring_publish"):
                self.launch(name, 1, 1, dp, self._stage_ptr, sp, me, z, np.int32(0), **kw)
            elif name.startswith("ring_produce"):
                self.launch(name, 1, 128, dp, self._stage_ptr, sp, me, z, np.int32(0), np.int32(0), z, 0, **kw)
            elif name.startswith("ring_consume"):
                self.launch(name, 1, 128, dp, self._stage_ptr, sp, me, z, z, np.int32(0), z, 0, **kw)
            elif name.startswith("ring_ack"):
                self.launch(name, 1, 1, dp, self._stage_ptr, sp, me, z, z, **kw)
        (stream.torch if stream is not None else self.stream).synchronize()

    def peer_table(self, region: Region):
        """Device int64 tensor: ``[pe] -> pe's copy of region`` in our address space (0: not P2P)."""
        t = self._torch.zeros(self._npes, dtype=self._torch.int64, device=self.device)
        self.launch("sr_peer_table", 1, 32, region.handle.ptr, int(t.data_ptr()), np.int32(self._npes))
        self.sync()
        return t

    # -- allocation ---------------------------------------------------------------------------------
    def alloc(self, name: str, nbytes: int) -> Region:
        if nbytes <= 0:
            raise VerbError(f"alloc {name!r}: nbytes must be > 0, got {nbytes}")
        sizes = self.allgather_int(int(nbytes))
        if len(set(sizes)) != 1:
            raise VerbError(f"alloc {name!r}: ranks asked for different sizes {sizes} (must be symmetric)")
        n = (int(nbytes) + ALLOC_ALIGN - 1) // ALLOC_ALIGN * ALLOC_ALIGN
        t = self._nv.tensor((n,), dtype=self._torch.uint8)
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
                    self.launch("sr_quiet", 1, 1)  # earlier pieces complete before the signal
                self.launch("sr_put_signal", 1, 256, dst + pos, self._stage_ptr, _u64(k), sig, _u64(value),
                            np.int32(op), np.int32(pe))
            elif k:
                self.launch("sr_put", 1, 256, dst + pos, self._stage_ptr, _u64(k), np.int32(pe))
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
            self.launch("sr_get", 1, 256, self._stage_ptr, src + pos, _u64(k), np.int32(pe))
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
        self.launch("sr_signal_op", 1, 1, sig_region.handle.ptr + sig_offset, _u64(value), np.int32(code),
                    np.int32(pe))
        self.sync()

    def signal_fetch(self, sig_region: Region, sig_offset: int) -> int:
        check_span(sig_region, sig_offset, 8, "signal_fetch")
        if sig_offset % 8:
            raise VerbError(f"signal_fetch: offset {sig_offset} is not 8-byte aligned")
        self.launch("sr_signal_fetch", 1, 1, sig_region.handle.ptr + sig_offset, self._res_ptr)
        return int(self._read_result(1)[0])

    def _fetch_op(self, kernel: str, region: Region, offset: int, value: int, pe: int, what: str) -> int:
        check_span(region, offset, 8, what)
        self._check_pe(pe, what)
        if offset % 8:
            raise VerbError(f"{what}: offset {offset} is not 8-byte aligned")
        self.launch(kernel, 1, 1, region.handle.ptr + offset, _u64(value), np.int32(pe), self._res_ptr)
        return int(self._read_result(1)[0])

    def atomic_fetch_or(self, region, offset, value, pe) -> int:
        return self._fetch_op("sr_atomic_fetch_or", region, offset, value, pe, "atomic_fetch_or")

    def atomic_fetch_add(self, region, offset, value, pe) -> int:
        return self._fetch_op("sr_atomic_fetch_add", region, offset, value, pe, "atomic_fetch_add")

    # -- ordering -------------------------------------------------------------------------------------
    def fence(self) -> None:
        self.launch("sr_fence", 1, 1)
        self.sync()

    def quiet(self) -> None:
        self.launch("sr_quiet", 1, 1)
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
