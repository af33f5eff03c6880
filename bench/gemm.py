"""Expert GEMMs of the block consumer on one GPU: Triton vs CUTLASS vs DeepGEMM vs ``torch._scaled_grouped_mm``.

DeepSeek-V3 shape (hidden 7168, intermediate 2048, 256 experts, top-8), FP8 e4m3 with 1x128
activation scales and 128x128 weight scales. For every token count T: uniform random routing (8
distinct experts per token out of 256), rows = 8 T, block_m 64, the batch path's ready blocks
(one dispatch + seal, as ``moe_forward`` makes them), and in the same run:

* L1 (gate+up, K = 7168, N = 4096, then SwiGLU + FP8 requant):
  ``triton`` = ``moe_triton.expert_l1`` as ``BlockConsumer.compute`` launches it (SwiGLU fused);
  ``cutlass_<tile>_<f32|bf16>`` = the CUTLASS grouped GEMM into a float32 or bf16 ``gu`` plus
  ``moe_triton.swiglu_quant_blocks`` (its time included);
* L2 (K = 2048, N = 7168, times the routing weight, bf16 rows):
  ``triton`` = ``moe_triton.expert_l2``; ``cutlass_<tile>`` = the CUTLASS grouped GEMM with the
  routing weight folded into the activation scales;
* ``torch_scaled_grouped_mm``: the same FP8 rows sorted by expert, one scale per row and per weight
  column (the max of the row's / column's block scales: torch has no 1x128 / 128x128 block scales),
  bf16 out; timed, not checked (its numerics are different);
* ``deep_gemm`` (whenever ``import deep_gemm`` works, ``--deep-gemm auto``): the same routing and
  activations in a consumer of 128-row blocks (DeepGEMM's contiguous layout), L1 =
  ``m_grouped_fp8_gemm_nt_contiguous`` over the whole block buffer with the psum layout (only the
  allocated blocks are scheduled; ``gemm.deep_gemm.psum_layout``) into a bf16 ``gu`` +
  ``swiglu_quant_blocks``, L2 with the routing weight folded into its scales - exactly what
  ``gemm="deep_gemm"``'s batch path runs (``streamring/gemm/deep_gemm.py``), minus the per-call
  preparation (the psum layout and the MN-major scale copies), timed apart as ``deep_gemm_prep``;
  ``deep_gemm_m_indices``: the same calls with ``m_indices`` (-1 outside the ready blocks: a streamed
  chunk's call), checked bitwise equal to the psum call's rows before it is timed; and
  ``deep_gemm_exact_m``: the ``m_indices`` calls over only the allocated blocks (the batch path
  allocates them first, so ``M`` = blocks x 128 with no -1 tail: each expert's rows padded to 128,
  DeepGEMM's own layout, as issue 21 measured it). ``ratio_vs_deep_gemm`` is against the fastest.

CUTLASS variants are ``tile:out_dtype[:raster[:s<swizzle>]]`` (``--l1``) and ``tile[:raster[:s<swizzle>]]``
(``--l2``), tiles of ``gemm.cutlass.TILE_TABLE``, raster ``m`` (default) or ``n``, the group scheduler's
swizzle ``s1`` (default), ``s2``, ``s4`` or ``s8``. Every row carries the ratio to torch and
to DeepGEMM (its time / ours: > 1 means faster than DeepGEMM), and ``variant``: the name the
heuristic table uses (``streamring/gemm/choice.py``). ``--table PATH`` writes that table: per
(rows per expert, N, K) every variant's median and the fastest.

``--layer-tokens`` (default 8192): the whole batch layer on one GPU (router, FP8 layout, dispatch into
blocks, seal, both GEMMs, combine: ``gemm_lib.layer_forward``, one CUDA graph) for each GEMM
implementation, each with the variants this run measured fastest at that size (the fallback rule if
the size was not measured), and which one ``gemm="auto"`` picks; every output is compared with
Triton's and a float64 reference, and the streamed path (``streamed_forward_serial``, 2 chunks) is
checked bitwise against the batch output. These rows have ``gemm`` = ``"layer"``.

Before any timing every kernel of ours is checked on input set 0, outputs poisoned with NaN first:
(1) sampled rows against a float64 reference of the dequantized operands, elementwise
``|ours - ref| <= 2^-9 * sum_k |a_k w_k| (+ the output rounding)`` and a relative Frobenius error
below 1e-3 (+ 2^-8 for a bf16 output); (2) CUTLASS against Triton on every routed row (L1: the FP8 ``h1`` within one e4m3 step
and >= 90 % bitwise equal; L2: relative Frobenius error < 2^-8). A kernel that fails is reported
with its error and NOT timed.

Timing: each callable is captured once in a CUDA graph (eager if the capture fails, recorded), then
for each of ``--sets`` input sets (routing + activations) the graphs are replayed ``--replays``
times interleaved (A B C A B C ...) with CUDA events; medians. Per size a table: ms, TFLOP/s
(useful: 2 * rows * N * K), % of the 1979 TFLOP/s dense FP8 peak, weight-read GB/s and % of
4.8 TB/s, ratio to torch (torch time / ours). ``--json`` writes one row per measurement.

    python -m bench.gemm --tokens 128,1024,8192,32768 --json docs/results/gemm-<date>.json \
        --table streamring/gemm/table.json

This file is the script; what other scripts reuse of it is in :mod:`bench.gemm_lib` (the input case,
variant specs, the table, the batch layer) and :mod:`bench.common` (shape, inputs, timing).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch

from streamring.gemm import cutlass as CG
from streamring.gemm import deep_gemm as DG
from streamring.moe import blocks as B
from streamring.moe.reference import reference_forward_f64, reference_tolerance
from streamring.moe.weights import MoEWeights
from bench import block_paths
from streamring.gemm import choice as GC
from bench.common import (FP8, HBM_GBS, PEAK_FP8_TFLOPS, T0, capture, dsv3_shape, log, poison,
                          time_interleaved)
from bench.gemm_lib import Case, deep_gemm_first_call, layer_forward, make_table, parse_variants

# ----------------------------------------------------------------------------------------------
# numerics helpers
# ----------------------------------------------------------------------------------------------
def deq_rows(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """float64 of FP8 rows ``q [n, K]`` with scales ``sf [n, K/128]``."""
    n, k = q.shape
    return (q.double().view(n, k // 128, 128) * sf.double()[:, :, None]).view(n, k)


def deq_weight(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """float64 of one expert's FP8 weight ``w [N, K]`` with ``sf [N/128, K/128]``."""
    n, k = w.shape
    return (w.double().view(n // 128, 128, k // 128, 128) * sf.double()[:, None, :, None]).reshape(n, k)


def check_sampled(out_rows: torch.Tensor, a_rows: torch.Tensor, experts: torch.Tensor, w, w_sf, scale=None,
                  out_round: float = 0.0) -> dict:
    """``out_rows [S, N]`` against ``(a_rows @ deq(w[e])^T) * scale`` in float64, per expert.

    Elementwise bound ``2^-9 * sum_k |a_k w_k| * |scale| + out_round * |ref|`` (the fp32/tensor-core
    accumulation of FP8 products is far inside 2^-9 of the absolute sum; a wrong row, expert, scale
    or K block is not) and relative Frobenius error < 1e-3 (+ ``out_round`` for a rounded output).
    """
    worst, bad = 0.0, 0
    num, den = 0.0, 0.0
    for e in torch.unique(experts).tolist():
        sel = (experts == e).nonzero().flatten()
        wd = deq_weight(w[e], w_sf[e])
        ref = a_rows[sel] @ wd.t()
        absum = a_rows[sel].abs() @ wd.abs().t()
        if scale is not None:
            ref = ref * scale[sel].double()[:, None]
            absum = absum * scale[sel].double().abs()[:, None]
        got = out_rows[sel].double()
        err = (got - ref).abs()
        tol = 2.0 ** -9 * absum + out_round * ref.abs() + 1e-30
        ok = err <= tol  # NaN (an unwritten, poisoned row) fails
        bad += int((~ok).sum())
        worst = max(worst, float(torch.nan_to_num(err / tol, nan=float("inf")).max()))
        num += float(torch.nan_to_num((got - ref) ** 2, nan=float("inf")).sum())
        den += float((ref ** 2).sum())
    rel = math.sqrt(num / max(den, 1e-300))
    limit = 1e-3 + out_round  # a bf16 output alone is ~2^-9 off (RMS) the float64 value
    return {"ok": bad == 0 and rel < limit, "bad_elements": bad, "worst_err_over_tol": worst, "rel_fro": rel,
            "rel_fro_limit": limit}


def fp8_step(q: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at |q| (q in quantized units, |q| <= 448): 2^(floor(log2|q|) - 3), subnormals 2^-9."""
    a = q.abs().float().clamp_min(2.0 ** -6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3.0)


def check_h1_sampled(h1q, h1sf, a_rows, experts, w1, w1_sf) -> dict:
    """SwiGLU + FP8 requant output of sampled rows against float64 ``silu(g) * u`` of the dequantized
    operands: within one e4m3 step of the row's scale plus 2^-8 relative (the GEMM's accumulation
    error passed through SwiGLU)."""
    bad, worst = 0, 0.0
    i = h1q.shape[1]
    for e in torch.unique(experts).tolist():
        sel = (experts == e).nonzero().flatten()
        wd = deq_weight(w1[e], w1_sf[e])
        gu = a_rows[sel] @ wd.t()
        h_ref = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        # the float32 GEMM's absolute accumulation error (2^-9 of the sum of |terms|, as check_sampled
        # allows) through SwiGLU: |silu(g)| * err(u) + |silu'(g)| (<= 1.1) * |u| * err(g). A value near
        # zero after cancellation in u or g cannot be held to a relative bound.
        absum = a_rows[sel].abs() @ wd.abs().t()
        acc = 2.0 ** -9 * (torch.nn.functional.silu(gu[:, :i]).abs() * absum[:, i:] + 1.1 * gu[:, i:].abs() * absum[:, :i])
        q = h1q[sel].float()
        sc = h1sf[sel].double().repeat_interleave(128, dim=1)
        h = q.double() * sc
        tol = fp8_step(q).double() * sc + 2.0 ** -8 * h_ref.abs() + acc + 1e-30
        err = (h - h_ref).abs()
        bad += int((~(err <= tol)).sum())
        worst = max(worst, float(torch.nan_to_num(err / tol, nan=float("inf")).max()))
    return {"ok": bad == 0, "bad_elements": bad, "worst_err_over_tol": worst}


def compare_h1(h1_c, sf_c, h1_t, sf_t, rows, chunk=16384, steps: float = 1.001) -> dict:
    """CUTLASS vs Triton ``h1`` on ``rows``: dequantized values within ``steps`` e4m3 steps (one for a
    float32 L1 output; a bf16 output rounds the SwiGLU input first, two), and the share of bitwise
    equal FP8 values."""
    bad, equal, total, worst = 0, 0, 0, 0.0
    for s in range(0, rows.numel(), chunk):
        r = rows[s:s + chunk]
        qc, qt = h1_c[r].float(), h1_t[r].float()
        n, i = qc.shape
        scc = sf_c[r].repeat_interleave(128, dim=1)
        sct = sf_t[r].repeat_interleave(128, dim=1)
        hc, ht = qc * scc, qt * sct
        tol = torch.maximum(fp8_step(qc) * scc, fp8_step(qt) * sct) * steps + 1e-30
        err = (hc - ht).abs()
        ok = err <= tol
        bad += int((~ok).sum())
        worst = max(worst, float(torch.nan_to_num(err / tol, nan=float("inf")).max()))
        equal += int((h1_c[r].view(torch.uint8) == h1_t[r].view(torch.uint8)).sum())
        total += qc.numel()
    frac = equal / max(total, 1)
    return {"ok": bad == 0 and frac >= 0.90, "bad_elements": bad, "worst_err_over_step": worst,
            "frac_bitwise_equal": frac}


def compare_rel(x, y, rows, limit: float, chunk=16384) -> dict:
    """Relative Frobenius error of ``x`` against ``y`` on ``rows`` (NaN fails)."""
    num, den = 0.0, 0.0
    for s in range(0, rows.numel(), chunk):
        r = rows[s:s + chunk]
        a, b = x[r].float(), y[r].float()
        num += float(torch.nan_to_num((a - b) ** 2, nan=float("inf")).sum())
        den += float((b ** 2).sum())
    rel = math.sqrt(num / max(den, 1e-300))
    return {"ok": rel < limit, "rel_fro": rel, "limit": limit}


def variant_of(impl: str, plans: dict) -> str | None:
    """The heuristic table's key of a row's implementation (None for torch and the prep row)."""
    if impl in plans:
        p = plans[impl]
        return GC.variant_key("cutlass", p.tile, "f32" if p.out_dtype == torch.float32 else "bf16", p.raster,
                              p.swizzle)
    if impl in ("triton", "deep_gemm"):
        return impl
    return None


def run_size(T, shape, fw, args, plans_l1, plans_l2, dev, dg=None) -> tuple[list, dict]:
    H, I = shape.hidden, shape.intermediate
    log(f"T={T}: buffers and {args.sets} input sets")
    c = Case(T, shape, fw, args, dev, dg)
    bc = c.bc
    c.load(0)
    torch.cuda.synchronize()
    checks = {}
    # ---- correctness on set 0, outputs poisoned first --------------------------------------
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    pick = torch.randperm(c.rows, generator=g)[:args.sample_rows].to(dev)
    rows_s = c.real_rows[pick]
    experts_s = bc.block_expert[(rows_s // bc.block_m)].long()
    a_s = deq_rows(bc.a.view(FP8)[rows_s], bc.a_sf[rows_s])
    # Triton L1 (ran in load) -> its h1; Triton L2
    poison(bc.y)
    c.triton_l2()
    torch.cuda.synchronize()
    h_s = deq_rows(bc.h1.view(FP8)[rows_s], bc.h1_sf[rows_s])
    rw_s = bc.row_weight[rows_s]
    checks[("l2", "triton")] = check_sampled(bc.y[rows_s], h_s, experts_s, fw.w2, fw.w2_sf, rw_s, out_round=2.0 ** -8)
    checks[("l1", "triton")] = check_h1_sampled(bc.h1.view(FP8)[rows_s], bc.h1_sf[rows_s], a_s, experts_s, fw.w1,
                                                fw.w1_sf)
    for name, plan in plans_l1.items():
        gu = c.gu[plan.out_dtype]
        poison(gu, c.h1c, c.h1c_sf)
        try:
            c.cutlass_l1(plan)
            plan.check()
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not timed
            checks[("l1", name)] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
            torch.cuda.synchronize()
            continue
        rnd = 2.0 ** -8 if plan.out_dtype == torch.bfloat16 else 0.0
        r1 = check_sampled(gu[rows_s], a_s, experts_s, fw.w1, fw.w1_sf, out_round=rnd)
        r2 = compare_h1(c.h1c, c.h1c_sf, bc.h1.view(FP8), bc.h1_sf, c.real_rows,
                        steps=2.001 if plan.out_dtype == torch.bfloat16 else 1.001)
        r3 = check_h1_sampled(c.h1c[rows_s], c.h1c_sf[rows_s], a_s, experts_s, fw.w1, fw.w1_sf)
        checks[("l1", name)] = {"ok": r1["ok"] and r2["ok"] and r3["ok"], "gemm_vs_float64": r1, "h1_vs_triton": r2,
                                "h1_vs_float64": r3}
    for name, plan in plans_l2.items():
        poison(c.yc)
        try:
            c.cutlass_l2(plan)
            plan.check()
        except Exception as exc:  # noqa: BLE001
            checks[("l2", name)] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
            torch.cuda.synchronize()
            continue
        r1 = check_sampled(c.yc[rows_s], h_s, experts_s, fw.w2, fw.w2_sf, rw_s, out_round=2.0 ** -8)
        r2 = compare_rel(c.yc, bc.y, c.real_rows, 2.0 ** -8)
        checks[("l2", name)] = {"ok": r1["ok"] and r2["ok"], "vs_float64": r1, "vs_triton": r2}
    if dg is not None:
        checks.update(check_deep_gemm(c, pick, args))
    for (gemm, impl), r in checks.items():
        log(f"  check {gemm} {impl:24s} {'ok' if r['ok'] else 'FAILED'}  "
            f"{json.dumps({k: v for k, v in r.items() if k != 'ok'})[:300]}")
    # ---- timing -----------------------------------------------------------------------------
    fns = {"l1": {}, "l2": {}}
    modes = {}
    if checks[("l1", "triton")]["ok"]:
        fns["l1"]["triton"] = c.triton_l1
    for name, plan in plans_l1.items():
        if checks[("l1", name)]["ok"]:
            fns["l1"][name] = (lambda p=plan, c=c: c.cutlass_l1(p))
    if checks[("l2", "triton")]["ok"]:
        fns["l2"]["triton"] = c.triton_l2
    for name, plan in plans_l2.items():
        if checks[("l2", name)]["ok"]:
            fns["l2"][name] = (lambda p=plan, c=c: c.cutlass_l2(p))
    if dg is not None:
        if checks[("l1", "deep_gemm")]["ok"]:
            fns["l1"]["deep_gemm"] = c.deep_gemm_l1
            fns["l1"]["deep_gemm_prep"] = c.deep_gemm_prep
            if checks.get(("l1", "deep_gemm_m_indices"), {}).get("ok"):
                fns["l1"]["deep_gemm_m_indices"] = lambda c=c: c.deep_gemm_l1(psum=False)
            if c.m_exact > 0:
                fns["l1"]["deep_gemm_exact_m"] = c.deep_gemm_exact_l1
        if checks[("l2", "deep_gemm")]["ok"]:
            fns["l2"]["deep_gemm"] = c.deep_gemm_l2
            if checks.get(("l2", "deep_gemm_m_indices"), {}).get("ok"):
                fns["l2"]["deep_gemm_m_indices"] = lambda c=c: c.deep_gemm_l2(psum=False)
            if c.m_exact > 0:
                fns["l2"]["deep_gemm_exact_m"] = c.deep_gemm_exact_l2
    fns["l1"]["torch_scaled_grouped_mm"] = c.torch_l1
    fns["l2"]["torch_scaled_grouped_mm"] = c.torch_l2
    plans = {**plans_l1, **plans_l2}
    rows_out = []
    summary = {}
    for gemm in ("l1", "l2"):
        runners = {}
        for k, fn in fns[gemm].items():
            try:
                runners[k], modes[(gemm, k)] = capture(fn, args.no_graphs)
            except Exception as exc:  # noqa: BLE001 - e.g. torch._scaled_grouped_mm missing
                log(f"  {gemm} {k}: cannot run: {type(exc).__name__}: {str(exc)[:200]}")
                checks.setdefault((gemm, k), {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
        log(f"  timing {gemm}: {list(runners)}")
        res = time_interleaved(runners, args.sets, c.load, args.replays)
        n, kk = (2 * I, H) if gemm == "l1" else (H, I)
        flops = 2.0 * c.rows * n * kk
        wbytes = c.experts_used * n * kk  # FP8 weights of the experts in use (every set uses all 256 here)
        t_torch = res.get("torch_scaled_grouped_mm", {}).get("median_ms")
        # DeepGEMM's speed: the fastest of its forms (the consumer's psum and m_indices calls, exact M)
        dgs = [res[k]["median_ms"] for k in ("deep_gemm", "deep_gemm_m_indices", "deep_gemm_exact_m") if k in res]
        t_dg = min(dgs) if dgs else None
        for impl, t in res.items():
            tf = flops / (t["median_ms"] * 1e-3) / 1e12
            gbs = wbytes / (t["median_ms"] * 1e-3) / 1e9
            row = {"tokens": T, "gemm": gemm, "impl": impl,
                   "ours": impl != "torch_scaled_grouped_mm" and not impl.startswith("deep_gemm"),
                   "median_ms": t["median_ms"], "min_ms": t["min_ms"], "max_ms": t["max_ms"], "n": t["n"],
                   "tflops": tf, "pct_dense_fp8_peak": 100.0 * tf / PEAK_FP8_TFLOPS, "weight_gbs": gbs,
                   "pct_hbm": 100.0 * gbs / HBM_GBS, "ratio_vs_torch": (t_torch / t["median_ms"]) if t_torch else None,
                   "ratio_vs_deep_gemm": (t_dg / t["median_ms"]) if t_dg else None,
                   "rows": c.rows, "n_dim": n, "k_dim": kk,
                   "block_m": DG.BLOCK_M if impl.startswith("deep_gemm") else bc.block_m,
                   "mode": modes.get((gemm, impl)), "variant": variant_of(impl, plans),
                   "check": checks.get((gemm, impl))}
            rows_out.append(row)
        for (g_, impl), r in checks.items():
            if g_ == gemm and not r["ok"]:
                rows_out.append({"tokens": T, "gemm": gemm, "impl": impl, "ours": not impl.startswith("deep_gemm"),
                                 "median_ms": None, "tflops": None, "n_dim": n, "k_dim": kk,
                                 "variant": variant_of(impl, plans),
                                 "error": "failed the correctness check: not timed", "check": r})
        ours = [r for r in rows_out if r["gemm"] == gemm and r["ours"] and r["median_ms"] is not None]
        best = min(ours, key=lambda r: r["median_ms"]) if ours else None
        cut = [r for r in ours if r["impl"] != "triton"]
        best_c = min(cut, key=lambda r: r["median_ms"]) if cut else None
        if best_c:
            best_c["best_cutlass"] = True
        if best:
            best["best_ours"] = True
        summary[gemm] = best
        print_table(T, gemm, [r for r in rows_out if r["gemm"] == gemm])
    del c
    torch.cuda.empty_cache()
    return rows_out, summary


def m_indices_equals_psum(d: torch.Tensor, rows: torch.Tensor, call) -> dict:
    """After ``call()`` (psum layout) wrote ``d``: poison ``d``, ``call(psum=False)`` (m_indices: a streamed
    chunk's form) and compare the routed ``rows`` bitwise."""
    want = d[rows].clone()
    poison(d)
    call(psum=False)
    torch.cuda.synchronize()
    same = bool(torch.equal(d[rows], want))
    return {"ok": same, "bitwise_equal_to_psum": same}


def check_deep_gemm(c: Case, pick, args) -> dict:
    """DeepGEMM's L1 (+ SwiGLU) and L2 on set 0 against float64 and against Triton on the same 128-row
    blocks; outputs poisoned first."""
    fw, bd = c.fw, c.bd
    out = {}
    try:
        rows_s = c.d_real_rows[pick]
        experts_s = bd.block_expert[rows_s // bd.block_m].long()
        a_s = deq_rows(bd.a.view(FP8)[rows_s], bd.a_sf[rows_s])
        poison(c.d_gu, c.d_h1, c.d_h1_sf)
        c.deep_gemm_prep()
        c.deep_gemm_l1()
        torch.cuda.synchronize()
        r1 = check_sampled(c.d_gu[rows_s], a_s, experts_s, fw.w1, fw.w1_sf, out_round=2.0 ** -8)
        r2 = compare_h1(c.d_h1, c.d_h1_sf, bd.h1.view(FP8), bd.h1_sf, c.d_real_rows, steps=2.001)
        r3 = check_h1_sampled(c.d_h1[rows_s], c.d_h1_sf[rows_s], a_s, experts_s, fw.w1, fw.w1_sf)
        out[("l1", "deep_gemm")] = {"ok": r1["ok"] and r2["ok"] and r3["ok"], "gemm_vs_float64": r1,
                                    "h1_vs_triton": r2, "h1_vs_float64": r3}
        out[("l1", "deep_gemm_m_indices")] = m_indices_equals_psum(c.d_gu, c.d_real_rows, c.deep_gemm_l1)
        # L2 on Triton's h1 of the 128-row consumer (its h1_sf x weight copied MN-major by the prep)
        poison(bd.y, c.d_y)
        torch.mul(bd.h1_sf, bd.row_weight[:, None], out=c.d_h1_sfw)
        c.deep_gemm_prep()
        c.triton_l2(bd)
        c.deep_gemm_l2()
        torch.cuda.synchronize()
        h_s = deq_rows(bd.h1.view(FP8)[rows_s], bd.h1_sf[rows_s])
        r1 = check_sampled(c.d_y[rows_s], h_s, experts_s, fw.w2, fw.w2_sf, bd.row_weight[rows_s], out_round=2.0 ** -8)
        r2 = compare_rel(c.d_y, bd.y, c.d_real_rows, 2.0 ** -8)
        out[("l2", "deep_gemm")] = {"ok": r1["ok"] and r2["ok"] and int(c.d_status.item()) == 0, "vs_float64": r1,
                                    "vs_triton": r2, "status": int(c.d_status.item())}
        out[("l2", "deep_gemm_m_indices")] = m_indices_equals_psum(c.d_y, c.d_real_rows, c.deep_gemm_l2)
    except Exception as exc:  # noqa: BLE001 - DeepGEMM failing is reported, the rest goes on
        torch.cuda.synchronize()
        err = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        out.setdefault(("l1", "deep_gemm"), err)
        out.setdefault(("l2", "deep_gemm"), err)
    return out


def print_table(T, gemm, rows):
    small = T <= 1024
    print(f"\n  T={T} {gemm.upper()}  (rows={rows[0].get('rows')}, N={rows[0].get('n_dim')}, K={rows[0].get('k_dim')})")
    head = f"  {'impl':30s} {'ms':>8s} {'TFLOP/s':>8s} {'%peak':>6s} {'x torch':>8s} {'x DeepGEMM':>10s}"
    if small:
        head += f" {'w GB/s':>8s} {'%HBM':>6s}"
    print(head)
    for r in rows:
        if r["median_ms"] is None:
            print(f"  {r['impl']:30s} FAILED CHECK (not timed)")
            continue
        ratio = f"{r['ratio_vs_torch']:.3f}" if r.get("ratio_vs_torch") else "-"
        rdg = f"{r['ratio_vs_deep_gemm']:.3f}" if r.get("ratio_vs_deep_gemm") else "-"
        line = (f"  {r['impl']:30s} {r['median_ms']:8.3f} {r['tflops']:8.1f} {r['pct_dense_fp8_peak']:6.1f} "
                f"{ratio:>8s} {rdg:>10s}")
        if small:
            line += f" {r['weight_gbs']:8.0f} {r['pct_hbm']:6.1f}"
        tag = "  <- best of ours" if r.get("best_ours") else ("  <- best CUTLASS" if r.get("best_cutlass") else "")
        print(line + tag, flush=True)


def targets(summary_by_t: dict) -> list[str]:
    """Issue 21's targets, judged on the best of ours (Triton or CUTLASS) per size and GEMM."""
    out = []
    for T, s in summary_by_t.items():
        for gemm, best in s.items():
            if best is None:
                out.append(f"T={T} {gemm}: no time of ours")
                continue
            r = best.get("ratio_vs_torch")
            need = 1.25 if T <= 1024 else 1.0
            if r is not None:
                out.append(f"T={T} {gemm}: best {best['impl']} {r:.3f}x torch (target >= {need}) "
                           f"{'MET' if r >= need else 'MISSED'}")
            d = best.get("ratio_vs_deep_gemm")
            need_d = 1.10 if T <= 1024 else 1.0
            out.append(f"T={T} {gemm}: best {best['impl']} " + (f"{d:.3f}x DeepGEMM (target >= {need_d}) "
                       f"{'MET' if d >= need_d else 'MISSED'}" if d is not None else "- no DeepGEMM time"))
            if T == 32768 and gemm == "l1":
                tf = best["tflops"]
                out.append(f"T={T} {gemm}: {tf:.0f} TFLOP/s = {best['pct_dense_fp8_peak']:.1f}% of dense FP8 peak "
                           f"(target >= 1100 TFLOP/s) {'MET' if tf >= 1100 else 'MISSED'}")
            if T == 128:
                h = best["pct_hbm"]
                out.append(f"T={T} {gemm}: {h:.1f}% of HBM for weights (target >= 85) {'MET' if h >= 85 else 'MISSED'}")
    return out


def layer_rows(T, shape, mw, args, dev, table: dict, avail: dict) -> tuple[list, dict]:
    """``gemm_lib.layer_forward`` (one CUDA graph) per implementation with this run's fastest variants, on the
    layer ``mw`` (a ``MoEWeights``), checked against its float64 reference."""
    fw = mw.fp8_blocks()
    H, I, E, Kk = shape.hidden, shape.intermediate, shape.num_experts, shape.topk
    rpe = T * Kk / E
    g = torch.Generator(device=dev).manual_seed(args.seed + 77)
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    impls = [i for i in ("triton", "cutlass", "deep_gemm") if not avail.get(i, "missing")]
    auto = GC.choose_layer(rpe, H, I, avail, table, block_m=args.block_m)
    meta = {"tokens": T, "rows_per_expert": rpe, "auto": {"impl": auto.impl, "l1": auto.l1.key, "l2": auto.l2.key,
                                                          "source": auto.source, "skipped": auto.skipped}}
    log(f"layer T={T}: auto picks {auto.impl} (L1 {auto.l1.key}, L2 {auto.l2.key}): {auto.source}")
    outs, fns, info = {}, {}, {}
    for impl in impls:
        bm = DG.BLOCK_M if impl == "deep_gemm" else args.block_m
        choice = GC.choose_layer(rpe, H, I, {impl: ""}, table, block_m=bm)
        try:
            fwd, out, bc = layer_forward(impl, choice, bm, x, shape, fw, dev)
            fns[impl], mode = capture(fwd, args.no_graphs)
            torch.cuda.synchronize()
            outs[impl] = out
            info[impl] = {"choice": choice, "block_m": bm, "mode": mode, "bc": bc}
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            log(f"layer T={T} {impl}: cannot run: {type(exc).__name__}: {str(exc)[:300]}")
            info[impl] = {"choice": choice, "block_m": bm, "error": f"{type(exc).__name__}: {exc}"[:400]}
    res = time_interleaved(fns, 1, lambda s: None, args.layer_replays) if fns else {}
    samp = torch.linspace(0, T - 1, 4, device=dev).round().long().unique()
    ref = reference_forward_f64(x, mw, shape, tokens=samp)
    rel_tol = reference_tolerance(shape, fp8_blocks=True)[0]
    rows = []
    flops = 2.0 * T * Kk * (2 * I * H + H * I)
    wbytes = E * (2 * I * H + H * I)
    for impl in impls:
        inf = info[impl]
        ch = inf["choice"]
        row = {"tokens": T, "gemm": "layer", "impl": impl, "ours": impl != "deep_gemm", "block_m": inf["block_m"],
               "rows": T * Kk, "n_dim": None, "k_dim": None, "variant": {"l1": ch.l1.key, "l2": ch.l2.key},
               "choice_source": ch.source, "ratio_vs_torch": None}
        if impl not in res:
            rows.append({**row, "median_ms": None, "tflops": None, "error": inf.get("error", "not timed")})
            continue
        t = res[impl]
        tf = flops / (t["median_ms"] * 1e-3) / 1e12
        rel = float((outs[impl][samp].double() - ref).norm() / ref.norm().clamp_min(1e-30))
        rel_t = (float((outs[impl].float() - outs["triton"].float()).norm() / outs["triton"].float().norm())
                 if "triton" in outs else None)
        bitwise = streamed_equals_batch(T, shape, fw, args, dev, impl, ch, inf["block_m"], x, outs[impl])
        ok = rel < rel_tol and (rel_t is None or rel_t < 4e-2) and bitwise is not False
        rows.append({**row, "median_ms": t["median_ms"], "min_ms": t["min_ms"], "max_ms": t["max_ms"], "n": t["n"],
                     "tflops": tf, "pct_dense_fp8_peak": 100.0 * tf / PEAK_FP8_TFLOPS,
                     "weight_gbs": wbytes / (t["median_ms"] * 1e-3) / 1e9,
                     "pct_hbm": 100.0 * wbytes / (t["median_ms"] * 1e-3) / 1e9 / HBM_GBS, "mode": inf["mode"],
                     "bitwise_streamed_equals_batch": bitwise,
                     "check": {"ok": ok, "rel_err_vs_f64": rel, "rel_err_vs_triton": rel_t,
                               "f64_limit": rel_tol}})
    t_auto = next((r["median_ms"] for r in rows if r["impl"] == auto.impl), None)
    meta["auto"]["median_ms"] = t_auto
    modes = sorted({inf["mode"] for inf in info.values() if "mode" in inf}) or ["-"]
    print(f"\n  T={T} the batch layer (router + layout + dispatch + GEMMs + combine), one GPU, {'/'.join(modes)}")
    print(f"  {'impl':10s} {'block_m':>7s} {'ms':>8s} {'vs f64':>8s} {'vs Triton':>9s} {'str==bat':>8s}  variants")
    for r in rows:
        if r["median_ms"] is None:
            print(f"  {r['impl']:10s} {r['block_m']:7d} {'-':>8s}  {r.get('error', '')[:100]}")
            continue
        c = r["check"]
        rt = f"{c['rel_err_vs_triton']:.4f}" if c["rel_err_vs_triton"] is not None else "-"
        print(f"  {r['impl']:10s} {r['block_m']:7d} {r['median_ms']:8.3f} {c['rel_err_vs_f64']:8.4f} {rt:>9s} "
              f"{str(r['bitwise_streamed_equals_batch']):>8s}  L1 {r['variant']['l1']}, L2 {r['variant']['l2']}"
              + ("  <- auto" if r["impl"] == auto.impl else ""), flush=True)
    for impl, inf in info.items():
        inf.pop("bc", None)
    return rows, meta


def streamed_equals_batch(T, shape, fw, args, dev, impl, choice, bm, x, batch_out) -> bool | None:
    """The single-GPU streamed path (2 chunks, ``streamed_forward_serial``) against the batch output,
    bitwise (None when it cannot run)."""
    try:
        prod = B.Producer(T, shape.num_experts, dev)
        chunk = max(1, T // 2)
        bc = B.BlockConsumer(shape, T, -(-T // chunk) + 1, bm, dev)
        GC.setup_consumer(bc, choice, staging_y=False)  # y must keep every range's rows until the combine
        sc = block_paths.scratch_buffers(shape, T, dev)
        y = torch.zeros_like(batch_out)
        block_paths.streamed_forward_serial(x, fw, shape, prod, bc, sc, chunk, y, gemm_impl=impl)
        torch.cuda.synchronize()
        return bool(torch.equal(y, batch_out))
    except Exception as exc:  # noqa: BLE001
        torch.cuda.synchronize()
        log(f"  streamed {impl}: cannot run: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,1024,8192,32768")
    ap.add_argument("--json", help="write the rows here (e.g. docs/results/gemm-<date>.json)")
    ap.add_argument("--table", help="write the heuristic table here (streamring/gemm/table.json's format)")
    ap.add_argument("--sets", type=int, default=2, help="input sets (routing + activations)")
    ap.add_argument("--replays", type=int, default=8, help="timed replays per set and kernel")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--l1", default="coop128:f32,coop128:bf16,pingpong64:f32,pingpong64:bf16,coop128_m2:bf16,"
                                    "coop192_m2:bf16,coop192_n2:bf16,pingpong192:bf16,coop128:bf16:n,coop192_m2:bf16:n",
                    help="CUTLASS L1 variants tile:out_dtype[:raster[:s<swizzle>]]")
    ap.add_argument("--l2", default="coop128,pingpong64,coop128_m2,coop192_m2,coop192_n2,pingpong192,coop128:n,"
                                    "coop192_m2:n", help="CUTLASS L2 variants tile[:raster[:s<swizzle>]]")
    ap.add_argument("--deep-gemm", choices=["auto", "off"], default="auto",
                    help="time DeepGEMM beside ours when import deep_gemm works (auto)")
    ap.add_argument("--layer-tokens", default="8192", help="token counts of the whole-layer rows ('' for none)")
    ap.add_argument("--layer-replays", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no new size after this long (0: no limit)")
    ap.add_argument("--sample-rows", type=int, default=64, help="rows checked against the float64 reference")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-graphs", action="store_true",
                    help="time eager calls instead of CUDA graph replays (a diagnosis; graphs are the measurement)")
    args = ap.parse_args(argv)
    if args.no_graphs and args.table:
        ap.error("--no-graphs times eager calls, which the heuristic table must not hold: drop --table")
    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    var_l1, var_l2 = parse_variants(args.l1, "l1"), parse_variants(args.l2, "l2")
    info = CG.library_info()
    log(f"CUTLASS library {info['path']}: {info['build_info']}")
    for k, v in info["variants"].items():
        log(f"  {k}: {v}")
    dg = None
    dg_avail = DG.deep_gemm_available()
    dg_reason = dg_avail.reason
    if args.deep_gemm == "auto" and dg_avail:
        first_call = deep_gemm_first_call()
        if first_call is None:
            dg = DG.load()
        else:
            dg_reason = f"{dg_reason}; but {first_call}"
    log(f"DeepGEMM: {'timed' if dg is not None else 'not timed'}: {dg_reason}")
    shape = dsv3_shape(args.block_m)
    tokens = [int(v) for v in args.tokens.split(",") if v]
    layer_tokens = [int(v) for v in args.layer_tokens.split(",") if v]
    log(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}; weights (256 experts, FP8) ...")
    mw = MoEWeights.random_fp8(shape, 7, dev)
    fw = mw.fp8_blocks()
    torch.cuda.synchronize()
    log("weights ready")
    max_blocks = max(-(-t * shape.topk // args.block_m) + shape.num_experts for t in tokens)  # = bc.max_blocks
    plans_l1 = {name: CG.GroupedGemm(2 * shape.intermediate, shape.hidden, out_dtype=dt, tile=tile, raster=raster,
                                     swizzle=swz, capacity=max_blocks)
                for name, (tile, dt, raster, swz) in var_l1.items()}
    plans_l2 = {name: CG.GroupedGemm(shape.hidden, shape.intermediate, out_dtype=torch.bfloat16, tile=tile,
                                     raster=raster, swizzle=swz, capacity=max_blocks)
                for name, (tile, dt, raster, swz) in var_l2.items()}
    all_rows, summary = [], {}
    failed = False
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cutlass_library": info,
            "deep_gemm": {"timed": dg is not None, "reason": dg_avail.reason,
                          "version": getattr(dg, "__version__", None)},
            "args": vars(args), "peak_fp8_tflops": PEAK_FP8_TFLOPS, "hbm_gbs": HBM_GBS,
            "date": time.strftime("%Y-%m-%d")}

    def write():
        meta["targets"] = targets(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": all_rows}, f, indent=1, default=str)
        if args.table:
            with open(args.table, "w") as f:
                json.dump(make_table(all_rows, shape.num_experts, shape.topk, meta), f, indent=1)
                f.write("\n")

    avail = {"triton": "", "cutlass": "", "deep_gemm": "" if dg is not None else dg_avail.reason}
    meta["layer"] = []

    def run_layer(T) -> bool:
        if args.budget_s and time.monotonic() - T0 > args.budget_s:
            log(f"layer T={T}: skipped (time budget spent)")
            meta["layer"].append({"tokens": T, "error": "skipped: time budget spent"})
            return False
        try:
            table = make_table(all_rows, shape.num_experts, shape.topk, meta)
            rows, lmeta = layer_rows(T, shape, mw, args, dev, table, avail)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            meta["layer"].append({"tokens": T, "error": traceback.format_exc()[-2000:]})
            torch.cuda.synchronize()
            return False
        all_rows.extend(rows)
        meta["layer"].append(lmeta)
        write()
        return not any(r.get("bitwise_streamed_equals_batch") is False or not (r.get("check") or {}).get("ok")
                       for r in rows)

    for T in tokens:
        if args.budget_s and time.monotonic() - T0 > args.budget_s:
            log(f"T={T}: skipped (time budget of {args.budget_s:.0f} s spent)")
            all_rows.append({"tokens": T, "error": "skipped: time budget spent"})
            failed = True
            continue
        try:
            rows, s = run_size(T, shape, fw, args, plans_l1, plans_l2, dev, dg)
        except Exception:  # noqa: BLE001 - report, keep the other sizes
            traceback.print_exc()
            failed = True
            all_rows.append({"tokens": T, "error": traceback.format_exc()[-2000:]})
            torch.cuda.synchronize()
            continue
        all_rows.extend(rows)
        summary[T] = s
        failed |= any(r.get("median_ms") is None and r.get("ours") for r in rows)
        write()
        if T in layer_tokens:  # right after its GEMMs: their fastest variants are known, before a larger size
            failed |= not run_layer(T)
    for T in layer_tokens:
        if T not in tokens:
            failed |= not run_layer(T)
    print()
    for line in targets(summary):
        log(line)
    write()
    if args.json:
        log(f"wrote {args.json}")
    if args.table:
        log(f"wrote {args.table}")
    log("done")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
