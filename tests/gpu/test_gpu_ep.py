"""The expert-parallel GPU layer (EPBuffer) on one PE: needs a CUDA GPU and nvshmem4py (skips otherwise).

Several PEs run it through ``streamring run --backend nvshmem`` under ``mpiexec`` on the GPU machine
(``launch/gpu_check.sh``, phase ``gpus``: one PE per GPU); here one PE checks, for every progress
policy and both transports, that the streamed forward equals the batch forward bitwise, that both
equal the single-process block path (``blocks.batch_forward``) bitwise, that the ring reports no
error, that a captured graph replays with new inputs and with any token count from a device word.
"""

from __future__ import annotations

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
    heap, shape, fw = env
    T = 157
    x0 = random_x(shape, T, 1, heap.device)
    ref = single_batch(shape, fw, x0)
    # the Triton GEMMs: the single-process block path runs them too (bitwise comparable)
    buf = _buffer(heap, shape, policy=policy, transport=transport, order=order)
    try:
        w = buf.prepare_weights(fw)
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
                assert torch.equal(bits(y), bits(single_batch(shape, fw, x2))), \
                    f"streaming={streaming} replay, seed {seed}; status {buf.status()}"
        st = buf.status()
        assert not (st["violations"] or st["timeouts"] or st["bad_routes"]), f"{st}"
        assert buf.transport == transport
    finally:
        buf.close()


def test_one_capture_serves_every_token_count(env):
    """One captured forward per path, replayed with counts 0, 1, 77 and the maximum from a device word:
    each equals the single-process batch of just those rows, bitwise, and the rows past the count are 0."""
    heap, shape, fw = env
    T = 157
    buf = _buffer(heap, shape)
    try:
        w = buf.prepare_weights(fw)
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
                    assert torch.equal(bits(y[:n]), bits(single_batch(shape, fw, x[:n]))), (streaming, n)
                assert not y[n:].any(), (streaming, n)
        st = buf.status()
        assert not (st["violations"] or st["timeouts"] or st["bad_routes"] or st["bad_counts"]), f"{st}"
    finally:
        buf.close()


def test_a_missing_arrival_is_reported_not_hung(env):
    """Negative control: an owner expecting one row more than can arrive times out with
    RE_COMBINE_TIMEOUT in the status instead of hanging or reading a partial chunk silently, and
    the buffer then refuses to run until rebuilt."""
    heap, shape, fw = env
    T = 33
    x = random_x(shape, T, 4, heap.device)
    buf = _buffer(heap, shape, deadline_s=0.5)
    try:
        w = buf.prepare_weights(fw)
        buf.forward(x, w)
        real = buf._produce  # noqa: SLF001 - the test breaks the owner's expectation on purpose

        def one_more(path, layer, x, c, routing=None):
            real(path, layer, x, c, routing)
            buf.expected[c].add_(1)  # on the producer's stream, after the chunk's own count

        buf._produce = one_more
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


@pytest.mark.parametrize("policy,order", [("spin_kernel", "rank"), ("spin_kernel", "ready"), ("serialized", "rank")])
def test_cutlass_gemms_keep_streamed_equal_to_batch(env, policy, order):
    """gemm='cutlass' (CUTLASS FP8 blockwise grouped GEMMs, L2 through a local y and puts): the streamed
    output equals its batch output bitwise, and both are close to the Triton path (rounding only)."""
    from streamring.moe.ep_buffer import cutlass_unavailable_reason

    why = cutlass_unavailable_reason()
    if why:
        pytest.skip(f"the CUTLASS library is not available here: {why}")
    heap, shape, fw = env
    T = 157
    x = random_x(shape, T, 5, heap.device)
    ref = single_batch(shape, fw, x)
    outs = {}
    buf = _buffer(heap, shape, policy=policy, order=order, gemm="cutlass")
    try:
        w = buf.prepare_weights(fw)
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
    heap, shape, fw = env
    T = 157
    buf = _buffer(heap, shape, policy=policy, order=order, consumer="persistent", reserved_sms=16)
    try:
        w = buf.prepare_weights(fw)
        for streaming in (False, True):
            x = random_x(shape, T, 1, heap.device)
            y = torch.full_like(x, float("nan"))
            buf.forward(x, w, streaming=streaming, out=y)
            assert torch.equal(bits(y), bits(single_batch(shape, fw, x))), (streaming, buf.status())
            g = buf.capture(x, w, y, streaming=streaming)
            for seed in (2, 3):
                x2 = random_x(shape, T, seed, heap.device)
                x.copy_(x2)
                y.fill_(float("nan"))
                buf.replay(g)
                assert torch.equal(bits(y), bits(single_batch(shape, fw, x2))), (streaming, seed, buf.status())
    finally:
        buf.close()
