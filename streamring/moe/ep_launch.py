"""A streamed forward's consumer side enqueued ahead of its input (:meth:`EPBuffer.launch_consumer
<streamring.moe.ep_buffer.EPBuffer.launch_consumer>`): the pending launch, and the rules by which the next call takes
it or cancels it.

The rule that keeps every PE's waits bounded: a launched consumer waits on the ring for every PE's producer, so a
launch is either taken by the forward it was made for (same layer, same rows, streamed, no explicit epoch, on the
same side of a CUDA graph capture) or cancelled, and a cancellation enqueues this PE's producer with no rows (empty
chunks are published, so no consumer here or on another PE waits past its deadline)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class Launched:
    """One launch: what its forward must be, and where it was enqueued."""

    layer: Any  # the PESliceView the forward must pass
    rows: int
    stamps: bool
    enqueued: bool  # False: nothing was enqueued (serialized policy, or the streamed path's first forward)
    capturing: bool  # enqueued inside a CUDA graph capture


class LaunchAhead:
    """The pending launch of one buffer (:attr:`pending`, None when none) and its take/cancel rules."""

    def __init__(self, buf):
        self._buf = buf
        self.pending: Optional[Launched] = None

    def launch(self, layer, rows: int, stamps: bool, capturing: bool) -> None:
        """Enqueue the consumer side of the next streamed forward (checked arguments); a pending one is cancelled
        first. Nothing is enqueued on one stream (serialized policy) or before the path's first (eager) forward."""
        buf = self._buf
        self.cancel("a new launch_consumer")
        path = buf.paths["stream"]
        enqueue = path.name in buf.warm_paths and path.policy != "serialized" and buf.pipeline.progress.concurrent
        if enqueue:
            buf.pipeline.launch(path, layer, rows, stamps)
        self.pending = Launched(layer, rows, stamps, enqueue, capturing)

    def cancel(self, why: Optional[str]) -> bool:
        """Cancel the pending launch (``why``: what cancelled it, warned about; None: the caller asked). Its
        producer side runs with no rows. True if one was pending. A launch enqueued on the other side of a capture
        cannot be cancelled there: the buffer is then broken (RuntimeError)."""
        ld, self.pending = self.pending, None
        if ld is None:
            return False
        buf = self._buf
        if why is not None:
            warnings.warn(f"EPBuffer: the consumer launched ahead for a layer's forward of {ld.rows} rows was "
                          f"cancelled by {why}", stacklevel=4)
        if ld.enqueued:
            if buf.capturing() != ld.capturing:
                where, now = ("inside", "outside") if ld.capturing else ("outside", "inside")
                buf.broken = buf.broken or f"a consumer launched ahead {where} a CUDA graph capture was cancelled {now} it"
                raise RuntimeError(f"{buf.broken}: its producer cannot be enqueued there (a captured graph would "
                                   f"hold a consumer whose producer never runs); the buffer now refuses to run: "
                                   f"rebuild it")
            empty = torch.empty(0, buf.shape.hidden, dtype=torch.bfloat16, device=buf.dev)
            buf.pipeline.enqueue(buf.paths["stream"], ld.layer, empty, empty, 0, None, serialized=False,
                                 stamps=ld.stamps, launched=True)
        return True

    def take(self, layer, rows: int, streaming: bool, stream_epoch, capturing: bool) -> Optional[Launched]:
        """The pending launch a forward runs the producer side of (None: none pending, or cancelled here because
        this forward is not the launched one)."""
        ld = self.pending
        if ld is None:
            return None
        if ld.enqueued and ld.capturing != capturing:
            self.cancel("a forward " + ("inside" if capturing else "outside") + " a CUDA graph capture")
            return None
        if not streaming or layer is not ld.layer or rows != ld.rows or stream_epoch is not None:
            what = ("a batch forward" if not streaming else "a forward with stream_epoch" if stream_epoch is not None
                    else "a forward of another layer" if layer is not ld.layer
                    else f"a forward of {rows} rows")
            self.cancel(what)
            return None
        self.pending = None
        return ld
