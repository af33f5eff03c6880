"""NVTX ranges for nsys users (``nvtx`` package; a no-op where it is not installed, e.g. a GPU
image that lacks it). Usage: ``with annotate("streamring ...", color="blue"): ...``."""

from __future__ import annotations

import contextlib

try:  # pragma: no cover - depends on the machine
    import nvtx as _nvtx
except ImportError:  # pragma: no cover
    _nvtx = None


def annotate(message: str, color: str = "blue"):
    """An NVTX push/pop range around a host-side phase (free when no profiler is attached)."""
    if _nvtx is None:
        return contextlib.nullcontext()
    return _nvtx.annotate(message, color=color)
