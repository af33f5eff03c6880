"""``streamring run``: the MoE layer on every rank, streamed against batch-ready, checked.

Each rank builds the same random layer (the CLI's default; an engine passes
its own weights to :class:`streamring.moe.layer.MoEBuffer`), draws its own
tokens, runs the batch-ready path and the streamed path for ``run.epochs``
forward calls on the same buffers, and compares: streamed against batch
(bitwise) and both against an independent float64 reference.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .config import Config, ConfigError, per_rank
from .device.verbs import SymmetricHeap
from .moe.shape import MoEShape
from .protocol import Inject, RingLayout

# torch and the MoE layer are imported by the functions that compute: the local launcher's pre-launch
# check (check_run_job, run_heap_bytes) runs in a process that needs neither.
if TYPE_CHECKING:
    import torch


def shape_from_config(cfg: Config) -> MoEShape:
    """The :class:`MoEShape` of ``cfg.layer`` with ``cfg.run.block_m``."""
    L = cfg.layer
    return MoEShape(hidden=L.hidden, intermediate=L.intermediate, num_experts=L.num_experts, topk=L.topk,
                    router=L.router, renormalize=L.renormalize, n_group=L.n_group, topk_group=L.topk_group,
                    routed_scaling_factor=L.routed_scaling_factor, norm_topk_prob=L.norm_topk_prob,
                    weight_dtype=L.weight_dtype, block_m=cfg.run.block_m)


# ----------------------------------------------------------------------------------
# Synthetic routings (tests and `run.routing`): deterministic per (rank, token).
# ----------------------------------------------------------------------------------
def _hash(*parts: np.ndarray) -> np.ndarray:
    v = np.zeros(np.broadcast(*parts).shape, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in parts:
            v = (v ^ np.asarray(p, dtype=np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
            v ^= v >> np.uint64(29)
            v *= np.uint64(0xBF58476D1CE4E5B9)
            v ^= v >> np.uint64(32)
    return v


def synthetic_routing(mode: str, rank: int, shape: MoEShape, num_ranks: int, seed: int = 0,
                      masked_every: int = 7):
    """A routing function for ``MoEBuffer.forward(routing=...)``.

    ``uniform``: k distinct random experts, about one route in ``masked_every``
    masked (-1); ``hot_expert``: expert 0 is every token's first choice;
    ``one_rank``: every route goes to rank 0's experts (extra routes masked).
    """
    E, k = shape.num_experts, shape.topk
    per = E // num_ranks

    import torch

    def fn(x_chunk: torch.Tensor, token_ids: torch.Tensor):
        n = len(token_ids)
        tok = token_ids.numpy().astype(np.uint64)[:, None]
        if mode == "one_rank":
            pool = np.arange(per)
        else:
            pool = np.arange(E)
        h = _hash(np.uint64(seed), np.uint64(rank), tok, pool[None, :].astype(np.uint64))
        order = np.argsort(h, axis=1, kind="stable")
        kk = min(k, len(pool))
        idx = np.full((n, k), -1, dtype=np.int64)
        idx[:, :kk] = pool[order[:, :kk]]
        if mode == "hot_expert" and n:
            first = idx[:, 0].copy()
            has0 = (idx == 0).any(axis=1)
            # put expert 0 first; keep the set distinct
            idx[:, 0] = 0
            swap = ~has0
            idx[swap, 1:] = np.where(idx[swap, 1:] == 0, first[swap, None], idx[swap, 1:])
            for j in range(1, k):
                col = idx[has0, j]
                idx[has0, j] = np.where(col == 0, first[has0], col)
        hw = _hash(np.uint64(seed + 1), np.uint64(rank), tok, np.arange(k, dtype=np.uint64)[None, :])
        w = ((hw >> np.uint64(40)).astype(np.float64) / float(1 << 24) + 0.05).astype(np.float32)
        if mode == "uniform" and masked_every:
            idx[(hw % np.uint64(masked_every)) == 0] = -1
        return torch.from_numpy(idx), torch.from_numpy(w)

    return fn


# ----------------------------------------------------------------------------------
def make_tokens(cfg: Config, rank: int, epoch: int, num_tokens: int) -> torch.Tensor:
    """This rank's tokens of one forward call (deterministic)."""
    import torch

    g = torch.Generator().manual_seed(cfg.layer.seed * 1_000_003 + rank * 7919 + epoch)
    return torch.randn(num_tokens, cfg.layer.hidden, generator=g, dtype=torch.float32)


def use_fast_gpu_path(cfg: Config) -> bool:
    """Whether ``run`` takes the expert-parallel FP8 GPU layer (see ``run.gpu_path``)."""
    if cfg.backend != "nvshmem":
        return False
    if cfg.run.gpu_path == "auto":
        return cfg.layer.weight_dtype == "fp8"
    return cfg.run.gpu_path == "fast"


def check_run_job(cfg: Config, num_ranks: int) -> None:
    """Every check of the ``run`` config that needs the number of ranks; raises :class:`ConfigError`.

    The same checks run before the ranks start (the CLI) and on every rank.
    """
    R = num_ranks
    try:
        shape_from_config(cfg).validate(R)
    except ValueError as exc:
        raise ConfigError(f"layer: {exc} (layer.num_experts must be a multiple of the {R} ranks; see also "
                          f"layer.topk, layer.n_group, layer.topk_group)") from None
    per_rank(cfg.run.tokens_per_rank, R, "run.tokens_per_rank")
    if R > 1 and cfg.nvshmem.progress == "pdl" and use_fast_gpu_path(cfg):
        # EPMoE refuses it (streamed != batch measured on 2 GPUs; see moe/gpu_layer.py): say so before launch
        raise ConfigError("nvshmem.progress=pdl is refused by the expert-parallel GPU layer with more than one rank "
                          "(its streamed output differed from batch on 2 GPUs); use serialized, stream_wait, "
                          "spin_kernel or green_ctx, or run.gpu_path=host_verbs")


def run_layouts(cfg: Config, num_ranks: int) -> dict[str, RingLayout]:
    """The two rings every rank of ``streamring run`` allocates (``MoEBuffer``): streamed and batch."""
    L = cfg.layer
    tokens = per_rank(cfg.run.tokens_per_rank, num_ranks, "run.tokens_per_rank")
    lay = dict(num_ranks=num_ranks, hidden=L.hidden, topk=L.topk, num_experts=L.num_experts, with_combine=True)
    return {"moe-stream-ring": RingLayout(num_slots=cfg.ring.num_slots, tokens_per_slot=cfg.ring.tokens_per_slot,
                                          **lay),
            "moe-batch-ring": RingLayout(num_slots=1, tokens_per_slot=max(max(tokens), 1), **lay)}


def run_heap_bytes(cfg: Config, num_ranks: int) -> int:
    """Symmetric bytes every rank of ``streamring run`` allocates."""
    return sum(lay.nbytes for lay in run_layouts(cfg, num_ranks).values())


def run_layer(heap: SymmetricHeap, cfg: Config) -> dict:
    """Run ``cfg`` on this rank; returns this rank's row of the report."""
    if use_fast_gpu_path(cfg):
        return run_layer_gpu(heap, cfg)
    import torch

    from .moe.bitwise import same_bits
    from .moe.layer import MoEBuffer
    from .moe.math import MoEWeights, compare_to_reference, reference_forward_f64, reference_tolerance

    R, me = heap.num_ranks, heap.rank
    check_run_job(cfg, R)
    shape = shape_from_config(cfg)
    tokens = per_rank(cfg.run.tokens_per_rank, R, "run.tokens_per_rank")
    # Expert math on the rank's GPU with the NVSHMEM backend (torch ops), on the CPU otherwise.
    device = getattr(heap, "device", None) or "cpu"
    weights = MoEWeights.random(shape, seed=cfg.layer.seed, device=device)
    buf = MoEBuffer(heap, shape, num_slots=cfg.ring.num_slots, tokens_per_slot=cfg.ring.tokens_per_slot,
                    max_tokens_per_rank=max(max(tokens), 1), wait_timeout_s=cfg.wait_timeout_s,
                    inject=Inject(cfg.run.inject))
    routing = None if cfg.run.routing == "router" else synthetic_routing(cfg.run.routing, me, shape, R,
                                                                         cfg.layer.seed)
    rtol, atol = reference_tolerance(shape)
    row = dict(rank=me, tokens=tokens[me], chunks=0, experts_hit=0, bitwise_equal=True,
               max_abs_stream_minus_batch=0.0, ref_ok=True, ref_max_abs_err=0.0, ref_max_err_ratio=0.0,
               ref_excluded=0, batch_wall_s=0.0, stream_wall_s=0.0, epochs=cfg.run.epochs,
               scheduler=cfg.run.scheduler, rtol=rtol, atol=atol)
    for ep in range(cfg.run.epochs):
        x = make_tokens(cfg, me, ep, tokens[me]).to(device)
        outs = {}
        for mode in ("batch", "stream"):
            if cfg.run.mode not in ("both", mode):
                continue
            t0 = time.monotonic()
            outs[mode] = buf.forward(x, weights, streaming=(mode == "stream"), scheduler=cfg.run.scheduler,
                                     routing=routing, source_order=cfg.run.source_order)
            row[f"{mode}_wall_s"] += time.monotonic() - t0
            if mode == "stream":
                row["chunks"] = buf.last_stats.num_chunks
            row["experts_hit"] = max(row["experts_hit"], buf.last_stats.experts_hit)
            idx32 = buf.last_routing[0]
        if "batch" in outs and "stream" in outs:
            diff = (outs["stream"] - outs["batch"]).abs().max().item() if x.shape[0] else 0.0
            row["max_abs_stream_minus_batch"] = max(row["max_abs_stream_minus_batch"], diff)
            row["bitwise_equal"] &= same_bits(outs["stream"], outs["batch"])  # bytes: -0.0 != +0.0
        # Independent float64 reference of the same math.
        if routing is None:
            y_ref, idx64, _ = reference_forward_f64(x, weights, shape, return_routing=True)
        else:
            idx_r, w_r = routing(x, torch.arange(x.shape[0]))
            idx_r, w_r = idx_r.to(device), w_r.to(device)
            y_ref, idx64 = reference_forward_f64(x, weights, shape, routing=(idx_r, w_r)), idx_r
            idx32 = idx_r
        for y in outs.values():
            cmp = compare_to_reference(y, y_ref, idx32, idx64, shape=shape)
            row["ref_ok"] &= bool(cmp.ok)
            row["ref_max_abs_err"] = max(row["ref_max_abs_err"], float(cmp.max_abs_err))
            row["ref_max_err_ratio"] = max(row["ref_max_err_ratio"], float(cmp.max_err_ratio))
            row["ref_excluded"] = max(row["ref_excluded"], int(cmp.num_excluded))
    buf.close()
    return row


def run_layer_gpu(heap, cfg: Config) -> dict:
    """``run`` on the expert-parallel FP8 GPU layer (:class:`streamring.moe.gpu_layer.EPMoE`).

    Every rank builds the same random FP8 layer and keeps its own experts; its tokens go through
    the batch-ready path and the streamed path (``ring.*``, ``run.block_m``, ``nvshmem.progress``,
    ``nvshmem.transport``, ``run.straggler``), each captured once as a CUDA graph and replayed for
    every epoch with new tokens. Checked: streamed == batch bitwise, no ring violation, timeout or
    corrupt route, and the batch output against a float64 reference of sampled tokens (relative
    error below ``blocks.FAST_PATH_REL_TOL``).
    """
    import torch

    from .moe import blocks as B
    from .moe.gpu_layer import EPMoE
    from .moe.plan import PlanChoice

    R, me = heap.num_ranks, heap.rank
    shape = shape_from_config(cfg)
    if cfg.layer.weight_dtype != "fp8":
        raise ConfigError(f"run.gpu_path=fast needs layer.weight_dtype=fp8 (got {cfg.layer.weight_dtype!r}); "
                          f"use --set layer.weight_dtype=fp8, or run.gpu_path=host_verbs for the bf16 reference layer")
    if cfg.run.block_m not in (16, 32, 64, 128):
        raise ConfigError(f"run.block_m must be one of [16, 32, 64, 128] on the fast GPU path, got {cfg.run.block_m}")
    try:
        shape.validate(R)
    except ValueError as exc:
        raise ConfigError(f"layer: {exc}") from None
    tokens = per_rank(cfg.run.tokens_per_rank, R, "run.tokens_per_rank")
    dev = heap.device
    fw = B.FastWeights.random(shape, cfg.layer.seed, dev).local(me, R)
    full = B.FastWeights.random(shape, cfg.layer.seed, dev)  # every expert, for this rank's reference
    st = cfg.run.straggler
    straggler_ns = int(st.ms * 1e6) if st is not None and st.rank == me else 0
    bm = cfg.run.block_m
    plan = PlanChoice(chunk_tokens=cfg.ring.tokens_per_slot, num_slots=cfg.ring.num_slots, block_m=bm,
                      policy=cfg.nvshmem.progress)
    layers = {"batch": EPMoE(heap, shape, fw, tokens, PlanChoice.batch(bm), transport=cfg.nvshmem.transport,
                             deadline_s=cfg.wait_timeout_s, name="run-batch"),
              "stream": EPMoE(heap, shape, fw, tokens, plan, transport=cfg.nvshmem.transport,
                              deadline_s=cfg.wait_timeout_s, straggler_ns=straggler_ns,
                              producer_sms=cfg.nvshmem.producer_sms, inject=cfg.run.inject,
                              source_order=cfg.run.source_order, name="run-stream")}
    T = tokens[me]
    x_buf = torch.zeros(T, shape.hidden, dtype=torch.bfloat16, device=dev)
    outs = {m: torch.zeros_like(x_buf) for m in layers}
    row = dict(rank=me, tokens=T, chunks=layers["stream"].num_chunks, experts_hit=0, bitwise_equal=True,
               max_abs_stream_minus_batch=0.0, ref_ok=True, ref_max_abs_err=0.0, ref_max_err_ratio=0.0,
               ref_excluded=0, batch_wall_s=0.0, stream_wall_s=0.0, epochs=cfg.run.epochs, scheduler="blocks",
               rtol=B.FAST_PATH_REL_TOL, atol=0.0, path="fast", transport=layers["stream"].transport,
               policy=cfg.nvshmem.progress, gemm=layers["stream"].gemm, ring_errors={})
    graphs = {}
    for m, layer in layers.items():
        x_buf.copy_(make_tokens(cfg, me, 0, T).to(dev, torch.bfloat16))
        if layer.inject != "none":  # a mutated ring: the eager warm-up forward may already see its errors
            layer.enqueue(x_buf, outs[m], order="serialized")
            torch.cuda.synchronize(dev)
        else:
            layer.warm_up(x_buf, outs[m])
        heap.barrier()
        graphs[m] = layer.capture(x_buf, outs[m])
        heap.barrier()
    for ep in range(cfg.run.epochs):
        x = make_tokens(cfg, me, ep, T).to(dev, torch.bfloat16)
        x_buf.copy_(x)
        for m in ("batch", "stream"):
            if cfg.run.mode not in ("both", m):
                continue
            torch.cuda.synchronize(dev)
            heap.barrier()
            t0 = time.monotonic()
            graphs[m].replay()
            torch.cuda.synchronize(dev)
            row[f"{m}_wall_s"] += time.monotonic() - t0
        if cfg.run.mode == "both" and T:
            a, b = outs["stream"], outs["batch"]
            row["bitwise_equal"] &= bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
            row["max_abs_stream_minus_batch"] = max(row["max_abs_stream_minus_batch"],
                                                    float((a.float() - b.float()).abs().max()))
        if T:
            y = outs["batch" if cfg.run.mode != "stream" else "stream"]
            sample = torch.linspace(0, T - 1, min(T, 8), device=dev).round().long().unique()
            ref = B.reference_tokens_f64(x, full, shape, sample)
            rel = float((y[sample].double() - ref).norm() / ref.norm().clamp_min(1e-30))
            row["ref_max_abs_err"] = max(row["ref_max_abs_err"], float((y[sample].double() - ref).abs().max()))
            row["ref_max_err_ratio"] = max(row["ref_max_err_ratio"], rel / B.FAST_PATH_REL_TOL)
            row["ref_ok"] &= rel < B.FAST_PATH_REL_TOL
            row["experts_hit"] = max(row["experts_hit"], int(layers["batch"].my_idx[:T].unique().numel()))
    for m, layer in layers.items():
        status = layer.status()
        errors = {k: status[k] for k in ("violations", "timeouts", "bad_routes") if status[k]}
        if status["first_error"]:
            errors["first_error"] = status["first_error"]
        if errors:
            row["ring_errors"][m] = errors
            row["ref_ok"] = False
    del graphs
    torch.cuda.synchronize(dev)
    heap.barrier()
    for layer in layers.values():
        layer.close()
    return row
