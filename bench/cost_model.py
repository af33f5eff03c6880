"""The cost model's fit, check and prediction grid (the model: :mod:`bench.cost_model_core`).

Run ``python -m bench.cost_model --check [FILES...]`` (measured beside predicted, exit 1 past ±10 %),
``--fit [FILES...]`` (refit the rates, write ``bench/cost_model_rates.json``, then check),
``--cv`` (leave one file out: refit without each file, check that file) or
``--predict --out DIR`` (streamed ÷ batch over EP 8-64, NVLink and inter-node, 128-32768 tokens per
rank: a CSV, a markdown table and a PNG heat map). The model's equations, parameters and what it leaves
out are in :mod:`bench.cost_model_core`'s docstring.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys

import numpy as np

from bench.skew import skew_seed, timed_skew_draws
from bench.cost_model_core import (CALL_US, E_TOTAL_DSV3, FALLBACK_RATES, FLOP_ROW,  # noqa: F401
                                       INTER_NODE_GBPS, NVLINK_GBPS, RATES_PATH, ROW_BYTES, TOPK, W_BYTES, Config,
                                       _RATES_CACHE, _block_counts, _norm, comb_bytes, gemm_call_ms, load_rates,
                                       predict, pull_bytes)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "docs", "results")
# the model's rates are the H200 machine's: the runs on an H100 (files named ``-h100-``) are another card's
DEFAULT_FILES = sorted(p for p in glob.glob(os.path.join(RESULTS, "ep-layer-*.json")) if "-h100-" not in os.path.basename(p))
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


# What the measured code did where a result file's args do not say (``separate_seal_gemms`` and
# ``chunk_combine`` entered bench.ep_layer's args on 2026-12-01 and left with the switches in d33fb34,
# which fixed both: the last step in the seal's call, one reduce after the GEMMs).
#  - the 2-H200 files of 2026-11-30 (gpu_layer.EPMoE): a GEMM call per dispatch step, then the seal's own
#    call with the partial blocks (the merge came with 26378e9); one reduce after the seal;
#  - ep-layer-1pe-per-chunk-vs-persistent (the 02291fa results, measured before 9f9be65 made
#    chunk_combine a switch and 02291fa turned it off): the seal's own call, and the owner's reduce chunk
#    by chunk on a stream of its own, whose spinning arrival wait holds an SM slot that one CTA of
#    CUTLASS's statically scheduled persistent grid waits for (13.7 against 8.7 ms at 4096 tokens,
#    docs/results/ep-schedule-experiments-1pe-2026-12-01.log). The model has no term for that stall:
#    those CUTLASS streamed rows are skipped (``chunk_combine``); Triton's grid is not persistent.
#  - the 2-H200 files' rows carry no routing field: that benchmark (ed0b009) routed every row through the
#    DeepSeek-V3 router on random inputs, which gave rank 1 1.5-1.7x the rows of rank 0. The model knows
#    only uniform routing; they are modelled as uniform (their rows are the only one-GPU-per-PE
#    calibration of the link and combine rates), a reason for some of their misses.
#  - every file measured before the dispatch's own sort kernel (ep_triton.bucket_sort, c8f9c5d; the files
#    from tree cabca03 on have it): a step's dispatch waited for the previous step's GEMM grid (torch's radix
#    sort ran when the grid drained: docs/results/sm-sharing-probe-1h200-2026-12-03.log), so
#    ``dispatch_during_gemm`` is off for them.
_BEFORE_BUCKET_SORT = {"dispatch_during_gemm": False}
MEASURED_CODE = {
    "ep-layer-2h200-cutlass-1024-8192-2026-11-30.json": {"last_step_with_seal": False, "chunk_combine": False,
                                                         "routing": "router_modelled_as_uniform",
                                                         **_BEFORE_BUCKET_SORT},
    "ep-layer-2h200-triton-128-8192-2026-11-30.json": {"last_step_with_seal": False, "chunk_combine": False,
                                                       "routing": "router_modelled_as_uniform", **_BEFORE_BUCKET_SORT},
    "ep-layer-1pe-per-chunk-vs-persistent-2026-12-01.json": {"last_step_with_seal": False, "chunk_combine": True,
                                                             **_BEFORE_BUCKET_SORT},
    "ep-layer-1pe-seal-merged-deepgemm-2026-12-01.json": _BEFORE_BUCKET_SORT,
    "ep-layer-1pe-seal-merged-triton-cutlass-2026-12-01.json": _BEFORE_BUCKET_SORT,
    "ep-layer-1pe-cutlass-32768-2026-12-02.json": _BEFORE_BUCKET_SORT,
    "ep-layer-mps2-128experts-cutlass-1024-4096-2026-12-01.json": _BEFORE_BUCKET_SORT,
    "ep-layer-mps2-32experts-one-chunk-late-ranks-2026-12-03.json": _BEFORE_BUCKET_SORT,
}


def measured_code(base: str, args: dict) -> dict:
    # ready_window_us None: one source per ready-order step (the code before the grouped steps; a row
    # measured since names its window, bench.ep_layer's "ready_window_us", which load_rows reads)
    code = {"last_step_with_seal": True, "chunk_combine": False, "ready_window_us": None, "routing": "uniform",
            "dispatch_during_gemm": True}
    if "separate_seal_gemms" in args:
        code["last_step_with_seal"] = not args["separate_seal_gemms"]
    if "chunk_combine" in args:
        code["chunk_combine"] = bool(args["chunk_combine"])
    code.update(MEASURED_CODE.get(base, {}))
    return code


def load_rows(files, machines: dict | None = None):
    """The modelled rows of result files: (row config, measured ms, row dict, file). Skipped: paths
    other than batch/streamed, consumer other than per_chunk, routing other than uniform, and CUTLASS
    streamed rows measured with the owner's reduce chunk by chunk (:data:`MEASURED_CODE`)."""
    machines = machines or {}
    out, skipped = [], {}
    for spec in files:
        path, kind = _split_spec(spec)
        kind = kind or machines.get(path) or machines.get(os.path.basename(path)) or machine_of(path)
        with open(path) as f:
            data = json.load(f)
        rows = data["rows"] if isinstance(data, dict) else data
        base = os.path.basename(path)
        code = measured_code(base, (data.get("args") or {}) if isinstance(data, dict) else {})
        for r in rows:
            why = None
            if r.get("path") not in ("batch", "streamed"):
                why = f"path {r.get('path')}"
            elif r.get("consumer", "per_chunk") != "per_chunk":
                why = f"consumer {r.get('consumer')}"
            routing = r.get("routing") or code["routing"]
            if why is None and routing not in ("uniform", "router_modelled_as_uniform"):
                why = f"routing {routing}"
            gemm = r.get("gemm")
            if gemm in (None, "auto"):
                gemm = "cutlass" if "cutlass" in base else ("deep_gemm" if "deepgemm" in base else "triton")
            if why is None and code["chunk_combine"] and gemm == "cutlass" and r["path"] == "streamed":
                why = "chunk_combine (CUTLASS streamed)"
            if why:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            R = int(r["ranks"])
            E = r.get("experts_per_pe") or E_TOTAL_DSV3 // R
            cfg = Config(ranks=R, tokens=int(r["tokens_per_rank"]), experts_per_pe=int(E), gemm=gemm,
                         block_m=int(r.get("block_m") or 64), path=r["path"],
                         chunks=int(r.get("chunks") or (1 if r["path"] == "batch" else 2)),
                         source_order=r.get("source_order") or "rank", machine=kind,
                         straggler_ms=float(r.get("straggler_ms") or 0.0),
                         straggler_rank=r.get("straggler_rank"), skew_ms=float(r.get("skew_ms") or 0.0),
                         skew_draws=measured_skew_draws(r, R, int(E)),
                         last_step_with_seal=code["last_step_with_seal"],
                         dispatch_during_gemm=code["dispatch_during_gemm"],
                         chunk_gemm_ctas=r.get("chunk_gemm_ctas"), gemm_grid=r.get("gemm_grid") or "bound",
                         ready_window_us=r.get("ready_window_us", code["ready_window_us"]))
            if cfg.ready_window_us is not None:   # a row names its window only where its forward grouped
                cfg.group_max_tokens = max(cfg.group_max_tokens, cfg.tokens)
            if cfg.straggler_ms and cfg.straggler_rank is None and R > 1:
                cfg.straggler_rank = 1          # the 2-H200 runs delayed rank 1's producer
            out.append((cfg, float(r["median_ms"]), r, base))
    return out, skipped


def measured_skew_draws(r: dict, ranks: int, experts_per_pe: int) -> tuple | None:
    """The producer delays of a skew row's timed replays (bench.skew: the seed of its size and load, its
    ``n`` replays after the warm-ups), or None for a row without skew or with no replay count."""
    if not r.get("skew_ms") or not r.get("n"):
        return None
    seed = skew_seed(int(r["tokens_per_rank"]), experts_per_pe)
    return tuple(tuple(d) for d in timed_skew_draws(float(r["skew_ms"]), int(r["n"]), ranks, seed))


def is_fit_row(cfg: Config, r: dict | None = None) -> bool:
    """On time (no late rank, no skew) and a plan the model describes in full (no chunk_gemm_ctas)."""
    return (not cfg.straggler_ms and not cfg.skew_ms
            and not (r is not None and r.get("chunk_gemm_ctas")))


# ---------------------------------------------------------------- fitting

# call_us stays CALL_US: fitted per implementation it left the physical range (CUTLASS 220-300 us,
# MPS and DeepGEMM 0) and the leave-one-file-out check fell from 540 to 457 of 624 rows
FIX_CALL = True
ROBUST = 0.05       # Cauchy scale of the fit's relative errors (half the check's tolerance)
GEMM_PARAMS = ("call_us", "t_w_us", "t_b_us_block64")
GPU_PARAMS = ("c_fix_us", "c_tok_us", "link_eff")


def _rates_entry(call_us, t_w_us, t_b64_us, n, on):
    return {"call_us": float(call_us), "bw_GBps": float(W_BYTES / (t_w_us * 1e-6) / 1e9),
            "tflops": float(64 * FLOP_ROW / (t_b64_us * 1e-6) / 1e12), "t_w_us": float(t_w_us),
            "t_b_us_block64": float(t_b64_us), "fit_rows": n, "fit_on": on}


def _gemm_key(cfg) -> str:
    return cfg.gemm if cfg.machine == "gpu" else f"{cfg.gemm}@{cfg.machine}"


def _params_of(rates, keys, gpu_link):
    """The fitted parameters' names and current values (all positive: fitted as logs)."""
    names, vals = [], []
    for k in keys:
        g = rates["gemm"].get(k) or rates["gemm"].get(k.split("@")[0]) or FALLBACK_RATES["gemm"][k.split("@")[0]]
        t_w = W_BYTES / (g["bw_GBps"] * 1e9) * 1e6
        t_b = 64 * FLOP_ROW / (g["tflops"] * 1e12) * 1e6
        for n, v in zip(GEMM_PARAMS, (g.get("call_us", CALL_US), t_w, t_b)):
            names.append((k, n))
            vals.append(max(v, 1e-3))
    if gpu_link:
        m = rates["machine"]["gpu"]
        for n in GPU_PARAMS:
            names.append(("gpu", n))
            vals.append(max(m.get(n, 1.0), 1e-4))
    return names, np.array(vals, float)


def _put(rates, names, vals):
    for (k, n), v in zip(names, vals):
        if k == "gpu":
            rates["machine"]["gpu"][n] = float(v)
            continue
        g = rates["gemm"].setdefault(k, {})
        if n == "call_us":
            g["call_us"] = float(v)
        elif n == "t_w_us":
            g["bw_GBps"] = float(W_BYTES / (v * 1e-6) / 1e9)
            g["t_w_us"] = float(v)
        else:
            g["tflops"] = float(64 * FLOP_ROW / (v * 1e-6) / 1e12)
            g["t_b_us_block64"] = float(v)


def _equations(rows):
    """The fit's equations: each on-time row's median (the whole forward: ``predict``), and, where
    the row has it, its ``gemm_only_ms`` mean over PEs (one call over every block of the batch path,
    ``bench.ep_layer``'s GEMM-only graph). DeepGEMM's gemm_only is left out: the runs that have it
    timed Triton's GEMMs for gemm='deep_gemm' (docs/results/ep-layer-1pe-last-step-with-seal-2026-12-01.md)."""
    eq = []
    for cfg, med, r, base in rows:
        if not is_fit_row(cfg, r):
            continue
        eq.append(("total", cfg, med, base))
        if cfg.path == "batch" and r.get("gemm_only_ms") and cfg.gemm != "deep_gemm":
            eq.append(("gemm_only", cfg, float(np.mean(r["gemm_only_ms"])), base))
    return eq


def _model_of(kind, cfg, rates):
    if kind == "total":
        return predict(cfg, rates)["total_ms"]
    E = cfg.experts_per_pe
    share = cfg.ranks if cfg.machine == "mps" else 1
    t, b = _block_counts(cfg.tokens * TOPK / E, E, 1, cfg.block_m)
    return gemm_call_ms(t[0], b[0], cfg.gemm, cfg.block_m, share, rates, cfg.machine)


def _fit_rates(rows, rates, iters=40):
    """Levenberg-Marquardt on the relative errors of :func:`_equations` over the logs of the GEMM rates
    (per implementation and machine kind: t_w, t_b; call_us fixed at CALL_US) and, with 2-GPU rows,
    c_fix, c_tok and link_eff of one GPU per PE, with Cauchy weights (scale ROBUST) renewed every 5
    iterations. Producer, dispatch step, MPS local copy and MPS combine stay the timelines'.
    Returns (names, values, equations, relative errors)."""
    eq = _equations(rows)
    keys = sorted({_gemm_key(cfg) for _, cfg, _, _ in eq})
    gpu_link = any(cfg.machine == "gpu" and cfg.ranks > 1 for _, cfg, _, _ in eq)
    names, v0 = _params_of(rates, keys, gpu_link)
    meas = np.array([e[2] for e in eq])

    wgt = np.ones(len(eq))

    def resid(logv):
        _put(rates, names, np.exp(logv))
        return (np.array([_model_of(k, cfg, rates) for k, cfg, _, _ in eq]) / meas - 1.0) * wgt

    free = np.array([not (FIX_CALL and n == "call_us") for _, n in names])
    x = np.log(v0)
    if FIX_CALL:
        x[~free] = np.log(CALL_US)
    r = resid(x)
    lam, h = 1e-2, 1e-4
    for it in range(iters):
        if ROBUST and it % 5 == 0:
            # Cauchy weights (scale 5 %): a row the model cannot describe pulls the rates less
            raw = r / wgt
            wgt = 1.0 / np.sqrt(1.0 + (raw / ROBUST) ** 2)
            r = raw * wgt
        J = np.empty((len(r), len(x)))
        for j in range(len(x)):
            if not free[j]:
                J[:, j] = 0.0
                continue
            xp = x.copy()
            xp[j] += h
            J[:, j] = (resid(xp) - r) / h
        A, g = J.T @ J, J.T @ r
        improved = False
        while lam < 1e8:
            step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-9), -g)
            step = np.clip(step, -1.0, 1.0)
            xn = x + step
            rn = resid(xn)
            if rn @ rn < r @ r:
                x, r, lam, improved = xn, rn, lam / 3, True
                break
            lam *= 4
        if not improved or np.max(np.abs(step)) < 1e-5:
            break
    _put(rates, names, np.exp(x))
    r = resid(x) / wgt
    n_rows = {}
    for k, cfg, _, _ in eq:
        n_rows[_gemm_key(cfg)] = n_rows.get(_gemm_key(cfg), 0) + (k == "total")
    for k in keys:
        g = rates["gemm"][k]
        rates["gemm"][k] = _rates_entry(g["call_us"], g["t_w_us"], g["t_b_us_block64"], n_rows[k],
                                        "medians of the on-time rows (batch and streamed) and gemm_only_ms")
    if gpu_link:
        rates["machine"]["gpu"]["fit_on"] = "c_fix, c_tok, link_eff: with the GEMM rates, on the on-time rows"
    return names, np.exp(x), eq, r


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


def fit(files, timeline_files, machines=None, start: dict | None = None) -> dict:
    """Refit every rate from the result files and timelines; a rate with no source keeps the value of
    the current rates JSON (or the fallback)."""
    rows, _ = load_rows(files, machines)
    rates = json.loads(json.dumps(load_rates() if start is None else start))
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
    _, _, eq, _ = _fit_rates(rows, rates)
    rel = lambda p: os.path.relpath(p, ROOT) if os.path.abspath(p).startswith(ROOT) else p
    rates["sources"] = {
        "files": [rel(_split_spec(p)[0]) for p in files],
        "timelines": [rel(_split_spec(p)[0]) for p in timeline_files if os.path.exists(_split_spec(p)[0])],
        "fit_equations": {"medians": sum(e[0] == "total" for e in eq), "gemm_only": sum(e[0] == "gemm_only" for e in eq)},
        "checked_only": "every row with a late rank or skew, every row with chunk_gemm_ctas",
    }
    _RATES_CACHE.clear()
    return rates


# ---------------------------------------------------------------- leave one file out

def cross_validate(files, timeline_files, machines=None, tol=0.10, out=None) -> dict:
    """Leave-one-file-out: for each result file, refit on the other files (the timelines kept) and check
    that file alone. A rate no other file identifies keeps its start value (FALLBACK_RATES; an MPS
    implementation without MPS rows falls back to its one-GPU rates)."""
    out = out or sys.stdout
    res = {}
    base_start = json.loads(json.dumps(FALLBACK_RATES))
    for f in files:
        others = [g for g in files if g != f]
        rates = fit(others, timeline_files, machines, start=base_start)
        rows, _ = load_rows([f], machines)
        fitted = {_gemm_key(cfg) for cfg, _, _, _ in load_rows(others, machines)[0]}
        errs = [(predict(cfg, rates)["total_ms"] - med) / med for cfg, med, _, _ in rows]
        unfit = sorted({_gemm_key(cfg) for cfg, _, _, _ in rows} - fitted)
        ok = sum(abs(e) <= tol for e in errs)
        res[os.path.basename(f)] = (ok, len(errs), unfit)
        print(f"  {os.path.basename(f)}: {ok} of {len(errs)} within ±{tol * 100:.0f} % out of sample"
              + (f", median |err| {np.median(np.abs(errs)) * 100:.1f} %" if errs else "")
              + (f" (no other file has {', '.join(unfit)}: start rates)" if unfit else ""), file=out)
    ok, n = sum(v[0] for v in res.values()), sum(v[1] for v in res.values())
    print(f"leave one file out: {ok} of {n} configurations within ±{tol * 100:.0f} %", file=out)
    _RATES_CACHE.clear()
    return res


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
                      "fit" if is_fit_row(cfg, r) else "chk", f"{med:.3f}", f"{p:.3f}", err))
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
    ap.add_argument("--cv", action="store_true", help="leave one file out: refit without each file, check it")
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
    if a.cv:
        cross_validate(files, DEFAULT_TIMELINES + a.timelines, machines, tol=a.tol)
    if a.predict:
        predict_grid(a.out, gemm=a.gemm, late_ms=a.late_ms, rates=rates or load_rates(a.rates))
    if not (a.check or a.fit or a.predict or a.cv):
        ap.print_help()
    return rc


if __name__ == "__main__":
    sys.exit(main())
