"""The device ring's acquire in its sm_90 PTX: the ordering that one GPU cannot show by running it.

Rule 2 of the protocol (``streamring/ring/protocol.py``): a consumer reads a slot only after an acquire of both
generation words. On the device that is ``acquire_wait`` (``csrc/ring_protocol.cuh``): an
``ld.acquire.sys`` of each generation in its spin loop, then ``fence.acq_rel.sys`` so that the reads the
kernel (and its block, after a barrier) makes next are ordered after it. A relaxed load or a dropped
fence still passes every run on one H200 (its loads are not reordered in practice), so this check reads
the compiled PTX instead, kernel by kernel, for every kernel that acquires:

* at least two ``ld.acquire.sys.global.u64`` (the route and the layout generation);
* a ``fence.acq_rel.sys`` after the last of them (the error paths' ``membar.sys`` does not count: it
  belongs to ``record_error``).

``--controls`` also compiles two broken copies of the source (the acquire loads made relaxed; the fence
dropped) and requires the check to report each. Exit 0: every check passed; 1: a check failed; 3: no
nvcc or no NVSHMEM headers here (the reason is printed; the test skips).

    python tests/helpers/ptx_ring.py [--controls]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: the kernels that call acquire_wait before they read a slot
ACQUIRING_KERNELS = ("ring_acquire_checked", "ring_spin_wait")
ACQUIRE = r"^ld\.acquire\.sys\.global\.u64\b"
FENCE = r"^fence\.acq_rel\.sys;"

#: (name, the exact source text, its broken replacement) in csrc/ring_protocol.cuh
CONTROLS = (
    ("acquire loads relaxed",
     "uint64_t seen = ld_acquire_sys_u64(words[k]);  // acquire (system scope)",
     "uint64_t seen = ld_relaxed_sys_u64(words[k]);"),
    ("fence after the acquire dropped",
     "    fence_acq_rel_sys();\n    return true;\n}",
     "    return true;\n}"),
)


class Unavailable(RuntimeError):
    """nvcc or the NVSHMEM headers are missing here."""


def compile_ptx(csrc: Path, out_dir: Path) -> str:
    """PTX of ``csrc/ring_kernels.cu`` for sm_90, with the build's flags and generated constants."""
    from streamring.device import build

    try:
        nvcc = build.find_nvcc()
        inc = build.find_nvshmem_include()
    except build.BuildError as exc:
        raise Unavailable(str(exc)) from exc
    gen = out_dir / "gen"
    gen.mkdir(exist_ok=True)
    (gen / build.GENERATED_HEADER).write_text(build.consts_header())
    ptx = out_dir / "ring_kernels.ptx"
    cmd = [nvcc, "-arch=sm_90", "-rdc=true", "-O3", "-std=c++17", f"-I{inc}", f"-I{gen}", f"-I{csrc}", "-ptx",
           str(csrc / "ring_kernels.cu"), "-o", str(ptx)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
    return ptx.read_text()


def kernel_lines(ptx: str, name: str) -> list[str]:
    """The instructions of one ``.entry`` (comments and directives dropped)."""
    m = re.search(rf"^\.visible \.entry {re.escape(name)}\(", ptx, re.MULTILINE)
    if not m:
        return []
    body = ptx[m.end():]
    body = body[:body.index("\n}\n")] if "\n}\n" in body else body
    out = []
    for line in body.splitlines():
        s = re.sub(r"\s*//.*$", "", line.strip())
        if s and not s.startswith((".loc", ".file", ".reg", ".param", ".local", ".shared")):
            out.append(re.sub(r"\s+", " ", s))
    return out


def check(ptx: str) -> list[str]:
    """Every ordering problem found in the acquiring kernels (empty: all good)."""
    problems = []
    for name in ACQUIRING_KERNELS:
        lines = kernel_lines(ptx, name)
        if not lines:
            problems.append(f"{name}: no such kernel in the PTX")
            continue
        acquires = [i for i, s in enumerate(lines) if re.search(ACQUIRE, s)]
        if len(acquires) < 2:
            problems.append(f"{name}: {len(acquires)} ld.acquire.sys of a generation word (want 2: route, layout)")
            continue
        if not any(re.search(FENCE, s) for s in lines[acquires[-1] + 1:]):
            problems.append(f"{name}: no fence.acq_rel.sys after the last ld.acquire.sys (line {acquires[-1]})")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--controls", action="store_true", help="also require the broken copies to be reported")
    args = ap.parse_args(argv)
    csrc = ROOT / "streamring" / "device" / "csrc"
    failed = False
    with tempfile.TemporaryDirectory(prefix="ptx-ring-") as tmp:
        try:
            ptx = compile_ptx(csrc, Path(tmp))
        except Unavailable as exc:
            print(f"cannot compile the ring kernels here: {exc}")
            return 3
        problems = check(ptx)
        for p in problems:
            print(f"FAIL: {p}")
        failed |= bool(problems)
        if not problems:
            print(f"ok: {', '.join(ACQUIRING_KERNELS)}: both generations ld.acquire.sys, then fence.acq_rel.sys")
        if args.controls:
            for what, good, bad in CONTROLS:
                broken = Path(tmp) / "broken"
                shutil.rmtree(broken, ignore_errors=True)
                shutil.copytree(csrc, broken)
                src = broken / "ring_protocol.cuh"
                text = src.read_text()
                if text.count(good) != 1:
                    print(f"FAIL: control '{what}': its source text is not in ring_protocol.cuh exactly once")
                    failed = True
                    continue
                src.write_text(text.replace(good, bad))
                found = check(compile_ptx(broken, Path(tmp)))
                if found:
                    print(f"ok: control '{what}' reported: {found[0]}")
                else:
                    print(f"FAIL: control '{what}' was not reported")
                    failed = True
    if failed:
        return 1
    print("every ordering check passed" + (" (and every control was reported)" if args.controls else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
