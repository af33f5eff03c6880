"""The Hugging Face drop-in on real MPI ranks (``mpiexec -n 2 python tests/helpers/mp_hf.py SCENARIO``), run by
tests/ranks/test_hf_drop_in.py. Each rank builds the same small random DeepseekV3ForCausalLM, runs its own tokens
through the unmodified model, through references and through the swapped model, asserts on every rank and
prints one ``HF {json}`` line per rank with the measured numbers; rank 0 ends with ``SCENARIO OK``.

The bounds (see :func:`compare`):

* **tight**: the swapped model against the *FP8 reference*, the same transformers model whose expert
  weights are replaced by their FP8-dequantised values (exactly the values the layer computes with) and
  whose expert inputs are fake-quantised to the ring format (1x128 blocks, ``amax / 448``). Both then
  compute the same function in float32; the only differences are float32 roundings (router dot products,
  GEMM summation orders, the combine order). Per MoE layer that is ``reference_tolerance(shape)``
  (``16 sqrt(H + I + k) u`` = 2.2e-5 here) relative to the layer's output (asserted at the first MoE layer,
  whose input is the same in every model); it enters the residual stream and passes through the following
  blocks. Bound: ``max |logits - ref| <= TIGHT_RTOL * max |ref|`` with ``TIGHT_RTOL = 1e-4`` (2.2e-5 x 2 MoE
  layers x about 2.3 for the blocks after them).
* **FP8 effect** (what quantisation explains): the same two models against the unmodified model.
  By the triangle inequality ``|ours - unmod| <= |ref - unmod| + |ours - ref|``, so the swapped model is
  bounded by the FP8 reference's own distance plus the tight bound; and that distance itself must be
  what e4m3 predicts (:data:`FP8_REL_RMS_MAX`: 6.5 % RMS predicted for one expert, bound 10 %).
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time

import torch

torch.set_num_threads(1)  # two ranks share the two cores

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from mp_main import run_scenarios  # noqa: E402
from streamring.device.cpu import MpiHeap  # noqa: E402
from streamring.moe import MoEBuffer, moe_shape_from_config, replace_moe_experts  # noqa: E402
from streamring.moe.hf import deepseek_v3_moe_modules  # noqa: E402
from streamring.moe.reference import reference_tolerance  # noqa: E402

FP8 = torch.float8_e4m3fn
TIGHT_RTOL = 1e-4
# What e4m3 predicts for one expert (the CPU layer rounds the weights and the expert input; the SwiGLU output
# stays float32): round-to-nearest with 3 mantissa bits leaves a relative error uniform in +-2^-4 of the
# binade, RMS 2^-4/sqrt(3) * sqrt(E[1/m^2]) = 0.0361 * 0.735 = 2.65 % over log-uniform mantissas m. A GEMM
# with both operands rounded: sqrt(2) * 2.65 % = 3.75 % (gate and up); silu(g) * u: sqrt(k^2 + 1) * 3.75 %
# with k = dln silu / dln g = 1 to 1.3 here, 5.3 to 6.2 %; the down GEMM adds its weights' 2.65 %: about
# 6.5 % RMS. Bound: 10 % (margin for a 20-token sample and the spread of k), at the first MoE layer (same input
# in every model) and for the logits (the layer's update is a part of the residual stream, so its relative
# error can only be diluted there, unless routes flip: counted as fp8_reroutes_in_unmodified_model).
FP8_REL_RMS_MAX = 0.10


def report_line(line: str) -> None:
    """One write per line: the ranks share mpiexec's stdout, and print() under PYTHONUNBUFFERED writes the
    text and its newline apart, so another rank's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def config(**kw) -> DeepseekV3Config:
    base = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=64, q_lora_rank=None,
                qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=128,
                num_mtp_layers=0)
    base.update(kw)
    return DeepseekV3Config(**base)


def build_model(cfg) -> DeepseekV3ForCausalLM:
    """The same random model on every rank, scaled like a trained one: a residual stream of RMS 1
    (embeddings N(0, 1)) that each MoE layer changes by about a quarter (experts N(0, 1/fan_in), the down
    projection x 0.3), a router with N(0, 1/H) weights and a correction bias. transformers' N(0, 0.02) init
    would make the MoE output dwarf the embeddings, so that any perturbation of one MoE layer (FP8 or
    not) reroutes tokens in the next and the logits comparison would measure that chaos, not the layer."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0, generator=g)
        for _, moe in deepseek_v3_moe_modules(model):
            ex = moe.experts
            # bf16 values, as a bf16 checkpoint holds them
            ex.gate_up_proj.copy_((torch.randn(ex.gate_up_proj.shape, generator=g) / math.sqrt(h)).bfloat16())
            ex.down_proj.copy_((torch.randn(ex.down_proj.shape, generator=g) * 0.3 / math.sqrt(i)).bfloat16())
            moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=g) / math.sqrt(h))
            moe.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.05)
    return model


def fake_quant_act(x: torch.Tensor) -> torch.Tensor:
    """The ring's activation format, written here independently: e4m3 with one scale per token per 128 columns."""
    t, h = x.shape
    xb = x.float().reshape(t, h // 128, 128)
    sf = xb.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return ((xb / sf).clamp(-448, 448).to(FP8).float() * sf).reshape(t, h).to(x.dtype)


def hf_fp8_quantize(w: torch.Tensor):
    """transformers' own FP8 quantiser (``Fp8Quantize``, 128x128 blocks): ``(weight, weight_scale_inv)``."""
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    q = Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=(128, 128),
                                                                        scale_fmt="float")))
    out = q._quantize_one("w.weight", w.float())
    return out["w.weight"], out["w.weight_scale_inv"]


def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(128, -2).repeat_interleave(128, -1)


def fp8_checkpoint(model, bf16: bool = False) -> dict:
    """The routed weights in DeepSeek-V3 FP8 checkpoint naming, quantised by transformers' quantiser
    (``bf16=True``: the weights as they are, without ``weight_scale_inv``)."""
    ckpt = {}
    for name, moe in deepseek_v3_moe_modules(model):
        ckpt[f"{name}.gate.weight"] = moe.gate.weight.detach().clone()
        ckpt[f"{name}.gate.e_score_correction_bias"] = moe.gate.e_score_correction_bias.detach().clone()
        i = moe.experts.down_proj.shape[-1]
        for e in range(moe.experts.gate_up_proj.shape[0]):
            gu = moe.experts.gate_up_proj[e].detach()
            for proj, w in (("gate_proj", gu[:i]), ("up_proj", gu[i:]), ("down_proj", moe.experts.down_proj[e])):
                if bf16:
                    ckpt[f"{name}.experts.{e}.{proj}.weight"] = w.detach().clone()
                    continue
                q, s = hf_fp8_quantize(w.detach())
                ckpt[f"{name}.experts.{e}.{proj}.weight"] = q
                ckpt[f"{name}.experts.{e}.{proj}.weight_scale_inv"] = s
    return ckpt


def fp8_reference(model, dequantised: dict) -> DeepseekV3ForCausalLM:
    """``model`` with every routed expert weight replaced by ``dequantised[(name, 'gate_up'|'down')]`` and the
    experts' input fake-quantised (the router still sees the unquantised input, as in the layer)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, moe in deepseek_v3_moe_modules(ref):
            moe.experts.gate_up_proj.copy_(dequantised[(name, "gate_up")])
            moe.experts.down_proj.copy_(dequantised[(name, "down")])
            moe.experts.register_forward_pre_hook(lambda mod, args: (fake_quant_act(args[0]), *args[1:]))
    return ref


def dequantised_from_ours(model) -> dict:
    from streamring.moe.math import dequantize_weight_fp8_block, quantize_weight_fp8_block

    out = {}
    for name, moe in deepseek_v3_moe_modules(model):
        for key, w in (("gate_up", moe.experts.gate_up_proj), ("down", moe.experts.down_proj)):
            q, s = quantize_weight_fp8_block(w.detach())
            out[(name, key)] = dequantize_weight_fp8_block(q, s)
    return out


def dequantised_from_checkpoint(model, ckpt) -> dict:
    out = {}
    for name, moe in deepseek_v3_moe_modules(model):
        n = moe.experts.gate_up_proj.shape[0]
        deq = {p: torch.stack([dequant(ckpt[f"{name}.experts.{e}.{p}.weight"],
                                       ckpt[f"{name}.experts.{e}.{p}.weight_scale_inv"]) for e in range(n)])
               for p in ("gate_proj", "up_proj", "down_proj")}
        out[(name, "gate_up")] = torch.cat([deq["gate_proj"], deq["up_proj"]], dim=1)
        out[(name, "down")] = deq["down_proj"]
    return out


class RoutingProbe:
    """Counts the tokens whose expert set differs between the layer's router and transformers' float32
    router on the very input the swapped layer saw; the largest routing-weight difference; and the
    swapped modules' outputs (for the layer-level comparison)."""

    def __init__(self, swapped_model, swap, original_model):
        self.flips, self.tokens, self.max_w_diff, self.swap = 0, 0, 0.0, swap
        self.outputs = []
        self.gates = {name: moe.gate for name, moe in deepseek_v3_moe_modules(original_model)}
        for name in swap.layers:
            swapped_model.get_submodule(name).register_forward_hook(
                lambda mod, args, out, name=name: self.check(name, args[0], out))

    def check(self, name, x, out):
        self.outputs.append(out.detach().clone())
        with torch.no_grad():
            _, w_hf, idx_hf = self.gates[name](x)
        idx, w = self.swap.layers[name].last_routing
        same = (idx.sort(1).values == idx_hf.sort(1).values).all(1)
        self.flips += int((~same).sum())
        self.tokens += int(idx.shape[0])
        if bool(same.any()):  # weights per expert id (the two list the chosen experts in different orders)
            d = (w.gather(1, idx.argsort(1)) - w_hf.gather(1, idx_hf.argsort(1))).abs()[same]
            self.max_w_diff = max(self.max_w_diff, float(d.max()))


class Taps:
    """The outputs and routings of every transformers DeepseekV3MoE of a model, in call order."""

    def __init__(self, model):
        self.outputs, self.routing = [], []
        for _, moe in deepseek_v3_moe_modules(model):
            moe.register_forward_hook(lambda mod, args, out: self.outputs.append(out.detach().clone()))
            moe.gate.register_forward_hook(lambda mod, args, out: self.routing.append(out[2].detach().clone()))


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS of ``a - b`` relative to the RMS of ``b``."""
    return float((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())


def compare(what, ours, ref, unmod, probe: RoutingProbe, ref_taps: Taps, unmod_taps: Taps) -> dict:
    """The assertions of the module docstring; returns the measured numbers."""
    scale = float(ref.abs().max())
    row = {"what": what, "logit_max": scale,
           "tight_max_abs": float((ours - ref).abs().max()), "tight_bound": TIGHT_RTOL * scale,
           "ours_vs_unmod_max_abs": float((ours - unmod).abs().max()),
           "ref_vs_unmod_max_abs": float((ref - unmod).abs().max()),
           "ours_vs_unmod_logits_rel_rms": rel_rms(ours, unmod), "ref_vs_unmod_logits_rel_rms": rel_rms(ref, unmod),
           # the first MoE layer sees the same input in all three models (the blocks before it are untouched)
           "layer1_ours_vs_ref_rel_rms": rel_rms(probe.outputs[0], ref_taps.outputs[0]),
           "layer_rtol": LAYER_RTOL,
           "layer1_ours_vs_unmod_rel_rms": rel_rms(probe.outputs[0], unmod_taps.outputs[0]),
           "routing_flips_vs_hf_router": probe.flips, "routed_tokens": probe.tokens,
           "routing_weight_max_diff": probe.max_w_diff,
           "fp8_reroutes_in_unmodified_model": sum(int((a.sort(1).values != b.sort(1).values).any(1).sum())
                                                   for a, b in zip(ref_taps.routing, unmod_taps.routing))}
    assert row["layer1_ours_vs_ref_rel_rms"] <= LAYER_RTOL, (f"{what}: MoE layer vs FP8 reference beyond float32 "
                                                             f"rounding", row)
    assert row["tight_max_abs"] <= row["tight_bound"], (f"{what}: swapped vs FP8 reference beyond float32 rounding",
                                                        row)
    assert row["ours_vs_unmod_max_abs"] <= row["ref_vs_unmod_max_abs"] + row["tight_bound"], \
        (f"{what}: swapped vs unmodified beyond what the FP8 quantisation explains", row)
    assert row["layer1_ours_vs_unmod_rel_rms"] <= FP8_REL_RMS_MAX, (f"{what}: MoE layer error beyond e4m3's", row)
    assert row["ours_vs_unmod_logits_rel_rms"] <= FP8_REL_RMS_MAX, (f"{what}: logits error beyond e4m3's", row)
    assert row["routing_flips_vs_hf_router"] == 0, (f"{what}: tokens routed differently from transformers' router "
                                                    f"on the same input", row)
    assert row["routing_weight_max_diff"] <= 1e-5, (f"{what}: routing weights differ beyond float32 rounding", row)
    return row


def new_buffer(heap, cfg, max_tokens):
    shape = moe_shape_from_config(cfg, weight_dtype="fp8", block_m=16)
    return MoEBuffer(heap, shape, num_slots=2, tokens_per_slot=8, max_tokens_per_rank=max_tokens)


def run_swapped(model, buf, ids, **swap_kw):
    """A copy of ``model`` with the layer swapped in: ``(swapped model, SwappedMoE, RoutingProbe, logits)``."""
    swapped = copy.deepcopy(model)
    swap = replace_moe_experts(swapped, buf, **swap_kw)
    probe = RoutingProbe(swapped, swap, model)
    with torch.no_grad():
        out = swapped(ids).logits
    return swapped, swap, probe, out


def run_reference(model, dequantised, ids):
    ref = fp8_reference(model, dequantised)
    taps = Taps(ref)
    with torch.no_grad():
        return ref(ids).logits, taps


def fp8_experts_module(cfg, ckpt, name):
    """transformers' own FP8 experts module (``FineGrainedFP8``) holding the checkpoint's tensors."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    ex = FP8Experts(cfg, block_size=(128, 128))
    with torch.no_grad():
        for e in range(cfg.n_routed_experts):
            k = f"{name}.experts.{e}"
            ex.gate_up_proj[e].copy_(torch.cat([ckpt[f"{k}.gate_proj.weight"], ckpt[f"{k}.up_proj.weight"]]))
            ex.gate_up_proj_scale_inv[e].copy_(torch.cat([ckpt[f"{k}.gate_proj.weight_scale_inv"],
                                                          ckpt[f"{k}.up_proj.weight_scale_inv"]]))
            ex.down_proj[e].copy_(ckpt[f"{k}.down_proj.weight"])
            ex.down_proj_scale_inv[e].copy_(ckpt[f"{k}.down_proj.weight_scale_inv"])
    return ex


LAYER_RTOL = reference_tolerance(moe_shape_from_config(config()))[0]


def drop_in(heap):
    me = heap.rank
    t0 = time.monotonic()
    cfg = config()
    model = build_model(cfg)
    # every rank its own tokens, uneven: 1 x 11 on rank 0, 2 x 9 on rank 1
    ids = torch.randint(0, cfg.vocab_size, (1 + me, 11 - 2 * me), generator=torch.Generator().manual_seed(10 + me))
    buf = new_buffer(heap, cfg, max_tokens=32)
    unmod_taps = Taps(model)
    with torch.no_grad():
        unmod = model(ids).logits
    rows, timing = [], {}

    # (a) bf16 expert weights, quantised to FP8 by the layer: from the model's parameters ...
    t = time.monotonic()
    swapped, swap, probe, ours = run_swapped(model, buf, ids)
    ref, ref_taps = run_reference(model, dequantised_from_ours(model), ids)
    rows.append(compare("bf16 weights -> fp8 (module parameters)", ours, ref, unmod, probe, ref_taps, unmod_taps))
    timing["bf16_path_s"] = time.monotonic() - t
    swap.close()
    # model-level torch.compile, on a swapped model without the probe's hooks: every swapped layer is one
    # op node and no graph break points at it
    t = time.monotonic()
    compiled = copy.deepcopy(model)
    swap = replace_moe_experts(compiled, buf)
    ex = torch._dynamo.explain(compiled)(ids)
    reasons = [f"{r.reason} @ " + " | ".join(str(f) for f in (r.user_stack or [])) for r in ex.break_reasons]
    at_layer = [r for r in reasons if any(k in r for k in ("streamring", "moe_forward", "StreamringDeepseekV3MoE"))]
    ops = [str(op) for g in ex.ops_per_graph for op in g]
    rows[-1].update(graph_count=ex.graph_count, graph_breaks=ex.graph_break_count, break_reasons=reasons[:3],
                    moe_op_nodes=sum("streamring.moe_forward" in o for o in ops))
    assert not at_layer, f"graph breaks at the layer: {at_layer}"
    assert rows[-1]["moe_op_nodes"] == len(swap.layers), (ops, rows[-1])
    timing["explain_s"] = time.monotonic() - t
    swap.close()
    # ... and from a bf16 checkpoint (the same values as bf16 tensors): bitwise the same logits
    bf16_ckpt = {k: v.to(torch.bfloat16) if ".experts." in k else v
                 for k, v in fp8_checkpoint(model, bf16=True).items()}
    _, swap, _, ours_ckpt = run_swapped(model, buf, ids, checkpoint=bf16_ckpt)
    assert torch.equal(ours_ckpt, ours), "bf16 checkpoint tensors and the module's parameters disagree"
    swap.close()

    # (b) FP8 checkpoint tensors with weight_scale_inv (transformers' own quantiser), taken as they are
    t = time.monotonic()
    ckpt = fp8_checkpoint(model)
    _, swap, probe, ours = run_swapped(model, buf, ids, checkpoint=ckpt)
    ref, ref_taps = run_reference(model, dequantised_from_checkpoint(model, ckpt), ids)
    rows.append(compare("fp8 checkpoint (weight_scale_inv)", ours, ref, unmod, probe, ref_taps, unmod_taps))
    swap.close()
    timing["fp8_path_s"] = time.monotonic() - t
    # ... and the same tensors in transformers' FP8 experts modules: bitwise the same logits
    fp8_model = copy.deepcopy(model)
    for name, moe in deepseek_v3_moe_modules(fp8_model):
        moe.experts = fp8_experts_module(cfg, ckpt, name)
    _, swap, _, ours_mod = run_swapped(fp8_model, buf, ids)
    assert torch.equal(ours_mod, ours), "FP8Experts modules and the FP8 checkpoint disagree"
    swap.close()

    # (c) the whole model in bf16, as engines run it: bf16 tokens into the op, bf16 out; transformers' bf16
    # experts round every GEMM output to bf16 (2^-9 relative), so only the FP8-level bound applies here
    t = time.monotonic()
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    unmod16_taps = Taps(model16)
    with torch.no_grad():
        unmod16 = model16(ids).logits
    _, swap, probe, ours16 = run_swapped(model16, buf, ids)
    assert ours16.dtype == torch.bfloat16 and probe.outputs[0].dtype == torch.bfloat16
    row = {"what": "model in bf16", "ours_vs_unmod_logits_rel_rms": rel_rms(ours16, unmod16),
           "layer1_ours_vs_unmod_rel_rms": rel_rms(probe.outputs[0], unmod16_taps.outputs[0]),
           "routing_flips_vs_hf_router": probe.flips, "routed_tokens": probe.tokens}
    assert row["ours_vs_unmod_logits_rel_rms"] <= FP8_REL_RMS_MAX and \
        row["layer1_ours_vs_unmod_rel_rms"] <= FP8_REL_RMS_MAX, row
    assert row["routing_flips_vs_hf_router"] == 0, row
    rows.append(row)
    swap.close()
    timing["bf16_model_s"] = time.monotonic() - t

    buf.close()
    timing["total_s"] = time.monotonic() - t0
    report_line("HF " + json.dumps({"rank": me, "tokens": int(ids.numel()), "rows": rows,
                                    "timing": {k: round(v, 2) for k, v in timing.items()}}))


def drop_in_gpu(heap):
    """The drop-in on the GPU layer (:class:`~streamring.moe.ep_buffer.EPBuffer`, one PE per GPU): the bf16
    model (as engines run it) with its routed experts swapped, against the unmodified bf16 model on the same
    GPU. The GPU layer also rounds the SwiGLU output to FP8 before the down GEMM (one e4m3 step more than the
    FP8 reference above models), so only the FP8-level bound applies: <= FP8_REL_RMS_MAX at the first MoE
    layer and at the logits, 0 routing flips against transformers' router, and no graph break at the layer."""
    from streamring.moe.ep_buffer import EPBuffer
    from streamring.moe.tuning import EPTuning

    me, dev = heap.rank, heap.device
    cfg = config()
    model = build_model(cfg).to(dev, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1 + me, 11 - 2 * me), generator=torch.Generator().manual_seed(10 + me))
    ids = ids.to(dev)
    shape = moe_shape_from_config(cfg, weight_dtype="fp8", block_m=16)
    buf = EPBuffer(heap, shape, max_tokens_per_rank=32, num_slots=2, tokens_per_slot=8, gemm="triton",
                   tuning=EPTuning(block_m=16, policy="spin_kernel"), name="hf")
    unmod_taps = Taps(model)
    with torch.no_grad():
        unmod = model(ids).logits
    rows = []
    logits = {}
    for streaming, ahead in ((False, False), (True, False), (True, True)):
        swapped, swap, probe, ours = run_swapped(model, buf, ids, streaming=streaming, launch_ahead=ahead)
        logits[streaming, ahead] = ours
        row = {"what": f"GPU layer, streaming={streaming}, launch_ahead={ahead}",
               "ours_vs_unmod_logits_rel_rms": rel_rms(ours, unmod),
               "layer1_ours_vs_unmod_rel_rms": rel_rms(probe.outputs[0], unmod_taps.outputs[0]),
               "routing_flips_vs_hf_router": probe.flips, "routed_tokens": probe.tokens}
        assert row["ours_vs_unmod_logits_rel_rms"] <= FP8_REL_RMS_MAX, row
        assert row["layer1_ours_vs_unmod_rel_rms"] <= FP8_REL_RMS_MAX, row
        assert row["routing_flips_vs_hf_router"] == 0, row
        rows.append(row)
        swap.close()
    # every MoE layer's consumer launched before its decoder layer's attention: the same bits as without
    assert torch.equal(logits[True, True], logits[True, False]), "launch_ahead changed the logits"
    assert buf.launches.pending is None, "a consumer launched ahead was left pending after the model's forward"
    compiled = copy.deepcopy(model)
    swap = replace_moe_experts(compiled, buf)
    ex = torch._dynamo.explain(compiled)(ids)
    reasons = [f"{r.reason} @ " + " | ".join(str(f) for f in (r.user_stack or [])) for r in ex.break_reasons]
    at_layer = [r for r in reasons if any(k in r for k in ("streamring", "moe_forward", "StreamringDeepseekV3MoE"))]
    assert not at_layer, f"graph breaks at the layer: {at_layer}"
    rows[-1].update(graph_breaks=ex.graph_break_count, moe_op_nodes=sum(
        "streamring.moe_forward" in str(op) for g in ex.ops_per_graph for op in g))
    swap.close()
    st = buf.status()
    assert not (st["violations"] or st["timeouts"] or st["bad_routes"]), st
    buf.close()
    report_line("HF " + json.dumps({"rank": me, "tokens": int(ids.numel()), "rows": rows}))


SCENARIOS = {f.__name__: f for f in (drop_in, drop_in_gpu)}

if __name__ == "__main__":
    if sys.argv[1].endswith("_gpu"):
        from streamring.device.nvshmem import NvshmemHeap

        heap = NvshmemHeap.bootstrap("mpi")
    else:
        heap = MpiHeap()
    run_scenarios(SCENARIOS, sys.argv[1:2], heap)
