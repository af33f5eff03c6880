#!/usr/bin/env python3
"""Layer benchmark on one GPU: the batch-ready path against the streamed path, same kernels.

DeepSeek-V3-shaped layer (hidden 7168, intermediate 2048, 256 experts, top-8, n_group 8,
topk_group 4, FP8 weights with 128x128 block scales), all experts on this GPU, one NVSHMEM PE.
Run through ``launch/gpu_layer.sh`` (one device call); by hand, from the repo root::

    python3 -m bench.layer_gpu --tokens 128,1024,8192,32768 --json out/layer.json

For every token count T, in one run, with CUDA events around every replay of a captured CUDA
graph and ``--sets`` different input sets (medians over sets x replays):

* ``producer``: router + top-k + FP8 layout of all T tokens;
* ``moe``: dispatch + expert GEMMs + combine on already produced inputs;
* ``batch``: producer, then MoE (the batch-ready path), for each ``--block-m`` candidate (the
  faster one is used for everything else at that T);
* ``streamed``: each (chunk count, progress policy): producers publish chunks through the
  NVSHMEM ring, the block-granular consumer runs blocks as they fill (``StreamedMoE``).
  Prints streamed/batch and the overlap efficiency (T_batch - T_stream) / min(T_prod, T_moe);
  checks every streamed output is bitwise equal to the batch output of the same input and
  that the ring reports no violation and no timeout.

Also: the L1 GEMM (our Triton FP8 block-scaled kernel, incl. SwiGLU + requant) against
``torch._scaled_grouped_mm`` (row-wise scales) on the same routed rows; the MoE alone against
the MoE beside an idle spinning consumer; a device timeline of the best streamed config
(``--timeline-json``, drawn by ``streamring timeline``); accuracy of the batch output against a
float64 per-token reference on sampled tokens.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from streamring.device import moe_triton as K
from streamring.moe import blocks as B
from streamring.moe.gpu_layer import StreamedMoE
from streamring.moe.math import MoEShape, select_experts
from streamring.moe.plan import PlanChoice

HBM_PEAK_GBS = 4800.0  # H200 nominal


def log(*a):
    print(*a, flush=True)


def dsv3_shape() -> MoEShape:
    return MoEShape(hidden=7168, intermediate=2048, num_experts=256, topk=8, router="deepseek_v3", n_group=8,
                    topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, weight_dtype="fp8")


class Timer:
    """Per-replay times (ms) with CUDA events, medians over input sets x replays.

    :meth:`compare` interleaves the callables replay by replay (A B A B ...), so clock and
    power drift of the GPU hits every path alike; ratios come from such interleaved runs.
    """

    def __init__(self, replays: int):
        self.replays = replays

    def __call__(self, fn, sets, load) -> dict:
        return self.compare({"x": fn}, sets, load)["x"]

    def compare(self, fns: dict, sets, load) -> dict:
        times = {k: [] for k in fns}
        for s in sets:
            load(s)
            for fn in fns.values():
                fn()  # warm
            torch.cuda.synchronize()
            ev = []
            for _ in range(self.replays):
                for k, fn in fns.items():
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    ev.append((k, a, b))
            torch.cuda.synchronize()
            for k, a, b in ev:
                times[k].append(a.elapsed_time(b))
        return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "n": len(v)}
                for k, v in times.items()}


def capture(fn):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # eager warm-up (compiles every kernel before any wait is captured)
    torch.cuda.synchronize()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize()
    return g


def reference_rows(x, fw: B.FastWeights, shape: MoEShape, tokens) -> torch.Tensor:
    """float64 reference of the layer for a few tokens (router from the same bf16 weights;
    weights dequantized per used expert; intermediate kept in float64, no requantization)."""
    from streamring.moe.math import dequantize_act_fp8, quantize_act_fp8

    xs = x[tokens]
    logits = (xs.double() @ fw.router.double().t()).float()
    idx, w = select_experts(logits, fw.bias, shape)
    q, sf = quantize_act_fp8(xs.float())
    xd = dequantize_act_fp8(q, sf).double()
    I = shape.intermediate
    out = torch.zeros(len(tokens), shape.hidden, dtype=torch.float64, device=x.device)
    for r in range(len(tokens)):
        for j in range(shape.topk):
            e = int(idx[r, j])
            w1 = (fw.w1[e].double().view(2 * I // 128, 128, -1, 128) * fw.w1_sf[e].double()[:, None, :, None]).view(2 * I, -1)
            w2 = (fw.w2[e].double().view(-1, 128, I // 128, 128) * fw.w2_sf[e].double()[:, None, :, None]).view(-1, I)
            gu = w1 @ xd[r]
            h = torch.nn.functional.silu(gu[:I]) * gu[I:]
            out[r] += (w2 @ h) * float(w[r, j])
    return out


def l1_vs_library(fw, shape, x, block_m, timer) -> dict:
    """Our L1 kernel (FP8 block scales, fused SwiGLU + requant) vs torch._scaled_grouped_mm on the same rows."""
    T = x.shape[0]
    dev = x.device
    prod = B.Producer(shape, fw, T, dev)
    sc = B.scratch_buffers(shape, T, dev)
    prod.route(x, sc["idx"], sc["w"])
    prod.layout(x, sc["q"], sc["sf"])
    bc = B.BlockConsumer(shape, T, 1, block_m, dev)
    B.moe_forward(sc["idx"], sc["w"], sc["q"], sc["sf"], fw, bc, torch.empty_like(x))
    torch.cuda.synchronize()
    nready = int(bc.ready_hi[2])
    pass
    h1 = bc.h1.view(B.FP8)

    def ours():
        K.expert_l1(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.a.view(B.FP8), bc.a_sf, fw.w1,
                    fw.w1_sf, h1, bc.h1_sf, block_m=block_m)
    t_ours = timer(ours, [0], lambda s: None)
    # library: rows sorted by expert (no padding), row-wise activation scale, column-wise weight scale
    flat = sc["idx"].reshape(-1)
    order = torch.sort(flat, stable=True).indices
    tok = order // shape.topk
    counts = torch.bincount(flat, minlength=shape.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xd = (sc["q"].float().view(T, -1, 128) * sc["sf"][:, :, None]).view(T, -1)
    amax = xd.abs().amax(dim=1).clamp_min(1e-12)
    a_scale = (amax / 448.0).float()
    a_q = (xd / a_scale[:, None]).clamp(-448, 448).to(B.FP8)[tok].contiguous()
    a_scale = a_scale[tok].contiguous()
    # weights: per-output-column scale (max of the column's block scales: a re-quantization of w1)
    w_scale = fw.w1_sf.amax(dim=2).repeat_interleave(128, dim=1).contiguous()  # [E, 2I]
    res = {"rows": int(flat.numel()), "blocks": nready, "ours": t_ours}
    useful_flops = 2.0 * flat.numel() * fw.w1.shape[1] * fw.w1.shape[2]
    experts_used = int((counts > 0).sum())
    wbytes = experts_used * fw.w1.shape[1] * fw.w1.shape[2]
    res["ours"]["tflops"] = useful_flops / (t_ours["median_ms"] * 1e-3) / 1e12
    res["ours"]["weight_gbs"] = wbytes / (t_ours["median_ms"] * 1e-3) / 1e9
    res["ours"]["hbm_frac"] = res["ours"]["weight_gbs"] / HBM_PEAK_GBS
    try:
        w_t = fw.w1.transpose(1, 2)

        def lib():
            torch._scaled_grouped_mm(a_q, w_t, a_scale, w_scale, offs=offs, out_dtype=torch.bfloat16)
        t_lib = timer(lib, [0], lambda s: None)
        t_lib["tflops"] = useful_flops / (t_lib["median_ms"] * 1e-3) / 1e12
        t_lib["weight_gbs"] = wbytes / (t_lib["median_ms"] * 1e-3) / 1e9
        t_lib["hbm_frac"] = t_lib["weight_gbs"] / HBM_PEAK_GBS
        res["torch_scaled_grouped_mm"] = t_lib
        res["ours_over_lib_throughput"] = t_lib["median_ms"] / t_ours["median_ms"]
    except Exception as exc:  # noqa: BLE001
        res["torch_scaled_grouped_mm"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return res


def idle_consumer_cost(moe_graph, replays: int) -> dict:
    """The MoE alone vs the MoE while a one-program consumer spins on a flag on another stream,
    interleaved replay by replay (the spinner is released right after each 'beside' replay)."""
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    seen = torch.zeros(1, dtype=torch.int32, device="cuda")
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    K.spin_on_flag(flag, 1, seen)  # compile
    torch.cuda.synchronize()
    alone, beside, released = [], [], 0
    for i in range(2 * replays):
        spin = i % 2 == 1
        if spin:
            flag.zero_()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                K.spin_on_flag(flag, int(5e9), seen)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        moe_graph.replay()
        b.record()
        if spin:
            flag.fill_(1)
            main.wait_stream(side)
        torch.cuda.synchronize()
        (beside if spin else alone).append(a.elapsed_time(b))
        released += int(spin and int(seen.item()) == 1)
    ma, mb = statistics.median(alone), statistics.median(beside)
    return {"moe_alone": {"median_ms": ma, "n": len(alone)}, "moe_beside_spinning_consumer": {"median_ms": mb, "n": len(beside)},
            "ratio": mb / ma, "spinner_saw_flag": released, "spinner_runs": len(beside)}


def bench_tokens(T, shape, fw, args, timer, out, save):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(1000 + T)
    sets = [torch.randn(T, shape.hidden, generator=gen, device=dev).to(torch.bfloat16) for _ in range(args.sets)]
    x = torch.empty_like(sets[0])
    y_batch = torch.empty_like(x)
    load = lambda s: x.copy_(sets[s])  # noqa: E731
    row = {"tokens": T, "sets": args.sets, "replays": args.replays}
    out["rows"].append(row)
    # --- batch path, producer alone, MoE alone, per block_m candidate ------------------------
    best = None
    row["batch_by_block_m"] = {}
    cands = ([16, 64] if T <= 2048 else [64]) if args.block_m == "auto" else [int(v) for v in args.block_m.split(",")]
    for bm in cands:
        prod = B.Producer(shape, fw, T, dev)
        sc = B.scratch_buffers(shape, T, dev)
        bc = B.BlockConsumer(shape, T, 1, bm, dev)
        g_batch = capture(lambda: B.batch_forward(x, fw, shape, prod, bc, sc, y_batch))
        tb = timer(g_batch.replay, range(args.sets), load)
        row["batch_by_block_m"][bm] = tb
        log(f"  T={T} block_m={bm}: batch {tb['median_ms']:.3f} ms")
        if best is None or tb["median_ms"] < best[1]["median_ms"]:
            best = (bm, tb, prod, sc, bc, g_batch)
    bm, tb, prod, sc, bc, g_batch = best
    row["block_m"] = bm
    try:
        kl1 = K.expert_l1(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.a.view(B.FP8), bc.a_sf,
                          fw.w1, fw.w1_sf, bc.h1.view(B.FP8), bc.h1_sf, block_m=bm)
        kl2 = K.expert_l2(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.h1.view(B.FP8),
                          bc.h1_sf, fw.w2, fw.w2_sf, bc.row_weight, bc.y, block_m=bm)
        row["kernels"] = {name: {"n_regs": k.n_regs, "n_spills": k.n_spills, "shared": k.metadata.shared,
                                 "num_warps": k.metadata.num_warps} for name, k in (("l1", kl1), ("l2", kl2))}
        log(f"  T={T}: kernels {row['kernels']}")
    except Exception as exc:  # noqa: BLE001 - informational only
        row["kernels"] = {"error": str(exc)}
    row["batch"] = tb
    g_prod = capture(lambda: (prod.route(x, sc["idx"], sc["w"]), prod.layout(x, sc["q"], sc["sf"])))
    row["producer"] = timer(g_prod.replay, range(args.sets), load)
    y_moe = torch.empty_like(x)
    g_moe = capture(lambda: B.moe_forward(sc["idx"], sc["w"], sc["q"], sc["sf"], fw, bc, y_moe))

    def load_moe(s):
        load(s)
        g_prod.replay()
    row["moe"] = timer(g_moe.replay, range(args.sets), load_moe)
    tp, tm = row["producer"]["median_ms"], row["moe"]["median_ms"]
    log(f"  T={T}: producer {tp:.3f} ms, moe {tm:.3f} ms, batch {tb['median_ms']:.3f} ms (block_m {bm})")
    # reference outputs per set (batch path) + accuracy on sampled tokens
    refs = []
    for s in range(args.sets):
        load(s)
        g_batch.replay()
        torch.cuda.synchronize()
        refs.append(y_batch.clone())
    samp = torch.linspace(0, T - 1, steps=min(T, args.ref_tokens)).long().tolist()
    ref = reference_rows(sets[0], fw, shape, samp)
    got = refs[0][samp].double()
    row["accuracy_vs_f64"] = {"tokens_checked": len(samp),
                              "rel_fro": float((got - ref).norm() / ref.norm()),
                              "max_abs": float((got - ref).abs().max()), "ref_max_abs": float(ref.abs().max())}
    log(f"  T={T}: batch vs float64 reference on {len(samp)} tokens: rel {row['accuracy_vs_f64']['rel_fro']:.4f}")
    save()
    # --- MoE beside an idle spinning consumer ------------------------------------------------
    if T in args.idle_check_tokens:
        row["idle_consumer"] = idle_consumer_cost(g_moe, max(args.replays, 10))
        log(f"  T={T}: moe beside a spinning consumer / alone = {row['idle_consumer']['ratio']:.3f}")
    # --- FP8 L1 against the library ----------------------------------------------------------
    if not args.skip_l1:
        try:
            row["l1_gemm"] = l1_vs_library(fw, shape, sets[0], bm, timer)
            r = row["l1_gemm"]
            lib = r.get("torch_scaled_grouped_mm", {})
            log(f"  T={T}: L1 ours {r['ours']['median_ms']:.3f} ms ({r['ours']['tflops']:.0f} TFLOP/s, "
                f"{r['ours']['hbm_frac'] * 100:.0f}% HBM) vs torch._scaled_grouped_mm "
                f"{lib.get('median_ms', float('nan')):.3f} ms -> ours/lib throughput {r.get('ours_over_lib_throughput', float('nan')):.2f}")
        except Exception as exc:  # noqa: BLE001
            row["l1_gemm"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  T={T}: L1 comparison failed: {exc}")
    save()
    del g_moe
    # --- streamed ------------------------------------------------------------------------------
    row["streamed"] = []
    configs = []  # (chunks, policy, producer_sms, high_priority, chunk_gemm_ctas)
    for C in args.chunks:
        if C < 2 or T // C < 16:
            continue
        extra = C in args.extra_at_chunks
        for policy in args.policies:
            if policy in ("pdl", "green_ctx") and not extra:
                continue
            if policy == "green_ctx":
                for psms in args.green_sms:
                    configs.append((C, policy, psms, True, None))
            elif policy in ("stream_wait", "spin_kernel"):
                prio = policy in args.prio_policies
                for ctas in ([None] + args.chunk_gemm_ctas if prio else [None]):
                    configs.append((C, policy, args.producer_sms, prio, ctas))
                if extra and prio:
                    configs.append((C, policy, args.producer_sms, False, None))
            else:
                configs.append((C, policy, args.producer_sms, True, None))
    # only plans PlanChoice accepts (stream_wait refuses high-priority streams: no deadline there)
    accepted = []
    for C, policy, psms, prio, ctas in configs:
        try:
            PlanChoice(chunk_tokens=max(1, math.ceil(T / C)), num_slots=min(args.slots, C), block_m=bm, policy=policy,
                       high_priority=prio, chunk_gemm_ctas=ctas).validate()
            accepted.append((C, policy, psms, prio, ctas))
        except ValueError as exc:
            log(f"  T={T}: skipped {policy} chunks={C} high_priority={prio}: {exc}")
    for C, policy, psms, prio, ctas in accepted:
            faulthandler.dump_traceback_later(args.config_watchdog_s)  # a hang prints where it is
            chunk = math.ceil(T / C)
            rec = {"chunks": C, "chunk_tokens": chunk, "policy": policy, "num_slots": min(args.slots, C)}
            if policy == "green_ctx":
                rec["producer_sms"] = psms
            if policy in ("stream_wait", "spin_kernel"):
                rec["high_priority"] = prio
                rec["chunk_gemm_ctas"] = ctas
            row["streamed"].append(rec)
            sm = None
            try:
                plan = PlanChoice(chunk_tokens=chunk, num_slots=rec["num_slots"], block_m=bm, policy=policy,
                                  high_priority=prio, chunk_gemm_ctas=ctas)
                sm = StreamedMoE(HEAP, shape, fw, T, plan, producer_sms=psms, deadline_s=args.deadline_s)
                y = torch.empty_like(x)
                load(0)
                sm.warm_up(x, y)
                g = sm.capture(x, y, node_priority=not args.no_node_priority)
                rec["node_priority"] = getattr(sm, "node_priority_report", None)
                both = timer.compare({"batch": g_batch.replay, "stream": g.replay}, range(args.sets), load)
                t, tb_here = both["stream"], both["batch"]
                # bitwise check against the batch output of every set
                same = []
                for s in range(args.sets):
                    load(s)
                    g.replay()
                    torch.cuda.synchronize()
                    same.append(bool(torch.equal(y, refs[s])))
                st = sm.status()
                rec.update(t)
                rec["batch_interleaved_ms"] = tb_here["median_ms"]
                rec["bitwise_equal_batch"] = all(same)
                rec["ring"] = {k: st.get(k) for k in ("violations", "timeouts", "published", "consumed", "aborted")}
                rec["ok"] = rec["bitwise_equal_batch"] and not st.get("violations") and not st.get("timeouts")
                rec["streamed_over_batch"] = t["median_ms"] / tb_here["median_ms"]
                rec["overlap_eff"] = (tb_here["median_ms"] - t["median_ms"]) / min(tp, tm)
                tag = f"{policy}" + (f"/{psms}SM" if policy == "green_ctx" else "") + ("" if prio else "/no-prio") \
                    + (f"/{ctas}cta" if ctas else "")
                log(f"  T={T} C={C} {tag:<16}: {t['median_ms']:.3f} ms (batch {tb_here['median_ms']:.3f}) "
                    f"stream/batch {rec['streamed_over_batch']:.3f}"
                    f"  overlap {rec['overlap_eff']:+.2f}  bitwise={rec['bitwise_equal_batch']} ring={rec['ring']}")
                del g
            except Exception as exc:  # noqa: BLE001 - one config's failure must not hide the others
                rec["ok"] = False
                rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
                rec["trace"] = traceback.format_exc()[-1500:]
                log(f"  T={T} C={C} {policy}: FAILED {rec['error']}\n{rec['trace']}")
                torch.cuda.synchronize()
            finally:
                faulthandler.cancel_dump_traceback_later()
                if sm is not None:
                    sm.close()
            save()
    ok = [r for r in row["streamed"] if r.get("ok")]
    if ok:
        b = min(ok, key=lambda r: r["median_ms"])
        row["best_streamed"] = {k: b.get(k) for k in ("chunks", "chunk_tokens", "policy", "num_slots", "median_ms",
                                                      "batch_interleaved_ms", "streamed_over_batch", "overlap_eff",
                                                      "producer_sms", "high_priority", "chunk_gemm_ctas")}
        # adaptive: stream only where it wins; otherwise one chunk (the batch path)
        wins = b["streamed_over_batch"] < 1.0
        row["adaptive"] = dict(row["best_streamed"]) if wins else {"chunks": 1, "policy": "batch",
                                                                     "median_ms": tb["median_ms"],
                                                                     "streamed_over_batch": 1.0}
        row["adaptive"]["block_m"] = bm
        # device timeline of the best config
        if args.timeline_json:
            sm = None
            try:
                plan = PlanChoice(chunk_tokens=b["chunk_tokens"], num_slots=b["num_slots"], block_m=bm,
                                  policy=b["policy"], high_priority=b.get("high_priority"),
                                  chunk_gemm_ctas=b.get("chunk_gemm_ctas"))
                sm = StreamedMoE(HEAP, shape, fw, T, plan, timeline=True,
                                 producer_sms=b.get("producer_sms") or args.producer_sms)
                y = torch.empty_like(x)
                load(0)
                sm.warm_up(x, y)
                g = sm.capture(x, y, node_priority=not args.no_node_priority)  # stamps of a replay, as timed
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
                del g
                tl = sm.timeline()
                # the batch path's own timeline for comparison: producer then MoE, from the medians
                tl["batch_ms"] = {"producer": tp, "moe": tm, "total": tb["median_ms"]}
                tl["streamed_ms"] = b["median_ms"]
                out.setdefault("timelines", []).append(tl)
            except Exception as exc:  # noqa: BLE001
                out.setdefault("timelines", []).append({"tokens": T, "error": f"{type(exc).__name__}: {exc}"})
            finally:
                if sm is not None:
                    sm.close()
    save()


HEAP = None


def main(argv=None) -> int:
    global HEAP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    ap.add_argument("--tokens", type=ints, default=[128, 1024, 8192, 32768])
    ap.add_argument("--chunks", type=ints, default=[2, 4, 8])
    ap.add_argument("--policies", type=lambda s: s.split(","),
                    default=["spin_kernel", "serialized", "pdl", "green_ctx", "stream_wait"])
    ap.add_argument("--block-m", default="auto",
                    help="comma list of block_m candidates, or 'auto' (16 and 64 up to 2048 tokens, else 64)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--ref-tokens", type=int, default=8)
    ap.add_argument("--idle-check-tokens", type=ints, default=[1024, 8192])
    ap.add_argument("--producer-sms", type=int, default=16)
    ap.add_argument("--green-sms", type=ints, default=[8, 16, 32], help="producer SMs swept for green_ctx")
    ap.add_argument("--prio-policies", type=lambda s: s.split(","), default=["spin_kernel"],
                    help="policies whose producer/dispatch streams run at high priority")
    ap.add_argument("--extra-at-chunks", type=ints, default=[4],
                    help="chunk counts that also run pdl, green_ctx (each --green-sms) and the normal-priority variant")
    ap.add_argument("--chunk-gemm-ctas", type=ints, default=[],
                    help="persistent grid sizes swept for the per-chunk GEMMs (high-priority policies)")
    ap.add_argument("--no-node-priority", action="store_true",
                    help="do not set high launch priority on the producer/dispatch kernel nodes of captured graphs")
    ap.add_argument("--config-watchdog-s", type=float, default=90.0,
                    help="print every thread's Python stack if one config runs longer than this")
    ap.add_argument("--deadline-s", type=float, default=10.0)
    ap.add_argument("--skip-l1", action="store_true")
    ap.add_argument("--timeline-json", action="store_true", help="record a device timeline of the best config")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip token counts once this much time has passed")
    ap.add_argument("--json", default="layer.json")
    args = ap.parse_args(argv)
    t_start = time.time()

    from streamring.device.nvshmem import NvshmemHeap

    HEAP = NvshmemHeap.bootstrap("local")
    shape = dsv3_shape()
    log(f"[layer] device {torch.cuda.get_device_name()}; generating FP8 weights "
        f"({shape.num_experts} experts, H={shape.hidden}, I={shape.intermediate})")
    t0 = time.time()
    fw = B.FastWeights.random(shape, 7, "cuda")
    K.stamp(torch.zeros(8, dtype=torch.int64, device="cuda"), 1)  # compile before any ring wait
    torch.cuda.synchronize()
    log(f"[layer] weights ready in {time.time() - t0:.1f} s")
    out = {"shape": shape.__dict__ if hasattr(shape, "__dict__") else str(shape), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "args": vars(args), "rows": []}
    path = Path(args.json)

    def save():
        path.write_text(json.dumps(out, indent=1, default=str))

    timer = Timer(args.replays)
    for T in args.tokens:
        if time.time() - t_start > args.budget_s:
            log(f"[layer] budget spent: T={T} skipped")
            out["rows"].append({"tokens": T, "skipped": "time budget"})
            continue
        log(f"[layer] T={T}")
        try:
            bench_tokens(T, shape, fw, args, timer, out, save)
        except Exception as exc:  # noqa: BLE001
            out["rows"].append({"tokens": T, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
            log(f"[layer] T={T} FAILED: {exc}\n{traceback.format_exc()}")
        save()
    log(table(out))
    save()
    HEAP.close()
    return 0


def table(out) -> str:
    lines = ["", f"{'tokens':>6} {'bm':>3} {'producer':>9} {'moe':>8} {'batch':>8} {'best streamed':>14} "
             f"{'config':<22} {'str/batch':>9} {'overlap':>7} {'L1 ours/lib':>11}"]
    for r in out["rows"]:
        if "batch" not in r:
            lines.append(f"{r['tokens']:>6} {r.get('error', r.get('skipped', ''))[:80]}")
            continue
        b = r.get("best_streamed") or {}
        l1 = r.get("l1_gemm", {})
        cfg = f"C={b.get('chunks')} {b.get('policy')}" if b else "-"
        lines.append(f"{r['tokens']:>6} {r['block_m']:>3} {r['producer']['median_ms']:>8.3f}m {r['moe']['median_ms']:>7.3f}m "
                     f"{r['batch']['median_ms']:>7.3f}m {b.get('median_ms', float('nan')):>13.3f}m {cfg:<22} "
                     f"{b.get('streamed_over_batch', float('nan')):>9.3f} {b.get('overlap_eff', float('nan')):>+7.2f} "
                     f"{l1.get('ours_over_lib_throughput', float('nan')):>11.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
