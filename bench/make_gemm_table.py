#!/usr/bin/env python3
"""Build the expert-GEMM heuristic table (``streamring/gemm/table.json``) from ``bench.gemm`` runs.

    python -m bench.make_gemm_table docs/results/gemm-all-vs-deepgemm-psum-128-32768-2026-12-01.json \
        docs/results/gemm-triton-vs-deepgemm-1024-bm64-2026-12-02.json --out streamring/gemm/table.json

Each (tokens, GEMM, block size) entry is taken whole from one run: the last file given that measured
that size with that ``--block-m`` (:func:`bench.gemm_lib.make_table` of its rows), so the times an entry
compares were taken side by side in one process, never mixed across runs. Every entry names its file
(``source``) and the run's block size (``run_block_m``; ``gemm.choice`` prefers the entries of the
consumer's block size: the one-block-per-tile CUTLASS tiles are measured at 128 only). The runs must
share the device: a file measured on another is refused, naming both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import dsv3_shape
from bench.gemm_lib import make_table


def merge(paths: list[str]) -> dict:
    """The table of ``paths`` (later files replace earlier ones' entries of the same tokens and GEMM)."""
    if not paths:
        raise ValueError("give at least one bench.gemm JSON file")
    shape = dsv3_shape(64)  # the shape every bench.gemm run measures (its experts and top-k)
    entries: dict = {}
    first = None
    dates = []
    for p in paths:
        run = json.loads(Path(p).read_text())
        meta = run.get("meta", {})
        here = {"device": meta.get("device")}
        block_m = meta.get("args", {}).get("block_m")
        if first is None:
            first = (p, here)
        elif here != first[1]:
            raise ValueError(f"{p} was measured on device {here['device']!r}, {first[0]} on "
                             f"{first[1]['device']!r}: one table holds one device")
        table = make_table(run.get("rows", []), shape.num_experts, shape.topk, meta)
        for e in table["entries"]:
            entries[(e["tokens"], e["gemm"], block_m)] = dict(e, run_block_m=block_m, source=str(p))
        dates.append(meta.get("date") or "")
    out = sorted(entries.values(), key=lambda e: (e["gemm"], e["rows_per_expert"], e["run_block_m"] or 0))
    return {"measured": bool(out), "date": max(dates), "device": first[1]["device"],
            "source": "python -m bench.make_gemm_table " + " ".join(str(p) for p in paths),
            "note": "per (rows per expert = tokens x top-k / experts, N, K): median ms of every implementation "
                    "variant that passed its correctness check, all from the one run named by the entry's "
                    "source; choose_gemm takes the fastest available one",
            "entries": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench.gemm --json files, oldest first")
    ap.add_argument("--out", help="write the table here (default: print it)")
    args = ap.parse_args(argv)
    try:
        table = merge(args.runs)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        print(f"make_gemm_table: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(table, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        for e in table["entries"]:
            best = f"{e['best']} ({e['times_ms'][e['best']]:.3f} ms)" if e["best"] else "none of ours (torch only)"
            print(f"{e['tokens']:6d} {e['gemm']}: best {best} from {e['source']}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
