"""Every kernel of one graph replay on each PE, as the GPU ran it (torch.profiler / CUPTI): name, stream, start
and duration, for reading where a late case's time goes beside the bench's stamps (which mark points of the
schedule, not when a kernel's CTAs got SMs).

:func:`traced_replay` is collective (every PE calls it for the same graph at once): one warm-up replay under the
profiler (CUPTI's start), then a barrier and the traced replay. Times are µs from the earliest kernel of the
traced replay over all PEs (host clock: every PE of one machine reads the same one).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

#: trace event categories that are GPU work
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _profiled(heap, replay) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        heap.barrier()
        replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"trace-{os.getpid()}.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return [{"name": e.get("name", "")[:160], "stream": (e.get("args") or {}).get("stream"), "ts": float(e["ts"]),
             "dur": float(e.get("dur", 0.0))}
            for e in events if e.get("cat") in GPU_CATEGORIES and "ts" in e]


def traced_replay(heap, replay) -> list[dict]:
    """This PE's kernels of one replay of ``replay`` (collective): ``[{name, stream, start_us, dur_us}]`` sorted by
    start, µs from the earliest kernel over all PEs. An empty list where the profiler saw no GPU work."""
    _profiled(heap, replay)  # CUPTI's first start is slow: not in the traced replay
    ks = _profiled(heap, replay)
    first = min((k["ts"] for k in ks), default=None)
    t0 = min((t for t in heap.allgather_obj(first) if t is not None), default=0.0)
    return sorted(({"name": k["name"], "stream": k["stream"], "start_us": round(k["ts"] - t0, 1),
                    "dur_us": round(k["dur"], 1)} for k in ks), key=lambda k: k["start_us"])


def short_name(name: str) -> str:
    """A kernel's name without its template arguments (CUTLASS's run to thousands of characters)."""
    base = name.split("<", 1)[0].replace("void ", "").strip()
    return base[-60:]


def print_trace(pes: list[list[dict]], min_us: float = 0.0) -> str:
    """One line per kernel, PE by PE: start, end, duration, stream and short name (kernels shorter than
    ``min_us`` left out)."""
    out = []
    for pe, ks in enumerate(pes):
        out.append(f"PE {pe}: {len(ks)} kernels")
        for k in ks:
            if k["dur_us"] >= min_us:
                out.append(f"  {k['start_us']:9.1f} -> {k['start_us'] + k['dur_us']:9.1f}  ({k['dur_us']:8.1f})  "
                           f"s{k['stream']}  {short_name(k['name'])}")
    return "\n".join(out)


if __name__ == "__main__":
    # python -m bench.kernel_trace TIMELINES.json [MIN_US]: the traces a bench run wrote (--timeline-json), or
    # python -m bench.kernel_trace RESULTS.json RUN [MIN_US]: those kept in a results file's runs[RUN]["timelines"],
    # or with RUN/SUB in runs[RUN]["by_run"][SUB]["timelines"]
    import sys

    args = sys.argv[1:]
    rows = json.loads(Path(args.pop(0)).read_text())
    if isinstance(rows, dict) and "runs" in rows and args and args[0].split("/")[0] in rows["runs"]:
        run, _, sub = args.pop(0).partition("/")
        rows = rows["runs"][run]
        rows = (rows["by_run"][sub] if sub else rows)["timelines"]
    rows = rows.get("timelines", rows) if isinstance(rows, dict) else rows
    min_us = float(args[0]) if args else 0.0
    groups: dict = {}
    for t in rows:
        if "kernels" in t:
            key = (t.get("tokens"), t.get("gemm"), "streamed" if "streamed_ms" in t else "batch", t.get("straggler_ms"))
            groups.setdefault(key, []).append(t["kernels"])
    for key, pes in groups.items():
        print(f"=== tokens {key[0]}, {key[1]}, {key[2]}, straggler {key[3]} ms")
        print(print_trace(pes, min_us))
