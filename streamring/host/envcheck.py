"""``streamring check-env``: what this machine offers to streamring, as a table."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys

from rich.console import Console
from rich.table import Table


def _version(mod: str) -> tuple[str, str]:
    try:
        m = importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001 - report, never fail
        return "missing", f"{type(exc).__name__}: {exc}"[:80]
    return str(getattr(m, "__version__", "present")), ""


def check_env() -> int:
    """Print interpreter, packages, MPI library and launcher, GPU and nvcc; exit 0 if the CPU backend can run."""
    from .launch import LaunchError, detect_launcher, find_mpiexec

    t = Table(title="streamring check-env")
    t.add_column("item")
    t.add_column("found")
    t.add_column("note")
    t.add_row("python", sys.version.split()[0], sys.executable)
    t.add_row("platform", platform.platform(), f"{os.cpu_count()} cpus")
    cpu_ok = True
    for mod in ("numpy", "torch", "mpi4py", "pydantic", "yaml", "rich", "matplotlib", "nvtx"):
        v, note = _version(mod)
        cpu_ok &= v != "missing" or mod in ("matplotlib", "nvtx")
        t.add_row(mod, v, note)
    try:
        from mpi4py import MPI

        lib = MPI.Get_library_version().splitlines()[0].strip()
        t.add_row("MPI library", lib, f"MPI {'.'.join(map(str, MPI.Get_version()))}")
    except Exception as exc:  # noqa: BLE001
        cpu_ok = False
        t.add_row("MPI library", "missing", str(exc)[:80])
    try:
        t.add_row("mpiexec", find_mpiexec(), "used by the local launcher")
    except LaunchError as exc:
        cpu_ok = False
        t.add_row("mpiexec", "missing", str(exc)[:80])
    t.add_row("launcher", detect_launcher().value, "how this process was started")
    for mod in ("nvshmem.core", "cuda.core", "cupy"):
        v, note = _version(mod)
        t.add_row(mod, v, note or "GPU backend")
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # noqa: BLE001
        gpu = "none"
    t.add_row("GPU", gpu, "needed by --backend nvshmem")
    nvcc = shutil.which("nvcc")
    nv = "missing"
    if nvcc:
        try:
            nv = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[-1]
        except Exception:  # noqa: BLE001
            nv = nvcc
    t.add_row("nvcc", nv, "builds the NVSHMEM device code")
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    print("cpu backend: ready" if cpu_ok else "cpu backend: NOT ready (see the rows marked missing)")
    return 0 if cpu_ok else 1
