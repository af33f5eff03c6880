"""Does a short chain of kernels get SMs while an expert GEMM grid runs? The question behind a streamed
forward whose second source is dispatched only after the first source's GEMMs end.

One process, one GPU. On a GEMM stream: the layer's own Triton L1, then L2, over the blocks of ``--tokens``
tokens (DeepSeek-V3 expert shapes, ``--experts`` experts, uniform top-8: one PE's first-source GEMMs at
the EP8 load). On a second stream, at a point inside L1 and at a point inside L2 (``--at``: fractions of
each GEMM's own time), the chain under test, in segments: a chunk's producer (router logits; top-k; the
FP8 quantization of ``--chain-tokens`` tokens) and the dispatch's own kinds of kernel (torch's radix sort
and scan of the chunk's routes, ``--extra`` small elementwise kernels). Every point is a %globaltimer stamp
written on the device, so eager launches and graph replays are timed alike, segment by segment.

Variants (medians of ``--reps``): eager with the chain's stream at priority 0 or at the highest priority;
a captured CUDA graph without node priorities, and with every non-GEMM kernel node at the highest
priority (``streamring.moe.ep_buffer``'s node-priority pass, whose report is printed); each with the GEMM
grids of one CTA per tile (``ctas none``) or a persistent grid (``--ctas``). The chain alone (no GEMM) is
the baseline: a segment that shares the GPU takes about its alone time; a starved one waits for the GEMM.
The GEMM kernels' registers and shared memory per CTA are printed (what a chain CTA must fit beside).

    python -m bench.sm_sharing --json out.json   # needs a CUDA GPU; the JSON gets one entry per run
    EPM_SHARING=1 bash launch/ep_mps_bench.sh       # on the GPU machine: without MPS and as an MPS client
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.common import dsv3_shape, log, uniform_inputs
from streamring.device import moe_triton as K
from streamring.moe.blocks import BlockConsumer, Producer, select_experts_into
from streamring.moe.weights import MoEWeights
from streamring.device.graph_priority import prioritize_nodes as _prioritize_nodes

FP8 = torch.float8_e4m3fn
# stamp slots
G0, L1_END, L2_END = 0, 1, 2
SEGMENTS = ("router", "top-k", "quantize", "sort+scan", "small")
C0 = 3  # chain start; C0 + 1 + i: the end of SEGMENTS[i]
NSTAMPS = C0 + 1 + len(SEGMENTS)


class Probe:
    def __init__(self, args, dev):
        self.args, self.dev = args, dev
        shape = dsv3_shape(64, num_experts=args.experts)
        self.shape = shape
        self.fw = MoEWeights.random_fp8(shape, 0, dev).fp8_blocks()
        gen = torch.Generator(device=dev)
        gen.manual_seed(1)
        idx, w, q, sf = uniform_inputs(args.tokens, shape, gen, dev)
        self.bc = BlockConsumer(shape, args.tokens, 2, 64, dev)
        self.bc.begin()
        self.bc.dispatch(0, idx, w, q, sf, 0)
        self.bc.seal(1)
        self.prod = Producer(args.chain_tokens, shape.num_experts, dev)
        n = args.chain_tokens
        self.x = torch.randn(n, shape.hidden, generator=gen, device=dev).to(torch.bfloat16)
        self.idx = torch.zeros(n, shape.topk, dtype=torch.int64, device=dev)
        self.w = torch.zeros(n, shape.topk, dtype=torch.float32, device=dev)
        self.q = torch.zeros(n, shape.hidden, dtype=FP8, device=dev)
        self.sf = torch.zeros(n, shape.hidden // 128, dtype=torch.float32, device=dev)
        self.small = torch.zeros(1 << 16, dtype=torch.float32, device=dev)
        self.stamps = torch.zeros(NSTAMPS, dtype=torch.int64, device=dev)
        props = torch.cuda.get_device_properties(dev)
        self.clock_khz = getattr(props, "clock_rate", 0) or 1_980_000
        self.delay_cycles = 0
        self.gstream = torch.cuda.Stream(device=dev, priority=0)
        self.kernels = {}

    def gemm(self, ctas):
        bc, fw = self.bc, self.fw
        h1 = bc.h1.view(FP8)
        k1 = K.expert_l1(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.a.view(FP8), bc.a_sf,
                         fw.w1, fw.w1_sf, h1, bc.h1_sf, block_m=64, max_ctas=ctas)
        K.stamp(self.stamps, L1_END)
        k2 = K.expert_l2(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, h1, bc.h1_sf, fw.w2,
                         fw.w2_sf, bc.row_weight, bc.y, bc.block_rows, block_m=64, max_ctas=ctas)
        self.kernels[("L1", ctas)], self.kernels[("L2", ctas)] = k1, k2
        bc.gemm_kernels.update(k for k in (k1, k2) if k is not None)

    def chain(self):
        lg = self.prod.logits[: self.x.shape[0]]
        K.router_logits(self.x, self.fw.router, lg)
        K.stamp(self.stamps, C0 + 1)
        select_experts_into(lg, self.fw.bias, self.shape, self.idx, self.w)
        K.stamp(self.stamps, C0 + 2)
        self.prod.layout(self.x, self.q, self.sf)
        K.stamp(self.stamps, C0 + 3)
        flat = self.idx.view(-1).to(torch.int32)
        torch.sort(flat, stable=True)
        torch.cumsum(flat, 0, dtype=torch.int32)
        K.stamp(self.stamps, C0 + 4)
        for _ in range(self.args.extra):
            self.small.add_(1.0)
        K.stamp(self.stamps, C0 + 5)

    def enqueue(self, ctas, vstream, with_gemm=True):
        """The measured sequence on the GEMM stream and ``vstream`` (forked from the current stream)."""
        cur = torch.cuda.current_stream(self.dev)
        self.gstream.wait_stream(cur)
        with torch.cuda.stream(self.gstream):
            K.stamp(self.stamps, G0)
            if with_gemm:
                self.gemm(ctas)
            else:
                K.stamp(self.stamps, L1_END)
            K.stamp(self.stamps, L2_END)
        vstream.wait_stream(cur)
        with torch.cuda.stream(vstream):
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            K.stamp(self.stamps, C0)
            self.chain()
        cur.wait_stream(self.gstream)
        cur.wait_stream(vstream)

    def read(self) -> dict:
        torch.cuda.synchronize(self.dev)
        s = self.stamps.tolist()
        ms = lambda a, b: (s[b] - s[a]) / 1e6  # noqa: E731
        row = {"l1_ms": ms(G0, L1_END), "l2_ms": ms(L1_END, L2_END), "chain_ms": ms(C0, C0 + len(SEGMENTS)),
               "chain_start_ms": ms(G0, C0), "chain_end_ms": ms(G0, C0 + len(SEGMENTS))}
        for i, name in enumerate(SEGMENTS):
            row[f"{name}_ms"] = ms(C0 + i, C0 + 1 + i)
        return row

    def eager(self, ctas, priority, with_gemm=True) -> list[dict]:
        vstream = torch.cuda.Stream(device=self.dev, priority=priority)
        out = []
        for _ in range(self.args.reps + 1):
            self.enqueue(ctas, vstream, with_gemm)
            out.append(self.read())
        return out[1:]

    def graph(self, ctas, node_priority: bool) -> tuple[list[dict], str]:
        vstream = torch.cuda.Stream(device=self.dev, priority=-10)  # torch clamps to its highest priority
        self.enqueue(ctas, vstream)  # warm-up (compiles) outside the capture
        torch.cuda.synchronize(self.dev)
        g = torch.cuda.CUDAGraph(keep_graph=node_priority)
        side = torch.cuda.Stream(device=self.dev)
        side.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.graph(g, stream=side):
            self.enqueue(ctas, vstream)
        report = "no node priorities"
        if node_priority:
            report = _prioritize_nodes(g, {int(k.function) for k in self.bc.gemm_kernels}, vstream.priority)
            g.instantiate()
        torch.cuda.current_stream(self.dev).wait_stream(side)
        out = []
        for _ in range(self.args.reps + 1):
            g.replay()
            out.append(self.read())
        del g
        return out[1:], report


def median_row(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def kernel_resources(k) -> dict:
    """Registers per thread, warps and shared memory per CTA of a compiled Triton kernel."""
    if k is None:
        return {}
    md = getattr(k, "metadata", None)
    return {"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
            "warps": getattr(md, "num_warps", None), "shared_bytes": getattr(md, "shared", None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens whose routes the GEMMs compute")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--chain-tokens", type=int, default=4096)
    ap.add_argument("--extra", type=int, default=8, help="small elementwise kernels at the chain's end")
    ap.add_argument("--at", type=lambda s: [float(v) for v in s.split(",")], default=[0.3, 1.3],
                    help="chain starts, as fractions: 0..1 inside L1 (of L1's time), 1..2 inside L2")
    ap.add_argument("--ctas", type=lambda s: [v if v in ("none", "sms") else int(v) for v in s.split(",")],
                    default=["none"],
                    help="GEMM grids: none (a CTA per tile), sms (a persistent grid of one CTA per visible SM) or N")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--label", default="", help="what this process runs under (e.g. 'MPS 50%%')")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.sm_sharing needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    p = Probe(args, dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ctas_list = [None if c == "none" else sms if c == "sms" else c for c in args.ctas]
    log(f"{torch.cuda.get_device_name(dev)}, {sms} SMs visible, {args.label or 'no label'}; GEMMs over "
        f"{args.tokens} tokens x top-8 on {args.experts} experts; chain: producer of {args.chain_tokens} tokens, "
        f"sort+scan of its routes, {args.extra} small kernels")
    alone = median_row(p.eager(None, 0, with_gemm=False))
    rows = [{"variant": "chain alone", "ctas": None, "at": None, **alone}]
    for ctas in ctas_list:
        gem = median_row(p.eager(ctas, 0))  # L1 and L2 times of this grid (the chain starts at once)
        log(f"ctas {ctas}: L1 {gem['l1_ms']:.3f} ms, L2 {gem['l2_ms']:.3f} ms; "
            f"L1 {kernel_resources(p.kernels[('L1', ctas)])}, L2 {kernel_resources(p.kernels[('L2', ctas)])}")
        for at in args.at:
            start_ms = at * gem["l1_ms"] if at <= 1 else gem["l1_ms"] + (at - 1) * gem["l2_ms"]
            p.delay_cycles = int(start_ms * p.clock_khz)
            for name, prio in (("eager, chain stream priority 0", 0), ("eager, chain stream high priority", -10)):
                rows.append({"variant": name, "ctas": ctas, "at": at, **median_row(p.eager(ctas, prio))})
            for node_priority in (False, True):
                meas, report = p.graph(ctas, node_priority)
                rows.append({"variant": f"graph, {report}", "ctas": ctas, "at": at, **median_row(meas)})
            p.delay_cycles = 0
    seg_hdr = " ".join(f"{s[:9]:>9s}" for s in SEGMENTS)
    print(f"\n{'variant':62s} {'ctas':>4s} {'at':>4s} {'L1 ms':>6s} {'L2 ms':>6s} {'start':>6s} {'chain':>6s} "
          f"{'x alone':>7s} {seg_hdr}")
    for r in rows:
        r["chain_over_alone"] = r["chain_ms"] / alone["chain_ms"]
        r["label"] = args.label
        segs = " ".join(f"{r[s + '_ms']:9.3f}" for s in SEGMENTS)
        print(f"{r['variant'][:62]:62s} {str(r['ctas']):>4s} {str(r['at']):>4s} {r['l1_ms']:6.3f} {r['l2_ms']:6.3f} "
              f"{r['chain_start_ms']:6.3f} {r['chain_ms']:6.3f} {r['chain_over_alone']:7.2f} {segs}")
    if args.json:  # appended: one entry per run (e.g. without MPS, then as an MPS client)
        path = Path(args.json)
        runs = json.loads(path.read_text()) if path.exists() else []
        runs.append({"sms": sms, "args": {k: v for k, v in vars(args).items() if k != "json"},
                     "gemm_kernels": {f"{n} ctas={c}": kernel_resources(k) for (n, c), k in p.kernels.items()},
                     "rows": rows})
        path.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
