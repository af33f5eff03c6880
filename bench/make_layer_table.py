"""Write streamring/moe/layer_table.json (``gemm="auto"``'s whole-layer rows, streamring/moe/layer_choice.py) from
bench.ep_layer results: per run and setting, the batch path's on-time median of every backend the run measured,
where it measured at least two, and beside it the on-time median of each backend's default streamed plan where the
run measured it (what ``streaming="auto"`` runs where it streams).

    python -m bench.make_layer_table docs/results/A.json [B.json ...] [--out PATH]

A results file is bench.ep_layer's JSON (a list of rows) or a merged one (``{"rows": [...]}``, each row tagged
with its ``run``); rows without a ``run`` take the file's name. Only rows of the batch path, on time (no lateness,
straggler or skew), on the default grid (no CTA cap, no reserved SMs) count; a backend measured twice in one run
and setting keeps its smaller median. A streamed row counts where it is the plan a buffer with default tuning runs:
one chunk, the ready order, the per-chunk consumer, ``spin_kernel``, the backend's own grid at every call (no
``--ctas``, no waves), launched with the forward.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from bench.common import dsv3_shape
from bench.ep_layer import megamoe_shape
from streamring.moe.layer_choice import TABLE_PATH

SHAPES = {"dsv3": dsv3_shape, "megamoe": megamoe_shape}


def on_time_on_default_grid(r: dict) -> bool:
    return (r.get("lateness", "none") in (None, "none") and not r.get("straggler_ms") and not r.get("skew_ms")
            and r.get("chunk_gemm_ctas") is None and r.get("reserved_sms") is None and r.get("median_ms") is not None
            and r.get("seal_by_expert") is not False)  # the seal after the full blocks: not the default layout


def on_time_batch(r: dict) -> bool:
    return r.get("path") == "batch" and on_time_on_default_grid(r)


def on_time_default_streamed(r: dict) -> bool:
    return (r.get("path") == "streamed" and on_time_on_default_grid(r) and r.get("chunks") == 1
            and r.get("source_order") == "ready" and r.get("consumer") == "per_chunk"
            and r.get("policy") == "spin_kernel" and r.get("streamed_grid_waves") in (None, 1)
            and not r.get("launch_ahead") and r.get("dispatch_beside_grid") is not True)


def rows_of(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    return [{**r, "run": f"{path.name}:{r.get('run', 'all')}"} for r in rows]


def layer_rows(rows: list[dict]) -> list[dict]:
    groups: dict[str, dict[tuple, dict[str, float]]] = {"batch_ms": defaultdict(dict), "streamed_ms": defaultdict(dict)}
    for field, keep in (("batch_ms", on_time_batch), ("streamed_ms", on_time_default_streamed)):
        for r in filter(keep, rows):
            shape = SHAPES[r.get("shape", "dsv3")](r["block_m"], r["experts_per_pe"] * r["ranks"])
            key = (r["run"], r["ranks"], r["experts_per_pe"], shape.hidden, shape.intermediate, shape.topk,
                   r["block_m"], r["tokens_per_rank"])
            ms = groups[field][key]
            ms[r["gemm"]] = round(min(ms.get(r["gemm"], float("inf")), r["median_ms"]), 4)
    out = []
    for key, ms in sorted(groups["batch_ms"].items(), key=lambda kv: kv[0][1:] + kv[0][:1]):
        run, ranks, epp, h, i, k, bm, tokens = key
        if len(ms) >= 2:
            row = dict(ranks=ranks, experts_per_pe=epp, hidden=h, intermediate=i, topk=k, block_m=bm,
                       tokens_per_rank=tokens, batch_ms=ms, run=run)
            streamed = {g: v for g, v in groups["streamed_ms"].get(key, {}).items() if g in ms}
            if streamed:
                row["streamed_ms"] = streamed
            out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=TABLE_PATH)
    a = ap.parse_args(argv)
    rows = layer_rows([r for p in a.results for r in rows_of(p)])
    table = {"produced_by": "python3 -m bench.make_layer_table " + " ".join(str(p) for p in a.results),
             "rows": rows}
    a.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{a.out}: {len(rows)} rows")
    for r in rows:
        print(f"  {r['ranks']} PE(s) x {r['experts_per_pe']} experts, block_m {r['block_m']}, {r['tokens_per_rank']} "
              f"tokens: batch " + ", ".join(f"{g} {ms:.3f}" for g, ms in sorted(r["batch_ms"].items(), key=lambda kv: kv[1]))
              + ("; streamed " + ", ".join(f"{g} {ms:.3f}" for g, ms in sorted(r["streamed_ms"].items(),
                                                                             key=lambda kv: kv[1]))
                 if r.get("streamed_ms") else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
