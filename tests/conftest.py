"""Helpers: every multi-rank test starts real processes (mpiexec of mpi4py's MPI)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


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


def _run(cmd, timeout, env) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout take the whole group (and its MPI job) down."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env), cwd=ROOT,
                            start_new_session=True)
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


@pytest.fixture
def cli(tmp_path):
    """Run ``python -m streamring ARGS`` (it starts its own ranks); returns a :class:`Result`."""

    def run(*args, timeout=240, env=None, json_out=True):
        jp = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.json"
        cmd = [sys.executable, "-m", "streamring", *map(str, args)]
        if json_out and args and args[0] in ("run", "stress", "model-check"):
            cmd += ["--json", str(jp)]
        return Result(_run(cmd, timeout, env), jp if json_out else None)

    return run


def mpiexec_path() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


@pytest.fixture
def mpirun():
    """Run ``mpiexec -n N python SCRIPT ARGS`` (the user's `mpirun` path)."""

    def run(n, *args, timeout=240, env=None):
        cmd = [mpiexec_path(), "-n", str(n), sys.executable, *map(str, args)]
        return Result(_run(cmd, timeout, env), None)

    return run
