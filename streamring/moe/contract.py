"""The one contract of the MoE layer's buffers: what :class:`~streamring.moe.layer.MoEBuffer` (the CPU reference
layer, any heap) and :class:`~streamring.moe.ep_buffer.EPBuffer` (the expert-parallel GPU layer) both are.

An engine holds one buffer per process group, shared by every MoE layer, and calls, collectively (every rank, the
same layers in the same order):

* ``prepare_weights(weights)``: one layer's weights checked (and, on the GPU, quantized and sliced to this rank's
  experts) once; the result is what ``forward`` takes for that layer;
* ``forward(x, weights, *, streaming=False, stream_epoch=None, num_tokens=None, out=None, routing=None)``: the layer
  on this rank's ``x [T, hidden]``, returning ``y [T, hidden]`` in ``x``'s dtype (into ``out`` when given: ``x``'s
  dtype and shape); the batch-ready path by default, the streamed ring with ``streaming=True``, both bitwise equal;
  ``num_tokens`` the valid rows (an int or a one-element integer tensor); ``routing`` a ``(topk_idx, topk_weights)``
  pair instead of the layer's router. Every argument is checked before anything is published
  (:mod:`streamring.moe.checks`: the same ``ValueError`` naming it on both buffers, and the buffer stays usable);
* ``last_routing``: ``(topk_idx, topk_weights)`` of this rank's tokens in the last forward;
* ``status()`` (what the rings recorded) and ``check()`` (raise if the buffer is broken by a failure inside a
  running stream: then ``close()`` it and build a new one on every rank); ``close()``;
* ``deadline_s``: every wait gives up after it (default :data:`DEFAULT_DEADLINE_S` on both) and says what it
  waited for; ``shape``, ``max_tokens_per_rank``, ``local_experts``.

What only the GPU buffer adds: ``streaming="auto"`` (a tuned table's decision), ``launch_consumer`` (a consumer
enqueued ahead of its input), ``capture`` / ``replay`` / ``prioritize`` (CUDA graphs), ``memory_report``, and its
scheduling switches (``EPTuning``); the CPU buffer's are ``MoETuning``. Test hooks live outside the contract
(:mod:`streamring.moe.debug`).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

#: every wait of either buffer gives up after this long by default (seconds)
DEFAULT_DEADLINE_S = 30.0


@runtime_checkable
class MoELayerBuffer(Protocol):
    """The contract both buffers implement (module doc). ``isinstance(buf, MoELayerBuffer)`` checks the names."""

    shape: Any
    deadline_s: float

    @property
    def max_tokens_per_rank(self) -> int: ...

    @property
    def local_experts(self) -> range: ...

    @property
    def last_routing(self) -> Optional[tuple]: ...

    def prepare_weights(self, weights) -> Any: ...

    def forward(self, x, weights, *, streaming=False, stream_epoch=None, num_tokens=None, out=None,
                routing=None): ...

    def status(self) -> dict: ...

    def check(self) -> None: ...

    def close(self) -> None: ...
