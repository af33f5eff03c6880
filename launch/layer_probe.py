"""Which whole-layer forward fails on the GPU, and in which mode (a diagnostic for bench.gemm's layer rows).

For the GEMM implementations given (comma-separated) and a token count, in this process: each one's
batch layer as ``bench.gemm`` builds it (``blocks.moe_forward`` after the producer), eager twice and
captured in a CUDA graph, one after another; then every graph replayed 3 times in turn, synchronising
after each step and printing ``layer_probe: T=<T> <impl> <step>: ok | <error>``; then each graph's
replay time (median of REPLAYS, default 20, each synchronised). A CUDA error is sticky: give one
implementation per process to see each alone, several to see them together.

    python3 launch/layer_probe.py deep_gemm 8192 [REPLAYS]
    python3 launch/layer_probe.py cutlass,deep_gemm 8192
"""

import statistics
import sys
import time

import torch

from bench import gemm as BG
from streamring.device import deep_gemm_ops as DG
from streamring.moe import blocks as B
from streamring.moe import gemm_choice as GC

impls, T = sys.argv[1].split(","), int(sys.argv[2])
REPLAYS = int(sys.argv[3]) if len(sys.argv) > 3 else 20
dev = torch.device("cuda")
shape = BG.dsv3_shape()
fw = B.FastWeights.random(shape, 7, dev)
x = torch.randn(T, shape.hidden, device=dev).to(torch.bfloat16)


def make(impl):
    """The batch layer's forward for ``impl``, as bench.gemm's layer rows build it."""
    choice = GC.choose_layer(T * shape.topk / shape.num_experts, shape.hidden, shape.intermediate, {impl: ""},
                             GC.load_table())
    bm = DG.BLOCK_M if impl == "deep_gemm" else 64
    fwd, out, bc = BG.layer_forward(impl, choice, bm, x, shape, fw, dev)
    print(f"layer_probe: {impl} T={T}: choice {choice.l1.key} / {choice.l2.key}, block_m {bm}", flush=True)
    return fwd, out, bc


def step(name, fn):
    t0 = time.monotonic()
    try:
        fn()
        torch.cuda.synchronize()
        print(f"layer_probe: T={T} {name}: ok ({time.monotonic() - t0:.2f} s)", flush=True)
        return True
    except Exception as exc:  # noqa: BLE001 - the point is to print it
        print(f"layer_probe: T={T} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return False


# every implementation set up, run eagerly and captured first (as bench.gemm's layer rows), then replayed
graphs, outs, refs, keep = {}, {}, {}, []
ok = True
for impl in impls:
    fwd, out, held = make(impl)
    keep.append(held)
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
for impl, g in graphs.items():
    if not ok:
        break
    print(f"layer_probe: {impl} T={T} graph == eager bitwise: {torch.equal(outs[impl], refs[impl])}", flush=True)
    ms = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    print(f"layer_probe: {impl} T={T} graph replay median {statistics.median(ms):.3f} ms (min {min(ms):.3f}, "
          f"max {max(ms):.3f}, n {len(ms)})", flush=True)
sys.exit(0 if ok else 1)
