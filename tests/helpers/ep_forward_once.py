#!/usr/bin/env python3
"""One small expert-parallel forward on one PE, streamed and batch, checked: the target of
``launch/sanitize.sh`` (compute-sanitizer wants a short run that touches every kernel of the EP layer).

    python3 tests/helpers/ep_forward_once.py [--policy serialized] [--transport p2p] [--tokens 97] [--replays 2]

Builds one :class:`~streamring.moe.ep_buffer.EPBuffer` and runs its batch and streamed paths (Triton GEMMs on
both: the
same implementation), warms both up (one eager forward), captures each and replays it; exits 0 iff the
streamed output equals the batch output bit for bit and the device reported no error. The default policy
is ``serialized`` (one stream): the sanitizer's tools may serialise kernels, and a consumer spinning
before its producer would then only end at its deadline.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="serialized")
    ap.add_argument("--transport", default="p2p", choices=["p2p", "nv"])
    ap.add_argument("--tokens", type=int, default=97)
    ap.add_argument("--replays", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=60.0, help="device waits (slow under a sanitizer)")
    ap.add_argument("--eager", action="store_true",
                    help="enqueue every forward instead of replaying a captured graph (the same kernels; lets "
                         "PYTORCH_NO_CUDA_MEMORY_CACHING=1 give every tensor its own allocation)")
    args = ap.parse_args(argv)

    import torch

    from streamring.device.nvshmem import NvshmemHeap
    from streamring.moe.ep_buffer import EPBuffer
    from streamring.moe.tuning import EPTuning
    from streamring.moe.math import MoEShape
    from streamring.moe.weights import MoEWeights

    heap = NvshmemHeap.bootstrap(launcher="local")
    shape = MoEShape(hidden=512, intermediate=256, num_experts=16, topk=4, router="deepseek_v3", n_group=4,
                     topk_group=2, routed_scaling_factor=2.5, weight_dtype="fp8", block_m=16)
    mw = MoEWeights.random_fp8(shape, 7, heap.device)
    T = args.tokens
    g = torch.Generator(device=heap.device)
    g.manual_seed(5)
    x = torch.randn(T, shape.hidden, generator=g, device=heap.device).to(torch.bfloat16)
    outs, problems = {}, []
    buf = EPBuffer(heap, shape, max_tokens_per_rank=T, num_slots=2, tokens_per_slot=40, gemm="triton",
                   deadline_s=args.deadline_s, name="once",
                   tuning=EPTuning(block_m=16, policy=args.policy, transport=args.transport))
    w = buf.prepare_weights(mw)
    for name in ("batch", "stream"):
        streaming = name == "stream"
        try:
            y = torch.zeros_like(x)
            buf.forward(x, w, streaming=streaming, out=y)  # the first (eager, serialized) forward of the path
            graph = None if args.eager else buf.capture(x, w, y, streaming=streaming)
            for _ in range(args.replays):
                y.fill_(float("nan"))
                if graph is None:
                    buf.forward(x, w, streaming=streaming, out=y)
                    buf.check()
                    st = buf.status()
                else:
                    st = buf.replay(graph)
            outs[name] = y.clone()
            print(f"ep_forward_once: {name} ({args.policy if streaming else 'serialized'}, {args.transport}, "
                  f"{'eager' if args.eager else 'graph'}): {buf.paths[name].num_chunks} chunks, status "
                  f"{ {k: st[k] for k in ('violations', 'timeouts', 'bad_routes') if k in st} }", flush=True)
            del graph
        except Exception as exc:  # noqa: BLE001 - reported, and the exit status says it
            problems.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        finally:
            torch.cuda.synchronize()
    buf.close()
    if len(outs) == 2 and not torch.equal(outs["stream"].view(torch.int16), outs["batch"].view(torch.int16)):
        problems.append("streamed != batch")
    heap.close()
    print("ep_forward_once: " + ("PASS: streamed == batch bitwise, no device error" if not problems else
                                 "FAIL: " + "; ".join(problems)), flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
