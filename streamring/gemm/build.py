"""Build the CUTLASS FP8 blockwise grouped GEMM (``csrc/gemm/gemm_blockwise_fp8.cu``) into a shared library.

The library has plain ``extern "C"`` entry points (``streamring.gemm.cutlass_lib`` loads it with
ctypes: no Python extension build). It is compiled for ``sm_90a`` only (``wgmma`` and ``setmaxnreg``
need the arch-specific target) with the CUDA runtime linked statically, so at run time it needs
nothing but the driver (``libcuda``, which the static runtime opens itself) - it can be built on a
machine without a GPU and carried to one::

    nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr -DNDEBUG
         -lineinfo -Xcompiler=-fPIC -shared -cudart static -DSR_GEMM_SOURCE_HASH="<sha256 of the .cu>"
         -I$CUTLASS/include -I$CUTLASS/tools/util/include gemm_blockwise_fp8.cu -o libsr_gemm-<key>.so

In fact the source is compiled in :data:`NUM_PARTS` parts at once (``-DSR_GEMM_PART=p
-DSR_GEMM_NUM_PARTS=N -c``: each part instantiates every N-th kernel variant, part 0 holds the C
entry points; a kernel variant is a minute or more of nvcc) and the objects are linked with
``nvcc -shared -cudart static``.

CUTLASS 4.2's ``fp8_accumulation.hpp`` refuses a blockwise tile with more than one weight scale
along N (``static_assert`` checks that compare the accumulator's and the scale tensor's *shapes*; the
192- and 256-wide tiles have equal sizes but other nestings). CUTLASS 4.3 checks sizes instead;
:func:`patch_cutlass` writes 4.2's header with those three checks in the 4.3 form into the build
folder, whose include path comes first. Nothing else of CUTLASS changes.

``$CUTLASS`` is the CUTLASS source tree that the ``nvidia-cutlass`` wheel ships
(``cutlass_library/source``; found as ``$STREAMRING_CUTLASS_DIR``, the installed ``cutlass_library``
package, or the wheel unpacked under ``.whl/cutlass/`` of the repository:
``pip download --no-deps nvidia-cutlass==4.2.0.0 -d .whl && unzip -q -o .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl -d .whl/cutlass``).

The library is cached under ``$STREAMRING_CACHE/gemm/`` (default ``~/.cache/streamring/gemm``) keyed
by the sha256 of the source, the flags, the ``nvcc --version`` text and CUTLASS's version header; a
JSON file beside it records what it was built from. ``--out DIR`` also copies both into ``DIR`` (the
repository's ``.gemm-build/`` is where :mod:`streamring.gemm.cutlass_lib` looks first).

Run ``python -m streamring.gemm.build [--out .gemm-build]``: it prints what it builds and how long that
takes (:data:`BUILD_TIME`), then a line per compile unit as it finishes (every 30 s a line while they run)
and one after the link, each with the seconds since the start.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..device.build import BuildError, cache_dir, find_nvcc, nvcc_version

CSRC = Path(__file__).resolve().parents[1] / "device" / "csrc" / "gemm"  # apart from the NVSHMEM library (csrc/*.cu)
SOURCE = CSRC / "gemm_blockwise_fp8.cu"
REPO = Path(__file__).resolve().parents[2]
REPO_BUILD_DIR = REPO / ".gemm-build"
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-DNDEBUG", "-lineinfo", "-Xcompiler=-fPIC",
              "-shared", "-cudart", "static"]
COMPILE_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-DNDEBUG", "-lineinfo", "-Xcompiler=-fPIC"]
LINK_FLAGS = ["-shared", "-cudart", "static"]
NUM_PARTS = 2  # the machines that build it have 2 cores
LIB_PREFIX = "libsr_gemm-"
PATCHED_HEADER = Path("cutlass") / "gemm" / "collective" / "fp8_accumulation.hpp"
PATCH_ID = "fp8_accumulation: 3 shape asserts -> size asserts (CUTLASS 4.3 form)"


def source_sha256(path: Path = SOURCE) -> str:
    """sha256 of the CUDA source: embedded in the library (``sr_gemm_build_info``) and checked at load."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _valid_cutlass(root) -> Path | None:
    if not root:
        return None
    p = Path(root)
    ok = (p / "include" / "cutlass" / "cutlass.h").is_file() and (p / "tools" / "util" / "include" / "cutlass" /
                                                                  "util" / "packed_stride.hpp").is_file()
    return p if ok else None


def find_cutlass() -> Path:
    """CUTLASS's source tree: ``include/`` and ``tools/util/include/`` (see the module doc for the order)."""
    tried = []
    env = os.environ.get("STREAMRING_CUTLASS_DIR")
    if env:
        tried.append(f"$STREAMRING_CUTLASS_DIR={env}")
        if _valid_cutlass(env):
            return Path(env)
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        cand = Path(spec.origin).parent / "source"
        tried.append(str(cand))
        if _valid_cutlass(cand):
            return cand
    else:
        tried.append("python package cutlass_library not installed")
    cand = REPO / ".whl" / "cutlass" / "cutlass_library" / "source"
    tried.append(str(cand))
    if _valid_cutlass(cand):
        return cand
    raise BuildError(
        "cannot build the CUTLASS grouped GEMM: CUTLASS's headers were not found. Tried: " + "; ".join(tried)
        + ". Get them from the nvidia-cutlass wheel: `pip download --no-deps nvidia-cutlass==4.2.0.0 -d .whl && "
        "unzip -q -o .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl -d .whl/cutlass` in the repository root "
        "(`bash launch/fetch_wheels.sh --cutlass` does both), or "
        "point STREAMRING_CUTLASS_DIR at a CUTLASS checkout (the folder holding include/ and tools/).")


def cutlass_version(root: Path) -> str:
    text = (root / "include" / "cutlass" / "version.h").read_text()
    parts = {}
    for key in ("CUTLASS_MAJOR", "CUTLASS_MINOR", "CUTLASS_PATCH"):
        for line in text.splitlines():
            if line.startswith(f"#define {key} "):
                parts[key] = line.split()[2]
    return ".".join(parts.get(k, "?") for k in ("CUTLASS_MAJOR", "CUTLASS_MINOR", "CUTLASS_PATCH"))


def patched_header_text(original: str) -> str:
    """CUTLASS 4.2's ``fp8_accumulation.hpp`` with its three accumulator/scale *shape* asserts turned
    into *size* asserts (what CUTLASS 4.3 checks); the text unchanged when it has none of them (a
    newer CUTLASS). Raises :class:`BuildError` when only some are found (an unknown version)."""
    pat = re.compile(r'static_assert\(LayoutAccum\{\}\.shape\(\) == (LayoutScale[AB]?)\{\}\.shape\(\), "([^"]*)"\);')
    new, n = pat.subn(lambda m: f'static_assert(cute::size(LayoutAccum{{}}) == cute::size({m.group(1)}{{}}), '
                                f'"{m.group(2)}");', original)
    if n not in (0, 3):
        raise BuildError(f"{PATCHED_HEADER}: found {n} of the 3 accumulator/scale shape asserts this build relaxes; "
                         "use the nvidia-cutlass 4.2.0.0 wheel (or a CUTLASS >= 4.3, which has none)")
    return new


def patch_cutlass(cutlass_root: Path, dest: Path) -> Path | None:
    """Write the relaxed ``fp8_accumulation.hpp`` under ``dest`` (an include folder to put before
    CUTLASS's own); None when CUTLASS needs no patch."""
    original = (cutlass_root / "include" / PATCHED_HEADER).read_text()
    new = patched_header_text(original)
    if new == original:
        return None
    out = dest / PATCHED_HEADER
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(new)
    return dest


def build_command(nvcc: str, cutlass_root: Path, out: Path, src_hash: str, source: Path = SOURCE,
                  patch_dir: Path | None = None) -> list[str]:
    """The nvcc command line that builds the shared library ``out`` from one translation unit."""
    inc = [f"-I{patch_dir}"] if patch_dir else []
    return [nvcc, *ARCH_FLAGS, *NVCC_FLAGS, f"-DSR_GEMM_SOURCE_HASH=\"{src_hash}\"", *inc,
            f"-I{cutlass_root / 'include'}", f"-I{cutlass_root / 'tools' / 'util' / 'include'}",
            str(source), "-o", str(out)]


def part_commands(nvcc: str, cutlass_root: Path, out: Path, src_hash: str, objdir: Path,
                  parts: int = NUM_PARTS, source: Path = SOURCE, patch_dir: Path | None = None
                  ) -> tuple[list[list[str]], list[str]]:
    """``(compile commands, one per part; the link command)`` that build ``out`` in ``parts`` parts."""
    inc = [f"-I{patch_dir}"] if patch_dir else []
    objs = [objdir / f"part{p}.o" for p in range(parts)]
    compiles = [[nvcc, *ARCH_FLAGS, *COMPILE_FLAGS, f"-DSR_GEMM_SOURCE_HASH=\"{src_hash}\"",
                 f"-DSR_GEMM_PART={p}", f"-DSR_GEMM_NUM_PARTS={parts}", *inc,
                 f"-I{cutlass_root / 'include'}", f"-I{cutlass_root / 'tools' / 'util' / 'include'}",
                 "-c", str(source), "-o", str(objs[p])] for p in range(parts)]
    link = [nvcc, *ARCH_FLAGS, *LINK_FLAGS, *map(str, objs), "-o", str(out)]
    return compiles, link


def cache_key(src_hash: str, nvcc_ver: str, cutlass_ver: str) -> str:
    h = hashlib.sha256()
    for part in (src_hash, " ".join(ARCH_FLAGS + COMPILE_FLAGS + LINK_FLAGS), f"parts={NUM_PARTS}", PATCH_ID,
                 nvcc_ver, cutlass_ver):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def library_name(key: str) -> str:
    return f"{LIB_PREFIX}{key}.so"


def needed_libraries(so: Path) -> list[str] | None:
    """The DT_NEEDED entries of a shared library (None when readelf is not available)."""
    readelf = shutil.which("readelf")
    if not readelf:
        return None
    out = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.stdout.splitlines() if "(NEEDED)" in line]


#: how long :func:`build` takes when nothing is cached (measured: the parts compile at once, one nvcc each)
BUILD_TIME = "about 2 minutes on 16 cores, 3.5 minutes on 2"
#: the command that builds the library ahead (where :mod:`streamring.gemm.cutlass_lib` looks first)
BUILD_COMMAND = "python -m streamring.gemm.build --out .gemm-build"


def run_parts(compiles: list[list[str]], progress=None, t0: float | None = None, what: str = SOURCE.name,
              heartbeat_s: float = 30.0) -> float:
    """Run the compile commands at once (one process each) and wait for all; ``progress(line)`` (when
    given) gets one line per compile unit as it finishes, with the seconds since ``t0`` (default: now),
    and between them a line every ``heartbeat_s`` (a unit takes minutes). Raises :class:`BuildError`
    with each failed command and the tail of its output; returns ``t0``."""
    t0 = time.monotonic() if t0 is None else t0
    last = time.monotonic()
    n = len(compiles)
    with tempfile.TemporaryDirectory(prefix="sr-gemm-log-") as logs:
        procs = []
        for i, cmd in enumerate(compiles):
            out = open(Path(logs) / f"part{i}.log", "w+")  # a file, not a pipe: nvcc's warnings cannot block it
            procs.append((i, cmd, out, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)))
        pending, errors, done = list(procs), [], 0
        while pending:
            for item in list(pending):
                i, cmd, out, proc = item
                if proc.poll() is None:
                    continue
                pending.remove(item)
                done += 1
                out.seek(0)
                text = out.read()
                out.close()
                if proc.returncode != 0:
                    errors.append(f"nvcc failed ({proc.returncode}) building {what} (part {i}):\n{' '.join(cmd)}\n"
                                  f"{text[-8000:]}")
                if progress:
                    progress(f"compile unit {done}/{n} (part {i} of {what}) "
                             f"{'FAILED' if proc.returncode else 'compiled'} after {time.monotonic() - t0:.0f} s")
                    last = time.monotonic()
            if pending:
                if progress and time.monotonic() - last >= heartbeat_s:
                    progress(f"compiling: {done}/{n} compile units done after {time.monotonic() - t0:.0f} s")
                    last = time.monotonic()
                time.sleep(0.2)
    if errors:
        raise BuildError("\n".join(errors))
    return t0


def build(out_dir: str | os.PathLike | None = None, force: bool = False, verbose: bool = False,
          progress=None) -> Path:
    """Build (or take from the cache) the library; returns its path (in ``out_dir`` if given).
    ``progress(line)``: called before the compile (what and how long it takes), once per compile unit
    as it finishes and after the link, each line with the seconds since the build began; nothing is
    reported when the library comes from the cache, but that it does."""
    nvcc = find_nvcc()
    root = find_cutlass()
    src_hash = source_sha256()
    nv_ver = nvcc_version(nvcc)
    cut_ver = cutlass_version(root)
    key = cache_key(src_hash, nv_ver, cut_ver)
    cdir = cache_dir() / "gemm"
    cdir.mkdir(parents=True, exist_ok=True)
    lib = cdir / library_name(key)
    meta = lib.with_suffix(".json")
    if force or not lib.is_file() or not meta.is_file():
        built = _compile_library(lib, nvcc, root, src_hash, cut_ver, verbose, progress)
        meta.write_text(json.dumps({
            "library": lib.name, "source": SOURCE.name, "source_sha256": src_hash, "cache_key": key,
            "nvcc_version": nv_ver.splitlines()[-1] if nv_ver else "", "cutlass_version": cut_ver,
            "commands": [*part_commands("nvcc", Path("$CUTLASS"), Path(lib.name), src_hash, Path("$TMP"),
                                        patch_dir=Path("$TMP/cutlass-patch") if built["patched"] else None)[0],
                         built["link"][:1] + ["..."] + built["link"][-2:]],
            "cutlass_patch": PATCH_ID if built["patched"] else None, "parts": NUM_PARTS,
            "build_seconds": round(built["seconds"], 1), "size_bytes": lib.stat().st_size, "needed": built["needed"],
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=1) + "\n")
    elif progress:
        progress(f"{lib.name} is in the build cache ({cdir}): nothing to compile")
    if out_dir is None:
        return lib
    od = Path(out_dir)
    od.mkdir(parents=True, exist_ok=True)
    dst = od / lib.name
    if not dst.is_file() or dst.stat().st_size != lib.stat().st_size or force:
        shutil.copy2(lib, dst)
    shutil.copy2(meta, od / meta.name)
    return dst


def _compile_library(lib: Path, nvcc: str, root: Path, src_hash: str, cut_ver: str, verbose: bool,
                     progress) -> dict:
    """Compile the parts at once and link them into ``lib``, through a temporary folder beside it (a failed build
    leaves no library there). Returns what the metadata records: ``seconds`` (compile and link), ``link`` (the
    link command), ``needed`` (the library's DT_NEEDED entries) and ``patched`` (CUTLASS's headers were patched
    for the build). Raises :class:`BuildError` where nvcc fails or the library links the CUDA runtime
    dynamically."""
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        tmp_lib = Path(tmp) / lib.name
        patch_dir = patch_cutlass(root, Path(tmp) / "cutlass-patch")
        compiles, link = part_commands(nvcc, root, tmp_lib, src_hash, Path(tmp), patch_dir=patch_dir)
        if verbose:
            for cmd in compiles:
                print(" ".join(cmd), flush=True)
        if progress:
            progress(f"building {lib.name} from {SOURCE.name}: {len(compiles)} compile units at once with "
                     f"{nvcc} (CUTLASS {cut_ver}), then a link; {BUILD_TIME}")
        t0 = run_parts(compiles, progress)
        if verbose:
            print(" ".join(link), flush=True)
        res = subprocess.run(link, capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"nvcc failed ({res.returncode}) linking {tmp_lib.name}:\n{' '.join(link)}\n"
                             f"{res.stderr[-8000:]}")
        seconds = time.monotonic() - t0
        if progress:
            progress(f"linked {lib.name} after {seconds:.0f} s")
        needed = needed_libraries(tmp_lib)
        if needed is not None and any("cudart" in n for n in needed):
            raise BuildError(f"{tmp_lib.name} links the CUDA runtime dynamically ({needed}); it must be static")
        os.replace(tmp_lib, lib)
    return {"seconds": seconds, "link": link, "needed": needed, "patched": bool(patch_dir)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also copy the library (and its .json) into this folder, e.g. .gemm-build")
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the nvcc command")
    args = ap.parse_args(argv)
    try:
        t0 = time.monotonic()
        path = build(args.out, force=args.force, verbose=args.verbose,
                     progress=lambda line: print(f"build_gemm: {line}", flush=True))
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    meta = json.loads(path.with_suffix(".json").read_text())
    print(f"{path}  ({path.stat().st_size / 1e6:.1f} MB; compiled in {meta['build_seconds']} s"
          f"{'' if time.monotonic() - t0 > 5 else ', from the cache'}; needs {meta.get('needed')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
