"""The process that Hydra starts for a preloaded rank (see :mod:`streamring.host.preload`).

Run by path (``python .../preload_stub.py ARGS``), standard library only, so it starts in a few
milliseconds. It hands what makes it this rank (its command line, environment, working directory,
CPU affinity and every open file descriptor: stdio and Hydra's PMI socket) to the preload server named
by ``STREAMRING_PRELOAD_SOCKET``, whose fork becomes the rank; then it forwards the signals it gets to
that fork and exits as the fork did (the same exit code, or killed by the same signal), so that
``mpiexec`` sees what it would have seen of a plain rank. The fork watches this process: if it is
killed (``SIGKILL`` from Hydra's cleanup), the fork kills itself.

``preload_stub.py --script PATH ARGS`` stands for ``python PATH ARGS`` instead (the test suite's
``mpiexec -n N python SCRIPT`` jobs, tests/conftest.py): the fork runs the script as ``__main__``.

With no server to talk to (it could not start, or is gone) it becomes a plain rank: it executes
``python -m streamring ARGS`` (or ``python PATH ARGS``) itself, after saying so on stderr.
"""

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "STREAMRING_PRELOAD_SOCKET"
#: In a preloaded rank: the pid of its stub's parent (Hydra's proxy), which a plain rank's parent would be.
PARENT_ENV = "STREAMRING_RANK_PARENT_PID"
#: Signals passed on to the rank. Not SIGUSR1: Hydra (``-disable-auto-cleanup``) sends it to every process
#: of the job when one exits, and MPICH's handler in a rank takes it only until ``MPI_Finalize``; forwarded
#: late (this stub outlives its rank by a poll), it would kill a rank that is past its finalize.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCONT)
#: First argument: the rank runs the script named next (``python PATH ARGS``), not ``python -m streamring``.
SCRIPT_ARG = "--script"


def _rank_argv() -> list[str]:
    """The rank's command line as a plain interpreter would run it, after ``python``."""
    args = sys.argv[1:]
    return args[1:] if args[:1] == [SCRIPT_ARG] else ["-m", "streamring", *args]


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            part = sock.recv(n - len(buf))
        except InterruptedError:
            continue
        if not part:
            return None
        buf += part
    return buf


def _open_fds(skip: int) -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == skip:
            continue
        try:
            os.fstat(fd)  # (the listing's own descriptor is closed by now)
        except OSError:
            continue
        fds.append(fd)
    return sorted(fds)


def _plain_rank(why: str) -> None:
    print(f"streamring preload: {why}; starting this rank without it", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, *_rank_argv()])


def main() -> None:
    path = os.environ.pop(SOCKET_ENV, None)
    if not path:
        _plain_rank(f"{SOCKET_ENV} is not set")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        _plain_rank(f"cannot reach the preload server at {path} ({exc})")
    fds = _open_fds(sock.fileno())
    argv = _rank_argv()
    what = {"module": "streamring", "argv": ["streamring", *argv[2:]]} if argv[0] == "-m" else \
        {"path": argv[0], "argv": argv}
    request = json.dumps({**what, "env": dict(os.environ),
                          "cwd": os.getcwd(), "fds": fds, "parent": os.getppid(), "affinity": sorted(os.sched_getaffinity(0))}).encode()
    socket.send_fds(sock, [struct.pack("!I", len(request)) + request], fds)
    got = _recv_exact(sock, 8)
    if got is None:
        _plain_rank("the preload server closed the connection before starting the rank")
    pid = struct.unpack("!q", got)[0]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # (see FORWARDED)
    got = _recv_exact(sock, 4)
    if got is None:  # the server died before the rank ended: the rank's fate is unknown
        print(f"streamring preload: the preload server is gone; rank process {pid} is being killed",
              file=sys.stderr, flush=True)
        forward(signal.SIGKILL, None)
        sys.exit(1)
    status = struct.unpack("!i", got)[0]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
