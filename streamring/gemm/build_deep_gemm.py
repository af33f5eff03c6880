"""Build and install DeepGEMM (commit 54e2261, deep_gemm 2.6.1) from the carried source, offline.

The recipe is ``docs/deep_gemm.md``; ``launch/build_deep_gemm.sh`` runs this on the GPU host with a
time limit. Input: the folder that ``launch/pack_deep_gemm.sh`` fills (``.deepgemm/``: DeepGEMM's
``csrc/`` and ``deep_gemm/``, CUTLASS f3fde58's ``include/``, fmt 553ec11's ``include/``, a MANIFEST
with their sha256). Steps:

1. check the tarballs against the MANIFEST and unpack them into ``--build-dir`` (the tree DeepGEMM's
   ``setup.py`` sees: ``third-party/cutlass/include``, ``third-party/fmt/include``);
2. compile ``deep_gemm._C`` - DeepGEMM's only compiled part, a torch C++ extension of one
   translation unit, ``csrc/python_api.cpp`` - with the host's g++ against the torch that runs it,
   with the flags, include folders and libraries of DeepGEMM's ``setup.py`` (``CUDAExtension``:
   ``-std=c++17 -O3 -fPIC``, ``_GLIBCXX_USE_CXX11_ABI`` as torch, ``$CUDA_HOME/include`` and
   ``include/cccl``, ``deep_gemm/include``, CUTLASS's and fmt's ``include``; ``cudart``, ``nvrtc``
   and torch's libraries). ``setup.py`` itself is not used: it needs ``wheel``, ``git`` metadata and
   a network fallback, none of which the GPU host has or this needs;
3. install the package into ``--prefix`` (a folder for ``PYTHONPATH``): ``deep_gemm/`` (Python),
   ``_C*.so``, and ``deep_gemm/include/{deep_gemm,cute,cutlass}`` - the headers its JIT compiles
   the kernels with at first call (``Compiler::library_include_path`` = the package's ``include``),
   as ``setup.py``'s ``prepare_includes`` lays them out;
4. write ``--prefix``/``deep_gemm_env.sh``: ``CUDA_HOME``, torch's ``site-packages/nvidia/*/lib`` on
   ``LD_LIBRARY_PATH``, ``DG_JIT_CACHE_DIR``, the prefix on ``PYTHONPATH``.

Run ``python -m streamring.gemm.build_deep_gemm --src .deepgemm --prefix .dg-site``
(``--dry-run`` prints the compile command without building).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import warnings
from pathlib import Path

DG_COMMIT = "54e2261"
CUTLASS_COMMIT = "f3fde58"
FMT_COMMIT = "553ec11"
TARBALLS = {"deepgemm": f"deepgemm-{DG_COMMIT}.tar.gz", "cutlass": f"cutlass-{CUTLASS_COMMIT}-include.tar.gz",
            "fmt": f"fmt-{FMT_COMMIT}-include.tar.gz"}
ROOT_NAME = "DeepGEMM"  # the tarballs' common prefix
# DeepGEMM's setup.py: cxx_flags (the ABI flag is added from torch), sources, libraries
CXX_FLAGS = ["-std=c++17", "-O3", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations"]
SOURCES = ["csrc/python_api.cpp"]
LIBRARIES = ["c10", "torch", "torch_cpu", "torch_python", "cudart", "c10_cuda", "torch_cuda", "nvrtc"]
# the headers the package must hold for its JIT (setup.py's third_party_include_dirs + its own)
JIT_INCLUDES = {"cute": "third-party/cutlass/include/cute", "cutlass": "third-party/cutlass/include/cutlass"}
# CUDA headers the compile needs (torch's ATen/cuda/CUDAContext.h and DeepGEMM's own includes): looked
# for before compiling, so a missing one fails in a second, naming it, instead of minutes into g++
CUDA_HEADERS = ("cuda_runtime.h", "cuda.h", "nvrtc.h", "cublasLt.h", "cublas_v2.h", "cusparse.h", "cusolverDn.h")


class DeepGemmBuildError(RuntimeError):
    """Something the build needs is missing or a step failed (the message says which)."""


def check_sources(src: Path) -> dict[str, Path]:
    """The three tarballs of ``src``, checked against ``src/MANIFEST`` (sha256) when it is there."""
    src = Path(src)
    paths = {k: src / v for k, v in TARBALLS.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise DeepGemmBuildError(f"DeepGEMM source tarballs missing: {', '.join(missing)} (make them on a machine "
                                 f"with the git repositories: bash launch/pack_deep_gemm.sh; carry .deepgemm)")
    manifest = src / "MANIFEST"
    if manifest.is_file():
        want = {}
        for line in manifest.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].endswith(".tar.gz"):
                want[Path(parts[1]).name] = parts[0]
        for p in paths.values():
            got = hashlib.sha256(p.read_bytes()).hexdigest()
            if p.name in want and want[p.name] != got:
                raise DeepGemmBuildError(f"{p}: sha256 {got} differs from the MANIFEST's {want[p.name]}")
    return paths


def unpack(src: Path, build_dir: Path) -> Path:
    """Unpack the tarballs into ``build_dir`` (emptied first); returns the DeepGEMM tree."""
    paths = check_sources(src)
    build_dir = Path(build_dir)
    root = build_dir / ROOT_NAME
    if root.exists():
        shutil.rmtree(root)
    build_dir.mkdir(parents=True, exist_ok=True)
    for p in paths.values():
        with tarfile.open(p) as tf:
            for m in tf.getmembers():
                if not m.name.startswith(ROOT_NAME + "/") and m.name != ROOT_NAME or ".." in Path(m.name).parts:
                    raise DeepGemmBuildError(f"{p}: unexpected member {m.name!r} (not under {ROOT_NAME}/)")
            try:
                tf.extractall(build_dir, filter="data")
            except TypeError:  # Python without extraction filters (the members were checked above)
                tf.extractall(build_dir)
    check_tree(root)
    return root


def check_tree(root: Path) -> None:
    """The files the compile and the JIT need are where DeepGEMM's build expects them."""
    need = [*SOURCES, "deep_gemm/__init__.py", "deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh",
            "third-party/cutlass/include/cutlass/cutlass.h", "third-party/cutlass/include/cute/tensor.hpp",
            "third-party/fmt/include/fmt/format.h", "third-party/fmt/include/fmt/base.h"]
    missing = [n for n in need if not (Path(root) / n).is_file()]
    if missing:
        raise DeepGemmBuildError(f"{root}: missing {', '.join(missing)}")


def torch_info() -> dict:
    """What the extension is compiled and linked against: the running Python's torch."""
    import torch
    from torch.utils import cpp_extension as ce

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pybind = list(getattr(ce, "_get_pybind11_abi_build_flags", lambda: [])())
    site = Path(torch.__file__).resolve().parent.parent
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "include_dirs": ce.include_paths(), "library_dirs": ce.library_paths(),
            # the CUDA libraries' headers of torch's pip dependencies (nvidia-*-cu13): a fallback for
            # a CUDA_HOME without cuBLAS/cuSPARSE/cuSOLVER headers
            "nvidia_include_dirs": sorted(glob.glob(str(site / "nvidia" / "*" / "include"))),
            "cxx11_abi": int(torch.compiled_with_cxx11_abi()), "pybind_flags": pybind,
            "python_include": sysconfig.get_paths()["include"],
            "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX") or ".so",
            "torch_lib": str(Path(torch.__file__).parent / "lib")}


def compile_command(root: Path, out_so: Path, info: dict, cuda_home: str, cxx: str = "g++") -> list[str]:
    """The g++ command that builds ``deep_gemm._C`` (see the module doc for where each part comes from)."""
    root = Path(root)
    inc = [*info["include_dirs"], info["python_include"], f"{cuda_home}/include", f"{cuda_home}/include/cccl",
           str(root / "deep_gemm/include"), str(root / "third-party/cutlass/include"),
           str(root / "third-party/fmt/include"), *info.get("nvidia_include_dirs", [])]
    libdirs = [*info["library_dirs"], f"{cuda_home}/lib64"]
    return [cxx, "-shared", *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={info['cxx11_abi']}",
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C", *info["pybind_flags"],
            *[f"-I{d}" for d in inc], *[str(root / s) for s in SOURCES],
            *[f"-L{d}" for d in libdirs], *[f"-l{lib}" for lib in LIBRARIES],
            *[f"-Wl,-rpath,{d}" for d in libdirs], "-o", str(out_so)]


def missing_headers(cmd: list[str]) -> list[str]:
    """The :data:`CUDA_HEADERS` that no ``-I`` folder of ``cmd`` holds."""
    dirs = [Path(c[2:]) for c in cmd if c.startswith("-I")]
    return [h for h in CUDA_HEADERS if not any((d / h).is_file() for d in dirs)]


def install(root: Path, so: Path, prefix: Path, ext_suffix: str) -> Path:
    """``prefix/deep_gemm``: the Python package, ``_C<ext_suffix>``, and the JIT's headers."""
    root, prefix = Path(root), Path(prefix)
    pkg = prefix / "deep_gemm"
    if pkg.exists():
        shutil.rmtree(pkg)
    shutil.copytree(root / "deep_gemm", pkg)
    for name, rel in JIT_INCLUDES.items():
        shutil.copytree(root / rel, pkg / "include" / name)
    shutil.copy2(so, pkg / f"_C{ext_suffix}")
    return pkg


def cuda_home_default() -> str:
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"


def runtime_env(prefix: Path, cuda_home: str, jit_cache: str) -> dict:
    """The environment ``import deep_gemm`` and its JIT need (``deep_gemm_env.sh`` exports it)."""
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    nv_libs = sorted(glob.glob(str(site / "nvidia" / "*" / "lib")))
    return {"CUDA_HOME": cuda_home, "DG_JIT_CACHE_DIR": jit_cache, "NV_LIBS": ":".join(nv_libs),
            "PREFIX": str(Path(prefix).resolve())}


def env_script(env: dict) -> str:
    q = shlex.quote
    return ("# written by python -m streamring.gemm.build_deep_gemm: source it before importing deep_gemm\n"
            f"export CUDA_HOME={q(env['CUDA_HOME'])}\n"
            f"export DG_JIT_CACHE_DIR={q(env['DG_JIT_CACHE_DIR'])}\n"
            f"export LD_LIBRARY_PATH={q(env['NV_LIBS'])}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\n"
            f"export PYTHONPATH={q(env['PREFIX'])}${{PYTHONPATH:+:$PYTHONPATH}}\n")


# libstdc++'s own (non-template) definitions: a shared object that defines them carries a private copy
# of the runtime (a static libstdc++.a linked in) beside the one Python loaded
LIBSTDCXX_OWN_SYMBOLS = ("_ZNKSt5ctypeIcE13_M_widen_initEv", "_ZNSt6locale7classicEv", "_ZNSt8ios_base4InitC1Ev")
# a use of the C++ runtime's locale (what std::regex reaches first): with libstdc++ linked statically
# the probe library defines the locale's own symbols; it compiles in a fraction of a second
_PROBE_SOURCE = """#include <locale>
int streamring_probe(char c) { return std::isalpha(c, std::locale::classic()) ? 1 : 0; }
"""


def defined_libstdcxx_symbols(so: Path) -> list[str] | None:
    """The libstdc++ runtime symbols ``so`` defines itself (``nm -D --defined-only``); None if ``nm``
    cannot say."""
    try:
        res = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    names = {line.split()[-1] for line in res.stdout.splitlines() if line.strip()}
    return [n for n in LIBSTDCXX_OWN_SYMBOLS if n in names]


def static_libstdcxx(cxx: str, work: Path) -> list[str] | None:
    """Build a small shared object with ``cxx`` (it uses the C++ runtime's locale) and return
    the libstdc++ runtime symbols it defines itself: non-empty when ``cxx`` links libstdc++
    statically into shared objects. None when the probe cannot be built or read."""
    work.mkdir(parents=True, exist_ok=True)
    src, so = work / "libstdcxx_probe.cpp", work / "libstdcxx_probe.so"
    src.write_text(_PROBE_SOURCE)
    try:
        res = subprocess.run([cxx, "-shared", "-fPIC", "-O1", "-std=c++17", str(src), "-o", str(so)],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return defined_libstdcxx_symbols(so) if res.returncode == 0 else None


def choose_compiler(work: Path, log=print) -> str:
    """The C++ compiler for ``deep_gemm._C``: ``$DG_CXX`` when set (taken as is); else the first of
    ``$CXX``, ``g++`` on PATH and ``/usr/bin/g++`` that links libstdc++ dynamically into a shared object.

    Why: on the H200 host ``$CXX`` (``/opt/gcc/bin/g++``) links libstdc++ statically, so ``_C``
    carried a private copy of the C++ runtime beside the one Python and torch loaded, and the first
    grouped GEMM call segfaulted in that copy's locale, inside ``std::regex`` (DeepGEMM's JIT include
    parser; a native backtrace: ``IncludeParser::get_includes`` ->
    ``_BracketMatcher::_M_ready``). A probe library built with each candidate shows which ones do that."""
    if os.environ.get("DG_CXX"):
        cxx = os.environ["DG_CXX"]
        if shutil.which(cxx) is None:
            raise DeepGemmBuildError(f"DG_CXX={cxx!r}: no such compiler")
        return cxx
    seen, found = set(), []
    for cxx in (os.environ.get("CXX"), "g++", "/usr/bin/g++"):
        path = shutil.which(cxx) if cxx else None
        if path is None or os.path.realpath(path) in seen:
            continue
        seen.add(os.path.realpath(path))
        own = static_libstdcxx(path, Path(work) / f"probe{len(found)}")
        found.append((path, own))
        if own == []:
            log(f"build_deep_gemm: compiler {path}: links libstdc++ dynamically")
            return path
        log(f"build_deep_gemm: compiler {path}: skipped: " + (
            "its probe library could not be built or read" if own is None else
            f"it links libstdc++ statically into shared objects (defines {', '.join(own)})"))
    if not found:
        raise DeepGemmBuildError("no C++ compiler: none of $CXX, g++ on PATH, /usr/bin/g++ exists (set DG_CXX)")
    unknown = [p for p, own in found if own is None]
    if unknown:
        log(f"build_deep_gemm: warning: cannot tell how {unknown[0]} links libstdc++; using it (set DG_CXX to "
            f"choose)")
        return unknown[0]
    raise DeepGemmBuildError(f"every compiler links libstdc++ statically ({[p for p, _ in found]}): deep_gemm._C "
                             f"would carry a second C++ runtime and crash; set DG_CXX to a g++ that does not")


def build(src: Path, prefix: Path, build_dir: Path, cuda_home: str, jit_cache: str, dry_run: bool = False,
          log=print) -> Path:
    t0 = time.monotonic()
    if not Path(cuda_home, "include", "cuda_runtime.h").is_file():
        raise DeepGemmBuildError(f"CUDA_HOME={cuda_home} has no include/cuda_runtime.h (set CUDA_HOME)")
    cxx = choose_compiler(Path(build_dir), log)
    root = unpack(src, build_dir)
    info = torch_info()
    log(f"build_deep_gemm: torch {info['torch']} (CUDA {info['cuda']}), cxx11 abi {info['cxx11_abi']}, "
        f"{cxx}, CUDA_HOME={cuda_home}; unpacked in {time.monotonic() - t0:.1f} s")
    so = Path(build_dir) / f"_C{info['ext_suffix']}"
    cmd = compile_command(root, so, info, cuda_home, cxx)
    log(" ".join(shlex.quote(c) for c in cmd))
    missing = missing_headers(cmd)
    if missing:
        msg = (f"headers not found in any include folder: {', '.join(missing)} (CUDA_HOME={cuda_home}, torch's "
               f"nvidia/*/include: {info.get('nvidia_include_dirs')}); point CUDA_HOME at a full CUDA toolkit")
        if not dry_run:
            raise DeepGemmBuildError(msg)
        log(f"build_deep_gemm: {msg}")
    if dry_run:
        return so
    t1 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise DeepGemmBuildError(f"{cxx} failed ({res.returncode}) after {time.monotonic() - t1:.0f} s:\n"
                                 f"{res.stderr[-6000:]}")
    log(f"build_deep_gemm: compiled _C in {time.monotonic() - t1:.0f} s ({so.stat().st_size / 1e6:.1f} MB)")
    own = defined_libstdcxx_symbols(so)
    if own:
        raise DeepGemmBuildError(f"{so} defines libstdc++'s own {', '.join(own)}: {cxx} linked the C++ runtime "
                                 f"statically, and a second runtime in the process crashes; set DG_CXX")
    pkg = install(root, so, prefix, info["ext_suffix"])
    env = runtime_env(prefix, cuda_home, jit_cache)
    (Path(prefix) / "deep_gemm_env.sh").write_text(env_script(env))
    log(f"build_deep_gemm: installed {pkg}; source {Path(prefix) / 'deep_gemm_env.sh'} ({time.monotonic() - t0:.0f} s)")
    return pkg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=".deepgemm", help="the tarballs (launch/pack_deep_gemm.sh)")
    ap.add_argument("--prefix", default=".dg-site", help="install deep_gemm here (a PYTHONPATH folder)")
    ap.add_argument("--build-dir", default="/tmp/streamring-deep-gemm-build")
    ap.add_argument("--cuda-home", default=cuda_home_default())
    ap.add_argument("--jit-cache", default=os.environ.get("DG_JIT_CACHE_DIR", "/tmp/streamring-deep-gemm-jit"))
    ap.add_argument("--dry-run", action="store_true", help="unpack and print the compile command only")
    args = ap.parse_args(argv)
    try:
        build(Path(args.src), Path(args.prefix), Path(args.build_dir), args.cuda_home, args.jit_cache, args.dry_run,
              log=lambda *a: print(*a, flush=True))
    except DeepGemmBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
