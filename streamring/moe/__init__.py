"""The MoE layer on the ring: the public surface an engine uses.

* :class:`MoEBuffer` (``moe.layer``): one rank's symmetric buffers and the expert-parallel
  layer on any backend (CPU MPI windows or NVSHMEM through the host verbs); batch-ready path by
  default, ``forward(..., streaming=True)`` for the streamed path. The RFC's
  ``get_symm_buffer_for_mega_moe`` + ``fp8_fp4_mega_moe``.
* :class:`EPBuffer` (``moe.ep_buffer``): the fast expert-parallel FP8 layer on GPUs (one PE per GPU,
  any number; device-side dispatch and combine over NVSHMEM), one buffer for every layer of a model:
  :meth:`EPBuffer.prepare_weights` once per layer (:class:`LayerWeights`), :meth:`EPBuffer.forward` per call
  (any token count up to the maximum, capturable in the caller's CUDA graph).
* :func:`batch_forward` (``moe.blocks``): the GPU batch-ready path on the same kernels.
* :class:`MoEShape` (``moe.shape``), :class:`MoEWeights` (``moe.math``): the layer's shape and weights;
  :class:`FastWeights` (``moe.blocks``): FP8 weights laid out for the GPU kernels;
  :class:`PlanChoice` (``moe.plan``): how a GPU forward is streamed; :func:`select_experts`,
  :func:`route`: the routing rule.
* :func:`weights_from_float`, :func:`weights_from_fp8` (``moe.weights``): one layer's weights from
  bf16/float tensors (quantised to FP8 128x128 blocks) or FP8 checkpoint tensors with
  ``weight_scale_inv``, taken as they are.
* :func:`register_layer`, :class:`MoELayer`, :func:`moe_forward` (``moe.ops``): the layer as the torch
  op ``torch.ops.streamring.moe_forward`` (one node under ``torch.compile``).
* :func:`replace_moe_experts`, :func:`moe_shape_from_config` (``moe.hf``): the Hugging Face drop-in for
  transformers' DeepSeek-V3 MoE modules.

Exports are lazy: ``import streamring.moe`` loads neither torch's GPU parts nor Triton; the name
you touch loads its module.
"""

_EXPORTS = {
    "MoEBuffer": "layer", "ForwardStats": "layer", "SCHEDULERS": "layer",
    "EPBuffer": "ep_buffer", "LayerWeights": "ep_buffer",
    "batch_forward": "blocks", "FastWeights": "blocks", "Producer": "blocks", "BlockConsumer": "blocks",
    "MoEShape": "shape", "MoEWeights": "math", "select_experts": "math", "route": "math",
    "reference_forward_f64": "math", "reference_tolerance": "math",
    "PlanChoice": "plan",
    "weights_from_float": "weights", "weights_from_fp8": "weights",
    "MoELayer": "ops", "register_layer": "ops", "moe_forward": "ops",
    "replace_moe_experts": "hf", "moe_shape_from_config": "hf", "StreamringDeepseekV3MoE": "hf",
    "SwappedMoE": "hf",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'streamring.moe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
