"""The MoE layer on the ring: the public surface an engine uses.

* :class:`MoEBuffer` (``moe.layer``): one rank's symmetric buffers and the expert-parallel
  layer on any backend (CPU MPI windows or NVSHMEM through the host verbs); batch-ready path by
  default, ``forward(..., streaming=True)`` for the streamed path. The RFC's
  ``get_symm_buffer_for_mega_moe`` + ``fp8_fp4_mega_moe``.
* :class:`EPMoE` (``moe.gpu_layer``): the fast expert-parallel FP8 layer on GPUs (one PE per GPU,
  any number; device-side dispatch and combine over NVSHMEM; one CUDA graph per forward).
* :func:`batch_forward` (``moe.blocks``): the GPU batch-ready path on the same kernels.
* :class:`MoEShape` (``moe.shape``), :class:`MoEWeights` (``moe.math``): the layer's shape and weights;
  :class:`FastWeights` (``moe.blocks``): FP8 weights laid out for the GPU kernels;
  :class:`PlanChoice` (``moe.plan``): how a GPU forward is streamed; :func:`select_experts`,
  :func:`route`: the routing rule.

Exports are lazy: ``import streamring.moe`` loads neither torch's GPU parts nor Triton; the name
you touch loads its module.
"""

_EXPORTS = {
    "MoEBuffer": "layer", "ForwardStats": "layer", "SCHEDULERS": "layer",
    "EPMoE": "gpu_layer",
    "batch_forward": "blocks", "FastWeights": "blocks", "Producer": "blocks", "BlockConsumer": "blocks",
    "MoEShape": "shape", "MoEWeights": "math", "select_experts": "math", "route": "math",
    "reference_forward_f64": "math", "reference_tolerance": "math",
    "PlanChoice": "plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'streamring.moe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
