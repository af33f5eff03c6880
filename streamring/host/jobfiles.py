"""The files an MPI job leaves behind when it is aborted, and how we find exactly ours.

MPICH's ranks share ``/dev/shm/mpich_shm_*`` (and Open MPI's ``sm_segment.*``/
``vader_segment.*``); Hydra's proxy writes the node topology to
``/tmp/hydra_hwloc_xmlfile_*`` (a fixed ``/tmp``, it ignores ``TMPDIR``). A job that
ends normally removes them; a job that is aborted, killed or interrupted does not.
Other jobs on the machine make the same names, so nothing is removed by name or by
a before/after listing: the launcher records the files that the processes of *its*
job (``mpiexec`` and every descendant) hold open or map while they run, and removes
those that are left when the job has ended. A rank that aborts removes the names of
the files its own job holds before the abort tears the job down (under a plain
``mpirun`` there is no launcher of ours to do it). After a failed job the launcher also removes the
segments this user made while the job ran that no process holds any more (:func:`orphaned_files`):
a job that dies inside the MPI call making a window can end before a scan saw the segment.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .preload_stub import PARENT_ENV

SHM_DIR = "/dev/shm"
SHM_PREFIXES = ("mpich_shm_", "mpich_shar_tmp", "sm_segment.", "vader_segment.")
TMP_PREFIXES = ("hydra_hwloc_xmlfile_",)
TMP_DIRS = tuple(sorted({"/tmp", tempfile.gettempdir()}))


def is_mpi_job_file(path: str) -> bool:
    """A shared-memory segment of the MPI library or a temporary file of its launcher (by location and prefix)."""
    d, name = os.path.split(path)
    if d == SHM_DIR:
        return name.startswith(SHM_PREFIXES)
    return d in TMP_DIRS and name.startswith(TMP_PREFIXES)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (``/proc/PID/task/*/children``)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant."""
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        todo += children(pid)
    return seen


def start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks): with the pid, a process's identity."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def held_files(pid: int, wanted=is_mpi_job_file, maps_dir: str = SHM_DIR) -> set[str]:
    """The files ``wanted`` accepts (MPI job files by default) that ``pid`` holds open or maps now
    (deleted ones left out; a mapping counts only in ``maps_dir``, the shared-memory directory)."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if not target.endswith(" (deleted)") and wanted(target):
                found.add(target)
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                if maps_dir in line and not line.rstrip().endswith("(deleted)"):
                    path = line.split(None, 5)[-1].strip()
                    if wanted(path):
                        found.add(path)
    except OSError:
        pass
    return found


class JobFiles:
    """Records the MPI job files held by process trees (the launcher's ``mpiexec``, and its preload server if
    any) and removes the leftovers."""

    def __init__(self, *root_pids: int, more_roots=None):
        """The trees of ``root_pids`` and of the pids ``more_roots()`` returns at each scan (the job's ranks that
        are no descendants of the roots: forks of a shared preload server, which outlives the job)."""
        self.root_pids, self.more_roots = root_pids, more_roots
        self.seen: set[str] = set()
        self.procs: dict[int, str] = {}  # every process of the tree seen, pid -> start time (its identity)

    def _pids(self) -> list[int]:
        roots = [*self.root_pids, *(self.more_roots() if self.more_roots is not None else ())]
        return list(dict.fromkeys(p for root in roots for p in process_tree(root)))

    def scan(self) -> None:
        """Record the tree and what it holds now (call it while the job runs; a few /proc reads per process)."""
        for pid in self._pids():
            start = start_time(pid)
            if start is not None:
                self.procs.setdefault(pid, start)
            self.seen |= held_files(pid)

    def alive(self) -> list[int]:
        """Recorded processes still running (the same processes: pid and start time match; zombies excluded)."""
        out = []
        for pid, start in self.procs.items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] not in ("Z", "X") and fields[19] == start:
                out.append(pid)
        return out

    def remove_leftovers(self) -> list[str]:
        """Remove every recorded file that still exists (call it after the job ended); returns them."""
        removed = []
        for path in sorted(self.seen):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue
        return removed


def orphaned_files(since: float, directory: str = SHM_DIR) -> list[str]:
    """Shared-memory segments of an MPI library (``SHM_PREFIXES`` in ``directory``) that this user
    made at or after ``since`` (``time.time()``) and that no process holds open or maps now.

    A job can die while one of its windows is being made: MPICH's local root creates the segment,
    every local rank maps it, and the root unlinks it once all of them have; a rank that fails
    before mapping it stops the others inside that one MPI call, and a job that ends within one of
    :meth:`JobFiles.scan`'s periods of the segment's creation leaves it unseen. Such a file is
    nobody's: from its creation to its unlink some process holds it (the creator's descriptor, then
    the mappings), and a live job of another user cannot hold a file of this user's (``mkstemp``
    makes it 0600). The directory is listed before the processes are read, so a segment made
    in between is not looked at."""
    uid = os.getuid()
    candidates = set()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if name.startswith(SHM_PREFIXES):
            path = os.path.join(directory, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if st.st_uid == uid and st.st_ctime >= since:
                candidates.add(path)
    if not candidates:
        return []
    held: set[str] = set()
    for pid in os.listdir("/proc"):  # (every process this user may read: see above for other users')
        if pid.isdigit():
            held |= held_files(int(pid), candidates.__contains__, directory)
    return sorted(candidates - held)


def launching_parent() -> int:
    """The pid of the process that started this rank: Hydra's proxy (for a preloaded rank, its stub's
    parent; see :mod:`streamring.host.preload`)."""
    return int(os.environ.get(PARENT_ENV) or os.getppid())


def unlink_own_job_files() -> list[str]:
    """In a rank that aborts: remove the names of its job's files (the mappings stay valid until exit).

    The rank's own shared-memory segments (from its maps) and its parent's (Hydra's proxy)
    temporary files. Every rank of the job mapped the segments during ``MPI_Init``, and the
    job is about to be torn down, so nobody opens them by name again.
    """
    paths = held_files(os.getpid()) | held_files(launching_parent())
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed
