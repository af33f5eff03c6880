#!/usr/bin/env python3
"""Build the adaptive policy's tuned table from layer-benchmark results.

    python3 -m bench.make_adaptive_table docs/results/ep-layer-2h200-triton-128-8192-2026-11-30.json:triton \
        docs/results/ep-layer-2h200-cutlass-1024-8192-2026-11-30.json:cutlass --out streamring/moe/adaptive_table.json

Two input forms: the expert-parallel layer benchmark (``python -m bench.ep_layer``: one row per
measured path) and the older single-layer benchmark (rows with ``batch`` and ``streamed`` lists).
For every (token count per rank, GEMM, ranks, experts per PE): the fastest streamed configuration that
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


def _decide(row: dict, best: dict | None, margin: float, config: dict | None = None) -> dict:
    """``row`` with the decision: streamed with ``best``'s configuration if it beat batch by more than
    ``margin``, else batch with the reason. ``config``: what else a streamed row records ({key: default},
    read from ``best``); a ``consumer`` among them is named in the reason too."""
    extra = {k: best.get(k, d) for k, d in (config or {}).items()} if best else {}
    if best is not None and best["streamed_over_batch"] < 1.0 - margin:
        row.update(path="streamed", chunks=best["chunks"], num_slots=best["num_slots"], policy=best["policy"], **extra,
                   streamed_over_batch=round(best["streamed_over_batch"], 4))
    elif best is not None:
        consumer = f", {extra['consumer']} consumer" if "consumer" in extra else ""
        row.update(path="batch", chunks=1, reason=f"best streamed config ({best['chunks']} chunks, {best['policy']}"
                                                  f"{consumer}) was {best['streamed_over_batch']:.3f}x the batch path")
    else:
        row.update(path="batch", chunks=1, reason="no streamed configuration passed")
    return row


def _fastest(streamed: list) -> dict | None:
    return min(streamed, key=lambda s: s["streamed_over_batch"]) if streamed else None


def _ep_rows(bench: dict, gemm_default: str | None, margin: float) -> list[dict]:
    """Table rows from the EP-layer benchmark's per-path rows."""
    groups: dict = {}
    for r in bench.get("rows", []):
        if r.get("straggler_ms") or r.get("skew_ms") or r.get("routing", "uniform") != "uniform":
            continue
        gemm = r.get("gemm")
        gemm = gemm_default if gemm in (None, "auto") and gemm_default else gemm
        ranks = int(r.get("ranks", 1))
        key = (int(r["tokens_per_rank"]), gemm, ranks, int(r.get("experts_per_pe") or 256 // ranks))
        groups.setdefault(key, {"batch": None, "streamed": []})
        if r["path"] == "batch":
            groups[key]["batch"] = r
        elif r.get("ok") and r.get("bitwise_equal_to_batch") and r.get("streamed_over_batch") is not None:
            groups[key]["streamed"].append(r)
    rows = []
    for (tokens, gemm, ranks, epp), g in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2:])):
        if g["batch"] is None:
            continue
        row = {"tokens": tokens, "ranks": ranks, "experts_per_pe": epp, "block_m": int(g["batch"]["block_m"]),
               "batch_ms": round(g["batch"]["median_ms"], 4)}
        if gemm is not None:
            row["gemm"] = gemm
        rows.append(_decide(row, _fastest(g["streamed"]), margin,
                            {"consumer": "per_chunk", "source_order": "rank"}))
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
    table = {"device": tables[0].get("device"), "source": " ".join(args.bench_json), "margin": args.margin,
             "produced_by": "python3 -m bench.make_adaptive_table " + " ".join(args.bench_json),
             "rows": sorted((r for t in tables for r in t["rows"]),
                            key=lambda x: (x["tokens"], str(x.get("gemm")), x.get("ranks", 0)))}
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    for r in table["rows"]:
        where = f" ({r['gemm']}, {r['ranks']} ranks)" if "gemm" in r else ""
        print(f"{r['tokens']:>6} tokens{where}: {r['path']}" + (f" ({r.get('reason')})" if r["path"] == "batch" else
                                                                  f" {r['chunks']} chunks {r['policy']}"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
