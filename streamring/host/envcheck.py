"""``streamring check-env``: what this machine offers to streamring, as a table."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys

from .report import Column, Report


def _version(mod: str) -> tuple[str, str]:
    try:
        m = importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001 - report, never fail
        return "missing", f"{type(exc).__name__}: {exc}"[:80]
    return str(getattr(m, "__version__", "present")), ""


def check_env() -> int:
    """Print interpreter, packages, MPI library and launcher, GPU and nvcc; exit 0 if the CPU backend can run."""
    from .launch import LaunchError, detect_launcher, find_mpiexec

    rows: list[list[str]] = []
    rows.append(["python", sys.version.split()[0], sys.executable])
    rows.append(["platform", platform.platform(), f"{os.cpu_count()} cpus"])
    cpu_ok = True
    for mod in ("numpy", "torch", "mpi4py", "pydantic", "yaml", "rich", "matplotlib", "nvtx"):
        v, note = _version(mod)
        cpu_ok &= v != "missing" or mod in ("matplotlib", "nvtx")
        rows.append([mod, v, note])
    try:
        from mpi4py import MPI

        lib = MPI.Get_library_version().splitlines()[0].strip()
        rows.append(["MPI library", lib, f"MPI {'.'.join(map(str, MPI.Get_version()))}"])
    except Exception as exc:  # noqa: BLE001
        cpu_ok = False
        rows.append(["MPI library", "missing", str(exc)[:80]])
    try:
        rows.append(["mpiexec", find_mpiexec(), "used by the local launcher"])
    except LaunchError as exc:
        cpu_ok = False
        rows.append(["mpiexec", "missing", str(exc)[:80]])
    rows.append(["launcher", detect_launcher().value, "how this process was started"])
    for mod in ("nvshmem.core", "cuda.core", "cupy"):
        v, note = _version(mod)
        rows.append([mod, v, note or "GPU backend"])
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # noqa: BLE001
        gpu = "none"
    rows.append(["GPU", gpu, "needed by --backend nvshmem"])
    nvcc = shutil.which("nvcc")
    nv = "missing"
    if nvcc:
        try:
            nv = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[-1]
        except Exception:  # noqa: BLE001
            nv = nvcc
    rows.append(["nvcc", nv, "builds the NVSHMEM device code"])
    Report().table("streamring check-env", [Column("item", justify="left"), Column("found", justify="left", wrap=True),
                                            Column("note", justify="left", wrap=True)], rows)
    print("cpu backend: ready" if cpu_ok else "cpu backend: NOT ready (see the rows marked missing)")
    return 0 if cpu_ok else 1
