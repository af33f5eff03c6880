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
from .ring.layout import RingLayout
from .ring.policies import PROGRESS_POLICIES, REFUSED_POLICIES

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
    if cfg.run.straggler is not None and cfg.run.straggler.rank >= R:
        raise ConfigError(f"run.straggler.rank must be in [0, {R}) (the job has {R} ranks), "
                          f"got {cfg.run.straggler.rank}")
    f = cfg.run.fault
    if f is not None:
        if not use_fast_gpu_path(cfg):
            raise ConfigError("run.fault is a fault of the expert-parallel GPU layer (--backend nvshmem, "
                              "layer.weight_dtype=fp8); the CPU backend's rank-failure test is stress.fault")
        if f.rank >= R:
            raise ConfigError(f"run.fault.rank must be in [0, {R}) (the job has {R} ranks), got {f.rank}")
        if f.epoch >= cfg.run.epochs:
            raise ConfigError(f"run.fault.epoch must be in [0, run.epochs={cfg.run.epochs}), got {f.epoch}")
        if cfg.run.mode == "batch":
            raise ConfigError("run.fault fails a streamed forward: run.mode must be 'both' or 'stream', got 'batch'")
    if cfg.run.launch_ahead and not use_fast_gpu_path(cfg):
        raise ConfigError("run.launch_ahead launches the consumer of the expert-parallel GPU layer ahead "
                          "(--backend nvshmem, layer.weight_dtype=fp8); the CPU layer's consumer runs in its forward")
    if cfg.run.source_order == "arrival":
        if not use_fast_gpu_path(cfg):
            raise ConfigError("run.source_order 'arrival' is a dispatch order of the expert-parallel GPU layer "
                              "(--backend nvshmem, layer.weight_dtype=fp8); elsewhere use 'rank' or 'ready'")
        most = max(max(per_rank(cfg.run.tokens_per_rank, R, "run.tokens_per_rank")), 1)
        chunks = -(-most // min(cfg.ring.tokens_per_slot, most))
        if cfg.ring.num_slots < chunks:
            raise ConfigError(f"run.source_order 'arrival' needs ring.num_slots >= the chunks of a forward "
                              f"({most} tokens / ring.tokens_per_slot={cfg.ring.tokens_per_slot} = {chunks}), "
                              f"got ring.num_slots={cfg.ring.num_slots}")
    if use_fast_gpu_path(cfg) and cfg.nvshmem.progress in REFUSED_POLICIES:
        # the expert-parallel layer refuses it (see moe/ep_buffer.py): say so before launch
        allowed = list(PROGRESS_POLICIES)
        raise ConfigError(f"nvshmem.progress={cfg.nvshmem.progress} is refused by the expert-parallel GPU layer: "
                          f"{REFUSED_POLICIES[cfg.nvshmem.progress]}; use one of {allowed}, or "
                          f"run.gpu_path=host_verbs")


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


def run_layer(heap: SymmetricHeap, cfg: Config, progress=None) -> dict:
    """Run ``cfg`` on this rank; returns this rank's row of the report.

    ``progress``: an object whose ``what`` is set to each step as it starts (rank 0's progress lines,
    :class:`streamring.host.progress.Heartbeat`); ``None``: nothing is told.
    """
    progress = progress if progress is not None else _Quiet()
    if use_fast_gpu_path(cfg):
        return run_layer_gpu(heap, cfg, progress)
    import torch

    from .moe import debug as moe_debug
    from .moe.layer import MoEBuffer
    from .moe.weights import MoEWeights
    from .moe.reference import reference_tolerance
    from .moe.tuning import MoETuning

    R, me = heap.num_ranks, heap.rank
    check_run_job(cfg, R)
    shape = shape_from_config(cfg)
    tokens = per_rank(cfg.run.tokens_per_rank, R, "run.tokens_per_rank")
    progress.what = "building the layer's weights and buffers"
    # Expert math on the rank's GPU with the NVSHMEM backend (torch ops), on the CPU otherwise.
    device = getattr(heap, "device", None) or "cpu"
    weights = MoEWeights.random(shape, seed=cfg.layer.seed, device=device)
    tuning = MoETuning(scheduler=cfg.run.scheduler, source_order=cfg.run.source_order)
    buf = MoEBuffer(heap, shape, num_slots=cfg.ring.num_slots, tokens_per_slot=cfg.ring.tokens_per_slot,
                    max_tokens_per_rank=max(max(tokens), 1), deadline_s=cfg.wait_timeout_s, tuning=tuning)
    moe_debug.inject(buf, cfg.run.inject)
    if cfg.run.straggler is not None and cfg.run.straggler.rank == me:
        moe_debug.set_producer_delay(buf, int(cfg.run.straggler.ms * 1e6))
    routing_fn = None if cfg.run.routing == "router" else synthetic_routing(cfg.run.routing, me, shape, R,
                                                                            cfg.layer.seed)
    rtol, atol = reference_tolerance(shape)
    row = dict(rank=me, tokens=tokens[me], chunks=0, experts_hit=0, bitwise_equal=True,
               max_abs_stream_minus_batch=0.0, ref_ok=True, ref_max_abs_err=0.0, ref_max_err_ratio=0.0,
               ref_excluded=0, batch_wall_s=0.0, stream_wall_s=0.0, epochs=cfg.run.epochs,
               scheduler=cfg.run.scheduler, rtol=rtol, atol=atol)
    for ep in range(cfg.run.epochs):
        x = make_tokens(cfg, me, ep, tokens[me]).to(device)
        routing = None if routing_fn is None else tuple(t.to(device) for t in routing_fn(x, torch.arange(len(x))))
        outs = _epoch_forwards(buf, cfg, x, weights, routing, row, progress, ep)
        # Independent float64 reference of the same math.
        progress.what = f"epoch {ep + 1} of {cfg.run.epochs}: the float64 reference of rank {me}'s {tokens[me]} tokens"
        _epoch_reference(row, outs, x, weights, shape, routing, buf.last_routing[0])
    buf.close()
    return row


def _epoch_forwards(buf, cfg: Config, x, weights, routing, row: dict, progress, ep: int) -> dict:
    """One epoch's forwards of ``run.mode`` on the CPU buffer (``{"batch": y, "stream": y}``), their wall times,
    chunks and experts hit in ``row``, and whether the two are bitwise equal."""
    from .moe.bitwise import same_bits

    outs = {}
    for mode in ("batch", "stream"):
        if cfg.run.mode not in ("both", mode):
            continue
        progress.what = (f"epoch {ep + 1} of {cfg.run.epochs}: the {'streamed' if mode == 'stream' else 'batch'} "
                         f"forward, {x.shape[0]} tokens on rank {row['rank']}")
        t0 = time.monotonic()
        outs[mode] = buf.forward(x, weights, streaming=(mode == "stream"), routing=routing)
        row[f"{mode}_wall_s"] += time.monotonic() - t0
        if mode == "stream":
            row["chunks"] = buf.last_stats.num_chunks
        row["experts_hit"] = max(row["experts_hit"], buf.last_stats.experts_hit)
    if "batch" in outs and "stream" in outs:
        diff = (outs["stream"] - outs["batch"]).abs().max().item() if x.shape[0] else 0.0
        row["max_abs_stream_minus_batch"] = max(row["max_abs_stream_minus_batch"], diff)
        row["bitwise_equal"] &= same_bits(outs["stream"], outs["batch"])  # bytes: -0.0 != +0.0
    return outs


def _epoch_reference(row: dict, outs: dict, x, weights, shape, routing, idx32) -> None:
    """Every output of one epoch against the float64 reference of the same math (``routing``: the given one, else
    the reference's own, a flipped near-tie excluded), the worst errors kept in ``row``."""
    from .moe.reference import compare_to_reference, reference_forward_f64

    if routing is None:
        y_ref, idx64, _ = reference_forward_f64(x, weights, shape, return_routing=True)
    else:
        y_ref, idx64 = reference_forward_f64(x, weights, shape, routing=routing), routing[0]
        idx32 = routing[0]
    for y in outs.values():
        cmp = compare_to_reference(y, y_ref, idx32, idx64, shape=shape)
        row["ref_ok"] &= bool(cmp.ok)
        row["ref_max_abs_err"] = max(row["ref_max_abs_err"], float(cmp.max_abs_err))
        row["ref_max_err_ratio"] = max(row["ref_max_err_ratio"], float(cmp.max_err_ratio))
        row["ref_excluded"] = max(row["ref_excluded"], int(cmp.num_excluded))


class _Quiet:
    """A progress holder that tells nothing."""

    what = ""


def run_layer_gpu(heap, cfg: Config, progress=None) -> dict:
    """``run`` on the expert-parallel FP8 GPU layer (:class:`streamring.moe.ep_buffer.EPBuffer`): every rank's experts
    of one random FP8 layer in ONE buffer, whose batch-ready and streamed paths run the same expert GEMMs (``run.gemm``,
    resolved once), each captured once as a CUDA graph and replayed every epoch with new tokens. Checked: streamed ==
    batch bitwise, no ring violation, timeout or corrupt route, sampled tokens against a float64 reference
    (relative error within ``reference_tolerance(shape, fp8_blocks=True)``)."""
    import torch

    from .moe.weights import MoEWeights

    progress = progress if progress is not None else _Quiet()
    R, me = heap.num_ranks, heap.rank
    shape, tokens = _fast_path_job(cfg, R)
    dev = heap.device
    progress.what = "building the buffer and capturing the first forward of each path"
    full = MoEWeights.random_fp8(shape, cfg.layer.seed, dev)  # every expert, for this rank's reference
    st = cfg.run.straggler
    buf = _ep_buffer_of(heap, cfg, shape, max(max(tokens), 1))
    layer = buf.prepare_weights(full)
    T = tokens[me]
    x_buf = torch.zeros(T, shape.hidden, dtype=torch.bfloat16, device=dev)
    outs = {m: torch.zeros_like(x_buf) for m in ("batch", "stream")}
    row = _gpu_row(buf, cfg, me, T)
    # Every host barrier has a deadline, so a dead or stopped peer ends this rank's run with an error. It
    # outlasts a peer's slowest forward (every device wait ends within wait_timeout_s; the host gives a
    # forward 2 x wait_timeout_s + 5 s): a peer whose forward ran into a deadline is late, not dead.
    barrier = lambda: heap.barrier(time.monotonic() + 2 * cfg.wait_timeout_s + 10)  # noqa: E731
    routed: set = set()  # the experts this rank's tokens were routed to, over every epoch
    x_buf.copy_(make_tokens(cfg, me, 0, T).to(dev, torch.bfloat16))
    graphs, failed = _capture_paths(buf, layer, x_buf, outs, cfg.run.launch_ahead, barrier)
    if st is not None and st.rank == me:
        buf.instrument.set_delay(int(st.ms * 1e6))
    fault = cfg.run.fault if cfg.run.fault is not None and cfg.run.fault.rank == me else None
    for ep in range(cfg.run.epochs if failed is None else 0):
        x = make_tokens(cfg, me, ep, T).to(dev, torch.bfloat16)
        x_buf.copy_(x)
        for m in ("batch", "stream"):
            if cfg.run.mode not in ("both", m):
                continue
            torch.cuda.synchronize(dev)
            barrier()
            progress.what = f"epoch {ep + 1} of {cfg.run.epochs}: the {'streamed' if m == 'stream' else 'batch'} replay"
            if m == "stream" and fault is not None and fault.epoch == ep:
                fail_this_rank(fault.kind, buf, graphs[m], cfg.wait_timeout_s)
            t0 = time.monotonic()
            replay_checked(buf, graphs[m])
            row[f"{m}_wall_s"] += time.monotonic() - t0
        if T:
            _check_gpu_epoch(row, outs, x, full, shape, cfg.run.mode)
            routed.update(int(e) for e in buf.last_routing[0].unique().tolist() if e >= 0)
    # the experts of this rank that computed a row: those any rank's tokens were routed to (as on the CPU layer)
    everyone = set().union(*heap.allgather_obj(sorted(routed)))
    row["experts_hit"] = len(everyone & set(buf.local_experts))
    _record_ring_errors(row, buf.status(), failed)
    del graphs
    torch.cuda.synchronize(dev)
    barrier()
    buf.close()
    return row


def _gpu_row(buf, cfg: Config, rank: int, tokens: int) -> dict:
    """This rank's report row of the GPU layer, before its epochs."""
    from .moe.reference import reference_tolerance

    rtol, atol = reference_tolerance(buf.shape, fp8_blocks=True)
    return dict(rank=rank, tokens=tokens, chunks=buf.paths["stream"].num_chunks, experts_hit=0, bitwise_equal=True,
                max_abs_stream_minus_batch=0.0, ref_ok=True, ref_max_abs_err=0.0, ref_max_err_ratio=0.0,
                ref_excluded=0, batch_wall_s=0.0, stream_wall_s=0.0, epochs=cfg.run.epochs, scheduler="blocks",
                rtol=rtol, atol=atol, path="fast", transport=buf.transport,
                policy=cfg.nvshmem.progress, gemm=buf.gemm, gemm_batch=buf.gemm, gemm_stream=buf.gemm,
                launch_ahead=cfg.run.launch_ahead, ring_errors={})


def _capture_paths(buf, layer, x_buf, outs: dict, launch_ahead: bool, barrier) -> tuple:
    """Each path's first (eager) forward, then its CUDA graph: ``(graphs by path, the first error or None)``. A ring
    error in a first forward (a mutated ring: expected there) stops the captures; it is reported with the row."""
    graphs, failed = {}, None
    for m in ("batch", "stream"):
        try:
            buf.forward(x_buf, layer, streaming=(m == "stream"), out=outs[m])
        except RuntimeError as exc:
            failed = str(exc)
            break
        barrier()
        graphs[m] = buf.capture(x_buf, layer, outs[m], streaming=(m == "stream"),
                                launch_ahead=launch_ahead and m == "stream")
        barrier()
    return graphs, failed


def _check_gpu_epoch(row: dict, outs: dict, x, full, shape, mode: str) -> None:
    """One epoch's replays: streamed against batch bitwise (``mode`` both), and the output of sampled tokens against
    the float64 reference within ``reference_tolerance(shape, fp8_blocks=True)`` (relative, by norm); the worst in
    ``row``."""
    import torch

    from .moe.reference import reference_forward_f64, reference_tolerance

    T = x.shape[0]
    if mode == "both":
        a, b = outs["stream"], outs["batch"]
        row["bitwise_equal"] &= bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
        row["max_abs_stream_minus_batch"] = max(row["max_abs_stream_minus_batch"],
                                                float((a.float() - b.float()).abs().max()))
    y = outs["batch" if mode != "stream" else "stream"]
    sample = torch.linspace(0, T - 1, min(T, 8), device=x.device).round().long().unique()
    ref = reference_forward_f64(x, full, shape, tokens=sample)
    rtol = reference_tolerance(shape, fp8_blocks=True)[0]
    rel = float((y[sample].double() - ref).norm() / ref.norm().clamp_min(1e-30))
    row["ref_max_abs_err"] = max(row["ref_max_abs_err"], float((y[sample].double() - ref).abs().max()))
    row["ref_max_err_ratio"] = max(row["ref_max_err_ratio"], rel / rtol)
    row["ref_ok"] &= rel < rtol


def _record_ring_errors(row: dict, status: dict, failed) -> None:
    """What the buffer's status recorded (and a first forward's error) into ``row["ring_errors"]``; any makes the
    row fail."""
    errors = {k: status[k] for k in ("violations", "timeouts", "bad_routes", "bad_counts") if status[k]}
    if status["first_error"]:
        errors["first_error"] = status["first_error"]
    if failed is not None:
        errors["first_forward"] = failed[:300]
        row["bitwise_equal"] = False
    if errors:
        row["ring_errors"]["layer"] = errors
        row["ref_ok"] = False


def _fast_path_job(cfg: Config, R: int) -> tuple:
    """The fast GPU path's checks of ``cfg`` (errors name the field); returns ``(shape, tokens per rank)``."""
    check_run_job(cfg, R)
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
    return shape, per_rank(cfg.run.tokens_per_rank, R, "run.tokens_per_rank")


def _ep_buffer_of(heap, cfg: Config, shape, max_tokens: int):
    """The run's :class:`~streamring.moe.ep_buffer.EPBuffer`: its sizes, GEMMs and tuning from ``cfg``; with a
    protocol mutation (``run.inject``), a straggler (``run.straggler``) or a fault (``run.fault``: a held-back
    producer) the test and benchmark instrument is attached (before any graph is captured) and set."""
    from .moe import debug as moe_debug
    from .moe.ep_buffer import EPBuffer
    from .moe.instrument import attach
    from .moe.tuning import EPTuning

    tuning = EPTuning(block_m=cfg.run.block_m, policy=cfg.nvshmem.progress, source_order=cfg.run.source_order,
                      transport=cfg.nvshmem.transport, producer_sms=cfg.nvshmem.producer_sms)
    buf = EPBuffer(heap, shape, max_tokens_per_rank=max_tokens, num_slots=cfg.ring.num_slots,
                   tokens_per_slot=min(cfg.ring.tokens_per_slot, max_tokens), gemm=cfg.run.gemm,
                   deadline_s=cfg.wait_timeout_s, tuning=tuning, name="run")
    if cfg.run.inject != "none" or cfg.run.straggler is not None or cfg.run.fault is not None:
        attach(buf)
        moe_debug.inject(buf, cfg.run.inject)
    return buf


def replay_checked(buf, graph) -> None:
    """Replay one captured forward of ``buf`` and wait for it.

    A buffer with a deliberate protocol mutation (``run.inject``) expects device errors: its replay is
    only waited for, and its errors go into the report at the end. Any other raises at once
    (:meth:`EPBuffer.replay <streamring.moe.ep_buffer.EPBuffer.replay>`): a device wait that timed out
    means a peer is dead, stopped or stuck, and nothing collective may follow. A SIGTERM from the
    launcher (torchrun ends the other workers this way when one dies) is held until the forward has
    ended (every device wait has a deadline), so this rank still says what it waited for; the run then
    stops with that error, or with the SIGTERM.
    """
    import torch

    if buf.instrument is not None and buf.instrument.inject != "none":
        graph.replay()
        torch.cuda.synchronize(buf.dev)
        return
    with _sigterm_held() as held:
        buf.replay(graph)
    if held:
        raise KeyboardInterrupt("SIGTERM")


class _sigterm_held:
    """Context manager: a SIGTERM inside is recorded (truthy afterwards) instead of ending the process."""

    def __enter__(self):
        import signal
        import threading

        self.got = []
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, lambda signum, frame: self.got.append(signum))
        return self.got

    def __exit__(self, *exc):
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
        return False


def fail_this_rank(kind: str, buf, graph, wait_timeout_s: float) -> None:
    """``run.fault`` on this rank, right before its streamed forward: ``kill`` launches the forward
    with the producer held back on the device past the peers' deadlines, then SIGKILLs this process
    (it dies while its peers wait for its first chunk); ``hang`` SIGSTOPs this process before it
    launches anything. The hold is bounded (twice the deadline plus 5 s, the peers' host deadline):
    a GPU shared under MPS may let a killed client's running kernel finish before it frees it."""
    import os
    import signal
    import sys

    print(f"rank {buf.me}: run.fault: {'SIGKILL' if kind == 'kill' else 'SIGSTOP'} of this rank (pid "
          f"{os.getpid()}) in the streamed forward", file=sys.stderr, flush=True)
    if kind == "kill":
        buf.instrument.set_delay(int((2 * wait_timeout_s + 5) * 1e9))
        graph.replay()
        os.kill(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGSTOP)
