"""Which SMs this process's kernels run on: one CTA per reported SM (and twice as many), each spinning for a
while and writing its ``%smid``; prints one line (``label``, SMs reported, distinct SM ids used, the ids).

Run as two MPS clients at once (launch/mps_partition_probe.sh): under ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
both clients report the same ids (``%smid`` as MPS numbers a client's SMs, which does not say whether the SMs
are the same); static SM partitions (``CUDA_MPS_SM_PARTITION``, MPS 13.1 and later) are meant to give disjoint
ones.

The ids cannot tell whether two clients' grids share SMs, so ``--matmul N`` instead times bf16 ``N x N``
matmuls (compute bound, every SM busy): a client alone and two clients at once under the same percentage take
the same time when the clients hold SMs of their own, and about twice as long when they share them.

    python -m bench.sm_ids --label client0 [--spin-us 200000]
    python -m bench.sm_ids --label client0 --matmul 8192 [--iters 40] [--start-at T]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _smid_kernel(out_ptr, spin_ns):
    pid = tl.program_id(0)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < spin_ns:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
    tl.store(out_ptr + pid, smid)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--spin-us", type=int, default=200_000, help="each CTA's spin (long enough to overlap)")
    ap.add_argument("--start-at", type=float, default=0.0, help="time.time() to launch at (two clients at once)")
    ap.add_argument("--matmul", type=int, default=0, help="time --iters bf16 N x N matmuls instead (0: the ids)")
    ap.add_argument("--iters", type=int, default=40, help="matmuls timed with --matmul")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if a.matmul:
        return _time_matmuls(a, dev, sms)
    rows = {}
    for ctas in (sms, 2 * sms):
        out = torch.full((ctas,), -1, dtype=torch.int32, device=dev)
        _smid_kernel[(1,)](out, 1000)  # compile and load first
        torch.cuda.synchronize()
        if a.start_at:
            time.sleep(max(0.0, a.start_at - time.time()))
        t = time.perf_counter()
        _smid_kernel[(ctas,)](out, a.spin_us * 1000)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        ids = sorted(set(out.tolist()))
        rows[ctas] = {"ms": round(ms, 1), "distinct_sms": len(ids), "ids": ids}
        a.start_at = a.start_at + a.spin_us * 3e-6 + 1.0 if a.start_at else 0.0
    print(json.dumps({"label": a.label, "sms_reported": sms, "grids": rows}))
    return 0


def _time_matmuls(a, dev, sms: int) -> int:
    """One line: the wall time of ``a.iters`` back-to-back bf16 matmuls started at ``a.start_at`` (warmed first)."""
    x = torch.randn(a.matmul, a.matmul, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(3):
        torch.mm(x, x, out=y)
    torch.cuda.synchronize()
    if a.start_at:
        time.sleep(max(0.0, a.start_at - time.time()))
    t = time.perf_counter()
    for _ in range(a.iters):
        torch.mm(x, x, out=y)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    tflops = 2 * a.matmul ** 3 * a.iters / (ms * 1e-3) / 1e12
    print(json.dumps({"label": a.label, "sms_reported": sms, "matmul_n": a.matmul, "iters": a.iters,
                      "ms": round(ms, 2), "tflops": round(tflops, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
