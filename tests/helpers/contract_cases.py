"""The contract suite of the MoE layer's buffers (:mod:`streamring.moe.contract`): ONE list of cases, run against
both buffers by ``tests/ranks/test_layer_contract.py``:

    mpiexec -n 2 python tests/helpers/contract_cases.py cpu        # MoEBuffer on 2 MPI ranks
    TRITON_INTERPRET=1 python tests/helpers/contract_cases.py emulated   # EPBuffer on the emulated device (1 PE)

Each case asserts on a buffer built with its defaults (but for sizes); the verdicts of every rank are gathered and
rank 0 prints one line per case, ``CASE <name> ok`` or ``CASE <name> FAIL <why>``, then ``CONTRACT DONE``. The test
compares the two backends' lines: a case that passes on one buffer and fails on the other is a contract difference.
Error cases compare the message a buffer raises with one needle for both buffers (the same error for the same
bad input).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

HIDDEN, MAX_TOKENS, ROWS = 128, 40, 24

#: (arguments of one bad forward, what its ValueError must say on either buffer)
BAD = [
    (lambda x, k: dict(x=x.int()), "x must be a bfloat16 (or other float) tensor"),
    (lambda x, k: dict(x=x[:, :64]), f"x must have shape [tokens, hidden={HIDDEN}]"),
    (lambda x, k: dict(x=torch.zeros(MAX_TOKENS + 1, HIDDEN, dtype=x.dtype)),
     f"x has {MAX_TOKENS + 1} tokens, more than max_tokens_per_rank={MAX_TOKENS}"),
    (lambda x, k: dict(x=x, out=torch.zeros(ROWS, HIDDEN, dtype=torch.float64)),
     f"out must be None or a bfloat16 tensor of shape [{ROWS}, {HIDDEN}]"),
    (lambda x, k: dict(x=x, out=torch.zeros(ROWS - 1, HIDDEN, dtype=x.dtype)), "out must be None"),
    (lambda x, k: dict(x=x, num_tokens=ROWS + 1), f"num_tokens must be in [0, {ROWS}]"),
    (lambda x, k: dict(x=x, num_tokens=True), "num_tokens must be"),
    (lambda x, k: dict(x=x, streaming="yes"), "streaming must be True"),
    (lambda x, k: dict(x=x, stream_epoch=9), "stream_epoch is for streaming=True"),
    (lambda x, k: dict(x=x, streaming=True, stream_epoch="9"), "stream_epoch must be None or an int"),
    (lambda x, k: dict(x=x, routing=torch.zeros(ROWS, k, dtype=torch.int64)), "routing must be None or a pair"),
    (lambda x, k: dict(x=x, routing=(torch.zeros(ROWS, k, dtype=torch.int32), torch.ones(ROWS, k))),
     f"routing[0] (topk_idx) must be int64 [{ROWS}, 2]"),
    (lambda x, k: dict(x=x, routing=(torch.full((ROWS, k), 99, dtype=torch.int64), torch.ones(ROWS, k))),
     "routing[0] (topk_idx) values must be expert ids"),
    (lambda x, k: dict(x=x, routing=(torch.zeros(ROWS, k, dtype=torch.int64), torch.full((ROWS, k), float("nan")))),
     "routing[1] (topk_weights) must be finite"),
    (lambda x, k: dict(x=x, weights="w"), "weights must"),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


class Case:
    """The state the cases share: the buffer, one layer's prepared weights, this rank's bf16 tokens and the
    batch output of them."""

    def __init__(self, buf, weights, rank: int):
        self.buf, self.w = buf, buf.prepare_weights(weights)
        dev = torch.device(getattr(buf.heap, "device", "cpu") or "cpu")
        g = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randn(ROWS, HIDDEN, generator=g).to(torch.bfloat16).to(dev)
        self.y = buf.forward(self.x, self.w)

    def implements_the_protocol(self):
        from streamring.moe.contract import MoELayerBuffer

        assert isinstance(self.buf, MoELayerBuffer), type(self.buf).__name__

    def default_deadline(self):
        from streamring.moe.contract import DEFAULT_DEADLINE_S

        assert self.buf.deadline_s == DEFAULT_DEADLINE_S, self.buf.deadline_s

    def sizes(self):
        R = self.buf.heap.num_ranks
        assert self.buf.max_tokens_per_rank == MAX_TOKENS, self.buf.max_tokens_per_rank
        assert len(self.buf.local_experts) == self.buf.shape.num_experts // R, self.buf.local_experts

    def y_in_x_dtype(self):
        for dt in (torch.bfloat16, torch.float32):
            y = self.buf.forward(self.x.to(dt), self.w)
            assert y.dtype == dt and tuple(y.shape) == (ROWS, HIDDEN) and y.device == self.x.device, (dt, y.dtype)

    def streamed_equals_batch(self):
        assert same_bits(self.buf.forward(self.x, self.w, streaming=True), self.y)
        assert same_bits(self.buf.forward(self.x, self.w, streaming=True, stream_epoch=10_000), self.y)

    def out_receives_y(self):
        for streaming in (False, True):
            out = torch.full_like(self.x, 7.0)
            got = self.buf.forward(self.x, self.w, streaming=streaming, out=out)
            assert got is out and same_bits(out, self.y), streaming

    def num_tokens_masks_rows(self):
        n = 10
        for count in (n, torch.tensor(n, device=self.x.device)):
            y = self.buf.forward(self.x, self.w, streaming=True, num_tokens=count)
            assert not y[n:].any(), "rows past num_tokens are not zero"
            idx, wt = self.buf.last_routing
            assert (idx[n:] == -1).all() and not wt[n:].any(), "last_routing past num_tokens"
            assert same_bits(y[:n], self.buf.forward(self.x[:n], self.w)), "rows before num_tokens"

    def routing_given(self):
        self.buf.forward(self.x, self.w)
        idx, wt = (t.clone() for t in self.buf.last_routing)
        assert idx.dtype == torch.int64 and wt.dtype == torch.float32 and idx.shape == (ROWS, self.buf.shape.topk)
        for streaming in (False, True):
            assert same_bits(self.buf.forward(self.x, self.w, streaming=streaming, routing=(idx, wt)), self.y)

    def bad_arguments_name_the_field_and_leave_the_buffer_usable(self):
        k = self.buf.shape.topk
        for make, needle in BAD:
            kw = make(self.x.cpu(), k)
            kw = {n: (v.to(self.x.device) if isinstance(v, torch.Tensor) else
                      tuple(t.to(self.x.device) for t in v) if isinstance(v, tuple) else v) for n, v in kw.items()}
            weights = kw.pop("weights", self.w)
            try:
                self.buf.forward(kw.pop("x"), weights, **kw)
            except ValueError as exc:
                assert needle in str(exc), f"{needle!r} not in {str(exc)!r}"
            else:
                raise AssertionError(f"no ValueError for {needle!r}")
            self.buf.check()
        assert same_bits(self.buf.forward(self.x, self.w, streaming=True), self.y)
        assert same_bits(self.buf.forward(self.x, self.w), self.y)

    def status_and_check(self):
        st = self.buf.status()
        assert {"violations", "timeouts", "first_error"} <= set(st), sorted(st)
        assert st["violations"] == 0 and st["timeouts"] == 0 and st["first_error"] is None, st
        self.buf.check()


CASES = [name for name in vars(Case) if not name.startswith("_")]


def shape(R: int):
    from streamring.moe.math import MoEShape

    return MoEShape(hidden=HIDDEN, intermediate=128, num_experts=4 * R, topk=2, router="deepseek_v3", n_group=2,
                    topk_group=1, routed_scaling_factor=2.5, weight_dtype="fp8", block_m=16)


def build(backend: str):
    """``(heap, buffer)`` of ``backend`` with the contract's defaults (only the sizes given)."""
    if backend == "cpu":
        from streamring.device.cpu import MpiHeap
        from streamring.moe.layer import MoEBuffer

        heap = MpiHeap()
        return heap, MoEBuffer(heap, shape(heap.num_ranks), max_tokens_per_rank=MAX_TOKENS, num_slots=2,
                               tokens_per_slot=16)
    from emulated_device import EmulatedHeap
    from streamring.moe.ep_buffer import EPBuffer
    from streamring.moe.tuning import EPTuning

    heap = EmulatedHeap()
    # the emulated device runs kernels in call order: the serialized policy (every policy's kernels are the GPU
    # check's); the Triton GEMMs, the only ones the interpreter runs
    return heap, EPBuffer(heap, shape(1), max_tokens_per_rank=MAX_TOKENS, num_slots=2, tokens_per_slot=16,
                          gemm="triton", tuning=EPTuning(policy="serialized"))


def main(backend: str) -> int:
    from streamring.moe.weights import MoEWeights

    heap, buf = build(backend)
    gather = getattr(heap, "allgather_obj", lambda v: [v])
    case = Case(buf, MoEWeights.random(buf.shape, seed=3), heap.rank)
    failed = 0
    for name in CASES:
        try:
            getattr(case, name)()
            err = None
        except Exception as exc:  # noqa: BLE001 - every rank's verdict is gathered, then the next case
            err = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            traceback.print_exc()
        verdicts = gather(err)
        bad = [f"rank {r}: {e}" for r, e in enumerate(verdicts) if e]
        failed += bool(bad)
        if heap.rank == 0:
            print(f"CASE {name} " + ("ok" if not bad else "FAIL " + "; ".join(bad)), flush=True)
    buf.close()
    if heap.rank == 0:
        print("CONTRACT DONE", flush=True)
    if hasattr(heap, "close"):
        heap.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main(sys.argv[1]))
