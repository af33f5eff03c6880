"""launch/: every script checks its tools before it does anything, and a missing one is one line naming it and
the command that fixes it, with exit status 2 (launch/preflight.sh). Here, on a machine without the GPU tools,
the scripts run in a copy of launch/ (a checkout without .venv or .whl) or with the venv's python first on
PATH, and stop at their first missing tool. (tests/ranks/test_launch.py runs launch/mpirun.sh for real.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

LAUNCH = ROOT / "launch"
SOURCED = {"preflight.sh", "device_env.sh"}  # sourced by the others, not run
WRAPPERS = {"mps_rank_env.sh"}  # a rank's command prefix inside a device script's mpiexec line, not run alone
SCRIPTS = sorted(p.name for p in LAUNCH.glob("*.sh") if p.name not in SOURCED | WRAPPERS) + ["slurm.sbatch"]
ARGS = {"mpirun.sh": ["2", "run"], "torchrun.sh": ["2", "run"]}
DEVICE = sorted(p.name for p in LAUNCH.glob("*.sh") if re.search(r"^\. launch/device_env\.sh", p.read_text(), re.M))
VENV_BIN = str(Path(sys.executable).parent)
SYSTEM_PATH = "/usr/bin:/bin"
FAIL_LINE = re.compile(r"^(?P<name>[\w.]+): cannot start: (?P<what>.+)\. Fix: (?P<fix>.+)$")


def _run(script: Path, args=(), path=SYSTEM_PATH, cwd=None, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "MPIEXEC"))}
    e.update(PATH=path, **env)
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60, env=e,
                          cwd=cwd or script.parents[1])


def _said_why(p, name: str) -> re.Match:
    """Status 2 and, as the last line on stderr, one line that names the script, what is missing and the fix."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines, (name, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    m = FAIL_LINE.match(lines[-1])
    assert m and m["name"] == name, (name, lines[-1])
    return m


@pytest.fixture(scope="module")
def bare_checkout(tmp_path_factory) -> Path:
    """A copy of launch/ in a directory with nothing else: no .venv, no .whl, not a git checkout."""
    root = tmp_path_factory.mktemp("bare-checkout")
    shutil.copytree(LAUNCH, root / "launch")
    return root


def test_every_script_is_covered():
    assert {"mpirun.sh", "torchrun.sh", "slurm.sbatch", "fetch_wheels.sh", "gpu_check.sh"} <= set(SCRIPTS)
    assert {"gpu_check.sh", "gpu_ep_bench.sh", "ep_mps_bench.sh", "sanitize.sh"} <= set(DEVICE), DEVICE
    for name in SCRIPTS:  # the check comes before the script's own work
        text = (LAUNCH / name).read_text()
        assert re.search(r"launch/preflight\.sh|launch/device_env\.sh", text), f"{name} runs no preflight"


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_missing_tool_is_named_with_its_fix_and_status_2(bare_checkout, name):
    """In a bare checkout with only the system's tools on PATH every script stops in its preflight: status 2
    and one line naming what is missing and the fixing command (or, where the system has every tool, the
    preflight passes and says what it found) -- never a silent status 1."""
    p = _run(bare_checkout / "launch" / name, ARGS.get(name, ()), OUT=str(bare_checkout / "out"), PREFLIGHT_ONLY="1")
    if p.returncode == 0:
        assert re.search(rf"^{re.escape(name)}: preflight ok: ", p.stdout, re.M), (name, p.stdout, p.stderr)
        return
    m = _said_why(p, name)
    assert m["fix"].strip(), (name, m)
    assert not (bare_checkout / ".site").exists()


def test_mpirun_without_the_venv_names_the_python_and_the_fix(bare_checkout):
    m = _said_why(_run(bare_checkout / "launch" / "mpirun.sh", ["2", "run"]), "mpirun.sh")
    assert "no python that can import streamring" in m["what"], m["what"]
    assert "python3 -m venv" in m["fix"] and "pip install" in m["fix"], m["fix"]


def test_mpirun_names_a_missing_mpiexec(tmp_path):
    """A python that has streamring but no mpiexec beside it or on PATH: the fix installs MPICH's into it."""
    (tmp_path / "bin").mkdir()
    py = tmp_path / "bin" / "python"  # this interpreter, from a directory that has no mpiexec
    py.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    m = _said_why(_run(LAUNCH / "mpirun.sh", ["2", "run"], PYTHON=str(py)), "mpirun.sh")
    assert "no mpiexec" in m["what"] and "pip install mpich" in m["fix"], m


def test_mpirun_and_torchrun_usage(tmp_path):
    for name in ("mpirun.sh", "torchrun.sh"):
        m = _said_why(_run(LAUNCH / name), name)
        assert "usage:" in m["what"], m


def test_mpirun_and_torchrun_find_the_checkouts_venv_off_path():
    """PATH without the venv: the checkout's .venv/bin/python and the mpiexec beside it are taken."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("this checkout has no .venv (bash tests/run.sh makes one)")
    for name in ("mpirun.sh", "torchrun.sh"):
        p = _run(LAUNCH / name, ["2", "run"], PREFLIGHT_ONLY="1")
        assert p.returncode == 0, (name, p.stdout, p.stderr)
        assert f"python {ROOT}/.venv/bin/python" in p.stdout, p.stdout
    assert f"mpiexec {ROOT}/.venv/bin/mpiexec" in _run(LAUNCH / "mpirun.sh", ["2", "run"], PREFLIGHT_ONLY="1").stdout


@pytest.mark.parametrize("name", DEVICE)
def test_device_scripts_name_the_carried_wheels(bare_checkout, name):
    """A GPU-machine script where python3 has torch and streamring but nothing carried the wheels: it stops
    before its first step, naming nvshmem4py and launch/fetch_wheels.sh, and installs nothing."""
    p = _run(bare_checkout / "launch" / name, path=f"{VENV_BIN}:{SYSTEM_PATH}", OUT=str(bare_checkout / "out"))
    m = _said_why(p, name)
    assert "nvshmem.core" in m["what"] and "no .whl" in m["what"], m["what"]
    assert "bash launch/fetch_wheels.sh" in m["fix"], m["fix"]
    assert not (bare_checkout / ".site").exists()
