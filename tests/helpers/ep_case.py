"""What the EP layer's GPU tests share: one small DeepSeek-V3-style shape on one NVSHMEM PE (the module-scoped
``env`` fixture: import ``ep_env`` into a test module), their inputs, the bitwise view they compare, and the
single-process block path every buffer must equal bitwise."""

from __future__ import annotations

import pytest
import torch
from bench import block_paths


@pytest.fixture(scope="module", name="env")
def ep_env():
    """``(heap, shape, mw)``: a 1-PE NVSHMEM heap, the shape and its random FP8 weights (closed at the end)."""
    from streamring.device.nvshmem import NvshmemHeap
    from streamring.moe.math import MoEShape
    from streamring.moe.weights import MoEWeights

    heap = NvshmemHeap.bootstrap(launcher="local")
    shape = MoEShape(hidden=512, intermediate=256, num_experts=16, topk=4, router="deepseek_v3", n_group=4,
                     topk_group=2, routed_scaling_factor=2.5, weight_dtype="fp8", block_m=16)
    mw = MoEWeights.random_fp8(shape, 7, heap.device)
    yield heap, shape, mw
    heap.close()


def random_x(shape, T: int, seed: int, dev) -> torch.Tensor:
    """``T`` tokens of bf16 activations, N(0, 1), from a generator seeded with ``seed`` on ``dev``."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    return torch.randn(T, shape.hidden, generator=g, device=dev).to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor's bits (what the bitwise comparisons compare)."""
    return t.contiguous().view(torch.int16)


def single_batch(shape, mw, x: torch.Tensor) -> torch.Tensor:
    """The single-process block path (no ring) on ``mw`` (a :class:`MoEWeights`, all experts): the reference a
    buffer's output must equal bitwise."""
    from block_forwards import batch_forward
    from streamring.moe import blocks as B

    T = x.shape[0]
    y = torch.zeros_like(x)
    fw = mw.fp8_blocks()
    batch_forward(x, fw, shape, B.Producer(T, shape.num_experts, x.device), B.BlockConsumer(shape, T, 2, 16, x.device),
                  block_paths.scratch_buffers(shape, T, x.device), y)
    return y
