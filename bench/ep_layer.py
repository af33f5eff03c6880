#!/usr/bin/env python3
"""The expert-parallel GPU layer against its own batch path and a torch + NCCL baseline, in one run.

Run one process per GPU, from the repo root (``launch/gpu_ep_bench.sh`` runs it on the device)::

    mpiexec -n 2 python3 -m bench.ep_layer --tokens 1024,4096,8192 --json out/ep-layer.json

DeepSeek-V3 expert shapes (hidden 7168, intermediate 2048, top-8, grouped routing, FP8 weights with
128x128 scales) with ``--experts-per-pe`` experts on each PE (total = PEs x that; 32 is the per-GPU load
of an EP8 deployment, 128 the worst case of 256 experts on 2 PEs). For every load, tokens-per-rank T,
every ``--routings`` (``uniform``: each token's k experts drawn uniformly at random, as peer benchmarks
do; ``router``: the model's router on random weights, which loads the PEs unevenly; ``hot``: low expert
ids hot, so PE 0 gets about 67 % of the routes on 2 PEs) and every
``--gemms`` implementation, in the same processes and on the same inputs:

* ``batch`` (``chunks`` = 1): :class:`~streamring.moe.ep_buffer.EPBuffer`'s batch path, captured as a
  CUDA graph; the reference every streamed output of the same GEMMs and routing is compared with,
  bitwise;
* ``streamed``: the same layer streamed for each ``--chunks`` (> 1) x ``--policies`` x ``--ctas`` x
  ``--orders`` x ``--consumers`` plan, captured;
* ``gemm_only``: each PE's expert GEMMs (L1 + SwiGLU + L2) over the rows the batch forward gave it,
  timed alone (its own captured graph), so the layer's overhead over its GEMMs is visible;
* ``torch_nccl``: what a user could write today from torch: NCCL ``all_to_all_single`` dispatch of
  FP8 rows (one per token and destination rank, rowwise scales), ``torch._scaled_grouped_mm``
  L1 -> SwiGLU -> FP8 -> L2, weighted reduce, ``all_to_all_single`` combine (eager: the split sizes
  need a host sync), with the same routing (not with two PEs on one GPU: NCCL refuses that);
* each path again in every late-rank case: each ``--straggler-ms`` device-side delay of one PE's
  producer, on each PE of ``--straggler-ranks`` in turn, and each ``--skew-ms`` random arrival skew
  (every PE's producer delayed by a fresh uniform draw in ``[0, skew]`` at every replay; every path sees
  the same draws);
* the publish -> acquire latency across PEs: a ring ping-pong (``ring_pingpong``: the layer's own
  publish and acquire) against the flag ping-pong floor (``flag_pingpong``), both round trip / 2.

Times: every replay starts after a host barrier; the forward's time is the slowest PE's event time;
medians over ``--replays``. A streamed plan is timed against its own buffer's batch graph, their replays
interleaved (on time: batch, streamed; in a late case: batch on time, batch late, streamed late, the
order rotated every replay), so clock drift reaches both and the ratios are paired. ``--json`` writes one row per measurement with ``ranks``,
``tokens_per_rank``, ``experts_per_pe``, ``path``, ``gemm``, ``routing``, the plan (``chunks``,
``num_slots``, ``policy``, ``source_order``, ``consumer``, ...), ``straggler_ms``, ``straggler_rank``,
``skew_ms``, ``median_ms``, ``streamed_over_batch`` (over the batch path in the same late-rank case),
``over_batch_on_time`` (over the batch path with no late rank: a late rank is *hidden* when this is at
most 1.02), for a skew ``first_wait_ms``, ``streamed_less_first_wait_ms`` and
``less_first_wait_over_batch_on_time`` (the median wait for the earliest producer, which no schedule can
hide, the median streamed time less each replay's own wait, and that over the on-time batch:
:func:`first_wait`), ``bitwise_equal_to_batch``, ``rows_per_rank`` (routed rows each PE computed), for a streamed plan
``blocks_{ready,expected,past,past_grid}_per_pe`` (its GEMM calls' ready blocks against the blocks their
grids were sized for, ``moe.debug.blocks_past_expectation``: ``past_grid``, past the one-CTA-per-tile
blocks, ran on a Triton grid's looping tail where it launched one), ``auto_streams`` and ``auto_source``
(whether ``streaming="auto"`` streams with the plan's buffer at this size, and whether the tuned table or
the cost model decided: the verdicts weigh auto's path against the better of batch and the plan, case by
case: :func:`auto_verdict`), ``gemm_only_ms``
(per PE) and ``pub_acq_us`` (``p50``, ``p99``, ``floor``); ``--timeline-json`` the device timelines of the
batch path and of the best streamed plan per size (each on time and with the largest straggler on the
last PE; draw with ``streamring timeline``). A table with the ratios and the targets' verdicts is
printed last.
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

from bench.common import FP8, Reported, dsv3_shape, log, stats, timed, timed_rounds
from bench.lateness import KINDS as LATE_KINDS
from bench.lateness import measure_kinds
from bench.skew import skew_delays_ms, skew_seed, timed_skew_draws
from bench.weight_floor import floor_graph, weight_bytes
from streamring.gemm.backends import CAPABILITIES
from streamring.device import kernels as DK
from streamring.device.gemm_grid import GEMM_GRID
from streamring.device.moe_triton import stamp
from streamring.moe import debug as moe_debug
from streamring.moe.ep_buffer import EPBuffer
from streamring.moe.math import MoEShape
from streamring.moe.reference import reference_forward_f64
from streamring.moe.routers import select_experts
from streamring.moe.tuning import EPTuning
from streamring.moe.weight_views import FP8BlocksView
from streamring.moe.weights import MoEWeights


#: --high-priority-puts -> EPTuning.high_priority_puts
PUTS_PRIORITY = {"auto": None, "on": True, "off": False}


def megamoe_shape(block_m: int, num_experts: int = 256) -> MoEShape:
    # DeepGEMM's SM90 Mega MoE benchmark shape (hidden 4096, 256 experts, top-6); intermediate 2048
    groups = max(1, 8 * num_experts // 256)
    return MoEShape(hidden=4096, intermediate=2048, num_experts=num_experts, topk=6, router="deepseek_v3",
                    n_group=groups, topk_group=min(4, groups), routed_scaling_factor=2.5, norm_topk_prob=True,
                    weight_dtype="fp8", block_m=block_m)


def uniform_routing(T: int, shape: MoEShape, seed: int, dev) -> tuple:
    """Each token's ``topk`` distinct experts drawn uniformly at random; weights random in (0.05, 1.05)
    times the scaling factor (the weights only scale rows: they do not change the work)."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    idx = torch.rand(T, shape.num_experts, generator=g, device=dev).topk(shape.topk, dim=1).indices
    w = (torch.rand(T, shape.topk, generator=g, device=dev) + 0.05) * shape.routed_scaling_factor
    return idx.to(torch.int64).contiguous(), w.float().contiguous()


#: ``hot`` routing's skew: expert e is drawn with weight (e + 1) ** -HOT_EXPONENT
HOT_EXPONENT = 0.5


def hot_routing(T: int, shape: MoEShape, seed: int, dev) -> tuple:
    """Each token's ``topk`` distinct experts drawn without replacement with weight
    ``(e + 1) ** -HOT_EXPONENT`` (Gumbel top-k), so the low expert ids, which PE 0 holds, are hot: on 2 PEs of
    32 experts each PE 0 gets about 67 % of the routes. Blocks past a call's grid (well past the even share:
    the grids have headroom) are what a Triton grid's looping tail computes (``blocks_past_grid_per_pe``);
    weights as :func:`uniform_routing`."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    logw = -HOT_EXPONENT * torch.log(torch.arange(1, shape.num_experts + 1, device=dev, dtype=torch.float32))
    u = torch.rand(T, shape.num_experts, generator=g, device=dev).clamp_min(1e-12)
    idx = (logw - torch.log(-torch.log(u))).topk(shape.topk, dim=1).indices
    w = (torch.rand(T, shape.topk, generator=g, device=dev) + 0.05) * shape.routed_scaling_factor
    return idx.to(torch.int64).contiguous(), w.float().contiguous()


#: the --routings a run may measure: a routing made here (seeded per PE), or the model's router (None)
ROUTINGS = {"uniform": uniform_routing, "hot": hot_routing, "router": None}


# ----------------------------------------------------------------------------------------------
# timing across PEs
# ----------------------------------------------------------------------------------------------
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

    def __init__(self, shape: MoEShape, fw_local: FP8BlocksView, rank: int, world: int, group):
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
    from streamring.ring.device import DeviceRing
    from streamring.ring.layout import RingLayout

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
    return int(buf.pipeline.experts.bc.state[: buf.E_loc].sum().item())


def gemm_only_graph(buf: EPBuffer, layer):
    """A captured graph of this PE's expert GEMMs over the blocks of the last (batch) forward, alone:
    L1 + SwiGLU + L2 of every ready block in ONE call (no dispatch, signal or reduce): as the default
    buffer's batch path runs them (its last step's blocks go with the seal's); with
    ``--separate-seal-gemms`` the layer makes two calls and this stays the one-call reference."""
    ex, comb = buf.pipeline.experts, buf.pipeline.combine
    bc = ex.bc
    n = buf.paths["batch"].num_chunks * buf.paths["batch"].steps + 1  # dispatch steps + the seal

    def run():
        # the buffer's own GEMMs (CUTLASS, DeepGEMM: one call over every block, its psum layout)
        direct = dict(out=comb.rows, direct=(bc.row_src, bc.row_tok, comb.row_delta)) if ex.owner_rows else {}
        bc.compute(0, n, bc.max_blocks, layer.fw, impl=buf.gemm, **direct)

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g


def late_cases(args) -> list[tuple]:
    """``(straggler_ms, straggler_rank, skew_ms)`` of every late-rank case of the producer kind measured after the
    on-time one: each straggler delay on each straggling PE in turn (with ``--lateness producer``), then each
    random arrival skew."""
    return [(ms, r, 0.0) for ms in args.straggler_ms for r in args.straggler_ranks if getattr(args, "producer_late", True)] + \
        [(0.0, None, sk) for sk in args.skew_ms]


def first_wait(streamed_ms: list[float], skew_ms: float, ranks: int, seed: int) -> dict:
    """Under a random skew nothing can be computed before the earliest producer publishes: replay ``i``'s
    streamed time holds ``min_p d_p(i)`` of pure waiting, however well the rest is hidden. Returns the
    median of that wait over the timed replays (``first_wait_ms``) and the median of each replay's
    streamed time less its own wait (``streamed_less_first_wait_ms``): what is left to compare with the
    on-time forward."""
    waits = [min(d) for d in timed_skew_draws(skew_ms, len(streamed_ms), ranks, seed)]
    return {"first_wait_ms": statistics.median(waits),
            "streamed_less_first_wait_ms": statistics.median(m - w for m, w in zip(streamed_ms, waits))}


def delay_setter(heap, buf, case, seed):
    """A per-replay hook (``timed``'s ``before``) setting this PE's producer delay for ``case``."""
    ms, rank, skew = case
    if skew:
        return lambda i: buf.instrument.set_delay(int(skew_delays_ms(skew, i, heap.num_ranks, seed)[heap.rank] * 1e6))
    ns = int(ms * 1e6) if heap.rank == rank else 0
    return lambda i: buf.instrument.set_delay(ns)


def measure_batch(heap, buf, layer, x, routing, args, seed):
    """The batch path (the reference of every streamed plan): eager first forward, capture, timed replays;
    then the same graph in each late-rank case. Returns ``(out, stats, {case: stats})``."""
    y = torch.zeros_like(x)
    buf.forward(x, layer, streaming=False, out=y, routing=routing)
    heap.barrier()
    g = Reported(buf, buf.capture(x, layer, y, streaming=False, routing=routing, stamps=False))
    heap.barrier()
    st = stats(timed(heap, g.replay, args.replays))
    out = y.clone()
    late = {}
    for case in late_cases(args):
        late[case] = stats(timed(heap, g.replay, args.replays, before=delay_setter(heap, buf, case, seed)))
        buf.instrument.set_delay(0)
    del g
    return out, st, late


def measure_paired(heap, buf, layer, x, routing, args, seed):
    """The streamed graph against the same buffer's batch graph (the same path as the reference buffer's),
    their replays interleaved (:func:`bench.common.timed_rounds`): on time, then in each late-rank case
    beside the batch path in the same case (the same delays) and the batch path on time. Returns
    ``(streamed out, {case: {"streamed": stats, "batch": stats, "batch_on_time": stats}}, blocks)``, blocks:
    how this PE's streamed forward on time met its GEMM grids' expectations (``moe.debug.blocks_past_expectation``
    without the per-call list)."""
    yb, ys = torch.zeros_like(x), torch.zeros_like(x)
    buf.forward(x, layer, streaming=False, out=yb, routing=routing)
    buf.forward(x, layer, streaming=True, out=ys, routing=routing)
    blocks = {k: v for k, v in moe_debug.blocks_past_expectation(buf).items() if k not in ("calls", "gemm")}
    heap.barrier()
    gb = Reported(buf, buf.capture(x, layer, yb, streaming=False, routing=routing, stamps=args.stamped_graphs))
    gs = Reported(buf, buf.capture(x, layer, ys, streaming=True, routing=routing, stamps=args.stamped_graphs))
    log(f"PE {heap.rank}: graph node priorities: {buf.node_priority_report}")
    heap.barrier()

    def on_time(i):
        buf.instrument.set_delay(0)
    t = timed_rounds(heap, [("batch", gb.replay, on_time), ("streamed", gs.replay, on_time)], args.replays)
    res = {ON_TIME: {"streamed": stats(t["streamed"]), "batch": stats(t["batch"]),
                     "batch_on_time": stats(t["batch"])}}
    if args.also_alone:  # each graph replayed back to back (not interleaved): what pairing changes
        res[ON_TIME]["streamed_alone"] = stats(timed(heap, gs.replay, args.replays))
        res[ON_TIME]["batch_alone"] = stats(timed(heap, gb.replay, args.replays))
    out = ys.clone()
    for case in late_cases(args):
        late = delay_setter(heap, buf, case, seed)
        t = timed_rounds(heap, [("batch_on_time", gb.replay, on_time), ("batch", gb.replay, late),
                                ("streamed", gs.replay, late)], args.replays)
        res[case] = {k: stats(v) for k, v in t.items()}
        if case[2]:
            res[case]["first_wait"] = first_wait(t["streamed"], case[2], heap.num_ranks, seed)
    buf.instrument.set_delay(0)
    del gb, gs
    return out, res, blocks


def timeline_line(t: dict) -> str:
    """One PE's stamped forward in a line (us from its graph's first kernel): chunk 0's producer steps,
    dispatch and GEMMs, the tail, the replay call and end stamps around the graph and the event time."""
    c, tl = t["chunks"][0], t["tail"]
    ev = [("writable", c), ("routed", c), ("own_routes", c), ("route_published", c), ("quantized", c),
          ("layout_published", c), ("acquired", c), ("first_blocks_done", c), ("dispatched_acked", c),
          ("blocks_done", c),
          ("seal_blocks_done", tl), ("combine_done", tl), ("replay_called", tl), ("replay_end", tl)]
    return (f"PE {t['rank']} {t['path']} late {t.get('straggler_ms')}: "
            + " ".join(f"{k} {d[k]:.0f}" for k, d in ev if k in d) + f" | event {t.get('event_ms', 0):.3f} ms")


def stamped_timelines(heap, buf, layer, x, routing, streaming, late_ms: float, info: dict, replays: int = 5,
                      trace: bool = False) -> list:
    """Stamped replays of the path (``replays`` on time, then as many with the last PE's producer ``late_ms``
    late): of each, the replay whose slowest PE's event time is the median, every PE's device timeline
    (for ``streamring timeline``) with the event time and the stamps written on the calling stream just
    before and after the graph (``replay_called``, ``replay_end``: time outside the graph's kernels). ``trace``:
    each also gets ``kernels``, every kernel of one more replay of the graph as the profiler saw it
    (:func:`bench.kernel_trace.traced_replay`; its stamps are not those of the same replay)."""
    out = []
    y = torch.zeros_like(x)
    gt = Reported(buf, buf.capture(x, layer, y, streaming=streaming, routing=routing, stamps=True))
    outer = torch.zeros(2, dtype=torch.int64, device=heap.device)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for ms in (0.0, late_ms):
        buf.instrument.set_delay(int(ms * 1e6) if heap.rank == heap.num_ranks - 1 else 0)
        runs = []
        for _ in range(replays):
            torch.cuda.synchronize()
            heap.barrier()
            stamp(outer, 0)
            e0.record()
            gt.replay()
            e1.record()
            stamp(outer, 1)
            torch.cuda.synchronize()
            tl = moe_debug.timeline(buf)
            t0 = tl.pop("t0_ns")
            called, end = outer.tolist()
            tl["tail"].update(replay_called=(called - t0) / 1e3, replay_end=(end - t0) / 1e3)
            tl.update(info, straggler_ms=ms, straggler_rank=heap.num_ranks - 1 if ms else None,
                      event_ms=e0.elapsed_time(e1))
            runs.append(heap.allgather_obj(tl))
        runs.sort(key=lambda pes: max(t["event_ms"] for t in pes))
        if trace:
            from bench.kernel_trace import traced_replay

            kernels = heap.allgather_obj(traced_replay(heap, gt.replay))
            for pe, t in enumerate(runs[len(runs) // 2]):
                t["kernels"] = kernels[pe]
        out += runs[len(runs) // 2]
        for t in runs[len(runs) // 2]:
            log(timeline_line(t))
    buf.instrument.set_delay(0)
    del gt
    return out


def case_fields(case) -> dict:
    ms, rank, skew = case
    kind = "skew" if skew else "producer" if rank is not None else "none"
    return {"straggler_ms": ms, "straggler_rank": rank, "skew_ms": skew, "lateness": kind}


ON_TIME = (0.0, None, 0.0)


#: the shape's block size under ``--block-m default`` (what a buffer of an open block size runs with Triton):
#: MoEShape's own default
SHAPE_BLOCK_M = MoEShape.block_m


def block_m_arg(text: str):
    """``--block-m``: an int, or ``default`` (None: ``EPTuning.block_m=None``, the buffer's own rule)."""
    if text == "default":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--block-m must be 16, 32, 64, 128 or 'default', got {text!r}") from None


def plans_for(args, T: int, gemm: str) -> list[tuple]:
    """Every streamed plan ``(chunks, policy, ctas, order, consumer, reserved_sms, ready_window_us,
    streamed_grid_waves, group_max_tokens)`` measured at ``T``. One chunk streams only in the ready and arrival
    orders: dispatch steps by source, so a late source delays only its own rows (with the rank order it would be
    the batch path's schedule). The ready window and the grouping bound are dimensions of the ready order only,
    the grid's waves of the GEMMs that have them (``gemm.backends.Capabilities.waves``; None: ``EPTuning``'s
    defaults)."""
    waves = args.waves if gemm == "auto" or CAPABILITIES.get(gemm, CAPABILITIES["triton"]).waves else [None]
    return [(C, pol, ctas, order, cons, k, win, wv, gmt) for C in args.chunks if math.ceil(T / C) >= 8
            for order in args.orders if C >= 2 or order != "rank"
            for pol in args.policies for ctas in args.ctas
            for cons in args.consumers for k in (args.reserved_sms if cons == "persistent" else [None])
            for win in (args.ready_windows_us if order == "ready" else [None])
            for gmt in (args.group_max_tokens if order == "ready" else [None])
            for wv in waves
            if cons == "per_chunk" or (gemm == "triton" and ctas is None)]


def batch_reference(heap, buf, layer, x, routing, full, shape, args, common, cfg, seed):
    """The batch path's rows (on time and late) and its GEMMs alone; returns ``(out, on-time row, rows)``."""
    T, dev = x.shape[0], heap.device
    ref_out, st, late = measure_batch(heap, buf, layer, x, routing, args, seed)
    rows_here = heap.allgather_obj(rows_routed_here(buf))
    # NVLink bytes per forward: one row per route (before) and one per token (after)
    pulled = heap.allgather_obj([int(v) for v in buf.pipeline.dispatch.pull_bytes.tolist()])
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
    floor = {}
    if args.floor:  # every PE reads its experts' weights once, all at once: the floor on the same SM shares
        fg = floor_graph(layer.fw)
        floor_ms = stats(timed(heap, fg.replay, args.replays))["median_ms"]
        del fg
        floor = {"floor_ms": floor_ms, "weight_bytes_per_pe": heap.allgather_obj(weight_bytes(layer.fw)),
                 "over_floor": st["median_ms"] / floor_ms, "gemm_only_over_floor": max(gemm_only) / floor_ms}
    rel = None
    if routing is None:
        samp = torch.linspace(0, T - 1, min(T, args.ref_tokens), device=dev).round().long().unique()
        ref = reference_forward_f64(x, full, shape, tokens=samp)
        rel = max(heap.allgather_obj(float((ref_out[samp].double() - ref).norm() / ref.norm().clamp_min(1e-30))))
    ok = buf.status()
    row = {**common, **cfg, "path": "batch", "gemm": buf.gemm, **case_fields(ON_TIME), **st,
           "bitwise_equal_to_batch": True, "rows_per_rank": rows_here, "gemm_only_ms": gemm_only,
           "peer_bytes_per_route": [b[0] for b in pulled], "peer_bytes_per_token": [b[1] for b in pulled],
           "batch_over_gemm_only": st["median_ms"] / max(gemm_only), **floor,
           "rel_err_vs_f64_max": rel, "ring_ok": not (ok["violations"] or ok["timeouts"])}
    rows = [row] + [{**common, **cfg, "path": "batch", "gemm": buf.gemm, **case_fields(c), **s_,
                     "over_batch_on_time": s_["median_ms"] / st["median_ms"]} for c, s_ in late.items()]
    log(f"T={T} E/PE={common['experts_per_pe']} {common['routing']} {buf.gemm}: batch {st['median_ms']:.3f} ms, "
        f"late {[round(s_['median_ms'], 3) for s_ in late.values()]} ms, gemm-only per PE "
        f"{[round(v, 3) for v in gemm_only]} ms, rows per PE {rows_here}"
        + (f"; weight-read floor {floor['floor_ms']:.3f} ms ({floor['weight_bytes_per_pe'][0] / 1e9:.2f} GB per PE): "
           f"batch {floor['over_floor']:.2f}x, GEMMs alone {floor['gemm_only_over_floor']:.2f}x" if floor else ""))
    return ref_out, row, rows


def end_job_after_failure(save, exc: BaseException) -> None:
    """End every PE's process after a failure on this PE inside a plan's collective work (its buffer made):
    they may be waiting in the plan's collectives for this PE, which would never come, so the job ends here (the
    launcher ends the other PEs) instead of waiting until its time limit; the file keeps the rows up to the last
    finished token count, and PE 0's rows so far (``save``; a failed PE's own error row is in its log only). A
    failure before the plan's buffer exists (a backend or plan refused, alike on every PE) does not end it: the
    next plan runs."""
    save()
    log(f"ending the job after a failure on this PE that the other PEs may be waiting on "
        f"({type(exc).__name__}); the rows so far are written")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


def bench_tokens(heap, T, shape, full, base, args, rows, timelines, budget, save=lambda: None):
    R, me, dev = heap.num_ranks, heap.rank, heap.device
    g = torch.Generator(device=dev)
    g.manual_seed(1000 + 7 * me + T)
    x = torch.randn(T, shape.hidden, generator=g, device=dev).to(torch.bfloat16)
    epp = shape.num_experts // R
    # gemm_grid: how the Triton GEMM grids are sized (the cost model models a row as the code that measured it)
    common = dict(ranks=R, tokens_per_rank=T, shape=args.shape, block_m=args.block_m, experts_per_pe=epp,
                  gemm_grid=GEMM_GRID)
    seed = skew_seed(T, epp)  # the skew draws: the same for every path of this size and load
    late_max = max(args.straggler_ms, default=0.0)
    for routing_name in args.routings:
        make = ROUTINGS[routing_name]
        routing = make(T, shape, 77 + me, dev) if make is not None else None
        common_r = {**common, "routing": routing_name}
        best = None
        for gemm in args.gemms:
            # one buffer per chunking; the first one's batch path is the reference of every streamed plan
            ref_out, ref_row, batch_tl = None, None, []
            for plan in [None] + plans_for(args, T, gemm):
                if budget.spent():
                    rows.append({**common_r, "gemm": gemm, "path": "skipped", "error": "time budget spent"})
                    return
                C, pol, ctas, order, cons, k, win, wv, gmt = plan or (1, "serialized", None, "rank",
                                                                      args.batch_consumer, None, None, None, None)
                chunk = math.ceil(T / C)
                slots = C if order == "arrival" else min(args.slots, C)  # arrival: a slot per chunk
                cfg = {"chunks": C, "chunk_tokens": chunk, "policy": pol, "num_slots": slots,
                       "chunk_gemm_ctas": ctas, "source_order": order, "consumer": cons, "reserved_sms": k,
                       "dispatch_beside_grid": args.dispatch_beside_grid, "seal_by_expert": args.seal_by_expert,
                       "high_priority_puts": PUTS_PRIORITY[args.high_priority_puts]}
                buf = None
                try:
                    tuning = EPTuning(block_m=args.block_m, policy=pol if plan else "spin_kernel", source_order=order,
                                      transport=args.transport, chunk_gemm_ctas=ctas, consumer=cons,
                                      reserved_sms=k or 16,
                                      **({} if win is None else {"ready_window_us": win}),
                                      **({} if wv is None else {"streamed_grid_waves": wv}),
                                      **({} if gmt is None else {"group_max_tokens": gmt}),
                                      dispatch_beside_grid=args.dispatch_beside_grid,
                                      seal_by_expert=args.seal_by_expert,
                                      high_priority_puts=PUTS_PRIORITY[args.high_priority_puts])
                    buf = EPBuffer(heap, shape, max_tokens_per_rank=T, num_slots=slots, tokens_per_slot=chunk,
                                   gemm=gemm, deadline_s=args.deadline_s, tuning=tuning, name="bench")
                    cfg["block_m"] = buf.block_m  # what the buffer runs (with --block-m default: its own rule)
                    if plan and buf.pipeline.groups_sources(buf.paths["stream"], T):
                        # the rows ran grouped ready steps with this window (the cost model reads it)
                        cfg["ready_window_us"] = tuning.ready_window_us
                    if plan:
                        cfg["grouped_steps"] = buf.pipeline.groups_sources(buf.paths["stream"], T)
                        cfg["streamed_grid_waves"] = tuning.streamed_grid_waves if CAPABILITIES[buf.gemm].waves \
                            else None
                    moe_debug.record_timeline(buf)
                    if args.delay_by == "host":  # before any capture: the graphs wait on the host word
                        buf.instrument.hold_with_host()
                        cfg["delay_by"] = "host"
                    layer = buf.prepare_weights(full)
                    info = dict(tokens=T, routing=routing_name, gemm=buf.gemm, experts_per_pe=epp)
                    if plan is None:  # the batch path, its GEMMs alone, its accuracy
                        ref_out, ref_row, brows = batch_reference(heap, buf, layer, x, routing, full, shape, args,
                                                                  common_r, cfg, seed)
                        rows += brows
                        batch_tl = stamped_timelines(heap, buf, layer, x, routing, False, late_max,
                                                     {**info, "batch_ms": ref_row["median_ms"]},
                                                     trace=args.kernel_trace)
                        continue
                    # what streaming="auto" makes of this buffer at T rows: this plan where its table or model
                    # picks this schedule, else the batch path (verdicts weigh it against the better of the two)
                    auto_f = {"auto_streams": bool(buf.adaptive_streaming(T)),
                              "auto_source": buf.last_adaptive.source}
                    out, paired, blocks = measure_paired(heap, buf, layer, x, routing, args, seed)
                    blocks = heap.allgather_obj(blocks)
                    same = all(heap.allgather_obj(bool(torch.equal(out.view(torch.int16), ref_out.view(torch.int16)))))
                    ok = buf.status()
                    good = all(heap.allgather_obj(not (ok["violations"] or ok["timeouts"] or ok["bad_routes"])))
                    st, late = paired[ON_TIME]["streamed"], {c: v["streamed"] for c, v in paired.items() if c != ON_TIME}
                    b0 = paired[ON_TIME]["batch"]["median_ms"]
                    # ratios over this buffer's batch graph, replayed interleaved with the streamed one
                    r = {**common_r, **cfg, "path": "streamed", "gemm": buf.gemm, **case_fields(ON_TIME), **st,
                         "bitwise_equal_to_batch": same, "ok": same and good, "paired": True, **auto_f,
                         "batch_paired_ms": b0, "streamed_over_batch": st["median_ms"] / b0,
                         "over_batch_on_time": st["median_ms"] / b0,
                         "streamed_over_gemm_only": st["median_ms"] / max(ref_row["gemm_only_ms"]),
                         **({"floor_ms": ref_row["floor_ms"], "over_floor": st["median_ms"] / ref_row["floor_ms"]}
                            if "floor_ms" in ref_row else {}),
                         "stamped_graphs": args.stamped_graphs,
                         **{f"blocks_{k_}_per_pe": [b[k_] for b in blocks]
                            for k_ in ("ready", "expected", "past", "past_grid")}}
                    for k_ in ("streamed_alone", "batch_alone"):
                        if k_ in paired[ON_TIME]:
                            r[f"{k_}_ms"] = paired[ON_TIME][k_]["median_ms"]
                    late_rows = []
                    for case, s_ in late.items():
                        b_case, b_on = paired[case]["batch"]["median_ms"], paired[case]["batch_on_time"]["median_ms"]
                        fw = paired[case].get("first_wait")
                        late_rows.append({**common_r, **cfg, "path": "streamed", "gemm": buf.gemm,
                                          **case_fields(case), **s_, "bitwise_equal_to_batch": same, "paired": True,
                                          **auto_f,
                                          "batch_paired_ms": b_case, "batch_on_time_paired_ms": b_on,
                                          "streamed_over_batch": s_["median_ms"] / b_case,
                                          "over_batch_on_time": s_["median_ms"] / b_on,
                                          **({} if fw is None else {
                                              **fw, "less_first_wait_over_batch_on_time":
                                                  fw["streamed_less_first_wait_ms"] / b_on})})
                    rows += [r] + late_rows
                    save()  # a later failure or the call's time limit keeps what was measured
                    if any(kd in LATE_KINDS for kd in args.lateness):
                        kinds = kind_rows(heap, buf, layer, x, routing, args, {**common_r, **cfg}, same, auto_f)
                        rows += kinds
                        late_rows += kinds
                        save()
                    log(f"T={T} E/PE={epp} {routing_name} {buf.gemm}: streamed {cfg} {st['median_ms']:.3f} ms "
                        f"({r['streamed_over_batch']:.3f}x batch), late "
                        f"{[round(lr['over_batch_on_time'], 3) for lr in late_rows]}x on-time batch, "
                        f"bitwise {same}, ok {good}"
                        + (f"; alone: streamed {r['streamed_alone_ms']:.3f} ms, batch {r['batch_alone_ms']:.3f} ms"
                           if "streamed_alone_ms" in r else "") + ("; stamped graphs" if args.stamped_graphs else ""))
                    # judged by the worst case over the on-time batch (what "hidden" means), as the verdicts
                    # judge: paired ratios, so plans measured minutes apart compare without their drift
                    worst = max(row["over_batch_on_time"] for row in [r] + late_rows)
                    if r["ok"] and (best is None or worst < best[0]):
                        best = (worst, stamped_timelines(heap, buf, layer, x, routing, True, late_max,
                                                         {**info, "batch_ms": b0, "streamed_ms": st["median_ms"]},
                                                         trace=args.kernel_trace))
                except Exception as exc:  # noqa: BLE001 - a plan refused alike everywhere must not hide the others
                    rows.append({**common_r, **cfg, "path": "streamed" if plan else "batch", "gemm": gemm,
                                 "error": f"{type(exc).__name__}: {exc}"[:400]})
                    log(f"T={T} {routing_name} {gemm}: {cfg} FAILED: {type(exc).__name__}: {exc}")
                    if buf is not None:  # from here on the plan's work is collective
                        end_job_after_failure(save, exc)
                    if plan is None:
                        break  # no reference for this GEMM: its streamed plans cannot be checked
                finally:
                    torch.cuda.synchronize()
                    heap.barrier()
                    if buf is not None:
                        buf.close()
            timelines += batch_tl
        if best is not None:
            timelines += best[1]
        # -- torch + NCCL, same routing ----------------------------------------------------------------
        if base is not None and not budget.spent():
            try:
                y_t = base.forward(x, routing)
                rel_t = float((y_t.float() - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-30)) \
                    if ref_out is not None else None
                ms_t = timed(heap, lambda: base.forward(x, routing), args.replays)
                rows.append({**common_r, "path": "torch_nccl", **case_fields(ON_TIME), **stats(ms_t),
                             "bitwise_equal_to_batch": False,
                             "rel_diff_vs_batch": max(heap.allgather_obj(rel_t)) if rel_t is not None else None})
                for case in late_cases(args):
                    ms, rank, skew = case

                    def before(i, ms=ms, rank=rank, skew=skew):
                        d = skew_delays_ms(skew, i, R, seed)[me] if skew else (ms if me == rank else 0.0)
                        base.sleep_cycles = int(d * 1e-3 * 1.98e9)
                    ms_ts = timed(heap, lambda: base.forward(x, routing), args.replays, before=before)
                    base.sleep_cycles = 0
                    rows.append({**common_r, "path": "torch_nccl", **case_fields(case), **stats(ms_ts),
                                 "bitwise_equal_to_batch": False})
                log(f"T={T} {routing_name}: torch+NCCL {statistics.median(ms_t):.3f} ms")
            except Exception as exc:  # noqa: BLE001
                rows.append({**common_r, "path": "torch_nccl", "error": f"{type(exc).__name__}: {exc}"[:400]})
                log(f"T={T}: torch+NCCL FAILED: {type(exc).__name__}: {exc}")


def kind_rows(heap, buf, layer, x, routing, args, fields: dict, same: bool, auto_f: dict) -> list[dict]:
    """The rows of ``bench.lateness``'s kinds for one streamed plan (each paired with the batch path in the same
    case and on time; ``other_work_over_batch``: the late PE's own work beside the streamed path over beside
    the batch path)."""
    out = []
    for m in measure_kinds(heap, buf, layer, x, routing, args, timed_rounds, stats):
        b_case, b_on = m["batch"]["median_ms"], m["batch_on_time"]["median_ms"]
        s_ = m["streamed"]
        ow, owb = m["other_work_ms"], m["other_work_batch_ms"]
        out.append({**fields, "path": "streamed", "gemm": buf.gemm, "straggler_ms": m["ms"], "straggler_rank": m["rank"],
                    "skew_ms": 0.0, "lateness": m["kind"], "launch_ahead": m["launch_ahead"], "late_matmuls": m["matmuls"],
                    **s_, "bitwise_equal_to_batch": same, "paired": True, **auto_f,
                    "batch_paired_ms": b_case, "batch_on_time_paired_ms": b_on,
                    "streamed_over_batch": s_["median_ms"] / b_case, "over_batch_on_time": s_["median_ms"] / b_on,
                    "other_work_ms": ow, "other_work_batch_ms": owb,
                    "other_work_over_batch": ow / owb if ow and owb else None})
        log(f"  {m['kind']} {m['ms']:g} ms on PE {m['rank']} (launched ahead {m['launch_ahead']}): streamed "
            f"{out[-1]['streamed_over_batch']:.3f}x batch same case, {out[-1]['over_batch_on_time']:.3f}x on-time batch"
            + (f", other work {out[-1]['other_work_over_batch']:.3f}x" if out[-1]["other_work_over_batch"] else ""))
    return out


def case_label(r) -> str:
    if r.get("skew_ms"):
        return f"skew{r['skew_ms']:g}"
    if r.get("straggler_rank") is not None:
        kind = r.get("lateness", "producer")
        prefix = "" if kind == "producer" else f"{kind}{'^' if r.get('launch_ahead') else ''}:"
        return f"{prefix}r{r['straggler_rank']}+{r['straggler_ms']:g}"
    return "-"


def plan_label(r) -> str:
    if r["path"] != "streamed":
        return ""
    return (f"{r.get('chunks')}x{r.get('chunk_tokens')} {str(r.get('policy'))[:5]} c{r.get('chunk_gemm_ctas') or '-'} "
            f"{str(r.get('source_order'))[:4]}{' P' + str(r.get('reserved_sms')) if r.get('consumer') == 'persistent' else ''}")


def table(rows, pub) -> str:
    """Every row: its median, over the batch path in the same late-rank case (``vs batch``) and over the
    batch path on time (``vs on-time``: what "a late rank is hidden" is judged by)."""
    out = [f"pub->acq across PEs: p50 {pub.get('p50')} us, p99 {pub.get('p99')} us (one release for both "
           f"generations: p50 {pub.get('p50_one_release')} us), flag floor {pub.get('floor')} us",
           f"{'T/rank':>7} {'E/PE':>4} {'routing':<8} {'path':<10} {'gemm':<8} {'late':>8} {'plan':<28} "
           f"{'median ms':>10} {'vs batch':>9} {'vs on-time':>10} {'vs torch':>9} {'bitwise':>8}"]
    key = lambda r: (r["tokens_per_rank"], r.get("experts_per_pe"), r.get("routing"), case_label(r))  # noqa: E731
    batch = {(*key(r), r.get("gemm")): r for r in rows if r.get("path") == "batch" and "median_ms" in r}
    torch_ = {key(r): r for r in rows if r.get("path") == "torch_nccl" and "median_ms" in r}
    f = lambda v: f"{v:.3f}" if v else "n/a"  # noqa: E731
    for r in rows:
        if "median_ms" not in r:
            out.append(f"{r['tokens_per_rank']:>7} {str(r.get('experts_per_pe')):>4} {str(r.get('routing', '')):<8} "
                       f"{r['path']:<10} {str(r.get('gemm', '')):<8} ERROR {r.get('error', '')[:70]}")
            continue
        # a paired row carries its ratios over the batch graph replayed beside it; others, over the batch rows
        b = r.get("batch_paired_ms") or batch.get((*key(r), r.get("gemm")), {}).get("median_ms")
        b0 = (r.get("batch_on_time_paired_ms") or r.get("batch_paired_ms")) if r.get("paired") else \
            batch.get((*key(r)[:3], "-", r.get("gemm")), {}).get("median_ms")
        t = torch_.get(key(r), {}).get("median_ms")
        out.append(f"{r['tokens_per_rank']:>7} {str(r.get('experts_per_pe')):>4} {str(r.get('routing')):<8} "
                   f"{r['path']:<10} {str(r.get('gemm', '')):<8} {case_label(r):>8} {plan_label(r):<28} "
                   f"{r['median_ms']:>10.3f} {f(b and r['median_ms'] / b):>9} {f(b0 and r['median_ms'] / b0):>10} "
                   f"{f(t and r['median_ms'] / t):>9} {str(r.get('bitwise_equal_to_batch')):>8}")
    return "\n".join(out)


def verdicts(rows) -> str:
    """Per size, load and GEMMs: the best streamed plan by its worst case, against the targets (a late rank
    hidden: streamed late <= 1.02x batch on time; skew: that and streamed < batch with the same draws;
    on time: streamed <= 1.00x batch)."""
    out = ["targets (best streamed plan by its worst case; ratios over the batch path of the same run):"]
    groups: dict = {}
    for r in rows:
        if r.get("path") == "streamed" and "median_ms" in r:
            groups.setdefault((r["tokens_per_rank"], r.get("experts_per_pe"), r.get("routing"), r.get("gemm")),
                              {}).setdefault(plan_label(r), []).append(r)
    for (T, epp, routing, gemm), plans in sorted(groups.items(), key=lambda kv: str(kv[0])):
        label, rs = min(plans.items(), key=lambda kv: max(x["over_batch_on_time"] for x in kv[1]))
        on = [x for x in rs if case_label(x) == "-"]
        late = [x for x in rs if x.get("straggler_rank") is not None and x.get("lateness", "producer") == "producer"]
        skew = [x for x in rs if x.get("skew_ms")]
        parts = [f"on time {on[0]['over_batch_on_time']:.3f}x{' ok' if on[0]['over_batch_on_time'] <= 1.0 else ' MISSED'}"
                 if on else "on time n/a"]
        if late:
            w = max(late, key=lambda x: x["over_batch_on_time"])
            parts.append(f"worst late ({case_label(w)}) {w['over_batch_on_time']:.3f}x on-time batch"
                         f"{' hidden' if w['over_batch_on_time'] <= 1.02 else ' NOT hidden'}")
        for x in skew:
            ok = x['over_batch_on_time'] <= 1.02 and x['streamed_over_batch'] < 1
            wait = (f" (first wait {x['first_wait_ms']:.2f} ms; less it {x['less_first_wait_over_batch_on_time']:.3f}x)"
                    if "first_wait_ms" in x else "")
            parts.append(f"{case_label(x)} {x['over_batch_on_time']:.3f}x on-time batch, {x['streamed_over_batch']:.3f}x "
                         f"batch same draws{' ok' if ok else ' MISSED'}{wait}")
        for kind in LATE_KINDS:
            ks = [x for x in rs if x.get("lateness") == kind]
            if not ks:
                continue
            w = max(ks, key=lambda x: x["over_batch_on_time"] if kind == "idle" else x["streamed_over_batch"])
            if kind == "idle":  # hidden: the layer's time with the wait before it as if on time
                parts.append(f"{case_label(w)} {w['over_batch_on_time']:.3f}x on-time batch"
                             f"{' hidden' if w['over_batch_on_time'] <= 1.02 else ' NOT hidden'}")
            else:  # the same work either way: no slower than batch in the same case, its other work not slowed
                ow = max((x["other_work_over_batch"] for x in ks if x.get("other_work_over_batch")), default=None)
                ok = w["streamed_over_batch"] <= 1.0 and (ow is None or ow <= 1.03)
                parts.append(f"{case_label(w)} {w['streamed_over_batch']:.3f}x batch same case, other work "
                             f"{'n/a' if ow is None else format(ow, '.3f') + 'x'}{' ok' if ok else ' MISSED'}")
        auto = auto_verdict(rs)
        if auto:
            parts.append(auto)
        out.append(f"  T={T} E/PE={epp} {routing} {gemm}: [{label}] " + "; ".join(parts))
    return "\n".join(out)


def auto_verdict(rs) -> str | None:
    """``streaming="auto"`` against its target (never more than 2 % slower than the better path): in each
    case of one streamed plan's paired rows, auto's time is the plan's where auto streams with it, else the
    batch graph's of the same rounds, over the better of the two; the worst case. None for rows without
    ``auto_streams`` (measured before it was recorded)."""
    rs = [x for x in rs if "auto_streams" in x and x.get("batch_paired_ms")]
    if not rs:
        return None
    def over_better(x):
        s_, b = x["median_ms"], x["batch_paired_ms"]
        return (s_ if x["auto_streams"] else b) / min(s_, b)
    w = max(rs, key=over_better)
    picks = "streams" if rs[0]["auto_streams"] else "keeps batch"
    return (f"auto {picks} ({rs[0]['auto_source']}): worst ({case_label(w)}) {over_better(w):.3f}x the better path"
            f"{' ok' if over_better(w) <= 1.02 else ' MISSED'}")


def _json_args(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "budget"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    words = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    ap.add_argument("--tokens", type=ints, default=[128, 1024, 4096, 8192], help="tokens per rank")
    ap.add_argument("--shape", choices=["dsv3", "megamoe"], default="dsv3")
    ap.add_argument("--routings", type=words, default=["uniform", "router"],
                    help=f"routings to measure, of {', '.join(ROUTINGS)} (hot: PE 0's experts hot, hot_routing)")
    ap.add_argument("--chunks", type=ints, default=[1, 2, 4],
                    help="chunk counts of the streamed plans (1: one dispatch step per source, ready and arrival "
                         "orders only; the batch path always runs)")
    ap.add_argument("--policies", type=words, default=["spin_kernel"])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--block-m", type=block_m_arg, default=64,
                    help="rows per expert block: 16, 32, 64 or 128, or 'default' (EPTuning.block_m=None: the buffer's "
                         "own rule, 128 where CUTLASS or DeepGEMM compute; each row records the buffer's block_m)")
    ap.add_argument("--ctas", type=lambda s: [None if v == "none" else int(v) for v in s.split(",")],
                    default=[None], help="persistent grid sizes of the per-chunk GEMMs ('none': one CTA per tile)")
    ap.add_argument("--orders", type=words, default=["ready", "arrival"],
                    help="source orders of the streamed dispatch (EPTuning.source_order; arrival: a slot per chunk)")
    ap.add_argument("--consumers", type=words, default=["per_chunk", "persistent"],
                    help="streamed consumers: per_chunk (GEMM grids per dispatch step), persistent (one kernel, "
                         "Triton GEMMs only)")
    ap.add_argument("--ready-windows-us", type=lambda s: [float(v) for v in s.split(",") if v], default=[None],
                    help="ready order: EPTuning.ready_window_us values to measure (default: its default)")
    ap.add_argument("--group-max-tokens", type=lambda s: [None if v == "default" else int(v) for v in s.split(",")],
                    default=[None], help="ready order: EPTuning.group_max_tokens values to measure ('default': its "
                                         "default)")
    ap.add_argument("--waves", type=lambda s: [None if v == "default" else int(v) for v in s.split(",")],
                    default=[None], help="GEMMs whose grid runs in waves (CUTLASS): EPTuning.streamed_grid_waves "
                                         "values to measure ('default': its default; 1: one CTA per SM)")
    ap.add_argument("--lateness", type=words, default=["producer"],
                    help=f"kinds of lateness of the late PE: producer (a delay inside its producer stage, the "
                         f"stragglers), {', '.join(LATE_KINDS)} (bench.lateness: its caller stream idle or busy "
                         f"before the layer, or busy beside it), each for every --straggler-ms and "
                         f"--straggler-ranks")
    ap.add_argument("--launch-ahead", choices=["on", "off", "both"], default="on",
                    help="the lateness kinds' streamed graphs launch the consumer ahead of the late work "
                         "(EPBuffer.launch_consumer), or not, or both")
    ap.add_argument("--batch-consumer", default="per_chunk", choices=["per_chunk", "persistent"])
    ap.add_argument("--reserved-sms", type=ints, default=[16], help="persistent consumer: SMs left to the producers")
    ap.add_argument("--transport", default="auto", choices=["auto", "p2p", "nv"])
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--ref-tokens", type=int, default=4)
    ap.add_argument("--experts-per-pe", type=ints, default=[32],
                    help="experts per PE (total = PEs x this; DeepSeek-V3 expert shapes, routing groups scaled along); "
                         "32 is an EP8 deployment's per-GPU load, 128 the 2-PE worst case")
    ap.add_argument("--straggler-ms", type=lambda s: [float(v) for v in s.split(",") if v], default=[1.0, 3.0],
                    help="device-side delays of one PE's producer, each measured on each --straggler-ranks PE")
    ap.add_argument("--straggler-ranks", type=ints, default=[0, 1], help="each PE that straggles, in turn")
    ap.add_argument("--skew-ms", type=lambda s: [float(v) for v in s.split(",") if v], default=[2.0],
                    help="random arrival skew: every PE's producer delayed by a fresh uniform draw in [0, skew] at "
                         "every replay, the same draws for every path")
    ap.add_argument("--stamped-graphs", action="store_true",
                    help="time the paired batch and streamed graphs with their timeline stamps in (what stamping changes)")
    ap.add_argument("--also-alone", action="store_true",
                    help="also time each plan's two graphs on time replayed back to back, not interleaved")
    ap.add_argument("--floor", action="store_true",
                    help="also time a kernel reading each PE's expert weights once, all PEs at once (bench.weight_floor): "
                         "rows get floor_ms and over_floor")
    ap.add_argument("--deadline-s", type=float, default=20.0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the torch + NCCL baseline")
    ap.add_argument("--gemms", type=words, default=["auto"],
                    help="expert GEMMs: triton, cutlass, deep_gemm (block-m 128), auto (each buffer resolves it)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new measurements after this long")
    ap.add_argument("--symmetric-size", default="24G", help="NVSHMEM_SYMMETRIC_SIZE")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeline-json", default=None)
    ap.add_argument("--delay-by", choices=("spin", "host"), default="spin",
                    help="how a late PE's producer delay (--straggler-ms, --skew-ms) and the idle lateness kind are "
                         "made: a one-warp kernel spinning on an SM (spin), or a stream wait on a host word a host "
                         "timer releases after the graph's launch (host: no SM held, the late PE's GPU free; rows "
                         "record delay_by)")
    ap.add_argument("--dispatch-beside-grid", action="store_true",
                    help="every plan with EPTuning(dispatch_beside_grid=True), an experiment: a streamed dispatch step "
                         "runs beside the previous step's GEMM call even where that call's grid holds every SM (the "
                         "default waits for it; rows record dispatch_beside_grid)")
    ap.add_argument("--dispatch-after-full-grid", action="store_false", dest="dispatch_beside_grid",
                    help="the default (EPTuning(dispatch_beside_grid=False)); kept so that recorded commands run")
    ap.add_argument("--seal-after-full-blocks", action="store_false", dest="seal_by_expert",
                    help="every plan with EPTuning(seal_by_expert=False): the seal's call computes every partial block "
                         "after every full block of its range, a second pass over the weights (the default lays it "
                         "out expert by expert; rows record seal_by_expert)")
    ap.add_argument("--seal-by-expert", action="store_true", dest="seal_by_expert", default=True,
                    help="the default (EPTuning(seal_by_expert=True)); kept so that recorded commands run")
    ap.add_argument("--high-priority-puts", choices=tuple(PUTS_PRIORITY), default="auto",
                    help="every plan with EPTuning(high_priority_puts=...): on / off, or auto (the default: off with a "
                         "persistent-grid GEMM backend, on with Triton); rows record high_priority_puts")
    ap.add_argument("--kernel-trace", action="store_true",
                    help="the stamped timelines also get every kernel of one replay as the profiler saw it "
                         "(bench.kernel_trace; python -m bench.kernel_trace TIMELINES.json prints them)")
    args = ap.parse_args(argv)
    bad = [r for r in args.routings if r not in ROUTINGS]
    if bad:
        ap.error(f"--routings: {bad} not among {list(ROUTINGS)}")
    bad = [k for k in args.lateness if k not in ("producer",) + LATE_KINDS]
    if bad:
        ap.error(f"--lateness: {bad} not among {['producer', *LATE_KINDS]}")
    if "producer" not in args.lateness:  # the straggler delays are the producer kind: measured only when asked
        args.skew_ms = []
        args.producer_late = False
    else:
        args.producer_late = True
    budget = args.budget = Budget(args.budget_s)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", args.symmetric_size)
    from streamring.device.nvshmem import NvshmemHeap
    from streamring.host.launch import detect_launcher

    heap = NvshmemHeap.bootstrap(launcher=detect_launcher().value)
    R, me, dev = heap.num_ranks, heap.rank, heap.device
    args.straggler_ranks = [r for r in args.straggler_ranks if r < R]
    if me == 0:
        log(f"{R} PEs, device {torch.cuda.get_device_name(dev)} ({torch.cuda.get_device_properties(dev).multi_processor_count} "
            f"SMs reported to this process), shape {args.shape}, experts per PE "
            f"{args.experts_per_pe}, transport {args.transport}, GEMMs {args.gemms}")
    nccl = False
    if not args.no_baseline and R > 1:
        import torch.distributed as dist

        port = heap.allgather_obj(29600 + (os.getpid() % 200) if me == 0 else None)[0]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=me, world_size=R,
                                device_id=dev)
        nccl = True
    pub = pub_acq_latency(heap)
    if me == 0:
        log(f"pub->acq across PEs: {pub}")
    rows, timelines = [], []
    for epp in args.experts_per_pe:
        shape = (dsv3_shape if args.shape == "dsv3" else megamoe_shape)(args.block_m or SHAPE_BLOCK_M, epp * R)
        full = MoEWeights.random_fp8(shape, 5, dev)
        base = TorchNcclBaseline(shape, full.fp8_blocks().local(me, R), me, R, None) if nccl else None
        def save():
            if me == 0 and args.json:
                Path(args.json).write_text(json.dumps({"rows": rows, "pub_acq": pub, "args": _json_args(args)}, indent=1))
        for T in args.tokens:
            bench_tokens(heap, T, shape, full, base, args, rows, timelines, budget, save)
            save()
        del full, base
        torch.cuda.empty_cache()
    if me == 0:
        for r in rows:
            r["pub_acq_us"] = {k: pub.get(k) for k in ("p50", "p99", "p50_one_release", "p99_one_release", "floor")}
        log(table(rows, pub))
        log(verdicts(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "pub_acq": pub, "args": _json_args(args)}, indent=1))
        if args.timeline_json:
            Path(args.timeline_json).write_text(json.dumps({"timelines": timelines}, indent=1))
    bad = [r for r in rows if r.get("path") == "streamed" and r.get("bitwise_equal_to_batch") is False]
    heap.barrier()
    if nccl:
        import torch.distributed as dist

        dist.destroy_process_group()
    heap.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
