"""Triton kernels of the MoE producer: the router's logits, the routing rule (top-k) and the FP8 quantization
of the activations, with the FP8 rule itself (:func:`_quant_fp8_rows`) that the consumer's kernels
(``streamring.device.moe_triton``: the L1 epilogue, the CUTLASS path's SwiGLU kernel) quantize through, so
that their rows are bitwise alike.

Device code only, as ``moe_triton``: every function here launches one kernel on the current torch stream and
returns at once. Each row's result depends on that row only (fixed tiles, row-local reductions), so a chunk and
the whole batch give bitwise identical logits, expert choices, weights and FP8 rows.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: whether Triton runs as its CPU interpreter in this process (TRITON_INTERPRET=1: the tests); the other device
#: modules' kernels read it here too. The interpreter mis-computes bf16 tl.dot; there the router runs in float32
#: (bf16 values are exact in float32, only the accumulation differs from the GPU path).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# ... and its float32 -> e4m3 cast loses the carry into the exponent (124.9 -> 64 instead of 128):
# there the value is rounded to the e4m3 grid first (round half up; the GPU rounds half to even).
_INTERP = tl.constexpr(INTERPRET)


@triton.jit
def _to_fp8(v):
    if _INTERP:
        ex = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(v), 1e-30))), -6.0)
        step = tl.exp2(ex - 3.0)
        v = tl.floor(v / step + 0.5) * step
    return v.to(tl.float8e4nv)


@triton.jit
def _quant_fp8_rows(x):
    # The activation rule of the ring (moe.math.quantize_act_fp8): one float32 scale per row of the
    # 128-column group ``x [rows, 128]``, ``s = max(amax, AMAX_EPS 1e-12) / FP8_MAX 448``; returns the
    # e4m3 values and the scales. The producer's layout, the L1 epilogue and the CUTLASS path's
    # SwiGLU kernel all quantize through here, so their rows are bitwise alike.
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
    s = amax / 448.0
    q = _to_fp8(tl.clamp(x / s[:, None], -448.0, 448.0))
    return q, s


# Integer arguments that change between launches of one forward (row counts, chunk indices,
# offsets) are not specialized: a new value must never trigger a compile (a module load in the
# middle of an enqueued stream can deadlock against a stream that waits on the ring).
@triton.jit(do_not_specialize=["x_stride", "n_rows"])
def _router_logits_kernel(x_ptr, x_stride, w_ptr, out_ptr, n_rows,
                          H: tl.constexpr, E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr):
    # Fixed BMxBN tiles: a token's logits never depend on how many tokens share the launch
    # (a chunk and the whole batch give bitwise identical logits, hence identical top-k).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < n_rows
    kk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + k0 + kk[None, :], mask=rmask[:, None], other=0.0)
        b = tl.load(w_ptr + cols.to(tl.int64)[:, None] * H + k0 + kk[None, :], mask=(cols < E)[:, None], other=0.0)
        acc += tl.dot(a, tl.trans(b))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], acc, mask=rmask[:, None] & (cols < E)[None, :])


#: the router GEMM's tile (rows x experts x K step), warps and pipeline stages. One tile for every token
#: count: a token's logits must not depend on how many tokens share the launch (bench/routing.py
#: measures the alternatives).
ROUTER_LOGITS_LAUNCH = {"bm": 64, "bn": 128, "bk": 64, "num_warps": 4, "num_stages": 3}


def router_logits(x, w_bf16, out, launch: dict | None = None) -> None:
    """``out[T, E] (float32) = x[T, H] (bf16) @ w_bf16[E, H].T`` on fixed tiles (``launch``: default
    :data:`ROUTER_LOGITS_LAUNCH`)."""
    t, h = x.shape
    e = w_bf16.shape[0]
    if t == 0:
        return
    cfg = launch or ROUTER_LOGITS_LAUNCH
    bn = min(cfg["bn"], triton.next_power_of_2(e))
    if INTERPRET:
        x, w_bf16 = x.float(), w_bf16.float()
    grid = (triton.cdiv(t, cfg["bm"]), triton.cdiv(e, bn))
    _router_logits_kernel[grid](x, x.stride(0), w_bf16, out, t, H=h, E=e, BM=cfg["bm"], BN=bn, BK=cfg["bk"],
                                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


@triton.jit
def _route_score(lg, mx, denom, SOFTMAX: tl.constexpr):
    # A routing score from its logit: the softmax probability (``mx``/``denom``: the row's max and sum of
    # exponentials) or the sigmoid. The top-k weights recompute it from the picked logit with the same
    # operations, hence the same bits as the score the pick compared.
    if SOFTMAX:
        return tl.exp(lg - mx) / denom
    else:
        return tl.sigmoid(lg)


@triton.jit
def _choice_scores(lg, bias_ptr, cols, cvalid, E: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BR: tl.constexpr):
    # ``(sel, mx, denom)``: the scores the picks compare, from the logits ``lg [BR, EP]`` (columns past E:
    # -inf), and the softmax's row max and sum of exponentials (zeros for the sigmoid rule, whose choice
    # adds the bias). A NaN score (rows past a forward's device token count hold stale data) competes as
    # -1e30: below every real score, still above the -inf of masked and already picked columns (a group
    # score, the sum of two, stays finite), so every pick is a distinct valid expert and no reduction sees NaN.
    NEG = float("-inf")
    mx = tl.zeros((BR,), dtype=tl.float32)
    denom = tl.zeros((BR,), dtype=tl.float32)
    if SOFTMAX:
        mx = tl.max(tl.where(cvalid, lg, NEG), axis=1)
        denom = tl.sum(tl.where(cvalid, tl.exp(lg - mx[:, None]), 0.0), axis=1)
        sel = tl.where(cvalid, _route_score(lg, mx[:, None], denom[:, None], SOFTMAX), NEG)
    else:
        sel = _route_score(lg, mx[:, None], denom[:, None], SOFTMAX)
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + cols, mask=cols < E, other=0.0)[None, :]
        sel = tl.where(cvalid, sel, NEG)
    sel = tl.where(sel != sel, -1.0e30, sel)
    return sel, mx, denom


@triton.jit
def _keep_best_groups(sel, cols, E: tl.constexpr, EP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, BR: tl.constexpr):
    # The group limit of the deepseek_v3 rule: a group's score is the sum of its two best ``sel``; the
    # TOPK_GROUP best groups (the lowest group on a tie) keep their scores, every other column becomes -inf.
    NEG = float("-inf")
    EPG: tl.constexpr = E // G
    if E == EP and G == GP:  # power-of-two sizes: all groups at once in a [BR, G, E/G] view
        v3 = tl.reshape(sel, (BR, G, EPG))
        top1 = tl.max(v3, axis=2)
        if EPG > 1:
            first = tl.argmax(v3, axis=2, tie_break_left=True)
            rest = tl.where(tl.arange(0, EPG)[None, None, :] == first[:, :, None], NEG, v3)
            gscore = top1 + tl.max(rest, axis=2)
        else:
            gscore = top1
        gcols = tl.arange(0, G)
        keep = tl.zeros((BR, G), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, axis=1, tie_break_left=True)
            keep = tl.where(gcols[None, :] == best[:, None], 1, keep)
            gscore = tl.where(gcols[None, :] == best[:, None], NEG, gscore)
        keep3 = tl.broadcast_to(keep[:, :, None], (BR, G, EPG))
        sel = tl.where(tl.reshape(keep3, (BR, EP)) != 0, sel, NEG)
    else:  # any sizes: one group at a time
        grp = cols // EPG
        gcols = tl.arange(0, GP)
        gscore = tl.full((BR, GP), NEG, tl.float32)
        for gi in tl.static_range(G):
            v = tl.where((grp == gi)[None, :], sel, NEG)
            top1 = tl.max(v, axis=1)
            if EPG > 1:
                first = tl.argmax(v, axis=1, tie_break_left=True)
                top1 = top1 + tl.max(tl.where(cols[None, :] == first[:, None], NEG, v), axis=1)
            gscore = tl.where(gcols[None, :] == gi, top1[:, None], gscore)
        keep = tl.zeros((BR, EP), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, axis=1, tie_break_left=True)
            keep = tl.where(grp[None, :] == best[:, None], 1, keep)
            gscore = tl.where(gcols[None, :] == best[:, None], NEG, gscore)
        sel = tl.where(keep != 0, sel, NEG)
    return sel


@triton.jit
def _pick_experts(sel, cols, ks, row_ptr, rmask, mx, denom, routed_scale, K: tl.constexpr, KP: tl.constexpr,
                  SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr, BR: tl.constexpr):
    # ``(idx, w) [BR, KP]``: K picks, largest ``sel`` first (the lowest column on a tie, as an iterative top-k
    # picks); each weight is recomputed from the picked logit (the same bits as the score the pick compared)
    # and summed in pick order j = 0..K-1 for the rule's normalization, then the sigmoid rule's scaling.
    NEG = float("-inf")
    idx = tl.zeros((BR, KP), dtype=tl.int64)
    w = tl.zeros((BR, KP), dtype=tl.float32)
    total = tl.zeros((BR,), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(sel, axis=1, tie_break_left=True)
        sel = tl.where(cols[None, :] == best[:, None], NEG, sel)
        wj = _route_score(tl.load(row_ptr + best, mask=rmask, other=0.0), mx, denom, SOFTMAX)
        idx = tl.where(ks[None, :] == j, best.to(tl.int64)[:, None], idx)
        w = tl.where(ks[None, :] == j, wj[:, None], w)
        total = total + wj
    if SOFTMAX:
        if NORMALIZE:
            w = w / total[:, None]
    else:
        if NORMALIZE:
            w = w / (total + 1e-20)[:, None]
        w = w * routed_scale
    return idx, w


@triton.jit(do_not_specialize=["n_rows"])
def _select_experts_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, n_rows, routed_scale,
                           E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                           SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                           G: tl.constexpr, GP: tl.constexpr, TOPK_GROUP: tl.constexpr, BR: tl.constexpr):
    # The routing rule of moe.routers.select_experts, one row block per program, every step row-local:
    # the scores, the deepseek_v3 rule's group limit, the picks and their weights.
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, EP)
    rmask = rows < n_rows
    cvalid = (cols < E)[None, :]
    r64 = rows.to(tl.int64)
    row_ptr = logits_ptr + r64 * E
    lg = tl.load(row_ptr[:, None] + cols[None, :], mask=rmask[:, None] & cvalid, other=0.0)
    sel, mx, denom = _choice_scores(lg, bias_ptr, cols, cvalid, E, SOFTMAX, HAS_BIAS, BR)
    if not SOFTMAX:
        if G > 1:
            sel = _keep_best_groups(sel, cols, E, EP, G, GP, TOPK_GROUP, BR)
    ks = tl.arange(0, KP)
    idx, w = _pick_experts(sel, cols, ks, row_ptr, rmask, mx, denom, routed_scale, K, KP, SOFTMAX, NORMALIZE, BR)
    omask = rmask[:, None] & (ks < K)[None, :]
    tl.store(idx_ptr + r64[:, None] * K + ks[None, :], idx, mask=omask)
    tl.store(w_ptr + r64[:, None] * K + ks[None, :], w, mask=omask)


#: rows per program and warps of the routing kernel (bench/routing.py measures the alternatives: 8 rows
#: and 4 warps were the fastest at 8192 tokens on an H200, 0.024 ms)
SELECT_EXPERTS_LAUNCH = {"rows": 8, "num_warps": 4}


def select_experts(logits, bias, idx_out, w_out, *, topk: int, softmax: bool, normalize: bool, n_group: int = 1,
                   topk_group: int = 1, routed_scaling_factor: float = 1.0, launch: dict | None = None) -> None:
    """The routing rule of :func:`streamring.moe.routers.select_experts` in one kernel: from float32
    ``logits [T, E]`` write ``idx_out [T, topk]`` (int64, contiguous) and ``w_out [T, topk]``
    (float32, contiguous).

    ``softmax``: the ``softmax_topk`` rule (``normalize`` = its ``renormalize``); otherwise the
    ``deepseek_v3`` rule (sigmoid scores, ``bias`` float32 ``[E]`` or None added for the choice,
    ``n_group``/``topk_group`` group limit, ``normalize`` = ``norm_topk_prob``, then
    ``routed_scaling_factor``). Experts are picked largest first, the lowest index on a tie, and
    the weight sum runs in that order, as the rule says. Each row's result depends on that row only.
    ``launch``: rows per program and warps (default :data:`SELECT_EXPERTS_LAUNCH`).
    """
    launch = launch or SELECT_EXPERTS_LAUNCH
    t, e = logits.shape
    if t == 0:
        return
    if softmax and n_group != 1:
        raise ValueError(f"select_experts: n_group applies to the deepseek_v3 rule only, got {n_group} with softmax")
    if e % n_group or not 1 <= topk_group <= n_group or not 1 <= topk <= (e // n_group) * topk_group:
        raise ValueError(f"select_experts: E={e}, n_group={n_group}, topk_group={topk_group}, topk={topk}: "
                         f"need E % n_group == 0, 1 <= topk_group <= n_group, 1 <= topk <= "
                         f"topk_group * E / n_group")
    for name, tns, dtype in (("logits", logits, "float32"), ("idx_out", idx_out, "int64"), ("w_out", w_out, "float32")):
        if not tns.is_contiguous() or str(tns.dtype) != f"torch.{dtype}":
            raise ValueError(f"select_experts: {name} must be contiguous {dtype}, got "
                             f"{tns.dtype} with strides {tns.stride()}")
    br, warps = launch["rows"], launch["num_warps"]
    _select_experts_kernel[(triton.cdiv(t, br),)](
        logits, bias if bias is not None else logits, idx_out, w_out, t, float(routed_scaling_factor),
        E=e, EP=triton.next_power_of_2(e), K=topk, KP=triton.next_power_of_2(topk), SOFTMAX=softmax,
        NORMALIZE=normalize, HAS_BIAS=bias is not None, G=n_group, GP=triton.next_power_of_2(n_group),
        TOPK_GROUP=topk_group, BR=br, num_warps=warps)


@triton.jit(do_not_specialize=["x_stride", "n_rows"])
def _quant_rows_kernel(x_ptr, x_stride, q_ptr, sf_ptr, n_rows, H: tl.constexpr, BR: tl.constexpr):
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = g * 128 + tl.arange(0, 128)
    rmask = rows < n_rows
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * x_stride + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    q, s = _quant_fp8_rows(x)
    tl.store(q_ptr + r64[:, None] * H + cols[None, :], q, mask=rmask[:, None])
    tl.store(sf_ptr + r64 * (H // 128) + g, s, mask=rmask)


def quant_rows(x, q, sf) -> None:
    """Quantize ``x[T, H]`` into ``q[T, H]`` (float8_e4m3fn, contiguous) and ``sf[T, H/128]``."""
    t, h = x.shape
    if t == 0:
        return
    grid = (triton.cdiv(t, 16), h // 128)
    _quant_rows_kernel[grid](x, x.stride(0), q, sf, t, H=h, BR=16, num_warps=4)
