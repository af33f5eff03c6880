"""Preloaded ranks: the local launcher's CPU ranks start as forks of one process that has imported them.

A rank of ``streamring run`` imports torch before it does anything: about 2 s of CPU on a small machine,
paid once per rank, so that 8 ranks on 2 cores wait 8 s before the first chunk. The local launcher
instead starts one *preload server* per job, which imports the modules the ranks need (``torch``,
the command's modules; never ``mpi4py.MPI``: MPI is initialised in each rank, after the fork), and
listens on a Unix socket in the job directory.

``mpiexec`` still starts one process per rank and owns its PMI identity: that process is the stub
(:mod:`streamring.host.preload_stub`), which sends the server its command line, environment, working
directory, CPU affinity and open file descriptors (stdio and Hydra's PMI socket). The server forks;
the fork takes all of that over (the descriptors at the same numbers) and runs ``python -m
streamring`` (or the script of ``--script PATH``) as the stub would have. So every rank is still its own
process with its own MPI rank; after the fork it shares nothing with the others but copy-on-write pages of
the imported modules.

The stub exits as its fork does and forwards its signals to it; the fork kills itself when its stub
is gone (Hydra's cleanup kills the stubs); the server exits when the launcher does.

A *shared* server (:meth:`PreloadServer.shared`) serves job after job of one rank count: a harness that runs
many short local jobs one after another (a sweep, a test suite) starts one per rank count it uses and exports
them in ``STREAMRING_PRELOAD_SERVER`` (:meth:`PreloadServer.export_env`, entries joined by commas); every local
job of that environment and rank count then forks its ranks from it instead of importing the modules again
(the rank count is the server's: libraries fix defaults from it when they load, see ``MPI_LOCALNRANKS``
below). It serves one job at a time: a stub of another job while ranks of one are alive is refused (its rank
starts as a plain interpreter), so the launcher's account of the files its job holds (the server's forks while
it runs) is never another job's. Its modules were imported in its own
environment: export it only to jobs that would import them the same way. The launcher
counts the server's process tree as part of the job (its files are recorded and removed, its
processes reaped). ``STREAMRING_PRELOAD=0`` turns it off: every rank is then a fresh interpreter.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import warnings
from pathlib import Path

from .jobstate import JOB_DIR_ENV
from .preload_stub import PARENT_ENV, SOCKET_ENV

#: ``STREAMRING_PRELOAD=0`` starts every rank as a fresh interpreter.
PRELOAD_ENV = "STREAMRING_PRELOAD"
#: The stub, run by path (it must not import the package: that would cost what preloading saves).
STUB = Path(__file__).with_name("preload_stub.py")
#: Set in a preloaded rank (the launcher's summary and the tests read it).
PRELOADED_ENV = "STREAMRING_PRELOADED"
#: Shared servers, ``PID:RANKS:SOCKET`` each, comma-separated (:meth:`PreloadServer.export_env`): the local
#: launcher forks a job's ranks from the one of its rank count.
SHARED_ENV = "STREAMRING_PRELOAD_SERVER"

_HIGH_FD = 1024  # where a fork parks its descriptors while it moves the stub's into place
_PR_SET_PDEATHSIG = 1


def preload_enabled(env=None) -> bool:
    """Whether the local launcher preloads its ranks (``STREAMRING_PRELOAD`` unset or not ``0``)."""
    return (os.environ if env is None else env).get(PRELOAD_ENV, "1") != "0"


class PreloadServer:
    """The launcher's handle on a job's preload server (a child process in a session of its own)."""

    def __init__(self, job_dir: Path, modules: tuple[str, ...], env: dict, num_ranks: int, argv: list[str]):
        self.path = str(job_dir / "preload.sock")
        self.num_ranks = num_ranks
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # bound and listening before mpiexec starts: a stub's connect succeeds at once (the backlog
        # holds it) while the server is still importing
        listener.bind(self.path)
        listener.listen(1024)
        # Libraries fix some defaults when they load, from the environment: MKL (torch's CPU build) runs one
        # thread per process when it finds MPI_LOCALNRANKS, which Hydra sets in every rank. The server loads
        # them for the ranks, so it loads them in a rank's environment in that respect.
        server_env = {**env, "MPI_LOCALNRANKS": str(num_ranks)}
        try:
            self.proc = subprocess.Popen(
                # (the ranks' command line after "--" only names the job in `ps`: a fork keeps this one)
                [sys.executable, "-m", "streamring.host.preload", str(listener.fileno()), *modules, "--", *argv],
                pass_fds=(listener.fileno(),), env=server_env, start_new_session=True, stdin=subprocess.DEVNULL)
        finally:
            listener.close()

    @classmethod
    def shared(cls, directory: Path, modules: tuple[str, ...], env: dict, num_ranks: int) -> "PreloadServer":
        """A server for job after job of ``num_ranks`` local ranks (module doc), listening in ``directory``;
        ended by :meth:`stop` or with the process that started it."""
        return cls(directory, modules, env, num_ranks, [f"(shared, {num_ranks} ranks)"])

    def export_env(self) -> dict:
        """What a job's environment holds to fork from this (shared) server."""
        return {SHARED_ENV: f"{self.proc.pid}:{self.num_ranks}:{self.path}"}

    def rank_env(self) -> dict:
        """What the stubs need in their environment."""
        return {SOCKET_ENV: self.path}

    def stop(self) -> None:
        """End the server (its forks end with their stubs)."""
        for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
            if self.proc.poll() is not None:
                return
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


class SharedServer:
    """A job's handle on a shared server found in its environment (:data:`SHARED_ENV`): the server is not the
    job's to stop; its forks are the job's ranks while the job runs (it serves one job at a time)."""

    def __init__(self, pid: int, path: str):
        self.pid, self.path = pid, path

    @classmethod
    def from_env(cls, env, num_ranks: int) -> "SharedServer | None":
        """The running shared server of ``num_ranks`` ranks that ``env`` names; else None (the job starts a server
        of its own)."""
        for entry in filter(None, env.get(SHARED_ENV, "").split(",")):
            pid, ranks, path = (entry.split(":", 2) + ["", ""])[:3]
            if not (pid.isdigit() and ranks == str(num_ranks) and os.path.exists(path)):
                continue
            try:
                os.kill(int(pid), 0)
            except OSError:
                continue
            return cls(int(pid), path)
        return None

    def rank_env(self) -> dict:
        return {SOCKET_ENV: self.path}

    def stop(self) -> None:
        """Nothing: the server serves the next job (the job's forks end with their stubs)."""


def _send_all(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass  # the stub is gone: its fork sees that and ends itself


def _receive_request(conn: socket.socket):
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 256)
    if len(data) < 4:
        raise ConnectionError("short preload request")
    size = struct.unpack("!I", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ConnectionError("preload request cut short")
        data += more
    return json.loads(data), fds


def _become_rank(conn: socket.socket, request: dict, fds: list[int], close: list[int]) -> None:
    """In the fork: take over the stub's descriptors, environment and place, then run the rank."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in close:  # the listening socket, other stubs' connections
            try:
                os.close(fd)
            except OSError:
                pass
        # park every received descriptor (and the connection) above the numbers they move to, then place them
        parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _HIGH_FD) for fd in fds]
        for fd in fds:
            os.close(fd)
        link = socket.socket(fileno=fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD_CLOEXEC, _HIGH_FD))
        conn.close()
        for target, fd in zip(request["fds"], parked):
            os.dup2(fd, target, inheritable=True)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[PRELOADED_ENV] = "1"
        os.environ[PARENT_ENV] = str(request["parent"])
        os.chdir(request["cwd"])
        os.sched_setaffinity(0, request["affinity"])
        sys.argv = list(request["argv"])

        def watch_stub():  # Hydra's cleanup kills the stub: then this rank must not outlive it
            try:
                while link.recv(64):
                    pass
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch_stub, name="preload-stub-watch", daemon=True).start()
        code = _run_main(request)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception of a plain interpreter
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        if "path" in request:
            _end_as_an_interpreter()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _run_main(request: dict) -> int:
    """Run the rank's ``__main__`` (``python -m MODULE`` or ``python PATH``); its exit code."""
    import runpy

    try:
        if "path" in request:  # ``python PATH``: the script's directory first on the path, as there
            sys.path[0] = os.path.dirname(os.path.realpath(request["path"]))
            runpy.run_path(request["path"], run_name="__main__")
        else:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def _end_as_an_interpreter() -> None:
    """What a plain interpreter does at its end and ``os._exit`` skips, for a script's rank: the ``atexit``
    functions, then mpi4py's ``MPI_Finalize`` (registered with ``Py_AtExit``). Without it a plain ``mpiexec``
    (no ``-disable-auto-cleanup``) takes a rank that ends while others still run for a failed one and kills them."""
    try:
        import atexit

        atexit._run_exitfuncs()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except BaseException:  # noqa: BLE001 - as an interpreter reports an error at its exit
        import traceback

        traceback.print_exc()


def serve(listen_fd: int, modules: list[str]) -> None:
    """The server's loop: import ``modules``, then fork a rank per stub until the launcher is gone."""
    launcher = os.getppid()
    try:  # the kernel ends us if the launcher dies without stopping us
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    listener = socket.socket(fileno=listen_fd)
    for name in modules:
        importlib.import_module(name)
    if "mpi4py.MPI" in sys.modules:  # MPI must be initialised in each rank, after its fork
        raise RuntimeError("a preloaded module imported mpi4py.MPI; the ranks cannot share an MPI_Init")
    ranks: dict[int, socket.socket] = {}  # fork pid -> its stub's connection
    job = None  # the job (its folder, JOB_DIR_ENV) the live forks belong to
    while os.getppid() == launcher:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            conn, _ = listener.accept()
            try:
                request, fds = _receive_request(conn)
            except (OSError, ValueError, ConnectionError) as exc:
                print(f"streamring preload: a bad request ({exc}); its stub starts the rank itself", file=sys.stderr)
                conn.close()
                continue
            asker = request["env"].get(JOB_DIR_ENV)
            if ranks and asker != job:  # one job at a time (module doc): the stub starts its rank itself
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            job = asker
            close = [listener.fileno(), *(c.fileno() for c in ranks.values())]
            with warnings.catch_warnings():
                # (Python >= 3.12 warns on fork with threads running: ours are the BLAS pool's, idle,
                # and it re-creates its pool in the child; no Python thread runs here)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                _become_rank(conn, request, fds, close)
            for fd in fds:
                os.close(fd)
            ranks[pid] = conn
            _send_all(conn, struct.pack("!q", pid))
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = ranks.pop(pid, None)
            if conn is not None:
                _send_all(conn, struct.pack("!i", status))
                conn.close()


if __name__ == "__main__":
    args = sys.argv[2:]
    serve(int(sys.argv[1]), args[:args.index("--")] if "--" in args else args)
