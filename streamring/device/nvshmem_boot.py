"""Starting NVSHMEM for this process (``NvshmemHeap.bootstrap`` calls :func:`bootstrap`).

* ``mpi``: rank/size from mpi4py; PE 0 makes an NVSHMEM unique id and broadcasts it over
  ``MPI.COMM_WORLD`` (UID bootstrap; nvshmem's own MPI plugin is not used, so any MPI that
  mpi4py is bound to works);
* ``torchrun``: ``torch.distributed`` (gloo) from the environment; the id travels with
  ``broadcast_object_list``;
* ``local``: one PE, a fresh id.

One GPU per local rank (``local_rank % torch.cuda.device_count()``); several PEs on one GPU
work under MPS (docs/gpu.md). ``NVSHMEM_DISABLE_NVLS=1``, ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are always set before NVSHMEM starts: NVLink multicast
is never used. ``symmetric_size`` (bytes) sets ``NVSHMEM_SYMMETRIC_SIZE`` before ``nv.init``.
The cubin is built by local rank 0 (or taken from the cache) and loaded by every PE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: always exported before NVSHMEM / NCCL / torch symmetric memory start
SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
LAUNCHERS = ("local", "mpi", "torchrun")


def set_safe_env() -> None:
    """Export the multicast-off variables (always, overriding anything set before)."""
    for k, v in SAFE_ENV.items():
        os.environ[k] = v


@dataclass
class Started:
    """What :func:`bootstrap` started: hand it to ``NvshmemHeap``."""

    rank: int
    npes: int
    device_index: int
    nv: object  # the nvshmem.core module
    cubin: Path
    comm: object = None  # mpi4py communicator (launcher mpi)
    dist: object = None  # torch.distributed (launcher torchrun)
    owns_dist: bool = False


def gpu_unavailable_reason() -> str | None:
    """Why the NVSHMEM backend cannot start here (no CUDA GPU, no nvshmem4py), or None."""
    try:
        import torch
    except ImportError as exc:
        return f"the nvshmem backend needs torch with CUDA: {exc}"
    if not torch.cuda.is_available():
        return "the nvshmem backend needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)"
    try:
        import nvshmem.core  # noqa: F401
    except ImportError as exc:
        return ("the nvshmem backend needs nvshmem4py (`pip install nvshmem4py-cu13`; on the test machine install "
                f"the carried wheel, see docs/gpu.md): {exc}")
    return None


def bootstrap(launcher: str = "local", cubin: str | Path | None = None, symmetric_size: int | None = None) -> Started:
    """Start NVSHMEM for this process under ``launcher`` ('local' | 'mpi' | 'torchrun')."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} is not one of {list(LAUNCHERS)}")
    set_safe_env()
    if symmetric_size is not None:
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(int(symmetric_size))
    reason = gpu_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    import nvshmem.core as nv
    import torch
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
    else:
        rank, size, local_rank = 0, 1, 0

    ndev = torch.cuda.device_count()
    dev = local_rank % ndev
    torch.cuda.set_device(dev)
    device = Device(dev)
    device.set_current()
    cubin = Path(cubin) if cubin else _build_collectively(local_rank, comm, dist)

    uid = nv.get_unique_id(empty=(rank != 0))
    raw = np.asarray(uid._data).view(np.uint8)
    if comm is not None:
        comm.Bcast(raw, root=0)
    elif dist is not None:
        box = [raw.tobytes() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        raw[:] = np.frombuffer(box[0], dtype=np.uint8)
    nv.init(device=device, uid=uid, rank=rank, nranks=size, initializer_method="uid")
    return Started(rank=rank, npes=size, device_index=dev, nv=nv, cubin=cubin, comm=comm, dist=dist,
                   owns_dist=owns_dist)


def _build_collectively(local_rank: int, comm, dist) -> Path:
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
