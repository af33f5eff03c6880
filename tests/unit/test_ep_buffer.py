"""The engine-facing GPU layer object, :class:`EPBuffer`, driven whole on the CPU (one PE).

The buffer's own pipeline runs here: its producers, ring publication with the slot metadata,
checked acquire (valid counts learned from the metadata), dispatch into expert blocks, the block
GEMMs (Triton, under ``TRITON_INTERPRET=1`` off the GPU), arrival counts, the owner's reduce, the
drain and the epoch advance. The CUDA ring kernels are replaced by their Python statements for one
PE (``tests/helpers/emulated_device.py``), launched through the same typed launchers, so the parameters the
buffer passes are checked against the C signatures. Several PEs and real concurrency are the GPU
check's part (``tests/gpu/test_gpu_ep.py``, ``launch/gpu_check.sh``).

Checked: streamed == batch == the single-process block path, bitwise; one buffer serving two layers
in alternation; any token count up to the maximum through a device count (rows past it are zero,
rows before it equal a forward of just those rows, bitwise); a count outside the rows of ``x`` is
clamped and makes the buffer refuse further forwards until rebuilt; bf16 weights prepared into
FP8; the buffer's bytes at the DeepSeek-V3 shape.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from conftest import quick_subset  # noqa: E402
from emulated_device import EmulatedHeap  # noqa: E402
from ep_case import bits, single_batch  # noqa: E402

from streamring.moe.ep_buffer import EPBuffer, memory_report  # noqa: E402
from streamring.moe.math import MoEShape  # noqa: E402
from streamring.moe.tuning import GROUP_MAX_TOKENS, EPTuning  # noqa: E402
from streamring.moe.weights import MoEWeights  # noqa: E402

SERIAL = EPTuning(policy="serialized")

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU emulation; GPUs run tests/gpu/test_gpu_ep.py"),
    pytest.mark.usefixtures("one_torch_thread"),  # (tests/conftest.py says why)
]
EMULATED = "the emulated device runs the layer's GPU kernels in Triton's CPU interpreter: 2 to 7 s a case on 2 cores"


def shape_(**kw) -> MoEShape:
    # the smallest sizes that still exercise everything: one 128-column scale group, grouped routing,
    # several blocks per expert and partial ones (the interpreter runs every GEMM on the CPU)
    base = dict(hidden=128, intermediate=128, num_experts=4, topk=2, router="deepseek_v3", n_group=2, topk_group=1,
                routed_scaling_factor=2.5, weight_dtype="fp8", block_m=16)
    return MoEShape(**{**base, **kw})


def tokens(n, seed, hidden=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, hidden, generator=g).to(torch.bfloat16)


@pytest.fixture(scope="module")
def setup():
    shape = shape_()
    mw = MoEWeights.random_fp8(shape, 3, "cpu")
    buf = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=2, tokens_per_slot=16,
                   gemm="triton", tuning=SERIAL)
    yield shape, mw, buf
    buf.close()


def test_streamed_equals_batch_equals_single_process(setup):
    shape, mw, buf = setup
    w = buf.prepare_weights(mw)
    x = tokens(37, 1)
    ref = single_batch(shape, mw, x)
    # the shared buffer may have served other tests first (pytest-xdist hands the slow ones out first):
    # the counts below are this test's forwards
    before = buf.status()
    yb = buf.forward(x, w).clone()
    ys = buf.forward(x, w, streaming=True).clone()
    assert torch.equal(bits(yb), bits(ref))
    assert torch.equal(bits(ys), bits(ref))
    assert buf.paths["stream"].num_chunks == 3  # 40 tokens of capacity in chunks of 16
    st = buf.status()
    assert st["violations"] == 0 and st["timeouts"] == 0 and st["bad_routes"] == 0, st
    # every chunk of both paths was published twice (route, layout), acknowledged and drained
    done = {p: {k: st[p][k] - before[p][k] for k in ("published", "consumed")} for p in ("stream", "batch")}
    assert done["stream"] == {"published": 2 * 3, "consumed": 3}, (done, st)
    assert done["batch"] == {"published": 2, "consumed": 1}, (done, st)


def test_every_source_order_computes_the_last_step_in_the_seal_call_and_keeps_the_bits(setup, monkeypatch):
    """The last dispatch step's blocks are computed in the seal's call: one GEMM call per forward fewer
    (the batch path: one call over its step and the seal), in every dispatch order; the orders' outputs are
    bitwise equal."""
    import streamring.moe.ep_experts as EX

    shape, mw, _ = setup  # buffers of its own: the shared one's status counts are asserted elsewhere
    ranges = []
    real = EX.EPExperts.compute

    def gemms(self, path, layer, lo, hi, *a, **k):  # every GEMM call of a forward, as its ready range
        ranges.append((lo, hi))
        return real(self, path, layer, lo, hi, *a, **k)
    monkeypatch.setattr(EX.EPExperts, "compute", gemms)
    x = tokens(37, 1)
    got = {}
    for order in ("rank", "ready", "arrival"):  # 3 chunks: arrival needs 3 slots
        b = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=3, tokens_per_slot=16, gemm="triton",
                     tuning=EPTuning(policy="serialized", source_order=order))
        try:
            w = b.prepare_weights(mw)
            for streaming in (False, True):
                ranges.clear()
                got[order, streaming] = (b.forward(x, w, streaming=streaming).clone(), list(ranges))
        finally:
            b.close()
    for order in ("rank", "ready", "arrival"):
        assert got[order, False][1] == [(0, 2)], order
        assert got[order, True][1] == [(0, 1), (1, 2), (2, 4)], order
        for streaming in (False, True):
            assert torch.equal(bits(got[order, streaming][0]), bits(got["rank", False][0])), (order, streaming)


def test_seal_by_expert_lays_the_seal_call_out_expert_by_expert_and_keeps_the_bits(setup):
    """EPTuning(seal_by_expert=True), the default: the seal's call (the last step's blocks and the partial ones)
    reads its range expert by expert, on both paths, and the outputs keep their bits; False keeps the allocator's
    order (every partial block after the full ones), which the same check rejects here."""
    assert EPTuning().seal_by_expert is True
    shape, mw, _ = setup
    x = tokens(37, 1)
    got, layouts = {}, {}
    for by_expert in (False, True):
        b = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=3, tokens_per_slot=16, gemm="triton",
                     tuning=EPTuning(policy="serialized", seal_by_expert=by_expert))
        try:
            w = b.prepare_weights(mw)
            bc = b.pipeline.experts.bc
            for streaming, (lo, hi) in ((False, (0, 2)), (True, (2, 4))):  # the seal call's ready indices
                got[by_expert, streaming] = b.forward(x, w, streaming=streaming).clone()
                ids = bc.ready_list[int(bc.ready_hi[lo]):int(bc.ready_hi[hi])].long()
                layouts[by_expert, streaming] = bc.block_expert[ids].tolist()
        finally:
            b.close()
    for streaming in (False, True):
        assert layouts[True, streaming] == sorted(layouts[True, streaming]), layouts
        assert torch.equal(bits(got[True, streaming]), bits(got[False, False])), streaming
    assert any(layouts[False, s] != sorted(layouts[False, s]) for s in (False, True)), layouts


def test_arrival_order_needs_a_slot_per_chunk(setup):
    """A consumer taking all of one source's chunks first could wait for a slot that only its own later
    acknowledgement frees: arrival order is refused when a forward has more chunks than slots."""
    shape, _, _ = setup
    with pytest.raises(ValueError, match=r"source_order 'arrival' needs num_slots >= the chunks of a forward .*= 3\), "
                                         r"got num_slots=2"):
        EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=2, tokens_per_slot=16,
                 tuning=EPTuning(policy="serialized", source_order="arrival"))


def test_a_gemm_status_makes_the_buffer_refuse(setup):
    """A bad ready range met by the expert GEMMs (DeepGEMM's status word: e.g. its psum layout refused on
    the device, so nothing was computed) is not silent: status() names it and the buffer is broken."""
    shape, mw, _ = setup
    buf = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=2, tokens_per_slot=16,
                   gemm="triton", tuning=SERIAL)
    try:
        assert buf.status()["gemm_status"] == 0 and not buf.broken

        class RefusedPsum:  # what DeepGemmExperts.status() returns after psum_layout refused a layout
            def status(self):
                return 32

        buf.pipeline.experts.bc.experts = lambda impl="triton", **options: RefusedPsum()
        st = buf.status()
        assert st["gemm_status"] == 32
        assert "psum layout" in buf.broken and "rank 0" in buf.broken
        with pytest.raises(RuntimeError, match="unusable"):
            buf.forward(tokens(4, 1), buf.prepare_weights(mw))
    finally:
        buf.close()


@pytest.mark.slow(reason=EMULATED)
def test_one_buffer_serves_two_layers(setup):
    shape, mw, buf = setup
    mw2 = MoEWeights.random_fp8(shape, 11, "cpu")
    w1, w2 = buf.prepare_weights(mw), buf.prepare_weights(mw2)
    x = tokens(40, 2)
    want1, want2 = single_batch(shape, mw, x), single_batch(shape, mw2, x)
    for streaming in (False, True):  # alternate layers and paths on the one buffer
        assert torch.equal(bits(buf.forward(x, w1, streaming=streaming)), bits(want1))
        assert torch.equal(bits(buf.forward(x, w2, streaming=streaming)), bits(want2))


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the poisoned rows past the count are quantized, then ignored
@pytest.mark.parametrize("n", quick_subset([0, 1, 33, 40], quick=[0, 1], reason=EMULATED))
def test_any_token_count_through_a_device_count(setup, n):
    shape, mw, buf = setup
    w = buf.prepare_weights(mw)
    x = tokens(40, 3)
    want = single_batch(shape, mw, x[:n]) if n else torch.zeros(0, shape.hidden, dtype=torch.bfloat16)
    for streaming in (False, True):
        x_poisoned = x.clone()
        x_poisoned[n:] = float("nan")  # rows past the count are never read into any result
        y = buf.forward(x_poisoned, w, streaming=streaming, num_tokens=torch.tensor([n]))
        assert torch.equal(bits(y[:n]), bits(want)), (streaming, n)
        assert not y[n:].any(), (streaming, n)
    st = buf.status()
    assert st["violations"] == 0 and st["timeouts"] == 0 and st["bad_counts"] == 0, st


def test_count_outside_the_rows_is_clamped_then_refused(monkeypatch):
    """Outside a capture a count outside the rows of x raises before anything is enqueued (the buffer stays
    usable); where it cannot be read on the host (under a CUDA graph capture, stood in for here) the device
    clamps it, counts it, and the buffer refuses further forwards until rebuilt."""
    from streamring.moe import ep_buffer

    shape = shape_()
    mw = MoEWeights.random_fp8(shape, 3, "cpu")
    buf = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=2, tokens_per_slot=16,
                   gemm="triton", tuning=SERIAL)
    w = buf.prepare_weights(mw)
    x = tokens(20, 4)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 20\]"):
        buf.forward(x, w, num_tokens=21)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 20\] \(x has 20 rows\), got 25"):
        buf.forward(x, w, num_tokens=torch.tensor([25]))
    assert not buf.broken
    monkeypatch.setattr(ep_buffer, "host_read_allowed", lambda device: False)  # as under a capture
    with pytest.raises(RuntimeError, match="bad_counts=1"):
        buf.forward(x, w, num_tokens=torch.tensor([25]))  # the first forward checks the status
    with pytest.raises(RuntimeError, match="unusable after a ring error"):
        buf.forward(x, w)
    buf.close()


def test_bad_arguments_leave_the_buffer_usable(monkeypatch):
    """Every argument family of forward is checked before anything is enqueued: each bad call raises a
    ValueError naming the argument, the buffer is not broken, and its next streamed and batch forwards give
    the bits of a fresh buffer's (the single-process batch, which test_streamed_equals_batch_equals_single_process
    holds every path of a buffer to). A routing id out of range is refused on the host; under a capture
    (stood in for) the dispatch drops it and counts it instead, and the buffer refuses further work."""
    from streamring.moe import ep_buffer

    shape = shape_()
    mw = MoEWeights.random_fp8(shape, 3, "cpu")
    buf = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=2, tokens_per_slot=16,
                   gemm="triton", tuning=SERIAL)
    w = buf.prepare_weights(mw)
    x = tokens(24, 9)
    E, K = shape.num_experts, shape.topk
    idx = (torch.arange(24 * K).view(24, K) % E).contiguous()
    wt = torch.full((24, K), 0.5)
    far, nan_w = idx.clone(), wt.clone()
    far[3, 1], nan_w[5, 0] = 99, float("nan")
    bad = [  # (the call's arguments, what its message must say)
        (dict(x=x, routing=(far, wt), streaming=True),
         "routing[0] (topk_idx) values must be expert ids in [0, 4) or -1 (a masked route), got 99 at token 3"),
        (dict(x=x, routing=(far, wt)), "got 99 at token 3"),
        (dict(x=x, routing=(idx, nan_w)), "routing[1] (topk_weights) must be finite, got nan at token 5"),
        (dict(x=x, routing=(idx.int(), wt)), "routing[0] (topk_idx) must be int64 [24, 2]"),
        (dict(x=x, routing=idx), "routing must be None or a pair"),
        (dict(x=x, num_tokens=25), "num_tokens must be in [0, 24]"),
        (dict(x=x, num_tokens=torch.tensor([30])), "num_tokens must be in [0, 24]"),
        (dict(x=x, num_tokens=torch.tensor([2.0])), "num_tokens must be an int or a 0-d/1-element integer tensor"),
        (dict(x=x, out=torch.zeros(24, 128)), "out must be None or a bfloat16 tensor of shape [24, 128]"),
        (dict(x=x, streaming="yes"), "streaming must be True, False or 'auto'"),
        (dict(x=x, streaming=True, stream_epoch=0), "stream_epoch must grow from call to call"),
        (dict(x=x, streaming=True, stream_epoch="9"), "stream_epoch must be None or an int"),
        (dict(x=x, stream_epoch=9), "stream_epoch is for streaming=True"),
        (dict(x=x.int()), "x must be a bfloat16 (or other float) tensor"),
        (dict(x=x[:, :64]), "x must have shape [tokens, hidden=128]"),
        (dict(x=tokens(41, 1)), "x has 41 tokens, more than max_tokens_per_rank=40"),
    ]
    for kw, needle in bad:
        with pytest.raises(ValueError) as ei:
            buf.forward(kw.pop("x"), w, **kw)
        assert needle in str(ei.value), (needle, str(ei.value))
        assert not buf.broken, (needle, buf.broken)
    want = single_batch(shape, mw, x)
    assert torch.equal(bits(buf.forward(x, w, streaming=True)), bits(want))
    assert torch.equal(bits(buf.forward(x, w)), bits(want))
    # where the values cannot be read on the host the device-side count stays the mechanism
    monkeypatch.setattr(ep_buffer, "host_read_allowed", lambda device: False)
    with pytest.raises(RuntimeError, match="bad_routes"):
        buf.forward(x, w, routing=(far, wt))
        buf.check()
    assert buf.broken
    buf.close()


def test_bf16_weights_are_prepared_into_fp8():
    shape = shape_(weight_dtype="bf16")
    mw = MoEWeights.random(shape, seed=5)
    buf = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=24, tokens_per_slot=8, gemm="triton", tuning=SERIAL)
    w = buf.prepare_weights(mw)
    assert w.fw.w1.dtype == torch.float8_e4m3fn and tuple(w.fw.w1.shape) == (4, 256, 128)
    x = tokens(24, 6)
    fp8 = MoEWeights(
        router_weight=mw.router_weight, correction_bias=mw.correction_bias,
        **{k: v for k, v in zip(("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale"),
                                 [t for name in ("w1", "w3", "w2") for t in _q(getattr(mw, name))])})
    assert torch.equal(bits(buf.forward(x, w, streaming=True)), bits(single_batch(shape_(), fp8, x)))
    buf.close()


def _q(t):
    from streamring.moe.math import quantize_weight_fp8_block

    return quantize_weight_fp8_block(t.float())


def test_bad_arguments_name_the_field(setup):
    shape, mw, buf = setup
    w = buf.prepare_weights(mw)
    with pytest.raises(ValueError, match="more than max_tokens_per_rank=40"):
        buf.forward(tokens(41, 1), w)
    with pytest.raises(ValueError, match="x must be a bfloat16"):
        buf.forward(tokens(4, 1).to(torch.int32), w)
    with pytest.raises(ValueError, match="weights must come from EPBuffer.prepare_weights"):
        buf.forward(tokens(4, 1), mw)
    with pytest.raises(ValueError, match="stream_epoch is for streaming=True"):
        buf.forward(tokens(4, 1), w, stream_epoch=9)
    with pytest.raises(ValueError, match="routing.hidden=256 differs"):
        buf.prepare_weights(mw, shape_(hidden=256))
    # the tuning's errors name the field and its allowed values
    with pytest.raises(ValueError, match=r"block_m\n  Input should be 16, 32, 64 or 128"):
        EPTuning(block_m=48)
    with pytest.raises(ValueError, match="policy 'pdl' is refused by the expert-parallel layer"):
        EPTuning(policy="pdl")
    with pytest.raises(ValueError, match=r"source_order\n  Input should be 'rank', 'ready' or 'arrival'"):
        EPTuning(source_order="fifo")
    with pytest.raises(ValueError, match=r"producer_sms must be a multiple of 8"):
        EPTuning(producer_sms=12)
    with pytest.raises(ValueError, match=r"side_puts\n  Extra inputs are not permitted"):
        EPTuning(side_puts=False)
    with pytest.raises(ValueError, match="frozen"):
        SERIAL.policy = "spin_kernel"
    with pytest.raises(ValueError, match="tuning must be an EPTuning, got dict"):
        EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=8, tuning={"policy": "serialized"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'policy'"):
        EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=8, policy="serialized")


def test_auto_streams_only_where_the_table_measured_a_win(setup, monkeypatch):
    """streaming='auto' follows the tuned table's rows of this GEMM implementation, PE count and chunk count
    only; a streamed row of another schedule, or no row (another GEMM's rows included), gives the batch path
    and says why; no model is consulted; either way the output is the batch output."""
    from streamring.moe import adaptive

    shape, mw, buf = setup
    w = buf.prepare_weights(mw)
    x = tokens(37, 4)
    want = single_batch(shape, mw, x)
    win = {"rows": [{"tokens": 32, "ranks": 1, "experts_per_pe": 4, "gemm": "triton", "block_m": 16,
                     "path": "streamed", "chunks": 3, "num_slots": 2, "policy": "serialized", "source_order": "ready",
                     "streamed_over_batch": 0.9}]}
    cases = [(win, True, "streamed", "measured"),
             ({"rows": [{**win["rows"][0], "chunks": 2}]}, False, "batch", "other schedule"),  # other chunking
             ({"rows": [{**win["rows"][0], "source_order": "arrival"}]}, False, "batch", "other schedule"),
             ({"rows": [{**win["rows"][0], "experts_per_pe": 32}]}, False, "batch", "none"),  # another expert load
             ({"rows": [{**win["rows"][0], "gemm": "cutlass"}]}, False, "batch", "none"),  # another GEMM's win
             ({"rows": [{"tokens": 32, "ranks": 1, "experts_per_pe": 4, "gemm": "triton", "block_m": 16,
                        "path": "batch"}]}, False, "batch", "measured")]  # a measured batch row decides
    for table, streams, answer, source in cases:
        monkeypatch.setattr(adaptive, "DEFAULT_TABLE", None)
        monkeypatch.setattr(adaptive, "load_table", lambda path=None, t=table: t)
        before = buf.paths["stream"].ring.epoch()
        y = buf.forward(x, w, streaming="auto", stream_epoch=before + 1).clone()
        assert torch.equal(bits(y), bits(want)), table
        assert (buf.paths["stream"].ring.epoch() > before) == streams, table
        assert (buf.last_adaptive.path, buf.last_adaptive.source) == (answer, source), (table, buf.last_adaptive)
    # no row for this setting: the batch path, and the answer says why
    monkeypatch.setattr(adaptive, "load_table", lambda path=None: {"rows": [{**win["rows"][0], "ranks": 8}]})
    y = buf.forward(x, w, streaming="auto").clone()
    assert torch.equal(bits(y), bits(want))
    assert buf.last_adaptive.source == "none" and buf.last_adaptive.path == "batch"
    assert "no measured row for gemm='triton' on 1 ranks" in buf.last_adaptive.note
    with pytest.raises(ValueError, match="streaming must be True, False or 'auto'"):
        buf.forward(x, w, streaming="yes")
    # the committed table: no streamed win was ever measured, so auto is the batch path
    monkeypatch.undo()
    assert not buf.adaptive_streaming(37) and buf.last_adaptive.path == "batch"


def test_auto_takes_a_one_chunk_row_of_either_source_order(setup, monkeypatch):
    """With one chunk the ready and arrival orders are one schedule (a step per source as they publish), so a
    measured one-chunk win of either serves a buffer of the other; with more chunks the order must match."""
    from streamring.moe import adaptive

    shape, _, _ = setup
    row = {"tokens": 32, "ranks": 1, "experts_per_pe": 4, "gemm": "triton", "block_m": 16, "path": "streamed",
           "chunks": 1, "num_slots": 1, "policy": "spin_kernel", "streamed_over_batch": 0.95}
    monkeypatch.setattr(adaptive, "DEFAULT_TABLE", None)
    for order, table_order, chunk, want in (("ready", "arrival", None, True), ("arrival", "ready", None, True),
                                            ("rank", "ready", None, False), ("ready", "arrival", 16, False)):
        monkeypatch.setattr(adaptive, "load_table", lambda path=None, o=table_order, c=chunk: {
            "rows": [{**row, "source_order": o, "chunks": 1 if c is None else 3}]})
        buf = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=3, tokens_per_slot=chunk,
                       gemm="triton", tuning=EPTuning(policy="serialized", source_order=order, block_m=16))
        try:
            assert buf.adaptive_streaming(37) is want, (order, table_order, chunk)
        finally:
            buf.close()


def test_a_grouped_ready_row_decides_only_for_grouped_ready_buffers():
    """On several PEs the ready order's grouped steps are a schedule of their own: a row measured with them
    (it names its window) decides for a grouped buffer whatever its window, never for an arrival buffer; a
    row measured with one source per ready step (no window) still serves an arrival buffer at one chunk."""
    from streamring.moe.ep_config import schedule as _schedule

    assert _schedule(1, "ready", 20.0, 2) == _schedule(1, "ready", 50.0, 2)
    assert _schedule(1, "ready", 20.0, 2) != _schedule(1, "arrival", None, 2)
    assert _schedule(1, "ready", None, 2) == _schedule(1, "arrival", None, 2)
    assert _schedule(2, "ready", None, 2) != _schedule(2, "arrival", None, 2)
    assert _schedule(1, "ready", 20.0, 1) == _schedule(1, "arrival", None, 1)  # one PE: nothing to group


def test_only_the_ready_order_on_several_pes_with_the_per_chunk_consumer_groups_small_forwards():
    tu = EPTuning(group_max_tokens=1024)
    assert tu.groups_sources(2, 1024, persistent_grid=False) and not tu.groups_sources(2, 1025, persistent_grid=False)
    assert not tu.groups_sources(1, 16, persistent_grid=False)  # one PE: one source, nothing to group
    assert not EPTuning(source_order="arrival").groups_sources(2, 16, persistent_grid=False)
    assert not EPTuning(consumer="persistent").groups_sources(2, 16, persistent_grid=False)
    assert not EPTuning(group_max_tokens=0).groups_sources(2, 1, persistent_grid=False)


def test_by_default_a_persistent_grid_groups_ready_sources_at_every_size_and_a_grid_per_tile_up_to_1024():
    from streamring.gemm.backends import CAPABILITIES

    tu = EPTuning()
    assert tu.groups_sources(2, GROUP_MAX_TOKENS, persistent_grid=False)
    assert not tu.groups_sources(2, GROUP_MAX_TOKENS + 1, persistent_grid=False)
    assert tu.groups_sources(2, 8192, persistent_grid=True)
    assert not tu.groups_sources(1, 8192, persistent_grid=True)  # one PE: nothing to group
    assert not EPTuning(group_max_tokens=1024).groups_sources(2, 8192, persistent_grid=True)  # a set limit holds
    assert CAPABILITIES["cutlass"].persistent_grid and CAPABILITIES["deep_gemm"].persistent_grid
    assert not CAPABILITIES["triton"].persistent_grid


def test_explicit_stream_epochs_must_grow(setup):
    shape, mw, buf = setup
    w = buf.prepare_weights(mw)
    x = tokens(10, 7)
    buf.forward(x, w, streaming=True)  # the stream path has run (no first-run special case below)
    now = buf.paths["stream"].ring.epoch()
    y = buf.forward(x, w, streaming=True, stream_epoch=now + 5).clone()
    assert buf.paths["stream"].ring.epoch() == now + 6
    assert torch.equal(bits(y), bits(single_batch(shape, mw, x)))
    with pytest.raises(ValueError, match="stream_epoch must grow"):
        buf.forward(x, w, streaming=True, stream_epoch=now)


@pytest.mark.parametrize("max_tokens", [128, 1024, 8192])
def test_shared_buffer_bytes_at_the_deepseek_v3_shape(max_tokens):
    """One buffer for every layer costs at most 1.1x one layer's streamed ring plus combine area
    (the batch ring is the extra); the figures go to docs/engine.md."""
    from bench.common import dsv3_shape

    dsv3 = dsv3_shape(64)
    rep = memory_report(dsv3, 2, max_tokens_per_rank=max_tokens, num_slots=2, tokens_per_slot=max_tokens // 2)
    assert rep["symmetric"] == rep["batch_ring"] + rep["stream_ring"] + rep["combine"]
    assert rep["ratio"] <= 1.1, rep
    # the combine area dominates: tokens x top-k x hidden bf16 rows
    assert rep["combine"] >= max_tokens * 8 * 7168 * 2


@pytest.mark.slow(reason=EMULATED)
def test_blocks_past_the_grids_expectation_are_counted_and_computed_on_the_tail(setup, monkeypatch):
    """Every GEMM call of a forward is recorded with the blocks its grid was sized for;
    ``debug.blocks_past_expectation`` reads how many it found ready. With every call expecting one block the
    Triton grids launch one group's tiles and a looping tail (here of 2 CTAs, so each loops over several tiles),
    which computes every block past the group; the output keeps the batch path's bits."""
    import streamring.moe.ep_experts as EX
    from streamring.device import moe_triton as K
    from streamring.device.gemm_grid import GROUP_BLOCKS
    from streamring.moe import debug

    shape, mw, _ = setup
    x = tokens(192, 4)  # 2 chunks of 96 tokens: 192 routes, more than a group of full 16-row blocks per call
    b = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=192, num_slots=2, tokens_per_slot=96, gemm="triton",
                 tuning=SERIAL)
    try:
        w = b.prepare_weights(mw)
        # streamed first: a block the tail skipped would keep the fresh buffer's zeros, not an earlier
        # forward's rows of the same tokens
        monkeypatch.setattr(EX.EPExperts, "expect", lambda self, path, rows, grouped, c, j=0: 1)
        monkeypatch.setattr(K, "tail_ctas", lambda device: 2)
        got = b.forward(x, w, streaming=True).clone()
        rec = debug.blocks_past_expectation(b)
        monkeypatch.undo()
        want = b.forward(x, w).clone()
        batch = debug.blocks_past_expectation(b)
    finally:
        b.close()
    assert torch.equal(bits(got), bits(want))
    # the batch call's grid was sized for its own expectation, which even routing's blocks stay within
    assert len(batch["calls"]) == 1 and batch["past"] == 0, batch
    # chunk 0's call, then the seal's call (chunk 1's step, expecting one block, and a partial block per
    # expert); the ready counts add up
    assert [c["expected"] for c in rec["calls"]] == [1, 1 + shape.num_experts], rec
    assert rec["ready"] == batch["ready"], (rec, batch)
    for call in rec["calls"]:
        one_cta_per_tile = -(-call["expected"] // GROUP_BLOCKS) * GROUP_BLOCKS
        assert call["past"] == call["ready"] - call["expected"]
        assert call["past_grid"] == max(0, call["ready"] - one_cta_per_tile), call
    # (one 128-column tile per block in both GEMMs at this shape)
    assert max(c["past_grid"] for c in rec["calls"]) > 2, "each tail CTA must have looped over several blocks"


def test_routing_given_by_the_caller(setup):
    """``routing=(idx, w)`` is published as it is: the router's own routing gives the router's output,
    bitwise; a masked route (-1) contributes nothing."""
    from streamring.device import moe_triton as K
    from streamring.moe.routers import select_experts

    shape, mw, buf = setup
    w = buf.prepare_weights(mw)
    x = tokens(21, 8)
    lg = torch.zeros(21, shape.num_experts)
    fw = mw.fp8_blocks()
    K.router_logits(x, fw.router, lg)
    idx, wt = select_experts(lg, fw.bias, shape)
    want = buf.forward(x, w).clone()
    assert torch.equal(bits(buf.forward(x, w, streaming=True, routing=(idx, wt.float()))), bits(want))
    # a strided view of the same routing (e.g. columns of a wider table) gives the same output
    wide_idx = torch.stack([idx, torch.zeros_like(idx)], -1).view(21, -1)[:, ::2]
    wide_w = torch.stack([wt.float(), torch.zeros_like(wt.float())], -1).view(21, -1)[:, ::2]
    assert not wide_idx.is_contiguous() and torch.equal(wide_idx, idx)
    assert torch.equal(bits(buf.forward(x, w, streaming=True, routing=(wide_idx, wide_w))), bits(want))
    masked = idx.clone()
    masked[:, 1:] = -1  # only each token's first expert
    only_first = buf.forward(x, w, routing=(masked, wt.float())).clone()
    assert not torch.equal(bits(only_first), bits(want))
    with pytest.raises(ValueError, match=r"routing\[0\] \(topk_idx\) must be int64 \[21, 2\]"):
        buf.forward(x, w, routing=(idx.int(), wt.float()))


@pytest.mark.slow(reason=EMULATED)
def test_the_torch_op_runs_the_gpu_buffer(setup):
    """``torch.ops.streamring.moe_forward`` over this buffer: the same output as ``forward``, bitwise, a
    device count passed through, and ``torch.compile`` sees the layer as one node (no graph break)."""
    from streamring.moe import register_layer

    shape, mw, buf = setup
    # gate and up as tensors of their own (fp8_blocks concatenates them) against the halves of one tensor
    # (random_fp8's, which fp8_blocks takes as they are): the same bits
    sep = MoEWeights(router_weight=mw.router_weight, correction_bias=mw.correction_bias, w1=mw.w1.contiguous(),
                     w3=mw.w3.contiguous(), w2=mw.w2, w1_scale=mw.w1_scale.contiguous(),
                     w3_scale=mw.w3_scale.contiguous(), w2_scale=mw.w2_scale)
    assert sep.w1.data_ptr() != mw.w1.data_ptr()
    x = tokens(19, 9)
    want = single_batch(shape, mw, x)
    with register_layer(buf, sep) as layer:
        assert torch.equal(bits(layer(x)), bits(want))
        assert torch.equal(bits(layer(x, streaming=True, num_tokens=torch.tensor(7))[:7]),
                           bits(single_batch(shape, mw, x[:7])))

        def model(t):
            return torch.relu(layer(t * 1.0)) + 1.0

        ex = torch._dynamo.explain(model)(x)
        assert ex.graph_break_count == 0, ex.break_reasons
        ops = [str(op) for g in ex.ops_per_graph for op in g]
        assert sum("streamring.moe_forward" in o for o in ops) == 1, ops


def test_persistent_consumer_keeps_the_output():
    """consumer='persistent' (one launch of the persistent expert kernel per forward, fed by the ready
    queue) gives the per-chunk consumer's output, bitwise; the pull counters say what the dispatch read from
    peers' slots (none here: one PE reads only its own)."""
    shape = shape_()
    mw = MoEWeights.random_fp8(shape, 3, "cpu")
    x = tokens(29, 12)
    want = single_batch(shape, mw, x)
    buf = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=32, num_slots=2, tokens_per_slot=16,
                   gemm="triton", tuning=EPTuning(policy="serialized", consumer="persistent"))
    try:
        w = buf.prepare_weights(mw)
        for streaming in (False, True):
            assert torch.equal(bits(buf.forward(x, w, streaming=streaming)), bits(want)), streaming
        st = buf.status()
        assert not (st["violations"] or st["timeouts"] or st["bad_routes"]), st
        assert buf.pipeline.dispatch.pull_bytes.tolist() == [0, 0]
    finally:
        buf.close()
    with pytest.raises(ValueError, match="consumer 'persistent' runs the Triton GEMMs"):
        EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=8, gemm="cutlass",
                 tuning=EPTuning(policy="serialized", consumer="persistent"))


@pytest.mark.slow(reason=EMULATED)
def test_a_consumer_launched_ahead_is_consumed_or_cancelled(setup):
    """launch_consumer then the launched layer's streamed forward: the batch output, bitwise (one stream here:
    the forward runs whole); any other call cancels it with a warning naming why, and the buffer goes on
    (the next forwards are right); bad arguments raise naming the argument and change nothing."""
    shape, mw, buf = setup
    mw2 = MoEWeights.random_fp8(shape, 11, "cpu")
    w, w2 = buf.prepare_weights(mw), buf.prepare_weights(mw2)
    x = tokens(37, 21)
    wants = {}

    def want(layer, rows):  # the single-process batch output of x's first rows (each computed once)
        if (layer, rows) not in wants:
            wants[layer, rows] = single_batch(shape, {1: mw, 2: mw2}[layer], x[:rows])
        return wants[layer, rows]

    buf.launch_consumer(w2, 37)
    assert torch.equal(bits(buf.forward(x, w2, streaming=True)), bits(want(2, 37)))
    assert buf.launches.pending is None
    for why, call in (("a forward of another layer", lambda: buf.forward(x, w, streaming=True)),
                      ("a batch forward", lambda: buf.forward(x, w2)),
                      ("a forward of 36 rows", lambda: buf.forward(x[:36], w2, streaming=True)),
                      ("a new launch_consumer", lambda: buf.launch_consumer(w, 37))):
        buf.launch_consumer(w2, 37)
        with pytest.warns(UserWarning, match=f"cancelled by {why}"):
            y = call()
        if y is not None:
            assert torch.equal(bits(y), bits(want(1 if why.endswith("another layer") else 2, y.shape[0]))), why
    assert buf.cancel_launch() and not buf.cancel_launch()
    for bad, match in (((mw, 37), "weights must come from EPBuffer.prepare_weights"),
                       ((w, 41), r"rows must be an int in \[0, max_tokens_per_rank=40\]"),
                       ((w, True), "rows must be an int")):
        with pytest.raises(ValueError, match=match):
            buf.launch_consumer(*bad)
        assert buf.launches.pending is None
    assert torch.equal(bits(buf.forward(x, w, streaming=True)), bits(want(1, 37)))
    st = buf.status()
    assert not (st["violations"] or st["timeouts"]), st


def test_launch_ahead_refuses_the_persistent_consumer_and_the_batch_only_buffers():
    shape = shape_()
    mw = MoEWeights.random_fp8(shape, 3, "cpu")
    buf = EPBuffer(EmulatedHeap(), shape, max_tokens_per_rank=40, num_slots=2, tokens_per_slot=16, gemm="triton",
                   tuning=EPTuning(policy="serialized", consumer="persistent"))
    try:
        with pytest.raises(ValueError, match="launch_consumer needs tuning.consumer 'per_chunk'"):
            buf.launch_consumer(buf.prepare_weights(mw), 8)
    finally:
        buf.close()


@pytest.mark.slow(reason=EMULATED)
def test_the_torch_op_launches_the_next_layer_ahead(setup):
    """moe_forward(..., launch_next=) runs this layer, then launches the next one's consumer: the next call of
    that layer takes it; a launch_next of an unregistered id or of another buffer is refused before anything
    runs."""
    from streamring.moe import register_layer
    from streamring.moe.ops import moe_forward

    shape, mw, buf = setup
    mw2 = MoEWeights.random_fp8(shape, 13, "cpu")
    x = tokens(23, 5)
    with register_layer(buf, mw) as l0, register_layer(buf, mw2) as l1:
        y0 = moe_forward(x, l0, streaming=True, launch_next=l1)
        assert buf.launches.pending is not None and buf.launches.pending.layer is l1.weights
        y1 = moe_forward(y0, l1, streaming=True)
        assert buf.launches.pending is None
        assert torch.equal(bits(y0), bits(single_batch(shape, mw, x)))
        assert torch.equal(bits(y1), bits(single_batch(shape, mw2, y0)))
        with pytest.raises(KeyError, match="layer id 999999 is not registered"):
            moe_forward(x, l0, streaming=True, launch_next=999999)
        assert buf.launches.pending is None


def test_the_pipeline_groups_by_the_gemm_backends_declared_grid():
    """Pipeline.groups_sources asks the tuning with the resolved backend's ``persistent_grid`` capability: at 2 PEs
    and 4096 rows CUTLASS and DeepGEMM group the ready sources, Triton does not; the batch path never groups."""
    from types import SimpleNamespace

    from streamring.moe.ep_pipeline import Pipeline

    stream, batch = SimpleNamespace(name="stream", num_chunks=1), SimpleNamespace(name="batch", num_chunks=1)

    def pipeline(gemm):
        return Pipeline(heap=SimpleNamespace(num_ranks=2, device="cpu"), paths={"stream": stream, "batch": batch},
                        progress=SimpleNamespace(concurrent=False), producer=None, dispatch=None,
                        experts=SimpleNamespace(gemm=gemm), combine=None, tuning=EPTuning(), deadline_s=1.0)

    assert pipeline("cutlass").groups_sources(stream, 4096) and pipeline("deep_gemm").groups_sources(stream, 4096)
    assert not pipeline("triton").groups_sources(stream, 4096) and pipeline("triton").groups_sources(stream, 1024)
    assert not pipeline("cutlass").groups_sources(batch, 4096)


def test_chunk_gemm_ctas_caps_every_streamed_call_but_the_last():
    """tuning.chunk_gemm_ctas caps every streamed GEMM call while a source may still come (a grouped step that may
    seal included), never the forward's final call nor the batch path; waves apply to a backend that can run them."""
    from types import SimpleNamespace

    from streamring.moe.ep_experts import EPExperts

    stream, batch = SimpleNamespace(name="stream"), SimpleNamespace(name="batch")
    capped = SimpleNamespace(tuning=EPTuning(chunk_gemm_ctas=60), gemm="cutlass", sm_count=66)
    assert EPExperts.grid_ctas(capped, stream, final=False) == 60
    assert EPExperts.grid_ctas(capped, stream, final=True) is None
    assert EPExperts.grid_ctas(capped, batch, final=False) is None
    waves = SimpleNamespace(tuning=EPTuning(streamed_grid_waves=4), gemm="cutlass", sm_count=66)
    assert EPExperts.grid_ctas(waves, stream, final=True) == 4 * 66
    assert EPExperts.grid_ctas(SimpleNamespace(tuning=EPTuning(streamed_grid_waves=4), gemm="triton", sm_count=66),
                               stream, final=True) is None


def test_a_decode_forward_leaves_sms_free_in_every_streamed_call_but_the_last():
    """At decode sizes a CUTLASS streamed call but the final one runs on DECODE_FREE_SMS fewer CTAs than SMs without
    being asked; not at larger sizes, not the final call, not the batch path, not a backend without a capped
    persistent grid, and an explicit chunk_gemm_ctas still decides."""
    from types import SimpleNamespace

    from streamring.moe.ep_experts import DECODE_FREE_SMS, DECODE_MAX_TOKENS, EPExperts

    stream, batch = SimpleNamespace(name="stream"), SimpleNamespace(name="batch")
    own = SimpleNamespace(tuning=EPTuning(), gemm="cutlass", sm_count=66)
    assert EPExperts.grid_ctas(own, stream, False, 256) == 66 - DECODE_FREE_SMS
    assert EPExperts.grid_ctas(own, stream, False, DECODE_MAX_TOKENS + 1) is None
    assert EPExperts.grid_ctas(own, stream, True, 128) is None
    assert EPExperts.grid_ctas(own, batch, False, 128) is None
    assert EPExperts.grid_ctas(own, stream, False) is None  # rows unknown: the backend's own grid
    assert EPExperts.grid_ctas(SimpleNamespace(tuning=EPTuning(), gemm="triton", sm_count=66), stream, False, 128) is None
    assert EPExperts.grid_ctas(SimpleNamespace(tuning=EPTuning(chunk_gemm_ctas=50), gemm="cutlass", sm_count=66),
                               stream, False, 128) == 50


def test_a_full_persistent_grid_holds_every_sm_and_a_capped_or_triton_grid_does_not():
    """EPExperts.holds_every_sm: a streamed call of CUTLASS / DeepGEMM on the backend's own grid holds every SM; a
    capped call (chunk_gemm_ctas, the decode rule) and Triton's CTA-per-tile grids do not."""
    from types import SimpleNamespace

    from streamring.moe.ep_experts import EPExperts

    stream = SimpleNamespace(name="stream", order=[(0, 0), (0, 1)])

    def experts(gemm, **tu):
        e = SimpleNamespace(tuning=EPTuning(**tu), gemm=gemm, sm_count=66)
        e.grid_ctas = lambda path, final, rows=None: EPExperts.grid_ctas(e, path, final, rows)
        return e

    assert EPExperts.holds_every_sm(experts("cutlass"), stream, 0, 4096)
    assert EPExperts.holds_every_sm(experts("deep_gemm"), stream, 0, 4096)
    assert not EPExperts.holds_every_sm(experts("triton"), stream, 0, 4096)
    assert not EPExperts.holds_every_sm(experts("cutlass", chunk_gemm_ctas=60), stream, 0, 4096)
    assert not EPExperts.holds_every_sm(experts("cutlass"), stream, 0, 128)  # decode: SMs left free


def test_the_dispatch_waits_for_full_grids_by_default_on_persistent_grid_backends_only():
    """A default buffer enqueues its dispatch steps behind full persistent grids (CUTLASS, DeepGEMM); Triton keeps
    its enqueue, and EPTuning(dispatch_beside_grid=True) restores the dispatch beside the grid."""
    from streamring.moe.ep_pipeline import Pipeline

    assert EPTuning().dispatch_beside_grid is False
    assert Pipeline.dispatch_waits_for_full_grids(EPTuning(), "cutlass")
    assert Pipeline.dispatch_waits_for_full_grids(EPTuning(), "deep_gemm")
    assert not Pipeline.dispatch_waits_for_full_grids(EPTuning(), "triton")
    assert not Pipeline.dispatch_waits_for_full_grids(EPTuning(dispatch_beside_grid=True), "cutlass")


def _enqueued_consumer(dispatched: bool, called: bool) -> list:
    """What Pipeline._enqueue_consumer enqueues, per side stream, over three dispatch steps whose GEMM calls hold
    every SM, but call 1 (capped, e.g. by chunk_gemm_ctas); fakes for the streams, events and parts."""
    import contextlib
    from types import SimpleNamespace

    from streamring.moe.ep_pipeline import Pipeline

    log, side = [], ["caller"]

    class Ev:
        def __init__(self, name):
            self.name = name

        def record(self):
            log.append((side[0], "record", self.name))

    class St:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append((self.name, "wait", ev.name))

    class Progress:
        def stream(self, role):
            return St(role)

        def side(self, role):
            @contextlib.contextmanager
            def cm():
                prev, side[0] = side[0], role
                try:
                    yield
                finally:
                    side[0] = prev
            return cm()

    full = {0: True, 1: False, 2: True}
    ex = SimpleNamespace(
        queue=None, owner_rows=True, holds_every_sm=lambda p, i, rows: full[i],
        step_gemms=lambda p, layer, plan, c, j, comb, st, puts, ins: log.append((side[0], "gemm", j)),
        seal=lambda p, layer, plan, comb, st, puts, ins: log.append((side[0], "seal")))
    pl = object.__new__(Pipeline)
    pl.experts, pl.progress, pl.combine, pl.instrument = ex, Progress(), None, None
    pl.plan = SimpleNamespace(rows=4096)
    pl._dispatched = [Ev(f"dispatched{i}") for i in range(3)] if dispatched else []
    pl._called = [Ev(f"called{i}") for i in range(3)] if called else []
    pl.current_stream = lambda: St(side[0])
    pl._dispatch_step = lambda p, c, j, st: log.append((side[0], "dispatch", j))
    pl._enqueue_consumer(SimpleNamespace(order=[(0, 0), (0, 1), (0, 2)]), None)
    return log


def test_dispatch_after_full_grid_orders_each_step_behind_the_previous_full_grid_call():
    """EPTuning(dispatch_beside_grid=False) (the default, persistent grids): the consumer side is enqueued step by
    step; dispatch step i waits for GEMM call i-1's event exactly where that call holds every SM, every GEMM call
    waits for its own dispatch step only (so no call waits on a later step), and the seal's call comes last on the
    GEMM stream."""
    log = _enqueued_consumer(dispatched=True, called=True)
    assert log == [
        ("d", "dispatch", 0), ("d", "record", "dispatched0"),
        ("g", "wait", "dispatched0"), ("g", "gemm", 0), ("g", "record", "called0"),
        ("d", "wait", "called0"), ("d", "dispatch", 1), ("d", "record", "dispatched1"),
        ("g", "wait", "dispatched1"), ("g", "gemm", 1), ("g", "record", "called1"),
        ("d", "dispatch", 2), ("d", "record", "dispatched2"),
        ("g", "wait", "dispatched2"), ("g", "gemm", 2), ("g", "record", "called2"),
        ("g", "seal")]
    # every GEMM call waits on its own step's event only
    assert [e for s, k, e in (x for x in log if len(x) == 3) if s == "g" and k == "wait"] == \
        ["dispatched0", "dispatched1", "dispatched2"]


def test_dispatch_beside_the_grid_and_one_shared_stream_enqueue_no_wait_on_a_gemm_call():
    """The other enqueues of the same step loop: beside the grid (Triton, or dispatch_beside_grid=True) the dispatch
    stream waits on no GEMM call and each call waits on its own step; with dispatch and GEMMs on one stream
    (green_ctx) nothing waits on an event and the calls follow their steps in order."""
    beside = _enqueued_consumer(dispatched=True, called=False)
    assert [x for x in beside if x[0] == "d"] == [
        ("d", "dispatch", 0), ("d", "record", "dispatched0"), ("d", "dispatch", 1), ("d", "record", "dispatched1"),
        ("d", "dispatch", 2), ("d", "record", "dispatched2")]
    assert [x for x in beside if x[0] == "g"] == [
        ("g", "wait", "dispatched0"), ("g", "gemm", 0), ("g", "wait", "dispatched1"), ("g", "gemm", 1),
        ("g", "wait", "dispatched2"), ("g", "gemm", 2), ("g", "seal")]
    shared = _enqueued_consumer(dispatched=False, called=False)
    assert shared == [("d", "dispatch", 0), ("d", "gemm", 0), ("d", "dispatch", 1), ("d", "gemm", 1),
                      ("d", "dispatch", 2), ("d", "gemm", 2), ("g", "seal")]


def test_memory_report_takes_the_block_size_a_buffer_of_that_gemm_takes():
    """memory_report(block_m=None) sizes the blocks as EPBuffer does with EPTuning.block_m=None: 128-row blocks for
    CUTLASS and DeepGEMM, the shape's for Triton; an explicit block size is kept; an unknown gemm is named."""
    from bench.common import dsv3_shape

    shape = dsv3_shape(16, 64)
    sizes = dict(max_tokens_per_rank=1024, num_slots=2, tokens_per_slot=512)
    for gemm in ("cutlass", "deep_gemm"):
        assert memory_report(shape, 2, gemm=gemm, **sizes) == memory_report(shape, 2, gemm=gemm, block_m=128, **sizes)
        assert memory_report(shape, 2, gemm=gemm, **sizes) != memory_report(shape, 2, gemm=gemm, block_m=16, **sizes)
    assert memory_report(shape, 2, gemm="triton", **sizes) == memory_report(shape, 2, gemm="triton", block_m=16,
                                                                            **sizes)
    with pytest.raises(ValueError, match="gemm must be one of .*'tensor_cores'"):
        memory_report(shape, 2, gemm="tensor_cores", **sizes)


def test_a_host_held_delay_counts_from_the_start_of_the_launch():
    """The held delay runs from launching() (before a graph's launch is enqueued), not from launched() (after it):
    with a 100 ms delay and launched() 80 ms after launching(), the word is still held at 90 ms and released by
    130 ms (from launched() it would be 180 ms); never before the deadline."""
    import time
    from types import SimpleNamespace

    from streamring.moe import instrument as I

    inst = I.Instrument(SimpleNamespace(dev="cpu"))
    inst.hold = torch.ones(1, dtype=torch.int64)
    inst.set_delay(100_000_000)
    t0 = time.perf_counter()
    inst.launching()
    time.sleep(0.08)
    inst.launched()
    while time.perf_counter() - t0 < 0.09:
        time.sleep(0.001)
    assert int(inst.hold[0]) == 0, "released before its delay"
    while int(inst.hold[0]) == 0 and time.perf_counter() - t0 < 0.5:
        time.sleep(0.0005)
    waited = time.perf_counter() - t0
    assert 0.099 <= waited <= 0.13, f"released {waited * 1e3:.1f} ms after launching(), want 100 (from launched(): 180)"


def test_a_host_held_producer_delay_is_released_after_the_launch_and_never_left_held(monkeypatch):
    """Instrument's host-held delay (bench.ep_layer --delay-by host): set_delay(ns > 0) holds the word (0), each
    rearm holds it again, launched() releases it ns later; with no launch reported the fallback releases it
    HOLD_FALLBACK_S after the delay; a stale fallback never releases a newer hold; set_delay(0) releases at once."""
    import time
    from types import SimpleNamespace

    from streamring.moe import instrument as I

    inst = I.Instrument(SimpleNamespace(dev="cpu"))
    inst.hold = torch.ones(1, dtype=torch.int64)  # what hold_with_host allocates (pinned there)
    monkeypatch.setattr(I, "HOLD_FALLBACK_S", 0.3)
    inst.set_delay(50_000_000)  # 50 ms
    assert int(inst.hold[0]) == 0
    inst.rearm()
    inst.launched()
    time.sleep(0.02)
    assert int(inst.hold[0]) == 0, "released before its delay"
    time.sleep(0.1)
    assert int(inst.hold[0]) == 1, "not released after its delay"
    inst.rearm()  # the next replay, whose launch is never reported: the fallback releases it
    time.sleep(0.2)
    assert int(inst.hold[0]) == 0
    time.sleep(0.3)
    assert int(inst.hold[0]) == 1, "left held"
    inst.rearm()  # a stale fallback (of an earlier hold) must not release a later one early
    time.sleep(0.2)
    inst.rearm()
    time.sleep(0.2)  # the first hold's fallback (0.35 s after it) has fired by now
    assert int(inst.hold[0]) == 0, "a stale fallback released a later hold"
    time.sleep(0.25)
    assert int(inst.hold[0]) == 1
    inst.set_delay(0)
    assert int(inst.hold[0]) == 1
    inst.rearm()
    assert int(inst.hold[0]) == 1, "no delay pending: nothing held"
