"""The symmetric-heap verbs every backend implements.

This is the lowest layer of streamring: an NVSHMEM-shaped set of one-sided
operations on a *symmetric heap*, i.e. named regions that every rank (PE)
allocates collectively with the same size, so that an offset into a region
means the same thing on every rank.

Memory-model contract (the same for every backend; the protocol in
``streamring.ring.protocol`` argues its ordering only in these terms):

* ``put``: copies bytes into a peer's region. Not ordered with respect to
  later operations unless followed by ``fence`` (ordering to the same PE) or
  ``quiet`` (completion of everything issued so far).
* ``put_signal``: the payload is visible at the target *before* the signal
  word update becomes visible (release on the signal).
* ``signal_op``: atomic SET or ADD on a 64-bit signal word at a PE. Every
  store and put the caller issued before it is visible before the new signal
  value (release semantics, system scope). Backends whose native signal op has
  no leading fence add one.
* ``signal_fetch`` / ``signal_wait_until``: read the caller's own signal word
  with acquire semantics: reads of payload issued after a successful wait see
  everything released before the observed signal value.
* ``atomic_fetch_or`` / ``atomic_fetch_add``: 64-bit atomics at a PE with
  release semantics (used for acknowledgement bitmasks). Keep one atomic op
  kind per word: MPI only guarantees atomicity between identical ops.
* ``get``: one-sided read of a peer's region; completes before it returns.
* ``fence``: orders the caller's earlier puts/atomics and local stores before
  its later ones, per target PE. ``quiet``: completes all of them.
* ``barrier``: all ranks, with ``quiet`` semantics.

Every blocking call takes a ``deadline`` (absolute ``time.monotonic()``
seconds) and raises :class:`WaitTimeout` instead of hanging. A completion
that waits on a peer inside the transport (an MPI ``Flush`` of RMA over a
network without RDMA needs the target's progress) cannot take a deadline;
such a backend reports it through :meth:`SymmetricHeap.blocked_call` for the
host layer's watchdog thread, and raises :class:`PeerUnreachable` when the
transport reports the peer gone.
"""

from __future__ import annotations

import abc
import enum
import os
import time
from dataclasses import dataclass

import numpy as np


class SignalOp(enum.Enum):
    """Operation of a signal update (NVSHMEM_SIGNAL_SET / NVSHMEM_SIGNAL_ADD)."""

    SET = "set"
    ADD = "add"


class Cmp(enum.Enum):
    """Comparison of a wait (NVSHMEM_CMP_*)."""

    EQ = "eq"
    NE = "ne"
    GE = "ge"
    GT = "gt"
    LE = "le"
    LT = "lt"

    def holds(self, current: int, value: int) -> bool:
        """True when ``current <cmp> value``."""
        return {
            Cmp.EQ: current == value,
            Cmp.NE: current != value,
            Cmp.GE: current >= value,
            Cmp.GT: current > value,
            Cmp.LE: current <= value,
            Cmp.LT: current < value,
        }[self]


class VerbError(RuntimeError):
    """A verb was called with arguments outside the region or rank range."""


class PeerUnreachable(VerbError):
    """The transport reports a peer gone (its process or host): names the verb, the peer and its host."""

    def __init__(self, me: int, what: str, pe: int, host: str, reason: str):
        if pe >= 0:
            text = f"rank {me}: {what} to rank {pe} failed: peer rank {pe} unreachable (host {host}): {reason}"
        else:
            text = f"rank {me}: {what} to every rank failed: a peer is unreachable (hosts: {host}): {reason}"
        super().__init__(text)
        self.pe = pe
        self.host = host


class WaitTimeout(TimeoutError):
    """A wait passed its deadline. ``what`` says what was awaited."""

    def __init__(self, what: str, waited_s: float):
        super().__init__(f"deadline passed after {waited_s:.3f}s waiting for {what}")
        self.what = what
        self.waited_s = waited_s


@dataclass(frozen=True, eq=False)
class Region:
    """A collectively allocated symmetric region.

    ``local`` is a writable uint8 view of this rank's copy (a numpy array on
    host-memory backends, a torch CUDA tensor on NVSHMEM); ``nbytes`` is the same
    on every rank. ``handle`` is backend-private. The protocol never touches
    ``local``: it goes through the verbs, so it runs unchanged on every backend.

    Regions compare by identity (``eq=False``): two allocations with the same name and
    size are different regions, and comparing field by field would read ``local``,
    whose memory may already be freed (a segfault, not an error).
    """

    name: str
    nbytes: int
    local: np.ndarray
    handle: object


def check_word(region: Region, offset: int, what: str) -> None:
    """Bounds and 8-byte alignment of a 64-bit signal/atomic word."""
    check_span(region, offset, 8, what)
    if offset % 8:
        raise VerbError(f"{what} on region {region.name!r}: offset {offset} is not 8-byte aligned")


def check_span(region: Region, offset: int, nbytes: int, what: str) -> None:
    """Bounds check done by every backend before touching memory.

    Shared-memory windows have no bounds checks of their own: an
    out-of-range access would corrupt a neighbour's segment or crash the job.
    """
    if offset < 0 or nbytes < 0 or offset + nbytes > region.nbytes:
        raise VerbError(
            f"{what} on region {region.name!r}: bytes [{offset}, {offset + nbytes}) "
            f"outside [0, {region.nbytes})"
        )


def spin_pause() -> None:
    """Give the core away inside spin loops (ranks may outnumber cores)."""
    # Without it a generation takes milliseconds instead of tens of
    # microseconds when ranks outnumber cores (see the CPU backend notes).
    os.sched_yield()


class SymmetricHeap(abc.ABC):
    """The verbs. One instance per rank; all ranks call ``alloc`` collectively."""

    #: short backend name ("cpu", "nvshmem")
    name: str = "abstract"

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This PE's index."""

    @property
    @abc.abstractmethod
    def num_ranks(self) -> int:
        """Number of PEs."""

    @property
    def memory_kind(self) -> str:
        """What the regions live in, for reports (the backend name unless it has several kinds)."""
        return self.name

    # -- allocation ---------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, name: str, nbytes: int) -> Region:
        """Collectively allocate a zero-filled region of ``nbytes`` on every rank.

        Returns after every rank's zeroing is complete (a barrier), so no
        remote signal can be overwritten by a late reset.
        """

    @abc.abstractmethod
    def free(self, region: Region) -> None:
        """Collectively release a region."""

    # -- RMA ------------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, region: Region, offset: int, data: np.ndarray, pe: int) -> None:
        """Copy ``data`` (any contiguous array, taken as bytes) to ``pe``'s region."""

    @abc.abstractmethod
    def get(self, region: Region, offset: int, out: np.ndarray, pe: int) -> np.ndarray:
        """Read ``out.nbytes`` bytes of ``pe``'s region into ``out``; complete on return."""

    @abc.abstractmethod
    def put_signal(
        self,
        region: Region,
        offset: int,
        data: np.ndarray,
        sig_region: Region,
        sig_offset: int,
        value: int,
        op: SignalOp,
        pe: int,
    ) -> None:
        """Put ``data``, then update the signal word; the payload is visible first."""

    @abc.abstractmethod
    def signal_op(self, sig_region: Region, sig_offset: int, value: int, op: SignalOp, pe: int) -> None:
        """Atomically SET/ADD a 64-bit signal word at ``pe`` with release semantics."""

    @abc.abstractmethod
    def signal_fetch(self, sig_region: Region, sig_offset: int) -> int:
        """Read this rank's own signal word with acquire semantics."""

    def signal_wait_until(
        self, sig_region: Region, sig_offset: int, cmp: Cmp, value: int, deadline: float, what: str = ""
    ) -> int:
        """Wait until own signal word ``cmp value``; returns the value seen (acquire).

        Raises :class:`WaitTimeout` at ``deadline``.
        """
        start = time.monotonic()
        while True:
            cur = self.signal_fetch(sig_region, sig_offset)
            if cmp.holds(cur, value):
                return cur
            now = time.monotonic()
            if now > deadline:
                raise WaitTimeout(
                    what or f"{sig_region.name}[{sig_offset}] {cmp.value} {value} (last seen {cur})", now - start
                )
            self.progress()
            spin_pause()

    # -- atomics ------------------------------------------------------------------------
    @abc.abstractmethod
    def atomic_fetch_or(self, region: Region, offset: int, value: int, pe: int) -> int:
        """64-bit fetch-or at ``pe`` (release); returns the old value."""

    @abc.abstractmethod
    def atomic_fetch_add(self, region: Region, offset: int, value: int, pe: int) -> int:
        """64-bit fetch-add at ``pe`` (release); returns the old value."""

    # -- ordering ----------------------------------------------------------------------
    @abc.abstractmethod
    def fence(self) -> None:
        """Order earlier local stores, puts and atomics before later ones."""

    @abc.abstractmethod
    def quiet(self) -> None:
        """Complete every outstanding put and atomic issued by this rank."""

    @abc.abstractmethod
    def barrier(self, deadline: float | None = None) -> None:
        """Barrier over all ranks with ``quiet`` semantics."""

    # -- host-side collectives used for stream set-up (not on the data path) ----------
    @abc.abstractmethod
    def allgather_int(self, value: int) -> list[int]:
        """Every rank's ``value`` (stream planning: token counts, epochs)."""

    @abc.abstractmethod
    def allgather_obj(self, obj) -> list:
        """Every rank's picklable ``obj`` (results and diagnostics; not on the data path)."""

    def progress(self) -> None:
        """Drive the transport's progress engine inside spin loops (no-op by default)."""

    def blocked_call(self) -> tuple[str, int, float] | None:
        """``(what, pe, since)``: the transport completion this rank is blocked in now, else None.

        ``pe`` is -1 for a completion towards every peer; ``since`` is ``time.monotonic()``.
        Read from another thread (the host layer's watchdog): it is the only way to see a
        wait that has no deadline of ours. Backends whose completions never wait on a
        peer return None.
        """
        return None

    def close(self) -> None:
        """Release every resource; safe to call twice."""
