"""What the benchmarks share: the DeepSeek-V3 MoE shape, the H200's nominal peaks, logging, inputs and
the timing helpers (CUDA graphs replayed interleaved, timed across PEs).

Every benchmark that measures "the DeepSeek-V3 layer" takes its shape from :func:`dsv3_shape`, so the
figures of ``bench.gemm``, ``bench.gemm_launches``, ``bench.triton_gemm_launch``, ``bench.routing``,
``bench.decode``, ``bench.ep_layer`` and the tests that quote them are of one shape. GEMM-specific helpers
(the benchmark's input case, CUTLASS variant specs, the heuristic table, the whole batch layer) are in
:mod:`bench.gemm_lib`.

Importing this module needs torch only; the Triton quantizer is imported by :func:`uniform_inputs` when
called.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench.skew import WARM_REPLAYS
from streamring.moe.math import MoEShape

FP8 = torch.float8_e4m3fn
PEAK_FP8_TFLOPS = 1979.0  # H200 dense FP8
HBM_GBS = 4800.0  # H200 nominal
T0 = time.monotonic()

#: DeepSeek-V3's routed experts: 256 experts in 8 groups, top-8 from the best 4 groups
DSV3_NUM_EXPERTS = 256
DSV3_GROUPS = 8
DSV3_TOPK_GROUP = 4


def log(*a) -> None:
    """Print with the seconds since this module was imported, flushed (a device run's log is read live)."""
    print(f"[{time.monotonic() - T0:7.1f}s]", *a, flush=True)


def dsv3_shape(block_m: int, num_experts: int = DSV3_NUM_EXPERTS) -> MoEShape:
    """DeepSeek-V3's MoE layer: hidden 7168, intermediate 2048, top-8, grouped routing
    (``deepseek_v3`` router, routed scaling factor 2.5, normalised top-k weights), FP8 weights with
    128x128 block scales, ``block_m`` rows per expert block.

    ``num_experts`` other than 256 (a smaller model of the same layer, e.g. one that fits a test) scales
    the expert groups along: ``n_group = max(1, 8 * num_experts // 256)`` (one group per 32 experts,
    rounded down, at least one) and ``topk_group = min(4, n_group)``. The shape is validated: a
    ``num_experts`` that ``n_group`` does not divide (e.g. 100: 3 groups), or below top-8's 8 experts, is
    a ValueError.
    """
    n_group = max(1, DSV3_GROUPS * num_experts // DSV3_NUM_EXPERTS)
    return MoEShape(hidden=7168, intermediate=2048, num_experts=num_experts, topk=8, router="deepseek_v3",
                    n_group=n_group, topk_group=min(DSV3_TOPK_GROUP, n_group), routed_scaling_factor=2.5,
                    norm_topk_prob=True, weight_dtype="fp8", block_m=block_m).validate()


# ----------------------------------------------------------------------------------------------
# inputs and outputs
# ----------------------------------------------------------------------------------------------
def uniform_inputs(T: int, shape: MoEShape, gen: torch.Generator, dev) -> tuple:
    """One input set of ``T`` tokens: ``(topk_idx, topk_w, x_q, x_sf)``, each token's ``topk`` distinct
    experts drawn uniformly (as peer benchmarks route), weights normalised and scaled as the router's,
    activations N(0, 1) quantized to FP8 with 1x128 scales."""
    from streamring.device import moe_triton as K

    E, Kk, H = shape.num_experts, shape.topk, shape.hidden
    idx = torch.rand(T, E, generator=gen, device=dev).argsort(dim=1)[:, :Kk].contiguous()
    w = torch.rand(T, Kk, generator=gen, device=dev) + 0.1
    w = (w / w.sum(dim=1, keepdim=True) * shape.routed_scaling_factor).float().contiguous()
    x = torch.randn(T, H, generator=gen, device=dev).to(torch.bfloat16)
    q = torch.empty(T, H, dtype=FP8, device=dev)
    sf = torch.empty(T, H // 128, dtype=torch.float32, device=dev)
    K.quant_rows(x, q, sf)
    return idx, w, q, sf


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of its width (NaN patterns compare equal to themselves); the same width,
    so strided views (DeepGEMM's MN-major scales) can be viewed too, where a byte view could not."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def poison(*ts) -> None:
    """Fill outputs with 0xFF bytes (NaN in e4m3, bf16 and float32; also FP8 data kept as uint8) so a
    kernel that stores nothing cannot pass a comparison."""
    for t in ts:
        bits(t).fill_(255 if t.element_size() == 1 else -1)


# ----------------------------------------------------------------------------------------------
# timing on one GPU
# ----------------------------------------------------------------------------------------------
class GraphCall:
    """A captured graph, called like the function it was captured from, which it keeps: the graph
    reads and writes the buffers that function's closure holds (a layer's producer and scratch
    tensors) but holds no reference to them, so without ``fn`` they could be freed while the graph
    lives, the allocator would hand their memory to buffers made later, and a replay would read and
    write those instead (an illegal address at best)."""

    def __init__(self, graph, fn):
        self.graph, self.fn = graph, fn

    def __call__(self):
        self.graph.replay()


def capture(fn, eager: bool = False):
    """A CUDA graph of ``fn`` (after an eager warm-up that compiles) as a :class:`GraphCall`; falls
    back to eager on failure. ``eager`` (``--no-graphs``, a diagnosis: is a fault a graph replay's?):
    ``fn`` itself after the warm-up. Returns ``(callable, "graph" | "eager")``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    if eager:
        return fn, "eager"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            fn()
        torch.cuda.synchronize()
        return GraphCall(g, fn), "graph"
    except Exception as exc:  # noqa: BLE001 - recorded; eager timing still measures the kernel
        torch.cuda.synchronize()
        log(f"    graph capture failed ({type(exc).__name__}: {str(exc)[:160]}); timing eagerly")
        return fn, "eager"


def event_times(calls, *, sync_each: bool = False) -> list:
    """``[(key, ms)]``: each ``(key, fn)`` of ``calls`` called in order between two CUDA events on the current
    stream; one synchronisation after the last (back to back), or after every call with ``sync_each`` (each
    call timed alone)."""
    ev = []
    for k, fn in calls:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        if sync_each:
            torch.cuda.synchronize()
        ev.append((k, a, b))
    torch.cuda.synchronize()
    return [(k, a.elapsed_time(b)) for k, a, b in ev]


def time_interleaved(fns: dict, sets: int, load, replays: int) -> dict:
    """``{name: {median_ms, min_ms, max_ms, n}}``: for each of ``sets`` input sets (``load(s)`` fills
    them), every callable once, synchronised (a failing kernel is named before the timing), then
    ``replays`` rounds A B C A B C ... with CUDA events around each call (clock drift reaches all alike)."""
    times = {k: [] for k in fns}
    for s in range(sets):
        load(s)
        for k, fn in fns.items():
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:
                raise RuntimeError(f"{k}: its first timed call failed: {type(exc).__name__}: {exc}") from exc
        for k, ms in event_times([(k, fn) for _ in range(replays) for k, fn in fns.items()]):
            times[k].append(ms)
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "n": len(v)}
            for k, v in times.items()}


# ----------------------------------------------------------------------------------------------
# timing across PEs
# ----------------------------------------------------------------------------------------------
class Reported:
    """A captured graph of an EPBuffer whose every replay reports its launch to the buffer's instrument, from which a
    host-held delay (``bench.ep_layer --delay-by host``: :meth:`~streamring.moe.instrument.Instrument.hold_with_host`)
    runs; without one it is the graph."""

    def __init__(self, buf, graph):
        self.buf, self.graph = buf, graph

    def replay(self) -> None:
        self.buf.instrument.rearm()  # the previous replay has ended (the callers synchronise between replays)
        self.buf.instrument.launching()  # the delay counts from the launch's start (the GPU starts before it returns)
        self.graph.replay()
        self.buf.instrument.launched()


def timed_rounds(heap, calls, replays: int, warm: int = WARM_REPLAYS) -> dict:
    """``{name: [ms]}``: per replay ``i`` (``warm`` warm-ups first, not kept), every ``(name, fn, before)``
    of ``calls`` in turn, the order rotated by ``i`` so that none always runs first: ``before(i)`` if
    given (e.g. this replay's producer delay), sync, host barrier, events around ``fn()``, sync; the
    slowest PE's ms (``heap``: a :class:`~streamring.device.nvshmem.NvshmemHeap`, whose barrier and
    allgather span the PEs). The calls alternate replay by replay, so clock and thermal drift reach them
    alike and their ratio is a paired one."""
    dev = heap.device
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {name: [] for name, _, _ in calls}
    for i in range(warm + replays):
        k = i % len(calls)
        for name, fn, before in calls[k:] + calls[:k]:
            if before is not None:
                before(i)
            torch.cuda.synchronize(dev)
            heap.barrier()
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize(dev)
            all_ms = heap.allgather_obj(e0.elapsed_time(e1))
            if i >= warm:
                out[name].append(max(all_ms))
    return out


def timed(heap, fn, replays: int, warm: int = WARM_REPLAYS, before=None) -> list[float]:
    """:func:`timed_rounds` of one call: the slowest PE's ms per replay."""
    return timed_rounds(heap, [("fn", fn, before)], replays, warm)["fn"]


def stats(ms: list[float]) -> dict:
    """Median, 10th and 90th percentile of a list of times in ms."""
    return {"median_ms": statistics.median(ms), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "n": len(ms)}
