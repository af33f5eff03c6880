"""Probes run on the simulated hosts by tests/ranks/test_multihost.py (``mpiexec ... python this.py MODE``).

* ``identify``: rank 0 prints one JSON list with, for every rank, its rank, hostname,
  MPI processor name, the size of its ``COMM_TYPE_SHARED`` communicator, whether the
  CPU backend picked shared windows, and its network interfaces with their IPv4 addresses.
* ``traffic MBYTES``: every rank puts MBYTES MB (``Win.Allocate`` window, ``Put`` +
  ``Flush`` in 256 KB pieces) into the rank with the same local index on the next
  host, then checks what it received; rank 0 prints ``PROBE OK``.
"""

import fcntl
import json
import socket
import struct
import sys

import numpy as np
from mpi4py import MPI

from streamring.device.cpu import MpiHeap


def _ipv4(ifname: str) -> str:
    """The interface's IPv4 address ('' if none), via SIOCGIFADDR (no tools needed)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(raw[20:24])
    except OSError:
        return ""
    finally:
        s.close()


def identify() -> None:
    comm = MPI.COMM_WORLD
    heap = MpiHeap()
    mine = {
        "rank": comm.Get_rank(), "hostname": socket.gethostname(), "processor": MPI.Get_processor_name(),
        "node_size": comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size(), "shared_windows": heap.shared,
        "interfaces": {name: _ipv4(name) for _, name in socket.if_nameindex()},
    }
    every = comm.gather(mine)
    if comm.Get_rank() == 0:
        print(json.dumps(every), flush=True)
    heap.close()


def traffic(mbytes: float) -> None:
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    names = sorted(set(hosts))
    mine = [r for r in range(n) if hosts[r] == hosts[me]]
    other = [r for r in range(n) if hosts[r] == names[(names.index(hosts[me]) + 1) % len(names)]]
    dest = other[mine.index(me) % len(other)]
    nbytes = int(mbytes * 1e6) // 8 * 8
    win = MPI.Win.Allocate(nbytes, 1, comm=comm)
    mem = np.frombuffer(win.tomemory(), dtype=np.uint8, count=nbytes)
    mem[:] = 0
    comm.Barrier()
    data = ((np.arange(nbytes, dtype=np.uint64) * 7 + me) % 251).astype(np.uint8)
    win.Lock_all(MPI.MODE_NOCHECK)
    piece = 1 << 18
    for off in range(0, nbytes, piece):  # bounded: nbytes / 256 KB puts
        m = min(piece, nbytes - off)
        win.Put([data[off:off + m], MPI.BYTE], dest, target=(off, m, MPI.BYTE))
        win.Flush(dest)
    win.Unlock_all()
    comm.Barrier()
    src = comm.allgather(dest).index(me)
    expect = ((np.arange(nbytes, dtype=np.uint64) * 7 + src) % 251).astype(np.uint8)
    assert np.array_equal(mem, expect), f"rank {me}: data from rank {src} differs"
    win.Free()
    if me == 0:
        print("PROBE OK", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "identify":
        identify()
    elif mode == "traffic":
        traffic(float(sys.argv[2]))
    else:
        raise SystemExit(f"unknown probe {mode!r}: identify | traffic MBYTES")
