"""CPU backend: the symmetric heap on MPI-3 RMA windows (mpi4py + MPICH wheel).

Mapping of the verbs (OSHMPI-style, see ``verbs.py`` for the contract):

* one window per region, one ``Lock_all(MODE_NOCHECK)`` epoch for its life;
* ``Win.Allocate_shared`` on the node communicator when every rank shares a
  node (``window="shared"``), ``Win.Allocate`` otherwise (``"separate"``);
* ``put``            -> ``Put``
* ``put_signal``     -> ``Put``; ``Flush(pe)``; ``Accumulate(REPLACE|SUM)``; ``Flush(pe)``.
  MPI does not order a Put before a later Accumulate to the same target:
  the Flush between them is what makes "payload before signal" true.
* ``signal_op``      -> ``Win.Sync`` (orders our own earlier local stores
  into the window) + ``Flush_all`` (completes our earlier puts) then
  ``Accumulate`` + ``Flush(pe)``: release semantics.
* ``signal_fetch``   -> shared: ``Win.Sync`` + plain load (a memory barrier in
  the unified model, then an aligned 8-byte load, which is atomic on the CPUs
  we run on); separate: ``Fetch_and_op(NO_OP)`` + ``Flush(self)`` (a plain
  load would never let MPICH make progress, see the notes on ``Win.Create``).
  Either is followed by ``Win.Sync`` so later payload loads are not hoisted
  above it (acquire).
* atomics            -> ``Fetch_and_op(BOR|SUM)`` + ``Flush(pe)``; one op kind per word.
* ``get``            -> shared: ``Win.Sync`` + copy out of the peer's segment;
  separate: ``Get`` + ``Flush(pe)``.
* ``fence``/``quiet`` -> ``Win.Sync`` + ``Flush_all`` on every window.

Across nodes (``Win.Allocate`` over UCX or libfabric on TCP, no RDMA) a
``Flush`` completes only when the target process polls MPI: a stopped peer
blocks it inside MPI, where no deadline of ours can act. Every flush records
what it waits for (:meth:`MpiHeap.blocked_call`, read by the host layer's
watchdog thread), and an MPI error of an RMA call (the transport saw the
peer's connection reset) becomes a :class:`PeerUnreachable` naming the peer
and its host.

Every offset is bounds-checked here: shared windows have none of their own.
"""

from __future__ import annotations

import time

import numpy as np

from .memcheck import HeapSizeError, check_fits
from .verbs import (
    PeerUnreachable,
    Region,
    SignalOp,
    SymmetricHeap,
    VerbError,
    WaitTimeout,
    check_span,
    check_word,
    spin_pause,
)

_WINDOW_MODES = ("auto", "shared", "separate")


def _mpi():
    from mpi4py import MPI  # imported lazily so `import streamring` works without MPI

    return MPI


class MpiHeap(SymmetricHeap):
    """Symmetric heap over MPI-3 RMA. Create one per rank after ``MPI.Init``.

    Args:
        comm: the communicator of the job (default ``COMM_WORLD``).
        window: ``"auto"`` (shared when all ranks are on one node), ``"shared"``
            or ``"separate"`` (``Win.Allocate``: forces the multi-node code path
            on one node, for testing).
    """

    name = "cpu"

    def __init__(self, comm=None, window: str = "auto", collective_timeout_s: float = 60.0):
        MPI = _mpi()
        if window not in _WINDOW_MODES:
            raise ValueError(f"cpu window mode {window!r} is not one of {_WINDOW_MODES}")
        self._MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self._node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        all_on_node = self._node.Get_size() == self.comm.Get_size()
        if window == "shared" and not all_on_node:
            raise ValueError("cpu window mode 'shared' needs every rank on one node; use 'auto' or 'separate'")
        self.shared = all_on_node if window == "auto" else window == "shared"
        if self.shared:
            # Rank numbering of the node communicator must equal the job's, so a
            # PE index means the same thing for both.
            if self._node.Get_rank() != self.comm.Get_rank():
                self.shared = False
        # Host collectives (allgather at stream start, alloc) first meet in an
        # Ibarrier polled against this deadline: a rank that never arrives gives
        # a WaitTimeout, not a hang inside MPI.
        self.collective_timeout_s = float(collective_timeout_s)
        self._broken = ""
        self._regions: list[Region] = []
        self._one = np.zeros(1, dtype=np.uint64)
        self._closed = False
        self._blocked: tuple[str, int, float] | None = None  # (what, pe, since) of the flush in progress
        # called with each new region before the allocation's closing barrier (the host records the
        # files a region maps: a job killed before it ends cannot unlink them itself)
        self.after_alloc: list = []
        self._meet("heap creation")
        #: every rank's host (MPI processor name), for messages that name a peer
        self.hostnames: list[str] = self.comm.allgather(MPI.Get_processor_name())

    # -- identity -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def num_ranks(self) -> int:
        return self.comm.Get_size()

    @property
    def memory_kind(self) -> str:
        """``cpu/shared`` (Allocate_shared: plain loads and stores) or ``cpu/separate`` (Win.Allocate: RMA calls)."""
        return f"cpu/{'shared' if self.shared else 'separate'}"

    def _check_pe(self, pe: int, what: str) -> None:
        if not 0 <= pe < self.num_ranks:
            raise VerbError(f"{what}: pe {pe} outside [0, {self.num_ranks})")

    # -- allocation -----------------------------------------------------------------------
    def alloc(self, name: str, nbytes: int) -> Region:
        MPI = self._MPI
        if nbytes <= 0:
            raise VerbError(f"alloc {name!r}: nbytes must be > 0, got {nbytes}")
        # Round up to 8 bytes so the last signal word is whole.
        rounded = (int(nbytes) + 7) // 8 * 8
        # Size check before any byte is taken (a shared window the node cannot hold
        # fills /dev/shm, then the ranks die of SIGBUS). Every rank checks its own
        # node and the verdicts are exchanged, so all ranks raise the same error.
        try:
            check_fits(rounded, self._node.Get_size(), what=f"alloc {name!r} (symmetric heap region)")
            problem = ""
        except HeapSizeError as exc:
            problem = str(exc)
        shared = self.allgather_obj((int(nbytes), problem))
        sizes = [n for n, _ in shared]
        if len(set(sizes)) != 1:
            raise VerbError(f"alloc {name!r}: ranks asked for different sizes {sizes} (must be symmetric)")
        bad = [(r, p) for r, (_, p) in enumerate(shared) if p]
        if bad:
            r, p = bad[0]
            raise HeapSizeError(f"{p} (on the node of rank {r})")
        nbytes = rounded
        if self.shared:
            win = MPI.Win.Allocate_shared(nbytes, 1, comm=self._node)
            buf, _ = win.Shared_query(self.rank)
            peers = [np.frombuffer(win.Shared_query(p)[0], dtype=np.uint8, count=nbytes) for p in range(self.num_ranks)]
        else:
            win = MPI.Win.Allocate(nbytes, 1, comm=self.comm)
            buf = win.tomemory()
            peers = None
        if win.Get_attr(MPI.WIN_MODEL) != MPI.WIN_UNIFIED:
            raise VerbError("the MPI library gave a separate-model window; streamring needs MPI_WIN_UNIFIED")
        local = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        local[:] = 0
        win.Lock_all(MPI.MODE_NOCHECK)
        win.Sync()
        region = Region(name=name, nbytes=nbytes, local=local, handle=(win, peers))
        self._regions.append(region)
        for hook in self.after_alloc:  # e.g. the host records the window's shared-memory file
            hook(region)
        # Zero everywhere before anyone may signal into this region.
        self._meet(f"alloc {name!r}")
        return region

    def free(self, region: Region) -> None:
        win, _ = region.handle
        self._meet(f"free {region.name!r}")
        # Forget the region (by identity) before its memory goes: nothing may look at
        # region.local once the window is freed.
        self._regions[:] = [r for r in self._regions if r is not region]
        self._blocked = (f"free {region.name!r} (Unlock_all)", -1, time.monotonic())
        try:
            win.Unlock_all()
        except self._MPI.Exception as exc:
            raise self._unreachable(f"free {region.name!r}", -1, exc) from None
        finally:
            self._blocked = None
        win.Free()

    # -- RMA --------------------------------------------------------------------------------
    @staticmethod
    def _bytes(data: np.ndarray) -> np.ndarray:
        arr = np.ascontiguousarray(data)
        return arr.reshape(-1).view(np.uint8)

    def put(self, region: Region, offset: int, data: np.ndarray, pe: int) -> None:
        raw = self._bytes(data)
        check_span(region, offset, raw.nbytes, "put")
        self._check_pe(pe, "put")
        win, _ = region.handle
        if raw.nbytes:
            try:
                win.Put([raw, self._MPI.BYTE], pe, target=(offset, raw.nbytes, self._MPI.BYTE))
            except self._MPI.Exception as exc:
                raise self._unreachable("put", pe, exc) from None

    def get(self, region: Region, offset: int, out: np.ndarray, pe: int) -> np.ndarray:
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise VerbError("get: out must be a writable C-contiguous array (a reshaped copy would drop the data)")
        raw = out.reshape(-1).view(np.uint8)
        check_span(region, offset, raw.nbytes, "get")
        self._check_pe(pe, "get")
        win, peers = region.handle
        if peers is not None:
            win.Sync()
            raw[:] = peers[pe][offset : offset + raw.nbytes]
            win.Sync()
        elif raw.nbytes:
            try:
                win.Get([raw, self._MPI.BYTE], pe, target=(offset, raw.nbytes, self._MPI.BYTE))
            except self._MPI.Exception as exc:
                raise self._unreachable("get", pe, exc) from None
            self._flush(win, pe, "get")
        return out

    def _accumulate(self, region: Region, offset: int, value: int, mpi_op, pe: int) -> None:
        win, _ = region.handle
        self._one[0] = value
        try:
            win.Accumulate([self._one, self._MPI.UINT64_T], pe, target=(offset, 1, self._MPI.UINT64_T), op=mpi_op)
        except self._MPI.Exception as exc:
            raise self._unreachable("signal accumulate", pe, exc) from None
        self._flush(win, pe, "signal accumulate")

    def _signal_mpi_op(self, op: SignalOp):
        if op is SignalOp.SET:
            return self._MPI.REPLACE
        if op is SignalOp.ADD:
            return self._MPI.SUM
        raise VerbError(f"signal op {op!r} is not one of {[o.value for o in SignalOp]}")

    def put_signal(self, region, offset, data, sig_region, sig_offset, value, op, pe) -> None:
        check_word(sig_region, sig_offset, "put_signal signal")
        mpi_op = self._signal_mpi_op(op)
        self.put(region, offset, data, pe)
        win, _ = region.handle
        # Complete the payload at the target before the signal can land.
        self._flush(win, pe, "put_signal payload")
        self._release_local()
        self._accumulate(sig_region, sig_offset, value, mpi_op, pe)

    def signal_op(self, sig_region, sig_offset, value, op, pe) -> None:
        check_word(sig_region, sig_offset, "signal_op")
        self._check_pe(pe, "signal_op")
        mpi_op = self._signal_mpi_op(op)
        # Release: our earlier local stores and puts (to any window) first.
        self._release_local()
        for r in self._regions:
            self._flush(r.handle[0], -1, "signal_op release (Flush_all)")
        self._accumulate(sig_region, sig_offset, value, mpi_op, pe)

    def signal_fetch(self, sig_region: Region, sig_offset: int) -> int:
        check_word(sig_region, sig_offset, "signal_fetch")
        win, peers = sig_region.handle
        if peers is not None:
            win.Sync()
            value = int(sig_region.local[sig_offset : sig_offset + 8].view(np.uint64)[0])
        else:
            res = np.zeros(1, dtype=np.uint64)
            try:
                win.Fetch_and_op([self._one, self._MPI.UINT64_T], [res, self._MPI.UINT64_T], self.rank, sig_offset,
                                 op=self._MPI.NO_OP)
            except self._MPI.Exception as exc:
                raise self._unreachable("signal_fetch", self.rank, exc) from None
            self._flush(win, self.rank, "signal_fetch")
            value = int(res[0])
        # Acquire: no payload load of ours may be satisfied before the signal load.
        self._acquire_local()
        return value

    def _fetch_op(self, region: Region, offset: int, value: int, mpi_op, pe: int, what: str) -> int:
        check_word(region, offset, what)
        self._check_pe(pe, what)
        win, _ = region.handle
        # Release: our earlier local stores and our puts to this target (any
        # region) complete before the atomic can be observed. MPI does not order
        # a Put before a later Fetch_and_op without a flush.
        self._release_local()
        for r in self._regions:
            self._flush(r.handle[0], pe, f"{what} release")
        src = np.array([value], dtype=np.uint64)
        res = np.zeros(1, dtype=np.uint64)
        try:
            win.Fetch_and_op([src, self._MPI.UINT64_T], [res, self._MPI.UINT64_T], pe, offset, op=mpi_op)
        except self._MPI.Exception as exc:
            raise self._unreachable(what, pe, exc) from None
        self._flush(win, pe, what)
        return int(res[0])

    def atomic_fetch_or(self, region, offset, value, pe) -> int:
        return self._fetch_op(region, offset, value, self._MPI.BOR, pe, "atomic_fetch_or")

    def atomic_fetch_add(self, region, offset, value, pe) -> int:
        return self._fetch_op(region, offset, value, self._MPI.SUM, pe, "atomic_fetch_add")

    # -- ordering -----------------------------------------------------------------------
    def _release_local(self) -> None:
        for r in self._regions:
            r.handle[0].Sync()

    _acquire_local = _release_local

    def fence(self) -> None:
        self.quiet()

    def quiet(self) -> None:
        for r in self._regions:
            win = r.handle[0]
            self._flush(win, -1, "quiet (Flush_all)")
            win.Sync()

    def barrier(self, deadline: float | None = None) -> None:
        """Barrier with quiet semantics; ``deadline`` defaults to now + ``collective_timeout_s``."""
        self.quiet()
        self._meet("barrier over all ranks", deadline)
        self.quiet()

    def _meet(self, what: str, deadline: float | None = None) -> None:
        """Ibarrier polled against a deadline: every host collective starts with it."""
        if self._broken:
            raise VerbError(f"{what}: this heap is unusable: {self._broken}")
        start = time.monotonic()
        deadline = start + self.collective_timeout_s if deadline is None else deadline
        req = self.comm.Ibarrier()
        while not req.Test():
            if time.monotonic() > deadline:
                # The Ibarrier stays pending: later collectives would pair with the
                # wrong calls of the other ranks, so the heap refuses them.
                self._broken = f"a collective timed out ({what})"
                raise WaitTimeout(f"{what}: not every rank arrived within {deadline - start:.1f}s "
                                  f"(a rank is stalled, dead or skipped a collective call)", time.monotonic() - start)
            self.progress()
            spin_pause()

    def allgather_int(self, value: int) -> list[int]:
        self._meet("allgather")
        return [int(v) for v in self.comm.allgather(int(value))]

    def allgather_obj(self, obj) -> list:
        self._meet("allgather")
        return self.comm.allgather(obj)

    # -- completions that wait on peers ------------------------------------------------------
    def _flush(self, win, pe: int, what: str) -> None:
        """``Flush(pe)`` (``Flush_all`` for pe -1), recorded for the watchdog thread; MPI errors name the peer."""
        self._blocked = (what, pe, time.monotonic())
        try:
            if pe >= 0:
                win.Flush(pe)
            else:
                win.Flush_all()
        except self._MPI.Exception as exc:
            raise self._unreachable(what, pe, exc) from None
        finally:
            self._blocked = None

    def _unreachable(self, what: str, pe: int, exc) -> VerbError:
        """The transport's error (e.g. UCX "Connection reset by remote peer") as an error naming the peer.

        Only MPI's catch-all classes (ERR_OTHER, ERR_INTERN, and ERR_PROC_FAILED where the
        library has it) are the transport's; any other class is a misuse, reported as such.
        """
        MPI = self._MPI
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        reason = lines[-1] if lines else repr(exc)
        if "):" in reason:  # "FUNC(LINE): message": keep the message
            reason = reason.split("):", 1)[1].strip()
        transport = {MPI.ERR_OTHER, MPI.ERR_INTERN} | ({MPI.ERR_PROC_FAILED} if hasattr(MPI, "ERR_PROC_FAILED") else set())
        try:
            cls = exc.Get_error_class()
        except Exception:  # noqa: BLE001 - not an MPI exception: treat as the transport's
            cls = MPI.ERR_OTHER
        if cls not in transport:
            return VerbError(f"rank {self.rank}: {what} to rank {pe}: MPI error (class {cls}): {reason}")
        if pe < 0:
            return PeerUnreachable(self.rank, what, pe, ", ".join(sorted(set(self.hostnames))), reason)
        mates = [r for r, h in enumerate(self.hostnames) if h == self.hostnames[pe]]
        return PeerUnreachable(self.rank, what, pe, f"{self.hostnames[pe]}, ranks {mates} there", reason)

    def blocked_call(self) -> tuple[str, int, float] | None:
        return self._blocked

    def progress(self) -> None:
        if not self.shared:
            # MPICH needs an MPI call to progress passive-target RMA.
            self.comm.Iprobe()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for r in list(self._regions):
            try:
                self.free(r)
            except Exception:  # pragma: no cover - best effort at teardown
                pass


