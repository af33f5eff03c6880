#!/usr/bin/env python3
"""Build the adaptive policy's tuned table from layer-benchmark results.

    python3 -m bench.make_adaptive_table docs/results/ep-layer-2h200-triton-128-8192-2026-11-30.json:triton \
        docs/results/ep-layer-2h200-cutlass-1024-8192-2026-11-30.json:cutlass --out streamring/moe/adaptive_table.json

Two input forms: the expert-parallel layer benchmark (``python -m bench.ep_layer``: one row per
measured path) and the older single-layer benchmark (rows with ``batch`` and ``streamed`` lists).
For every (token count per rank, GEMM, ranks, experts per PE, block size): the fastest streamed configuration that
passed its checks (bitwise equal to batch, no ring violation or timeout), with no late rank and uniform
routing, if it beat the batch path of the same run (streamed/batch < 1 - margin), else the batch path
(one chunk). Results older than the ``experts_per_pe`` key put DeepSeek-V3's 256 experts on their ranks. ``FILE:GEMM`` names the GEMM of rows that do not record a resolved one (results older
than the ``gemm`` key, or ``auto``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _decide(row: dict, best: dict | None, margin: float, config: dict | None = None,
            compared: str | None = None) -> dict:
    """``row`` with the decision: streamed with ``best``'s configuration if it beat batch by more than
    ``margin``, else batch with the reason. ``config``: what else a streamed row records ({key: default},
    read from ``best``); a ``consumer`` among them is named in the reason too. ``compared``: what
    ``best["streamed_over_batch"]`` is, for the reason, where it is not the on-time ratio."""
    extra = {k: best.get(k, d) for k, d in (config or {}).items()} if best else {}
    if best is not None and best["streamed_over_batch"] < 1.0 - margin:
        row.update(path="streamed", chunks=best["chunks"], num_slots=best["num_slots"], policy=best["policy"], **extra,
                   streamed_over_batch=round(best["streamed_over_batch"], 4))
    elif best is not None:
        consumer = f", {extra['consumer']} consumer" if "consumer" in extra else ""
        ratio = compared or f"was {best['streamed_over_batch']:.3f}x the batch path"
        row.update(path="batch", chunks=1, reason=f"best streamed config ({best['chunks']} chunks, {best['policy']}"
                                                  f"{consumer}) {ratio}")
    else:
        row.update(path="batch", chunks=1, reason="no streamed configuration passed")
    return row


def _fastest(streamed: list) -> dict | None:
    return min(streamed, key=lambda s: s["streamed_over_batch"]) if streamed else None


PLAN_KEYS = ("chunks", "num_slots", "policy", "source_order", "consumer", "chunk_gemm_ctas", "ready_window_us",
             "streamed_grid_waves", "grouped_steps")


def _case(r: dict) -> tuple:
    """The late-rank case of a row: (straggler_ms, straggler_rank, skew_ms); (0, None, 0) on time."""
    ms = float(r.get("straggler_ms") or 0.0)
    return ms, (r.get("straggler_rank") if ms else None), float(r.get("skew_ms") or 0.0)


def _ep_rows(bench: dict, gemm_default: str | None, margin: float) -> list[dict]:
    """Table rows from the EP-layer benchmark's per-path rows. Each streamed plan and the batch path are
    compared in every late-rank case the batch path was measured in (on time; stragglers; skew): a path's
    regret is its worst ratio over the fastest path of each case, and a streamed plan is taken where its
    regret is below the batch path's by more than ``margin`` (with only the on-time case: where it beat batch
    by more than ``margin``). A streamed plan that failed a check on time is no candidate."""
    groups: dict = {}
    for r in bench.get("rows", []):
        if r.get("routing", "uniform") != "uniform" or "median_ms" not in r or r.get("path") not in ("batch", "streamed"):
            continue
        if (r.get("dispatch_beside_grid") is True or r.get("seal_by_expert") is False
                or r.get("delay_by", "spin") != "spin"):
            # switches a buffer does not run by default, and another model of a late producer. Rows without the
            # fields are kept. The dispatch beside full grids (unrecorded): behind the grid the late cases
            # measured faster and on time the same (docs/performance.md, "The dispatch behind a full grid"), so
            # their decisions lean to batch where streaming does better, never the reverse. The seal after the
            # full blocks (unrecorded): the layout expert by expert measured faster for both paths of one case
            # (docs/performance.md, "The seal's call expert by expert"), so their ratios stand
            continue
        gemm = r.get("gemm")
        gemm = gemm_default if gemm in (None, "auto") and gemm_default else gemm
        ranks = int(r.get("ranks", 1))
        key = (int(r["tokens_per_rank"]), gemm, ranks, int(r.get("experts_per_pe") or 256 // ranks),
               int(r.get("block_m") or 0))
        plan = ("batch",) if r["path"] == "batch" else ("streamed",) + tuple(r.get(k) for k in PLAN_KEYS)
        on_time_streamed = r["path"] == "streamed" and _case(r) == (0.0, None, 0.0)
        if on_time_streamed and not (r.get("ok") and r.get("bitwise_equal_to_batch")):
            continue  # a plan that failed a check is no candidate (nor are its late rows, without this one)
        groups.setdefault(key, {}).setdefault(plan, {})[_case(r)] = r
    rows = []
    for (tokens, gemm, ranks, epp, _bm), plans in sorted(groups.items(),
                                                       key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2:])):
        batch = plans.get(("batch",))
        if batch is None or (0.0, None, 0.0) not in batch:
            continue
        on_time = batch[(0.0, None, 0.0)]
        cases = list(batch)
        good = {p: c for p, c in plans.items() if p[0] == "streamed" and all(k in c for k in cases)
                and (0.0, None, 0.0) in c and c[(0.0, None, 0.0)].get("streamed_over_batch") is not None}
        row = {"tokens": tokens, "ranks": ranks, "experts_per_pe": epp, "block_m": int(on_time["block_m"]),
               "batch_ms": round(on_time["median_ms"], 4)}
        if gemm is not None:
            row["gemm"] = gemm
        def ms(c, k):
            # a paired streamed row was timed against its own batch graph, replays interleaved: its time on
            # the batch row's scale is its ratio over that batch times the batch row (drift between plans
            # out); others, their median
            r = c[k]
            return r["streamed_over_batch"] * batch[k]["median_ms"] if r.get("paired") else r["median_ms"]
        fastest = {k: min([batch[k]["median_ms"]] + [ms(c, k) for c in good.values()]) for k in cases}

        def regret(c):
            return max(ms(c, k) / fastest[k] for k in cases)
        best = min(good.values(), key=regret) if good else None
        rb = regret(batch)
        if best is None:
            rows.append(_decide(row, None, margin))
            continue
        rs = regret(best)
        first = dict(best[(0.0, None, 0.0)])
        # the on-time rule's input, made from the regrets: streamed is taken iff rs < rb * (1 - margin)
        first["streamed_over_batch"] = rs / rb
        on_time_ratio = best[(0.0, None, 0.0)]["streamed_over_batch"]
        # over late cases that ratio is of regrets (worst over the cases), not of on-time times: the reason says so
        compared = None if len(cases) == 1 else (
            f"was at worst {rs:.3f}x the fastest path of a case against the batch path's {rb:.3f}x, over {len(cases)} "
            f"cases; on time {on_time_ratio:.3f}x the batch path")
        decided = _decide(row, first, margin, {"consumer": "per_chunk", "source_order": "rank",
                                               "ready_window_us": None}, compared)
        decided.update(streamed_on_time_over_batch=round(on_time_ratio, 4),
                       cases=len(cases), batch_regret=round(rb, 4), streamed_regret=round(rs, 4))
        if decided["path"] == "streamed":
            decided["streamed_over_batch"] = decided["streamed_on_time_over_batch"]
        rows.append(decided)
    return rows


def build(bench: dict, source: str, margin: float, gemm_default: str | None = None) -> dict:
    if any("path" in r for r in bench.get("rows", [])):
        rows = _ep_rows(bench, gemm_default, margin)
        if not rows:
            raise SystemExit(f"{source}: no benchmark rows with a batch timing in the input")
        return {"device": bench.get("device"), "source": source, "margin": margin, "rows": rows}
    rows = []
    for r in bench.get("rows", []):
        if "batch" not in r:
            continue
        row = {"tokens": r["tokens"], "block_m": r["block_m"], "batch_ms": round(r["batch"]["median_ms"], 4)}
        rows.append(_decide(row, _fastest([s for s in r.get("streamed", []) if s.get("ok")]), margin))
    if not rows:
        raise SystemExit("no benchmark rows with a batch timing in the input")
    return {"device": bench.get("device"), "source": source, "margin": margin,
            "produced_by": f"python3 -m bench.make_adaptive_table {source}",
            "rows": sorted(rows, key=lambda x: x["tokens"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", nargs="+", help="benchmark JSON files, each FILE or FILE:GEMM")
    ap.add_argument("--out", default="streamring/moe/adaptive_table.json")
    ap.add_argument("--margin", type=float, default=0.01,
                    help="stream only where it beats batch by more than this fraction (noise guard)")
    args = ap.parse_args(argv)
    tables = []
    for spec in args.bench_json:
        path, _, gemm = spec.partition(":")
        if not Path(path).is_file():
            ap.error(f"bench_json: no such file {path!r}")
        tables.append(build(json.loads(Path(path).read_text()), spec, args.margin, gemm or None))
    # a later file supersedes an earlier one's row for the same setting (tokens, GEMM, ranks, experts per PE,
    # block size)
    latest = {(r["tokens"], r.get("gemm"), r.get("ranks"), r.get("experts_per_pe"), r.get("block_m")): r
              for t in tables for r in t["rows"]}
    table = {"device": tables[0].get("device"), "source": " ".join(args.bench_json), "margin": args.margin,
             "produced_by": "python3 -m bench.make_adaptive_table " + " ".join(args.bench_json),
             "rows": sorted(latest.values(),
                            key=lambda x: (x["tokens"], str(x.get("gemm")), x.get("ranks", 0), x.get("experts_per_pe", 0),
                                           x.get("block_m", 0)))}
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    for r in table["rows"]:
        where = f" ({r['gemm']}, {r['ranks']} ranks, {r.get('experts_per_pe')} experts per PE)" if "gemm" in r else ""
        print(f"{r['tokens']:>6} tokens{where}: {r['path']}" + (
            f" ({r.get('reason')})" if r["path"] == "batch" else
            f" {r['chunks']} chunks {r['policy']} {r.get('source_order')} order (regret {r.get('streamed_regret')} "
            f"against batch's {r.get('batch_regret')} over {r.get('cases')} cases)"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
