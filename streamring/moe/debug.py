"""Test and debug hooks of the buffers, kept out of the signature an engine reads: a deliberate protocol
mutation (to show that the checks catch it; both buffers) and the per-chunk device timeline of an
:class:`~streamring.moe.ep_buffer.EPBuffer` (what ``streamring timeline`` draws). Both are set on a built
buffer before its first forward (collective like the buffer: every rank sets the same)."""

from __future__ import annotations

import torch

from ..device.ringdesc import INJECT_BITS
from ..ring.policies import Inject
from .timeline_events import STAMP_STRIDE


def inject(buf, mode: str) -> None:
    """Make ``buf`` (an :class:`~streamring.moe.ep_buffer.EPBuffer` or a
    :class:`~streamring.moe.layer.MoEBuffer`) run the protocol mutation ``mode`` on its streamed ring
    (``streamring.ring.policies.INJECT_MODES``: ``skip-acquire``, ``signal-before-payload``, ``skip-ack-wait``,
    ``ignore-epoch``; ``none`` undoes it). The run's bitwise and status checks must then fail: tests and the
    GPU check use it to show they can."""
    if mode not in INJECT_BITS:
        raise ValueError(f"inject mode must be one of {list(INJECT_BITS)}, got {mode!r}")
    if hasattr(buf, "stream_ring"):  # MoEBuffer: the host protocol's ring reads the mode at every step
        buf.stream_ring.inject = Inject(mode)
        return
    buf.inject = mode
    buf._inject_bits = INJECT_BITS[mode]


def record_timeline(buf) -> None:
    """Make every later forward of ``buf`` record per-chunk ``%globaltimer`` stamps (read them with
    :meth:`EPBuffer.timeline`). Allocates: call before capturing a graph that should record them."""
    if buf.stamps is None:
        buf.stamps = torch.zeros((buf._max_chunks + 1) * STAMP_STRIDE, dtype=torch.int64, device=buf.dev)
