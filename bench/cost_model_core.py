"""A cost model of one forward of the expert-parallel layer (numpy and the buffer's tuning rules; no GPU
import): :func:`predict` gives the phase times of a batch or streamed forward for a configuration, with
rates measured on the H200 (``cost_model_rates.json`` beside this module, fitted by ``python -m
bench.cost_model --fit`` from ``bench.ep_layer`` results and timelines, which names its sources).
Research, not the runtime: ``streaming="auto"`` reads the tuned table only (:mod:`streamring.moe.adaptive`);
:func:`choose_by_model` is what the model would choose, for comparison. ``python -m bench.cost_model --check``
prints every measured configuration beside its prediction; ``--predict`` the streamed ÷ batch grid.

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
  DeepGEMM's call over a range is a whole-buffer m_indices call: every block of the buffer,
  ceil(R*T*K/block_m) + E (its worst case), is loaded and stored at DG_SKIP_US each (its MMAs skipped
  outside the range; measured per buffer block by bench.gemm_launches), plus t_b for each block in the
  range; only the batch path's one call (one allocation) takes the psum layout, the blocks in use;
* two corrections of a streamed call: with ``chunk_gemm_ctas`` under MPS the calls before the sealing
  one run on that many CTAs, one per SM (the Triton L1 holds 201 KB of shared memory), of the 132/R SMs
  an MPS client has, so at ctas/(132/R) of their speed when fewer, and a looping grid of one CTA per SM
  computes its blocks LOOP_ONE_PER_SM slower than one CTA per tile (bench.empty_grid); CUTLASS on one GPU per PE reads each
  weight pass beyond the batch path's one per expert from HBM (W / 4.8 TB/s instead of t_w): its chunk
  order puts an expert's blocks apart (bench.gemm_launches: 8.8-9.6 µs per extra pass);
* the grids: a Triton call's grid is sized on the host (``grid_bounds``), and each block of it past the
  call's ready blocks costs EMPTY_BLOCK_US_SM SM-µs on the PE's SMs (bench.empty_grid). ``gemm_grid``
  ``bound`` (result rows without the field) launches one CTA per (block, tile) up to the call's bound:
  for the grouped ready steps the idle calls after a chunk's last source, R - 1 of them on time, whose
  bounds sum to about R²/2 sources' blocks. ``expected`` launches one CTA per tile of the
  blocks the call is expected under even routing and a looping tail of TAIL_CTAS_PER_SM per SM, which
  computes any blocks past the expectation TAIL_SLOWDOWN slower; an idle grouped step expects one late
  source's blocks. ``expected_headroom`` sizes the expectation for EXPECT_HEADROOM times the routed rows'
  share (before rounding up to full blocks). A
  forward is charged its calls' grids less the batch path's grids by the bound rule, which the fitted
  rates hold (the batch path under the expected rule is charged the difference, a gain);
* the streamed path (consumer per_chunk): steps = C (rank order: chunk c of every source per step)
  or C*R (arrival, and ready with ``ready_window_us=None`` or more than ``group_max_tokens`` tokens:
  one source's chunk per step); ready order with a window (the code since its grouping) takes per
  step every source of the chunk ready within the window of the first (the schedule below), and the
  step taking the last source of the last chunk has the seal, so on-time sources share one call (the
  idle steps' GEMM grids are priced below, "the grids"); each step's call
  takes the step's FULL blocks of each expert (rows of an expert accumulate until they fill a block); the last step is
  merged into the seal call, which takes every remaining row (partial blocks). Every call that
  touches an expert streams its weights again: that is what chunking costs. ``last_step_with_seal=
  False`` describes code measured before the merge: a call per step (the batch path's one step
  included), then the seal's own call with the partial blocks alone;
* combine: c_fix + c_tok*T, plus on one GPU per PE the results coming back over the link:
  T*K*(R-1)/R bf16 rows of H (under MPS the timelines' combine phase already holds the local copy);
* schedule: each source r publishes its chunk c at delay_r + (c+1)*producer(T/C); a PE's consumer
  dispatches its steps one after the other, each when its sources are ready and the previous dispatch is
  done, while the previous step's GEMM call runs (the dispatch kernels get SMs beside a GEMM grid:
  bench.sm_sharing), and runs each step's call after its dispatch and the previous call
  (d = max(d, ready) + dispatch; t = max(t, d) + GEMM call); code measured before the dispatch's own
  sort kernel (``dispatch_during_gemm=False``) dispatched a step only after the previous call
  (t = max(t, ready) + dispatch + GEMM call); ungrouped steps only: the grouped ready steps decide
  what a step takes when the previous call ends (below). The forward ends at
  the slowest consumer + combine. Batch is the same with C = 1 and one step over every source, so a
  late source (delay L) costs batch about L (the on-time producers overlap the wait). Rank order
  waits for chunk c of every source; ready order takes chunk c's sources as they come, then chunk
  c+1; arrival order takes the on-time sources' chunks first, so with one late source the on-time
  (R-1)/R of a PE's rows are computed during L. Random skew (each PE delayed by uniform[0, S] ms
  per forward) is the mean over 256 fixed-seed draws (for batch: S*R/(R+1) added, the expected max), or,
  for a measured row, the median forward over the draws its replays were timed with (``skew_draws``).

Parameters (all physical; ``bench/cost_model_rates.json`` names their sources and fit rows):
  per GEMM implementation and machine kind (``triton``, ``cutlass``, ``deep_gemm``; ``triton@mps``,
  ``cutlass@mps``; a kind without its own entry takes the one-GPU rates): BW (GB/s, effective
  weight-streaming rate) and F (TFLOP/s, effective rate of a block) - 2 each (the JSON also gives them
  as t_w and t_b in µs); g_call = 25 µs per call for all (not fitted: fitted per implementation it
  leaves the physical range - CUTLASS 220-300 µs, MPS and DeepGEMM 0 - and predicts left-out files
  worse);
  per machine kind (``gpu``: one GPU per PE; ``mps``: R PEs on one GPU): p_fix, p_tok (producer:
  layout_published - produce_start of the current-code MPS timelines; the one-GPU kind has no
  current-code timeline and takes the same), d_fix (dispatch step: dispatched_acked - acquired of the
  timelines), the MPS local copy rate (the same phase against bytes), c_fix, c_tok (MPS: the batch
  timelines' combine phase; one GPU: fitted), and on one GPU per PE ``link_eff``, the fraction of the
  nominal link rate the dispatch and combine bytes get (fitted on the 2-H200 rows; it also absorbs
  what crossing GPUs costs beyond bytes, and it is applied to the inter-node rate too).
Fit (``bench.cost_model``): Levenberg-Marquardt on the relative errors, Cauchy-weighted (scale 5 %),
over every on-time row, batch and streamed, without chunk_gemm_ctas: its median (``predict``, every
phase) and, for a batch row, its ``gemm_only_ms`` mean over PEs (one call over the batch blocks;
not DeepGEMM's, which those runs timed with Triton's GEMMs). Rows with a late rank, skew or capped
GEMM grids are checked only (``fit``/``chk`` column of --check); ``--cv`` refits without each file and
checks it. Each result file is modelled as the code that measured it (``bench.cost_model.MEASURED_CODE``:
the seal's own call before the merge; CUTLASS streamed rows measured with the owner's reduce chunk by
chunk are skipped: its spinning wait delays one CTA of CUTLASS's persistent grid, a stall the model has
no term for).

Left out (a miss of the check is one of these): CUTLASS's chunk order beyond a full read per extra
weight pass (1.2-1.5x the batch blocks' GEMM time at >= 4096 tokens, docs/performance.md), and under
MPS; the spread of the PEs' start times (the ready order's window then misses on-time sources: every PE
starts at 0 here); NVLink/HBM contention between dispatch and GEMMs
(the streamed dispatch kernels starved by GEMM grids; under MPS the streamed dispatch phase is ~3x
its batch time); an on-time PE on an MPS GPU running faster while its peer is late (it has the SMs
to itself); routing imbalance (non-uniform routing rows are skipped) and uneven per-PE row counts;
L2 reuse of weights between concurrent calls; chunk_gemm_ctas on one GPU per PE, and the progress
policy; the persistent consumer and torch + NCCL rows (skipped); MPS run-to-run drift (up to 7 %).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import numpy as np

from streamring.device.gemm_grid import EXPECT_HEADROOM, GEMM_GRID, TAIL_CTAS_PER_SM, grid_blocks
from streamring.moe.adaptive import AdaptiveChoice
from streamring.moe.grid_bounds import (consumer_max_blocks, grouped_step_bound, grouped_step_expect, seal_bound, step_bound,
                          step_expect)
from streamring.moe.tuning import GROUP_MAX_TOKENS, EPTuning

_TUNING_DEFAULTS = EPTuning.model_fields

H, I_DIM, TOPK = 7168, 2048, 8
W_BYTES = 3 * I_DIM * H                 # one expert's FP8 weights (gate, up, down)
ROW_BYTES = H + 4 * H // 128            # FP8 row + 1x128 float32 scales
FLOP_ROW = 2 * 3 * I_DIM * H            # L1 (gate+up) and L2 per routed row
E_TOTAL_DSV3 = 256
NVLINK_GBPS, INTER_NODE_GBPS = 450.0, 50.0
DG_SKIP_US = 6.5    # DeepGEMM m_indices call: per 128-row block of the whole buffer (gemm-launches 2026-12-02)
HBM_GBPS = 4800.0   # H200 HBM3e
H200_SMS = 132
# a Triton GEMM grid's CTAs over blocks past the ready range (they read the range and exit): per block of the
# grid bound (all its L1 and L2 tiles), in SM-microseconds (bench.empty_grid: 9.5-12.5 at 132, 66 and 32 SMs,
# docs/results/gemm-empty-grids-1h200-mps-2026-12-03.json)
EMPTY_BLOCK_US_SM = 11.0
TILES_PER_BLOCK = I_DIM // 128 + H // 128   # a block's CTAs in the two Triton GEMMs' grids (L1 16, L2 56)
# grids sized for the expected blocks (gemm_grid "expected", streamring.device.moe_triton._grid): how much slower
# the looping tail (TAIL_CTAS_PER_SM per SM) computes the blocks past the expectation than one CTA per tile
# (bench.empty_grid, 2-8 CTAs per SM: 1.035-1.068 without MPS, 1.051-1.064 at 50 and 25 % under MPS,
# docs/results/gemm-empty-grids-1h200-mps-2026-12-03.json)
TAIL_SLOWDOWN = 0.055
# how much slower a looping grid of one CTA per SM computes a call's blocks than one CTA per tile
# (bench.empty_grid run cap_sweep: 1.17-1.19 without MPS, 1.19-1.20 at 50 %, 1.18-1.20 at 25 % under MPS,
# docs/results/gemm-empty-grids-1h200-mps-2026-12-03.json): a capped grid (chunk_gemm_ctas) is one
LOOP_ONE_PER_SM = 1.19
GRID_RULES = ("bound", "expected", "expected_headroom")   # Config.gemm_grid
CALL_US = 25.0      # fixed cost of one GEMM call (launch, grid set-up, tail wave): not fitted

RATES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cost_model_rates.json")

# rates used when no rates JSON exists, and the start of bench.cost_model's leave-one-file-out refits:
# round figures of the right order, not a fit (the fit is cost_model_rates.json)
FALLBACK_RATES = {
    "gemm": {
        "triton": {"bw_GBps": 3300.0, "tflops": 480.0, "call_us": 25.0},
        "cutlass": {"bw_GBps": 3700.0, "tflops": 550.0, "call_us": 25.0},
        "deep_gemm": {"bw_GBps": 4000.0, "tflops": 700.0, "call_us": 25.0},
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
    # a measured skew row's draws: every timed forward's producer delays (ms, one per PE), whose median
    # forward is predicted as the benchmark reports the median replay (None: the mean over 256 draws)
    skew_draws: tuple | None = None
    chunk_gemm_ctas: int | None = None  # the persistent grid of the calls before the seal's (None: one CTA per tile)
    # how the Triton grids are sized (streamring.device.gemm_grid.GEMM_GRID): "expected_headroom" (one CTA per tile
    # of the blocks a call is expected to have, with EXPECT_HEADROOM, and a looping tail for any past them),
    # "expected" (the same without the headroom) or "bound" (one CTA per tile of the call's bound: result rows
    # without the field)
    gemm_grid: str = GEMM_GRID
    last_step_with_seal: bool = True    # False: a call per dispatch step, then the seal's own call
    # True (the code since the dispatch's own sort kernel, ep_triton.bucket_sort): a step's dispatch runs while
    # the previous step's GEMMs do; False (the code before it): it waited for them
    dispatch_during_gemm: bool = True
    # ready order: the grouping window (None: one source per step) and the largest forward that groups (the
    # buffer's defaults, streamring.moe.tuning.EPTuning)
    ready_window_us: float | None = _TUNING_DEFAULTS["ready_window_us"].default
    group_max_tokens: int = GROUP_MAX_TOKENS


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

def _block_counts(rows_per_expert: float, experts: int, steps: int, block_m: int, draws: int = 16,
                  merged: bool = True):
    """Expected (touched, blocks) per call of ``steps`` equal steps (see :func:`_group_block_counts`)."""
    return _group_block_counts(rows_per_expert, experts, (1,) * steps, block_m, draws, merged, steps)


@functools.lru_cache(maxsize=4096)
def _group_block_counts(rows_per_expert: float, experts: int, sizes: tuple, block_m: int, draws: int = 16,
                        merged: bool = True, parts: int = 1):
    """Expected (touched, blocks) per call. Step s takes ``sizes[s]`` of the ``parts`` equal (source,
    chunk) parts of the forward (``sizes`` may be a prefix of the steps); a step of size 0 has a call
    over nothing. ``merged``: the last step's call
    has the seal (every remaining row); else every step's call has full blocks only, then the seal's
    call the partial blocks alone. Expert counts per step ~ Poisson(rows_per_expert * share)."""
    rng = np.random.default_rng(12345)
    steps = len(sizes)
    mu = rows_per_expert * np.asarray(sizes, dtype=np.float64) / parts
    counts = rng.poisson(mu[None, None, :], size=(draws, experts, steps))
    cum = np.cumsum(counts, axis=2)
    full = cum // block_m                                   # full blocks available after step s
    touched, blocks = [], []
    prev = np.zeros((draws, experts), dtype=np.int64)
    for s in range(steps - 1 if merged else steps):
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


class _Schedule:
    """One forward's schedule on every consumer PE (the module docstring's "schedule"): what
    :func:`predict` times for each draw of the producers' delays."""

    def __init__(self, cfg: Config, rates: dict):
        self.cfg, self.rates = cfg, rates
        R = self.R = int(cfg.ranks)
        T = self.T = int(cfg.tokens)
        E = self.E = int(cfg.experts_per_pe or max(E_TOTAL_DSV3 // R, 1))
        E_tot = E * R
        m = self.m = rates["machine"][cfg.machine]
        self.share = R if cfg.machine == "mps" else 1
        if cfg.machine == "mps":
            self.link = cfg.link_GBps or m["local_GBps"]
        else:   # a nominal link rate times the efficiency the 2-H200 rows gave
            self.link = (cfg.link_GBps or NVLINK_GBPS) * m.get("link_eff", 1.0)
        streamed = cfg.path == "streamed"
        C = self.C = max(int(cfg.chunks), 1) if streamed else 1
        self.order = cfg.source_order if streamed else "rank"
        self.steps = C * R if self.order in ("ready", "arrival") else C
        # ready order with a window: a step takes every source ready within the window of the first one, by
        # the buffer's own rule (the modelled consumer is per_chunk); no window: the code before the grouping.
        # Every modelled file grouped up to group_max_tokens whatever the GEMMs (persistent_grid=False): the
        # grouping of a persistent grid at every size came after them and is not modelled
        self.grouped = cfg.ready_window_us is not None and EPTuning(
            source_order=self.order, group_max_tokens=cfg.group_max_tokens).groups_sources(
                R, T, persistent_grid=False)
        self.window = (cfg.ready_window_us or 0.0) * 1e-3
        self.rows = T * TOPK * E / E_tot * R                     # = T*K
        self.f_pull = 1.0 - (1.0 - E / E_tot) ** TOPK
        self.src_chunk_bytes = (T / C) * self.f_pull * ROW_BYTES  # one peer's chunk, pulled by me
        self.prod_chunk = (m["p_fix_us"] + m["p_tok_us"] * T / C) * 1e-3
        # the GEMM grids (grid_bounds, as the pipeline sizes them): the buffer's block capacity, its chunk, and
        # what the batch path's one call launches past its blocks, which the fitted rates hold
        bm = cfg.block_m
        self.chunk_tokens = -(-T // C)
        self.max_blocks = consumer_max_blocks(R, max(T, C * self.chunk_tokens), TOPK, bm, E)
        merged = bool(cfg.last_step_with_seal)
        batch_bounds = self._call_bounds(step_bound(R, 1, T, TOPK, bm, E, self.max_blocks), 1 if merged else 2)
        self.batch_bound = batch_bounds[-1]   # the seal's call
        _, batch_blocks = _block_counts(self.rows / E, E, 1, bm, merged=merged)
        # the rates were fitted on rows whose grids were sized by their bounds: they hold the batch path's
        # grid cost with that rule, whatever rule the modelled code has
        self.batch_grid_ms = sum(self.empty_ms(bd - blk) for bd, blk in zip(batch_bounds, batch_blocks))
        self.calls = self._step_calls()

    def _step_calls(self) -> list:
        """The GEMM calls of the ungrouped steps (and the seal's own call, ``last_step_with_seal`` off)."""
        cfg, E = self.cfg, self.E
        merged = bool(cfg.last_step_with_seal)
        n_calls = self.steps if merged else self.steps + 1
        tt, bb = _block_counts(self.rows / E, E, self.steps, cfg.block_m, merged=merged)
        if cfg.gemm == "deep_gemm" and n_calls > 1:
            return [self._whole_call(b) for b in bb]
        # (DeepGEMM's one batch call: the psum layout, the blocks in use)
        calls = [gemm_call_ms(t, b, cfg.gemm, cfg.block_m, self.share, self.rates, cfg.machine) for t, b in zip(tt, bb)]
        # each call's grid past its blocks: a step's bound, the last step's (merged into the seal) one block per
        # expert more, the seal's own call (code before the merge) the same
        per_chunk = self.steps // self.C
        b = step_bound(self.R, per_chunk, self.chunk_tokens, TOPK, cfg.block_m, E, self.max_blocks)
        x = step_expect(self.R, per_chunk, self.chunk_tokens, TOPK, cfg.block_m, E, self.headroom)
        calls = [c + self.grid_ms(bd, ex, blk)
                 for c, bd, ex, blk in zip(calls, self._call_bounds(b, n_calls), self._call_bounds(x, n_calls), bb)]
        if cfg.path == "streamed" and cfg.chunk_gemm_ctas and cfg.machine == "mps":
            # the calls before the seal's on a persistent grid of chunk_gemm_ctas CTAs, one per SM (Triton L1: 201 KB
            # of shared memory), of the 132 / R SMs an MPS client has (66 at 50 %:
            # docs/results/sm-sharing-probe-1h200-2026-12-03.log)
            slow = max(1.0, (H200_SMS / self.share) / cfg.chunk_gemm_ctas) * LOOP_ONE_PER_SM
            # current code: every step but the last (sealing) one; the 11-30 code: the steps of every chunk but the last
            capped = self.steps - 1 if merged else self.steps - self.steps // self.C
            calls = [c * slow if i < capped else c for i, c in enumerate(calls)]
        if cfg.gemm == "cutlass" and cfg.path == "streamed" and cfg.machine == "gpu" and merged:
            # CUTLASS's chunk order: an expert's blocks lie apart, so each weight pass beyond the batch path's one
            # per expert is a full read from HBM (W / 4.8 TB/s), not the batch call's mostly hidden t_w
            # (gemm-launches 2026-12-02, merged seal as here: CUTLASS per-chunk - batch over the extra passes,
            # 2 chunks: 9.6 / 8.8 us)
            g = self.rates["gemm"]["cutlass"]
            t_w = W_BYTES / (g["bw_GBps"] * 1e9) * 1e3
            t_hbm = W_BYTES / (HBM_GBPS * 1e9) * 1e3
            t1, _ = _block_counts(self.rows / E, E, 1, cfg.block_m)
            calls[-1] += max(sum(tt) - t1[0], 0.0) * max(t_hbm - t_w, 0.0)
        return calls

    def _whole_call(self, blocks: float = 0.0) -> float:
        """A DeepGEMM call over a range: a whole-buffer m_indices call: every block of the buffer
        (ceil(R*T*K / block_m) + E) is loaded and stored (DG_SKIP_US each, its MMAs skipped outside the
        range), the range's blocks add their MMAs (t_b; their weight tiles are in the loads)."""
        cfg, E = self.cfg, self.E
        n_buf = -(-self.R * self.T * TOPK // cfg.block_m) + E
        return (gemm_call_ms(0.0, blocks, "deep_gemm", cfg.block_m, self.share, self.rates, cfg.machine)
                + self.share * n_buf * DG_SKIP_US * 1e-3)

    def _dispatch_ms(self, nbytes: float) -> float:
        return self.m["d_fix_us"] * 1e-3 + nbytes / (self.link * 1e9) * 1e3

    def step_sources(self, q: int, delays) -> list:
        """The ungrouped steps: which (source, chunk) pairs each takes, on consumer PE ``q``."""
        R, C, pc = self.R, self.C, self.prod_chunk
        if self.order == "rank":
            return [[(r, c) for r in range(R)] for c in range(C)]
        if self.order == "ready":
            out = []
            for c in range(C):
                srcs = sorted(range(R), key=lambda r: (delays[r] + (c + 1) * pc, r != q, r))
                out += [[(r, c)] for r in srcs]
            return out
        srcs = sorted(range(R), key=lambda r: (delays[r] + pc, r != q, r))   # arrival
        return [[(r, c)] for r in srcs for c in range(C)]

    def group_call(self, sizes, last: bool, j: int = 0) -> float:
        """The call of the last of grouped steps ``sizes`` (sources per step so far, every chunk's; it is
        step ``j`` of its chunk): full blocks only, or (``last``) with the seal's partial blocks. Block
        counts are causal, so a prefix gives a step's call. DeepGEMM: every grouped call is a whole-buffer
        call (a seal decided on the device never gives the psum layout), as :meth:`_step_calls` prices the
        ungrouped ones. Triton: plus what its grid costs past the step's blocks (:meth:`grid_ms`)."""
        cfg = self.cfg
        tt, bb = _group_block_counts(self.rows / self.E, self.E, tuple(sizes), cfg.block_m, merged=last,
                                     parts=self.C * self.R)
        s = len(sizes) - 1
        if cfg.gemm == "deep_gemm":
            return self._whole_call(bb[s])
        return gemm_call_ms(tt[s], bb[s], cfg.gemm, cfg.block_m, self.share, self.rates, cfg.machine) + \
            self.grid_ms(self.step_bound(j), self.step_expect(j), bb[s])

    def _call_bounds(self, b: int, n_calls: int) -> list:
        """The grid bounds of ``n_calls`` ungrouped calls whose steps are bounded by ``b``: every step's call,
        and the last one (the seal's, merged with the last step or its own) one block per expert more."""
        return [b] * (n_calls - 1) + [seal_bound(b, self.E, self.max_blocks)]

    def step_bound(self, j: int) -> int:
        """The GEMM grid bound (blocks) of grouped step ``j`` of a chunk, as the pipeline sizes it."""
        return grouped_step_bound(self.R, j, self.chunk_tokens, TOPK, self.cfg.block_m, self.E, self.max_blocks)

    def step_expect(self, j: int) -> int:
        """The blocks grouped step ``j`` of a chunk is expected to have, as the pipeline sizes its grid."""
        return grouped_step_expect(self.R, j, self.chunk_tokens, TOPK, self.cfg.block_m, self.E, self.headroom)

    @property
    def headroom(self) -> float:
        """The routed rows' headroom of the grids' expectations under this row's grid rule."""
        if self.cfg.gemm_grid not in GRID_RULES:
            raise ValueError(f"gemm_grid must be one of {GRID_RULES}, got {self.cfg.gemm_grid!r}")
        return EXPECT_HEADROOM if self.cfg.gemm_grid == "expected_headroom" else 1.0

    def grid_ms(self, bound: int, expect: int, blocks: float) -> float:
        """What a Triton call's grid costs beyond one CTA per tile of its ``blocks`` ready blocks. ``bound``
        rule: the CTAs of the bound past them (:meth:`empty_ms`). ``expected`` rules, per GEMM (L1, L2) as
        ``moe_triton._grid`` decides: the CTAs of the expected blocks in whole groups
        (``gemm_grid.grid_blocks``; the expectation as :meth:`headroom` sizes it) and of the looping tail past
        the ready blocks, and the tail's slowdown on the blocks past the groups (the bound's CTAs when the tail
        would launch no fewer)."""
        cfg = self.cfg
        if cfg.gemm != "triton":
            return 0.0
        if cfg.gemm_grid == "bound":
            return self.empty_ms(bound - blocks)
        # per GEMM, as moe_triton._grid decides: one CTA per tile of the expectation in whole groups of blocks
        # and the looping tail, or (when that launches no fewer CTAs than the bound's grid) the bound's grid
        tail = TAIL_CTAS_PER_SM * H200_SMS / self.share
        g = self.rates["gemm"].get(f"triton@{cfg.machine}") or self.rates["gemm"]["triton"]
        t_b = cfg.block_m * FLOP_ROW / (g["tflops"] * 1e12) * 1e3
        single_blocks, bound_blocks = grid_blocks(expect, bound), grid_blocks(bound, bound)
        ms = 0.0
        # L1 (gate+up, with SwiGLU) and L2 (down): their tiles per block and their shares of a block's work
        for nt, flop_frac in ((I_DIM // 128, 2 / 3), (H // 128, 1 / 3)):
            share_of_block = nt / TILES_PER_BLOCK  # of a block's CTAs, in empty_ms's per-block price
            if single_blocks * nt + tail >= bound_blocks * nt:
                ms += self.empty_ms(bound_blocks - blocks) * share_of_block
                continue
            # the CTAs launched past the ready blocks' tiles (the tail's count as blocks of this GEMM's tiles),
            # and the tail's slowdown on the blocks past the one-CTA-per-tile ones
            ms += (self.empty_ms(single_blocks + tail / nt - blocks) * share_of_block
                   + max(blocks - single_blocks, 0.0) * self.share * t_b * flop_frac * TAIL_SLOWDOWN)
        return ms

    def empty_ms(self, blocks: float) -> float:
        """The CTAs of ``blocks`` grid blocks past a call's ready range, on the SMs a PE has (all of them, or
        its MPS share): Triton launches one CTA per (block, tile) up to the bound, each reads the range and
        exits; CUTLASS sizes its persistent grid by the SMs, DeepGEMM is priced as a whole-buffer call."""
        if self.cfg.gemm != "triton" or blocks <= 0:
            return 0.0
        return blocks * EMPTY_BLOCK_US_SM / (H200_SMS / self.share) * 1e-3

    @staticmethod
    def _consumers(delays) -> list:
        # consumers with the same own delay see the same schedule (uniform routing): one of each
        return sorted({d: q for q, d in reversed(list(enumerate(delays)))}.values())

    def forward(self, delays) -> tuple:
        """(end of the slowest consumer, dispatch ms, GEMM ms, GEMM calls) for one draw of delays."""
        if self.grouped:
            return self._forward_grouped(delays)
        ends, disp_tot, reps = [], 0.0, self._consumers(delays)
        overlap = bool(self.cfg.dispatch_during_gemm)
        for q in reps:
            t = d_end = 0.0
            step_list = self.step_sources(q, delays)
            for s, srcs in enumerate(step_list):
                ready = max(delays[r] + (c + 1) * self.prod_chunk for r, c in srcs)
                d = self._dispatch_ms(sum(self.src_chunk_bytes for r, c in srcs if r != q))
                # the dispatch beside the previous step's call (after the previous dispatch), or after that call
                d_end = max(d_end if overlap else t, ready) + d
                t = max(t, d_end) + self.calls[s]
                if q == reps[0]:
                    disp_tot += d
            # the seal's own call (last_step_with_seal off); less the batch path's grids, which the rates hold
            ends.append(t + sum(self.calls[len(step_list):]) - self.batch_grid_ms)
        return max(ends), disp_tot, float(sum(self.calls)) - self.batch_grid_ms, len(self.calls)

    def _forward_grouped(self, delays) -> tuple:
        """Ready order with a window: per chunk, wait for the first ready source, take those ready within
        the window (waiting it out only while a source is still missing), dispatch them, one call; the
        step that takes the last source of the last chunk has the seal. A chunk has R steps: those after
        the one that took its last source take nothing, and cost their GEMM calls over an empty range (a
        whole-buffer call with DeepGEMM, the grid bound's CTAs with Triton); their dispatch kernels are
        left out."""
        R, C = self.R, self.C
        ends, disp_tot, gemm_tot, n_calls, reps = [], 0.0, 0.0, 0, self._consumers(delays)
        for q in reps:
            t, sizes = 0.0, []
            for c in range(C):
                ready = sorted((delays[r] + (c + 1) * self.prod_chunk, r != q, r) for r in range(R))
                i, j = 0, 0
                while i < R:
                    t_first = max(t, ready[i][0])
                    g = [x for x in ready[i:] if x[0] <= t_first + self.window]
                    t_take = max(t_first, max(x[0] for x in g)) if len(g) == R - i else t_first + self.window
                    i += len(g)
                    sizes.append(len(g))
                    d = self._dispatch_ms(sum(self.src_chunk_bytes for x in g if x[2] != q))
                    call = self.group_call(sizes, c == C - 1 and i == R, j)
                    t = t_take + d + call
                    j += 1
                    if q == reps[0]:
                        disp_tot, gemm_tot, n_calls = disp_tot + d, gemm_tot + call, n_calls + 1
                idle = sum(self.grid_ms(self.step_bound(k), self.step_expect(k), 0.0) for k in range(j, R))  # idle steps
                t += idle
                if q == reps[0]:
                    gemm_tot += idle
            t -= self.batch_grid_ms   # the batch path's grids, which the fitted rates hold
            if q == reps[0]:
                gemm_tot -= self.batch_grid_ms
            if self.cfg.gemm == "deep_gemm":   # the empty steps' calls, after the last one that took a source
                empty = C * R - len(sizes)
                t += empty * self._whole_call()
                if q == reps[0]:
                    gemm_tot, n_calls = gemm_tot + empty * self._whole_call(), n_calls + empty
            ends.append(t)
        return max(ends), disp_tot, gemm_tot, n_calls


def predict(config, rates: dict | None = None) -> dict:
    """Phase times (ms) of one forward: {'total_ms', 'producer_ms', 'dispatch_ms', 'gemm_ms',
    'combine_ms', 'wait_ms', 'gemm_calls', 'steps', ...}. ``config``: a Config or a dict with its
    fields (``tokens_per_rank`` is accepted for ``tokens``)."""
    cfg = _norm(config)
    sch = _Schedule(cfg, rates or load_rates())
    R, T, m = sch.R, sch.T, sch.m
    if cfg.skew_ms:
        if cfg.skew_draws:   # the measured replays' draws, and their median forward (as the bench reports)
            draws = np.asarray(cfg.skew_draws, dtype=float).reshape(-1, R)
            stat = np.median
        else:
            draws = np.random.default_rng(7).uniform(0.0, cfg.skew_ms, size=(256, R))
            stat = np.mean
        res = [sch.forward(list(d)) for d in draws]
        end = float(stat([r[0] for r in res]))
        disp = res[0][1]
        gemm, n_calls = float(stat([r[2] for r in res])), res[0][3]
        delay = float(stat(draws.max(axis=1)))
    else:
        delays = [0.0] * R
        if cfg.straggler_ms and cfg.straggler_rank is not None:
            delays[int(cfg.straggler_rank) % R] = float(cfg.straggler_ms)
        elif cfg.straggler_ms:
            delays[R - 1] = float(cfg.straggler_ms)
        end, disp, gemm, n_calls = sch.forward(delays)
        delay = max(delays)
    comb = (m["c_fix_us"] + m["c_tok_us"] * T) * 1e-3
    if cfg.machine != "mps" and R > 1:
        # the K results of my tokens come back as bf16 rows, (R-1)/R of them from peers, over the link;
        comb += comb_bytes(T, R) / (sch.link * 1e9) * 1e3
    total = end + comb
    return {
        "total_ms": total, "producer_ms": sch.prod_chunk * sch.C, "dispatch_ms": disp, "gemm_ms": gemm,
        "combine_ms": comb, "wait_ms": max(total - comb - disp - gemm, 0.0), "late_ms": delay,
        "gemm_calls": n_calls, "steps": sch.steps, "rows_per_pe": sch.rows, "experts_per_pe": sch.E,
        "pull_fraction": sch.f_pull, "pulled_bytes": (R - 1) * T * sch.f_pull * ROW_BYTES,
    }


#: late-rank cases :func:`choose_by_model` weighs beside the on-time one (ms of one PE's producer delay)
MODEL_LATE_MS = (1.0, 3.0)


def choose_by_model(tokens: int, *, ranks: int, experts_per_pe: int, gemm: str, block_m: int, chunks: int,
                    source_order: str, link_GBps: float, shape: tuple = (7168, 2048, 8),
                    margin: float = 0.01, ready_window_us: float | None = None) -> AdaptiveChoice:
    """The batch path or a buffer's own streamed plan for ``tokens`` tokens per PE, from the model
    (:func:`predict`, one GPU per PE): each path's regret is its worst ratio over the faster path in the cases
    on time and with one PE ``MODEL_LATE_MS`` late, and the streamed plan is taken where its regret is below
    batch's by more than ``margin`` (the tuned table's rule). ``shape``: ``(hidden, intermediate, topk)`` of the
    layer; the model's rates are DeepSeek-V3's expert shapes on an H200, so any other shape gets the batch path.
    ``ready_window_us``: the buffer's grouping window (ready order; None: one source per step). The answer's
    ``source`` is ``"model"``."""
    if tuple(shape) != (H, I_DIM, TOPK):
        return AdaptiveChoice(tokens, "batch", block_m, tokens, source="model",
                              note=f"the cost model covers (hidden, intermediate, topk) = {(H, I_DIM, TOPK)} only, "
                                   f"not {tuple(shape)}: the batch path")
    if gemm not in load_rates()["gemm"]:
        return AdaptiveChoice(tokens, "batch", block_m, tokens, source="model",
                              note=f"the cost model has no rates for gemm={gemm!r}: the batch path")
    base = dict(ranks=ranks, tokens=tokens, experts_per_pe=experts_per_pe, gemm=gemm, block_m=block_m,
                machine="gpu", link_GBps=link_GBps)
    times = {p: [] for p in ("batch", "streamed")}
    for late in (0.0,) + MODEL_LATE_MS:
        case = dict(base, straggler_ms=late, straggler_rank=ranks - 1 if late else None)
        times["batch"].append(predict(dict(case, path="batch"))["total_ms"])
        times["streamed"].append(predict(dict(case, path="streamed", chunks=chunks, source_order=source_order,
                                              ready_window_us=ready_window_us))["total_ms"])
    best = [min(b, s) for b, s in zip(times["batch"], times["streamed"])]
    regret = {p: max(t / f for t, f in zip(ts, best)) for p, ts in times.items()}
    path = "streamed" if regret["streamed"] < regret["batch"] * (1.0 - margin) else "batch"
    return AdaptiveChoice(tokens, path, block_m, -(-tokens // chunks) if path == "streamed" else tokens,
                          num_slots=chunks, policy="spin_kernel" if path == "streamed" else None, chunks=chunks,
                          source_order=source_order, ready_window_us=ready_window_us, source="model",
                          note=f"cost model: regret streamed {regret['streamed']:.3f}, batch {regret['batch']:.3f} "
                               f"(on time and {', '.join(format(x, 'g') for x in MODEL_LATE_MS)} ms late)")
