"""The expert GEMM backends behind one interface, and what each can do.

A backend is a class made for one :class:`~streamring.moe.blocks.BlockConsumer` ``bc``
(``cls(bc, **options)``: it allocates, so before a graph capture) with

* ``compute(lo_index, hi_index, max_items, fw, *, max_ctas=None, expect_items=None, out=None, direct=None)``:
  L1 + SwiGLU + L2 of the blocks ``bc.ready_list[bc.ready_hi[lo_index] : bc.ready_hi[hi_index]]``
  (``max_items``: the grid bound; ``expect_items``: how many the call is expected to have, a hint that a
  backend whose grid the host sizes uses to launch for those rather than for the bound, and the others
  ignore) with the weights ``fw``, into ``bc.y`` (or ``out``; ``direct``: each row straight into its owner's
  combine row). A call asking for what the backend cannot do raises ValueError naming it
  (:func:`refuse_unsupported`);
* ``status() -> int``: the ready-range status bits of the calls so far (0: fine; synchronises);
* ``check()``: raise when ``status()`` is not 0;
* ``capabilities``: its :class:`Capabilities`, :data:`CAPABILITIES` ``[name]``.

Every backend computes each result row from that row's inputs and its expert's weights only, whatever
the ready ranges of the calls: streamed (many ranges) and batch (one) outputs are bitwise equal on it.

Importing this module loads neither torch nor a backend (:func:`backend_class` imports on demand).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a backend's ``compute`` can do beside the GEMMs themselves.

    ``max_ctas``: a capped (persistent) grid, leaving SMs to other streams; ``owner_rows``: L2 writes each
    row straight into its owner PE's combine row (``direct=``), no local ``y`` and no puts; ``persistent``:
    its tile functions make the persistent consumer kernel (``device/persistent_moe.py``); ``waves``: its own
    grid is persistent (a CTA per SM, which holds every SM until the call ends, so no other stream's kernel
    runs beside it) and ``max_ctas`` above the SM count runs it in waves instead (each CTA a share of the
    tiles: CTAs retire during the call and other streams' CTAs get SMs between them); ``kernel_names``: parts of
    the (mangled) names of its GEMM kernels that a library launches (Python sees no handle of them), so that a
    captured graph's node priorities leave them at the default (``EPBuffer.prioritize``)."""

    max_ctas: bool
    owner_rows: bool
    persistent: bool
    waves: bool = False
    kernel_names: tuple = ()


#: every backend by name (``gemm=`` of the buffers), in the measured table's order
CAPABILITIES = {
    # cutlass::device_kernel<...GemmUniversal...>: the grouped and the one-block-tile kernels
    "cutlass": Capabilities(max_ctas=True, owner_rows=False, persistent=False, waves=True,
                            kernel_names=("cutlass13device_kernel",)),
    # DeepGEMM's SM90 FP8 GEMM kernels (JIT-compiled: sm90_fp8_gemm_1d2d_impl and its kin)
    "deep_gemm": Capabilities(max_ctas=False, owner_rows=False, persistent=False,
                              kernel_names=("fp8_gemm",)),
    "triton": Capabilities(max_ctas=True, owner_rows=True, persistent=True),
}
IMPLS = tuple(CAPABILITIES)
_CLASSES = {"cutlass": ("cutlass", "CutlassExperts"), "deep_gemm": ("deep_gemm", "DeepGemmExperts"),
            "triton": ("triton", "TritonExperts")}


def check_impl(impl: str) -> str:
    """``impl`` if it names a backend, else ValueError listing them."""
    if impl not in CAPABILITIES:
        raise ValueError(f"gemm implementation must be one of {IMPLS}, got {impl!r}")
    return impl


def backend_class(impl: str) -> type:
    """The class of backend ``impl`` (imported on demand)."""
    module, name = _CLASSES[check_impl(impl)]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def make_experts(impl: str, bc, **options):
    """Backend ``impl`` made for the block consumer ``bc`` with its ``options`` (allocates)."""
    return backend_class(impl)(bc, **options)


def refuse_unsupported(impl: str, *, max_ctas=None, out=None, direct=None) -> None:
    """ValueError naming the argument when a ``compute`` call of ``impl`` asks for what it cannot do
    (``out``: L2 into rows other than the consumer's ``y``, which only the owner-rows backends take)."""
    cap = CAPABILITIES[check_impl(impl)]
    if max_ctas is not None and not cap.max_ctas:
        raise ValueError(f"max_ctas must be None for gemm={impl!r} (it sizes its own persistent grid from the "
                         f"device's SM count; a capped grid would change its configuration), got {max_ctas}")
    for arg, value in (("direct", direct), ("out", out)):
        if value is not None and not cap.owner_rows:
            raise ValueError(f"{arg}= (L2 into rows other than the consumer's y: the owners' combine rows) is not "
                             f"implemented for gemm={impl!r} (only for "
                             f"{[k for k, c in CAPABILITIES.items() if c.owner_rows]})")
