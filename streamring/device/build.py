"""Build the streamring CUDA library (every ``csrc/*.cu``) into one cubin, cached.

The recipe is the one that works with libnvshmem 3.4.5 (NVRTC + nvJitLink
does not: undefined ``nvshmemi_transfer_put_signal_dispatch``)::

    nvcc -arch=sm_90 -rdc=true -I$INC -I$GEN -I csrc -c X.cu -o X.o     (each csrc/*.cu)
    nvcc -arch=sm_90 -dlink --cubin -o ring.cubin *.o -L$LIB -lnvshmem_device

Before compiling, the build checks ``csrc/ring_desc.cuh`` against the Python descriptor
(:func:`streamring.device.ringdesc.check_header`) and writes the generated header
``ring_consts.cuh`` (every constant shared with Python, from ``ringdesc.py``) into ``$GEN``,
so no constant is copied by hand.

The sources are split by concern: ``ptx.cuh`` (memory-model helpers), ``transport.cuh``
(NVSHMEM and P2P transports), ``ring_protocol.cuh`` (the device-side protocol steps),
``verbs.cu`` (the heap's verb kernels), ``ring_kernels.cu`` (the ring kernels a layer
enqueues) and ``selftest.cu`` (the synthetic producer/consumer of ``streamring gpu-check``).

``INC`` is NVSHMEM's header directory (``cuda.pathfinder.find_nvidia_header_directory("nvshmem")``,
or ``$STREAMRING_NVSHMEM_INC`` / ``$NVSHMEM_HOME/include``, or the ``nvidia-nvshmem-cu13``
wheel's ``nvidia/nvshmem/include``), and ``LIB`` is ``INC/../lib`` (it must hold
``libnvshmem_device.a``).

The cubin is cached under ``$STREAMRING_CACHE`` (default ``~/.cache/streamring``),
keyed by the sha256 of every source in ``csrc/``, the arch, the ``nvcc --version``
text, NVSHMEM's version header and ``$STREAMRING_NVCC_DEFINES``, so editing a source or switching
compilers rebuilds and nothing else does.

``STREAMRING_NVCC_DEFINES`` (space-separated ``NAME=VALUE`` words, each passed as ``-DNAME=VALUE``) builds a
variant of the library for a measurement against the default in one device call, e.g.
``STREAMRING_NVCC_DEFINES="SR_ONE_WARP="`` lifts the one-warp kernels' register cap
(``csrc/ring_protocol.cuh``).

Run ``python -m streamring.device.build`` to build and print the cubin's path (a line per compile
unit); the CUTLASS GEMM library is built by ``python -m streamring.gemm.build --out .gemm-build``
(the GEMM backends sit above ``device``: this module does not reach up to them).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .ringdesc import CSRC, check_header, consts_header

GENERATED_HEADER = "ring_consts.cuh"
DEFAULT_ARCH = "sm_90"
# Last-resort places to look for nvcc when it is not on PATH (tests may clear this).
FALLBACK_CUDA_HOMES: list[str] = ["/usr/local/cuda"]


class BuildError(RuntimeError):
    """The CUDA library cannot be built; the message says what is missing and how to fix it."""


# --------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------
def find_nvcc() -> str:
    """Path of nvcc: ``$NVCC``, then PATH, then ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``."""
    explicit = os.environ.get("NVCC")
    if explicit:
        if Path(explicit).is_file() and os.access(explicit, os.X_OK):
            return explicit
        raise BuildError(f"$NVCC={explicit!r} is not an executable file")
    found = shutil.which("nvcc")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *FALLBACK_CUDA_HOMES]
    for home in homes:
        if home:
            cand = Path(home) / "bin" / "nvcc"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    raise BuildError(
        "cannot build the streamring CUDA library: nvcc (the CUDA compiler) was not found on PATH, "
        "in $CUDA_HOME/bin or $CUDA_PATH/bin. Install the CUDA toolkit (12.x/13.x) and put its bin/ on PATH, "
        "or set NVCC=/path/to/nvcc."
    )


def _valid_inc(path) -> Path | None:
    if not path:
        return None
    p = Path(path)
    return p if (p / "nvshmem.h").is_file() else None


def find_nvshmem_include() -> Path:
    """NVSHMEM's header directory (see the module doc for the search order)."""
    tried = []
    for var in ("STREAMRING_NVSHMEM_INC",):
        v = os.environ.get(var)
        if v:
            tried.append(f"${var}={v}")
            if _valid_inc(v):
                return Path(v)
    home = os.environ.get("NVSHMEM_HOME")
    if home:
        tried.append(f"$NVSHMEM_HOME/include={home}/include")
        if _valid_inc(Path(home) / "include"):
            return Path(home) / "include"
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("nvshmem")
        tried.append(f"cuda.pathfinder -> {found}")
        if _valid_inc(found):
            return Path(found)
    except Exception as exc:  # noqa: BLE001 - pathfinder missing or failing: try the next way
        tried.append(f"cuda.pathfinder unavailable ({type(exc).__name__}: {exc})")
    try:
        import nvidia.nvshmem as _nv  # the nvidia-nvshmem-cu13 wheel (a namespace package)

        for base in getattr(_nv, "__path__", []):
            cand = Path(base) / "include"
            tried.append(str(cand))
            if _valid_inc(cand):
                return cand
    except Exception:  # noqa: BLE001
        tried.append("python package nvidia.nvshmem not importable")
    raise BuildError(
        "cannot build the streamring CUDA library: the NVSHMEM headers (nvshmem.h) were not found. Tried: "
        + "; ".join(tried)
        + ". Install the NVSHMEM wheel (`pip install nvidia-nvshmem-cu13==3.4.5`; cuda-pathfinder finds it) "
        "or point STREAMRING_NVSHMEM_INC (or NVSHMEM_HOME) at an NVSHMEM installation."
    )


def find_nvshmem_lib(inc: Path) -> Path:
    """The directory holding ``libnvshmem_device.a`` (``INC/../lib``, or ``$NVSHMEM_HOME/lib``)."""
    cands = [inc.parent / "lib"]
    if os.environ.get("NVSHMEM_HOME"):
        cands.append(Path(os.environ["NVSHMEM_HOME"]) / "lib")
    for c in cands:
        if (c / "libnvshmem_device.a").is_file():
            return c
    raise BuildError(
        f"cannot build the streamring CUDA library: libnvshmem_device.a not found in {[str(c) for c in cands]} "
        f"(NVSHMEM headers found at {inc}); the device library of the same NVSHMEM installation is needed for "
        "`nvcc -dlink -lnvshmem_device`."
    )


def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"cannot run {nvcc} --version: {exc}") from exc
    if out.returncode != 0:
        raise BuildError(f"{nvcc} --version failed: {out.stderr.strip()}")
    return out.stdout.strip()


def cache_dir() -> Path:
    return Path(os.environ.get("STREAMRING_CACHE") or Path.home() / ".cache" / "streamring")


def nvcc_defines() -> list[str]:
    """The ``-D`` flags of ``$STREAMRING_NVCC_DEFINES`` (module doc); none by default."""
    return [f"-D{w}" for w in os.environ.get("STREAMRING_NVCC_DEFINES", "").split()]


def source_digest(arch: str, nvcc_ver: str, inc: Path | None) -> str:
    h = hashlib.sha256()
    for flag in nvcc_defines():
        h.update(flag.encode() + b"\0")
    for name in sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h")):
        h.update(name.encode())
        h.update(b"\0")
        h.update((CSRC / name).read_bytes())
        h.update(b"\0")
    h.update(consts_header().encode())
    h.update(b"\0")
    h.update(arch.encode())
    h.update(b"\0")
    h.update(nvcc_ver.encode())
    if inc is not None:
        ver = inc / "non_abi" / "nvshmem_version.h"
        if ver.is_file():
            h.update(ver.read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------
def _run(cmd: list[str], what: str, timeout: float) -> None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{what} timed out after {timeout:.0f}s: {' '.join(cmd)}") from exc
    if out.returncode != 0:
        raise BuildError(f"{what} failed (exit {out.returncode}): {' '.join(cmd)}\n{out.stderr.strip()}\n"
                         f"{out.stdout.strip()}")


def kernel_sources() -> list[Path]:
    """Every translation unit of the library (``csrc/*.cu``), in a stable order."""
    return sorted(CSRC.glob("*.cu"))


def build_cubin(arch: str | None = None, force: bool = False, verbose: bool = False, timeout: float = 300.0) -> Path:
    """Build (or reuse from the cache) the cubin of every ``csrc/*.cu``; returns its path.

    Raises :class:`BuildError` naming what is missing (nvcc, NVSHMEM headers or device library)
    or what is inconsistent (the descriptor header against the Python layout). A build is never
    silent (it may start inside a run, at the heap's bootstrap): when the cubin is not cached, stderr
    gets a line saying so and how long it takes, then a line per compile unit with the seconds since.
    """
    arch = arch or os.environ.get("STREAMRING_CUDA_ARCH") or DEFAULT_ARCH
    if not arch.startswith("sm_"):
        raise BuildError(f"arch must look like 'sm_90', got {arch!r}")
    try:
        check_header()
    except ValueError as exc:
        raise BuildError(f"csrc/ring_desc.cuh does not match the Python descriptor: {exc}") from exc
    nvcc = find_nvcc()
    inc = find_nvshmem_include()
    lib = find_nvshmem_lib(inc)
    key = source_digest(arch, nvcc_version(nvcc), inc)
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"ring-{arch}-{key[:24]}.cubin"
    if target.is_file() and target.stat().st_size > 0 and not force:
        if verbose:
            print(f"streamring build: cached {target}", file=sys.stderr)
        return target
    t0 = time.monotonic()
    srcs = kernel_sources()
    print(f"streamring build: the ring kernels' cubin is not in the cache ({target.name} under {out_dir}): "
          f"compiling {len(srcs)} csrc/*.cu with nvcc -rdc, then the device link (about 35 s on the H200 machine; "
          f"`python -m streamring.device.build` builds it ahead)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="streamring-build-", dir=out_dir) as tmp:
        gen = Path(tmp) / "gen"
        gen.mkdir()
        (gen / GENERATED_HEADER).write_text(consts_header())
        objs = []
        for i, src in enumerate(srcs):
            obj = Path(tmp) / (src.stem + ".o")
            cc = [nvcc, f"-arch={arch}", "-rdc=true", "-O3", "-std=c++17", *nvcc_defines(), f"-I{inc}", f"-I{gen}",
                  f"-I{CSRC}", "-c", str(src), "-o", str(obj)]
            if verbose:
                print("streamring build: " + " ".join(cc), file=sys.stderr)
            _run(cc, f"nvcc compile of {src.name}", timeout)
            objs.append(str(obj))
            print(f"streamring build: compile unit {i + 1}/{len(srcs)} ({src.name}) compiled after "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        cub = Path(tmp) / "ring.cubin"
        link = [nvcc, f"-arch={arch}", "-dlink", "--cubin", "-o", str(cub), *objs, f"-L{lib}", "-lnvshmem_device"]
        if verbose:
            print("streamring build: " + " ".join(link), file=sys.stderr)
        _run(link, "nvcc device link (-dlink --cubin)", timeout)
        # Atomic publish: concurrent builders (several ranks) each replace with an identical file.
        os.replace(cub, target)
    print(f"streamring build: built {target} in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streamring.device.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default=None, help=f"GPU arch (default $STREAMRING_CUDA_ARCH or {DEFAULT_ARCH})")
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    try:
        path = build_cubin(args.arch, force=args.force, verbose=args.verbose)
    except BuildError as exc:
        print(f"streamring build: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
