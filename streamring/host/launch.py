"""Launch-time environment: which launcher started us, and the local launcher itself.

``streamring run`` with no launcher starts ``--ranks N`` local ranks through the
``mpiexec`` of the MPI that mpi4py is bound to (the ``mpich`` wheel's Hydra in a
fresh install, or a site MPI) and waits for them. Under ``mpirun``/``srun`` the
ranks already exist; under ``torchrun`` only the NVSHMEM backend can bootstrap.

``STREAMRING_MPIEXEC_ARGS`` (shell words) is inserted right after ``mpiexec`` in
the local launcher's command line: e.g. ``-f hosts`` to put the ranks on other
hosts while this launcher still watches the job (see ``host/netns.py``).
"""

from __future__ import annotations

import enum
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .jobfiles import JobFiles, is_mpi_job_file, orphaned_files
from .preload import STUB as PRELOAD_STUB
from .preload import PreloadServer, SharedServer, preload_enabled
from .jobstate import (JOB_DIR_ENV, rank_errors, rank_pids, ranks_down, ranks_not_ok, recorded_job_files,
                       summarize)
from .report import TERMINAL_COLUMNS_ENV, terminal_columns

SPAWNED_ENV = "STREAMRING_SPAWNED"
MPIEXEC_ARGS_ENV = "STREAMRING_MPIEXEC_ARGS"  # extra mpiexec arguments of the local launcher (hostfile...)


class Launcher(enum.Enum):
    """How the current process was started."""

    LOCAL = "local"  # a plain `streamring ...`: we start the ranks ourselves
    MPI = "mpi"  # mpirun / mpiexec / srun with PMI
    TORCHRUN = "torchrun"


_MPI_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")
_TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def detect_launcher(env=None) -> Launcher:
    """Decide from the environment which launcher started this process."""
    env = os.environ if env is None else env
    if any(v in env for v in _MPI_VARS) or env.get(SPAWNED_ENV):
        return Launcher.MPI
    if any(v in env for v in _TORCHRUN_VARS) or ("LOCAL_RANK" in env and "WORLD_SIZE" in env):
        return Launcher.TORCHRUN
    return Launcher.LOCAL


class LaunchError(RuntimeError):
    """The job cannot be launched as asked (names the launchers that work)."""


def find_mpiexec() -> str:
    """The mpiexec that belongs to mpi4py's MPI: beside the interpreter first, then PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise LaunchError(
            "no mpiexec found: install the MPI wheel (`pip install mpich`) or put your site MPI's mpiexec on PATH"
        )
    return found


def _mpiexec_cmd(mpiexec: str, num_ranks: int, openmpi: bool) -> list[str]:
    """``mpiexec`` with the user's extra arguments and ``num_ranks`` ranks; Open MPI may oversubscribe, and
    Hydra keeps the other ranks alive when one dies, so their watchdogs can report the slot states and the
    dead peer (their MPI_Abort then ends the job)."""
    cmd = [mpiexec, *shlex.split(os.environ.get(MPIEXEC_ARGS_ENV, "")), "-n", str(num_ranks)]
    return cmd + (["--oversubscribe"] if openmpi else ["-disable-auto-cleanup"])


def _rank_env(jdir: Path, extra_env: dict | None) -> dict:
    """The ranks' environment: this process's, marked as spawned, with the job folder, the terminal width
    (their stdout is a pipe to mpiexec; none: a log), what Open MPI needs to run as root on one host, and
    ``extra_env`` last."""
    env = dict(os.environ)
    env[SPAWNED_ENV] = "1"
    columns = terminal_columns()
    if columns is None:
        env.pop(TERMINAL_COLUMNS_ENV, None)
    else:
        env[TERMINAL_COLUMNS_ENV] = str(columns)
    env[JOB_DIR_ENV] = str(jdir)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_osc", "^ucx")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra_env:
        env.update(extra_env)
    return env


def spawn_local(num_ranks: int, argv: list[str], extra_env: dict | None = None, timeout_s: float | None = None,
                preload: tuple[str, ...] = (), errors: dict | None = None) -> int:
    """Start ``num_ranks`` ranks of ``python -m streamring <argv>`` and return the job's exit code.

    ``errors``, if given, receives ``{rank: its error report}`` of the ranks that reported one.

    ``preload``: modules that every rank imports (CPU ranks only: a fork of a process that holds a
    CUDA context is unusable). When given, with Hydra's ``mpiexec`` and ``STREAMRING_PRELOAD`` not
    ``0``, one server imports them and the ranks start as its forks (:mod:`streamring.host.preload`).

    One rank raising aborts the whole MPI job (the rank calls ``MPI_Abort``), so
    the launcher returns promptly with a non-zero code and no rank is left behind.
    However the job ends (normally, aborted, a rank killed, Ctrl-C or SIGTERM to the
    launcher), the shared-memory segments and temporary files that its processes held
    are removed afterwards (:mod:`streamring.host.jobfiles`), and nothing else.
    """
    if num_ranks < 1:
        raise LaunchError(f"--ranks must be >= 1, got {num_ranks}")
    mpiexec = find_mpiexec()
    openmpi = _is_openmpi(mpiexec)
    cmd = _mpiexec_cmd(mpiexec, num_ranks, openmpi)
    jdir = Path(tempfile.mkdtemp(prefix="streamring-job-"))
    env = _rank_env(jdir, extra_env)
    server = None
    # (not with extra mpiexec arguments: they may put ranks on other hosts, where a fork of this host's
    # server would be the wrong process on the wrong host)
    if preload and preload_enabled(env) and not openmpi and not os.environ.get(MPIEXEC_ARGS_ENV):
        server = SharedServer.from_env(env, num_ranks) or PreloadServer(jdir, preload, env, num_ranks, argv)
        env.update(server.rank_env())
        cmd += [sys.executable, str(PRELOAD_STUB), *argv]
    else:
        cmd += [sys.executable, "-m", "streamring", *argv]
    job = _LocalJob.start(cmd, env, server, jdir, num_ranks, mpiexec)
    rc = 1
    interrupted = ""
    previous = signal.signal(signal.SIGTERM, _sigterm_interrupts)
    try:
        rc = job.wait(timeout_s)
        if rc == 0:
            rc = job.exit_code_from_reports()
        return rc
    except (KeyboardInterrupt, subprocess.TimeoutExpired) as exc:
        interrupted = ("SIGTERM" if str(exc) == "SIGTERM" else "Ctrl-C") if isinstance(exc, KeyboardInterrupt) \
            else f"the launcher's timeout ({timeout_s}s)"
        job.files.scan()
        _kill_group(job.proc)
        rc = 130 if timeout_s is None else 124
        return rc
    finally:
        signal.signal(signal.SIGTERM, previous)
        job.end(rc, interrupted, errors)


def _sigterm_interrupts(signum, frame):
    """SIGTERM to the launcher: take the MPI job down with us (as Ctrl-C does)."""
    raise KeyboardInterrupt("SIGTERM")


class _LocalJob:
    """A started job of local ranks: ``mpiexec`` in a session of its own, the preload server whose forks the ranks
    are (or None), the files the job's processes hold and the job folder the ranks report into."""

    def __init__(self, proc: subprocess.Popen, server, jdir: Path, num_ranks: int, mpiexec: str, started_at: float):
        self.proc, self.server, self.jdir, self.num_ranks, self.mpiexec = proc, server, jdir, num_ranks, mpiexec
        self.started_at = started_at
        # the job's processes: mpiexec's tree, and its preload server's (its own server and the forks; of a
        # shared server, which serves other jobs before and after, only the ranks this job's folder names)
        if isinstance(server, SharedServer):
            self.files = JobFiles(proc.pid, more_roots=lambda: rank_pids(jdir, num_ranks))
        else:
            self.files = JobFiles(proc.pid, *([server.proc.pid] if server is not None else []))
        self.first_down: list = []  # [(rank, pid, state)] first seen not running normally (one poll)

    @classmethod
    def start(cls, cmd: list[str], env: dict, server, jdir: Path, num_ranks: int, mpiexec: str) -> "_LocalJob":
        """Start ``cmd``; where it cannot start, stop the server, remove the job folder and raise LaunchError."""
        started_at = time.time()  # (wall clock: compared with the ctime of the job's segments)
        try:
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        except OSError as exc:
            if server is not None:
                server.stop()
            shutil.rmtree(jdir, ignore_errors=True)
            raise LaunchError(f"cannot start {mpiexec}: {exc}") from exc
        return cls(proc, server, jdir, num_ranks, mpiexec, started_at)

    def wait(self, timeout_s: float | None) -> int:
        """``mpiexec``'s exit code once it exits. Meanwhile every poll records the ranks first seen down without
        having reported (once: :attr:`first_down`) and the files the job holds (every
        :data:`FILE_SCAN_PERIOD_S`). Raises ``subprocess.TimeoutExpired`` past ``timeout_s``."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        next_scan = 0.0
        while True:
            try:
                return self.proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                if end is not None and time.monotonic() > end:
                    raise
                if not self.first_down:
                    self.first_down = ranks_down(self.jdir, self.num_ranks)
                if time.monotonic() >= next_scan:
                    self.files.scan()
                    next_scan = time.monotonic() + FILE_SCAN_PERIOD_S

    def exit_code_from_reports(self) -> int:
        """The exit code of a job whose ``mpiexec`` exited 0: every rank reports how it ended, and an mpiexec may
        exit 0 although a rank failed (Open MPI's with orte_enable_recovery after an MPI_Abort), so the ranks'
        reports decide, not its code (1 and a line naming the ranks that did not report success)."""
        failed = ranks_not_ok(self.jdir, self.num_ranks)
        if failed:
            print(f"streamring launcher: {Path(self.mpiexec).name} exited 0, but ranks {sorted(failed)} did not "
                  f"report success ({'; '.join(f'rank {r}: {w}' for r, w in sorted(failed.items()))}): the job "
                  f"failed", file=sys.stderr)
            return 1
        return 0

    def end(self, rc: int, interrupted: str, errors: dict | None) -> None:
        """However the job ended (exit code ``rc``; ``interrupted``: how the launcher ended it, or ''): stop what
        still runs (mpiexec's group, the server, then the job's stragglers), summarize a failed job on stderr,
        hand the ranks' error reports to ``errors`` (when given), and remove the job folder and what the job's
        processes held (with a failed job's orphaned MPI files too), nothing else."""
        files = self.files
        if self.proc.poll() is None:
            files.scan()
            _kill_group(self.proc)
        if self.server is not None:
            files.scan()
            self.server.stop()
        _reap_tree(files)
        if rc != 0:
            for line in summarize(self.jdir, self.num_ranks, self.first_down, interrupted=interrupted):
                print(f"streamring launcher: {line}", file=sys.stderr)
        files.seen |= {f for f in recorded_job_files(self.jdir) if is_mpi_job_file(f)}
        if rc != 0:
            files.seen |= set(orphaned_files(self.started_at))
        if errors is not None:
            errors.update(rank_errors(self.jdir, self.num_ranks))
        shutil.rmtree(self.jdir, ignore_errors=True)
        files.remove_leftovers()


#: How often the launcher records the files its job holds (a few /proc reads per process).
FILE_SCAN_PERIOD_S = 0.25


def _reap_tree(files: JobFiles, patience_s: float = 3.0) -> None:
    """Wait (a little) until no process of the job is left, then SIGKILL the stragglers.

    ``mpiexec`` is gone, but its proxy and ranks run in sessions of their own (Hydra's
    proxy calls ``setsid``), so the process group kill does not reach them; they normally
    exit when ``mpiexec`` does. A stopped rank (SIGSTOP) would not. Only processes recorded
    in the job's tree while it ran are touched (pid and start time must match).
    """
    deadline = time.monotonic() + patience_s
    while True:
        alive = files.alive()
        if not alive:
            return
        if time.monotonic() > deadline:
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            return
        time.sleep(0.05)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _is_openmpi(mpiexec: str) -> bool:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=10).stdout
    except Exception:
        return False
    return "Open MPI" in out or "OpenRTE" in out
