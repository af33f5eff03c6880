"""The memory-ordering instructions of the persistent consumer, read from its sm_90 PTX (no GPU needed).

    python tests/helpers/ptx_queue.py                    # check with the installed Triton (exit 1 on a finding)
    /tmp/t36/bin/python tests/helpers/ptx_queue.py       # ... with Triton 3.6, the GPU machine's
    python tests/helpers/ptx_queue.py --baseline REV     # also: the GEMM/quant kernels' PTX equals moe_triton.py at REV
    python tests/helpers/ptx_queue.py --dump DIR         # write the PTX files
    python tests/helpers/ptx_queue.py --controls         # also: broken PTX text (a fence removed, ...) is reported

Exit 0: every check passed; 1: findings; 3: this Triton cannot compile sm_90 PTX here.

Compiles ``persistent_moe._persistent_moe_kernel`` (DeepSeek-V3 shape, block_m 64 and 16, the correct
variant) and ``_queue_publish_kernel`` for ``GPUTarget("cuda", 90, 32)`` and checks, in the text:

* every wait is an acquire load (``ld.global.gpu.acquire``) in one thread whose value is broadcast
  through shared memory and ``bar.sync`` (so the other threads' later loads follow it, and every
  thread takes the same branch);
* each release add is preceded by a fence in every thread and a ``bar.sync``, with no global store
  between the fence and the add: ``l1_done`` (fence.acq_rel.gpu, atom.release.gpu), ``l2_done``
  (fence.acq_rel.sys, atom.acq_rel.sys); the owners' ``arrived`` adds (atom.release.sys) follow the
  l2_done acq_rel, its broadcast ``bar.sync`` and a fence.sc.sys in every thread; the publish kernel's
  release max follows its fence;
* (an add whose result is unused may be a ``red`` instead of an ``atom``: Triton 3.9 emits that)
* no ``.nc`` load anywhere (the kernel reads rows, h1 and the ready list while other CTAs and other
  streams' kernels write them: the non-coherent path may serve stale lines within a kernel);
* the deadline reads ``%globaltimer`` and the back-off sleeps; the GEMM pipelines are there
  (``cp.async``, and ``wgmma`` at block_m 64).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# compiled mode: kernels decorated while TRITON_INTERPRET=1 cannot be compiled (and a process that ran
# the interpreter keeps triton.language patched): run this file in a process of its own
os.environ.pop("TRITON_INTERPRET", None)
EXIT_CANNOT_COMPILE = 3


def _compile(fn, signature: dict, constexprs: dict, num_warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps})
    return k.asm["ptx"]


PERSISTENT_ARGS = ("ctrl_ptr:*i32 ready_list_ptr:*i32 block_expert_ptr:*i32 a_ptr:*fp8e4nv asf_ptr:*fp32 "
                   "w1_ptr:*fp8e4nv w1sf_ptr:*fp32 h1_ptr:*fp8e4nv h1sf_ptr:*fp32 w2_ptr:*fp8e4nv w2sf_ptr:*fp32 "
                   "roww_ptr:*fp32 comb_ptr:*bf16 row_src_ptr:*i32 row_tok_ptr:*i64 row_chunk_ptr:*i32 "
                   "comb_delta_ptr:*i64 arrived_ptr:*i64 arrived_delta_ptr:*i64 status_ptr:*i64 trace_ptr:*i32 "
                   "witness_ptr:*i64 cap:i32 deadline_ns:i64")


def persistent_ptx(block_m: int, inject: int = 0) -> str:
    from streamring.device import persistent_moe as PM
    from streamring.device.moe_triton import _gemm_cfg

    sig = dict(a.split(":") for a in PERSISTENT_ARGS.split())
    cfg = _gemm_cfg(block_m, gemm="persistent")
    consts = dict(H=7168, I=2048, BM=block_m, GROUP=8, STAGES=cfg["STAGES"], NW=cfg["num_warps"], INJECT=inject,
                  TRACE=False, WITNESS=False, STALL_L1_US=0)
    sig.update({k: "constexpr" for k in consts})
    return _compile(PM._persistent_moe_kernel, sig, consts, cfg["num_warps"])


def publish_ptx() -> str:
    from streamring.device import persistent_moe as PM

    return _compile(PM._queue_publish_kernel, {"ctrl_ptr": "*i32", "ready_hi_ptr": "*i32", "index": "i32",
                                               "SEAL": "constexpr"}, {"SEAL": True}, 1)


def code_lines(ptx: str) -> list[str]:
    """The instructions (debug sections, .loc/.file lines and comments dropped)."""
    out = []
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and "debug" in s:
            break
        if not s or s.startswith(("//", ".loc", ".file", "$L__tmp")):
            continue
        out.append(re.sub(r"\s*//.*$", "", s))
    return out


def _find(lines, pattern):
    return [i for i, s in enumerate(lines) if re.search(pattern, s)]


def _ordered_before(lines, atom: str, chain: list[str], what: str) -> list[str]:
    """Each `atom` must be preceded by the patterns of `chain` in this order going backwards (the nearest
    one of each, before the previous), and no global store may sit between the first fence of the chain
    and the atom (a store there would not be covered by the release)."""
    found = []
    hits = _find(lines, atom)
    if not hits:
        return [f"{what}: no `{atom}` in the PTX"]
    for i in hits:
        at, fence_at = i, None
        for pat in chain:
            at = next((j for j in range(at - 1, -1, -1) if re.search(pat, lines[j])), None)
            if at is None:
                found.append(f"{what}: line {i} `{lines[i]}` is not preceded by {' <- '.join(chain)}")
                break
            if fence_at is None and pat.lstrip("^").startswith("fence"):
                fence_at = at
        else:
            stores = [lines[j] for j in range(fence_at + 1, i) if re.match(r"(@%p\d+ )?st\.global", lines[j])]
            if stores:
                found.append(f"{what}: a global store between the fence and the release: {stores[0]}")
    return found


def check_persistent(ptx: str, block_m: int) -> list[str]:
    lines = code_lines(ptx)
    bad = []
    nc = [s for s in lines if ".nc" in s and s.split()[0].startswith(("ld", "@"))]
    if nc:
        bad.append(f"non-coherent loads: {nc[:3]}")
    acq = _find(lines, r"ld\.global\.gpu\.acquire\.b32")
    if len(acq) < 4:  # ready wait (first poll + loop), l1_done wait (first poll + loop)
        bad.append(f"expected >= 4 acquire loads (ready word, l1_done), found {len(acq)}")
    for i in acq:
        if not re.match(r"@%p\d+ ld", lines[i]):
            bad.append(f"acquire load not in one thread: {lines[i]}")
        nxt = lines[i + 1: i + 4]
        if not (any(s.startswith("@") and "st.shared" in s for s in nxt) and any(s.startswith("bar.sync") for s in nxt)):
            bad.append(f"acquire load not broadcast through shared memory + bar.sync: {lines[i]} -> {nxt}")
    # every thread fences its stores, the barrier joins them, then one thread's release (l1_done, l2_done);
    # the owners' arrivals: the l2_done acq_rel (one thread), its broadcast barrier, every thread's
    # fence.sc.sys, then each lane's release add
    bad += _ordered_before(lines, r"(atom|red)\.global\.gpu\.release\.add\.u32", [r"^bar\.sync", r"^fence\.acq_rel\.gpu"],
                           "l1_done release")
    bad += _ordered_before(lines, r"atom\.global\.sys\.acq_rel\.add\.u32", [r"^bar\.sync", r"^fence\.acq_rel\.sys"],
                           "l2_done acq_rel")
    bad += _ordered_before(lines, r"(atom|red)\.global\.sys\.release\.add\.u64",
                           [r"^fence\.sc\.sys", r"^bar\.sync", r"atom\.global\.sys\.acq_rel\.add\.u32"],
                           "arrived release")
    for pat, what in ((r"%globaltimer", "deadline clock"), (r"^nanosleep", "back-off"),
                      (r"atom\.global\.(relaxed\.sys|sys\.relaxed)\.cas\.b64", "first-error CAS"),
                      (r"atom\.global\.gpu\.relaxed\.add\.u32", "claim counter"), (r"cp\.async", "K pipeline")):
        if not _find(lines, pat):
            bad.append(f"{what}: no `{pat}`")
    if block_m >= 64 and not _find(lines, r"wgmma"):
        bad.append("no wgmma at block_m 64")
    return bad


def check_publish(ptx: str) -> list[str]:
    lines = code_lines(ptx)
    i = _find(lines, r"(atom|red)\.global\.gpu\.release\.max\.s32")
    f = _find(lines, r"^fence\.acq_rel\.gpu")
    if not i or not f or f[0] > i[0]:
        return [f"publish: fence.acq_rel.gpu then a release max expected, found fence {f} atom {i}"]
    return []


def gemm_ptx(moe_triton_path: Path) -> dict[str, str]:
    """PTX of the GEMM and quantisation kernels of a moe_triton.py file (any revision)."""
    spec = importlib.util.spec_from_file_location(f"mt_{abs(hash(str(moe_triton_path)))}", moe_triton_path)
    mt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)
    ready = dict(ready_list_ptr="*i32", ready_hi_ptr="*i32", lo_index="i32", hi_index="i32", max_items="i32",
                 block_expert_ptr="*i32")
    if "single_tiles" in mt._l1_swiglu_kernel.arg_names:  # revisions with a grid for the expected blocks
        ready["single_tiles"] = "i32"
    ready["block_expert_ptr"] = ready.pop("block_expert_ptr")  # (after single_tiles, as in the kernels)
    out = {}
    # revisions with programmatic dependent launch take it as a constexpr: compiled without it, as every launch is
    pdl = {"PDL": False} if "PDL" in mt._l1_swiglu_kernel.arg_names else {}
    for persist in (False, True):
        for bm, nw, st in ((16, 4, 4), (64, 8, 3)):
            sig = dict(ready, a_ptr="*fp8e4nv", asf_ptr="*fp32", w1_ptr="*fp8e4nv", w1sf_ptr="*fp32",
                       h1_ptr="*fp8e4nv", h1sf_ptr="*fp32")
            c = dict(H=7168, I=2048, BM=bm, GROUP=8, STAGES=st, **pdl, PERSIST=persist)
            out[f"l1_p{int(persist)}_bm{bm}"] = _compile(mt._l1_swiglu_kernel, {**sig, **{k: "constexpr" for k in c}},
                                                         c, nw)
            for direct in (False, True):
                sig = dict(ready, h1_ptr="*fp8e4nv", h1sf_ptr="*fp32", w2_ptr="*fp8e4nv", w2sf_ptr="*fp32",
                           roww_ptr="*fp32", y_ptr="*bf16", row_src_ptr="*i32", row_tok_ptr="*i64",
                           comb_delta_ptr="*i64")
                if "block_rows_ptr" in mt._l2_kernel.arg_names:  # revisions with the routed rows per block
                    sig["block_rows_ptr"] = "*i32"
                c = dict(H=7168, I=2048, BM=bm, GROUP=8, STAGES=st, **pdl, PERSIST=persist, DIRECT=direct)
                out[f"l2_p{int(persist)}_d{int(direct)}_bm{bm}"] = _compile(
                    mt._l2_kernel, {**sig, **{k: "constexpr" for k in c}}, c, nw)
    c = dict(H=7168, BR=16)
    out["quant_rows"] = _compile(mt._quant_rows_kernel, dict(x_ptr="*bf16", x_stride="i32", q_ptr="*fp8e4nv",
                                                             sf_ptr="*fp32", n_rows="i32", H="constexpr",
                                                             BR="constexpr"), c, 4)
    c = dict(I=2048, BM=64, RB=32)
    ready.pop("block_expert_ptr")
    ready.pop("single_tiles", None)
    out["swiglu_quant"] = _compile(mt._swiglu_quant_kernel, dict(ready, gu_ptr="*bf16", h1_ptr="*fp8e4nv",
                                                                 h1sf_ptr="*fp32", roww_ptr="*fp32", h1sfw_ptr="*fp32",
                                                                 I="constexpr", BM="constexpr", RB="constexpr"), c, 4)
    return out


def compare_gemms(rev: str) -> list[str]:
    """The GEMM/quant PTX of the working tree's moe_triton.py against revision ``rev``'s (instructions only, the
    parameters' numbers left out)."""
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:streamring/device/moe_triton.py"],
                         capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "moe_triton_old.py"
        p.write_text(old)
        before = gemm_ptx(p)
    after = gemm_ptx(ROOT / "streamring/device/moe_triton.py")

    def instructions(ptx: str) -> list[str]:
        # the parameter list and the parameters' numbers are left out: a kernel argument added that one form
        # of the kernel does not use changes them and no instruction
        return [re.sub(r"_param_\d+", "_param_N", s) for s in code_lines(ptx) if not s.startswith(".param")]
    return [f"{name}: PTX differs from {rev}" for name in before if instructions(before[name]) != instructions(after[name])]


def negative_controls(ptx: str) -> list[str]:
    """The checks on edited PTX text must find what was broken (else they are vacuous)."""
    lines = ptx.splitlines()
    cases = {
        "l1_done release": "\n".join(x for x in lines if "fence.acq_rel.gpu" not in x),
        "arrived release": "\n".join(x for x in lines if "fence.sc.sys" not in x),
        "non-coherent": ptx.replace("ld.global.b32", "ld.global.nc.b32", 1),
        "acquire loads": ptx.replace("ld.global.gpu.acquire.b32", "ld.global.gpu.relaxed.b32"),
    }
    return [f"negative control: removing/breaking `{what}` was not reported" for what, text in cases.items()
            if not any(what in f for f in check_persistent(text, 64))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="compare the GEMM/quant kernels' PTX with moe_triton.py at REV")
    ap.add_argument("--dump", metavar="DIR", help="write the PTX files here")
    ap.add_argument("--controls", action="store_true", help="also check that broken PTX text is reported")
    args = ap.parse_args(argv)
    import triton

    findings = []
    texts = {}
    try:
        for bm in (64, 16):
            texts[f"persistent_bm{bm}"] = persistent_ptx(bm)
        texts["publish"] = publish_ptx()
    except Exception as exc:  # noqa: BLE001 - no CUDA backend or ptxas in this Triton
        print(f"triton {triton.__version__}: cannot compile sm_90 PTX here: {type(exc).__name__}: {exc}")
        return EXIT_CANNOT_COMPILE
    for bm in (64, 16):
        findings += [f"block_m {bm}: {f}" for f in check_persistent(texts[f"persistent_bm{bm}"], bm)]
    findings += check_publish(texts["publish"])
    if args.controls:
        findings += negative_controls(texts["persistent_bm64"])
    if args.baseline:
        findings += compare_gemms(args.baseline)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for name, text in texts.items():
            Path(args.dump, f"{name}.ptx").write_text(text)
    print(f"triton {triton.__version__}, sm_90: "
          + ("every ordering check passed" + (f"; GEMM/quant PTX equal to {args.baseline}'s" if args.baseline else "")
             if not findings else f"{len(findings)} findings"))
    for f in findings:
        print("  " + f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
