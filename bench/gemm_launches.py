"""Per-chunk expert-GEMM launches against one launch over the same blocks, on one GPU.

Issue 20 asks the CUTLASS consumer either to claim its tiles from the device queue (as the Triton
persistent consumer does) or to show, with numbers, that a bounded number of launches per forward
is equivalent. A queue-claiming tile scheduler runs the same tiles as the per-chunk launches: the
chunks' ready blocks. What it changes is what lies *between* the launches: each launch's last wave
(its tail), the launch gaps and the L1 -> L2 boundary of every chunk. This script times, for each
GEMM implementation:

* ``per_chunk``: the blocks of a streamed forward of ``C`` chunks (``C`` dispatches, then the seal),
  computed as the per-chunk consumer computes them: one call per chunk, the last chunk's full blocks
  together with the seal's partial blocks (as ``EPBuffer`` computes them):
  ``C`` L1 + ``C`` L2 launches (CUTLASS: plus its SwiGLU kernel each);
* ``one_launch``: the SAME blocks (the same ready list) in ONE call: the same tiles with no launch
  boundary between the chunks, which is what a scheduler claiming them from a queue would run
  (the tile order inside the call is the library's; it is not a lower bound on time);
* ``batch``: one dispatch of all tokens and the seal, one call (the batch-ready path's blocks, each
  expert's full blocks side by side in the ready list, every partial block after them);
* ``per_chunk_by_expert`` and ``batch_by_expert``: the same as ``per_chunk`` and ``batch`` with the seal's
  ``call_from`` (what ``EPBuffer`` does): the range of the call that has the partial blocks laid out expert by
  expert, each expert's partial block right after its full blocks.

DeepGEMM (``deep_gemm``, when it imports) runs on 128-row blocks (its contiguous layout); its
calls over a range take ``m_indices``, the batch call the psum layout.

``per_chunk / one_launch`` is therefore what bounded launches cost against one launch of the same
tiles; ``batch_by_expert / batch`` and ``per_chunk_by_expert / per_chunk`` what reading each expert's
weights in one run of tiles in the sealing call saves; ``one_launch / batch`` what the chunk order of the
same blocks costs (an expert's blocks apart in the ready list: smaller CUTLASS groups, weight tiles less
often shared in L2), which no scheduler over these blocks removes. Before any timing every form's outputs and intermediates are
filled with NaN and it is run: ``per_chunk`` must store ``one_launch``'s row for every (token, k) route
bit for bit, and so must ``batch``.

Uniform top-8 routing (``bench.common.uniform_inputs``), DeepSeek-V3 shape, ``--block-m`` rows per
block. Each form is one CUDA graph; for each of ``--sets`` input sets the graphs are replayed
``--replays`` times interleaved (``bench.common.time_interleaved``); medians. The CUTLASS variants
are what ``gemm="cutlass"`` takes at that size from the committed table (``gemm.choice``).

    python -m bench.gemm_launches --tokens 1024,4096,8192 --chunks 2,4,8 \
        --json docs/results/gemm-launches-<date>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.common import capture, dsv3_shape, log, poison, time_interleaved, uniform_inputs
from bench.gemm_lib import deep_gemm_first_call
from streamring.gemm import cutlass as CG
from streamring.gemm import deep_gemm as DG
from streamring.moe import blocks as B
from streamring.moe.weights import MoEWeights
from streamring.moe.bitwise import same_bits
from streamring.moe.grid_bounds import seal_bound
from streamring.gemm import choice as GC

IMPLS = ("cutlass", "triton", "deep_gemm")


class Forward:
    """The blocks of one forward of ``T`` tokens dispatched in ``chunks`` chunks (1: the batch path)."""

    def __init__(self, T: int, chunks: int, shape, block_m: int, impl: str, choice, dev, *, by_expert: bool = False):
        self.T, self.chunks, self.impl = T, chunks, impl
        self.bc = B.BlockConsumer(shape, T, chunks, DG.BLOCK_M if impl == "deep_gemm" else block_m, dev,
                                  seal_by_expert=by_expert)
        if impl != "triton":
            GC.setup_consumer(self.bc, choice, staging_y=False)
        self.bounds = [(c * T // chunks, (c + 1) * T // chunks) for c in range(chunks)]

    def load(self, inputs) -> None:
        """Dispatch ``inputs`` chunk by chunk, then seal (not timed: the GEMMs only read the block state); with
        ``by_expert`` the last per-chunk call's range laid out expert by expert (``BlockConsumer``'s
        ``seal_by_expert``, ``seal``'s ``call_from``)."""
        idx, w, q, sf = inputs
        bc = self.bc
        bc.begin()
        for c, (a, b) in enumerate(self.bounds):
            bc.dispatch(c, idx[a:b], w[a:b], q[a:b], sf[a:b], a)
        bc.seal(self.chunks, call_from=self.chunks - 1)

    def steps(self) -> list[tuple[int, int, int]]:
        """``(lo_index, hi_index, max_items)`` of the per-chunk calls: one per chunk, the last one
        also covering the seal's partial blocks."""
        bc, C = self.bc, self.chunks
        out = [(c, c + 1, bc.max_ready(b - a)) for c, (a, b) in enumerate(self.bounds[:-1])]
        a, b = self.bounds[-1]
        out.append((C - 1, C + 1, seal_bound(bc.max_ready(b - a), bc.shape.num_experts, bc.max_blocks)))
        return out

    def call(self, lo: int, hi: int, max_items: int, fw) -> None:
        self.bc.compute(lo, hi, max_items, fw, impl=self.impl)

    def per_chunk(self, fw):
        return lambda: [self.call(lo, hi, m, fw) for lo, hi, m in self.steps()]

    def one_launch(self, fw):
        return lambda: self.call(0, self.chunks + 1, self.bc.max_blocks, fw)


def outputs(fwd: Forward) -> list:
    """Every buffer a form writes: ``y`` and the intermediates L2 reads (``h1``, its scales, CUTLASS's and
    DeepGEMM's L1 outputs and scale copies), so that a form which skips blocks cannot pass on another
    form's leftovers."""
    bc = fwd.bc
    out = [bc.y, bc.h1, bc.h1_sf]
    for helper, names in ((bc.made_experts("cutlass"), ("gu", "h1_sf_w")),
                          (bc.made_experts("deep_gemm"), ("gu", "h1_sf_w", "h1_sf_w_mn", "y_scratch"))):
        if helper is not None:
            out += [t for t in (getattr(helper, n, None) for n in names) if t is not None]
    return out


def run_poisoned(fwd: Forward, run) -> None:
    poison(*outputs(fwd))
    run()
    if fwd.bc.y.is_cuda:
        torch.cuda.synchronize()


def by_route(fwd: Forward) -> torch.Tensor:
    """``y``'s row of every (token, k) route, in route order (comparable across block layouts)."""
    bc = fwd.bc
    return bc.y[bc.tok_row[: fwd.T * bc.shape.topk]]


def same_output(fwd: Forward, run, ref: torch.Tensor) -> bool:
    """Whether ``run`` (outputs poisoned first) gives every route the row ``ref`` holds, bit for bit."""
    run_poisoned(fwd, run)
    return same_bits(by_route(fwd), ref)


def measure(T: int, chunks: int, impl: str, shape, fw, args, dev, sets: list) -> list[dict]:
    rows_per_expert = T * shape.topk / shape.num_experts
    choice = GC.choose_layer(rows_per_expert, shape.hidden, shape.intermediate, {impl}, block_m=args.block_m)
    if impl == "cutlass" and (args.cutlass_l1 or args.cutlass_l2):
        l1 = GC.parse_key(args.cutlass_l1) if args.cutlass_l1 else choice.l1
        l2 = GC.parse_key(args.cutlass_l2) if args.cutlass_l2 else choice.l2
        choice = GC.LayerChoice("cutlass", l1, l2, f"--cutlass-l1 {l1.key} --cutlass-l2 {l2.key}")
    streamed = Forward(T, chunks, shape, args.block_m, impl, choice, dev)
    batch = Forward(T, 1, shape, args.block_m, impl, choice, dev)
    streamed_e = Forward(T, chunks, shape, args.block_m, impl, choice, dev, by_expert=True)
    batch_e = Forward(T, 1, shape, args.block_m, impl, choice, dev, by_expert=True)
    fwds = (streamed, batch, streamed_e, batch_e)
    for f in fwds:
        f.load(sets[0])
    forms = {"per_chunk": streamed.per_chunk(fw), "one_launch": streamed.one_launch(fw)}
    # every route's row, bitwise, from every form over the streamed blocks and from the batch blocks
    run_poisoned(streamed, forms["one_launch"])
    ref = by_route(streamed).clone()
    checks = {name: same_output(streamed, fn, ref) for name, fn in forms.items() if name != "one_launch"}
    checks["batch"] = same_output(batch, batch.one_launch(fw), ref)
    checks["batch_by_expert"] = same_output(batch_e, batch_e.one_launch(fw), ref)
    checks["per_chunk_by_expert"] = same_output(streamed_e, streamed_e.per_chunk(fw), ref)
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise RuntimeError(f"T={T} C={chunks} {impl}: {bad} not bitwise equal to one_launch over the streamed blocks")
    captured = {name: capture(fn) for name, fn in forms.items()}
    captured["batch"] = capture(batch.one_launch(fw))
    captured["batch_by_expert"] = capture(batch_e.one_launch(fw))
    captured["per_chunk_by_expert"] = capture(streamed_e.per_chunk(fw))
    modes = {name: mode for name, (_, mode) in captured.items()}
    if len(set(modes.values())) > 1:
        raise RuntimeError(f"T={T} C={chunks} {impl}: forms captured differently {modes}: graphs and eager "
                           "launches do not compare")
    graphs = {name: fn for name, (fn, _) in captured.items()}

    def load(s):  # (ruff reads the `del` below as unbinding these for the closure; it runs before it)
        for f in fwds:  # noqa: F821
            f.load(sets[s])

    t = time_interleaved(graphs, len(sets), load, args.replays)
    n_ready = int(streamed.bc.ready_hi[chunks + 1])
    n_batch = int(batch.bc.ready_hi[2])
    ms = {k: v["median_ms"] for k, v in t.items()}
    row = {"tokens": T, "chunks": chunks, "impl": impl, "block_m": streamed.bc.block_m,
           "variant": {"l1": choice.l1.key, "l2": choice.l2.key}, "choice_source": choice.source,
           "calls_per_forward": len(streamed.steps()), "blocks_streamed": n_ready, "blocks_batch": n_batch,
           "times": t, "ms": ms, "bitwise_vs_one_launch": checks, "timed_as": modes,
           "per_chunk_over_one_launch": ms["per_chunk"] / ms["one_launch"],
           "one_launch_over_batch": ms["one_launch"] / ms["batch"],
           "per_chunk_over_batch": ms["per_chunk"] / ms["batch"],
           "batch_by_expert_over_batch": ms["batch_by_expert"] / ms["batch"],
           "per_chunk_by_expert_over_per_chunk": ms["per_chunk_by_expert"] / ms["per_chunk"],
           # per_chunk - one_launch (the key the committed results carry; not a strict bound: module doc)
           "scheduler_saving_bound_ms": ms["per_chunk"] - ms["one_launch"]}
    del streamed, batch, streamed_e, batch_e, fwds, forms, captured, graphs
    torch.cuda.empty_cache()
    return [row]


def print_rows(rows: list[dict]) -> None:
    print(f"{'tokens':>6} {'C':>2} {'impl':8} {'blocks':>11} {'batch':>8} {'one':>8} {'per-chunk':>9} "
          f"{'chunk/one':>9} {'one/batch':>9} {'chunk-one':>9} {'batch_e':>8} {'chunk_e':>8} {'b_e/b':>6} "
          f"{'c_e/c':>6}")
    for r in rows:
        m = r["ms"]
        print(f"{r['tokens']:6d} {r['chunks']:2d} {r['impl']:8} {r['blocks_batch']:5d}/{r['blocks_streamed']:5d} "
              f"{m['batch']:8.3f} {m['one_launch']:8.3f} {m['per_chunk']:9.3f} "
              f"{r['per_chunk_over_one_launch']:9.3f} {r['one_launch_over_batch']:9.3f} "
              f"{r['scheduler_saving_bound_ms']:9.3f} {m['batch_by_expert']:8.3f} {m['per_chunk_by_expert']:8.3f} "
              f"{r['batch_by_expert_over_batch']:6.3f} {r['per_chunk_by_expert_over_per_chunk']:6.3f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,4096,8192", help="tokens per forward (one PE)")
    ap.add_argument("--chunks", default="2,4,8", help="chunk counts of the streamed forward")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"GEMM implementations, of {IMPLS}")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--experts", type=int, default=256,
                    help="experts of the layer (32: each expert gets the rows one of a PE's 32 experts gets with 2 "
                         "PEs of --tokens each, 64 experts in all; 4096 tokens: 1024 rows per expert)")
    ap.add_argument("--cutlass-l1", default="", help="CUTLASS L1 variant instead of the table's choice, e.g. "
                                                     "cutlass:pingpong64:bf16:m (or ...:m:s4, a swizzle)")
    ap.add_argument("--cutlass-l2", default="", help="CUTLASS L2 variant instead of the table's choice")
    ap.add_argument("--sets", type=int, default=2, help="input sets (routing + activations)")
    ap.add_argument("--replays", type=int, default=10, help="timed replays per set and form")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no new case after this long (0: no limit)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", help="write the rows here (docs/results/gemm-launches-<date>.json)")
    args = ap.parse_args(argv)
    impls = [v for v in args.impls.split(",") if v]
    for opt in ("cutlass_l1", "cutlass_l2"):
        key = getattr(args, opt)
        try:
            ok = not key or (GC.parse_key(key).impl == "cutlass" and GC.parse_key(key).tile in CG.TILE_TABLE)
        except ValueError:
            ok = False
        if not ok:
            ap.error(f"--{opt.replace('_', '-')}: {key!r} is not cutlass:<tile>:<bf16|f32>:<m|n>[:s<2|4|8>] with a tile of "
                     f"{sorted(CG.TILE_TABLE)}")
    for v in impls:
        if v not in IMPLS:
            ap.error(f"--impls: {v!r} is not one of {IMPLS}")
    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    shape = dsv3_shape(args.block_m, args.experts)
    fw = MoEWeights.random_fp8(shape, 7, dev).fp8_blocks()
    t0 = time.monotonic()
    rows: list[dict] = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
            "date": time.strftime("%Y-%m-%d"), "skipped": []}
    if "deep_gemm" in impls:
        avail = DG.deep_gemm_available()
        why = deep_gemm_first_call() if avail else avail.reason
        if why:
            impls.remove("deep_gemm")
            meta["skipped"].append(f"deep_gemm: {why}")
            log(meta["skipped"][-1])
    def write():
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)

    for T in (int(v) for v in args.tokens.split(",") if v):
        gen = torch.Generator(device=dev)
        gen.manual_seed(args.seed + T)
        sets = [uniform_inputs(T, shape, gen, dev) for _ in range(args.sets)]
        for impl in impls:
            for C in (int(v) for v in args.chunks.split(",") if v):
                if args.budget_s and time.monotonic() - t0 > args.budget_s:
                    meta["skipped"].append(f"T={T} C={C} {impl}: past --budget-s {args.budget_s:g}")
                    log(meta["skipped"][-1])
                    continue
                log(f"T={T} C={C} {impl}")
                rows += measure(T, C, impl, shape, fw, args, dev, sets)
                print_rows(rows[-1:])
                write()
    write()  # the skips after the last measured case too
    print("\nall cases (ms, medians; chunk/one = per-chunk calls against one call running the same tiles, "
          "one/batch = the same blocks in chunk order against the batch blocks):")
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
