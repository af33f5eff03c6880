"""The expert-parallel GPU layer (EPBuffer) on one PE: needs a CUDA GPU and nvshmem4py (skips otherwise).

Several PEs run it through ``streamring run --backend nvshmem`` under ``mpiexec`` on the GPU machine
(``launch/gpu_check.sh``, phase ``gpus``: one PE per GPU); here one PE checks, for every progress
policy and both transports, that the streamed forward equals the batch forward bitwise, that both
equal the single-process block path (``blocks.batch_forward``) bitwise, that the ring reports no
error, that a captured graph replays with new inputs and with any token count from a device word.
"""

from __future__ import annotations

import re

import pytest
import torch
from ep_case import ep_env  # noqa: F401 - the module-scoped fixture `env`
from ep_case import bits, random_x, single_batch
from gpu_skip import needs_gpu


pytestmark = [pytest.mark.gpu, needs_gpu("nvshmem.core", "cuda.core", "triton")]


def _buffer(heap, shape, *, policy="spin_kernel", transport="p2p", order="rank", gemm="triton", max_tokens=157,
            tokens_per_slot=40, **kw):
    """A buffer of 4 chunks of 40 tokens: 2 slots (wrapping), 4 for arrival order (a slot per chunk)."""
    from streamring.moe.ep_buffer import EPBuffer
    from streamring.moe.tuning import EPTuning

    deadline = {"deadline_s": kw.pop("deadline_s")} if "deadline_s" in kw else {}
    tuning = EPTuning(block_m=16, policy=policy, transport=transport, source_order=order, **kw)
    slots = 4 if order == "arrival" else 2
    return EPBuffer(heap, shape, max_tokens_per_rank=max_tokens, num_slots=slots, tokens_per_slot=tokens_per_slot,
                    gemm=gemm, tuning=tuning, **deadline)


@pytest.mark.parametrize("policy,transport,order", [
    # the first case JIT-compiles the layer's Triton kernels for the module (about 45 s on the H200)
    pytest.param("serialized", "p2p", "rank", marks=pytest.mark.slow(
        reason="the module's first EP forward compiles every Triton kernel of the layer (about 45 s on the H200)")),
    ("spin_kernel", "p2p", "rank"), ("stream_wait", "p2p", "rank"),
    ("green_ctx", "p2p", "rank"), ("spin_kernel", "nv", "rank"), ("serialized", "nv", "rank"),
    ("spin_kernel", "p2p", "ready"), ("spin_kernel", "nv", "ready"), ("spin_kernel", "p2p", "arrival"),
    ("serialized", "p2p", "arrival"), ("spin_kernel", "nv", "arrival")])
def test_streamed_equals_batch_equals_single_process(env, policy, transport, order):
    heap, shape, mw = env
    T = 157
    x0 = random_x(shape, T, 1, heap.device)
    ref = single_batch(shape, mw, x0)
    # the Triton GEMMs: the single-process block path runs them too (bitwise comparable)
    buf = _buffer(heap, shape, policy=policy, transport=transport, order=order)
    try:
        w = buf.prepare_weights(mw)
        for streaming in (False, True):
            x = x0.clone()  # the graph's input buffer (its replays below overwrite it)
            y = torch.full_like(x, float("nan"))
            buf.forward(x, w, streaming=streaming, out=y)
            assert torch.equal(bits(y), bits(ref)), \
                f"streaming={streaming} ({policy}, {transport}, {order}) eager != single-process batch; {buf.status()}"
            g = buf.capture(x, w, y, streaming=streaming)
            for seed in (2, 3):  # new inputs through the same graph: new ring epochs
                x2 = random_x(shape, T, seed, heap.device)
                x.copy_(x2)
                y.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(bits(y), bits(single_batch(shape, mw, x2))), \
                    f"streaming={streaming} replay, seed {seed}; status {buf.status()}"
        st = buf.status()
        assert not (st["violations"] or st["timeouts"] or st["bad_routes"]), f"{st}"
        assert buf.transport == transport
    finally:
        buf.close()


def test_one_capture_serves_every_token_count(env):
    """One captured forward per path, replayed with counts 0, 1, 77 and the maximum from a device word:
    each equals the single-process batch of just those rows, bitwise, and the rows past the count are 0."""
    heap, shape, mw = env
    T = 157
    buf = _buffer(heap, shape)
    try:
        w = buf.prepare_weights(mw)
        x = random_x(shape, T, 6, heap.device)
        n_dev = torch.tensor([T], dtype=torch.int64, device=heap.device)
        for streaming in (False, True):
            y = torch.zeros_like(x)
            buf.forward(x, w, streaming=streaming, num_tokens=n_dev, out=y)
            g = buf.capture(x, w, y, streaming=streaming, num_tokens=n_dev)
            for n in (0, 1, 77, T, 5):
                n_dev.fill_(n)
                y.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                if n:
                    assert torch.equal(bits(y[:n]), bits(single_batch(shape, mw, x[:n]))), (streaming, n)
                assert not y[n:].any(), (streaming, n)
        st = buf.status()
        assert not (st["violations"] or st["timeouts"] or st["bad_routes"] or st["bad_counts"]), f"{st}"
    finally:
        buf.close()


def test_a_missing_arrival_is_reported_not_hung(env):
    """Negative control: an owner expecting one row more than can arrive times out with
    RE_COMBINE_TIMEOUT in the status instead of hanging or reading a partial chunk silently, and
    the buffer then refuses to run until rebuilt."""
    heap, shape, mw = env
    T = 33
    x = random_x(shape, T, 4, heap.device)
    buf = _buffer(heap, shape, deadline_s=0.5)
    try:
        w = buf.prepare_weights(mw)
        buf.forward(x, w)
        producer = buf.pipeline.producer
        real = producer.produce  # the test breaks the owner's expectation on purpose

        def one_more(path, layer, x, c, routing, stream, instrument):
            real(path, layer, x, c, routing, stream, instrument)
            producer.expected[c].add_(1)  # on the producer's stream, after the chunk's own count

        producer.produce = one_more
        buf.forward(x, w)
        torch.cuda.synchronize()
        st = buf.status()
        assert st["timeouts"] >= 1 and st["first_error"]["what"] == "combine arrival timeout", f"{st}"
        with pytest.raises(RuntimeError, match="ring errors"):
            buf.check()
        with pytest.raises(RuntimeError, match="unusable"):
            buf.forward(x, w)
    finally:
        buf.close()


@pytest.mark.parametrize("policy,order,grids", [
    ("spin_kernel", "rank", "capped"), ("spin_kernel", "ready", "capped"), ("serialized", "rank", "capped"),
    ("spin_kernel", "ready", "behind"), ("spin_kernel", "ready", "beside"), ("spin_kernel", "ready", "by_expert"),
    ("spin_kernel", "rank", "by_expert")])
def test_cutlass_gemms_keep_streamed_equal_to_batch(env, policy, order, grids):
    """gemm='cutlass' (CUTLASS FP8 blockwise grouped GEMMs, L2 through a local y and puts): the streamed
    output equals its batch output bitwise, and both are close to the Triton path (rounding only).
    ``grids``: ``capped`` at 157 rows (the decode rule caps the streamed grids), ``behind`` and ``beside`` at 320
    rows (every call but the seal's on the backend's own persistent grid): the default, each dispatch step behind
    the previous call, and EPTuning(dispatch_beside_grid=True), the dispatch beside it; ``by_expert`` as
    ``behind`` with EPTuning(seal_by_expert=True) (the seal's call laid out expert by expert: grouped ready steps
    seal on the device, the rank order in a call of its own)."""
    from streamring.moe.ep_buffer import cutlass_unavailable_reason

    why = cutlass_unavailable_reason()
    if why:
        pytest.skip(f"the CUTLASS library is not available here: {why}")
    heap, shape, mw = env
    T = 157 if grids == "capped" else 320
    x = random_x(shape, T, 5, heap.device)
    ref = single_batch(shape, mw, x)
    outs = {}
    sizes = {} if grids == "capped" else dict(max_tokens=T, tokens_per_slot=80, dispatch_beside_grid=grids == "beside",
                                              seal_by_expert=grids == "by_expert")
    buf = _buffer(heap, shape, policy=policy, order=order, gemm="cutlass", **sizes)
    try:
        if grids != "capped":
            assert buf.pipeline.experts.holds_every_sm(buf.paths["stream"], 0, T), "the case must run full grids"
            assert bool(buf.pipeline._called) == (grids != "beside"), "the case must run its enqueue"
        w = buf.prepare_weights(mw)
        for streaming in (False, True):
            xb = x.clone()
            y = torch.full_like(x, float("nan"))
            buf.forward(xb, w, streaming=streaming, out=y)
            g = buf.capture(xb, w, y, streaming=streaming)
            y.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            outs[streaming] = y.clone()
        st = buf.status()
        assert not (st["violations"] or st["timeouts"] or st["bad_routes"]), f"{st}"
        assert torch.equal(bits(outs[True]), bits(outs[False])), "CUTLASS streamed != CUTLASS batch"
        rel = float((outs[False].float() - ref.float()).norm() / ref.float().norm())
        assert rel < 0.02, f"CUTLASS path {rel:.4f} (relative) away from the Triton path"
    finally:
        buf.close()


@pytest.mark.parametrize("policy,order", [("spin_kernel", "rank"), ("spin_kernel", "ready"), ("serialized", "rank"),
                                          ("stream_wait", "rank"), ("spin_kernel", "arrival")])
def test_persistent_consumer_equals_single_process(env, policy, order):
    """consumer='persistent': ONE persistent expert kernel per forward, launched before any block is ready
    (streamed, multi-stream policies) with SMs left to the producer and dispatch, fed by the ready queue;
    captured, replayed with new inputs: bitwise the single-process block path, no ring error."""
    heap, shape, mw = env
    T = 157
    buf = _buffer(heap, shape, policy=policy, order=order, consumer="persistent", reserved_sms=16)
    try:
        w = buf.prepare_weights(mw)
        for streaming in (False, True):
            x = random_x(shape, T, 1, heap.device)
            y = torch.full_like(x, float("nan"))
            buf.forward(x, w, streaming=streaming, out=y)
            assert torch.equal(bits(y), bits(single_batch(shape, mw, x))), (streaming, buf.status())
            g = buf.capture(x, w, y, streaming=streaming)
            for seed in (2, 3):
                x2 = random_x(shape, T, seed, heap.device)
                x.copy_(x2)
                y.fill_(float("nan"))
                buf.replay(g)
                assert torch.equal(bits(y), bits(single_batch(shape, mw, x2))), (streaming, seed, buf.status())
    finally:
        buf.close()


def _next_input(y: torch.Tensor) -> torch.Tensor:
    """What the caller computes from one layer's output for the next (a stand-in for a decoder layer)."""
    return torch.tanh(y.float()).to(torch.bfloat16)


@pytest.mark.parametrize("gemm,order", [("triton", "ready"), ("triton", "rank"), ("cutlass", "ready")])
def test_a_consumer_launched_ahead_keeps_every_output(env, gemm, order):
    """Two layers, the second one's consumer side launched right after the first forward, ahead of the caller's
    work that makes its input (a 2 ms sleep, then the next input computed on the caller's stream): eager, and in
    one captured graph holding both layers (as a whole-model graph does, node priorities set) replayed with new
    inputs; also through the torch op (``launch_next``), and a launch cancelled by another layer's forward.
    Every output equals the buffer's batch path bitwise (Triton: also the single-process block path); the ring
    reports no error."""
    from streamring.moe.weights import MoEWeights
    from streamring.moe import register_layer
    from streamring.moe.ep_buffer import cutlass_unavailable_reason
    from streamring.moe.ops import moe_forward

    if gemm == "cutlass" and cutlass_unavailable_reason():
        pytest.skip(f"the CUTLASS library is not available here: {cutlass_unavailable_reason()}")
    heap, shape, mw = env
    mw2 = MoEWeights.random_fp8(shape, 19, heap.device)
    T = 157
    buf = _buffer(heap, shape, order=order, gemm=gemm)
    try:
        w0, w1 = buf.prepare_weights(mw), buf.prepare_weights(mw2)

        def reference(x):  # the batch path of the same buffer (its GEMMs), layer after layer
            y0 = buf.forward(x, w0)
            return y0, buf.forward(_next_input(y0), w1)

        def two_layers(x, y0, y1):
            buf.forward(x, w0, streaming=True, out=y0)
            buf.launch_consumer(w1, T)
            torch.cuda._sleep(2_000_000)  # the caller's own work before the next layer
            buf.forward(_next_input(y0), w1, streaming=True, out=y1)

        x = random_x(shape, T, 1, heap.device)
        reference(x)
        # each path's first forward runs eagerly and whole; and every kernel the caller runs between a launch and
        # its forward has run once before (CUDA's lazy loading: a kernel's first launch can wait for the running
        # kernels, the launched consumer's waits among them)
        buf.forward(_next_input(buf.forward(x, w0, streaming=True)), w1, streaming=True)
        torch.cuda._sleep(1000)
        y0, y1 = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        two_layers(x, y0, y1)
        r0, r1 = reference(x)
        assert torch.equal(bits(y0), bits(r0)) and torch.equal(bits(y1), bits(r1)), f"eager; {buf.status()}"
        if gemm == "triton":
            assert torch.equal(bits(r0), bits(single_batch(shape, mw, x)))
            assert torch.equal(bits(r1), bits(single_batch(shape, mw2, _next_input(r0))))
        g = torch.cuda.CUDAGraph(keep_graph=True)
        side = torch.cuda.Stream(device=heap.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
            two_layers(x, y0, y1)
        report = buf.prioritize(g)
        m = re.match(r"(\d+) kernel nodes set to priority -?\d+, (\d+) GEMM nodes left at the default", report)
        assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, report  # the GEMMs found, by handle or name
        g.instantiate()
        torch.cuda.current_stream().wait_stream(side)
        for seed in (2, 3):
            x.copy_(random_x(shape, T, seed, heap.device))
            y0.fill_(float("nan"))
            y1.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            r0, r1 = reference(x)
            assert torch.equal(bits(y0), bits(r0)) and torch.equal(bits(y1), bits(r1)), f"replay {seed}"
        del g
        with register_layer(buf, mw) as l0, register_layer(buf, mw2) as l1:
            a = moe_forward(x, l0, streaming=True, launch_next=l1)
            b = moe_forward(_next_input(a), l1, streaming=True)
            r0, r1 = reference(x)
            assert torch.equal(bits(a), bits(r0)) and torch.equal(bits(b), bits(r1)), "torch op"
        buf.launch_consumer(w1, T)
        with pytest.warns(UserWarning, match="cancelled by a forward of another layer"):
            a = buf.forward(x, w0, streaming=True)
        assert torch.equal(bits(a), bits(reference(x)[0])), "after a cancelled launch"
        st = buf.status()
        assert not (st["violations"] or st["timeouts"] or st["bad_routes"]), f"{st}"
    finally:
        buf.close()


def test_the_buffers_streams_are_never_the_callers(env):
    """torch hands out its streams from a pool, round robin: however many streams the caller makes, none is one
    of the buffer's side streams (its GEMM stream as a capture stream would put the producer behind GEMMs that
    wait for it)."""
    heap, shape, mw = env
    buf = _buffer(heap, shape)
    try:
        own = {int(s.cuda_stream) for s in buf.pipeline.progress.streams()}
        pooled = {int(torch.cuda.Stream(device=heap.device, priority=p).cuda_stream) for p in (0, -1, -5)
                  for _ in range(70)}
        assert len(own) == 4 and not own & pooled
    finally:
        buf.close()


@pytest.mark.parametrize("gemm", ["triton", "cutlass"])
def test_the_result_puts_run_at_the_gemm_priority_beside_a_persistent_grid(env, gemm):
    """spin_kernel raises the producer's and the dispatch's streams; the result puts' stream too with Triton, not
    with a persistent-grid backend (CUTLASS, EPTuning.high_priority_puts None), where the puts would take the SMs a
    call frees from the next dispatch step; high_priority_puts=True raises it there too. A captured streamed
    forward leaves the puts' kernel nodes at the default priority where their stream is: more nodes left low."""
    heap, shape, mw = env
    if gemm == "cutlass":
        from streamring.moe.ep_buffer import cutlass_unavailable_reason

        why = cutlass_unavailable_reason()
        if why:
            pytest.skip(why)
    x = random_x(shape, 320, 1, heap.device)
    left_low = {}
    for puts_high in (None, True):
        buf = _buffer(heap, shape, gemm=gemm, max_tokens=320, tokens_per_slot=80, high_priority_puts=puts_high)
        try:
            pr = buf.pipeline.progress
            high = {r: pr.stream(r).priority < 0 for r in ("p", "d", "g", "u")}
            assert high == {"p": True, "d": True, "g": False, "u": gemm == "triton" or bool(puts_high)}, high
            w = buf.prepare_weights(mw)
            y = buf.forward(x, w, streaming=True)
            g = buf.capture(x, w, torch.empty_like(y), streaming=True)
            report = buf.node_priority_report
            m = re.match(r"(\d+) kernel nodes set to priority -?\d+, (\d+) GEMM nodes left at the default", report)
            assert m, report
            left_low[puts_high] = int(m.group(2))
            del g
        finally:
            buf.close()
    if gemm == "cutlass":  # L2 into a local y, then each call's puts: left low by default, raised with True
        assert left_low[None] > left_low[True], left_low
    else:  # Triton stores L2 straight into the owners: no puts kernel, the same nodes either way
        assert left_low[None] == left_low[True], left_low


_PLAN_DROPPED_IN_A_CAPTURE = r"""
import gc, sys
import torch
from streamring.gemm import cutlass_lib as L

if sys.argv[1] == "destroy-in-del":  # the negative control: a plan destroyed by the collector where it runs
    L.GroupedGemm.__del__ = lambda self: self.close()
gc.disable()
plan = L.GroupedGemm(512, 256, capacity=64)
plan._ensure(torch.device("cuda", 0))  # the C plan: device memory of its own
cycle = [plan]
cycle.append(cycle)  # freed only by the cyclic collector
holder = [cycle]  # alive until inside the capture (a torch that collects as its graph context opens finds no garbage)
del plan, cycle
x = torch.ones(64, device="cuda")
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
try:
    with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
        y = x * 2
        holder.clear()
        gc.collect()  # the plan's finalizer runs inside the capture
        y += 1
    g.replay()
    torch.cuda.synchronize()
    print("CAPTURE OK", float(y.sum()), len(L._DROPPED))
except Exception as exc:  # noqa: BLE001
    print("CAPTURE FAILED", type(exc).__name__, str(exc).splitlines()[0])
L.destroy_dropped()
print("DROPPED LEFT", len(L._DROPPED))
"""


def test_a_gemm_plan_collected_inside_a_capture_leaves_the_capture_valid():
    """The garbage collector can finalize a CUTLASS plan inside a caller's CUDA graph capture (a buffer of an
    earlier layer or test dropped in a cycle). Its destroy frees device memory, which invalidates a capture in the
    same thread: the finalizer only queues the plan, destroyed at the next plan made or closed outside a capture.
    Negative control: a finalizer that destroys the plan where it runs makes the same capture fail."""
    import subprocess
    import sys
    from pathlib import Path

    from streamring.moe.ep_buffer import cutlass_unavailable_reason
    why = cutlass_unavailable_reason()
    if why:
        pytest.skip(f"the CUTLASS library is not available here: {why}")
    runs = {}
    for variant in ("queued", "destroy-in-del"):
        r = subprocess.run([sys.executable, "-c", _PLAN_DROPPED_IN_A_CAPTURE, variant], capture_output=True, text=True,
                           timeout=120, cwd=Path(__file__).resolve().parents[2])
        runs[variant] = r.stdout + r.stderr[-2000:]
    assert "CAPTURE OK 192.0 1" in runs["queued"] and "DROPPED LEFT 0" in runs["queued"], runs["queued"]
    assert "CAPTURE FAILED" in runs["destroy-in-del"], runs["destroy-in-del"]
