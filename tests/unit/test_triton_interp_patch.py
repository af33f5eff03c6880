"""tests/helpers/triton_interp_patch.py: where it answers in place of Triton's interpreter, the answers are
Triton's own (a function it installed is compared with the one it wraps, ``__wrapped__``; where nothing was
installed, as on a GPU, each is compared with itself)."""

from __future__ import annotations

import numpy as np
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
