"""tests/helpers/triton_interp_patch.py: where it answers in place of Triton's interpreter, the answers are
Triton's own (a function it installed is compared with the one it wraps, ``__wrapped__``; where nothing was
installed, as on a GPU, each is compared with itself)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as interp


def _with_tritons(name):
    ours = getattr(interp, name)
    return ours, getattr(ours, "__wrapped__", ours)


def test_numpy_dtypes_are_tritons():
    ours, tritons = _with_tritons("_get_np_dtype")
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
               tl.bfloat16, tl.float32, tl.float64, tl.float8e4nv, tl.float8e5, tl.float8e4b8, tl.float8e5b16]
    for t in scalars + [tl.pointer_type(tl.float8e4nv)]:
        for asked in (t, tl.block_type(t, [16, 128]), t):  # (the second scalar ask: a kept answer)
            assert ours(asked) == tritons(asked), asked


def test_float_conversions_are_tritons_bit_for_bit():
    """Every code of the 8- and 16-bit conversions the kernels make (FP8 dot operands to fp16, bf16 to fp32)
    and a few others, in the shapes of the kernels' tiles, strided views and 0-d; one-element fp32 inputs
    (kept once converted: each is converted twice) and fp32 tiles (Triton's code)."""
    ours, tritons = _with_tritons("_convert_float")
    rtne = interp._ir.ROUNDING_MODE.RTNE
    rng = np.random.default_rng(0)
    cases = [(tl.float8e4nv, tl.float16, None), (tl.float8e5, tl.float16, None), (tl.float8e4b8, tl.float32, None),
             (tl.bfloat16, tl.float32, None), (tl.float16, tl.float8e4nv, rtne), (tl.float32, tl.bfloat16, None)]
    for src, dst, rounding in cases:
        bits = src.primitive_bitwidth
        every = np.arange(1 << min(bits, 16), dtype=f"uint{bits}")
        tile = rng.integers(0, 1 << min(bits, 16), size=(16, 128)).astype(f"uint{bits}")
        for x in (every, tile, tile.T, tile[3, 5], tile[3:4, 5], tile[3:4, 5:6]):
            x = x.view(np.float16 if src == tl.float16 else np.float32 if bits == 32 else x.dtype)
            b = tritons(x, src, dst, rounding)
            for a in (ours(x, src, dst, rounding), ours(x, src, dst, rounding)):
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (src, dst, x.shape)


def test_block_shapes_are_tritons():
    """Block types and tensors of the kernels' shapes, and the errors of shapes Triton refuses (a dimension not
    a power of two, a builtin tuple, no dimension), from the installed constructors and from Triton's."""
    from triton_interp_patch import _same_shapes

    core = tl.core
    block_init, tensor_init = core.block_type.__init__, core.tensor.__init__
    shapes = ([1], [16], [128], [16, 128], [128, 128], [64, 1], [2, 1, 4], [3], [16, 24], (16, 128), [])
    assert _same_shapes(core, getattr(block_init, "__wrapped__", block_init),
                        getattr(tensor_init, "__wrapped__", tensor_init), shapes)


def test_builtin_wrappers_call_the_builtin_as_tritons_do():
    """The wrapper ``_patch_attr`` installs passes the arguments on and the interpreter's semantic object in place
    of a caller's ``_semantic``, as Triton's wrapper does."""
    ours, tritons = _with_tritons("_patch_attr")
    calls = []

    class Holder:
        pass

    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    def builtin(*args, **kwargs):
        calls.append((args, kwargs))
        return len(calls)

    for patch_attr in (ours, tritons):
        patch_attr(Holder, "op", builtin, None, Scope())
        assert Holder.op(1, 2, k=3, _semantic="the caller's") == len(calls)
        assert Holder.op(4) == len(calls)
    assert calls[:2] == calls[2:] == [((1, 2), {"k": 3, "_semantic": interp.interpreter_semantic}),
                                      ((4,), {"_semantic": interp.interpreter_semantic})]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels are compiled here: no interpreter")
def test_launches_wrap_the_builtins_tritons_walk_wraps(monkeypatch):
    """Every attribute each launch wraps (and what it held), for a kernel whose device functions wrap more
    (``tl.sum``, ``tl.cumsum``: triton.language.standard, whose wrapping of ``tl.core`` Triton never undoes, so
    a first launch in a process wraps more than later ones: one comes first), launched twice: the same with
    the kept builtin lists as with Triton's walk of every package at every launch."""
    ours, tritons = _with_tritons("_patch_builtin")
    sets = []
    real_set_attr = interp._LangPatchScope.set_attr

    def set_attr(self, obj, name, value):
        sets[-1].append((getattr(obj, "__name__", repr(obj)), name, type(getattr(obj, name, None)).__name__))
        return real_set_attr(self, obj, name, value)

    monkeypatch.setattr(interp._LangPatchScope, "set_attr", set_attr)
    x = torch.arange(64, dtype=torch.int32)
    for patch_builtin in (tritons, tritons, ours, tritons):
        monkeypatch.setattr(interp, "_patch_builtin", patch_builtin)
        sets.append([])
        for _ in range(2):
            out = torch.zeros(2, dtype=torch.int32)
            _sums[(1,)](x, out, N=64)
            assert out.tolist() == [2016, 2016]
    assert sets[1] and sets[1] == sets[2] == sets[3]


@triton.jit
def _sums(x_ptr, out_ptr, N: tl.constexpr):
    v = tl.load(x_ptr + tl.arange(0, N))
    tl.store(out_ptr, tl.sum(v, axis=0))
    tl.store(out_ptr + 1, tl.max(tl.cumsum(v, axis=0), axis=0))
