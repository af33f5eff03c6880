"""The torch op ``streamring::moe_forward`` on real MPI ranks (``mpiexec -n 2 python tests/helpers/mp_moe_ops.py NAME``),
run by tests/ranks/test_moe_ops.py. Every scenario asserts on every rank; rank 0 ends with ``SCENARIO OK``."""

from __future__ import annotations

import os
import sys
import time

# Two ranks share two cores: inductor's pool of compile workers (started in each rank) costs more than it
# saves. Measured with a cold inductor cache (a fresh machine): op_inductor 29.9 s wall and 38.8 CPU-s in-process
# against 37.8 s and 45.3 CPU-s with the pool; the same with a warm cache.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)  # two ranks share the two cores

from mp_main import run_scenarios  # noqa: E402
from streamring.device.cpu import MpiHeap  # noqa: E402
from streamring.moe import MoEBuffer, MoEShape, MoEWeights, register_layer  # noqa: E402
from streamring.moe.ops import moe_forward  # noqa: E402
from streamring.moe.bitwise import bit_difference  # noqa: E402
from streamring.moe.ops import registered_layers  # noqa: E402

SHAPE = MoEShape(hidden=256, intermediate=128, num_experts=8, topk=2, router="deepseek_v3", n_group=4,
                 topk_group=2, routed_scaling_factor=2.5, weight_dtype="fp8", block_m=8)
OP = "streamring.moe_forward"


def same(a, b, a_name, b_name):
    diff = bit_difference(a, b, a_name, b_name)
    assert diff is None, diff


def expect(exc, fn, needle):
    try:
        fn()
    except exc as e:
        assert needle in str(e), f"message {str(e)!r} lacks {needle!r}"
        return e
    raise AssertionError(f"{fn} did not raise {exc.__name__} ({needle})")


class Block(torch.nn.Module):
    """A model's piece around the layer: the op's input is the block's input, so every backend hands the op
    the same bits and its output can be compared bitwise."""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, x):
        return torch.ops.streamring.moe_forward(x, self.layer_id, False, None, None) + x


def setup(heap):
    w = MoEWeights.random(SHAPE, seed=7)
    buf = MoEBuffer(heap, SHAPE, num_slots=2, tokens_per_slot=8, max_tokens_per_rank=40)
    return w, buf


def tokens(me, n, dtype=torch.float32):
    return torch.randn(n, SHAPE.hidden, generator=torch.Generator().manual_seed(100 + me)).to(dtype)


def op_eager_and_explain(heap):
    me = heap.rank
    w, buf = setup(heap)
    with register_layer(buf, w) as layer:
        assert layer.id in registered_layers() and not layer.closed
        for dtype in (torch.float32, torch.bfloat16):
            x = tokens(me, [13, 29][me], dtype)
            y_op = layer(x)
            y_buf = buf.forward(x, w)
            assert y_op.dtype == dtype and y_op.shape == x.shape
            same(y_op, y_buf.to(dtype), f"op ({dtype})", "buf.forward")
            assert layer.last_routing is not None and layer.last_routing[0].shape == (x.shape[0], SHAPE.topk)
        x = tokens(me, [13, 29][me])
        same(layer(x, streaming=True), buf.forward(x, w), "op streamed", "buf.forward batch")
        # the valid count: an int or a tensor, rows past it zero, the rest as the buffer computes them
        for n in ([0, 29], [5, 0], [13, 17]):
            nt = n[me]
            for arg in (nt, torch.tensor(nt), torch.tensor([nt], dtype=torch.int32)):
                y = layer(x, num_tokens=arg)
                same(y[:nt], buf.forward(x[:nt], w), f"op num_tokens={nt} ({type(arg).__name__})", "buf.forward")
                assert not y[nt:].any(), "rows past num_tokens must be zero"
        # the fake implementation: shape and dtype of x, nothing run (no collective: one rank alone is fine)
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            for dtype in (torch.float32, torch.bfloat16, torch.float64):
                fx = torch.empty(7, SHAPE.hidden, dtype=dtype)
                fy = torch.ops.streamring.moe_forward(fx, layer.id, False, None, torch.tensor(3))
                assert fy.shape == fx.shape and fy.dtype == dtype, (fy.shape, fy.dtype)
        # torch.compile with the eager backend: one graph, no break, the op a node of it, bitwise the same
        block = Block(layer.id)
        ex = torch._dynamo.explain(block)(x)
        ops = [str(op) for g in ex.ops_per_graph for op in g]
        assert ex.graph_count == 1 and ex.graph_break_count == 0 and not ex.break_reasons, ex
        assert sum(OP in o for o in ops) == 1, ops
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="eager", fullgraph=True)
        same(compiled(x), block(x), "compiled (eager backend)", "eager")
        # another token count: recompiled with a dynamic size, still no break (fullgraph) and the same bits
        x2 = tokens(me, [3, 31][me])
        same(compiled(x2), block(x2), "compiled, second token count", "eager")
        # torch.library's own checks of the registration (schema, fake vs real, dispatch under tracing)
        torch.library.opcheck(torch.ops.streamring.moe_forward.default, (x, layer.id, False, None, None),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    # a closed handle: the id is gone and never reused
    assert layer.closed and layer.id not in registered_layers()
    expect(KeyError, lambda: moe_forward(x, layer.id), f"layer id {layer.id} is not registered")
    with register_layer(buf, w) as again:
        assert again.id > layer.id
    buf.close()


def num_tokens_errors(heap):
    """Bad valid counts: every rank raises a ValueError naming num_tokens and the allowed range; the buffer
    keeps working."""
    me = heap.rank
    w, buf = setup(heap)
    x = tokens(me, 12)
    for bad, needle in ((-1, "num_tokens must be in [0, 12]"), (13, "num_tokens must be in [0, 12]"),
                        (torch.tensor(2.0), "num_tokens must be an int or a 0-d/1-element integer tensor"),
                        (torch.tensor([1, 2]), "num_tokens must be an int or a 0-d/1-element integer tensor"),
                        (True, "num_tokens must be an int"), (1.5, "num_tokens must be an int")):
        expect(ValueError, lambda: buf.forward(x, w, num_tokens=bad), needle)
    # a bad count on one rank only: that rank names it, the other says which rank failed
    n = 99 if me == 1 else 4
    e = expect(ValueError, lambda: buf.forward(x, w, num_tokens=n), "num_tokens must be in [0, 12]")
    assert me == 1 or "rank 1" in str(e), e
    # rows past the count may hold anything (not checked, not computed)
    junk = x.clone()
    junk[6:] = float("nan")
    same(buf.forward(junk, w, num_tokens=6, streaming=True)[:6], buf.forward(x[:6], w), "NaN rows ignored", "clean")
    # the capacity bounds the rows of x, whatever the valid count (the contract's rule, the GPU buffer's)
    big = tokens(me, 41)
    expect(ValueError, lambda: buf.forward(big, w, num_tokens=40), "x has 41 tokens, more than max_tokens_per_rank=40")
    expect(ValueError, lambda: buf.forward(big, w, streaming=True), "max_tokens_per_rank=40")
    buf.close()


def op_inductor(heap):
    """The default backend (inductor, C++ codegen), compiled once with dynamic shapes: the op stays one extern
    node and gives the same bits, at each rank's token count and at another. (Dynamic: both ranks generate the
    same code, and it is the engine's case: any token count up to the buffer's maximum.)"""
    me = heap.rank
    w, buf = setup(heap)
    with register_layer(buf, w) as layer:
        block = Block(layer.id)
        x = tokens(me, [13, 29][me])
        t0 = time.monotonic()
        compiled = torch.compile(block, fullgraph=True, dynamic=True)
        y = compiled(x)
        compile_s = time.monotonic() - t0
        same(y, block(x), "compiled (inductor)", "eager")
        same(compiled(x), y, "compiled, second call", "first call")
        # compiled with dynamic shapes: another token count on each rank runs the same compiled graph
        x2 = tokens(me, [29, 13][me])
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        same(compiled(x2), block(x2), "compiled (inductor), other token count", "eager")
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs == 1, \
            dict(torch._dynamo.utils.counters["stats"])  # no recompile
        print(f"INDUCTOR rank {me} first call (compile + run) {compile_s:.1f} s", flush=True)
    buf.close()


SCENARIOS = {f.__name__: f for f in (op_eager_and_explain, num_tokens_errors, op_inductor)}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv[1:2], MpiHeap())
