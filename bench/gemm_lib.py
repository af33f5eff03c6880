"""The expert-GEMM benchmark's pieces that other scripts reuse (``bench.gemm`` is the script).

* :class:`Case`: the buffers and input sets of one token count (the block consumer of ``--block-m``
  rows, CUTLASS's own outputs, torch's sorted rows, DeepGEMM's 128-row consumer) and every GEMM call of
  the benchmark on them (``triton_l1``, ``cutlass_l1``, ``deep_gemm_exact_l1``...);
* :func:`parse_variants`: CUTLASS variant specs (``--l1`` / ``--l2``) into tiles, dtypes, rasters and
  swizzles;
* :func:`make_table`: the heuristic table (``streamring/gemm/table.json``) from benchmark rows;
* :func:`layer_forward`: the whole batch layer through one GEMM implementation;
* :func:`deep_gemm_first_call`: DeepGEMM's first call in a child process (a crash ends the child).

Used by ``bench.gemm``, ``bench.gemm_launches``, ``bench.make_gemm_table``, ``bench.gemm_profile`` and
``bench.layer_replay``; the shape, inputs and timing helpers are :mod:`bench.common`'s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

from bench.common import FP8, uniform_inputs
from streamring.gemm import cutlass as CG
from streamring.gemm import deep_gemm as DG
from streamring.device import moe_triton as K
from streamring.moe import blocks as B
from streamring.gemm import choice as GC
from streamring.moe.math import MoEShape
from streamring.moe.weight_views import FP8BlocksView
from bench import block_paths

# ----------------------------------------------------------------------------------------------
# one token count
# ----------------------------------------------------------------------------------------------
class Case:
    """Buffers and input sets of one token count (a consumer of ``--block-m`` rows per block for Triton
    and CUTLASS; with DeepGEMM a second one of 128-row blocks, same routing and activations)."""

    def __init__(self, T: int, shape: MoEShape, fw: FP8BlocksView, args, dev, dg=None):
        self.T, self.shape, self.fw, self.dev, self.dg = T, shape, fw, dev, dg
        E, Kk, H, I = shape.num_experts, shape.topk, shape.hidden, shape.intermediate
        self.bc = B.BlockConsumer(shape, T, 1, args.block_m, dev)
        bc = self.bc
        rows_buf = bc.max_blocks * bc.block_m
        gen = torch.Generator(device=dev)
        gen.manual_seed(args.seed + T)
        self.sets = []
        for _ in range(args.sets):
            self.sets.append(uniform_inputs(T, shape, gen, dev))
        self.rows = T * Kk
        # the CUTLASS path's own outputs (the Triton path writes bc.h1 / bc.h1_sf / bc.y)
        self.gu = {torch.float32: torch.empty(rows_buf, 2 * I, dtype=torch.float32, device=dev),
                   torch.bfloat16: torch.empty(rows_buf, 2 * I, dtype=torch.bfloat16, device=dev)}
        self.h1c = torch.empty(rows_buf, I, dtype=FP8, device=dev)
        self.h1c_sf = torch.empty(rows_buf, I // 128, dtype=torch.float32, device=dev)
        self.h1c_sfw = torch.empty_like(self.h1c_sf)
        self.yc = torch.empty(rows_buf, H, dtype=torch.bfloat16, device=dev)
        self.h1t_sfw = torch.empty_like(self.h1c_sf)  # Triton's h1_sf x routing weight: CUTLASS L2's input
        # weight scales as the 64-row-scale tiles read them (made once per weights)
        self.w_sf = {("w1", 128): fw.w1_sf, ("w2", 128): fw.w2_sf,
                     ("w1", 64): CG.weight_scales_for(fw.w1_sf, 64), ("w2", 64): CG.weight_scales_for(fw.w2_sf, 64)}
        # torch._scaled_grouped_mm inputs (rows sorted by expert), refilled per set
        self.real_rows = torch.empty(self.rows, dtype=torch.int64, device=dev)
        self.a_t = torch.empty(self.rows, H, dtype=FP8, device=dev)
        self.a_t_scale = torch.empty(self.rows, dtype=torch.float32, device=dev)
        self.h_t = torch.empty(self.rows, I, dtype=FP8, device=dev)
        self.h_t_scale = torch.empty(self.rows, dtype=torch.float32, device=dev)
        self.offs = torch.empty(E, dtype=torch.int32, device=dev)
        self.w1_t = fw.w1.transpose(1, 2)
        self.w2_t = fw.w2.transpose(1, 2)
        self.w1_col_scale = fw.w1_sf.amax(dim=2).repeat_interleave(128, dim=1).contiguous()  # [E, 2I]
        self.w2_col_scale = fw.w2_sf.amax(dim=2).repeat_interleave(128, dim=1).contiguous()  # [E, H]
        self.experts_used = 0
        if dg is not None:
            # DeepGEMM: 128-row blocks; its buffers as DeepGemmExperts holds them
            self.bd = B.BlockConsumer(shape, T, 1, DG.BLOCK_M, dev)
            rows_d = self.bd.max_blocks * DG.BLOCK_M
            self.d_m_idx = torch.full((rows_d,), -1, dtype=torch.int32, device=dev)
            self.d_psum = torch.zeros(E, dtype=torch.int32, device=dev)
            self.d_status = torch.zeros(1, dtype=torch.int32, device=dev)
            self.d_a_sf = DG.mn_major_scales(rows_d, H // 128, dev)
            self.d_gu = torch.empty(rows_d, 2 * I, dtype=torch.bfloat16, device=dev)
            self.d_h1 = torch.empty(rows_d, I, dtype=FP8, device=dev)
            self.d_h1_sf = torch.empty(rows_d, I // 128, dtype=torch.float32, device=dev)
            self.d_h1_sfw = torch.empty_like(self.d_h1_sf)
            self.d_h1t_sfw = DG.mn_major_scales(rows_d, I // 128, dev)  # Triton's h1_sf x weight, MN-major
            self.d_y = torch.empty(rows_d, H, dtype=torch.bfloat16, device=dev)
            self.d_real_rows = torch.empty(self.rows, dtype=torch.int64, device=dev)
            # DeepGEMM over the allocated blocks only: M = the most blocks any set allocates (the batch
            # path hands out ids 0..n-1), scales MN-major for exactly M rows
            self.m_exact = 0
            for s in range(len(self.sets)):
                idx, w, q, sf = self.sets[s]
                self.bd.begin()
                self.bd.dispatch(0, idx, w, q, sf, 0)
                self.bd.seal(1)
                n = int(self.bd.ready_hi[2])
                ids = self.bd.ready_list[:n].sort().values
                if not torch.equal(ids, torch.arange(n, dtype=ids.dtype, device=dev)):
                    self.m_exact = -1  # blocks not 0..n-1: no exact-M variant
                    break
                self.m_exact = max(self.m_exact, n * DG.BLOCK_M)
            if self.m_exact > 0:
                self.d_a_sf_x = DG.mn_major_scales(self.m_exact, H // 128, dev)
                self.d_h1t_sfw_x = DG.mn_major_scales(self.m_exact, I // 128, dev)

    def triton_l1(self, bc=None):
        bc, fw = bc or self.bc, self.fw
        K.expert_l1(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.a.view(FP8), bc.a_sf,
                    fw.w1, fw.w1_sf, bc.h1.view(FP8), bc.h1_sf, block_m=bc.block_m)

    def triton_l2(self, bc=None):
        bc, fw = bc or self.bc, self.fw
        K.expert_l2(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.h1.view(FP8), bc.h1_sf,
                    fw.w2, fw.w2_sf, bc.row_weight, bc.y, bc.block_rows, block_m=bc.block_m)

    def cutlass_l1(self, plan: CG.GroupedGemm):
        bc, fw = self.bc, self.fw
        gu = self.gu[plan.out_dtype]
        plan.run(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.a.view(FP8), bc.a_sf, fw.w1,
                 self.w_sf[("w1", plan.sf_n)], gu, block_m=bc.block_m)
        K.swiglu_quant_blocks(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, gu, self.h1c, self.h1c_sf,
                              bc.row_weight, self.h1c_sfw, block_m=bc.block_m)

    def cutlass_l2(self, plan: CG.GroupedGemm):
        bc, fw = self.bc, self.fw
        plan.run(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.h1.view(FP8), self.h1t_sfw,
                 fw.w2, self.w_sf[("w2", plan.sf_n)], self.yc, block_m=bc.block_m)

    def deep_gemm_prep(self):
        """What gemm='deep_gemm''s batch call does besides the GEMMs: the psum layout and the MN-major scale
        copies. (A streamed chunk's call builds m_indices instead: made once per input set in
        :meth:`load`, for the ``deep_gemm_m_indices`` and ``deep_gemm_exact_m`` rows, and not timed.)"""
        bd = self.bd
        DG.psum_layout(bd.state, bd.expert_blocks, bd.ready_hi, 0, 2, self.shape.num_experts, bd.block_m,
                       out=self.d_psum, status=self.d_status)
        self.d_a_sf.copy_(bd.a_sf)
        self.d_h1t_sfw.copy_(self.d_h1_sfw)

    def _dg(self, a, b, d, psum: bool):
        DG.grouped_gemm(self.dg, a, b, d, self.d_psum if psum else self.d_m_idx, psum)

    def deep_gemm_l1(self, psum: bool = True):
        """gemm='deep_gemm''s L1 over the whole block buffer: the psum layout (the batch path), or
        ``m_indices`` with -1 rows (``psum=False``: a streamed chunk's call)."""
        bd, fw = self.bd, self.fw
        self._dg((bd.a.view(FP8), self.d_a_sf), (fw.w1, fw.w1_sf), self.d_gu, psum)
        K.swiglu_quant_blocks(bd.ready_list, bd.ready_hi, 0, 2, bd.max_blocks, self.d_gu, self.d_h1, self.d_h1_sf,
                              bd.row_weight, self.d_h1_sfw, block_m=bd.block_m)

    def deep_gemm_l2(self, psum: bool = True):
        bd, fw = self.bd, self.fw
        self._dg((bd.h1.view(FP8), self.d_h1t_sfw), (fw.w2, fw.w2_sf), self.d_y, psum)

    def deep_gemm_exact_l1(self):
        bd, fw, m = self.bd, self.fw, self.m_exact
        self.dg.m_grouped_fp8_gemm_nt_contiguous((bd.a.view(FP8)[:m], self.d_a_sf_x), (fw.w1, fw.w1_sf),
                                                 self.d_gu[:m], self.d_m_idx[:m])
        K.swiglu_quant_blocks(bd.ready_list, bd.ready_hi, 0, 2, bd.max_blocks, self.d_gu, self.d_h1, self.d_h1_sf,
                              bd.row_weight, self.d_h1_sfw, block_m=bd.block_m)

    def deep_gemm_exact_l2(self):
        bd, fw, m = self.bd, self.fw, self.m_exact
        self.dg.m_grouped_fp8_gemm_nt_contiguous((bd.h1.view(FP8)[:m], self.d_h1t_sfw_x), (fw.w2, fw.w2_sf),
                                                 self.d_y[:m], self.d_m_idx[:m])

    def torch_l1(self):
        return torch._scaled_grouped_mm(self.a_t, self.w1_t, self.a_t_scale, self.w1_col_scale, offs=self.offs,
                                        out_dtype=torch.bfloat16)

    def torch_l2(self):
        return torch._scaled_grouped_mm(self.h_t, self.w2_t, self.h_t_scale, self.w2_col_scale, offs=self.offs,
                                        out_dtype=torch.bfloat16)

    def load(self, s: int) -> None:
        """Dispatch input set ``s`` into the blocks (batch path), run the Triton L1 once (L2's input),
        and refill torch's sorted-row inputs (and DeepGEMM's consumer, its m_indices and scales)."""
        idx, w, q, sf = self.sets[s]
        bc, shape = self.bc, self.shape
        bc.begin()
        bc.dispatch(0, idx, w, q, sf, 0)
        bc.seal(1)
        self.triton_l1()
        torch.mul(bc.h1_sf, bc.row_weight[:, None], out=self.h1t_sfw)
        flat = idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        self.real_rows.copy_(bc.tok_row[order])
        counts = torch.bincount(flat, minlength=shape.num_experts)
        self.offs.copy_(torch.cumsum(counts, 0).to(torch.int32))
        self.experts_used = int((counts > 0).sum())
        torch.index_select(bc.a.view(FP8), 0, self.real_rows, out=self.a_t)
        torch.amax(bc.a_sf[self.real_rows], dim=1, out=self.a_t_scale)
        torch.index_select(bc.h1.view(FP8), 0, self.real_rows, out=self.h_t)
        torch.amax(self.h1t_sfw[self.real_rows], dim=1, out=self.h_t_scale)
        if self.dg is not None:
            bd = self.bd
            bd.begin()
            bd.dispatch(0, idx, w, q, sf, 0)
            bd.seal(1)
            self.triton_l1(bd)  # DeepGEMM L2's input, as Triton's h1 is CUTLASS L2's
            torch.mul(bd.h1_sf, bd.row_weight[:, None], out=self.d_h1_sfw)
            self.d_real_rows.copy_(bd.tok_row[order])
            DG.ready_m_indices(bd.ready_list, bd.ready_hi, 0, 2, bd.max_blocks, bd.block_expert, shape.num_experts,
                               bd.block_m, out=self.d_m_idx, status=self.d_status)
            self.deep_gemm_prep()
            if self.m_exact > 0:
                self.d_a_sf_x.copy_(bd.a_sf[:self.m_exact])
                self.d_h1t_sfw_x.copy_(self.d_h1_sfw[:self.m_exact])



def parse_variants(spec: str, gemm: str) -> dict:
    """``--l1`` / ``--l2`` into ``{name: (tile, out dtype, raster, swizzle)}`` (names as the rows carry
    them): L1 entries ``tile:out_dtype[:raster[:s<swizzle>]]``, L2 entries ``tile[:raster[:s<swizzle>]]``;
    an entry is read as the table key it names (``gemm.choice.parse_key``)."""
    dts = {"f32": torch.float32, "bf16": torch.bfloat16}
    out = {}
    for v in (x for x in spec.split(",") if x):
        parts = v.split(":")
        defaults = ["", "bf16", "m", "s1"] if gemm == "l1" else ["", "m", "s1"]
        given = parts + defaults[len(parts):]
        if gemm == "l2":
            given.insert(1, "bf16")
        fields = ["cutlass", *given[:3]] + ([given[3]] if given[3] != "s1" else [])  # a key leaves out s1
        try:
            c = None if len(parts) > len(defaults) else GC.parse_key(":".join(fields))
        except ValueError:
            c = None
        if c is None:
            raise ValueError(f"--{gemm} entry {v!r}: out dtype must be one of {sorted(dts)}, raster one of "
                             f"{sorted(CG.RASTERS)}, swizzle one of {[f's{s}' for s in CG.SWIZZLES]}")
        CG.variant_id(c.tile, dts[c.out])  # names what does not exist
        name = (f"cutlass_{c.tile}" + (f"_{c.out}" if gemm == "l1" else "") + ("_n" if c.raster == "n" else "")
                + (f"_s{c.swizzle}" if c.swizzle != 1 else ""))
        out[name] = (c.tile, dts[c.out], c.raster, c.swizzle)
    return out




def make_table(rows: list, num_experts: int, topk: int, meta: dict) -> dict:
    """The heuristic table (``streamring/gemm/table.json``) from this run's GEMM rows: per (tokens,
    GEMM) the rows per expert, N, K, every timed variant's median (torch's for reference) and the best."""
    groups: dict = {}
    for r in rows:
        if r.get("gemm") not in ("l1", "l2") or r.get("median_ms") is None:
            continue
        key = r["variant"] if r.get("variant") else (r["impl"] if r["impl"] == "torch_scaled_grouped_mm" else None)
        if key is None:
            continue
        g = groups.setdefault((r["tokens"], r["gemm"]), {"rows_per_expert": r["tokens"] * topk / num_experts,
                                                         "tokens": r["tokens"], "gemm": r["gemm"], "n": r["n_dim"],
                                                         "k": r["k_dim"], "times_ms": {}, "block_m": {}})
        g["times_ms"][key] = round(float(r["median_ms"]), 4)
        g["block_m"][key] = r.get("block_m")
    entries = []
    for g in groups.values():
        cands = {k: v for k, v in g["times_ms"].items() if k != "torch_scaled_grouped_mm"}
        g["best"] = min(cands, key=cands.get) if cands else None
        entries.append(g)
    entries.sort(key=lambda e: (e["gemm"], e["rows_per_expert"]))
    return {"measured": bool(entries), "date": meta.get("date"), "device": meta.get("device"),
            "source": "python -m bench.gemm (docs/results/gemm-<date>.json holds the full rows)",
            "note": "per (rows per expert = tokens x top-k / experts, N, K): median ms of every implementation "
                    "variant that passed its correctness check; choose_gemm takes the fastest available one",
            "entries": entries}




# ----------------------------------------------------------------------------------------------
# the whole batch layer, per GEMM implementation
# ----------------------------------------------------------------------------------------------
def layer_forward(impl: str, choice, block_m: int, x, shape, fw, dev):
    """The batch layer on ``x`` (router, layout, ``blocks.moe_forward``) through ``impl``'s GEMMs, with its
    own producer, block consumer and buffers: ``(fwd, out, bc)``; ``fwd()`` writes ``out`` (what
    ``layer_rows`` captures, and ``bench.layer_replay`` runs alone)."""
    T = x.shape[0]
    prod = B.Producer(T, shape.num_experts, dev)
    bc = B.BlockConsumer(shape, T, 1, block_m, dev)
    # batch: one call over every block, so DeepGEMM may write y directly (see gemm.deep_gemm.DeepGemmExperts)
    GC.setup_consumer(bc, choice, staging_y=True)
    sc = block_paths.scratch_buffers(shape, T, dev)
    out = torch.zeros(T, shape.hidden, dtype=torch.bfloat16, device=dev)

    def fwd():
        prod.route(x, fw, shape, sc["idx"][:T], sc["w"][:T])
        prod.layout(x, sc["q"][:T], sc["sf"][:T])
        B.moe_forward(sc["idx"][:T], sc["w"][:T], sc["q"][:T], sc["sf"][:T], fw, bc, out, gemm_impl=impl)

    return fwd, out, bc




_DG_FIRST_CALL = """
import torch, deep_gemm
a = torch.randn(256, 256, device="cuda").to(torch.float8_e4m3fn)
sf = torch.rand(256, 2, device="cuda")
w = torch.randn(2, 256, 256, device="cuda").to(torch.float8_e4m3fn)
w_sf = torch.rand(2, 2, 2, device="cuda")
m_idx = torch.tensor([0] * 128 + [1] * 128, dtype=torch.int32, device="cuda")
d = torch.empty(256, 256, dtype=torch.bfloat16, device="cuda")
deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sf), (w, w_sf), d, m_idx)
torch.cuda.synchronize()
"""


def deep_gemm_first_call(timeout_s: float = 240.0) -> str | None:
    """DeepGEMM's first grouped call (JIT compile included) in a child process: None when it works, else
    what went wrong. A crash in deep_gemm (it segfaulted on 2026-12-01 when built with a compiler that
    links libstdc++ statically) then ends the child, not the benchmark."""
    try:
        res = subprocess.run([sys.executable, "-c", _DG_FIRST_CALL], capture_output=True, text=True,
                             timeout=timeout_s, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return f"its first call did not finish in {timeout_s:.0f} s in a child process"
    if res.returncode == 0:
        return None
    how = (f"signal {signal.Signals(-res.returncode).name}" if res.returncode < 0 else f"rc {res.returncode}")
    tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [""]
    return f"its first call in a child process ended with {how}: {tail[0][:300]}"
