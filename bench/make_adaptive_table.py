#!/usr/bin/env python3
"""Build the adaptive policy's tuned table from layer-benchmark results.

    python3 -m bench.make_adaptive_table docs/results/gpu-layer-2026-11-29.json \
        --out streamring/moe/adaptive_table.json

For every token count in the benchmark JSON: the fastest streamed configuration that passed
its checks (bitwise equal to batch, no ring violation or timeout) if it beat the batch path in
the same interleaved run (streamed/batch < 1 - margin), else the batch path (one chunk).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build(bench: dict, source: str, margin: float) -> dict:
    rows = []
    for r in bench.get("rows", []):
        if "batch" not in r:
            continue
        ok = [s for s in r.get("streamed", []) if s.get("ok")]
        best = min(ok, key=lambda s: s["streamed_over_batch"]) if ok else None
        row = {"tokens": r["tokens"], "block_m": r["block_m"], "batch_ms": round(r["batch"]["median_ms"], 4)}
        if best is not None and best["streamed_over_batch"] < 1.0 - margin:
            row.update(path="streamed", chunks=best["chunks"], num_slots=best["num_slots"], policy=best["policy"],
                       streamed_over_batch=round(best["streamed_over_batch"], 4))
        else:
            row.update(path="batch", chunks=1,
                       reason=(f"best streamed config ({best['chunks']} chunks, {best['policy']}) was "
                               f"{best['streamed_over_batch']:.3f}x the batch path" if best else
                               "no streamed configuration passed"))
        rows.append(row)
    if not rows:
        raise SystemExit("no benchmark rows with a batch timing in the input")
    return {"device": bench.get("device"), "source": source, "margin": margin,
            "produced_by": f"python3 -m bench.make_adaptive_table {source}",
            "rows": sorted(rows, key=lambda x: x["tokens"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json")
    ap.add_argument("--out", default="streamring/moe/adaptive_table.json")
    ap.add_argument("--margin", type=float, default=0.01,
                    help="stream only where it beats batch by more than this fraction (noise guard)")
    args = ap.parse_args(argv)
    table = build(json.loads(Path(args.bench_json).read_text()), args.bench_json, args.margin)
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    for r in table["rows"]:
        print(f"{r['tokens']:>6} tokens: {r['path']}" + (f" ({r.get('reason')})" if r["path"] == "batch" else
                                                           f" {r['chunks']} chunks {r['policy']}"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
