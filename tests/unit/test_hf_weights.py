"""Single-process checks of the weight preparation (streamring.moe.weights) and of the Hugging Face mapping
(streamring.moe.hf): the FP8 scale convention against transformers' own FineGrainedFP8 code, the routing rule
against transformers' DeepSeek-V3 router, every expert layout transformers uses. The multi-rank end-to-end test
is tests/ranks/test_hf_drop_in.py."""

from types import SimpleNamespace

import pytest
import torch
import transformers  # a declared test dependency: the conftest fails the run when it is missing
from transformers import DeepseekV3Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize, FP8Experts
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from streamring.moe import moe_shape_from_config, replace_moe_experts, weights_from_float, weights_from_fp8
from streamring.moe.hf import layer_weights_from_module
from streamring.moe.math import FP8_DTYPE, dequantize_weight_fp8_block, quantize_weight_fp8_block
from streamring.moe.routers import route

H, I, E = 256, 128, 8
HF_QUANT = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=(128, 128), scale_fmt="float"))


def randn(*size, seed=0, std=1.0):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed)) * std


def hf_config(**kw):
    base = dict(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=2, n_group=4,
                topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
                intermediate_size=256, num_hidden_layers=2, first_k_dense_replace=1, vocab_size=64,
                num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64)
    base.update(kw)
    return DeepseekV3Config(**base)


def random_moe(cfg, seed=0) -> ds.DeepseekV3MoE:
    moe = ds.DeepseekV3MoE(cfg)
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    with torch.no_grad():
        moe.gate.weight.copy_(randn(e, h, seed=seed, std=h ** -0.5))
        moe.gate.e_score_correction_bias.copy_(randn(e, seed=seed + 1, std=0.05))
        moe.experts.gate_up_proj.copy_(randn(e, 2 * i, h, seed=seed + 2, std=h ** -0.5))
        moe.experts.down_proj.copy_(randn(e, h, i, seed=seed + 3, std=i ** -0.5))
    return moe


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


# ------------------------------------------------------------------------------------------------
def test_weight_scale_inv_is_the_dequantisation_multiplier_of_moe_weights():
    """transformers' Fp8Quantize stores weight_scale_inv = 1/(448/amax) and Fp8Dequantize multiplies by it:
    the same quantity and use as MoEWeights' w*_scale (amax/448, w = w_fp8 * scale)."""
    w = randn(3, 256, 384, seed=4, std=0.02)
    w[0, :128, :128] = 0.0  # an all-zero block: transformers stores 1.0, we 1e-12/448; zero codes either way
    out = Fp8Quantize(HF_QUANT)._quantize_one("m.weight", w)
    q_hf, s_hf = out["m.weight"], out["m.weight_scale_inv"]
    assert q_hf.dtype == FP8_DTYPE and s_hf.dtype == torch.float32 and s_hf.shape == (3, 2, 3)
    # transformers' own dequantisation and ours, from the same tensors, agree bitwise in float32
    deq_hf = Fp8Dequantize(HF_QUANT)._dequantize_one(q_hf, s_hf, torch.float32)
    assert same_bits(deq_hf, dequantize_weight_fp8_block(q_hf, s_hf))
    # our quantiser: the same scales up to the last bit (amax/448 against 1/(448/amax)), the same codes
    q, s = quantize_weight_fp8_block(w)
    nonzero = s_hf != 1.0
    assert torch.allclose(s[nonzero], s_hf[nonzero], rtol=2 ** -23, atol=0)
    assert (q.float() != q_hf.float()).float().mean() < 1e-3
    # weights_from_fp8 keeps the checkpoint's tensors bit for bit
    gate, up, down = (Fp8Quantize(HF_QUANT)._quantize_one("m.weight", t) for t in
                      (randn(E, I, H, seed=5), randn(E, I, H, seed=6), randn(E, H, I, seed=7)))
    lw = weights_from_fp8(randn(E, H, seed=8), gate["m.weight"], gate["m.weight_scale_inv"], up["m.weight"],
                          up["m.weight_scale_inv"], down["m.weight"], down["m.weight_scale_inv"])
    for mine, theirs in ((lw.w1, gate["m.weight"]), (lw.w1_scale, gate["m.weight_scale_inv"]),
                         (lw.w3, up["m.weight"]), (lw.w2_scale, down["m.weight_scale_inv"])):
        assert same_bits(mine, theirs)


def test_weights_from_float_quantises_like_math_and_keeps_only_the_asked_experts():
    rw, bias = randn(E, H, seed=1), randn(E, seed=2)
    gate, up, down = randn(E, I, H, seed=3).bfloat16(), randn(E, I, H, seed=4).bfloat16(), randn(E, H, I, seed=5)
    full = weights_from_float(rw, gate, up, down, correction_bias=bias)
    q, s = quantize_weight_fp8_block(gate)
    assert same_bits(full.w1, q) and same_bits(full.w1_scale, s) and full.router_weight.dtype == torch.float32
    local = weights_from_float(rw, list(gate), list(up), list(down), correction_bias=bias, experts=range(4, 8))
    assert local.w1.shape[0] == 4 and same_bits(local.w2, full.w2[4:]) and same_bits(local.w3_scale, full.w3_scale[4:])
    assert same_bits(local.router_weight, full.router_weight)  # the router stays global
    kept = weights_from_float(rw, gate, up, down, weight_dtype="bf16")
    assert kept.w1.dtype == torch.bfloat16 and kept.w1_scale is None and same_bits(kept.w1, gate)


def test_lazy_expert_sources_are_read_only_for_the_kept_experts():
    read = []

    class Lazy:
        def __init__(self, t):
            self.t = t

        def __len__(self):
            return E

        def __getitem__(self, e):
            read.append(e)
            return self.t[e]

    weights_from_float(randn(E, H), Lazy(randn(E, I, H)), Lazy(randn(E, I, H)), Lazy(randn(E, H, I)),
                       experts=range(2, 4))
    assert sorted(set(read)) == [2, 3]


@pytest.mark.parametrize("call, needle", [
    (lambda: weights_from_float(randn(E, H), randn(E, I, H), randn(E, I, H), randn(E, H, I), weight_dtype="fp4"),
     "weight_dtype must be one of"),
    (lambda: weights_from_float(randn(E, H), randn(E, 100, H), randn(E, 100, H), randn(E, H, 100)),
     "must have both dimensions multiples of 128"),
    (lambda: weights_from_float(randn(E, H), randn(E - 1, I, H), randn(E, I, H), randn(E, H, I)),
     "gate must be [num_experts=8, out, in]"),
    (lambda: weights_from_float(randn(E, H), randn(E, I, H), randn(E, I, H), randn(E, I, H)),
     "down[0] must have shape [hidden=256, intermediate=128]"),
    (lambda: weights_from_float(randn(E, H), randn(E, I, H), randn(E, I, H), randn(E, H, I), experts=range(6, 9)),
     "experts must be None or a contiguous range within [0, 8)"),
    (lambda: weights_from_float(randn(E, H), randn(E, I, H).to(FP8_DTYPE), randn(E, I, H), randn(E, H, I)),
     "gate[0] must be bfloat16, float16 or float32 (FP8 tensors go through weights_from_fp8)"),
    (lambda: weights_from_fp8(randn(E, H), randn(E, I, H), randn(E, 1, 2), randn(E, I, H), randn(E, 1, 2),
                              randn(E, H, I), randn(E, 2, 1)), "gate[0] must be torch.float8_e4m3fn"),
    (lambda: weights_from_fp8(randn(E, H), randn(E, I, H).to(FP8_DTYPE), randn(E, 2, 2),
                              randn(E, I, H).to(FP8_DTYPE), randn(E, 1, 2), randn(E, H, I).to(FP8_DTYPE),
                              randn(E, 2, 1)), "gate_scale_inv[0] must have shape [1, 2]"),
    (lambda: weights_from_fp8(randn(E, H), randn(E, I, H).to(FP8_DTYPE), randn(E, 1, 2).double(),
                              randn(E, I, H).to(FP8_DTYPE), randn(E, 1, 2), randn(E, H, I).to(FP8_DTYPE),
                              randn(E, 2, 1)), "gate_scale_inv[0] must be float32 (or float8_e8m0fnu)"),
    (lambda: weights_from_float(randn(E, H), randn(E, I, H), randn(E, I, H), randn(E, H, I),
                                correction_bias=randn(E + 1)), "correction_bias must be a tensor of shape [8]"),
])
def test_bad_weights_are_refused_naming_the_argument(call, needle):
    with pytest.raises(ValueError) as e:
        call()
    assert needle in str(e.value)


def test_ue8m0_scales_are_widened_exactly():
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    s = torch.full((E, 1, 2), 2.0 ** -7).to(e8m0)
    w = weights_from_fp8(randn(E, H), randn(E, I, H).to(FP8_DTYPE), s, randn(E, I, H).to(FP8_DTYPE),
                         torch.ones(E, 1, 2), randn(E, H, I).to(FP8_DTYPE), torch.ones(E, 2, 1))
    assert w.w1_scale.dtype == torch.float32 and bool((w.w1_scale == 2.0 ** -7).all())


# ------------------------------------------------------------------------------------------------
ROUTER_CASES = {
    "dsv3-like 16e top4 4/2": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2),
    "32e top8 8/3 no-norm rsf1": dict(n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=3,
                                      norm_topk_prob=False, routed_scaling_factor=1.0),
    "64e top6 8/4 rsf2.5": dict(n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4),
    "16e top2 one group": dict(n_routed_experts=16, num_experts_per_tok=2, n_group=1, topk_group=1),
}


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_routing_matches_transformers_router(case, x_dtype):
    """Same top-k sets and, per expert, the same weights within float32 rounding, on 512 random tokens.
    The two differ only in summation orders (logits in blocks of 64 rows here; the k-term normalisation), so a
    token could flip only on a near-tie of the selection scores: counted, and none at these seeds."""
    cfg = hf_config(**ROUTER_CASES[case])
    shape = moe_shape_from_config(cfg)
    moe = random_moe(cfg, seed=11)
    w = layer_weights_from_module(moe, shape)
    x = randn(512, H, seed=12).to(x_dtype)
    idx, wt = route(x, w, shape)
    with torch.no_grad():
        _, wt_hf, idx_hf = moe.gate(x)
    same = (idx.sort(1).values == idx_hf.sort(1).values).all(1)
    assert int((~same).sum()) == 0, f"{int((~same).sum())} of 512 tokens chose another expert set"
    mine, theirs = wt.gather(1, idx.argsort(1)), wt_hf.gather(1, idx_hf.argsort(1))
    # a few float32 ulps of values up to routed_scaling_factor
    torch.testing.assert_close(mine, theirs, rtol=4 * 2 ** -24, atol=4 * 2 ** -24 * shape.routed_scaling_factor)


def test_config_mapping_is_exact():
    cfg = hf_config(n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=3, norm_topk_prob=False,
                    routed_scaling_factor=1.5)
    s = moe_shape_from_config(cfg, block_m=32)
    assert (s.hidden, s.intermediate, s.num_experts, s.topk, s.router, s.n_group, s.topk_group,
            s.routed_scaling_factor, s.norm_topk_prob, s.weight_dtype, s.block_m) == \
        (H, I, 32, 8, "deepseek_v3", 8, 3, 1.5, False, "fp8", 32)


@pytest.mark.parametrize("change, needle", [
    (dict(hidden_act="gelu"), "config.hidden_act must be 'silu'"),
    (dict(n_group=8, topk_group=2), "config.n_group must leave >= 2 experts per group"),
    (dict(moe_intermediate_size=96), "intermediate must be a multiple of 128"),
])
def test_configs_the_layer_cannot_run_are_refused(change, needle):
    with pytest.raises(ValueError) as e:
        moe_shape_from_config(hf_config(**change))
    assert needle in str(e.value)
    cfg = hf_config()
    cfg.scoring_func = "softmax"  # DeepSeek's own config files carry it
    with pytest.raises(ValueError, match="config.scoring_func must be 'sigmoid'"):
        moe_shape_from_config(cfg)


# ------------------------------------------------------------------------------------------------
def test_every_expert_layout_gives_the_same_weights():
    """5.x fused parameters, 4.x ModuleList of MLPs, transformers' FP8Experts and a checkpoint mapping."""
    cfg = hf_config()
    shape = moe_shape_from_config(cfg)
    moe = random_moe(cfg, seed=3)
    fused = layer_weights_from_module(moe, shape, range(4, 8))
    # 4.x: a ModuleList of DeepseekV3MLP(gate_proj, up_proj, down_proj)
    mods = torch.nn.ModuleList(ds.DeepseekV3MLP(cfg, intermediate_size=I) for _ in range(E))
    with torch.no_grad():
        for e, m in enumerate(mods):
            m.gate_proj.weight.copy_(moe.experts.gate_up_proj[e, :I])
            m.up_proj.weight.copy_(moe.experts.gate_up_proj[e, I:])
            m.down_proj.weight.copy_(moe.experts.down_proj[e])
    old = ds.DeepseekV3MoE(cfg)
    old.gate, old.experts = moe.gate, mods
    listed = layer_weights_from_module(old, shape, range(4, 8))
    for name in ("router_weight", "correction_bias", "w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"):
        assert same_bits(getattr(fused, name), getattr(listed, name)), name
    # FP8: transformers' FP8Experts module and the per-expert checkpoint tensors
    quant = Fp8Quantize(HF_QUANT)
    gu = quant._quantize_one("w.weight", moe.experts.gate_up_proj.detach())  # 128-row blocks: gate, up separate
    dn = quant._quantize_one("w.weight", moe.experts.down_proj.detach())
    fp8 = FP8Experts(cfg, block_size=(128, 128))
    with torch.no_grad():
        fp8.gate_up_proj.copy_(gu["w.weight"])
        fp8.gate_up_proj_scale_inv.copy_(gu["w.weight_scale_inv"])
        fp8.down_proj.copy_(dn["w.weight"])
        fp8.down_proj_scale_inv.copy_(dn["w.weight_scale_inv"])
    old.experts = fp8
    from_module = layer_weights_from_module(old, shape, range(4, 8))
    assert same_bits(from_module.w1, gu["w.weight"][4:, :I]) and same_bits(from_module.w3_scale,
                                                                           gu["w.weight_scale_inv"][4:, 1:])
    assert same_bits(from_module.w2, dn["w.weight"][4:]) and same_bits(from_module.w2_scale,
                                                                       dn["w.weight_scale_inv"][4:])
    bf16_shape = moe_shape_from_config(cfg, weight_dtype="bf16")
    with pytest.raises(ValueError, match="has FP8 experts but the buffer's shape.weight_dtype is 'bf16'"):
        layer_weights_from_module(old, bf16_shape)


class FakeBuffer:
    """Stands in for a buffer where only the checks before any forward are exercised (no ranks)."""

    deadline_s, max_tokens_per_rank, last_routing = 30.0, 64, None

    def __init__(self, shape, local=None):
        self.shape, self.local_experts = shape, local or range(shape.num_experts)

    def prepare_weights(self, w):
        return w

    def forward(self, x, w, **kw):
        raise AssertionError("not called here")

    def status(self):
        return {}

    def check(self):
        pass

    def close(self):
        pass


def test_replace_refuses_a_buffer_of_another_shape_and_a_model_without_deepseek_moe():
    cfg = hf_config(num_hidden_layers=2, first_k_dense_replace=1)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    other = moe_shape_from_config(hf_config(num_experts_per_tok=4, routed_scaling_factor=1.0))
    with pytest.raises(ValueError) as e:
        replace_moe_experts(model, FakeBuffer(other))
    assert "topk: buffer 4, config 2" in str(e.value)
    assert "routed_scaling_factor: buffer 1.0, config 2.5" in str(e.value)
    assert isinstance(model.model.layers[1].mlp, ds.DeepseekV3MoE)  # untouched
    with pytest.raises(ValueError, match="has no transformers DeepseekV3MoE module"):
        replace_moe_experts(torch.nn.Sequential(torch.nn.Linear(4, 4)), FakeBuffer(other))
    swap = replace_moe_experts(model, FakeBuffer(moe_shape_from_config(cfg), range(0, 4)))
    try:
        mlp = model.model.layers[1].mlp
        assert type(mlp).__name__ == "StreamringDeepseekV3MoE" and isinstance(mlp.shared_experts, ds.DeepseekV3MLP)
        assert list(swap.layers) == ["model.layers.1.mlp"]
        assert swap.layers["model.layers.1.mlp"].weights.w1.shape[0] == 4  # this rank's experts only
        assert not any(isinstance(m, ds.DeepseekV3Experts) for m in model.modules())  # the HF experts are gone
    finally:
        swap.close()
    assert swap.layers["model.layers.1.mlp"].closed
