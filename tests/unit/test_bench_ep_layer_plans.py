"""bench.ep_layer: its plan grid (the ready order's grouping window is a dimension of that order only) and the
skew rows' first-source wait."""

import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="bench.ep_layer needs torch")
if not torch.cuda.is_available():  # before bench.ep_layer imports Triton (as every Triton test sets it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.skew import WARM_REPLAYS, skew_delays_ms  # noqa: E402

ep_layer = pytest.importorskip("bench.ep_layer", reason="bench.ep_layer needs torch")


def _args(**kw):
    base = dict(chunks=[1, 2], orders=["ready", "arrival"], policies=["spin_kernel"], ctas=[None],
                consumers=["per_chunk"], reserved_sms=[16], ready_windows_us=[None], waves=[None],
                group_max_tokens=[None])
    base.update(kw)
    return SimpleNamespace(**base)


def test_ready_windows_multiply_the_ready_plans_only():
    plans = ep_layer.plans_for(_args(ready_windows_us=[0.0, 50.0]), 1024, "triton")
    ready = [p for p in plans if p[3] == "ready"]
    arrival = [p for p in plans if p[3] == "arrival"]
    assert sorted({p[6] for p in ready}) == [0.0, 50.0] and len(ready) == 2 * 2  # 2 chunkings x 2 windows
    assert {p[6] for p in arrival} == {None} and len(arrival) == 2


def test_grid_waves_multiply_the_plans_of_the_gemms_that_have_them_only():
    """--waves is a dimension of the GEMMs whose own grid is persistent (CUTLASS: Capabilities.waves) and of
    'auto' (which may resolve to one); the grouping bound one of the ready order only."""
    args = _args(waves=[1, 4], group_max_tokens=[0, 8192])
    cut = ep_layer.plans_for(args, 1024, "cutlass")
    tri = ep_layer.plans_for(args, 1024, "triton")
    assert {p[7] for p in cut} == {1, 4} and {p[7] for p in tri} == {None}
    assert len(cut) == 2 * len(tri)
    assert {p[8] for p in tri if p[3] == "ready"} == {0, 8192} and {p[8] for p in tri if p[3] == "arrival"} == {None}


def test_the_default_window_is_the_tunings():
    plans = ep_layer.plans_for(_args(), 1024, "triton")
    assert {p[6] for p in plans} == {None}  # None: EPTuning's default, not a value of the plan


def test_first_wait_takes_off_each_replays_own_earliest_delay():
    """A streamed time that is the on-time forward plus the replay's earliest producer delay has nothing
    left over it once first_wait takes that delay off; the draws are those of the timed replays (past the
    warm-ups), so a shifted index would leave a residue."""
    import inspect
    import statistics

    from bench import common
    # the draws first_wait takes are those of the replays bench.common times (its warm-ups first)
    assert inspect.signature(common.timed_rounds).parameters["warm"].default == WARM_REPLAYS
    assert inspect.signature(common.timed).parameters["warm"].default == WARM_REPLAYS
    seed, skew, ranks, n = 127008, 2.0, 2, 30
    waits = [min(skew_delays_ms(skew, WARM_REPLAYS + j, ranks, seed)) for j in range(n)]
    rest = [10.0 + (j % 7) * 0.1 for j in range(n)]   # the forward less its wait, varying by replay
    fw = ep_layer.first_wait([r + w for r, w in zip(rest, waits)], skew, ranks, seed)
    assert fw["streamed_less_first_wait_ms"] == pytest.approx(statistics.median(rest), abs=1e-12)
    assert fw["first_wait_ms"] == pytest.approx(statistics.median(waits))
    assert statistics.mean(rest) != pytest.approx(statistics.median(rest))
    assert 0.0 < fw["first_wait_ms"] < skew
    shifted = [10.0 + min(skew_delays_ms(skew, j, ranks, seed)) for j in range(n)]
    assert abs(ep_layer.first_wait(shifted, skew, ranks, seed)["streamed_less_first_wait_ms"] - 10.0) > 1e-3


def test_hot_routing_loads_pe_0_past_its_even_share():
    """``hot`` routing: distinct experts per token, and on 2 PEs of 32 experts PE 0 (experts 0..31) gets well
    past half the routes, so its GEMM calls have blocks past their even-routing expectations; uniform routing
    stays near half."""
    from streamring.moe.math import MoEShape

    shape = MoEShape(hidden=128, intermediate=128, num_experts=64, topk=8, router="deepseek_v3", n_group=8,
                     topk_group=4, routed_scaling_factor=2.5, weight_dtype="fp8", block_m=16)
    share = {}
    for name in ("hot", "uniform"):
        idx, w = ep_layer.ROUTINGS[name](4096, shape, 77, "cpu")
        assert idx.shape == (4096, 8) and idx.dtype == torch.int64 and w.shape == (4096, 8)
        assert (idx.sort(1).values.diff(dim=1) > 0).all(), f"{name}: an expert twice in one token's routes"
        share[name] = (idx < 32).float().mean().item()
    assert 0.62 < share["hot"] < 0.78 and abs(share["uniform"] - 0.5) < 0.02, share


def test_an_unknown_routing_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exc:
        ep_layer.main(["--routings", "uniform,zipf"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "['zipf'] not among ['uniform', 'hot', 'router']" in err, err


def _row(case, streamed, batch, streams, **kw):
    return {"path": "streamed", "median_ms": streamed, "batch_paired_ms": batch, "auto_streams": streams,
            "auto_source": "table", "tokens_per_rank": 1024, **kw, **case}


def test_auto_verdict_weighs_the_path_auto_takes_against_the_better_one():
    """Where auto streams, a case in which batch is faster counts against it (and the reverse): the verdict is
    the worst such ratio over the cases, and misses past 1.02."""
    on, late = {}, {"straggler_rank": 1, "straggler_ms": 3.0}
    v = ep_layer.auto_verdict([_row(on, 10.1, 10.0, True), _row(late, 10.2, 12.0, True)])
    assert "streams (table)" in v and "worst (-) 1.010x" in v and v.endswith(" ok"), v
    v = ep_layer.auto_verdict([_row(on, 10.1, 10.0, False), _row(late, 10.2, 12.0, False)])
    assert "keeps batch" in v and "worst (r1+3) 1.176x" in v and v.endswith("MISSED"), v
    assert ep_layer.auto_verdict([{"path": "streamed", "median_ms": 1.0, "batch_paired_ms": 1.0}]) is None


def test_lateness_kinds_are_labelled_and_judged_by_their_own_rule():
    """An idle-before-the-layer row is judged against the on-time batch (hidden or not); a busy or beside row
    against batch in the same case with the late PE's other work no more than 3 % slower; a producer delay keeps
    its plain label; an unknown kind is refused by name."""
    base = {"path": "streamed", "tokens_per_rank": 4096, "experts_per_pe": 32, "routing": "uniform", "gemm": "cutlass",
            "chunks": 1, "chunk_tokens": 4096, "policy": "spin_kernel", "source_order": "ready", "median_ms": 9.0}
    rows = [{**base, "over_batch_on_time": 0.99, "streamed_over_batch": 0.99, "straggler_rank": None},
            {**base, "lateness": "idle", "launch_ahead": True, "straggler_rank": 1, "straggler_ms": 3.0,
             "over_batch_on_time": 1.01, "streamed_over_batch": 0.8},
            {**base, "lateness": "busy", "launch_ahead": True, "straggler_rank": 0, "straggler_ms": 3.0,
             "over_batch_on_time": 1.3, "streamed_over_batch": 0.99, "other_work_over_batch": 1.05},
            {**base, "lateness": "producer", "straggler_rank": 1, "straggler_ms": 1.0, "over_batch_on_time": 1.0,
             "streamed_over_batch": 0.95}]
    assert [ep_layer.case_label(r) for r in rows] == ["-", "idle^:r1+3", "busy^:r0+3", "r1+1"]
    v = ep_layer.verdicts(rows)
    assert "idle^:r1+3 1.010x on-time batch hidden" in v, v
    assert "busy^:r0+3 0.990x batch same case, other work 1.050x MISSED" in v, v
    assert "worst late (r1+1) 1.000x on-time batch hidden" in v, v
    with pytest.raises(SystemExit):
        ep_layer.main(["--lateness", "producer,sleepy"])


def test_block_m_default_is_the_buffers_own_rule_and_a_bad_value_is_named():
    import argparse

    assert ep_layer.block_m_arg("default") is None
    assert ep_layer.block_m_arg("128") == 128
    with pytest.raises(argparse.ArgumentTypeError, match="--block-m .*'default'.*'big'"):
        ep_layer.block_m_arg("big")
