"""The cost model's fit, check and prediction grid (the model: :mod:`streamring.moe.cost_model`).

Run ``python -m bench.cost_model --check [FILES...]`` (measured beside predicted, exit 1 past ±10 %),
``--fit [FILES...]`` (refit the rates, write ``streamring/moe/cost_model_rates.json``, then check) or
``--predict --out DIR`` (streamed ÷ batch over EP 8-64, NVLink and inter-node, 128-32768 tokens per
rank: a CSV, a markdown table and a PNG heat map). The model's equations, parameters and what it leaves
out are in :mod:`streamring.moe.cost_model`'s docstring.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys

import numpy as np

from streamring.moe.cost_model import (CALL_US, E_TOTAL_DSV3, FALLBACK_RATES, FLOP_ROW,  # noqa: F401
                                       INTER_NODE_GBPS, NVLINK_GBPS, RATES_PATH, ROW_BYTES, TOPK, W_BYTES, Config,
                                       _RATES_CACHE, _block_counts, _norm, comb_bytes, load_rates, predict,
                                       pull_bytes)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "docs", "results")
DEFAULT_FILES = sorted(glob.glob(os.path.join(RESULTS, "ep-layer-*.json")))
DEFAULT_TIMELINES = [os.path.join(RESULTS, "ep-timelines-2h200-triton-2026-11-30.json"),
                     os.path.join(RESULTS, "ep-timelines-mps2-32experts-one-chunk-late-ranks-2026-12-03.json")]

# ---------------------------------------------------------------- measured rows

def machine_of(path: str) -> str:
    name = os.path.basename(path)
    return "mps" if "mps" in name else "gpu"


def _split_spec(spec: str):
    if ":" in spec and spec.rsplit(":", 1)[1] in ("mps", "gpu", "2h200", "1pe"):
        p, k = spec.rsplit(":", 1)
        return p, ("mps" if k == "mps" else "gpu")
    return spec, None


def load_rows(files, machines: dict | None = None):
    """The modelled rows of result files: (row config, measured ms, row dict, file). Skipped: paths
    other than batch/streamed, consumer other than per_chunk, routing other than uniform."""
    machines = machines or {}
    out, skipped = [], {}
    for spec in files:
        path, kind = _split_spec(spec)
        kind = kind or machines.get(path) or machines.get(os.path.basename(path)) or machine_of(path)
        with open(path) as f:
            data = json.load(f)
        rows = data["rows"] if isinstance(data, dict) else data
        base = os.path.basename(path)
        seen = {}
        for r in rows:
            why = None
            if r.get("path") not in ("batch", "streamed"):
                why = f"path {r.get('path')}"
            elif r.get("consumer", "per_chunk") != "per_chunk":
                why = f"consumer {r.get('consumer')}"
            key = (r.get("tokens_per_rank"), r.get("path"), r.get("chunks"), r.get("source_order"),
                   r.get("chunk_gemm_ctas"), r.get("straggler_ms"))
            n = seen.get(key, 0)
            seen[key] = n + 1
            routing = r.get("routing")
            if routing is None and "2h200" in base and n % 2 == 1:
                routing = "router"      # the second row of each pair of the 2-H200 files
            if why is None and (routing or "uniform") != "uniform":
                why = f"routing {routing}"
            if why:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            gemm = r.get("gemm")
            if gemm in (None, "auto"):
                gemm = "cutlass" if "cutlass" in base else ("deep_gemm" if "deepgemm" in base else "triton")
            R = int(r["ranks"])
            E = r.get("experts_per_pe") or E_TOTAL_DSV3 // R
            cfg = Config(ranks=R, tokens=int(r["tokens_per_rank"]), experts_per_pe=int(E), gemm=gemm,
                         block_m=int(r.get("block_m") or 64), path=r["path"],
                         chunks=int(r.get("chunks") or (1 if r["path"] == "batch" else 2)),
                         source_order=r.get("source_order") or "rank", machine=kind,
                         straggler_ms=float(r.get("straggler_ms") or 0.0),
                         straggler_rank=r.get("straggler_rank"), skew_ms=float(r.get("skew_ms") or 0.0))
            if cfg.straggler_ms and cfg.straggler_rank is None and R > 1:
                cfg.straggler_rank = 1          # the 2-H200 runs delayed rank 1's producer
            out.append((cfg, float(r["median_ms"]), r, base))
    return out, skipped


def is_fit_row(cfg: Config) -> bool:
    return cfg.path == "batch" and not cfg.straggler_ms and not cfg.skew_ms


# ---------------------------------------------------------------- fitting

def _gemm_design(cfg):
    E = cfg.experts_per_pe
    share = cfg.ranks if cfg.machine == "mps" else 1
    t, b = _block_counts(cfg.tokens * TOPK / E, E, 1, cfg.block_m)
    return [1.0, share * t[0] * W_BYTES * 1e-9, share * b[0] * cfg.block_m * FLOP_ROW * 1e-12]


def _lstsq_gemm(A, y, call_ms=None):
    """(call ms, 1/BW [ms per GB], 1/F [ms per TFLOP]) minimising the relative error; with call_ms
    given, only the two rates."""
    A, y = np.array(A), np.array(y)
    wgt = 1.0 / y
    if call_ms is not None:
        x, *_ = np.linalg.lstsq(A[:, 1:] * wgt[:, None], (y - call_ms) * wgt, rcond=None)
        x = np.concatenate([[call_ms], x])
    else:
        x, *_ = np.linalg.lstsq(A * wgt[:, None], y * wgt, rcond=None)
    return np.maximum(x, [0.0, 1e-6, 1e-6])


def _rates_of(x, n, on, block_m=64):
    return {"call_us": float(x[0] * 1e3), "bw_GBps": float(1e3 / x[1]), "tflops": float(1e3 / x[2]),
            "t_w_us": float(W_BYTES * 1e-9 * x[1] * 1e3), "t_b_us_block64": float(block_m * FLOP_ROW * 1e-12 * x[2] * 1e3),
            "fit_rows": n, "fit_on": on}


def _fit_gemm(rows, rates):
    """One weighted linear least-squares fit per machine kind (relative errors) of the rates the
    timelines do not give: per GEMM implementation (call_us, 1/BW, 1/F), and on one GPU per PE also
    c_fix, c_tok, the link efficiency (dispatch and combine bytes over the nominal NVLink) and the
    cross-GPU fixed cost. Equations: each on-time batch row's gemm_only_ms (the mean over PEs: the
    GEMM term alone) and its median (every phase; producer and dispatch step from the timelines).
    DeepGEMM is fitted afterwards (its gemm_only is a whole-buffer timing larger than its forward)."""
    out = {}
    for kind in ("gpu", "mps"):
        m = rates["machine"][kind]
        impls = sorted({cfg.gemm for cfg, *_ in rows if cfg.machine == kind and cfg.gemm != "deep_gemm"
                        and is_fit_row(cfg)})
        if not impls:
            continue
        extra = ["c_fix", "c_tok", "inv_eff"] if kind == "gpu" else []
        names = extra + [f"{i}.{k}" for i in impls for k in ("invbw", "invf")]
        col = {n: j for j, n in enumerate(names)}
        A, y, n_rows = [], [], {}
        for cfg, med, r, _ in rows:
            if cfg.machine != kind or cfg.gemm not in impls or not is_fit_row(cfg):
                continue
            g = _gemm_design(cfg)
            gem = np.zeros(len(names))
            for k, v in zip(("invbw", "invf"), g[1:]):
                gem[col[f"{cfg.gemm}.{k}"]] = v
            call = CALL_US * 1e-3
            n_rows[cfg.gemm] = n_rows.get(cfg.gemm, 0) + 1
            if r.get("gemm_only_ms"):
                A.append(gem)
                y.append(float(np.mean(r["gemm_only_ms"])) - call)
            row = gem.copy()
            R, T, E = cfg.ranks, cfg.tokens, cfg.experts_per_pe
            known = call + (m["p_fix_us"] + m["p_tok_us"] * T + m["d_fix_us"]) * 1e-3
            if kind == "gpu":
                row[col["c_fix"]] = 1.0
                row[col["c_tok"]] = T
                row[col["inv_eff"]] = (pull_bytes(T, R, E) + (comb_bytes(T, R) if R > 1 else 0.0)) / (NVLINK_GBPS * 1e9) * 1e3
            else:
                known += (m["c_fix_us"] + m["c_tok_us"] * T) * 1e-3 + pull_bytes(T, R, E) / (m["local_GBps"] * 1e9) * 1e3
            A.append(row)
            y.append(med - known)
        A, y = np.array(A), np.array(y)
        wgt = 1.0 / np.maximum(np.abs(y), 1e-3)
        x, *_ = np.linalg.lstsq(A * wgt[:, None], y * wgt, rcond=None)
        for n, v in zip(names, x):
            if kind == "gpu" and n in extra:
                v = max(float(v), 0.0)
                if n == "c_fix":
                    m["c_fix_us"] = v * 1e3
                elif n == "c_tok":
                    m["c_tok_us"] = v * 1e3
                elif n == "inv_eff":
                    m["link_eff"] = 1.0 / v if v > 0 else 1.0
        for i in impls:
            xi = np.maximum([CALL_US * 1e-3, x[col[f"{i}.invbw"]], x[col[f"{i}.invf"]]], [0.0, 1e-6, 1e-6])
            key = i if kind == "gpu" else f"{i}@mps"
            out[key] = _rates_of(xi, n_rows[i], "gemm_only_ms and medians of the on-time batch rows")
        if kind == "gpu":
            m["fit_on"] = "c_fix, c_tok, link_eff: with the GEMM rates, on the on-time batch rows"
    rates["gemm"].update(out)
    return out


def _fit_machine_from_timelines(timeline_files, kind_of):
    """Least-squares lines per machine kind from the device timelines (µs): the producer
    (layout_published - produce_start against chunk tokens; only timelines of the current code, which
    carry ``path``), the dispatch step (dispatched_acked - acquired against the bytes pulled: the batch
    entries, and the first chunk of streamed entries, whose dispatch waits behind no GEMM) and the
    combine of the batch path (combine_done - seal_blocks_done against tokens)."""
    acc = {}
    for path in timeline_files:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            d = json.load(f)
        kind = kind_of(path)
        tl = d.get("all_timelines") or d.get("timelines") or []
        a = acc.setdefault(kind, {"prod": [], "disp": [], "comb": [], "src": []})
        a["src"].append(os.path.relpath(path, ROOT) if path.startswith(ROOT) else path)
        for t in tl:
            if t.get("straggler_ms") or t.get("skew_ms"):
                continue
            R = t.get("ranks", 1)
            E = t.get("experts_per_pe") or E_TOTAL_DSV3 // R
            f = 1 - (1 - E / (E * R)) ** TOPK
            n = t.get("chunk_tokens") or t.get("tokens")
            current = "path" in t
            if current:
                for c in t["chunks"]:
                    a["prod"].append((n, c["layout_published"] - c["produce_start"]))
            c = t["chunks"][0]
            if t.get("path") == "batch" or (not current and t.get("source_order") == "rank"):
                a["disp"].append(((R - 1) * n * f * ROW_BYTES, c["dispatched_acked"] - c["acquired"]))
            if t.get("path") == "batch":
                tail = t["tail"]
                a["comb"].append((t["tokens"], tail["combine_done"] - tail["seal_blocks_done"]))
    out = {}

    def line(pts):
        x = np.array([p[0] for p in pts], float)
        y = np.array([p[1] for p in pts], float)
        if len(set(x)) < 2:
            return max(float(np.median(y)), 0.0), 0.0
        k, c0 = np.polyfit(x, y, 1)
        return max(float(c0), 0.0), max(float(k), 0.0)
    for kind, a in acc.items():
        o = {"timeline_sources": a["src"]}
        if len(a["prod"]) >= 3:
            o["p_fix_us"], o["p_tok_us"] = line(a["prod"])
        if len(a["disp"]) >= 3:
            d0, k = line(a["disp"])
            o["d_fix_us"] = d0
            if kind == "mps" and k:
                o["local_GBps"] = 1e-3 / k
        if len(a["comb"]) >= 3:
            o["c_fix_us"], o["c_tok_us"] = line(a["comb"])
        out[kind] = o
    return out


def _fit_deep_gemm(rows, rates):
    pts = [(cfg, med) for cfg, med, r, _ in rows if cfg.gemm == "deep_gemm" and is_fit_row(cfg)]
    if len(pts) < 3:
        return 0
    A, y = [], []
    for cfg, med in pts:
        p0 = predict(cfg, rates)
        other = p0["total_ms"] - p0["gemm_ms"]
        A.append(_gemm_design(cfg))
        y.append(med - other)
    rates["gemm"]["deep_gemm"] = _rates_of(_lstsq_gemm(A, y, CALL_US * 1e-3), len(y),
                                           "batch medians less the modelled producer/dispatch/combine")
    return len(y)


def fit(files, timeline_files, machines=None) -> dict:
    """Refit every rate from the result files and timelines; a rate with no source keeps the value of
    the current rates JSON (or the fallback)."""
    rows, _ = load_rows(files, machines)
    rates = json.loads(json.dumps(load_rates()))
    for k in ("sources",):
        rates.pop(k, None)
    kind_of = lambda p: _split_spec(p)[1] or machine_of(_split_spec(p)[0])
    tl = _fit_machine_from_timelines([_split_spec(p)[0] for p in timeline_files], kind_of)
    for kind, vals in tl.items():
        rates["machine"][kind].update(vals)
    g, mp = rates["machine"]["gpu"], rates["machine"]["mps"]
    if not any("p_fix_us" in v for k, v in tl.items() if k == "gpu") and "p_fix_us" in tl.get("mps", {}):
        # no current-code timeline on one GPU per PE: the producer measured under MPS (half the SMs, the
        # peer's producer beside it) stands for it
        g["p_fix_us"], g["p_tok_us"] = mp["p_fix_us"], mp["p_tok_us"]
        g["producer_from"] = "the MPS timelines"
    _fit_gemm(rows, rates)
    n_dg = _fit_deep_gemm(rows, rates)
    rel = lambda p: os.path.relpath(p, ROOT) if os.path.abspath(p).startswith(ROOT) else p
    rates["sources"] = {
        "files": [rel(_split_spec(p)[0]) for p in files],
        "timelines": [rel(_split_spec(p)[0]) for p in timeline_files if os.path.exists(_split_spec(p)[0])],
        "fit_rows": {"gemm_only": {k: v.get("fit_rows") for k, v in rates["gemm"].items()},
                     "deep_gemm_batch_medians": n_dg},
        "checked_only": "every streamed row, every batch row with a late rank or skew",
    }
    _RATES_CACHE.clear()
    return rates


# ---------------------------------------------------------------- check

def check(files, machines=None, rates=None, tol=0.10, out=None) -> int:
    out = out or sys.stdout
    rows, skipped = load_rows(files, machines)
    rates = rates or load_rates()
    hdr = ("file", "R", "T", "E/PE", "gemm", "path", "plan", "late", "fit", "meas ms", "pred ms", "err %")
    lines = []
    for cfg, med, r, base in rows:
        p = predict(cfg, rates)["total_ms"]
        err = (p - med) / med * 100
        plan = "-" if cfg.path == "batch" else f"C{cfg.chunks} {cfg.source_order}" + (
            f" ctas{r['chunk_gemm_ctas']}" if r.get("chunk_gemm_ctas") else "")
        late = (f"{cfg.straggler_ms:g}ms@{cfg.straggler_rank}" if cfg.straggler_ms else
                (f"skew{cfg.skew_ms:g}" if cfg.skew_ms else "-"))
        lines.append((base[:48], cfg.ranks, cfg.tokens, cfg.experts_per_pe, cfg.gemm, cfg.path, plan, late,
                      "fit" if is_fit_row(cfg) else "chk", f"{med:.3f}", f"{p:.3f}", err))
    w = [max(len(str(h)), *(len(str(l[i]) if i != 11 else f"{l[i]:+.1f}") for l in lines)) if lines else len(h)
         for i, h in enumerate(hdr)]
    print("  ".join(str(h).ljust(w[i]) for i, h in enumerate(hdr)), file=out)
    for l in lines:
        cells = [str(c) for c in l[:11]] + [f"{l[11]:+.1f}"]
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(cells)), file=out)
    n = len(lines)
    ok = sum(abs(l[11]) <= tol * 100 for l in lines)
    print(f"\n{ok} of {n} configurations within ±{tol * 100:.0f} %"
          + (f"; skipped: {', '.join(f'{v} {k}' for k, v in sorted(skipped.items()))}" if skipped else ""),
          file=out)
    for kind in ("fit", "chk"):
        sub = [l for l in lines if l[8] == kind]
        if sub:
            print(f"  {'fit rows' if kind == 'fit' else 'checked-only rows'}: {sum(abs(l[11]) <= tol * 100 for l in sub)}"
                  f" of {len(sub)} within, median |err| {np.median([abs(l[11]) for l in sub]):.1f} %", file=out)
    worst = sorted(lines, key=lambda l: -abs(l[11]))[:8]
    if worst:
        print("worst:", file=out)
        for l in worst:
            print(f"  {l[0]} R{l[1]} T{l[2]} E{l[3]} {l[4]} {l[5]} {l[6]} late {l[7]}: measured {l[9]}, "
                  f"predicted {l[10]} ({l[11]:+.1f} %)", file=out)
    return 0 if ok == n else 1


# ---------------------------------------------------------------- predict grid

def predict_grid(out_dir, gemm="triton", late_ms=1.0, rates=None):
    rates = rates or load_rates()
    os.makedirs(out_dir, exist_ok=True)
    eps = [8, 16, 32, 64]
    links = [("nvlink", NVLINK_GBPS), ("inter-node", INTER_NODE_GBPS)]
    toks = [2 ** k for k in range(7, 16)]
    recs = []
    for lname, bw in links:
        for late in (0.0, late_ms):
            for ep in eps:
                for T in toks:
                    base = dict(ranks=ep, tokens=T, experts_per_pe=256 // ep, gemm=gemm, machine="gpu",
                                link_GBps=bw, straggler_ms=late, straggler_rank=ep - 1 if late else None,
                                block_m=64)
                    b = predict(dict(base, path="batch"), rates)
                    best = None
                    for C, order in ((1, "ready"), (2, "arrival"), (4, "arrival")):
                        s = predict(dict(base, path="streamed", chunks=C, source_order=order), rates)
                        if best is None or s["total_ms"] < best[1]["total_ms"]:
                            best = (C, s)
                    recs.append({"link": lname, "link_GBps": bw, "late_ms": late, "ep": ep,
                                 "experts_per_pe": 256 // ep, "tokens_per_rank": T,
                                 "batch_ms": round(b["total_ms"], 4), "streamed_ms": round(best[1]["total_ms"], 4),
                                 "chunks": best[0], "streamed_over_batch": round(best[1]["total_ms"] / b["total_ms"], 4),
                                 "batch_gemm_ms": round(b["gemm_ms"], 4), "streamed_gemm_ms": round(best[1]["gemm_ms"], 4),
                                 "batch_dispatch_ms": round(b["dispatch_ms"], 4)})
    csv_path = os.path.join(out_dir, "cost-model-predict.csv")
    with open(csv_path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(recs[0]))
        wr.writeheader()
        wr.writerows(recs)
    md = [f"# streamed ÷ batch predicted by bench.cost_model ({gemm} GEMMs, best of one chunk in the ready order and 2 or 4 in the arrival order, "
          f"one GPU per PE, 256 experts over EP)\n"]
    for lname, _ in links:
        for late in (0.0, late_ms):
            md.append(f"\n## {lname}, {'late rank ' + format(late, 'g') + ' ms' if late else 'no late rank'}\n")
            md.append("| EP | " + " | ".join(str(t) for t in toks) + " |")
            md.append("|---|" + "---|" * len(toks))
            for ep in eps:
                cells = [f"{r['streamed_over_batch']:.2f}" for r in recs
                         if r["link"] == lname and r["late_ms"] == late and r["ep"] == ep]
                md.append(f"| {ep} | " + " | ".join(cells) + " |")
    md_path = os.path.join(out_dir, "cost-model-predict.md")
    with open(md_path, "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    png_path = os.path.join(out_dir, "cost-model-predict.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(2, 2, figsize=(13, 7), constrained_layout=True)
        for i, (lname, _) in enumerate(links):
            for j, late in enumerate((0.0, late_ms)):
                ax = axes[i][j]
                grid = np.array([[r["streamed_over_batch"] for r in recs
                                  if r["link"] == lname and r["late_ms"] == late and r["ep"] == ep] for ep in eps])
                im = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.6, vmax=1.4, aspect="auto")
                for (a, b_), v in np.ndenumerate(grid):
                    ax.text(b_, a, f"{v:.2f}", ha="center", va="center", fontsize=7)
                ax.set_xticks(range(len(toks)), [str(t) for t in toks], fontsize=7)
                ax.set_yticks(range(len(eps)), [str(e) for e in eps])
                ax.set_xlabel("tokens per rank")
                ax.set_ylabel("EP (experts per PE = 256/EP)")
                ax.set_title(f"{lname}, {'late rank ' + format(late, 'g') + ' ms' if late else 'no late rank'}",
                             fontsize=9)
        fig.colorbar(im, ax=axes, label="streamed ÷ batch (< 1: streaming pays)")
        fig.suptitle(f"bench.cost_model: predicted streamed ÷ batch, {gemm}, best of 1 chunk (ready) and 2 or 4 (arrival)")
        fig.savefig(png_path, dpi=110)
        plt.close(fig)
    except ImportError:
        png_path = None
        print("matplotlib is missing: no PNG", file=sys.stderr)
    return {"csv": csv_path, "md": md_path, "png": png_path, "rows": recs}


# ---------------------------------------------------------------- CLI

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cost_model", description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="bench.ep_layer result JSONs (FILE or FILE:mps / FILE:gpu); "
                    "default: docs/results/ep-layer-*.json")
    ap.add_argument("--check", action="store_true", help="measured beside predicted; exit 1 past the tolerance")
    ap.add_argument("--fit", action="store_true", help="refit the rates from the files and write --rates")
    ap.add_argument("--predict", action="store_true", help="write the streamed ÷ batch table and heat map")
    ap.add_argument("--out", default=".", help="--predict's folder")
    ap.add_argument("--extra", action="append", default=[], help="more result files (added to the default list)")
    ap.add_argument("--timelines", action="append", default=[], help="more timelines JSONs for --fit")
    ap.add_argument("--machine", action="append", default=[], help="FILE:mps or FILE:gpu")
    ap.add_argument("--rates", default=RATES_PATH)
    ap.add_argument("--gemm", default="triton", help="--predict's GEMM implementation")
    ap.add_argument("--late-ms", type=float, default=1.0)
    ap.add_argument("--tol", type=float, default=0.10)
    a = ap.parse_args(argv)
    files = (a.files or DEFAULT_FILES) + a.extra
    machines = dict(_split_spec(s) for s in a.machine)
    machines = {os.path.basename(k): v for k, v in machines.items()} | machines
    rc = 0
    rates = None
    if a.fit:
        tl = DEFAULT_TIMELINES + a.timelines
        rates = fit(files, tl, machines)
        with open(a.rates, "w") as f:
            json.dump(rates, f, indent=1)
            f.write("\n")
        _RATES_CACHE.pop(a.rates, None)
        print(f"rates -> {a.rates}:")
        print(json.dumps({k: rates[k] for k in ("gemm", "machine")}, indent=1))
    if a.check or a.fit:
        rc = check(files, machines, rates or load_rates(a.rates), tol=a.tol)
    if a.predict:
        predict_grid(a.out, gemm=a.gemm, late_ms=a.late_ms, rates=rates or load_rates(a.rates))
    if not (a.check or a.fit or a.predict):
        ap.print_help()
    return rc


if __name__ == "__main__":
    sys.exit(main())
