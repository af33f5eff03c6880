"""MoE-layer scenarios run on several real MPI ranks by tests/ranks/test_scenarios.py (``mpiexec -n N python this.py
NAME[,NAME...]``: the named scenarios one after the other in one job).

Each scenario asserts on every rank and prints ``SCENARIO OK`` on rank 0; any
failure raises, which aborts the job with a non-zero exit code.
"""

import sys

import torch

from mp_main import run_scenarios
from single_process import batch_forward_single
from streamring.device.cpu import MpiHeap
from streamring.moe.bitwise import bit_difference
from streamring.moe import debug as moe_debug
from streamring.moe.layer import MoEBuffer
from streamring.moe.math import MoEShape
from streamring.moe.weights import MoEWeights
from streamring.moe.tuning import MoETuning
from streamring.ring.protocol import ProtocolViolation, WatchdogError


def expect(exc, fn, needle):
    try:
        fn()
    except exc as e:
        assert needle in str(e), f"message {str(e)!r} lacks {needle!r}"
        return e
    raise AssertionError(f"{fn} did not raise {exc.__name__} ({needle})")


def same(a, b, a_name, b_name):
    """Bitwise (bytes, so -0.0 != +0.0); the failure names the first differing element and its bits."""
    diff = bit_difference(a, b, a_name, b_name)
    assert diff is None, diff


def moe_api(heap):
    """The library API an engine calls: caller weights, repeated epochs, local-only weights, bad inputs."""
    R, me = heap.num_ranks, heap.rank
    shape = MoEShape(hidden=256, intermediate=128, num_experts=4 * R, topk=2, block_m=8)
    w = MoEWeights.random(shape, seed=3)
    buf = MoEBuffer(heap, shape, num_slots=2, tokens_per_slot=8, max_tokens_per_rank=40)
    res = MoEBuffer(heap, shape, num_slots=2, tokens_per_slot=8, max_tokens_per_rank=40,
                    tuning=MoETuning(scheduler="reservation", block_m=3))
    tokens = [0, 1, 37, 40][me % 4]
    for ep in range(3):
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(100 * ep + me))
        y_b = buf.forward(x, w)
        y_s = buf.forward(x, w, streaming=True)
        y_r = res.forward(x, w, streaming=True)
        same(y_s, y_b, f"epoch {ep} streamed", "batch")
        same(y_r, y_b, f"epoch {ep} streamed (reservation)", "batch")
        if tokens:
            same(y_b, batch_forward_single(x, w, shape), f"epoch {ep} batch", "single-process batch")
        else:
            assert y_b.shape == (0, 256)
    # explicit epochs must grow
    last = buf.stream_ring.last_epoch
    expect(ValueError, lambda: buf.forward(x, w, streaming=True, stream_epoch=last), "stream_epoch")
    y_e = buf.forward(x, w, streaming=True, stream_epoch=last + 10)
    same(y_e, y_b, "streamed (explicit epoch)", "batch")
    # local-only expert weights give the same result
    lo = buf.local_experts
    wl = MoEWeights(router_weight=w.router_weight, correction_bias=None, w1=w.w1[lo.start:lo.stop],
                    w3=w.w3[lo.start:lo.stop], w2=w.w2[lo.start:lo.stop])
    same(buf.forward(x, wl, streaming=True), y_b, "streamed (local-only weights)", "batch")
    # bad input on ONE rank: that rank gets the real message, every other rank a clean error; no hang
    bad_x = x.clone()
    if me == R - 1:
        bad_x = torch.full((3, 256), float("nan"))
    e = expect(ValueError, lambda: buf.forward(bad_x, w, streaming=True), "NaN/Inf")
    assert (f"rank {R - 1}" in str(e)) or me == R - 1
    if me == 0:
        expect(ValueError, lambda: buf.forward(torch.zeros(2, 100), w), "x must have shape [tokens, hidden=256]")
    else:
        expect(ValueError, lambda: buf.forward(x, w), "rank 0: x must have shape")
    expect(ValueError, lambda: buf.forward(x.to(torch.int32), w), "x must be a bfloat16 (or other float) tensor")
    expect(ValueError, lambda: buf.forward(torch.zeros(41, 256), w), "max_tokens_per_rank=40")
    expect(ValueError, lambda: MoETuning(scheduler="fifo"), "scheduler")
    wbad = MoEWeights(router_weight=w.router_weight, correction_bias=None, w1=w.w1[:, :, :128], w3=w.w3, w2=w.w2)
    expect(ValueError, lambda: buf.forward(x, wbad), "w1")
    # the buffers still work after all those errors (recovery)
    same(buf.forward(x, w, streaming=True), y_b, "streamed (after the errors)", "batch")
    # a shape that does not fit the ranks is refused at construction
    expect(ValueError, lambda: MoEBuffer(heap, MoEShape(hidden=256, intermediate=128, num_experts=4 * R + 1, topk=2),
                                         num_slots=2, tokens_per_slot=8, max_tokens_per_rank=4), "num_experts")
    buf.close()
    res.close()


def recovery_after_watchdog(heap):
    """A forward call that dies on the watchdog leaves the buffer unusable (clear error); rebuilding works."""
    R, me = heap.num_ranks, heap.rank
    shape = MoEShape(hidden=128, intermediate=128, num_experts=2 * R, topk=2, block_m=4)
    w = MoEWeights.random(shape, seed=5)
    x = torch.randn(10, 128, generator=torch.Generator().manual_seed(me))
    buf = MoEBuffer(heap, shape, num_slots=2, tokens_per_slot=4, max_tokens_per_rank=10, deadline_s=30.0)
    good = buf.forward(x, w, streaming=True)
    buf.stream_ring.wait_timeout_s = 1.0  # short deadline only for the stalled call

    if me == 1:  # rank 1's producers start past every deadline (the fault itself), inside the stream
        moe_debug.set_producer_delay(buf, int(2.5e9))
    try:
        buf.forward(x, w, streaming=True)
    except (WatchdogError, TimeoutError, ProtocolViolation) as exc:
        err = exc
    else:
        raise AssertionError("the stalled forward did not fail")
    assert buf.broken and type(err).__name__ in buf.broken
    expect(RuntimeError, lambda: buf.forward(x, w, streaming=True), "close() it and build a new MoEBuffer")
    heap.barrier()  # every rank has failed before the buffers go
    buf.close()
    buf2 = MoEBuffer(heap, shape, num_slots=2, tokens_per_slot=4, max_tokens_per_rank=10, deadline_s=10.0)
    same(buf2.forward(x, w, streaming=True), good, "rebuilt buffer, streamed", "before the failure")
    same(buf2.forward(x, w), good, "rebuilt buffer, batch", "before the failure")
    buf2.close()


def bad_arguments_leave_the_buffer_usable(heap):
    """Every argument family of ``forward`` refused before anything is published: each bad call (on every
    rank, or on one rank only) raises a ValueError naming the argument on every rank, and then a streamed
    and a batch call on the same buffer give the same bits as a fresh buffer's. An expert id out of range
    in a given routing is one of them (it used to be found inside the stream, breaking the buffer)."""
    R, me = heap.num_ranks, heap.rank
    shape = MoEShape(hidden=128, intermediate=128, num_experts=4 * R, topk=2, block_m=4)
    w = MoEWeights.random(shape, seed=7)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(me))
    E = shape.num_experts
    fresh = MoEBuffer(heap, shape, num_slots=2, tokens_per_slot=8, max_tokens_per_rank=32)
    want_s, want_b = fresh.forward(x, w, streaming=True), fresh.forward(x, w)
    fresh.close()
    buf = MoEBuffer(heap, shape, num_slots=2, tokens_per_slot=8, max_tokens_per_rank=32)
    idx = (torch.arange(40).view(20, 2) + me) % E
    wt = torch.full((20, 2), 0.5)
    far, nan_w = idx.clone(), wt.clone()
    far[3, 1], nan_w[5, 0] = 99, float("nan")
    one_rank_far = far if me == R - 1 else idx
    cases = [  # (what, call, the argument named in every rank's message)
        ("routing id 99 (a pair)", lambda: buf.forward(x, w, streaming=True, routing=(far, wt)), "topk_idx"),
        ("routing a function", lambda: buf.forward(x, w, streaming=True, routing=lambda xc, t: (idx[t], wt[t])),
         "routing must be None or a pair"),
        ("routing id 99 on one rank", lambda: buf.forward(x, w, routing=(one_rank_far, wt)), "topk_idx"),
        ("routing NaN weight", lambda: buf.forward(x, w, streaming=True, routing=(idx, nan_w)), "topk_weights"),
        ("routing shape", lambda: buf.forward(x, w, routing=(idx[:, :1], wt)), "topk_idx"),
        ("routing not a pair", lambda: buf.forward(x, w, routing=idx), "routing must be"),
        ("x dtype", lambda: buf.forward(x.to(torch.int32), w), "x must be"),
        ("x shape", lambda: buf.forward(x[:, :64], w, streaming=True), "x must have shape"),
        ("x NaN", lambda: buf.forward(torch.full_like(x, float("nan")), w, streaming=True), "NaN/Inf"),
        ("x over the batch capacity", lambda: buf.forward(torch.zeros(33, 128), w), "max_tokens_per_rank=32"),
        ("num_tokens too large", lambda: buf.forward(x, w, streaming=True, num_tokens=21), "num_tokens"),
        ("num_tokens a float tensor", lambda: buf.forward(x, w, num_tokens=torch.tensor(3.0)), "num_tokens"),
        ("num_tokens a bool", lambda: buf.forward(x, w, num_tokens=True), "num_tokens"),
        ("streaming not a bool", lambda: buf.forward(x, w, streaming="yes"), "streaming must be True or False"),
        ("stream_epoch not growing", lambda: buf.forward(x, w, streaming=True, stream_epoch=0), "stream_epoch"),
        ("stream_epoch not an int", lambda: buf.forward(x, w, streaming=True, stream_epoch="7"), "stream_epoch"),
        ("stream_epoch on the batch path", lambda: buf.forward(x, w, stream_epoch=9), "stream_epoch"),
        ("out dtype", lambda: buf.forward(x, w, out=torch.zeros(20, 128, dtype=torch.float64)), "out must be"),
        ("out shape", lambda: buf.forward(x, w, streaming=True, out=torch.zeros(19, 128)), "out must be"),
    ]
    for what, call, needle in cases:
        e = expect(ValueError, call, needle)
        assert not buf.broken, (what, buf.broken)
        same(buf.forward(x, w, streaming=True), want_s, f"streamed after a bad {what}", "a fresh buffer's")
        same(buf.forward(x, w), want_b, f"batch after a bad {what}", "a fresh buffer's")
        if what.endswith("on one rank") and me != R - 1:
            assert f"rank {R - 1}" in str(e), (what, str(e))
    # the caller's routing is taken when it is good; ``out`` receives the same bits
    y_pair = buf.forward(x, w, streaming=True, routing=(idx, wt))
    same(buf.forward(x, w, routing=(idx, wt)), y_pair, "batch, routing pair", "streamed")
    out = torch.full_like(x, 7.0)
    assert buf.forward(x, w, streaming=True, out=out) is out
    same(out, want_s, "streamed into out", "a fresh buffer's")
    buf.close()


def collective_verdict(heap, err, what):
    """Every rank's error of one step together: all ranks raise the same AssertionError or none does,
    so the ranks' next collective calls stay matched (a failure on one rank alone would desync them)."""
    bad = [(r, e) for r, e in enumerate(heap.allgather_obj(err)) if e]
    if bad:
        raise AssertionError(f"{what}: " + "; ".join(f"rank {r}: {e}" for r, e in bad))


def fuzz_forward(heap):
    """Random shapes, token counts, top-k, magnitudes, NaN/Inf, on every rank (same examples everywhere)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    R, me = heap.num_ranks, heap.rank

    # No shrinking: hypothesis bounds the shrink phase by wall time, so ranks could stop shrinking at
    # different examples and their collectives would go out of step; the first failing example is
    # reported as it is. Every example's verdict is collective (collective_verdict), so every rank sees
    # the same outcomes and draws the same next example.
    @settings(max_examples=int(sys.argv[3]) if len(sys.argv) > 3 else 12, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), database=None,
              phases=(Phase.explicit, Phase.reuse, Phase.generate))
    @given(hidden=st.sampled_from([128, 256]), per_rank_experts=st.integers(1, 3), topk_frac=st.floats(0, 1),
           tokens=st.lists(st.integers(0, 30), min_size=R, max_size=R), slots=st.integers(1, 3),
           tps=st.integers(1, 9), router=st.sampled_from(["softmax_topk", "deepseek_v3"]),
           wdt=st.sampled_from(["bf16", "fp8"]), scheduler=st.sampled_from(["chunk_local", "reservation"]),
           block_m=st.integers(1, 17), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e12]),
           poison=st.sampled_from([None, "nan", "inf"]), poison_rank=st.integers(0, R - 1),
           xdtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    def check(hidden, per_rank_experts, topk_frac, tokens, slots, tps, router, wdt, scheduler, block_m, scale,
              poison, poison_rank, xdtype):
        example = (hidden, per_rank_experts, topk_frac, tokens, slots, tps, router, wdt, scheduler, block_m, scale,
                   poison, poison_rank, str(xdtype))
        drawn = heap.allgather_obj(repr(example))
        if len(set(drawn)) != 1:
            raise AssertionError(f"the ranks drew different examples (out of step): {drawn}")
        err, buf = None, None
        try:
            E = per_rank_experts * R
            topk = max(1, round(topk_frac * E))
            kw = dict(n_group=1, topk_group=1) if router == "softmax_topk" else dict(n_group=R, topk_group=R,
                                                                                       routed_scaling_factor=1.5)
            shape = MoEShape(hidden=hidden, intermediate=128, num_experts=E, topk=topk, router=router,
                             weight_dtype=wdt, block_m=block_m, **kw)
            w = MoEWeights.random(shape, seed=hidden + E)
            buf = MoEBuffer(heap, shape, num_slots=slots, tokens_per_slot=tps,
                            max_tokens_per_rank=max(max(tokens), 1), deadline_s=30,
                            tuning=MoETuning(scheduler=scheduler))
            g = torch.Generator().manual_seed(me * 1000 + tokens[me])
            x = (torch.randn(tokens[me], hidden, generator=g, dtype=torch.float64) * scale).to(xdtype)
            if poison and tokens[poison_rank]:
                bad = x.clone()
                if me == poison_rank:
                    bad[tokens[me] // 2, 3] = float(poison)
                expect(ValueError, lambda: buf.forward(bad, w, streaming=True), "NaN/Inf")
            y_b = buf.forward(x, w)
            y_s = buf.forward(x, w, streaming=True)
            same(y_s, y_b, f"streamed ({scheduler})", "batch")
            if tokens[me] and scale <= 1e3:
                assert y_b.dtype == x.dtype, (y_b.dtype, x.dtype)
                same(y_b, batch_forward_single(x, w, shape).to(x.dtype), "distributed batch", "single-process batch")
        except Exception as exc:  # noqa: BLE001 - reported collectively below
            err = f"{type(exc).__name__}: {exc}"
        finally:
            if buf is not None:
                buf.close()  # collective; also after a failed forward (a leaked buffer is a leaked window)
        collective_verdict(heap, err, f"example {example}")

    check()


def alloc_size_check(heap):
    """A region the node cannot hold is refused on every rank before anything is taken; the heap stays usable.
    And the CLI's byte count of `streamring run` equals what MoEBuffer allocates."""
    from streamring.config import load_config
    from streamring.device.memcheck import HeapSizeError
    from streamring.runner import run_heap_bytes, shape_from_config

    e = expect(HeapSizeError, lambda: heap.alloc("too-big", 1 << 50), " per rank x ")
    assert ", but " in str(e) and ("/dev/shm" in str(e) or "MemAvailable" in str(e)), e
    assert heap.allgather_obj(str(e)) == [str(e)] * heap.num_ranks  # the same error everywhere
    small = heap.alloc("after", 64)
    heap.barrier()
    heap.free(small)
    cfg = load_config(None, ["run.tokens_per_rank=[3, 50]", "ring.num_slots=3", "ring.tokens_per_slot=7",
                             "layer.topk=3"])
    before = {id(r) for r in heap._regions}
    buf = MoEBuffer(heap, shape_from_config(cfg), num_slots=3, tokens_per_slot=7, max_tokens_per_rank=50)
    got = sum(r.nbytes for r in heap._regions if id(r) not in before)
    assert got == run_heap_bytes(cfg, heap.num_ranks), (got, run_heap_bytes(cfg, heap.num_ranks))
    buf.close()


def bitwise_oracle(heap):
    """Fixed inputs, top-k >= 3: the batch path, the streamed path with each scheduler and the
    single-process batch (single_process.batch_forward_single) give the same bytes on every rank.

    With three or more terms the combine's order shows in the bits ((a + b) + c is not (c + b) + a),
    so this catches a combiner that sums the top-k contributions in another order than the reference;
    bytes, not torch.equal, so a -0.0 for a +0.0 shows too.
    """
    R, me = heap.num_ranks, heap.rank
    cases = [  # name, MoEShape fields
        ("softmax-bf16-top3", dict(num_experts=2 * R, topk=3)),
        ("deepseek-fp8-top5", dict(num_experts=3 * R, topk=5, router="deepseek_v3", n_group=R, topk_group=2,
                                   routed_scaling_factor=2.5, weight_dtype="fp8")),
        ("softmax-bf16-every-expert", dict(num_experts=2 * R, topk=2 * R)),
    ]
    counts = [0, 11, 26, 5]
    failures = []
    for n, (name, kw) in enumerate(cases):
        shape = MoEShape(hidden=256, intermediate=128, block_m=8, **kw)
        w = MoEWeights.random(shape, seed=11 + n)
        tokens = counts[(me + n) % len(counts)]  # uneven; a rank without tokens; partial chunks
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(1000 * n + me))
        buf = MoEBuffer(heap, shape, num_slots=2, tokens_per_slot=4, max_tokens_per_rank=max(counts))
        res = MoEBuffer(heap, shape, num_slots=2, tokens_per_slot=4, max_tokens_per_rank=max(counts),
                        tuning=MoETuning(scheduler="reservation", block_m=3))
        try:
            outs = {"batch": buf.forward(x, w),
                    "streamed (chunk_local)": buf.forward(x, w, streaming=True),
                    "streamed (reservation)": res.forward(x, w, streaming=True)}
        finally:
            buf.close()
            res.close()
        ref = batch_forward_single(x, w, shape) if tokens else torch.zeros(0, 256)
        for path, y in outs.items():
            diff = bit_difference(y, ref, path, "single-process batch")
            if diff:
                failures.append(f"rank {me}, {name} ({tokens} tokens): {diff}")
    every = [f for fs in heap.allgather_obj(failures) for f in fs]
    assert not every, (f"{len(every)} outputs differ from the single-process batch, first: {every[0] if every else ''}"
                       "\n  " + "\n  ".join(every))


SCENARIOS = {f.__name__: f for f in (moe_api, recovery_after_watchdog, bad_arguments_leave_the_buffer_usable,
                                     fuzz_forward, alloc_size_check, bitwise_oracle)}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv[1].split(","), MpiHeap(window=sys.argv[2] if len(sys.argv) > 2 else "auto"))
