"""Bootstrap of a backend's symmetric heap for the current launcher."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from ..config import Config
from ..device.verbs import SymmetricHeap
from .jobfiles import unlink_own_job_files
from .launch import Launcher, LaunchError, detect_launcher


def make_heap(cfg: Config, launcher: Launcher | None = None) -> SymmetricHeap:
    """Create this rank's symmetric heap for ``cfg.backend``.

    The CPU backend needs MPI ranks (the local launcher, mpirun or srun); under
    torchrun it fails at once, naming the launchers that work.
    """
    launcher = launcher or detect_launcher()
    if cfg.backend == "cpu":
        if launcher is Launcher.TORCHRUN:
            raise LaunchError(
                "the cpu backend runs on MPI ranks and cannot bootstrap from torchrun (torch.distributed has no "
                "one-sided put/signal/atomics). Use `streamring <cmd> --ranks N` (starts local ranks itself) or "
                "`mpirun -n N streamring <cmd>`; torchrun works with --backend nvshmem."
            )
        from ..device.cpu import MpiHeap

        return MpiHeap(window=cfg.cpu.window, collective_timeout_s=cfg.wait_timeout_s)
    if cfg.backend == "nvshmem":
        from ..device.nvshmem import NvshmemHeap  # noqa: WPS433 (GPU-only import)

        return NvshmemHeap.bootstrap(launcher=launcher.value, symmetric_size=cfg.nvshmem.symmetric_size)
    raise LaunchError(f"backend {cfg.backend!r} is not one of ['cpu', 'nvshmem']")


def abort_job(exc: BaseException, code: int = 1) -> None:
    """Print the error of this rank and take the whole job down (no orphans, no hang).

    Under MPI: ``MPI_Abort``. Under torchrun (no MPI: torchrun ends the other workers when this one
    exits non-zero) the process exits, and a SIGALRM ends it should an exit handler hang (NVSHMEM's
    finalisation waits for peers that may be dead or stopped)."""
    rank = os.environ.get("RANK", "?")
    MPI = None
    if detect_launcher() is not Launcher.TORCHRUN:  # importing mpi4py would start an MPI singleton there
        try:
            from mpi4py import MPI

            rank = MPI.COMM_WORLD.Get_rank()
        except Exception:  # pragma: no cover
            MPI = None
    # The type is part of the line: a caller (or a test) can tell a protocol violation or a
    # watchdog from a crash without a traceback.
    sys.stderr.write(f"[streamring rank {rank}] error: {type(exc).__name__}: {exc}\n")
    # Expected failures (bad input, protocol violation, watchdog) carry their own
    # diagnostics; anything else gets a traceback.
    from ..device.verbs import PeerUnreachable
    from ..ring.protocol import ProtocolViolation, WatchdogError

    if not isinstance(exc, (ValueError, TypeError, LaunchError, ProtocolViolation, WatchdogError, TimeoutError,
                            PeerUnreachable)):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    # MPI_Abort leaves the job's shared-memory segments and the launcher's temporary
    # files behind (under a plain mpirun nothing else would remove them).
    try:
        unlink_own_job_files()
    except Exception:  # noqa: BLE001 - best effort, the abort matters more
        pass
    time.sleep(0.3)  # let mpiexec forward our last lines before the abort tears the job down
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        MPI.COMM_WORLD.Abort(code)
    if hasattr(signal, "alarm"):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the default action ends the process, GIL or not
        signal.alarm(ABORT_EXIT_GRACE_S)
    sys.exit(code)


#: Seconds an aborting rank that is not under MPI may spend in its exit handlers.
ABORT_EXIT_GRACE_S = 20


class BlockedCallWatch:
    """Handle of the blocked-call watchdog thread: :meth:`stop` ends it and waits for it."""

    def __init__(self, thread: threading.Thread | None, event: threading.Event):
        self._thread, self._event = thread, event

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread and join it.

        Joined, not left to die with the process: a daemon thread still running while the
        interpreter finalizes is ended by ``pthread_exit`` when it next takes the GIL, and if
        that happens inside a C++ destructor (the cyclic GC can free a torch tensor over NVSHMEM
        memory in any thread) the process aborts ("terminate called without an active
        exception") after a successful run.
        """
        self._event.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def watch_blocked_calls(heap: SymmetricHeap, timeout_s: float, diagnostics=()) -> BlockedCallWatch:
    """Start a daemon thread that ends the job when this rank stays blocked in one transport completion.

    The protocol's waits poll with a deadline, but an MPI ``Flush`` towards a peer on
    another node waits inside MPI for that peer's progress (no RDMA on TCP): a stopped
    peer would block it for ever. The thread reads :meth:`SymmetricHeap.blocked_call`
    every ``timeout_s / 4`` (at most 0.5 s); once one call has lasted ``timeout_s`` it
    prints which completion, towards which rank and host, and the ``diagnostics``
    (callables returning text), records the status and aborts the job. Set the
    returned handle's ``stop()`` ends it. A backend whose completions never wait on a peer
    (it does not override ``blocked_call``: NVSHMEM) gets no thread.
    """
    from ..ring.protocol import WatchdogError

    stop = threading.Event()
    if type(heap).blocked_call is SymmetricHeap.blocked_call:
        return BlockedCallWatch(None, stop)
    period = min(0.5, timeout_s / 4)

    def watch() -> None:
        while not stop.wait(period):  # ends with the event or with the process (daemon)
            blocked = heap.blocked_call()
            if blocked is None:
                continue
            what, pe, since = blocked
            waited = time.monotonic() - since
            if waited <= timeout_s:
                continue
            hosts = getattr(heap, "hostnames", None)
            peer = "every rank" if pe < 0 else f"rank {pe}" + (f" (host {hosts[pe]})" if hosts else "")
            lines = [f"rank {heap.rank}: watchdog: blocked {waited:.1f}s (wait_timeout_s={timeout_s}) inside the "
                     f"transport's completion of {what} towards {peer}: that peer makes no progress (a stopped or "
                     f"hung process, or its host or the network is down)"]
            lines += [text for text in (d() for d in diagnostics) if text]
            exc = WatchdogError("\n".join(lines))
            from .jobstate import report_status

            report_status(heap.rank, f"WatchdogError: {exc}")
            # If MPI_Abort itself hung (it should not), leave anyway: the launcher reports the rank dead.
            threading.Timer(10.0, os._exit, (1,)).start()
            abort_job(exc)
            return

    thread = threading.Thread(target=watch, name="streamring-blocked-call-watchdog", daemon=True)
    thread.start()
    return BlockedCallWatch(thread, stop)
