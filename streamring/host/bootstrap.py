"""Bootstrap of a backend's symmetric heap for the current launcher."""

from __future__ import annotations

import sys
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
    """Print the error of this rank and take the whole job down (no orphans, no hang)."""
    rank = "?"
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
    from ..protocol import ProtocolViolation, WatchdogError

    if not isinstance(exc, (ValueError, TypeError, LaunchError, ProtocolViolation, WatchdogError, TimeoutError)):
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
    sys.exit(code)
