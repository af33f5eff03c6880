"""The MoE layer as one torch op: ``torch.ops.streamring.moe_forward``, visible to ``torch.compile``.

A torch op takes only tensors and scalars, so the buffer and a layer's prepared weights stay in a
process-local registry and the op names them by an int id:

* :func:`register_layer` prepares the weights once (``buffer.prepare_weights``) and returns a
  :class:`MoELayer` handle holding the id;
* ``torch.ops.streamring.moe_forward(x, layer_id, streaming, stream_epoch, num_tokens, launch_next)`` looks
  the id up and runs ``buffer.forward``; the output has ``x``'s shape and dtype; ``launch_next`` (a layer id,
  default None) then enqueues that layer's consumer side ahead of its input (``buffer.launch_consumer``, the
  GPU buffer: while the caller's stream computes what feeds the next layer, its consumer already takes what
  other PEs publish);
* ``handle.close()`` (or leaving ``with register_layer(...) as layer:``) removes the entry. Ids are
  never reused, so a graph that still calls a closed id raises a ``KeyError`` naming it instead of
  reaching another layer. The registry holds the buffer and the weights strongly until then;
  closing a handle does not close the buffer (every layer of a model shares it).

The op is collective, like ``buffer.forward``: every rank calls it, for the same layers in the same
order. ``torch.compile`` keeps it as one node: its fake implementation gives the output's shape and
dtype without running anything (no graph break, nothing data-dependent for the tracer to see).
Inference only: the op has no autograd formula.

On the CPU buffer (:class:`~streamring.moe.layer.MoEBuffer`) ``num_tokens`` is read on the host; a
GPU buffer reads the same tensor on the device.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional

import torch

from .contract import MoELayerBuffer
from .layer import NumTokens

__all__ = ["MoELayer", "register_layer", "moe_forward", "registered_layers"]

_REGISTRY: dict[int, "MoELayer"] = {}
_LOCK = threading.Lock()
_NEXT_ID = itertools.count(1)


class MoELayer:
    """A registered layer: a buffer and one layer's prepared weights, named by :attr:`id` in the op.

    Made by :func:`register_layer`. Call it like ``buffer.forward`` (it goes through the torch op);
    :meth:`close` or the ``with`` block's end unregisters it.

    Attributes:
        id: the int the op takes (unique in this process, never reused).
        buffer: the shared buffer (``MoEBuffer`` on CPUs).
        weights: what ``buffer.prepare_weights`` returned for this layer.
        last_routing: ``(topk_idx [T, k], topk_weights [T, k])`` of this layer's last call on this
            rank, or None (``buffer.last_routing`` after it).
    """

    def __init__(self, layer_id: int, buffer: Any, weights: Any):
        self.id = layer_id
        self.buffer = buffer
        self.weights = weights
        self.last_routing: Optional[tuple] = None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (the op then refuses :attr:`id`)."""
        return self.id not in _REGISTRY

    def __call__(self, x: torch.Tensor, *, streaming: bool = False, stream_epoch: Optional[int] = None,
                 num_tokens: Optional[NumTokens] = None, launch_next: Optional["MoELayer | int"] = None
                 ) -> torch.Tensor:
        """``buffer.forward`` through the torch op (collective).

        Args:
            x: ``[T, hidden]`` tokens of this rank.
            streaming: streamed path (True) or batch-ready path (False).
            stream_epoch: the call's epoch, default the buffer's next one.
            num_tokens: valid row count (int or 0-d/1-element integer tensor), default ``T``.
            launch_next: the layer whose streamed forward comes next (:func:`moe_forward`).
        Returns:
            ``[T, hidden]`` in ``x``'s dtype; rows ``>= num_tokens`` are zero.
        """
        return moe_forward(x, self.id, streaming=streaming, stream_epoch=stream_epoch, num_tokens=num_tokens,
                           launch_next=launch_next)

    def close(self) -> None:
        """Unregister (idempotent). The buffer stays open: it belongs to every layer."""
        with _LOCK:
            _REGISTRY.pop(self.id, None)

    def __enter__(self) -> "MoELayer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MoELayer(id={self.id}, {'closed' if self.closed else 'open'})"


def register_layer(buffer: Any, weights: Any) -> MoELayer:
    """Prepare one layer's weights for ``buffer`` and register them for the op.

    Args:
        buffer: the buffer every layer shares (:class:`~streamring.moe.contract.MoELayerBuffer`).
        weights: the layer's :class:`~streamring.moe.weights.MoEWeights` (all experts or this rank's).
    Returns:
        the :class:`MoELayer` handle; keep it while a model calls the op with its id, then ``close()``.
    Raises:
        ValueError: from ``prepare_weights``, naming the bad field.
    """
    if not isinstance(buffer, MoELayerBuffer):
        raise ValueError(f"buffer must implement streamring.moe.contract.MoELayerBuffer (a MoEBuffer or an EPBuffer), "
                         f"got {type(buffer).__name__}")
    prepared = buffer.prepare_weights(weights)
    with _LOCK:
        layer = MoELayer(next(_NEXT_ID), buffer, prepared)
        _REGISTRY[layer.id] = layer
    return layer


def registered_layers() -> list[int]:
    """The ids registered in this process now (sorted)."""
    with _LOCK:
        return sorted(_REGISTRY)


def _lookup(layer_id: int) -> MoELayer:
    with _LOCK:
        layer = _REGISTRY.get(layer_id)
    if layer is None:
        raise KeyError(f"streamring::moe_forward: layer id {layer_id} is not registered in this process "
                       f"(closed, or never registered; registered now: {registered_layers()})")
    return layer


@torch.library.custom_op("streamring::moe_forward", mutates_args=())
def _moe_forward_op(x: torch.Tensor, layer: int, streaming: bool, stream_epoch: Optional[int],
                    num_tokens: Optional[torch.Tensor], launch_next: Optional[int] = None) -> torch.Tensor:
    entry = _lookup(layer)
    nxt = None
    if launch_next is not None:  # checked before the forward: a bad id enqueues nothing
        nxt = _lookup(launch_next)
        if nxt.buffer is not entry.buffer or not callable(getattr(entry.buffer, "launch_consumer", None)):
            raise ValueError(f"streamring::moe_forward: launch_next={launch_next} must be a layer of the same buffer "
                             f"as layer {layer}, a buffer that launches consumers ahead (the GPU buffer); got "
                             f"{type(nxt.buffer).__name__}" + ("" if nxt.buffer is entry.buffer else " (another one)"))
    y = entry.buffer.forward(x, entry.weights, streaming=streaming, stream_epoch=stream_epoch,
                             num_tokens=num_tokens)
    entry.last_routing = entry.buffer.last_routing
    if nxt is not None:
        entry.buffer.launch_consumer(nxt.weights, rows=x.shape[0])
    # A custom op's output must not alias its inputs: y is the buffer's fresh tensor, in x's dtype (the contract).
    return y


@_moe_forward_op.register_fake
def _moe_forward_fake(x, layer, streaming, stream_epoch, num_tokens, launch_next=None):
    return torch.empty_like(x)


def moe_forward(x: torch.Tensor, layer: int, *, streaming: bool = False, stream_epoch: Optional[int] = None,
                num_tokens: Optional[NumTokens] = None, launch_next: Optional["MoELayer | int"] = None
                ) -> torch.Tensor:
    """Call ``torch.ops.streamring.moe_forward`` (collective): the registered layer ``layer`` on ``x``.

    Args:
        x: ``[T, hidden]`` bf16/float32/float64 tokens of this rank.
        layer: a :class:`MoELayer` or its ``id``.
        streaming: streamed path (True) or batch-ready path (False).
        stream_epoch: the call's epoch (must grow per buffer ring); default the buffer's next one.
            Under ``torch.compile`` leave it None: a Python int that changes per call recompiles.
        num_tokens: valid row count, an int (turned into a 0-d int64 tensor on ``x``'s device) or a
            0-d/1-element integer tensor; default every row.
        launch_next: the layer (a :class:`MoELayer` of the same buffer, or its id) whose streamed forward of
            ``T`` rows comes next: after this forward its consumer side is enqueued ahead of its input
            (``buffer.launch_consumer``; the GPU buffer only), so it waits only on the ring and on this forward,
            never on what the caller enqueues before the next layer (its attention).
    Returns:
        ``[T, hidden]`` in ``x``'s dtype; rows ``>= num_tokens`` are zero.
    """
    layer_id = layer.id if isinstance(layer, MoELayer) else int(layer)
    if launch_next is not None:
        launch_next = launch_next.id if isinstance(launch_next, MoELayer) else int(launch_next)
    if num_tokens is not None and not isinstance(num_tokens, torch.Tensor):
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise ValueError(f"num_tokens must be an int or a 0-d/1-element integer tensor, "
                             f"got {type(num_tokens).__name__}")
        num_tokens = torch.tensor(num_tokens, dtype=torch.int64, device=x.device)
    return torch.ops.streamring.moe_forward(x, layer_id, bool(streaming), stream_epoch, num_tokens, launch_next)
