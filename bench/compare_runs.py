"""Side by side: ``bench.ep_layer`` result files of the same cases run with different switches (an A/B of
``launch/seal_layout_ab.sh``, ``launch/ab_env.sh``), paired by case.

    python -m bench.compare_runs default=OUT/1-default/ep-layer-mps.json by_expert=OUT/1-by_expert/ep-layer-mps.json

A case is (tokens per PE, GEMMs, path, late PE, lateness in ms, lateness kind). For every case and run the
median and its ratio to that run's own on-time batch path (the RFC's measure, within one run), then each run's
median over the first run's (between runs of one call: the card's drift falls on both). Exit 2 when a file has
no rows; a case a run lacks prints ``-``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def case_of(r: dict) -> tuple:
    return (r.get("tokens_per_rank"), r.get("gemm"), r.get("path"), r.get("straggler_rank"),
            float(r.get("straggler_ms") or 0.0), r.get("lateness", "none"))


def load_rows(path: Path) -> list[dict]:
    d = json.loads(Path(path).read_text())
    rows = d["rows"] if isinstance(d, dict) else d
    return [r for r in rows if "median_ms" in r and r.get("path") in ("batch", "streamed")]


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    """One line per case: ``{"case": ..., label: {"ms", "over_on_time_batch", "over_first"}}``."""
    names = list(runs)
    by = {n: {case_of(r): r for r in rows} for n, rows in runs.items()}
    on_time = {n: {(c[0], c[1]): r["median_ms"] for c, r in cases.items()
                   if c[2] == "batch" and c[4] == 0.0 and c[5] == "none"} for n, cases in by.items()}
    lines = []
    for case in sorted({c for cases in by.values() for c in cases}, key=lambda c: tuple(str(v) for v in c)):
        line = {"case": case}
        first = by[names[0]].get(case)
        for n in names:
            r = by[n].get(case)
            if r is None:
                line[n] = None
                continue
            base = on_time[n].get((case[0], case[1]))
            line[n] = {"ms": r["median_ms"], "over_on_time_batch": r["median_ms"] / base if base else None,
                       "over_first": r["median_ms"] / first["median_ms"] if first else None,
                       "bitwise": r.get("bitwise_equal_to_batch")}
        lines.append(line)
    return lines


def _cell(v: dict | None) -> str:
    if v is None:
        return f"{'-':>26}"
    otb = "-" if v["over_on_time_batch"] is None else f"{v['over_on_time_batch']:.3f}x"
    of = "-" if v["over_first"] is None else f"{v['over_first']:.3f}x"
    return f"{v['ms']:8.3f} {otb:>8} {of:>8}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=FILE", help="bench.ep_layer --json files, the first the base")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            ap.error(f"{spec!r} is not LABEL=FILE")
        rows = load_rows(Path(path))
        if not rows:
            print(f"error: {path} has no timed rows", file=sys.stderr)
            return 2
        runs[label] = rows
    print(f"{'tokens':>6} {'gemm':8} {'path':8} {'late':>9} {'kind':9} "
          + " ".join(f"{n + ': ms, /on-time batch, /' + next(iter(runs)):>26}" for n in runs))
    for line in compare(runs):
        t, gemm, path, pe, ms, kind = line["case"]
        late = "on time" if ms == 0.0 else f"PE{pe} {ms:g}ms"
        print(f"{t!s:>6} {gemm!s:8} {path:8} {late:>9} {kind!s:9} " + " ".join(_cell(line[n]) for n in runs))
    bad = [n for n, rows in runs.items() for r in rows if r.get("bitwise_equal_to_batch") is False]
    if bad:
        print(f"NOT bitwise equal to batch in: {sorted(set(bad))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
