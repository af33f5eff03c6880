#!/usr/bin/env python3
"""The expert-parallel GPU layer against its own batch path and a torch + NCCL baseline, in one run.

Run one process per GPU, from the repo root (``launch/gpu_ep_bench.sh`` runs it on the device)::

    mpiexec -n 2 python3 -m bench.ep_layer --tokens 1024,4096,8192 --json out/ep-layer.json

DeepSeek-V3 shape (hidden 7168, intermediate 2048, 256 experts, top-8, grouped routing 8/4, FP8
weights with 128x128 scales), experts split over the PEs. For every tokens-per-rank T, every
``--routings`` (``uniform``: each token's k experts drawn uniformly at random, as peer benchmarks
do; ``router``: the model's router on random weights, which loads the PEs unevenly) and every
``--gemms`` implementation, in the same processes and on the same inputs:

* ``batch`` (``chunks`` = 1): :class:`~streamring.moe.ep_buffer.EPBuffer`'s batch path, captured as a
  CUDA graph; the reference every streamed output of the same GEMMs and routing is compared with,
  bitwise;
* ``streamed``: the same layer streamed for each ``--chunks`` (> 1) x ``--policies`` x ``--ctas`` x
  ``--orders`` plan, captured;
* ``gemm_only``: each PE's expert GEMMs (L1 + SwiGLU + L2) over the rows the batch forward gave it,
  timed alone (its own captured graph), so the layer's overhead over its GEMMs is visible;
* ``torch_nccl``: what a user could write today from torch: NCCL ``all_to_all_single`` dispatch of
  FP8 rows (one per token and destination rank, rowwise scales), ``torch._scaled_grouped_mm``
  L1 -> SwiGLU -> FP8 -> L2, weighted reduce, ``all_to_all_single`` combine (eager: the split sizes
  need a host sync), with the same routing;
* each of batch, streamed and torch_nccl again with a ``--straggler-ms`` device-side delay of one
  PE's producer, for each PE of ``--straggler-ranks`` separately;
* the publish -> acquire latency across PEs: a ring ping-pong (``ring_pingpong``: the layer's own
  publish and acquire) against the flag ping-pong floor (``flag_pingpong``), both round trip / 2.

Times: every replay starts after a host barrier; the forward's time is the slowest PE's event time;
medians over ``--replays``. ``--json`` writes one row per measurement with ``ranks``,
``tokens_per_rank``, ``path``, ``gemm``, ``routing``, ``chunks``, ``straggler_ms``, ``straggler_rank``,
``median_ms``, ``bitwise_equal_to_batch``, ``rows_per_rank`` (routed rows each PE computed),
``gemm_only_ms`` (per PE) and ``pub_acq_us`` (``p50``, ``p99``, ``floor``); ``--timeline-json`` the
device timelines of the best streamed plan per size (draw with ``streamring timeline``); a table with
the ratios is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from streamring.device import kernels as DK
from streamring.moe import blocks as B
from streamring.moe.ep_buffer import EPBuffer
from streamring.moe.math import MoEShape, select_experts

FP8 = torch.float8_e4m3fn


def log(*a):
    print(*a, flush=True)


def dsv3_shape(block_m: int) -> MoEShape:
    return MoEShape(hidden=7168, intermediate=2048, num_experts=256, topk=8, router="deepseek_v3", n_group=8,
                    topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, weight_dtype="fp8", block_m=block_m)


def megamoe_shape(block_m: int) -> MoEShape:
    # DeepGEMM's SM90 Mega MoE benchmark shape (hidden 4096, 256 experts, top-6); intermediate 2048
    return MoEShape(hidden=4096, intermediate=2048, num_experts=256, topk=6, router="deepseek_v3", n_group=8,
                    topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, weight_dtype="fp8", block_m=block_m)


def uniform_routing(T: int, shape: MoEShape, seed: int, dev) -> tuple:
    """Each token's ``topk`` distinct experts drawn uniformly at random; weights random in (0.05, 1.05)
    times the scaling factor (the weights only scale rows: they do not change the work)."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    idx = torch.rand(T, shape.num_experts, generator=g, device=dev).topk(shape.topk, dim=1).indices
    w = (torch.rand(T, shape.topk, generator=g, device=dev) + 0.05) * shape.routed_scaling_factor
    return idx.to(torch.int64).contiguous(), w.float().contiguous()


# ----------------------------------------------------------------------------------------------
# timing across PEs
# ----------------------------------------------------------------------------------------------
def timed(heap, fn, replays: int, warm: int = 2) -> list[float]:
    """Per replay: host barrier, events around ``fn()``, sync; the slowest PE's ms per replay."""
    dev = heap.device
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(warm + replays):
        torch.cuda.synchronize(dev)
        heap.barrier()
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize(dev)
        ms = e0.elapsed_time(e1)
        all_ms = heap.allgather_obj(ms)
        if i >= warm:
            out.append(max(all_ms))
    return out


def stats(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "n": len(ms)}


# ----------------------------------------------------------------------------------------------
# the torch + NCCL baseline
# ----------------------------------------------------------------------------------------------
def rowwise_fp8(w_fp8, w_sf):
    """Blockwise (128x128) FP8 weights -> rowwise-scaled FP8 (per output row), one expert at a time."""
    E, N, Kd = w_fp8.shape
    q = torch.empty_like(w_fp8)
    s = torch.empty(E, N, dtype=torch.float32, device=w_fp8.device)
    for e in range(E):
        wd = (w_fp8[e].float().view(N // 128, 128, Kd // 128, 128) * w_sf[e][:, None, :, None]).view(N, Kd)
        amax = wd.abs().amax(dim=1).clamp_min(1e-12)
        s[e] = amax / 448.0
        q[e] = (wd / s[e][:, None]).clamp(-448, 448).to(FP8)
    return q, s


def quant_rowwise(x):
    amax = x.float().abs().amax(dim=1).clamp_min(1e-12)
    s = amax / 448.0
    return (x.float() / s[:, None]).clamp(-448, 448).to(FP8), s


class TorchNcclBaseline:
    """The expert-parallel layer as a user writes it with torch + NCCL (see the module doc)."""

    def __init__(self, shape: MoEShape, fw_local: B.FastWeights, rank: int, world: int, group):
        self.shape, self.rank, self.R, self.group = shape, rank, world, group
        self.E_loc = shape.num_experts // world
        self.router = fw_local.router
        self.bias = fw_local.bias
        self.w1, self.s1 = rowwise_fp8(fw_local.w1, fw_local.w1_sf)
        self.w2, self.s2 = rowwise_fp8(fw_local.w2, fw_local.w2_sf)
        self.sleep_cycles = 0

    def _a2a(self, t, send_splits, recv_splits):
        import torch.distributed as dist

        out = torch.empty((sum(recv_splits),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def forward(self, x, routing=None):
        import torch.distributed as dist

        sh, R, E_loc = self.shape, self.R, self.E_loc
        H, I = sh.hidden, sh.intermediate
        if self.sleep_cycles:
            torch.cuda._sleep(self.sleep_cycles)
        T = x.shape[0]
        if routing is None:
            logits = torch.nn.functional.linear(x, self.router).float()
            idx, w = select_experts(logits, self.bias, sh)
        else:
            idx, w = routing
        xq, xs = quant_rowwise(x)
        dest = idx // E_loc                                            # [T, K]
        to = torch.zeros(T, R, dtype=torch.bool, device=x.device)
        to.scatter_(1, dest, True)                                     # token t goes to rank r
        pairs = to.t().nonzero()                                       # (rank, token), rank-major
        dst_rank, tok = pairs[:, 0], pairs[:, 1]
        send_counts = torch.bincount(dst_rank, minlength=R)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        ss, rs = send_counts.tolist(), recv_counts.tolist()          # host sync: the split sizes
        loc_idx = torch.where(dest[tok] == dst_rank[:, None], idx[tok] - dst_rank[:, None] * E_loc, -1)
        # (float8 tensors have no index kernels: move their bytes)
        r_x = self._a2a(xq.view(torch.uint8)[tok], ss, rs)
        r_s = self._a2a(xs[tok], ss, rs)
        r_idx = self._a2a(loc_idx, ss, rs)
        r_w = self._a2a(w[tok], ss, rs)
        # local experts: one row per (received row, k) routed here, grouped by expert (16-row padded groups)
        rows, ks = (r_idx >= 0).nonzero(as_tuple=True)
        e = r_idx[rows, ks]
        order = torch.argsort(e, stable=True)
        rows, ks, e = rows[order], ks[order], e[order]
        cnt = torch.bincount(e, minlength=E_loc)
        pad = (cnt + 15) // 16 * 16
        start = torch.cumsum(pad, 0) - pad
        pos = start[e] + (torch.arange(e.numel(), device=x.device) - (torch.cumsum(cnt, 0) - cnt)[e])
        M = int(pad.sum().item()) if e.numel() else 0
        y_rows = torch.zeros(r_x.shape[0], H, dtype=torch.float32, device=x.device)
        if M:
            a_u8 = torch.zeros(M, H, dtype=torch.uint8, device=x.device)
            a_s = torch.ones(M, dtype=torch.float32, device=x.device)
            a_u8[pos] = r_x[rows]
            a_s[pos] = r_s[rows]
            a = a_u8.view(FP8)
            offs = torch.cumsum(pad, 0).to(torch.int32)
            h = torch._scaled_grouped_mm(a, self.w1.transpose(1, 2), a_s, self.s1, offs=offs, out_dtype=torch.bfloat16)
            h = torch.nn.functional.silu(h[:, :I].float()) * h[:, I:].float()
            hq, hs = quant_rowwise(h)
            y = torch._scaled_grouped_mm(hq, self.w2.transpose(1, 2), hs, self.s2, offs=offs,
                                         out_dtype=torch.bfloat16)
            y_rows.index_add_(0, rows, y[pos].float() * r_w[rows, ks][:, None])
        back = self._a2a(y_rows.to(torch.bfloat16), rs, ss)
        out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, back.float())
        return out.to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# publish -> acquire across PEs
# ----------------------------------------------------------------------------------------------
def pub_acq_latency(heap, launches: int = 20, nchunks: int = 64, flag_iters: int = 20000) -> dict:
    """Round trip / 2 of the ring's publish->acquire (``ring_pingpong``) and of a bare flag (the floor).

    ``p50``/``p99``: the producer publishes route and layout as two publications (two releases), as
    the layer's producer does; ``p50_one_release``/``p99_one_release``: both under one release
    (``publish_both``); ``floor``: one flag, ``st.release.sys`` / ``ld.acquire.sys``."""
    from streamring.device_ring import DeviceRing
    from streamring.protocol import RingLayout

    R, me = heap.num_ranks, heap.rank
    if R < 2:
        return {"p50": None, "p99": None, "floor": None, "note": "one PE: no cross-PE handoff"}
    lay = RingLayout(num_ranks=R, num_slots=nchunks, tokens_per_slot=1, hidden=128, topk=1, num_experts=R)
    ring = DeviceRing(heap, lay, nchunks, transport="auto", deadline_s=5.0, name="pingpong")
    dev = heap.device
    out = torch.zeros(nchunks, dtype=torch.int64, device=dev)
    samples = {0: [], 1: []}
    role = me in (0, 1)
    peer = 1 - me if role else me
    epoch = 0
    for together in (0, 1):
        for i in range(launches):
            epoch += 1
            ring.set_epoch(epoch)
            heap.barrier()
            if role:
                DK.ring_pingpong(heap.lib, heap.sref, d=ring.desc, buf=ring.buf, peers=ring.peers, me=me, peer=peer,
                                 initiator=int(me == 0), together=together, nchunks=nchunks,
                                 out_ns=int(out.data_ptr()))
            heap.sync()
            if me == 0:
                samples[together] += (out.cpu().numpy() / 2 / 1e3).tolist()
    st = ring.status()
    # the floor: one flag word per PE in a symmetric region, written through the peer pointer
    reg = heap.alloc("flag", 256)
    peers = heap.peer_table(reg)
    res = torch.zeros(1, dtype=torch.int64, device=dev)
    heap.barrier()
    floor = None
    if role and int(peers[peer].item()):
        DK.flag_pingpong(heap.lib, heap.sref, my_flag=reg.handle.ptr, peer_flag=int(peers[peer].item()),
                         initiator=int(me == 0), iters=flag_iters, base=0, deadline_cycles=int(20e9),
                         out_ns=int(res.data_ptr()))
    heap.sync()
    if me == 0 and int(res.item()):
        floor = int(res.item()) / flag_iters / 2 / 1e3
    heap.barrier()
    heap.free(reg)
    ring.close()
    info = heap.allgather_obj({"samples": samples, "floor": floor, "errors": st["violations"] + st["timeouts"]})[0]

    def pct(v, q):
        return float(np.percentile(v, q)) if v else None

    s2, s1 = info["samples"][0], info["samples"][1]
    return {"p50": pct(s2, 50), "p99": pct(s2, 99), "p50_one_release": pct(s1, 50), "p99_one_release": pct(s1, 99),
            "floor": info["floor"], "n": len(s2), "ring_errors": info["errors"], "transport": ring.transport}


# ----------------------------------------------------------------------------------------------
class Budget:
    """Stops starting new measurements once ``seconds`` have passed (the device call has a limit)."""

    def __init__(self, seconds: float):
        self.t0, self.seconds = time.monotonic(), seconds

    def spent(self) -> bool:
        return time.monotonic() - self.t0 > self.seconds


def rows_routed_here(buf: EPBuffer) -> int:
    """Routed rows this PE's expert blocks received in the last forward (the fill of every expert)."""
    return int(buf.bc.state[: buf.E_loc].sum().item())


def gemm_only_graph(buf: EPBuffer, layer):
    """A captured graph of this PE's expert GEMMs over the blocks of the last (batch) forward, alone:
    L1 + SwiGLU + L2 of every ready block in ONE call (no dispatch, signal or reduce): as the default
    buffer's batch path runs them (its last step's blocks go with the seal's); with
    ``--separate-seal-gemms`` the layer makes two calls and this stays the one-call reference."""
    bc = buf.bc
    n = buf.paths["batch"].num_chunks * buf.paths["batch"].steps + 1  # dispatch steps + the seal

    def run():
        if buf.direct_l2:
            bc.compute(0, n, bc.max_blocks, layer.fw, out=buf.comb_rows, direct=(bc.row_src, bc.row_tok,
                                                                                 buf.comb_delta))
        else:  # the buffer's own GEMMs (CUTLASS, DeepGEMM: one call over every block, its psum layout)
            B.compute_blocks(bc, 0, n, bc.max_blocks, layer.fw, buf.gemm)

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g


def measure(heap, buf, layer, x, routing, streaming, args, straggler_ranks):
    """Eager first forward, capture, timed replays; then the same graph with each straggler.
    Returns ``(out, stats, {straggler_rank: stats})``."""
    y = torch.zeros_like(x)
    buf.forward(x, layer, streaming=streaming, out=y, routing=routing)
    heap.barrier()
    g = buf.capture(x, layer, y, streaming=streaming, routing=routing, stamps=False)
    heap.barrier()
    st = stats(timed(heap, g.replay, args.replays))
    out = y.clone()
    strag = {}
    for sr in straggler_ranks:
        buf.set_straggler(int(args.straggler_ms * 1e6) if heap.rank == sr else 0)
        strag[sr] = stats(timed(heap, g.replay, args.replays))
        buf.set_straggler(0)
    del g
    return out, st, strag


def bench_tokens(heap, T, shape, full, base, args, rows, timelines, budget):
    R, me, dev = heap.num_ranks, heap.rank, heap.device
    g = torch.Generator(device=dev)
    g.manual_seed(1000 + 7 * me + T)
    x = torch.randn(T, shape.hidden, generator=g, device=dev).to(torch.bfloat16)
    common = dict(ranks=R, tokens_per_rank=T, shape=args.shape, block_m=args.block_m)
    sr = args.straggler_ranks
    for routing_name in args.routings:
        routing = uniform_routing(T, shape, 77 + me, dev) if routing_name == "uniform" else None
        common_r = {**common, "routing": routing_name}
        best = None
        for gemm in args.gemms:
            # one buffer per chunking; the first one's batch path is the reference of every streamed plan
            plans = [(C, pol, ctas, order, cons, k) for C in args.chunks if C >= 2 and math.ceil(T / C) >= 8
                     for pol in args.policies for ctas in args.ctas for order in args.orders
                     for cons in args.consumers for k in (args.reserved_sms if cons == "persistent" else [None])
                     if cons == "per_chunk" or (gemm == "triton" and ctas is None)]
            ref_out, ref_row = None, None
            for k, plan in enumerate([None] + plans):
                if budget.spent():
                    rows.append({**common_r, "gemm": gemm, "path": "skipped", "error": "time budget spent"})
                    return
                C, pol, ctas, order, cons, k = plan or (1, "serialized", None, "rank", args.batch_consumer, None)
                chunk = math.ceil(T / C)
                cfg = {"chunks": C, "chunk_tokens": chunk, "policy": pol, "num_slots": min(args.slots, C),
                       "chunk_gemm_ctas": ctas, "source_order": order, "consumer": cons, "reserved_sms": k,
                       "pull": args.pull}
                buf = None
                try:
                    buf = EPBuffer(heap, shape, max_tokens_per_rank=T, num_slots=cfg["num_slots"],
                                   tokens_per_slot=chunk, block_m=args.block_m, policy=pol if plan else "spin_kernel",
                                   source_order=order, gemm=gemm,
                                   transport=args.transport, chunk_gemm_ctas=ctas, consumer=cons,
                                   reserved_sms=k or 0, pull=args.pull, side_puts=not args.no_side_puts,
                                   chunk_combine=args.chunk_combine,
                                   last_step_with_seal=not args.separate_seal_gemms,
                                   deadline_s=args.deadline_s,
                                   timeline=bool(plan), name="bench")
                    layer = buf.prepare_weights(full)
                    if plan is None:  # the batch path, its GEMMs alone, its accuracy
                        ref_out, st, strag = measure(heap, buf, layer, x, routing, False, args, sr)
                        rows_here = heap.allgather_obj(rows_routed_here(buf))
                        # NVLink bytes per forward: one row per route (before) and one per token (after)
                        pulled = heap.allgather_obj([int(v) for v in buf.pull_bytes.tolist()])
                        gg = gemm_only_graph(buf, layer)
                        heap.barrier()
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        times = []
                        for _ in range(args.replays):
                            e0.record()
                            gg.replay()
                            e1.record()
                            torch.cuda.synchronize()
                            times.append(e0.elapsed_time(e1))
                        gemm_only = heap.allgather_obj(statistics.median(times))
                        del gg
                        rel = None
                        if routing is None:
                            samp = torch.linspace(0, T - 1, min(T, args.ref_tokens), device=dev).round().long().unique()
                            ref = B.reference_tokens_f64(x, full, shape, samp)
                            rel = max(heap.allgather_obj(
                                float((ref_out[samp].double() - ref).norm() / ref.norm().clamp_min(1e-30))))
                        ok = buf.status()
                        ref_row = {**common_r, **cfg, "path": "batch", "gemm": buf.gemm, "straggler_ms": 0.0,
                                   "straggler_rank": None, **st, "bitwise_equal_to_batch": True,
                                   "rows_per_rank": rows_here, "gemm_only_ms": gemm_only,
                                   "peer_bytes_per_route": [b[0] for b in pulled],
                                   "peer_bytes_per_token": [b[1] for b in pulled],
                                   "batch_over_gemm_only": st["median_ms"] / max(gemm_only),
                                   "rel_err_vs_f64_max": rel, "ring_ok": not (ok["violations"] or ok["timeouts"])}
                        rows.append(ref_row)
                        for r_, s_ in strag.items():
                            rows.append({**common_r, **cfg, "path": "batch", "gemm": buf.gemm,
                                         "straggler_ms": args.straggler_ms, "straggler_rank": r_, **s_})
                        log(f"T={T} {routing_name} {buf.gemm}: batch {st['median_ms']:.3f} ms, gemm-only per PE "
                            f"{[round(v, 3) for v in gemm_only]} ms, rows per PE {rows_here}")
                    else:
                        out, st, strag = measure(heap, buf, layer, x, routing, True, args, sr)
                        same = all(heap.allgather_obj(bool(torch.equal(out.view(torch.int16),
                                                                       ref_out.view(torch.int16)))))
                        ok = buf.status()
                        good = all(heap.allgather_obj(not (ok["violations"] or ok["timeouts"] or ok["bad_routes"])))
                        r = {**common_r, **cfg, "path": "streamed", "gemm": buf.gemm, "straggler_ms": 0.0,
                             "straggler_rank": None, **st, "bitwise_equal_to_batch": same, "ok": same and good,
                             "streamed_over_batch": st["median_ms"] / ref_row["median_ms"],
                             "streamed_over_gemm_only": st["median_ms"] / max(ref_row["gemm_only_ms"])}
                        rows.append(r)
                        for r_, s_ in strag.items():
                            rows.append({**common_r, **cfg, "path": "streamed", "gemm": buf.gemm,
                                         "straggler_ms": args.straggler_ms, "straggler_rank": r_, **s_})
                        log(f"T={T} {routing_name} {buf.gemm}: streamed {cfg} {st['median_ms']:.3f} ms "
                            f"({r['streamed_over_batch']:.3f}x batch), bitwise {same}, ok {good}")
                        # one stamped replay: the device timeline of this plan
                        y = torch.zeros_like(x)
                        gt = buf.capture(x, layer, y, streaming=True, routing=routing, stamps=True)
                        torch.cuda.synchronize()
                        heap.barrier()
                        gt.replay()
                        torch.cuda.synchronize()
                        tl = buf.timeline()
                        tl.update(batch_ms=ref_row["median_ms"], streamed_ms=st["median_ms"], tokens=T,
                                  routing=routing_name, gemm=buf.gemm)
                        tls = heap.allgather_obj(tl)
                        del gt
                        if r["ok"] and (best is None or st["median_ms"] < best[0]):
                            best = (st["median_ms"], tls)
                except Exception as exc:  # noqa: BLE001 - one plan's failure must not hide the others
                    rows.append({**common_r, **cfg, "path": "streamed" if plan else "batch", "gemm": gemm,
                                 "error": f"{type(exc).__name__}: {exc}"[:400]})
                    log(f"T={T} {routing_name} {gemm}: {cfg} FAILED: {type(exc).__name__}: {exc}")
                    if plan is None:
                        break  # no reference for this GEMM: its streamed plans cannot be checked
                finally:
                    torch.cuda.synchronize()
                    heap.barrier()
                    if buf is not None:
                        buf.close()
        if best is not None:
            timelines += best[1]
        # -- torch + NCCL, same routing ----------------------------------------------------------------
        if base is not None and not budget.spent():
            try:
                y_t = base.forward(x, routing)
                rel_t = float((y_t.float() - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-30)) \
                    if ref_out is not None else None
                ms_t = timed(heap, lambda: base.forward(x, routing), args.replays)
                rows.append({**common_r, "path": "torch_nccl", "straggler_ms": 0.0, "straggler_rank": None,
                             **stats(ms_t), "bitwise_equal_to_batch": False,
                             "rel_diff_vs_batch": max(heap.allgather_obj(rel_t)) if rel_t is not None else None})
                for r_ in sr:
                    base.sleep_cycles = int(args.straggler_ms * 1e-3 * 1.98e9) if me == r_ else 0
                    ms_ts = timed(heap, lambda: base.forward(x, routing), args.replays)
                    base.sleep_cycles = 0
                    rows.append({**common_r, "path": "torch_nccl", "straggler_ms": args.straggler_ms,
                                 "straggler_rank": r_, **stats(ms_ts), "bitwise_equal_to_batch": False})
                log(f"T={T} {routing_name}: torch+NCCL {statistics.median(ms_t):.3f} ms")
            except Exception as exc:  # noqa: BLE001
                rows.append({**common_r, "path": "torch_nccl", "error": f"{type(exc).__name__}: {exc}"[:400]})
                log(f"T={T}: torch+NCCL FAILED: {type(exc).__name__}: {exc}")


def table(rows, pub) -> str:
    out = [f"pub->acq across PEs: p50 {pub.get('p50')} us, p99 {pub.get('p99')} us (one release for both "
           f"generations: p50 {pub.get('p50_one_release')} us), flag floor {pub.get('floor')} us",
           f"{'T/rank':>7} {'routing':<8} {'path':<9} {'gemm':<8} {'strag':>6} {'plan':<26} {'median ms':>10} "
           f"{'vs batch':>9} {'vs torch':>9} {'vs gemm':>8} {'bitwise':>8}"]
    key = lambda r: (r["tokens_per_rank"], r.get("routing"), r.get("straggler_rank"))  # noqa: E731
    batch = {(*key(r), r.get("gemm")): r for r in rows if r.get("path") == "batch" and "median_ms" in r}
    torch_ = {key(r): r for r in rows if r.get("path") == "torch_nccl" and "median_ms" in r}
    gonly = {(r["tokens_per_rank"], r.get("routing"), r.get("gemm")): max(r["gemm_only_ms"])
             for r in rows if r.get("gemm_only_ms")}
    for r in rows:
        if "median_ms" not in r:
            out.append(f"{r['tokens_per_rank']:>7} {str(r.get('routing', '')):<8} {r['path']:<9} "
                       f"{str(r.get('gemm', '')):<8} ERROR {r.get('error', '')[:70]}")
            continue
        b = batch.get((*key(r), r.get("gemm")), {}).get("median_ms")
        t = torch_.get(key(r), {}).get("median_ms")
        go = gonly.get((r["tokens_per_rank"], r.get("routing"), r.get("gemm")))
        strag = "-" if r.get("straggler_rank") is None else f"r{r['straggler_rank']}"
        plan = (f"{r.get('chunks')}x{r.get('chunk_tokens')} {str(r.get('policy'))[:5]} "
                f"c{r.get('chunk_gemm_ctas') or '-'} {str(r.get('source_order'))[:4]} "
                f"{'P' + str(r.get('reserved_sms')) if r.get('consumer') == 'persistent' else ''}") \
            if r["path"] == "streamed" else ""
        f = lambda v: f"{v:.3f}" if v else "n/a"  # noqa: E731
        out.append(f"{r['tokens_per_rank']:>7} {str(r.get('routing')):<8} {r['path']:<9} {str(r.get('gemm', '')):<8} "
                   f"{strag:>6} {plan:<26} {r['median_ms']:>10.3f} {f(b and r['median_ms'] / b):>9} "
                   f"{f(t and r['median_ms'] / t):>9} {f(go and r['median_ms'] / go):>8} "
                   f"{str(r.get('bitwise_equal_to_batch')):>8}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    words = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    ap.add_argument("--tokens", type=ints, default=[128, 1024, 4096, 8192], help="tokens per rank")
    ap.add_argument("--shape", choices=["dsv3", "megamoe"], default="dsv3")
    ap.add_argument("--routings", type=words, default=["uniform", "router"], help="uniform, router")
    ap.add_argument("--chunks", type=ints, default=[1, 2, 4, 8], help="chunk counts (1: the batch path only)")
    ap.add_argument("--policies", type=words, default=["spin_kernel"])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--ctas", type=lambda s: [None if v == "none" else int(v) for v in s.split(",")],
                    default=[None], help="persistent grid sizes of the per-chunk GEMMs ('none': one CTA per tile)")
    ap.add_argument("--orders", type=words, default=["ready"], help="source orders of the streamed dispatch")
    ap.add_argument("--consumers", type=words, default=["per_chunk", "persistent"],
                    help="streamed consumers: per_chunk (GEMM grids per dispatch step), persistent (one kernel, "
                         "Triton GEMMs only)")
    ap.add_argument("--batch-consumer", default="per_chunk", choices=["per_chunk", "persistent"])
    ap.add_argument("--reserved-sms", type=ints, default=[16], help="persistent consumer: SMs left to the producers")
    ap.add_argument("--chunk-combine", action="store_true",
                    help="the owner's reduce chunk by chunk on its own stream instead of once after the GEMMs "
                         "(EPBuffer(chunk_combine=True); off by default, as in the buffer)")
    ap.add_argument("--separate-seal-gemms", action="store_true",
                    help="a GEMM call per dispatch step and one for the seal (EPBuffer(last_step_with_seal=False))")
    ap.add_argument("--no-side-puts", action="store_true",
                    help="the result puts of the local-y GEMMs (CUTLASS) on the GEMM stream instead of their own")
    ap.add_argument("--pull", default="token", choices=["route", "token"], help="dispatch pull: per route or per token")
    ap.add_argument("--transport", default="auto", choices=["auto", "p2p", "nv"])
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--ref-tokens", type=int, default=4)
    ap.add_argument("--straggler-ms", type=float, default=1.0)
    ap.add_argument("--straggler-ranks", type=ints, default=[0, 1], help="each PE that straggles, in turn")
    ap.add_argument("--deadline-s", type=float, default=20.0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the torch + NCCL baseline")
    ap.add_argument("--gemms", type=words, default=["auto"],
                    help="expert GEMMs: triton, cutlass, deep_gemm (block-m 128), auto (each buffer resolves it)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new measurements after this long")
    ap.add_argument("--symmetric-size", default="24G", help="NVSHMEM_SYMMETRIC_SIZE")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeline-json", default=None)
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", args.symmetric_size)
    from streamring.device.nvshmem import NvshmemHeap
    from streamring.host.launch import detect_launcher

    heap = NvshmemHeap.bootstrap(launcher=detect_launcher().value)
    R, me, dev = heap.num_ranks, heap.rank, heap.device
    args.straggler_ranks = [r for r in args.straggler_ranks if r < R]
    shape = (dsv3_shape if args.shape == "dsv3" else megamoe_shape)(args.block_m)
    if me == 0:
        log(f"{R} PEs, device {torch.cuda.get_device_name(dev)}, shape {args.shape}, transport {args.transport}, "
            f"GEMMs {args.gemms}")
    full = B.FastWeights.random(shape, 5, dev)
    base = None
    if not args.no_baseline and R > 1:
        import torch.distributed as dist

        port = heap.allgather_obj(29600 + (os.getpid() % 200) if me == 0 else None)[0]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=me, world_size=R,
                                device_id=dev)
        base = TorchNcclBaseline(shape, full.local(me, R), me, R, None)
    pub = pub_acq_latency(heap)
    if me == 0:
        log(f"pub->acq across PEs: {pub}")
    rows, timelines = [], []
    for T in args.tokens:
        bench_tokens(heap, T, shape, full, base, args, rows, timelines, budget)
        if me == 0 and args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "pub_acq": pub, "args": vars(args)}, indent=1))
    if me == 0:
        for r in rows:
            r["pub_acq_us"] = {k: pub.get(k) for k in ("p50", "p99", "p50_one_release", "p99_one_release", "floor")}
        log(table(rows, pub))
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "pub_acq": pub, "args": vars(args)}, indent=1))
        if args.timeline_json:
            Path(args.timeline_json).write_text(json.dumps({"timelines": timelines}, indent=1))
    bad = [r for r in rows if r.get("path") == "streamed" and r.get("bitwise_equal_to_batch") is False]
    heap.barrier()
    if base is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    heap.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
