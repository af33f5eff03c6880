"""The MoE layer on the ring: the public surface an engine uses.

* :class:`EPBuffer` (``moe.ep_buffer``): the expert-parallel FP8 layer on GPUs (one PE per GPU, any
  number; device-side dispatch and combine over NVSHMEM), one buffer for every layer of a model:
  :meth:`EPBuffer.prepare_weights` once per layer, :meth:`EPBuffer.forward` per call (any token count up
  to the maximum, capturable in the caller's CUDA graph). :class:`EPTuning` (``moe.tuning``): its
  scheduling switches, with measured defaults.
* :class:`MoEBuffer` (``moe.layer``): the reference layer on any backend (CPU MPI windows or NVSHMEM
  through the host verbs), bf16 or FP8; batch-ready path by default, ``forward(..., streaming=True)``
  for the streamed path; :class:`MoETuning`: its consumer's switches. Both buffers implement one contract,
  :class:`streamring.moe.contract.MoELayerBuffer`.
* :class:`MoEShape` (``moe.shape``), :class:`MoEWeights` (``moe.weights``): the layer's sizes, router and
  weights, the one weights type (the FP8 layer reads its views: ``fp8_blocks()``, ``pe_slice()``);
  :func:`weights_from_float`, :func:`weights_from_fp8` (``moe.weights``): one layer's weights
  from bf16/float tensors (quantised to FP8 128x128 blocks) or FP8 checkpoint tensors with
  ``weight_scale_inv``, taken as they are.
* :func:`register_layer` (``moe.ops``): the layer as the torch op ``torch.ops.streamring.moe_forward``
  (one node under ``torch.compile``).
* :func:`replace_moe_experts`, :func:`moe_shape_from_config` (``moe.hf``): the Hugging Face drop-in for
  transformers' DeepSeek-V3 MoE modules.
* :class:`NvshmemHeap` (``device.nvshmem``) and :class:`MpiHeap` (``device.cpu``): the symmetric heaps a
  buffer lives in (GPUs; CPUs).

Exports are lazy: ``import streamring.moe`` loads neither torch's GPU parts nor Triton; the name
you touch loads its module. Everything else is reached through its module.
"""

_EXPORTS = {
    "EPBuffer": ".ep_buffer", "EPTuning": ".tuning", "MoEBuffer": ".layer", "MoETuning": ".tuning",
    "MoEShape": ".shape", "MoEWeights": ".weights",
    "weights_from_float": ".weights", "weights_from_fp8": ".weights",
    "register_layer": ".ops", "replace_moe_experts": ".hf", "moe_shape_from_config": ".hf",
    "NvshmemHeap": "streamring.device.nvshmem", "MpiHeap": "streamring.device.cpu",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'streamring.moe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
