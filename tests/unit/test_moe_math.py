"""Tests for streamring.moe.math (pure MoE math shared by batch and streamed paths) and its float64
reference (streamring.moe.reference)."""

import dataclasses

import pytest
import torch

from conftest import quick_subset
from single_process import batch_forward_single
from streamring.moe.math import (
    FP8_DTYPE,
    MoEShape,
    combine,
    dequantize_act_fp8,
    dequantize_weight_fp8_block,
    expert_block_forward,
    expert_pool_forward,
    quantize_act_fp8,
    quantize_weight_fp8_block,
)
from streamring.moe.routers import route, route_f64
from streamring.moe.weights import MoEWeights
from streamring.moe.reference import compare_to_reference, reference_forward_f64, reference_tolerance

H, I, E = 256, 128, 8


def make_shape(router="softmax_topk", weight_dtype="bf16", topk=2, intermediate=I, **kw):
    if router == "deepseek_v3":
        kw.setdefault("n_group", 4)
        kw.setdefault("topk_group", 2)
        kw.setdefault("routed_scaling_factor", 2.5)
    return MoEShape(hidden=H, intermediate=intermediate, num_experts=E, topk=topk,
                    router=router, weight_dtype=weight_dtype, **kw).validate()


_WCACHE = {}


def weights_for(shape, seed=0):
    key = (dataclasses.astuple(shape), seed)
    if key not in _WCACHE:
        _WCACHE[key] = MoEWeights.random(shape, seed)
    return _WCACHE[key]


def randn(*size, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*size, generator=g, dtype=torch.float32).to(dtype)


def bitwise_equal(a, b):
    """Same shape, dtype and bytes (distinguishes -0.0 from 0.0 and NaN payloads)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


# --------------------------------------------------------------------------- #
# MoEShape.validate
# --------------------------------------------------------------------------- #
BAD_SHAPES = [
    (dict(hidden=200), "hidden"),
    (dict(hidden=0), "hidden"),
    (dict(intermediate=100), "intermediate"),
    (dict(topk=0), "topk"),
    (dict(topk=9), "topk"),
    (dict(router="sparsemixer"), "router"),
    (dict(weight_dtype="int8"), "weight_dtype"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=0), "n_group"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(n_group=2, topk_group=0), "topk_group"),
    (dict(router="deepseek_v3", n_group=4, topk_group=1, topk=3), "topk"),
    (dict(block_m=0), "block_m"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(renormalize=1), "renormalize"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(num_experts=2.0), "num_experts"),
]


@pytest.mark.parametrize("kw,field", BAD_SHAPES)
def test_shape_validate_errors(kw, field):
    base = dict(hidden=H, intermediate=I, num_experts=E, topk=2)
    base.update(kw)
    with pytest.raises(ValueError, match=field):
        MoEShape(**base).validate()


def test_shape_validate_num_ranks():
    s = MoEShape(hidden=H, intermediate=I, num_experts=E, topk=2)
    s.validate(num_ranks=4)
    with pytest.raises(ValueError, match="num_experts"):
        s.validate(num_ranks=3)
    with pytest.raises(ValueError, match="num_ranks"):
        s.validate(num_ranks=0)


def test_shape_valid_deepseek():
    make_shape("deepseek_v3", topk=4).validate(num_ranks=8)
    MoEShape(H, I, E, 8, router="deepseek_v3", n_group=8, topk_group=8).validate()


# --------------------------------------------------------------------------- #
# MoEWeights
# --------------------------------------------------------------------------- #
def test_random_weights_deterministic_and_valid():
    for wd in ("bf16", "fp8"):
        s = make_shape(weight_dtype=wd)
        a = MoEWeights.random(s, 7).validate(s)
        b = MoEWeights.random(s, 7)
        c = MoEWeights.random(s, 8)
        for name in ("router_weight", "w1", "w3", "w2"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert torch.equal(ta.float(), tb.float())
        assert not torch.equal(a.w1.float(), c.w1.float())
        if wd == "fp8":
            assert a.w1.dtype == FP8_DTYPE and a.w1_scale.shape == (E, I // 128, H // 128)
            assert a.w2_scale.shape == (E, H // 128, I // 128)
        else:
            assert a.w1.dtype == torch.bfloat16 and a.w1_scale is None
    assert MoEWeights.random(make_shape("deepseek_v3"), 0).correction_bias.shape == (E,)
    assert MoEWeights.random(make_shape(), 0).correction_bias is None


def _replace(w, **kw):
    return dataclasses.replace(w, **kw)


def test_weights_validate_errors():
    s = make_shape(weight_dtype="fp8")
    w = weights_for(s)
    nan_rw = w.router_weight.clone()
    nan_rw[0, 0] = float("nan")
    bad_w1 = w.w1.clone()
    bad_w1.view(torch.uint8)[0, 0, 0] = 0x7F  # e4m3fn NaN
    cases = [
        (dict(router_weight=w.router_weight[:, :128]), "router_weight"),
        (dict(router_weight=w.router_weight.double()), "router_weight"),
        (dict(router_weight=nan_rw), "router_weight"),
        (dict(correction_bias=torch.zeros(E + 1)), "correction_bias"),
        (dict(correction_bias=torch.tensor([float("inf")] * E)), "correction_bias"),
        (dict(w1=w.w1[:, :, :128]), "w1"),
        (dict(w3=w.w3.float()), "w3"),
        (dict(w2=w.w2.transpose(1, 2)), "w2"),
        (dict(w1=bad_w1), "w1"),
        (dict(w1_scale=None), "w1_scale"),
        (dict(w3_scale=w.w3_scale[:, :, :1]), "w3_scale"),
        (dict(w2_scale=-w.w2_scale), "w2_scale"),
        (dict(w2_scale=w.w2_scale.double()), "w2_scale"),
    ]
    for kw, field in cases:
        with pytest.raises(ValueError, match=field):
            _replace(w, **kw).validate(s)
    sb = make_shape(weight_dtype="bf16")
    wb = weights_for(sb)
    with pytest.raises(ValueError, match="w1"):
        wb.validate(s)  # bf16 weights against an fp8 shape
    with pytest.raises(ValueError, match="w1_scale"):
        _replace(wb, w1_scale=w.w1_scale).validate(sb)
    with pytest.raises(ValueError, match="shape"):
        wb.validate("not a shape")


def test_local_experts():
    w = weights_for(make_shape())
    assert w.local_experts(0, 4) == range(0, 2)
    assert w.local_experts(3, 4) == range(6, 8)
    assert list(w.local_experts(0, 1)) == list(range(E))
    with pytest.raises(ValueError, match="num_ranks"):
        w.local_experts(0, 3)
    with pytest.raises(ValueError, match="rank"):
        w.local_experts(4, 4)
    with pytest.raises(ValueError, match="rank"):
        w.local_experts(-1, 4)


def test_dequantized_expert_cache_and_values():
    s = make_shape(weight_dtype="fp8")
    w = MoEWeights.random(s, 3)
    w1, w3, w2 = w.dequantized_expert(2)
    assert w1.dtype == torch.float32 and w1.shape == (I, H) and w2.shape == (H, I)
    assert w.dequantized_expert(2)[0] is w1  # cached
    ref = w.w1[2].float() * w.w1_scale[2].repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(w1, ref)
    with pytest.raises(ValueError, match="e must"):
        w.dequantized_expert(E)
    with pytest.raises(ValueError, match="dtype"):
        w.dequantized_expert(0, torch.float16)


# --------------------------------------------------------------------------- #
# fp8 quantization
# --------------------------------------------------------------------------- #
def _check_roundtrip(x, deq, scale_full):
    """|x - deq| <= 2^-4 |x| (normal range) or 2^-10 * scale (subnormal range).

    Both are <= 2^-3 of the value measured in block-amax-scaled units whenever
    the scaled value is >= 2^-7; fp8 e4m3 has 3 mantissa bits (half-ulp
    relative error 2^-4) and subnormal spacing 2^-9.
    """
    err = (x.double() - deq.double()).abs()
    scaled = x.double().abs() / scale_full.double()
    bound = torch.maximum(scaled * 2.0 ** -4, torch.full_like(scaled, 2.0 ** -10))
    bound = bound * scale_full.double() * (1 + 1e-6)
    assert bool((err <= bound).all()), float((err / bound).max())
    # the coarse spec bound: relative error <= 2^-3 of the block-amax-scaled value
    big = scaled >= 2.0 ** -7
    assert bool((err[big] <= 2.0 ** -3 * x.double().abs()[big]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_act_fp8_roundtrip(dtype):
    x = randn(37, H, seed=1) * torch.logspace(-3, 3, 37)[:, None]
    x = x.to(dtype)
    x[5] = 0.0  # zero row
    x[6, :128] = 0.0  # zero block
    q, sf = quantize_act_fp8(x)
    assert q.dtype == FP8_DTYPE and q.shape == (37, H)
    assert sf.dtype == torch.float32 and sf.shape == (37, H // 128)
    deq = dequantize_act_fp8(q, sf)
    assert deq.dtype == torch.float32
    assert bool(torch.isfinite(deq).all())
    assert torch.equal(deq[5], torch.zeros(H)) and torch.equal(deq[6, :128], torch.zeros(128))
    xf = x.float()
    amax = xf.reshape(37, -1, 128).abs().amax(-1)
    assert torch.allclose(sf[amax > 0], amax[amax > 0] / 448, rtol=1e-6, atol=0)
    assert float(q.float().abs().max()) <= 448
    _check_roundtrip(xf, deq, sf.repeat_interleave(128, 1))


def test_act_fp8_is_row_local():
    x = randn(20, H, seed=2)
    q, sf = quantize_act_fp8(x)
    q1, sf1 = quantize_act_fp8(x[7:8])
    assert torch.equal(q[7:8].view(torch.uint8), q1.view(torch.uint8))
    assert torch.equal(sf[7:8], sf1)


def test_act_fp8_rejects_bad_input():
    x = randn(4, H)
    x[2, 3] = float("nan")
    with pytest.raises(ValueError, match="x contains NaN/Inf at token 2"):
        quantize_act_fp8(x)
    x[2, 3] = float("inf")
    with pytest.raises(ValueError, match="x contains NaN/Inf at token 2"):
        quantize_act_fp8(x)
    with pytest.raises(ValueError, match="float32 range"):
        quantize_act_fp8(torch.full((2, H), 1e300, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must have shape"):
        quantize_act_fp8(randn(4, 200))
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_act_fp8(randn(H))
    with pytest.raises(ValueError, match="x must have dtype"):
        quantize_act_fp8(randn(4, H).half())
    q, sf = quantize_act_fp8(randn(4, H))
    with pytest.raises(ValueError, match="x_sf"):
        dequantize_act_fp8(q, sf[:, :1])
    with pytest.raises(ValueError, match="x_fp8"):
        dequantize_act_fp8(q.float(), sf)


def test_act_fp8_empty():
    q, sf = quantize_act_fp8(torch.zeros(0, H))
    assert q.shape == (0, H) and sf.shape == (0, 2)


def test_weight_fp8_roundtrip():
    w = randn(3, 256, 384, seed=4) * torch.logspace(-2, 2, 256)[None, :, None]
    w[1, :128, :128] = 0.0
    q, s = quantize_weight_fp8_block(w)
    assert q.dtype == FP8_DTYPE and s.shape == (3, 2, 3)
    deq = dequantize_weight_fp8_block(q, s)
    assert torch.equal(deq[1, :128, :128], torch.zeros(128, 128))
    full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)
    _check_roundtrip(w, deq, full)
    with pytest.raises(ValueError, match="w must have shape"):
        quantize_weight_fp8_block(randn(100, 128))
    bad = randn(128, 128)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="w must be finite"):
        quantize_weight_fp8_block(bad)
    with pytest.raises(ValueError, match="scale"):
        dequantize_weight_fp8_block(q, s[:, :1])


# --------------------------------------------------------------------------- #
# routing
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("topk", [1, 2, 4])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_router(topk, renormalize):
    s = make_shape(topk=topk, renormalize=renormalize)
    w = weights_for(s)
    x = randn(50, H, seed=5)
    idx, wt = route(x, w, s)
    assert idx.dtype == torch.int64 and idx.shape == (50, topk)
    assert wt.dtype == torch.float32 and wt.shape == (50, topk)
    probs = torch.softmax(x.double() @ w.router_weight.double().T, dim=-1)
    ref_w, ref_i = torch.topk(probs, topk, dim=-1)
    assert torch.equal(idx, ref_i)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert torch.allclose(wt.sum(-1).double(), torch.ones(50, dtype=torch.float64),
                              atol=1e-6)
    assert torch.allclose(wt.double(), ref_w, rtol=1e-5, atol=1e-7)
    assert bool((wt[:, :-1] >= wt[:, 1:]).all())  # sorted
    i64, w64 = route_f64(x, w, s)
    assert w64.dtype == torch.float64 and torch.equal(i64, idx)


def _groups_used(idx, experts_per_group):
    return [len(set((row // experts_per_group).tolist())) for row in idx]


@pytest.mark.parametrize("n_group,topk_group,topk", [(4, 1, 2), (4, 2, 4), (2, 1, 3),
                                                     (8, 3, 3), (1, 1, 4)])
def test_deepseek_group_limited(n_group, topk_group, topk):
    s = make_shape("deepseek_v3", topk=topk, n_group=n_group, topk_group=topk_group)
    w = weights_for(s)
    x = randn(300, H, seed=6)
    idx, wt = route(x, w, s)
    epg = E // n_group
    used = _groups_used(idx, epg)
    assert max(used) <= topk_group
    for row in idx.tolist():
        assert len(set(row)) == topk  # distinct experts
    # independent group-limited selection in float64 agrees on the chosen sets
    logits = x.double() @ w.router_weight.double().T
    sc = torch.sigmoid(logits) + w.correction_bias.double()
    g = sc.view(300, n_group, epg)
    gs = g.topk(min(2, epg), dim=-1).values.sum(-1)
    keep = torch.zeros(300, n_group, dtype=torch.bool)
    keep.scatter_(1, gs.topk(topk_group, dim=-1).indices, True)
    masked = sc.masked_fill(~keep.repeat_interleave(epg, 1), float("-inf"))
    ref = masked.topk(topk, dim=-1).indices
    assert torch.equal(idx.sort(1).values, ref.sort(1).values)


def test_deepseek_correction_bias_changes_selection_not_weights():
    s = make_shape("deepseek_v3", topk=2, n_group=1, topk_group=1,
                   routed_scaling_factor=2.5)
    w = weights_for(s)
    x = randn(100, H, seed=7)
    nobias = _replace(w, correction_bias=None)
    # large bias favouring experts 6 and 7
    bias = torch.tensor([0.0] * 6 + [10.0, 9.0])
    biased = _replace(w, correction_bias=bias)
    idx0, wt0 = route(x, nobias, s)
    idx1, wt1 = route(x, biased, s)
    assert bool((idx1 == torch.tensor([6, 7])).all())
    assert not torch.equal(idx0, idx1)
    for idx, wt in ((idx0, wt0), (idx1, wt1)):
        scores = torch.sigmoid(x.double() @ w.router_weight.double().T)
        chosen = scores.gather(1, idx)
        ref = chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * 2.5
        assert torch.allclose(wt.double(), ref, rtol=1e-5)
        assert torch.allclose(wt.sum(-1), torch.full((100,), 2.5), rtol=1e-5)
    # norm_topk_prob=False: raw sigmoid scores times the scaling factor
    s2 = dataclasses.replace(s, norm_topk_prob=False)
    idx2, wt2 = route(x, biased, s2)
    scores = torch.sigmoid(x.double() @ w.router_weight.double().T)
    assert torch.allclose(wt2.double(), scores.gather(1, idx2) * 2.5, rtol=1e-5)


@pytest.mark.parametrize("router", ["softmax_topk", "deepseek_v3"])
def test_route_is_row_independent(router):
    s = make_shape(router, topk=3)
    w = weights_for(s)
    x = randn(150, H, seed=8)
    idx, wt = route(x, w, s)
    perm = torch.randperm(150, generator=torch.Generator().manual_seed(0))
    idx_p, wt_p = route(x[perm], w, s)
    assert torch.equal(idx_p, idx[perm]) and bitwise_equal(wt_p, wt[perm])
    idx_s, wt_s = route(x[70:75], w, s)
    assert torch.equal(idx_s, idx[70:75]) and bitwise_equal(wt_s, wt[70:75])


def test_route_rejects_bad_input():
    s = make_shape()
    w = weights_for(s)
    x = randn(5, H)
    x[3, 0] = float("nan")
    with pytest.raises(ValueError, match="x contains NaN/Inf at token 3"):
        route(x, w, s)
    with pytest.raises(ValueError, match="x must have shape"):
        route(randn(5, 128), w, s)
    with pytest.raises(ValueError, match="dtype"):
        route(randn(5, H), w, s, dtype=torch.float16)
    idx, wt = route(torch.zeros(0, H), w, s)
    assert idx.shape == (0, 2) and wt.shape == (0, 2)


# --------------------------------------------------------------------------- #
# expert compute
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("block_m", [16, 7])
def test_expert_block_row_independence_bitwise(weight_dtype, block_m):
    s = make_shape(weight_dtype=weight_dtype, intermediate=256)
    w = weights_for(s)
    q, sf = quantize_act_fp8(randn(block_m, H, seed=9))
    out = expert_block_forward(q, sf, 3, w)
    assert out.dtype == torch.float32 and out.shape == (block_m, H)
    gen = torch.Generator().manual_seed(1)
    for trial in range(4):
        # replace all other rows (fresh data, zeros)
        other_q, other_sf = quantize_act_fp8(randn(block_m, H, seed=100 + trial))
        if trial == 3:
            other_q, other_sf = torch.zeros_like(q), torch.zeros_like(sf)
        r = trial % block_m
        q2, sf2 = other_q.clone(), other_sf.clone()
        q2[r], sf2[r] = q[r], sf[r]
        assert bitwise_equal(expert_block_forward(q2, sf2, 3, w)[r], out[r])
        # permute rows
        perm = torch.randperm(block_m, generator=gen)
        out_p = expert_block_forward(q[perm], sf[perm], 3, w)
        assert bitwise_equal(out_p, out[perm])


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
def test_expert_block_matches_f64(weight_dtype):
    s = make_shape(weight_dtype=weight_dtype)
    w = weights_for(s)
    q, sf = quantize_act_fp8(randn(16, H, seed=10))
    out = expert_block_forward(q, sf, 5, w)
    xd = dequantize_act_fp8(q, sf).double()
    w1, w3, w2 = (t.double() for t in w.dequantized_expert(5))
    ref = (torch.nn.functional.silu(xd @ w1.T) * (xd @ w3.T)) @ w2.T
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_expert_pool_forward_matches_single_rows():
    s = make_shape(weight_dtype="fp8")
    w = weights_for(s)
    q, sf = quantize_act_fp8(randn(37, H, seed=11))
    out = expert_pool_forward(q, sf, 1, w, 16)
    assert out.shape == (37, H)
    # each row alone in a zero-padded block gives the identical bits
    for r in (0, 15, 16, 36):
        alone = expert_pool_forward(q[r:r + 1], sf[r:r + 1], 1, w, 16)
        assert bitwise_equal(alone[0], out[r])
    # a different grouping of the same rows (reversed) gives identical rows
    rev = torch.arange(36, -1, -1)
    assert bitwise_equal(expert_pool_forward(q[rev], sf[rev], 1, w, 16), out[rev])
    empty = expert_pool_forward(q[:0], sf[:0], 1, w, 16)
    assert empty.shape == (0, H)


def test_expert_input_errors():
    s = make_shape()
    w = weights_for(s)
    q, sf = quantize_act_fp8(randn(16, H))
    with pytest.raises(ValueError, match="x_fp8_block"):
        expert_block_forward(q.float(), sf, 0, w)
    with pytest.raises(ValueError, match="x_sf_block"):
        expert_block_forward(q, sf[:, :1], 0, w)
    with pytest.raises(ValueError, match="e must"):
        expert_block_forward(q, sf, E, w)
    with pytest.raises(ValueError, match="block_m"):
        expert_pool_forward(q, sf, 0, w, 0)
    with pytest.raises(ValueError, match="x_fp8"):
        expert_pool_forward(quantize_act_fp8(randn(4, 512))[0], sf[:4], 0, w, 16)


# --------------------------------------------------------------------------- #
# combine
# --------------------------------------------------------------------------- #
def test_combine_order_and_masking():
    t, k = 6, 3
    c = randn(t, k, H, seed=12)
    wt = randn(t, k, seed=13).abs()
    y = combine(c, wt)
    ref = torch.zeros(t, H)
    for j in range(k):
        ref = ref + c[:, j] * wt[:, j:j + 1]
    assert bitwise_equal(y, ref)
    idx = torch.arange(t * k).view(t, k) % E
    idx[1, 1] = -1
    idx[4, 0] = -1
    c2 = c.clone()
    c2[1, 1] = float("nan")  # masked route content must not leak
    y2 = combine(c2, wt, idx)
    ref2 = torch.zeros(t, H)
    for j in range(k):
        term = c[:, j] * wt[:, j:j + 1]
        ref2 = torch.where((idx[:, j] >= 0)[:, None], ref2 + term, ref2)
    assert bitwise_equal(y2, ref2)
    assert bitwise_equal(y2[0], y[0])
    assert torch.isfinite(y2).all()
    with pytest.raises(ValueError, match="topk_weights"):
        combine(c, wt.double(), idx)
    with pytest.raises(ValueError, match="topk_idx"):
        combine(c, wt, idx - 2)
    with pytest.raises(ValueError, match="contrib"):
        combine(c[0], wt, idx)


# --------------------------------------------------------------------------- #
# whole layer
# --------------------------------------------------------------------------- #
LAYER_CASES = [(topk, dtype, router) for topk in (1, 2, 3, 4) for dtype in ("bf16", "fp8")
               for router in ("softmax_topk", "deepseek_v3")]


@pytest.mark.parametrize("topk,weight_dtype,router", quick_subset(
    LAYER_CASES, quick=[(1, "bf16", "softmax_topk"), (2, "fp8", "deepseek_v3")],
    reason="the whole layer against its float64 reference in all 16 combinations of top-k, weights and router, "
           "64 tokens each, 1 to 5 s apiece on 2 cores", ids=["-".join(map(str, c)) for c in LAYER_CASES]))
def test_batch_forward_vs_reference(router, weight_dtype, topk):
    s = make_shape(router, weight_dtype, topk=topk, intermediate=256 if topk == 3 else I)
    w = weights_for(s)
    x = randn(64, H, seed=14 + topk, dtype=torch.bfloat16 if topk == 2 else torch.float32)
    y, idx32, _ = batch_forward_single(x, w, s, return_routing=True)
    assert y.dtype == torch.float32 and y.shape == (64, H)
    assert bitwise_equal(batch_forward_single(x, w, s), y)  # deterministic
    y_ref, idx64, _ = reference_forward_f64(x, w, s, return_routing=True)
    assert y_ref.dtype == torch.float64
    rep = compare_to_reference(y, y_ref, idx32, idx64, shape=s)
    assert rep.ok, str(rep)
    assert rep.num_excluded <= 2, str(rep)  # near-ties are rare
    assert rep.num_compared + rep.num_excluded == 64
    assert (rep.rtol, rep.atol) == reference_tolerance(s)
    assert 0.0 < float(y.abs().max()) < 50.0


@pytest.mark.parametrize("router", ["softmax_topk", "deepseek_v3"])
def test_batch_forward_rows_independent_of_batch(router):
    """What the streamed path relies on: same rows -> same bits, any grouping."""
    s = make_shape(router, "fp8", topk=2)
    w = weights_for(s)
    x = randn(40, H, seed=20)
    y = batch_forward_single(x, w, s)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    assert bitwise_equal(batch_forward_single(x[perm], w, s), y[perm])
    assert bitwise_equal(batch_forward_single(x[11:14], w, s), y[11:14])


def test_batch_forward_masked_routes_and_zero_rows():
    s = make_shape("softmax_topk", "bf16", topk=2)
    w = weights_for(s)
    x = randn(8, H, seed=21)
    x[2] = 0.0
    y = batch_forward_single(x, w, s)
    assert torch.equal(y[2], torch.zeros(H))  # zero token -> zero output, no NaN
    assert torch.isfinite(y).all()


def test_forward_rejects_nan_and_bad_args():
    s = make_shape()
    w = weights_for(s)
    x = randn(10, H)
    x[7, 100] = float("nan")
    with pytest.raises(ValueError, match="x contains NaN/Inf at token 7"):
        batch_forward_single(x, w, s)
    with pytest.raises(ValueError, match="x contains NaN/Inf at token 7"):
        reference_forward_f64(x, w, s)
    with pytest.raises(ValueError, match="weights"):
        batch_forward_single(randn(10, H), None, s)
    with pytest.raises(ValueError, match="shape"):
        batch_forward_single(randn(10, H), w, None)


def test_compare_to_reference_excludes_routing_flips():
    t = 10
    y_ref = randn(t, H, seed=22).double()
    y = y_ref.float().clone()
    i32 = torch.tensor([[0, 1]] * t)
    i64 = i32.clone()
    i64[3] = torch.tensor([1, 0])  # same set, reordered: compared
    i64[5] = torch.tensor([0, 2])  # different expert: excluded
    y[5] += 1.0  # a flipped token may differ a lot
    rep = compare_to_reference(y, y_ref, i32, i64, rtol=1e-5, atol=1e-5)
    assert rep.ok and rep.num_excluded == 1 and rep.excluded_tokens == [5]
    assert rep.num_compared == 9
    y[6, 0] += 1e-3
    rep = compare_to_reference(y, y_ref, i32, i64, rtol=1e-5, atol=1e-5)
    assert not rep.ok and rep.worst_token == 6
    with pytest.raises(ValueError, match="y_ref"):
        compare_to_reference(y, y_ref[:3], i32, i64)
    with pytest.raises(ValueError, match="topk_idx_f64"):
        compare_to_reference(y, y_ref, i32, i64[:, :1])


def test_reference_tolerance_scales_with_shape():
    small = reference_tolerance(make_shape())
    big = reference_tolerance(MoEShape(7168, 2048, 256, 8, router="deepseek_v3", n_group=8,
                                       topk_group=4))
    assert 1e-5 <= small[0] < big[0] < 1e-3
    with pytest.raises(ValueError, match="hidden"):
        reference_tolerance(MoEShape(100, 128, 8, 2))
