"""The whole batch layer on one GPU per GEMM implementation, in one process: each step checked, graph
replays interleaved and timed, optionally the kernels of one forward (the layer's phases).

For the GEMM implementations given (comma-separated) and a token count, in this process: each one's
batch layer as ``bench.gemm`` builds it (``blocks.moe_forward`` after the producer), eager twice and
captured in a CUDA graph, one after another; then every graph replayed 3 times in turn, synchronising
after each step and printing ``layer_replay: T=<T> <impl> <step>: ok | <error>``; then each graph's
replay time (median of REPLAYS, default 20, interleaved across the graphs, each synchronised). A CUDA error is sticky: give one
implementation per process to see each alone, several to see them together. With
``LAYER_REPLAY_KERNELS=1`` it also prints each implementation's kernels per forward (torch.profiler over 3
eager forwards: device time per kernel name), the phases of the layer.

    python3 -m bench.layer_replay deep_gemm 8192 [REPLAYS]
    python3 -m bench.layer_replay cutlass,deep_gemm 8192
    python3 -m bench.layer_replay deep_gemm:indices 8192   # DeepGEMM without the psum layout (m_indices)

``bash launch/gemm_bench.sh layer`` runs it (DeepGEMM, CUTLASS and Triton at 8192 tokens).
"""

import os
import statistics
import sys
import time

import torch

from bench.common import dsv3_shape, event_times
from bench.gemm_lib import layer_forward
from streamring.gemm import deep_gemm as DG
from streamring.moe.weights import MoEWeights
from streamring.gemm import choice as GC

impls, T = sys.argv[1].split(","), int(sys.argv[2])
REPLAYS = int(sys.argv[3]) if len(sys.argv) > 3 else 20
dev = torch.device("cuda")
shape = dsv3_shape(64)
fw = MoEWeights.random_fp8(shape, 7, dev).fp8_blocks()
x = torch.randn(T, shape.hidden, device=dev).to(torch.bfloat16)


def make(name):
    """The batch layer's forward for ``name`` (an implementation; ``deep_gemm:indices`` is DeepGEMM with
    ``m_indices`` in every call instead of the psum layout), as bench.gemm's layer rows build it."""
    impl, _, mode = name.partition(":")
    choice = GC.choose_layer(T * shape.topk / shape.num_experts, shape.hidden, shape.intermediate, {impl: ""},
                             GC.load_table())
    bm = DG.BLOCK_M if impl == "deep_gemm" else 64
    fwd, out, bc = layer_forward(impl, choice, bm, x, shape, fw, dev)
    if mode == "indices":
        bc.experts("deep_gemm").allow_psum = False
    elif mode:
        raise SystemExit(f"layer_replay: {name!r}: the only mode is deep_gemm:indices")
    print(f"layer_replay: {name} T={T}: choice {choice.l1.key} / {choice.l2.key}, block_m {bm}", flush=True)
    return fwd, out, bc


def step(name, fn):
    t0 = time.monotonic()
    try:
        fn()
        torch.cuda.synchronize()
        print(f"layer_replay: T={T} {name}: ok ({time.monotonic() - t0:.2f} s)", flush=True)
        return True
    except Exception as exc:  # noqa: BLE001 - the point is to print it
        print(f"layer_replay: T={T} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return False


# every implementation set up, run eagerly and captured first (as bench.gemm's layer rows), then replayed
graphs, outs, refs, keep, fwds = {}, {}, {}, [], {}
ok = True
for impl in impls:
    fwd, out, held = make(impl)
    keep.append(held)
    fwds[impl] = fwd
    ok = ok and step(f"{impl} eager 1", fwd) and step(f"{impl} eager 2", fwd)
    if not ok:
        break
    refs[impl], outs[impl] = out.clone(), out
    g = torch.cuda.CUDAGraph()

    def cap(g=g, fwd=fwd):
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            fwd()

    ok = step(f"{impl} capture", cap)
    graphs[impl] = g
for i in range(3):
    for impl, g in graphs.items():
        ok = ok and step(f"{impl} replay {i}", g.replay)
if ok:
    for impl in graphs:
        print(f"layer_replay: {impl} T={T} graph == eager bitwise: {torch.equal(outs[impl], refs[impl])}", flush=True)
    # replays interleaved (A B A B ...), each timed alone, so that clock drift reaches every graph alike
    ms = {impl: [] for impl in graphs}
    for _ in range(REPLAYS):
        for impl, t in event_times([(impl, g.replay) for impl, g in graphs.items()], sync_each=True):
            ms[impl].append(t)
    for impl, v in ms.items():
        print(f"layer_replay: {impl} T={T} graph replay median {statistics.median(v):.3f} ms (min {min(v):.3f}, "
              f"max {max(v):.3f}, n {len(v)})", flush=True)
if ok and os.environ.get("LAYER_REPLAY_KERNELS"):
    # where a forward's time goes: every kernel of 3 eager forwards per implementation (the same kernels
    # the graph replays), device time per kernel name, largest first
    from torch.profiler import ProfilerActivity, profile

    for impl, fwd in fwds.items():
        fwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fwd()
            torch.cuda.synchronize()
        per = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name] = per.get(ev.name, 0.0) + ev.time_range.elapsed_us() / 3e3  # us -> ms per forward
        tot = sum(per.values())
        print(f"layer_replay: {impl} T={T} kernels per forward (eager, device time; sum {tot:.3f} ms):", flush=True)
        for name, t in sorted(per.items(), key=lambda kv: -kv[1])[:14]:
            print(f"layer_replay:   {t:8.3f} ms  {100 * t / tot:5.1f} %  {name[:110]}", flush=True)
for held, impl in zip(keep, impls):
    dgx = held.made_experts("deep_gemm")  # held: the form's BlockConsumer
    if ok and dgx is not None:
        print(f"layer_replay: {impl} psum layout used: {dgx.last_used_psum}; status: {DG.status_text(dgx.status())}",
              flush=True)
        ok = ok and dgx.status() == 0
if ok and "deep_gemm" in outs and "deep_gemm:indices" in outs:
    same = torch.equal(outs["deep_gemm"], outs["deep_gemm:indices"])
    print(f"layer_replay: deep_gemm (psum) == deep_gemm:indices bitwise: {same}", flush=True)
    ok = ok and same
sys.exit(0 if ok else 1)
