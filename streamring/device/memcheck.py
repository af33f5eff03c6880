"""Does a symmetric heap of a given size fit on this machine? Checked before anything is allocated.

One small, backend-neutral check used in two places: the command line's pre-launch
check (the ring bytes of the configured job, before any rank starts) and a heap's
``alloc`` (each region, against what is free at that moment). A capacity is one limit
the allocation draws from: a node-wide pool shared by the ranks on it (free ``/dev/shm``
and ``MemAvailable`` on CPUs, free memory of one GPU) or a per-rank reservation
(``NVSHMEM_SYMMETRIC_SIZE``). The CPU backend's shared windows live in ``/dev/shm`` (a
tmpfs, so they also take RAM); ``Win.Allocate`` takes RAM, and MPICH may back it with
shared memory too, so both limits apply to both window kinds.

GPU side (the NVSHMEM backend), for example::

    check_fits(nbytes, ranks_on_this_gpu, capacities=[
        Capacity("NVSHMEM_SYMMETRIC_SIZE", symmetric_size, per_rank=True, remedy="raise NVSHMEM_SYMMETRIC_SIZE"),
        Capacity("free GPU memory", free_bytes, remedy="free the GPU or run fewer PEs per GPU")])
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")


class HeapSizeError(ValueError):
    """A symmetric heap does not fit in what the machine has; the message gives the bytes and what to change."""


@dataclass(frozen=True)
class Capacity:
    """One limit an allocation must fit in.

    Attributes:
        name: what it is, as shown to the user ("free /dev/shm", "MemAvailable", ...).
        nbytes: bytes available now.
        per_rank: ``True`` when every rank has ``nbytes`` of its own (a reservation such as
            ``NVSHMEM_SYMMETRIC_SIZE``); ``False`` when the ranks sharing it draw from one pool.
        remedy: how to raise it, shown after the keys to change.
    """

    name: str
    nbytes: int
    per_rank: bool = False
    remedy: str = ""


def fmt_bytes(n: int) -> str:
    """``123456789`` -> ``'123,456,789 bytes (117.7 MiB)'``: exact bytes first, a readable size after."""
    size, unit = float(n), "bytes"
    for u in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            break
        size, unit = size / 1024, u
    return f"{n:,} bytes" + ("" if unit == "bytes" else f" ({size:.1f} {unit})")


def meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (``None`` where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def shm_free(path: Path = SHM_DIR) -> int | None:
    """Bytes an unprivileged process can still write to ``path`` (``None`` if it is not there)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def host_capacities() -> list[Capacity]:
    """The CPU backend's limits on this node now: free ``/dev/shm`` and ``MemAvailable``."""
    caps = []
    shm = shm_free()
    if shm is not None:
        caps.append(Capacity("free /dev/shm", shm, remedy="free space in /dev/shm or mount a larger one "
                                                          "(docker: --shm-size)"))
    avail = meminfo_available()
    if avail is not None:
        caps.append(Capacity("MemAvailable", avail, remedy="free memory on this node"))
    return caps


def check_fits(nbytes_per_rank: int, ranks_on_this_node: int, *, capacities: list[Capacity] | None = None,
               what: str = "the symmetric heap", keys: str = "") -> None:
    """Raise :class:`HeapSizeError` unless ``nbytes_per_rank`` fits every capacity.

    Args:
        nbytes_per_rank: symmetric bytes each rank allocates.
        ranks_on_this_node: ranks drawing from the shared capacities (the ranks on this node for
            host memory; the ranks on one GPU for GPU memory).
        capacities: the limits (default: :func:`host_capacities`, the CPU backend's).
        what: the allocation, for the message ("the ring of `streamring run`", "region 'ring'").
        keys: what the user can change to make it smaller (config keys), shown in the message.
    """
    if nbytes_per_rank < 0 or ranks_on_this_node < 1:
        raise ValueError(f"check_fits: nbytes_per_rank must be >= 0 and ranks_on_this_node >= 1, got "
                         f"{nbytes_per_rank} and {ranks_on_this_node}")
    caps = host_capacities() if capacities is None else capacities
    for cap in caps:
        need = nbytes_per_rank if cap.per_rank else nbytes_per_rank * ranks_on_this_node
        if need <= cap.nbytes:
            continue
        if cap.per_rank:
            amount = f"{fmt_bytes(nbytes_per_rank)} per rank"
        else:
            amount = (f"{fmt_bytes(nbytes_per_rank)} per rank x {ranks_on_this_node} "
                      f"rank{'s' if ranks_on_this_node != 1 else ''} = {fmt_bytes(need)}")
        fixes = [f for f in (f"lower one of {keys}" if keys else "", cap.remedy) if f]
        raise HeapSizeError(f"{what} needs {amount}, but {cap.name} is {fmt_bytes(cap.nbytes)}: "
                            + "; or ".join(fixes))
