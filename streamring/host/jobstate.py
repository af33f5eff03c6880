"""Per-job bookkeeping shared by the local launcher and its ranks.

The launcher creates a job directory (``STREAMRING_JOB_DIR``); every rank
that can see it writes ``rank-R.pid`` (pid and hostname) at start and
``rank-R.status`` when it ends (``ok`` or the error). After the job the
launcher names the ranks that never reported (killed or crashed), and a rank
whose watchdog fires names the peers that are not running (dead, zombie or
stopped) next to the slot states. A process's state is read from ``/proc``,
so only peers on the reader's own host are inspected: another host's pid
means nothing here (on simulated hosts, network namespaces sharing one
``/proc``, it would be an answer no real host could give). On a cluster the
job directory is seen by the ranks of the launcher's host only, unless it
lies on a shared file system (``TMPDIR``).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

JOB_DIR_ENV = "STREAMRING_JOB_DIR"
# A peer on another host, named by the transport (PeerUnreachable: its connection was reset) or by a
# blocked-call watchdog (it makes no progress); the host is the second group.
_NAMED_PEER = re.compile(r"peer rank (\d+) unreachable \(host ([^,)\s]+)|towards rank (\d+) \(host ([^)\s]+)\): that peer")
_HOST = socket.gethostname()


def job_dir() -> Path | None:
    d = os.environ.get(JOB_DIR_ENV)
    return Path(d) if d and Path(d).is_dir() else None


def register_rank(rank: int) -> None:
    """Record this rank's pid (no-op outside the local launcher)."""
    d = job_dir()
    if d is not None:
        (d / f"rank-{rank}.pid").write_text(f"{os.getpid()} {_HOST}")


def record_job_files(rank: int) -> None:
    """Record the MPI job files this rank maps now (``rank-R.files``; no-op outside the local launcher).

    Called after each symmetric-heap allocation: a window's shared-memory segment may be made, and
    the job killed, between two of the launcher's own scans of the job's processes; the launcher
    removes what the ranks recorded as well as what it saw."""
    d = job_dir()
    if d is not None:
        from .jobfiles import held_files

        (d / f"rank-{rank}.files").write_text("\n".join(sorted(held_files(os.getpid()))))


def recorded_job_files(d: Path) -> set[str]:
    """Every path the ranks recorded with :func:`record_job_files`."""
    out: set[str] = set()
    for p in d.glob("rank-*.files"):
        try:
            out |= {line for line in p.read_text().splitlines() if line}
        except OSError:
            continue
    return out


def _read_pid_file(p: Path) -> tuple[int, str] | None:
    """``(pid, hostname)`` from a ``rank-R.pid`` file (hostname '' when absent); None if unreadable."""
    try:
        words = p.read_text().split()
        return int(words[0]), (words[1] if len(words) > 1 else "")
    except (OSError, ValueError, IndexError):
        return None


def rank_pids(d: Path, num_ranks: int) -> list[int]:
    """The pids the ranks of the job folder ``d`` recorded (:func:`register_rank`), those on this host."""
    entries = (_read_pid_file(d / f"rank-{r}.pid") for r in range(num_ranks))
    return [e[0] for e in entries if e is not None and _on_this_host(e[1])]


def _on_this_host(host: str) -> bool:
    return host in ("", _HOST)


def report_status(rank: int, status: str) -> None:
    """Record how this rank ended (``ok`` or an error line)."""
    d = job_dir()
    if d is not None:
        (d / f"rank-{rank}.status").write_text(status[:50000])


def _proc_state(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(None, 1)[1]
    except OSError:
        return "not running"
    return "unknown"


def _is_down(state: str) -> bool:
    """Dead, zombie or stopped (SIGSTOP / traced)."""
    return state == "not running" or state[:1] in ("Z", "X", "T", "t")


def peer_report(num_ranks: int) -> str:
    """One line per peer that is not running normally (dead, zombie, stopped); '' if all look alive."""
    d = job_dir()
    if d is None:
        return ""
    lines = []
    for r in range(num_ranks):
        p = d / f"rank-{r}.pid"
        if not p.exists():
            lines.append(f"  rank {r}: never registered")
            continue
        entry = _read_pid_file(p)
        if entry is None or not _on_this_host(entry[1]):
            continue  # another host's process: its state cannot be read from here
        pid = entry[0]
        state = _proc_state(pid)
        if _is_down(state):
            lines.append(f"  rank {r} (pid {pid}): {state}")
    return ("peers not running normally:\n" + "\n".join(lines)) if lines else ""


def ranks_not_ok(d: Path, num_ranks: int) -> dict[int, str]:
    """``{rank: how it ended}`` of the ranks known not to have ended well: an error line, or ``"no
    report"`` for a rank that registered and never reported (killed, crashed, or ended by the job's
    abort). A rank that never registered is not listed: on another host the job directory is not
    visible (see the module docstring), so its silence says nothing."""
    out = {}
    for r in range(num_ranks):
        st, pid = d / f"rank-{r}.status", d / f"rank-{r}.pid"
        text = st.read_text() if st.exists() else None
        if text is None and pid.exists():
            out[r] = "no report"
        elif text is not None and text != "ok":
            out[r] = ((text.splitlines() or ["(no message)"])[0])[:200]
    return out


def rank_errors(d: Path, num_ranks: int) -> dict[int, str]:
    """``{rank: its whole error report}`` of the ranks that reported an error (not ``"ok"``)."""
    out = {}
    for r in range(num_ranks):
        st = d / f"rank-{r}.status"
        text = st.read_text() if st.exists() else None
        if text is not None and text != "ok":
            out[r] = text
    return out


def ranks_down(d: Path, num_ranks: int) -> list:
    """``[(rank, pid, state), ...]`` of the ranks dead, zombie or stopped without having reported."""
    down = []
    for r in range(num_ranks):
        p, st = d / f"rank-{r}.pid", d / f"rank-{r}.status"
        if not p.exists() or st.exists():
            continue
        entry = _read_pid_file(p)
        if entry is None or not _on_this_host(entry[1]):
            continue
        pid = entry[0]
        state = _proc_state(pid)
        if _is_down(state):
            down.append((r, pid, state))
    return down


def summarize(d: Path, num_ranks: int, first_down=None, interrupted: str = "") -> list[str]:
    """After a failed job: how each rank ended, and which rank failed first.

    ``interrupted`` (e.g. ``"Ctrl-C"``) says the launcher itself ended the job: then no
    rank is blamed; only errors that ranks had reported before are shown.

    The launcher polls the ranks while the job runs and records the ranks first
    seen dead or stopped without having reported (``first_down``: a list; more
    than one when they went down within one poll, then the failed rank is one
    of them); a rank whose watchdog fired names the peers it found dead or
    stopped. Ranks that never reported and that neither names were ended by
    the job's abort.
    """
    statuses = {}
    for r in range(num_ranks):
        st = d / f"rank-{r}.status"
        statuses[r] = st.read_text() if st.exists() else None
    if interrupted:
        return _interrupted_summary(statuses, interrupted)
    named, lost_hosts = _named_in_reports(statuses)
    first_down = list(first_down or [])
    out = _first_down_lines(first_down)
    named.update(r for r, _, _ in first_down)
    first_ranks = {r for r, _, _ in first_down} if len(first_down) == 1 else set()
    reported_error = any(t not in (None, "ok") for t in statuses.values())
    silent = [r for r in range(num_ranks) if statuses[r] is None]
    if not named and not reported_error and len(silent) > 1:
        # Nobody reported and the launcher never saw one go first: mpiexec ended them all at once.
        return [f"ranks {silent} ended without reporting, all within one poll (mpiexec tore the job down): "
                f"the failed rank is among them"]
    # Under Hydra a rank killed by a signal takes its host's other ranks with it (its proxy
    # SIGKILLs them), so a peer that became unreachable may not be the one that failed first.
    hosts = {r: (e[1] if (e := _read_pid_file(d / f"rank-{r}.pid")) else "") for r in range(num_ranks)}
    lost = {r for r in range(num_ranks) if statuses[r] is None and hosts[r] in lost_hosts}
    for host in sorted(lost_hosts):
        on_host = sorted(r for r in lost if hosts[r] == host)
        if len(on_host) > 1:
            out.append(f"ranks {on_host} on host {host} became unreachable together (the process manager ends a "
                       f"host's ranks when one of them is killed): the failed rank is among them")
    named |= lost
    return out + _rank_lines(d, statuses, named, first_ranks, reported_error)


def _interrupted_summary(statuses: dict, interrupted: str) -> list[str]:
    """The summary of a job the launcher ended itself (``interrupted`` says how): which ranks were still running,
    and the errors that ranks had reported before; no rank is blamed."""
    running = [r for r, text in statuses.items() if text is None]
    failed = [r for r, text in statuses.items() if text not in (None, "ok")]
    out = [f"interrupted ({interrupted}): the launcher stopped the job" +
           (f"; ranks {running} were still running and were ended with it" if running else "") +
           ("" if failed else "; no rank had failed")]
    for r in failed:
        out.append(f"rank {r} had already stopped with: {(statuses[r].splitlines() or ['(no message)'])[0]}")
    return out


def _named_in_reports(statuses: dict) -> tuple[set, set]:
    """``(ranks, hosts)`` that the ranks' reports name: the peers a watchdog found not running (``rank R (pid
    P): ...`` lines) and those the transport or a blocked-call watchdog named (:data:`_NAMED_PEER`); the hosts
    are those of the peers whose connection was reset (every rank there may be gone)."""
    named, lost_hosts = set(), set()
    for text in statuses.values():
        for line in (text or "").splitlines():
            line = line.strip()
            if line.startswith("rank ") and "(pid " in line and "):" in line:
                named.add(int(line.split()[1]))
            for r_reset, host_reset, r_stuck, _ in _NAMED_PEER.findall(line):
                named.add(int(r_reset or r_stuck))
                if r_reset:
                    lost_hosts.add(host_reset)
    return named, lost_hosts


def _first_down_lines(first_down: list) -> list[str]:
    """What the launcher's polls saw first: the one rank that stopped running first (the failed rank), or the
    ranks that stopped within one poll (the failed rank among them); nothing when it saw none."""
    if len(first_down) == 1:
        r0, pid0, state0 = first_down[0]
        return [f"rank {r0} (pid {pid0}) was the first rank to stop running ({state0}): the failed rank"]
    if first_down:
        return [f"ranks {[r for r, _, _ in first_down]} stopped running at the same moment (mpiexec tore the job "
                f"down): the failed rank is among them"]
    return []


def _rank_lines(d: Path, statuses: dict, named: set, first_ranks: set, reported_error: bool) -> list[str]:
    """One line per rank that did not end well, in rank order: its error (the first error report in full), or,
    for a rank that never reported, whether it is the failed rank (``named``, or every silent rank when nothing
    was named or reported) or was ended by the job's abort; the rank of ``first_ranks`` is said already."""
    out = []
    # The first error report in full (watchdog slot dump): a rank's own stderr can be
    # lost when mpiexec tears the job down right after its abort.
    full = next(((r, t) for r, t in statuses.items() if t not in (None, "ok")), None)
    for r, text in statuses.items():
        entry = _read_pid_file(d / f"rank-{r}.pid")
        pid = "?" if entry is None else (f"{entry[0]}" if _on_this_host(entry[1]) else f"{entry[0]} on {entry[1]}")
        if text is not None:
            if text != "ok":
                if full is not None and r == full[0] and len(text.splitlines()) > 1:
                    out.append(f"rank {r} (pid {pid}) stopped with:\n    " + "\n    ".join(text.splitlines()))
                else:
                    out.append(f"rank {r} (pid {pid}) stopped with: {(text.splitlines() or ['(no message)'])[0]}")
        elif r in first_ranks:
            continue
        elif r in named or not (named or reported_error):
            out.append(f"rank {r} (pid {pid}) died or hung without reporting (killed, crashed or stopped): "
                       f"the failed rank")
        else:
            out.append(f"rank {r} (pid {pid}) was ended by the job abort")
    return out
