"""Helpers: every multi-rank test starts real processes (mpiexec of mpi4py's MPI)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def _set_triton_interpreter_off_the_gpu() -> None:
    """Triton reads TRITON_INTERPRET when a module first imports it, and a test module is not the only importer
    (transformers' FP8 integration imports Triton): without a GPU the interpreter is set here, before any test
    module is collected, so the order the tests run in does not decide how the kernels run."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_set_triton_interpreter_off_the_gpu()


def missing_test_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The declared test dependencies (``[project.optional-dependencies] test``) that are not installed
    in a matching version (for this platform's markers)."""
    import importlib.metadata as md

    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest itself depends on tomli there
        import tomli as tomllib
    from packaging.requirements import Requirement  # a dependency of pytest

    missing = []
    for spec in tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["test"]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            missing.append(f"{spec} (not installed)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            missing.append(f"{spec} (found {version})")
    return missing


def pytest_configure(config):
    # A missing test dependency fails the run: a module that needs it must not be skipped silently.
    missing = missing_test_dependencies()
    if missing:
        raise pytest.UsageError("declared test dependencies are missing: " + ", ".join(missing)
                                + " (pip install -e '.[test]')")
    # the emulated device's kernels without the interpreter's work whose result it never uses
    # (tests/helpers/triton_interp_patch.py); in the processes that run tests (not pytest-xdist's controller)
    if os.environ.get("TRITON_INTERPRET") == "1" and (
            hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)):
        from triton_interp_patch import install

        install()
    if hasattr(config, "workerinput"):
        _share_the_cores(config.workerinput["workercount"])


def _share_the_cores(workers: int) -> None:
    """A pytest-xdist worker's torch threads: its share of the cores (tests/run.sh runs one worker per core),
    unless OMP_NUM_THREADS sets them. Each worker's torch would otherwise start a thread per core, and every
    op on a tensor above torch's grain (32k elements: a test's weights, a buffer's rows) waits for a
    thread the other worker's process keeps off its core: measured on the 2-core machine, the four files of
    the emulated device (test_blocks, test_ep_buffer, test_ep_kernels, test_persistent_consumer) took 130
    CPU-s in 2 workers against 93 with one thread each."""
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // max(1, workers)))


# ----------------------------------------------------------------------------------------
# Tiers: the full suite (CI, `bash tests/run.sh`) and the edit loop (`bash tests/run.sh --quick`)
# ----------------------------------------------------------------------------------------
#: Fixtures that start ranks: a test using one is marked ``ranks`` without saying so itself.
RANK_FIXTURES = {"cli", "mpirun", "cluster"}
#: What the edit loop must run besides the in-process tests (``pytest.mark.quick(WHAT)``).
QUICK_MUST_RUN = ("2-rank run", "stress config")
#: A test that takes longer than this says why it must (``pytest.mark.slow(reason=...)``).
SLOW_S = 30.0


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread while a module runs (then as before), for the modules of the emulated device
    (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): Triton's interpreter runs their kernels
    in numpy on one core, and their tensors are small (weights of a few experts, a buffer's rows), so a
    second torch thread adds only its hand-offs: every op above torch's grain (32k elements) waits for it,
    and on the 2-core machine with anything else running that wait is a spin of up to milliseconds
    (MoEWeights.random of 8 experts: 0.14-0.95 s against 0.018 s on one thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", default=False,
                     help="the edit loop: the in-process tests not marked slow, plus the tests marked quick "
                          f"({' and '.join(QUICK_MUST_RUN)})")


def quick_subset(cases, quick, reason: str, ids=None):
    """``cases`` (values, or tuples of values, of one parametrize) as params, every one not in ``quick``
    marked ``slow(reason=reason)``: the edit loop runs the ``quick`` ones, the full run all of them."""
    out = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        marks = [] if case in quick else [pytest.mark.slow(reason=reason)]
        out.append(pytest.param(*values, marks=marks, id=ids[i] if ids else None))
    return out


def in_quick_tier(item) -> bool:
    return item.get_closest_marker("quick") is not None or not (
        item.get_closest_marker("ranks") or item.get_closest_marker("slow"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # after pytest-xdist's worker hook: under --dist loadgroup it names a grouped test by setting
    # ``item._nodeid`` ("<nodeid>@<group>"), but pytest >= 9.2 derives ``nodeid`` from ``item._id``, so the
    # suffix never reaches the scheduler and the groups are split across workers (each then builds the
    # group's shared fixture, e.g. the default-size model check). Carry the suffix into ``_id``.
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        for item in items:
            named = getattr(item, "_nodeid", None)
            if isinstance(named, str) and "@" in named and item.nodeid != named and hasattr(item, "_id"):
                from _pytest.nodeid import coerce_node_id

                item._id = coerce_node_id(named)
    for item in items:
        if RANK_FIXTURES & set(item.fixturenames):
            item.add_marker("ranks")
        slow = item.get_closest_marker("slow")
        if slow is not None and not slow.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: pytest.mark.slow needs reason='why it must take that long'")
        if slow is not None:  # travels with the test's reports (from pytest-xdist's workers too)
            item.user_properties.append((SLOW_REASON_PROPERTY, slow.kwargs["reason"]))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        # pytest-xdist hands tests out in this order: the slow ones first, so that no long test starts last
        # and runs alone at the end (a stable sort: the same order in every worker)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not config.getoption("--quick"):
        return
    keep = [item for item in items if in_quick_tier(item)]
    whole_suite = (config.args_source is pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
                   and not config.option.markexpr)
    covered = {m.args[0] for item in keep for m in item.iter_markers("quick")}
    if whole_suite and not set(QUICK_MUST_RUN) <= covered:
        raise pytest.UsageError(f"--quick must run a {' and a '.join(QUICK_MUST_RUN)}; tests marked quick "
                                f"cover only {sorted(covered)}")
    config.hook.pytest_deselected(items=[item for item in items if not in_quick_tier(item)])
    items[:] = keep


SLOW_REASON_PROPERTY = "slow_reason"
_durations: dict = {}  # node id -> seconds (setup + call + teardown)
_reasons: dict = {}  # node id -> its slow(reason=...)


_running_test = [""]  # node id of the test this process runs now (the leak guard names it)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running_test[0] = item.nodeid
    yield
    _running_test[0] = ""


def pytest_runtest_logreport(report):
    # (tests/run.sh runs the tests in pytest-xdist workers: their reports reach this hook in the main
    # process, which collects no items itself, so the reason comes with the report)
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    for name, value in report.user_properties:
        if name == SLOW_REASON_PROPERTY:
            _reasons[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, config):
    """Every test over SLOW_S seconds (setup, call and teardown together), with the reason it gives."""
    long = sorted(((s, nodeid) for nodeid, s in _durations.items() if s > SLOW_S), reverse=True)
    if not long:
        return
    terminalreporter.section(f"tests over {SLOW_S:.0f} s and why they must take that long")
    for s, nodeid in long:
        why = _reasons.get(nodeid, "NO REASON GIVEN: mark it pytest.mark.slow(reason=...)")
        terminalreporter.write_line(f"{s:6.1f}s {nodeid}: {why}")


def wait_until(pred, timeout_s: float, period_s: float = 0.05):
    """Poll ``pred()`` until it is true or ``timeout_s`` has passed; returns its last value.

    Tests wait for a condition this way, never for a fixed time: a fast machine goes on at once,
    a loaded one gets the whole deadline."""
    end = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value or time.monotonic() >= end:
            return value
        time.sleep(period_s)


def error_types(stderr: str) -> set[str]:
    """The exception types the ranks died with (``[streamring rank N] error: TYPE: ...`` lines)."""
    return set(re.findall(r"^\[streamring rank \S+\] error: (\w+):", stderr, flags=re.M))


def _env(extra=None):
    env = dict(os.environ)
    for v in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "HYDRA_CONTROL_FD", "STREAMRING_SPAWNED",
              "TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(v, None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if extra:
        env.update(extra)
    return env


def _run(cmd, timeout, env, started: list[int] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout take the whole group (and its MPI job) down.
    ``started``, if given, receives the process id."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env), cwd=ROOT,
                            start_new_session=True)
    if started is not None:
        started.append(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM lets the local launcher kill its mpiexec session; then SIGKILL the group.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class Result:
    def __init__(self, proc: subprocess.CompletedProcess, json_path: Path | None):
        self.rc = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr
        self.json = json.loads(json_path.read_text()) if json_path and json_path.exists() else None

    def __repr__(self):
        return f"rc={self.rc}\n--- stdout\n{self.out[-4000:]}\n--- stderr\n{self.err[-4000:]}"


#: The rank counts of most :func:`cli` jobs: each gets a shared preload server per worker
SHARED_PRELOAD_RANKS = (2, 3, 4)


@pytest.fixture(scope="session")
def shared_preload(tmp_path_factory):
    """Shared preload servers per worker (:meth:`streamring.host.preload.PreloadServer.shared`), one per rank
    count of :data:`SHARED_PRELOAD_RANKS`, that imported what the ranks of ``streamring run`` and ``stress``
    import: the :func:`cli` jobs of the default environment fork their ranks from the one of their rank count
    (one job at a time, as a worker runs its tests) instead of a server of their own importing torch again,
    about 2.5 CPU-seconds a job. Jobs given an ``env`` start their own (the servers' modules were imported in
    the suite's environment, not theirs)."""
    from streamring.cli import RANK_MODULES
    from streamring.host.preload import SHARED_ENV, PreloadServer

    modules = tuple(dict.fromkeys(RANK_MODULES["run"] + RANK_MODULES["stress"]))
    servers = [PreloadServer.shared(tmp_path_factory.mktemp(f"preload{n}"), modules, _env(), n)
               for n in SHARED_PRELOAD_RANKS]
    yield {SHARED_ENV: ",".join(s.export_env()[SHARED_ENV] for s in servers)}
    for s in servers:
        s.stop()


@pytest.fixture
def cli(tmp_path, shared_preload):
    """Run ``python -m streamring ARGS`` (it starts its own ranks); returns a :class:`Result`."""

    def run(*args, timeout=240, env=None, json_out=True):
        jp = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.json"
        cmd = [sys.executable, "-m", "streamring", *map(str, args)]
        if json_out and args and args[0] in ("run", "stress", "model-check"):
            cmd += ["--json", str(jp)]
        return Result(_run(cmd, timeout, shared_preload if env is None else env), jp if json_out else None)

    return run


def mpiexec_path() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


#: The ``mpirun`` scripts whose ranks import torch (about 2 CPU-seconds per fresh interpreter), and what a
#: preload server imports for them once per job; ``python -m streamring`` jobs (the user's `mpirun` path
#: of test_stress.py and test_prelaunch_checks.py) and the scripts not named here start fresh interpreters.
_TORCH_RANK = ("torch", "numpy", "streamring.device.cpu", "streamring.moe", "streamring.moe.layer",
               "streamring.moe.reference")
MPIRUN_PRELOAD = {
    "mp_scenarios.py": _TORCH_RANK,
    "mp_moe_ops.py": _TORCH_RANK,
    "mp_doc_examples.py": _TORCH_RANK,
    "contract_cases.py": _TORCH_RANK,
    "mp_hf.py": _TORCH_RANK + ("transformers", "transformers.models.deepseek_v3.modeling_deepseek_v3",
                               "streamring.moe.hf"),
}


@pytest.fixture
def mpirun(suite_leaves_no_mpi_files):
    """Run ``mpiexec -n N python SCRIPT ARGS`` (the user's `mpirun` path). A script of
    :data:`MPIRUN_PRELOAD` runs on preloaded ranks: ``mpiexec`` starts a stub per rank, each rank is a fork of
    a server that imported its modules once (the start ``streamring run`` uses; ``STREAMRING_PRELOAD=0``
    in ``env`` starts fresh interpreters).

    A job that fails by ``MPI_Abort`` (a test script's failed check) leaves MPICH's shared-memory
    segment behind: plain ``mpiexec`` has no launcher of streamring's to remove it. The files the
    suite's watcher saw this job's processes hold are removed after a failed job, and the result says
    so, so that the failure shows as itself and not also as the suite's leak guard. A job that
    succeeded keeps its leftovers, for the guard to report. A segment the watcher had no poll to see
    (a job that failed inside the MPI call making it), or that a poll still running when the job ended
    recorded after this run took the job's files, is found as the launcher finds it: made by this user
    while the job ran and held by no process (:func:`streamring.host.jobfiles.orphaned_files`)."""

    def run(n, *args, timeout=240, env=None):
        from streamring.host.jobfiles import orphaned_files
        from streamring.host.preload import STUB, PreloadServer, preload_enabled
        from streamring.host.preload_stub import SCRIPT_ARG

        args = [str(a) for a in args]
        cmd = [mpiexec_path(), "-n", str(n), sys.executable, *args]
        modules = MPIRUN_PRELOAD.get(Path(args[0]).name) if args else None
        server = None
        if modules and preload_enabled(_env(env)):
            # the script's ranks start as forks of a server that imported torch (streamring.host.preload):
            # still one process and one MPI rank each, as `streamring run` starts its own
            job_dir = Path(tempfile.mkdtemp(prefix="streamring-test-job-"))
            server = PreloadServer(job_dir, modules, _env(env), n, args)
            # (-disable-auto-cleanup, as the launcher's preloaded jobs: Hydra's cleanup otherwise kills the other
            # ranks when a stub exits, before its fork's MPI_Finalize reached it; a failed script still ends the
            # job by MPI_Abort, and the timeout below takes down any other)
            cmd = [mpiexec_path(), "-disable-auto-cleanup", "-n", str(n), sys.executable, str(STUB), SCRIPT_ARG, *args]
            env = {**(env or {}), **server.rank_env()}
        started: list[int] = []
        started_at = time.time()
        try:
            proc = _run(cmd, timeout, env, started=started)
        finally:
            if server is not None:
                server.stop()
                shutil.rmtree(job_dir, ignore_errors=True)
        # (popped whatever the outcome: a later job that reuses the process id starts with no files; the
        # preloaded ranks descend from their server, not from mpiexec)
        held = suite_leaves_no_mpi_files.files_by_child.pop(started[0], set()) if started else set()
        if server is not None:
            held |= suite_leaves_no_mpi_files.files_by_child.pop(server.proc.pid, set())
        if proc.returncode != 0:
            left = sorted({f for f in held if os.path.exists(f)} | set(orphaned_files(started_at)))
            for f in left:
                with contextlib.suppress(OSError):
                    os.unlink(f)
            if left:
                proc.stderr += f"\n[tests/conftest.py] the failed job left {left}: removed\n"
        return Result(proc, None)

    return run


# ----------------------------------------------------------------------------------------
# Leftover MPI files: an observer independent of streamring.host.jobfiles (it finds a
# process tree through the ppid of every /proc/PID/stat, not the children files).
# ----------------------------------------------------------------------------------------
def _is_mpi_file(path: str) -> bool:
    d, name = os.path.split(path)
    return (d == "/dev/shm" and name.startswith(("mpich_", "sm_segment.", "vader_segment."))) or \
        (d == "/tmp" and name.startswith("hydra_hwloc_xmlfile_"))


def descendants_by_child(root: int) -> dict[int, int]:
    """``root``'s live descendants (not ``root``), each mapped to the child of ``root`` it descends from,
    from the ppid of every process."""
    children: dict[int, list[int]] = {}
    # (the leak guard runs this 4 times a second over every process of the machine: plain os calls, about
    # a quarter of what pathlib's read_text cost per process; the ppid follows the ")" that ends the name)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
                try:
                    data = os.read(fd, 4096)
                finally:
                    os.close(fd)
                ppid = int(data.rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out: dict[int, int] = {}
    todo = [(c, c) for c in children.get(root, [])]
    while todo:
        p, top = todo.pop()
        if p not in out:
            out[p] = top
            todo.extend((c, top) for c in children.get(p, []))
    return out


def descendants(root: int) -> set[int]:
    """``root``'s live descendants (not ``root``), from the ppid of every process."""
    return set(descendants_by_child(root))


def files_held(pid: int) -> set[str]:
    """MPI files (see :func:`_is_mpi_file`) that ``pid`` has open or mapped."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                t = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if _is_mpi_file(t):
                found.add(t)
        maps = Path(f"/proc/{pid}/maps").read_bytes()
        # (the suite polls every process it started 4 times a second: a rank's maps run to hundreds of
        # lines, so they are parsed only where an MPI file's directory appears in them at all)
        if b"/dev/shm/" in maps or b"/tmp/" in maps:
            for line in maps.decode(errors="replace").splitlines():
                path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if _is_mpi_file(path.strip()):
                    found.add(path.strip())
    except OSError:
        pass
    return found


class FileWatcher:
    """Records, every ``period_s``, the MPI files held by the descendants of ``root``."""

    def __init__(self, root: int, period_s: float = 0.2):
        self.root, self.period_s = root, period_s
        self.files: set[str] = set()
        self.files_by_child: dict[int, set[str]] = {}  # the same files, by the child of root whose tree held them
        self.first_seen_in: dict[str, str] = {}  # file -> the test running when it was first seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.period_s)

    def poll(self):
        for pid, child in descendants_by_child(self.root).items():
            held = files_held(pid)
            if held:
                for f in held - self.files:
                    self.first_seen_in[f] = _running_test[0] or "(between tests)"
                self.files |= held
                self.files_by_child.setdefault(child, set()).update(held)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def leftovers(self) -> list[str]:
        return sorted(f for f in self.files if os.path.exists(f))


@pytest.fixture(scope="session", autouse=True)
def suite_leaves_no_mpi_files():
    """The whole suite: every MPI file held by a process the tests started is gone at the end."""
    with FileWatcher(os.getpid(), period_s=0.25) as w:
        yield w
    # (a job's files are removed by its launcher before it exits; the deadline covers a slow unlink)
    wait_until(lambda: not w.leftovers(), 5.0)
    left = w.leftovers()
    assert not left, "the test suite left MPI files behind: " + \
        ", ".join(f"{f} (first seen during {w.first_seen_in.get(f, '?')})" for f in left)

# How each `streamring stress --inject MODE` must fail, in rank order and in ready order alike: the
# violation kinds its checkers must report in the JSON; or, where a consumer reads before the publish
# (skip-acquire, ignore-epoch), the owner's drain waiting forever. Such a consumer may acknowledge a chunk
# before its owner cleared the mask for it (rule 4 assumes the acquire); the owner's clearing then wipes
# the acknowledgement and its watchdog fires in the drain. Nothing else counts: a crash is not a catch.
STRESS_INJECT_EXPECTED = {
    "skip-acquire": ({"stale_or_torn"}, "for drain: acknowledgements"),
    "signal-before-payload": ({"stale_or_torn"}, None),
    "skip-ack-wait": ({"early_reuse"}, None),
    "ignore-epoch": ({"stale_or_torn"}, "for drain: acknowledgements"),
}


def assert_stress_mutation_caught(r: Result, mode: str) -> None:
    """``r`` (a stress run with ``--inject mode``) failed the way ``mode`` must fail, and no other way."""
    kinds_needed, drain_wait = STRESS_INJECT_EXPECTED[mode]
    assert r.rc == 1, r
    # the last line says the FAIL is the expected result (rank 0's report, or the local launcher's from the
    # ranks' errors)
    caught = f"the injected bug ({mode}) was caught, as intended"
    if r.json is not None:
        assert r.json["config"]["stress"]["inject"] == mode and r.json["violations"] > 0, r
        kinds = set().union(*(x["violation_kinds"] for x in r.json["ranks"]))
        assert kinds_needed <= kinds, (mode, kinds, r)
        assert caught in r.out.strip().splitlines()[-1], r
        return
    died = error_types(r.err)
    # WaitTimeout: a rank whose peer died first times out in a collective; it is never the only error.
    assert drain_wait and "WatchdogError" in died and died <= {"WatchdogError", "WaitTimeout"}, (mode, died, r)
    assert drain_wait in r.err and "route_ready_gen" in r.err and "missing acks" in r.err, r
    assert caught in r.err.strip().splitlines()[-1], r
