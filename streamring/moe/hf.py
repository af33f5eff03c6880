"""Hugging Face drop-in: the routed experts of every ``transformers`` DeepSeek-V3 MoE module on this layer.

:func:`replace_moe_experts` swaps each ``DeepseekV3MoE`` of a model for a
:class:`StreamringDeepseekV3MoE` that runs the router and the routed experts as one
``torch.ops.streamring.moe_forward`` call on the shared buffer and keeps the module's
``shared_experts`` as they are::

    y = moe_forward(x) + shared_experts(x)     # transformers: experts(x, gate(x)) + shared_experts(x)

Weights are prepared once per layer (each rank keeps only ``buffer.local_experts``; the router stays
global), from the model's own parameters or from checkpoint tensors:

* bf16 / float experts (``weight_dtype="fp8"`` buffers quantise them to FP8 with 128x128 block scales);
* FP8 experts with ``weight_scale_inv`` (transformers' ``FineGrainedFP8`` modules, or a DeepSeek-V3 FP8
  checkpoint's ``...experts.{e}.{gate,up,down}_proj.weight`` / ``.weight_scale_inv``), taken as they are.

How transformers stores the experts (both handled): 5.x (5.17 to 5.24 read) keeps one
``DeepseekV3Experts`` with fused ``gate_up_proj [E, 2I, H]`` (gate rows first, then up) and
``down_proj [E, H, I]`` parameters (FP8 modules add ``gate_up_proj_scale_inv [E, 2I/128, H/128]`` and
``down_proj_scale_inv``); 4.x keeps a ``ModuleList`` of ``DeepseekV3MLP`` with ``gate_proj``,
``up_proj``, ``down_proj`` linears (FP8 linears carry ``weight_scale_inv``).

The routing rule is transformers' ``DeepseekV3TopkRouter`` (see :func:`moe_shape_from_config`):
float32 logits ``x.float() @ weight.float().T``, sigmoid scores, ``e_score_correction_bias`` added for
the choice only, ``n_group`` groups scored by their two best experts, ``topk_group`` groups kept,
top-k, the chosen scores normalised (``norm_topk_prob``, ``+ 1e-20``) and scaled by
``routed_scaling_factor``. The two can differ in the last bits (summation orders); a token whose
choice sits on such a near-tie may pick another expert set.

After the swap ``output_router_logits`` records nothing for these layers (the router runs inside the op).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from .math import FP8_DTYPE, QUANT_BLOCK, MoEShape
from .ops import MoELayer, register_layer
from .weights import MoEWeights, weights_from_float, weights_from_fp8

__all__ = ["moe_shape_from_config", "replace_moe_experts", "StreamringDeepseekV3MoE", "SwappedMoE",
           "deepseek_v3_moe_modules", "layer_weights_from_module"]

#: Checkpoint tensors by name: a mapping, or a function of the name (e.g. a safetensors handle's ``get_tensor``).
Checkpoint = Union[Mapping[str, torch.Tensor], Callable[[str], torch.Tensor]]

#: The routing / size fields the buffer's shape must share with the model's config.
_SHAPE_FIELDS = ("hidden", "intermediate", "num_experts", "topk", "router", "n_group", "topk_group",
                 "routed_scaling_factor", "norm_topk_prob")


def moe_shape_from_config(config: Any, *, weight_dtype: str = "fp8", block_m: int = 16) -> MoEShape:
    """The :class:`MoEShape` of a transformers ``DeepseekV3Config`` (to size the shared buffer).

    Mapping: ``hidden_size -> hidden``, ``moe_intermediate_size -> intermediate``,
    ``n_routed_experts -> num_experts``, ``num_experts_per_tok -> topk``, ``router = "deepseek_v3"``
    (sigmoid scores, float32 logits), ``n_group``, ``topk_group``, ``routed_scaling_factor``,
    ``norm_topk_prob`` as they are. ``hidden_act`` must be ``"silu"`` (SwiGLU experts) and, where
    the config has them (DeepSeek's own config files), ``scoring_func == "sigmoid"`` and
    ``topk_method == "noaux_tc"``.

    Args:
        config: the model's config (``model.config``).
        weight_dtype: ``"fp8"`` (the layer's FP8 path; bf16 checkpoints are quantised) or ``"bf16"``.
        block_m: rows per expert block of the layer.
    Returns:
        the validated shape.
    Raises:
        ValueError: naming the config field that this layer cannot run.
    """
    def need(name):
        v = getattr(config, name, None)
        if v is None:
            raise ValueError(f"config.{name} must be set for a DeepSeek-V3 MoE layer, got None")
        return v

    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.hidden_act must be 'silu' (SwiGLU experts), got {act!r}")
    for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        v = getattr(config, name, want)
        if v != want:
            raise ValueError(f"config.{name} must be {want!r} (transformers' DeepSeek-V3 router), got {v!r}")
    shape = MoEShape(hidden=int(need("hidden_size")), intermediate=int(need("moe_intermediate_size")),
                     num_experts=int(need("n_routed_experts")), topk=int(need("num_experts_per_tok")),
                     router="deepseek_v3", n_group=int(need("n_group")), topk_group=int(need("topk_group")),
                     routed_scaling_factor=float(need("routed_scaling_factor")),
                     norm_topk_prob=bool(need("norm_topk_prob")), weight_dtype=weight_dtype, block_m=block_m)
    shape.validate()
    if shape.num_experts // shape.n_group < 2:
        raise ValueError(f"config.n_group must leave >= 2 experts per group (transformers scores a group by its "
                         f"top 2), got n_group={shape.n_group} for n_routed_experts={shape.num_experts}")
    return shape


def deepseek_v3_moe_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every transformers ``DeepseekV3MoE`` in ``model``, in model order."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    return [(name, m) for name, m in model.named_modules() if isinstance(m, ds.DeepseekV3MoE)]


class _Fused:
    """Experts ``e`` of a fused ``[E, rows, cols]`` parameter, rows ``lo:hi`` (gate or up half), read lazily."""

    def __init__(self, t: torch.Tensor, lo: int, hi: int):
        self.t, self.lo, self.hi = t, lo, hi

    def __len__(self):
        return self.t.shape[0]

    def __getitem__(self, e):
        return self.t[e, self.lo:self.hi]


class _PerExpert:
    """``get(e)`` of experts ``e``, read lazily (a ModuleList's linears, a checkpoint's tensors)."""

    def __init__(self, n: int, get: Callable[[int], torch.Tensor]):
        self.n, self.get = n, get

    def __len__(self):
        return self.n

    def __getitem__(self, e):
        return self.get(e)


def _from_sources(router_weight, bias, gate, up, down, scales, shape: MoEShape, experts: range,
                  where: str) -> MoEWeights:
    if scales is not None:
        if shape.weight_dtype != "fp8":
            raise ValueError(f"{where} has FP8 experts but the buffer's shape.weight_dtype is "
                             f"{shape.weight_dtype!r}: build the buffer with weight_dtype='fp8'")
        gs, us, ds = scales
        return weights_from_fp8(router_weight, gate, gs, up, us, down, ds, correction_bias=bias, experts=experts)
    return weights_from_float(router_weight, gate, up, down, correction_bias=bias,
                              weight_dtype=shape.weight_dtype, experts=experts)


def layer_weights_from_module(moe: nn.Module, shape: MoEShape, experts: Optional[range] = None) -> MoEWeights:
    """One ``DeepseekV3MoE``'s router and routed experts as :class:`MoEWeights` (shared experts excluded).

    Args:
        moe: a transformers ``DeepseekV3MoE`` (5.x fused experts or 4.x ``ModuleList``; bf16/float or
            FP8 with ``*_scale_inv``).
        shape: the buffer's shape (its ``weight_dtype`` decides whether float experts are quantised).
        experts: experts to keep (``buffer.local_experts``), None = all.
    Returns:
        the layer's weights.
    Raises:
        ValueError: an expert layout this layer cannot take (transposed, interleaved, biased, no gate).
    """
    gate_mod, ex = moe.gate, moe.experts
    router_weight, bias = gate_mod.weight, getattr(gate_mod, "e_score_correction_bias", None)
    i = shape.intermediate
    if hasattr(ex, "gate_up_proj"):
        for attr, want in (("is_transposed", False), ("is_concatenated", True), ("has_gate", True),
                           ("has_bias", False)):
            if getattr(ex, attr, want) != want:
                raise ValueError(f"experts.{attr} must be {want} for this layer, got {getattr(ex, attr)}")
        gu, dn = ex.gate_up_proj, ex.down_proj
        if tuple(gu.shape[1:]) != (2 * i, shape.hidden):
            raise ValueError(f"experts.gate_up_proj must be [E, 2*intermediate={2 * i}, hidden={shape.hidden}], "
                             f"got {list(gu.shape)}")
        gate, up = _Fused(gu, 0, i), _Fused(gu, i, 2 * i)
        scales = None
        if gu.dtype == FP8_DTYPE:
            gus, dns = getattr(ex, "gate_up_proj_scale_inv", None), getattr(ex, "down_proj_scale_inv", None)
            if gus is None or dns is None:
                raise ValueError("FP8 experts must carry gate_up_proj_scale_inv and down_proj_scale_inv")
            ib = i // QUANT_BLOCK
            scales = (_Fused(gus, 0, ib), _Fused(gus, ib, 2 * ib), dns)
        return _from_sources(router_weight, bias, gate, up, dn, scales, shape, experts, "experts")
    if isinstance(ex, nn.ModuleList):
        n = len(ex)
        lin = {p: _PerExpert(n, lambda e, p=p: getattr(ex[e], p).weight) for p in ("gate_proj", "up_proj", "down_proj")}
        scales = None
        if ex[0].gate_proj.weight.dtype == FP8_DTYPE:
            scales = tuple(_PerExpert(n, lambda e, p=p: getattr(ex[e], p).weight_scale_inv)
                           for p in ("gate_proj", "up_proj", "down_proj"))
        return _from_sources(router_weight, bias, lin["gate_proj"], lin["up_proj"], lin["down_proj"], scales,
                             shape, experts, "experts")
    raise ValueError(f"experts of type {type(ex).__name__} are neither fused (gate_up_proj/down_proj) nor a "
                     f"ModuleList of gate_proj/up_proj/down_proj MLPs")


def _layer_weights_from_checkpoint(get: Callable[[str], torch.Tensor], prefix: str, shape: MoEShape,
                                   experts: range) -> MoEWeights:
    e = shape.num_experts
    router_weight = get(f"{prefix}.gate.weight")
    bias = get(f"{prefix}.gate.e_score_correction_bias")

    def proj(p, suffix="weight"):
        return _PerExpert(e, lambda k: get(f"{prefix}.experts.{k}.{p}.{suffix}"))

    first = get(f"{prefix}.experts.{experts.start}.gate_proj.weight")
    scales = None
    if first.dtype == FP8_DTYPE:
        scales = tuple(proj(p, "weight_scale_inv") for p in ("gate_proj", "up_proj", "down_proj"))
    return _from_sources(router_weight, bias, proj("gate_proj"), proj("up_proj"), proj("down_proj"), scales,
                         shape, experts, f"checkpoint {prefix}.experts")


class StreamringDeepseekV3MoE(nn.Module):
    """A ``DeepseekV3MoE`` whose router and routed experts run as ``torch.ops.streamring.moe_forward``.

    Args:
        layer: the registered layer (its ``id`` goes into the op).
        shared_experts: the original module's ``shared_experts``, kept as they are.
        streaming: streamed path (True) or batch-ready path (False) of the buffer.
        launch_next: the id of the next MoE layer, whose consumer side the op enqueues ahead after this one
            (``launch_ahead`` of :func:`replace_moe_experts`); None: none.
    """

    def __init__(self, layer: MoELayer, shared_experts: nn.Module, streaming: bool = False,
                 launch_next: Optional[int] = None):
        super().__init__()
        self.layer_id = int(layer.id)
        self.shared_experts = shared_experts
        self.streaming = bool(streaming)
        self.launch_next = launch_next

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]`` in the input's dtype (collective: every rank calls it)."""
        shape = hidden_states.shape
        routed = torch.ops.streamring.moe_forward(hidden_states.reshape(-1, shape[-1]), self.layer_id,
                                                  self.streaming, None, None, self.launch_next)
        return routed.view(shape) + self.shared_experts(hidden_states)

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, streaming={self.streaming}, launch_next={self.launch_next}"


class SwappedMoE:
    """What :func:`replace_moe_experts` returns: keep it while the model runs, then :meth:`close`.

    Attributes:
        layers: module name (``"model.layers.3.mlp"``) -> its registered :class:`~streamring.moe.ops.MoELayer`.
        buffer: the shared buffer (not closed by :meth:`close`: the caller owns it).
    """

    def __init__(self, buffer: Any, layers: dict, hooks: tuple = ()):
        self.buffer = buffer
        self.layers: dict[str, MoELayer] = layers
        self._hooks = list(hooks)

    def close(self) -> None:
        """Unregister every layer (the swapped modules then raise if called) and remove the launch hook;
        idempotent."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for layer in self.layers.values():
            layer.close()

    def __enter__(self) -> "SwappedMoE":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _register_layers(buffer, found, checkpoint, checkpoint_prefix: str) -> dict:
    """Every found module's weights (from the module or ``checkpoint``) registered with ``buffer``, by module name;
    the buffer's shape checked against the model's config first. A bad layer registers none (the model is left
    untouched)."""
    shape: MoEShape = buffer.shape
    want = moe_shape_from_config(found[0][1].config, weight_dtype=shape.weight_dtype, block_m=shape.block_m)
    bad = [f"{f}: buffer {getattr(shape, f)!r}, config {getattr(want, f)!r}" for f in _SHAPE_FIELDS
           if getattr(shape, f) != getattr(want, f)]
    if bad:
        raise ValueError("buffer.shape does not match the model's config (build it with moe_shape_from_config): "
                         + "; ".join(bad))
    experts = buffer.local_experts
    get = None
    if checkpoint is not None:
        get = checkpoint if callable(checkpoint) and not isinstance(checkpoint, Mapping) else checkpoint.__getitem__
    layers: dict[str, MoELayer] = {}
    try:
        for name, moe in found:
            if get is not None:
                w = _layer_weights_from_checkpoint(get, checkpoint_prefix + name, shape, experts)
            else:
                w = layer_weights_from_module(moe, shape, experts)
            layers[name] = register_layer(buffer, w)
    except BaseException:
        for layer in layers.values():
            layer.close()
        raise
    return layers


def replace_moe_experts(model: nn.Module, buffer: Any, *, checkpoint: Optional[Checkpoint] = None,
                        checkpoint_prefix: str = "", streaming: bool = False, launch_ahead: bool = False) -> SwappedMoE:
    """Replace the router + routed experts of every ``DeepseekV3MoE`` in ``model`` by this library's layer.

    Each module becomes a :class:`StreamringDeepseekV3MoE` (same place in the model, its
    ``shared_experts`` kept). Every layer's weights are prepared once for ``buffer`` (only
    ``buffer.local_experts`` are read and kept on this rank). Collective in use: every rank runs the
    model, with its own tokens, through the same layers.

    Args:
        model: a transformers DeepSeek-V3 model (``DeepseekV3ForCausalLM``, ``DeepseekV3Model``).
        buffer: the buffer all layers share, built with ``moe_shape_from_config(model.config, ...)``
            (its routing and sizes must match the config).
        checkpoint: optional source of the routed weights instead of the model's parameters: a mapping
            or a function from names to tensors, in DeepSeek-V3 checkpoint naming
            (``{prefix}{module}.gate.weight``, ``.gate.e_score_correction_bias``,
            ``.experts.{e}.{gate,up,down}_proj.weight`` and, for FP8, ``.weight_scale_inv``).
        checkpoint_prefix: prepended to the module names (``"model."`` when ``model`` is a
            ``DeepseekV3Model`` and the checkpoint belongs to the causal-LM).
        streaming: run the layers on the buffer's streamed path.
        launch_ahead: (with ``streaming``; a buffer with ``launch_consumer``, the GPU buffer) enqueue each MoE
            layer's consumer side before the decoder layer's attention that feeds it: the first one from a
            forward pre-hook of its decoder layer, every later one at the end of the previous MoE layer's op
            (``launch_next``). A PE whose attention runs late then already computes the rows other PEs
            published. Outputs are bitwise those without it.
    Returns:
        :class:`SwappedMoE` with the registered layers; close it (or use ``with``) when done.
    Raises:
        ValueError: no ``DeepseekV3MoE`` in the model, a config field the buffer's shape does not
        share, or weights the layer cannot take (naming the field); ``launch_ahead`` without ``streaming`` or
        with a buffer that cannot launch a consumer ahead.
    """
    if launch_ahead and not streaming:
        raise ValueError("launch_ahead=True needs streaming=True (the batch path has no consumer to launch ahead)")
    if launch_ahead and not callable(getattr(buffer, "launch_consumer", None)):
        raise ValueError(f"launch_ahead=True needs a buffer with launch_consumer (the GPU buffer), got "
                         f"{type(buffer).__name__}")
    found = deepseek_v3_moe_modules(model)
    if not found:
        raise ValueError(f"model ({type(model).__name__}) has no transformers DeepseekV3MoE module to replace")
    layers = _register_layers(buffer, found, checkpoint, checkpoint_prefix)
    names = [name for name, _ in found]
    hooks = []
    for i, (name, moe) in enumerate(found):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        nxt = layers[names[i + 1]].id if launch_ahead and i + 1 < len(names) else None
        setattr(parent, child, StreamringDeepseekV3MoE(layers[name], moe.shared_experts, streaming, nxt))
        if launch_ahead and i == 0:
            # the first MoE layer's consumer: before its decoder layer (the MoE's parent) runs its attention
            hooks.append(parent.register_forward_pre_hook(_first_launch(buffer, layers[name]), with_kwargs=True))
    return SwappedMoE(buffer, layers, hooks)


def _first_launch(buffer: Any, layer: MoELayer):
    """A forward pre-hook of the first MoE layer's decoder layer: its consumer, launched ahead of its attention
    for the rows of the hidden states the decoder layer receives."""
    def hook(module, args, kwargs):
        hs = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hs, torch.Tensor):
            buffer.launch_consumer(layer.weights, rows=int(hs.numel() // hs.shape[-1]))
        return None
    return hook
