"""The suite's one GPU skip check (tests/gpu/ and the GPU cases of tests/unit/ use it)::

    from gpu_skip import gpu_skip_reason, needs_gpu

    pytestmark = [pytest.mark.gpu, needs_gpu("nvshmem.core", "cuda.core")]   # a whole module
    @needs_gpu("triton")                                                       # one test

``gpu_skip_reason(*modules)`` is None where torch sees a CUDA GPU and every named module imports, else
why not; ``needs_gpu(*modules, extra=None)`` is the skipif mark with the reason ``GPU test skipped: ...``
(``extra``: a further check, called only where the GPU and the modules are there, returning a reason or
None, e.g. the compute capability a library was built for)."""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import pytest

#: What to install where a module is missing (named in the reason).
INSTALL = {"nvshmem.core": "nvshmem4py-cu13", "cuda.core": "cuda-core"}


@functools.lru_cache(maxsize=None)
def gpu_skip_reason(*modules: str) -> str | None:
    """None where torch sees a CUDA GPU and every module of ``modules`` imports; otherwise why not."""
    try:
        import torch
    except ImportError:
        return "torch is not importable"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001 - any failure to import is a reason to skip
            hint = f"; install {INSTALL[mod]}" if mod in INSTALL else ""
            return f"{mod} is not importable ({exc}){hint}"
    return None


def needs_gpu(*modules: str, extra: Callable[[], str | None] | None = None):
    """The skip mark of a GPU test: skipped, with the reason ``GPU test skipped: ...``, unless
    ``gpu_skip_reason(*modules)`` is None and so is ``extra()`` (called only then)."""
    reason = gpu_skip_reason(*modules)
    if reason is None and extra is not None:
        reason = extra()
    return pytest.mark.skipif(reason is not None, reason=f"GPU test skipped: {reason}")
