"""A cost model of one forward of the expert-parallel layer, fitted to and checked against bench.ep_layer.

Run ``python -m bench.cost_model --check [FILES...]`` (measured beside predicted, exit 1 past ±10 %),
``--fit [FILES...]`` (refit the rates, write ``bench/cost_model_rates.json``, then check) or
``--predict --out DIR`` (streamed ÷ batch over EP 8-64, NVLink and inter-node, 128-32768 tokens per
rank: a CSV, a markdown table and a PNG heat map). ``predict(config)`` gives the phase times from
Python; it imports numpy only (matplotlib only for the PNG).

Shapes: DeepSeek-V3 experts, H = 7168, I = 2048, top-K = 8, FP8: one expert's weights are
W = 3*I*H bytes (44 MB); a routed row pulls H + 4*H/128 bytes (FP8 row + 1x128 scales); a routed row
costs 2*3*I*H flops through L1, SwiGLU and L2.

Per forward and per PE (the slowest PE sets the time), R PEs, T tokens per PE, E experts per PE
(E_total = E*R), uniform top-K routing:

* rows per PE: T*K (every route of the R*T tokens lands on one of E_total experts, E of them mine);
* a peer token is pulled when at least one of its K routes is mine: f = 1 - (1 - E/E_total)^K
  (the K routes are distinct experts of 256; drawing them independently is exact enough), so a PE
  pulls (R-1)*T*f rows of H + 4*H/128 bytes;
* producer of a chunk of n tokens (router, top-k, FP8 quantisation): p_fix + p_tok*n;
* dispatch step: d_fix + bytes pulled in the step / link bandwidth (NVLink 450 GB/s, inter-node
  50 GB/s; PEs sharing one GPU under MPS: a fitted local copy rate);
* GEMM call (L1 + SwiGLU + L2 over the call's row blocks of block_m rows), a sum:
      g_call + touched*t_w + blocks*t_b,
  t_w = W / BW: the cost of a weight pass, each expert the call touches (its weights are read once
  per call), t_b = block_m*2*3*I*H / F: each block's compute. ``touched`` and ``blocks`` are the
  expectation over Poisson expert counts (a fixed-seed draw). The sum fits the measured rows better
  than max(compute, weights) or a first-block-free form (--check: 207 against 189 of the 252 rows of
  docs/results + run 2; run 3 out of sample 170 against 113 of 324); the fitted BW comes out above
  HBM's 4.8 TB/s (t_w 3-8 µs against 9 µs for 44 MB from HBM): most of a weight pass hides under the
  blocks' compute, t_w is what it adds. Under MPS R PEs run their GEMMs at once on one GPU: t_w and
  t_b are multiplied by R (HBM and SMs shared; the rates ``@mps`` are fitted with that factor).
  DeepGEMM's call over a range is a whole-buffer call: every call of it costs the batch call;
* the streamed path (consumer per_chunk): steps = C (rank order: chunk c of every source per step)
  or C*R (ready, arrival: one source's chunk per step); each step's call takes the step's FULL
  blocks of each expert (rows of an expert accumulate until they fill a block); the last step is
  merged into the seal call, which takes every remaining row (partial blocks). Every call that
  touches an expert streams its weights again: that is what chunking costs;
* combine: c_fix + c_tok*T, plus on one GPU per PE the results coming back over the link:
  T*K*(R-1)/R bf16 rows of H (under MPS the timelines' combine phase already holds the local copy);
* schedule: each source r publishes its chunk c at delay_r + (c+1)*producer(T/C); a PE's consumer
  runs its steps one after the other (t = max(t, ready) + dispatch + GEMM call); the forward ends at
  the slowest consumer + combine. Batch is the same with C = 1 and one step over every source, so a
  late source (delay L) costs batch about L (the on-time producers overlap the wait). Rank order
  waits for chunk c of every source; ready order takes chunk c's sources as they come, then chunk
  c+1; arrival order takes the on-time sources' chunks first, so with one late source the on-time
  (R-1)/R of a PE's rows are computed during L. Random skew (each PE delayed by uniform[0, S] ms
  per forward) is the mean over 256 fixed-seed draws (for batch: S*R/(R+1) added, the expected max).

Parameters (all physical; ``bench/cost_model_rates.json`` names their sources and fit rows):
  per GEMM implementation and machine kind (``triton``, ``cutlass``, ``deep_gemm``; ``triton@mps``,
  ``cutlass@mps``): BW (GB/s, effective weight-streaming rate) and F (TFLOP/s, effective rate of a
  block) - 2 each (the JSON also gives them as t_w and t_b in µs); g_call = 25 µs per call for all (not fitted: with one expert count per
  machine it is collinear with BW);
  per machine kind (``gpu``: one GPU per PE; ``mps``: R PEs on one GPU): p_fix, p_tok (producer:
  layout_published - produce_start of the current-code MPS timelines; the one-GPU kind has no
  current-code timeline and takes the same), d_fix (dispatch step: dispatched_acked - acquired of the
  timelines), the MPS local copy rate (the same phase against bytes), c_fix, c_tok (MPS: the batch
  timelines' combine phase; one GPU: fitted), and on one GPU per PE ``link_eff``, the fraction of the
  nominal link rate the dispatch and combine bytes get (fitted on the 2-H200 rows; it also absorbs
  what crossing GPUs costs beyond bytes, and it is applied to the inter-node rate too).
Fit: one weighted linear least-squares per machine kind over the on-time batch rows (equations: each
row's ``gemm_only_ms``, mean over PEs = the GEMM term alone, and its median = every phase). DeepGEMM's
gemm_only is a whole-buffer timing larger than its forward, so its two rates come from its three
batch medians less the other phases. Every streamed row and every batch row with a late rank or
skew is checked only (``fit``/``chk`` column of --check).

Left out (a miss of the check is one of these): NVLink/HBM contention between dispatch and GEMMs
(the streamed dispatch kernels starved by GEMM grids; under MPS the streamed dispatch phase is ~3x
its batch time); an on-time PE on an MPS GPU running faster while its peer is late (it has the SMs
to itself); routing imbalance (non-uniform routing rows are skipped) and uneven per-PE row counts;
L2 reuse of weights between concurrent calls; chunk_gemm_ctas (capped GEMM grids) and the progress
policy; the persistent consumer and torch + NCCL rows (skipped); MPS run-to-run drift (up to 7 %).
"""
from __future__ import annotations

import argparse
import csv
import functools
import glob
import json
import math
import os
import sys
from dataclasses import dataclass, asdict, field

import numpy as np

H, I_DIM, TOPK = 7168, 2048, 8
W_BYTES = 3 * I_DIM * H                 # one expert's FP8 weights (gate, up, down)
ROW_BYTES = H + 4 * H // 128            # FP8 row + 1x128 float32 scales
FLOP_ROW = 2 * 3 * I_DIM * H            # L1 (gate+up) and L2 per routed row
E_TOTAL_DSV3 = 256
NVLINK_GBPS, INTER_NODE_GBPS = 450.0, 50.0
CALL_US = 25.0      # fixed cost of one GEMM call (launch, grid set-up, tail wave): not fitted

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RATES_PATH = os.path.join(HERE, "cost_model_rates.json")
RESULTS = os.path.join(ROOT, "docs", "results")
DEFAULT_FILES = sorted(glob.glob(os.path.join(RESULTS, "ep-layer-*.json")))
DEFAULT_TIMELINES = [os.path.join(RESULTS, "ep-timelines-2h200-triton-2026-11-30.json"),
                     "/work/devout/run2/ep-timelines-mps.json", "/work/devout/run3/ep-timelines-mps.json"]

# rates used when no rates JSON exists (the values the fit of 2026-12-03 gave, rounded)
FALLBACK_RATES = {
    "gemm": {
        "triton": {"bw_GBps": 3300.0, "tflops": 480.0, "call_us": 20.0},
        "cutlass": {"bw_GBps": 3700.0, "tflops": 550.0, "call_us": 20.0},
        "deep_gemm": {"bw_GBps": 4000.0, "tflops": 700.0, "call_us": 20.0},
    },
    "machine": {
        "gpu": {"p_fix_us": 20.0, "p_tok_us": 0.01, "d_fix_us": 30.0, "local_GBps": 1500.0,
                "c_fix_us": 30.0, "c_tok_us": 0.03},
        "mps": {"p_fix_us": 40.0, "p_tok_us": 0.02, "d_fix_us": 60.0, "local_GBps": 75.0,
                "c_fix_us": 30.0, "c_tok_us": 0.05},
    },
}


@dataclass
class Config:
    ranks: int = 2
    tokens: int = 4096                  # tokens per PE (rank)
    experts_per_pe: int | None = None   # None: 256 / ranks
    gemm: str = "triton"
    block_m: int = 64
    path: str = "batch"                 # batch | streamed
    chunks: int = 1
    source_order: str = "rank"          # rank | ready | arrival
    machine: str = "gpu"                # gpu (one GPU per PE) | mps (R PEs on one GPU)
    link_GBps: float | None = None      # None: NVLink for gpu, the fitted local rate for mps
    straggler_ms: float = 0.0
    straggler_rank: int | None = None
    skew_ms: float = 0.0


_RATES_CACHE: dict = {}


def load_rates(path: str | None = None) -> dict:
    path = path or RATES_PATH
    if path not in _RATES_CACHE:
        if os.path.exists(path):
            with open(path) as f:
                _RATES_CACHE[path] = json.load(f)
        else:
            _RATES_CACHE[path] = FALLBACK_RATES
    return _RATES_CACHE[path]


# ---------------------------------------------------------------- GEMM calls (block counts)

@functools.lru_cache(maxsize=4096)
def _block_counts(rows_per_expert: float, experts: int, steps: int, block_m: int, draws: int = 16):
    """Expected (touched, blocks) per call: steps-1 step calls with full blocks only, then the seal
    call with every remaining row. Expert counts per step ~ Poisson(rows_per_expert/steps)."""
    rng = np.random.default_rng(12345)
    mu = rows_per_expert / steps
    counts = rng.poisson(mu, size=(draws, experts, steps))
    cum = np.cumsum(counts, axis=2)
    full = cum // block_m                                   # full blocks available after step s
    touched, blocks = [], []
    prev = np.zeros((draws, experts), dtype=np.int64)
    for s in range(steps - 1):
        b = full[:, :, s] - prev
        prev = full[:, :, s]
        touched.append(float((b > 0).sum(axis=1).mean()))
        blocks.append(float(b.sum(axis=1).mean()))
    rest = cum[:, :, -1] - prev * block_m
    b = -(-rest // block_m)
    touched.append(float((b > 0).sum(axis=1).mean()))
    blocks.append(float(b.sum(axis=1).mean()))
    return tuple(touched), tuple(blocks)


def gemm_call_ms(touched: float, blocks: float, gemm: str, block_m: int, share: int, rates: dict,
                 machine: str = "gpu") -> float:
    g = rates["gemm"].get(f"{gemm}@{machine}") or rates["gemm"][gemm]
    t_w = W_BYTES / (g["bw_GBps"] * 1e9) * 1e3
    t_b = block_m * FLOP_ROW / (g["tflops"] * 1e12) * 1e3
    return g["call_us"] * 1e-3 + share * (touched * t_w + blocks * t_b)


# ---------------------------------------------------------------- the forward

def comb_bytes(T: int, R: int) -> float:
    return T * TOPK * (R - 1) / R * H * 2


def pull_bytes(T: int, R: int, E: int | None = None) -> float:
    """Bytes a PE pulls per forward: (R-1)*T peer tokens, a fraction 1-(1-E/E_total)^K = 1-(1-1/R)^K
    of them with a route to one of my experts, one FP8 row + scales each."""
    return (R - 1) * T * (1.0 - (1.0 - 1.0 / R) ** TOPK) * ROW_BYTES

def _norm(config) -> Config:
    if isinstance(config, Config):
        return config
    c = dict(config)
    if "tokens_per_rank" in c:
        c["tokens"] = c.pop("tokens_per_rank")
    known = set(Config.__dataclass_fields__)
    return Config(**{k: v for k, v in c.items() if k in known})


def predict(config, rates: dict | None = None) -> dict:
    """Phase times (ms) of one forward: {'total_ms', 'producer_ms', 'dispatch_ms', 'gemm_ms',
    'combine_ms', 'wait_ms', 'gemm_calls', 'steps', ...}. ``config``: a Config or a dict with its
    fields (``tokens_per_rank`` is accepted for ``tokens``)."""
    cfg = _norm(config)
    rates = rates or load_rates()
    R, T = int(cfg.ranks), int(cfg.tokens)
    E = int(cfg.experts_per_pe or max(E_TOTAL_DSV3 // R, 1))
    E_tot = E * R
    m = rates["machine"][cfg.machine]
    share = R if cfg.machine == "mps" else 1
    if cfg.machine == "mps":
        link = cfg.link_GBps or m["local_GBps"]
    else:   # a nominal link rate times the efficiency the 2-H200 rows gave
        link = (cfg.link_GBps or NVLINK_GBPS) * m.get("link_eff", 1.0)
    streamed = cfg.path == "streamed"
    C = max(int(cfg.chunks), 1) if streamed else 1
    order = cfg.source_order if streamed else "rank"
    per_source = order in ("ready", "arrival")
    steps = C * R if per_source else C

    rows = T * TOPK * E / E_tot * R                     # = T*K
    f_pull = 1.0 - (1.0 - E / E_tot) ** TOPK
    src_chunk_bytes = (T / C) * f_pull * ROW_BYTES      # one peer's chunk, pulled by me
    prod_chunk = (m["p_fix_us"] + m["p_tok_us"] * T / C) * 1e-3

    # GEMM calls
    if cfg.gemm == "deep_gemm":
        t1, b1 = _block_counts(rows / E, E, 1, cfg.block_m)
        whole = gemm_call_ms(t1[0], b1[0], "deep_gemm", cfg.block_m, share, rates, cfg.machine)
        calls = [whole] * steps
    else:
        tt, bb = _block_counts(rows / E, E, steps, cfg.block_m)
        calls = [gemm_call_ms(t, b, cfg.gemm, cfg.block_m, share, rates, cfg.machine) for t, b in zip(tt, bb)]

    # the steps: which (source, chunk) pairs each takes, per consumer PE q
    def step_sources(q, delays):
        if order == "rank":
            return [[(r, c) for r in range(R)] for c in range(C)]
        if order == "ready":
            out = []
            for c in range(C):
                srcs = sorted(range(R), key=lambda r: (delays[r] + (c + 1) * prod_chunk, r != q, r))
                out += [[(r, c)] for r in srcs]
            return out
        srcs = sorted(range(R), key=lambda r: (delays[r] + prod_chunk, r != q, r))   # arrival
        return [[(r, c)] for r in srcs for c in range(C)]

    def forward(delays):
        ends, disp_tot = [], 0.0
        # consumers with the same own delay see the same schedule (uniform routing): one of each
        reps = sorted({d: q for q, d in reversed(list(enumerate(delays)))}.values())
        for q in reps:
            t = 0.0
            for s, srcs in enumerate(step_sources(q, delays)):
                ready = max(delays[r] + (c + 1) * prod_chunk for r, c in srcs)
                nbytes = sum(src_chunk_bytes for r, c in srcs if r != q)
                d = m["d_fix_us"] * 1e-3 + nbytes / (link * 1e9) * 1e3
                t = max(t, ready) + d + calls[s]
                if q == reps[0]:
                    disp_tot += d
            ends.append(t)
        return max(ends), disp_tot

    if cfg.skew_ms:
        rng = np.random.default_rng(7)
        draws = rng.uniform(0.0, cfg.skew_ms, size=(256, R))
        res = [forward(list(d)) for d in draws]
        end = float(np.mean([r[0] for r in res]))
        disp = res[0][1]
        delay = float(np.mean(draws.max(axis=1)))
    else:
        delays = [0.0] * R
        if cfg.straggler_ms and cfg.straggler_rank is not None:
            delays[int(cfg.straggler_rank) % R] = float(cfg.straggler_ms)
        elif cfg.straggler_ms:
            delays[R - 1] = float(cfg.straggler_ms)
        end, disp = forward(delays)
        delay = max(delays)
    comb = (m["c_fix_us"] + m["c_tok_us"] * T) * 1e-3
    if cfg.machine != "mps" and R > 1:
        # the K results of my tokens come back as bf16 rows, (R-1)/R of them from peers, over the link;
        comb += comb_bytes(T, R) / (link * 1e9) * 1e3
    gemm = float(sum(calls))
    total = end + comb
    return {
        "total_ms": total, "producer_ms": prod_chunk * C, "dispatch_ms": disp, "gemm_ms": gemm,
        "combine_ms": comb, "wait_ms": max(total - comb - disp - gemm, 0.0), "late_ms": delay,
        "gemm_calls": len(calls), "steps": steps, "rows_per_pe": rows, "experts_per_pe": E,
        "pull_fraction": f_pull, "pulled_bytes": (R - 1) * T * f_pull * ROW_BYTES,
    }


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
                    for C in (2, 4):
                        s = predict(dict(base, path="streamed", chunks=C, source_order="arrival"), rates)
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
    md = [f"# streamed ÷ batch predicted by bench.cost_model ({gemm} GEMMs, best of 2 and 4 chunks, arrival order, "
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
        fig.suptitle(f"bench.cost_model: predicted streamed ÷ batch, {gemm}, best of C in {{2,4}}, arrival order")
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
