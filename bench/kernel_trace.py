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


#: the expert GEMM kernels of a trace, by name: CUTLASS's grouped GEMM, the Triton L1 (with SwiGLU) and L2
GEMM_KERNELS = ("cutlass13device_kernel", "_l1_swiglu_kernel", "_l2_kernel")


def gemm_kernels(kernels: list[dict]) -> list[dict]:
    """The expert GEMM launches of one PE's traced replay, in start order."""
    return [k for k in kernels if any(g in k["name"] for g in GEMM_KERNELS)]


def gemm_balance(timelines: list[dict]) -> list[dict]:
    """Each traced replay's GEMM launches side by side over its PEs: one row per (tokens, GEMMs, path, late PE,
    lateness) case with ``durations_us`` (per PE, each GEMM launch's duration in start order), ``spread``:
    per launch index, the slowest PE's duration over the fastest's (1.0 where the PEs ran it alike), and
    ``span_us``: from the first GEMM launch's start to the last one's end over every PE. On one GPU
    shared by several PEs (MPS) a spread far above 1 marks a replay whose PEs did not get the GPU alike."""
    groups: list[tuple[tuple, dict]] = []  # a case's PEs of one replay; a PE seen again starts the next replay
    for t in timelines:
        if "kernels" in t:
            key = (t.get("tokens"), t.get("gemm"), t.get("path"), t.get("straggler_rank"), t.get("straggler_ms"))
            rank = t.get("rank", 0)
            same = [g for g in groups if g[0] == key]
            if not same or rank in same[-1][1]:
                groups.append((key, {}))
                same = [groups[-1]]
            same[-1][1][rank] = gemm_kernels(t["kernels"])
    rows = []
    for (tokens, gemm, path, late_pe, late_ms), by_pe in groups:
        durs = [[k["dur_us"] for k in by_pe[pe]] for pe in sorted(by_pe)]
        n = min(len(d) for d in durs) if durs else 0
        spread = [round(max(d[i] for d in durs) / max(min(d[i] for d in durs), 1e-9), 3) for i in range(n)]
        ks = [k for pe in by_pe.values() for k in pe]
        span = (max(k["start_us"] + k["dur_us"] for k in ks) - min(k["start_us"] for k in ks)) if ks else 0.0
        rows.append({"tokens": tokens, "gemm": gemm, "path": path, "late_pe": late_pe, "late_ms": late_ms,
                     "durations_us": durs, "spread": spread, "span_us": round(span, 1)})
    return rows


def results_timelines(results: dict) -> list[tuple[str, list[dict]]]:
    """Every traced replay kept in a results file: ``(RUN or RUN/SUB, timelines)`` for each run (and each of its
    ``by_run`` entries) that holds ``timelines``."""
    out = []
    for name, run in results.get("runs", {}).items():
        if isinstance(run, dict) and isinstance(run.get("timelines"), list):
            out.append((name, run["timelines"]))
        for sub, entry in (run.get("by_run") or {}).items() if isinstance(run, dict) else ():
            if isinstance(entry, dict) and isinstance(entry.get("timelines"), list):
                out.append((f"{name}/{sub}", entry["timelines"]))
    return out


def print_gemm_balance(results: dict) -> str:
    """:func:`gemm_balance` of every traced replay of a results file, a line per case: each PE's GEMM launches
    (ms), the first launch's spread over the PEs and the GEMMs' span."""
    out = []
    for name, timelines in results_timelines(results):
        for r in gemm_balance(timelines):
            if not any(r["durations_us"]):
                continue
            late = f"PE {r['late_pe']} {r['late_ms']} ms late" if r["late_ms"] else "on time"
            pes = "  ".join("PE%d %s" % (i, "+".join(f"{d / 1e3:.2f}" for d in ds))
                            for i, ds in enumerate(r["durations_us"]))
            first = f"{r['spread'][0]:.2f}" if r["spread"] else "-"
            out.append(f"{name}  {r['tokens']} {r['gemm']} {r['path']} {late}:  {pes}   first spread {first}"
                       f"   span {r['span_us'] / 1e3:.2f} ms")
    return "\n".join(out)


if __name__ == "__main__":
    # python -m bench.kernel_trace TIMELINES.json [MIN_US]: the traces a bench run wrote (--timeline-json), or
    # python -m bench.kernel_trace RESULTS.json RUN [MIN_US]: those kept in a results file's runs[RUN]["timelines"],
    # or with RUN/SUB in runs[RUN]["by_run"][SUB]["timelines"];
    # python -m bench.kernel_trace --gemm-balance RESULTS.json: print_gemm_balance
    import sys

    args = sys.argv[1:]
    if args and args[0] == "--gemm-balance":
        # python -m bench.kernel_trace --gemm-balance RESULTS.json: every kept trace's GEMM launches per PE
        print(print_gemm_balance(json.loads(Path(args[1]).read_text())))
        sys.exit(0)
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
