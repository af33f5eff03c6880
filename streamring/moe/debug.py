"""Test and debug hooks of the buffers, kept out of the signature an engine reads: a deliberate protocol
mutation (to show that the checks catch it; both buffers), the per-chunk device timeline and the producer delay
of an :class:`~streamring.moe.ep_buffer.EPBuffer` (its instrument: :mod:`streamring.moe.instrument`), each set on
a built buffer before the forwards that should carry it (collective like the buffer: every rank sets the same);
and how a forward's ready blocks met its GEMM grids' expectations (read after it, on one rank)."""

from __future__ import annotations

import torch

from ..device.gemm_grid import grid_blocks
from ..device.ringdesc import INJECT_BITS
from ..ring.policies import Inject
from .instrument import attach
from .layer import MoEBuffer


def inject(buf, mode: str) -> None:
    """Make ``buf`` (an :class:`~streamring.moe.ep_buffer.EPBuffer` or a
    :class:`~streamring.moe.layer.MoEBuffer`) run the protocol mutation ``mode`` on its streamed ring
    (``streamring.ring.policies.INJECT_MODES``: ``skip-acquire``, ``signal-before-payload``, ``skip-ack-wait``,
    ``ignore-epoch``; ``none`` undoes it). The run's bitwise and status checks must then fail: tests and the
    GPU check use it to show they can. On the GPU buffer it lives in the buffer's instrument
    (:func:`streamring.moe.instrument.attach`)."""
    if mode not in INJECT_BITS:
        raise ValueError(f"inject mode must be one of {list(INJECT_BITS)}, got {mode!r}")
    if isinstance(buf, MoEBuffer):  # the host protocol's ring reads the mode at every step
        buf.stream_ring.inject = Inject(mode)
        return
    attach(buf).set_inject(mode)


def record_timeline(buf) -> None:
    """Make every later forward of ``buf`` record per-chunk ``%globaltimer`` stamps (read them with
    :func:`timeline`). Allocates: call before capturing a graph that should record them."""
    attach(buf).record_timeline()


def timeline(buf) -> dict:
    """The device timeline of ``buf``'s last stamped forward (:meth:`~streamring.moe.instrument.Instrument.timeline`)."""
    if buf.instrument is None:
        raise ValueError("no timeline: call streamring.moe.debug.record_timeline(buffer) and run a forward")
    return buf.instrument.timeline()


def set_producer_delay(buf, ns: int) -> None:
    """Delay ``buf``'s producers on this rank by ``ns`` nanoseconds from the next forward (0: none): a slow rank on
    purpose, batch and streamed alike, while this rank's consumer already serves the others' chunks. Local (not
    collective). On the GPU buffer the delay runs on the device (its instrument); on the CPU buffer the route and
    layout producers sleep before their first chunk."""
    if not isinstance(ns, int) or isinstance(ns, bool) or ns < 0:
        raise ValueError(f"ns must be an int >= 0, got {ns!r}")
    if isinstance(buf, MoEBuffer):
        buf.producer_delay_s = ns * 1e-9
        return
    attach(buf).set_delay(ns)


def blocks_past_expectation(buf) -> dict:
    """How the blocks of ``buf``'s last forward (or last replay of its last captured forward) met the
    expectations its GEMM grids were sized for (``EPExperts.expect``; synchronizes): per call the
    blocks found ready, the expectation (a call without one: its bound), the blocks past it, and
    ``past_grid``: those past the expectation in whole groups (``device.gemm_grid.grid_blocks``), the blocks
    a Triton grid launches one CTA per tile for; with the sums over the calls and ``gemm``, the buffer's GEMMs.
    Where a Triton grid launched its looping tail, ``past_grid`` blocks ran on it; where the tail would not
    have launched fewer CTAs than the bound's grid, or under ``chunk_gemm_ctas``, every block ran on that
    grid (``moe_triton._grid``); CUTLASS and DeepGEMM grids ignore the expectation. The persistent consumer
    makes no such calls (every count 0, ``calls`` empty)."""
    ex = buf.pipeline.experts
    if buf.dev.type == "cuda":
        torch.cuda.synchronize(buf.dev)
    hi_of = ex.bc.ready_hi.cpu().tolist()
    calls = []
    for lo, hi, bound, expect in ex.gemm_calls:
        ready = max(0, min(hi_of[hi] - hi_of[lo], bound))
        exp = bound if expect is None else min(expect, bound)
        calls.append({"ready": ready, "expected": exp, "past": max(0, ready - exp),
                      "past_grid": max(0, ready - grid_blocks(exp, bound))})
    return {"gemm": buf.gemm, "calls": calls,
            **{k: sum(c[k] for c in calls) for k in ("ready", "expected", "past", "past_grid")}}
