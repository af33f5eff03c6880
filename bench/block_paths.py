"""The single-process block path's drivers that the benchmarks and the tests run (not the engine's path):
producer outputs standing in for ring slots (:func:`scratch_buffers`) and the chunk-by-chunk streamed forward
without a ring (:func:`streamed_forward_serial`, the block logic alone)."""

from __future__ import annotations

import torch

from streamring.moe.blocks import FP8, BlockConsumer, Producer
from streamring.moe.math import MoEShape
from streamring.moe.weight_views import FP8BlocksView


def scratch_buffers(shape: MoEShape, tokens: int, device) -> dict:
    """Producer outputs for ``tokens`` tokens (the batch path's stand-in for ring slots)."""
    return {"idx": torch.zeros(tokens, shape.topk, dtype=torch.int64, device=device),
            "w": torch.zeros(tokens, shape.topk, dtype=torch.float32, device=device),
            "q": torch.zeros(tokens, shape.hidden, dtype=FP8, device=device),
            "sf": torch.zeros(tokens, shape.hidden // 128, dtype=torch.float32, device=device)}


def streamed_forward_serial(x, fw: FP8BlocksView, shape: MoEShape, prod: Producer, bc: BlockConsumer,
                            scratch: dict, chunk_tokens: int, out: torch.Tensor, gemm_impl: str = "triton") -> None:
    """Chunk by chunk on one stream, without a ring (the block logic alone; tests and the
    ``serialized`` reference): produce chunk c, dispatch it, run the blocks it made ready with
    the expert GEMMs of ``gemm_impl`` (:meth:`BlockConsumer.compute`)."""
    t = x.shape[0]
    n_chunks = max(1, -(-t // chunk_tokens))
    bc.begin()
    for c in range(n_chunks):
        a, b = c * chunk_tokens, min(t, (c + 1) * chunk_tokens)
        idx, w = scratch["idx"][a:b], scratch["w"][a:b]
        q, sf = scratch["q"][a:b], scratch["sf"][a:b]
        prod.route(x[a:b], fw, shape, idx, w)
        prod.layout(x[a:b], q, sf)
        bc.dispatch(c, idx, w, q, sf, a)
        bc.compute(c, c + 1, bc.max_ready(b - a), fw, impl=gemm_impl)
    bc.seal(n_chunks)
    bc.compute(n_chunks, n_chunks + 1, bc.max_ready(0), fw, impl=gemm_impl)
    bc.combine(out)
