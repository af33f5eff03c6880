"""bench.cost_model: the check's exit status, predictions moving the right way, --predict's files.
CPU only, numpy (matplotlib for the PNG); no ranks, no GPU."""
import json

import pytest

from bench import cost_model as cm
from streamring.device.gemm_grid import GEMM_GRID


def _row(median_ms, **kw):
    row = {"ranks": 2, "tokens_per_rank": 4096, "experts_per_pe": 32, "block_m": 64, "routing": "uniform",
           "path": "batch", "gemm": "triton", "chunks": 1, "num_slots": 1, "policy": "serialized",
           "source_order": "rank", "consumer": "per_chunk", "chunk_gemm_ctas": None, "straggler_ms": 0.0,
           "straggler_rank": None, "skew_ms": 0.0, "median_ms": median_ms, "gemm_grid": GEMM_GRID}
    row.update(kw)
    return row


def _predicted(**kw):
    row = _row(0.0, **kw)
    cfg = cm.Config(ranks=row["ranks"], tokens=row["tokens_per_rank"], experts_per_pe=row["experts_per_pe"],
                    gemm=row["gemm"], block_m=row["block_m"], path=row["path"], chunks=row["chunks"],
                    source_order=row["source_order"], machine="mps", straggler_ms=row["straggler_ms"],
                    straggler_rank=row["straggler_rank"], skew_ms=row["skew_ms"])
    return cm.predict(cfg)["total_ms"]


def _write(tmp_path, rows, name="ep-layer-mps-synthetic.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"rows": rows, "args": {}}))
    return str(p)


def test_check_fails_on_a_wrong_row_and_passes_on_the_prediction(tmp_path, capsys):
    streamed = dict(path="streamed", chunks=2, num_slots=2, source_order="arrival", straggler_ms=3.0,
                    straggler_rank=1)
    good = [_row(_predicted()), _row(_predicted(**streamed), **streamed)]
    assert cm.main(["--check", _write(tmp_path, good, "ep-layer-mps-good.json")]) == 0
    bad = good + [_row(2 * _predicted(tokens_per_rank=1024), tokens_per_rank=1024)]
    assert cm.main(["--check", _write(tmp_path, bad, "ep-layer-mps-bad.json")]) == 1
    out = capsys.readouterr().out
    assert "2 of 3 configurations within" in out and "(-50.0 %)" in out


def test_machine_override_and_skipped_rows(tmp_path):
    rows = [_row(_predicted()), _row(1.0, path="torch_nccl"), _row(1.0, consumer="persistent")]
    p = _write(tmp_path, rows, "ep-layer-other.json")            # the name says one GPU per PE
    loaded, skipped = cm.load_rows([p + ":mps"])
    assert len(loaded) == 1 and loaded[0][0].machine == "mps"
    assert skipped == {"path torch_nccl": 1, "consumer persistent": 1}
    assert cm.load_rows([p])[0][0][0].machine == "gpu"
    assert cm.main(["--check", p, "--machine", p + ":mps"]) == 0
    # a row names how its Triton grids were sized; rows from before the field had one CTA per tile of the bound
    older = {k: v for k, v in _row(1.0).items() if k != "gemm_grid"}
    got = cm.load_rows([_write(tmp_path, [_row(1.0), older], "ep-layer-mps-grids.json")])[0]
    assert [c.gemm_grid for c, *_ in got] == [GEMM_GRID, "bound"]


def test_predictions_move_the_right_way():
    base = dict(ranks=8, experts_per_pe=32, gemm="triton", machine="gpu")
    t = [cm.predict(dict(base, tokens=n))["total_ms"] for n in (128, 1024, 8192, 32768)]
    assert t == sorted(t) and t[0] < t[-1]
    # a late rank costs batch about L (the on-time producers overlap the wait)
    on = cm.predict(dict(base, tokens=4096))["total_ms"]
    for late in (1.0, 3.0):
        d = cm.predict(dict(base, tokens=4096, straggler_ms=late, straggler_rank=3))["total_ms"] - on
        assert 0.8 * late <= d <= 1.05 * late
    # more chunks: more GEMM calls, and more weight passes
    s2 = cm.predict(dict(base, tokens=8192, path="streamed", chunks=2, source_order="rank"))
    s4 = cm.predict(dict(base, tokens=8192, path="streamed", chunks=4, source_order="rank"))
    assert (s2["gemm_calls"], s4["gemm_calls"]) == (2, 4) and s4["gemm_ms"] > s2["gemm_ms"]
    a2 = cm.predict(dict(base, tokens=8192, path="streamed", chunks=2, source_order="arrival"))
    assert a2["gemm_calls"] == 2 * 8
    # inter-node dispatch slower than NVLink
    nv = cm.predict(dict(base, tokens=4096, link_GBps=cm.NVLINK_GBPS))
    ib = cm.predict(dict(base, tokens=4096, link_GBps=cm.INTER_NODE_GBPS))
    assert ib["dispatch_ms"] > nv["dispatch_ms"] and ib["total_ms"] > nv["total_ms"]
    # arrival order computes the on-time rows during L; rank order waits like batch does
    late = dict(base, tokens=8192, path="streamed", chunks=2, straggler_ms=3.0, straggler_rank=7)
    arr = cm.predict(dict(late, source_order="arrival"))["total_ms"]
    rank = cm.predict(dict(late, source_order="rank"))["total_ms"]
    assert arr < rank
    # skew: batch pays about the expected max S*R/(R+1)
    sk = cm.predict(dict(base, tokens=4096, skew_ms=2.0))["total_ms"] - on
    assert sk == pytest.approx(2.0 * 8 / 9, rel=0.1)


def test_pull_fraction():
    # a peer token is pulled when one of its K routes is mine: 1-(1-E/E_total)^K
    p = cm.predict(dict(ranks=2, tokens=1024, experts_per_pe=32, machine="mps"))
    assert p["pull_fraction"] == pytest.approx(1 - 0.5 ** 8)
    assert p["pulled_bytes"] == pytest.approx(1024 * (1 - 0.5 ** 8) * (7168 + 4 * 56))
    assert p["rows_per_pe"] == pytest.approx(1024 * 8)


def test_predict_writes_table_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert cm.main(["--predict", "--out", str(tmp_path)]) == 0
    csv_text = (tmp_path / "cost-model-predict.csv").read_text().splitlines()
    assert csv_text[0].startswith("link,") and len(csv_text) == 1 + 2 * 2 * 4 * 9
    assert (tmp_path / "cost-model-predict.md").read_text().count("| 64 |") == 4
    png = (tmp_path / "cost-model-predict.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000
    assert "streamed ÷ batch" in capsys.readouterr().out


def test_a_seal_call_of_its_own_is_one_more_weight_pass():
    base = dict(ranks=2, tokens=1024, experts_per_pe=32, gemm="triton", machine="mps")
    for path, chunks, order in (("batch", 1, "rank"), ("streamed", 1, "ready"), ("streamed", 2, "arrival")):
        cfg = dict(base, path=path, chunks=chunks, source_order=order, ready_window_us=None)
        merged, apart = cm.predict(cfg), cm.predict(dict(cfg, last_step_with_seal=False))
        assert apart["gemm_calls"] == merged["gemm_calls"] + 1
        assert apart["gemm_ms"] > merged["gemm_ms"] and apart["total_ms"] > merged["total_ms"]


def test_grouped_ready_steps_give_on_time_sources_one_call():
    """Ready order with a window: on-time sources share one step, so one GEMM call as the batch path's; a
    source later than the window gets a step and a call of its own; one source per step (the code before
    the grouping) pays a call per source."""
    base = dict(ranks=2, tokens=1024, experts_per_pe=32, gemm="triton", machine="mps", gemm_grid="bound")
    batch = cm.predict(dict(base, path="batch"))
    grouped = cm.predict(dict(base, path="streamed", chunks=1, source_order="ready"))
    apart = cm.predict(dict(base, path="streamed", chunks=1, source_order="ready", ready_window_us=None))
    assert grouped["gemm_calls"] == 1 and apart["gemm_calls"] == 2
    # batch's call (step 0's grid bound is the batch call's: both sources), plus step 1, an empty call with
    # the bound for one source (its Triton CTAs: bench.empty_grid measured what they cost)
    from bench import cost_model_core as core
    sch = core._Schedule(core._norm(dict(base, path="streamed", chunks=1, source_order="ready")), core.load_rates())
    assert sch.step_bound(0) == sch.batch_bound > sch.step_bound(1) > 0
    idle = sch.empty_ms(sch.step_bound(1))
    assert 0 < idle < 0.1 * batch["gemm_ms"]
    assert grouped["gemm_ms"] == pytest.approx(batch["gemm_ms"] + idle)
    assert apart["gemm_ms"] > 1.05 * grouped["gemm_ms"]
    # grids sized for the expected blocks: step 0 expects the batch call's blocks, step 1 one source's, so the
    # idle call launches CTAs for those (and its looping tail), fewer than its bound's
    exp = dict(base, gemm_grid="expected")
    sch_x = core._Schedule(core._norm(dict(exp, path="streamed", chunks=1, source_order="ready")), core.load_rates())
    idle_x = sch_x.grid_ms(sch_x.step_bound(1), sch_x.step_expect(1), 0.0)
    assert sch_x.step_expect(0) == sch_x.step_bound(0) - 96 and sch_x.step_expect(1) == sch_x.step_bound(1) - 96
    tail = 2 * core.TAIL_CTAS_PER_SM * (core.H200_SMS / 2) / core.TILES_PER_BLOCK
    # (the expectation in whole groups of 8 blocks, as the kernel's grid)
    assert idle_x == pytest.approx(sch_x.empty_ms(-(-sch_x.step_expect(1) // 8) * 8 + tail)) and 0 < idle_x < idle
    # with headroom the idle call launches a quarter more of the expected blocks' CTAs, and a call with blocks
    # past its expectation loses less to the tail than without
    sch_h = core._Schedule(core._norm(dict(base, gemm_grid="expected_headroom", path="streamed", chunks=1,
                                           source_order="ready")), core.load_rates())
    # (the headroom scales the routed rows' full blocks, not the partial block per expert)
    E, rows = sch_x.E, sch_x.chunk_tokens
    full = sch_x.step_expect(1) - E
    assert full == -(-rows * 8 // (2 * 64)) and sch_h.step_expect(1) - E == -(-rows * 8 * 1250 // (2 * 64 * 1000))
    idle_h = sch_h.grid_ms(sch_h.step_bound(1), sch_h.step_expect(1), 0.0)
    assert idle_h == pytest.approx(sch_h.empty_ms(-(-sch_h.step_expect(1) // 8) * 8 + tail)) and idle_x <= idle_h
    over = sch_x.step_expect(1) * 1.2
    assert sch_h.grid_ms(sch_h.step_bound(1), sch_h.step_expect(1), over) \
        < sch_x.grid_ms(sch_x.step_bound(1), sch_x.step_expect(1), over)
    with pytest.raises(ValueError, match="gemm_grid must be one of"):
        core._Schedule(core._norm(dict(base, gemm_grid="expectd")), core.load_rates()).step_expect(1)
    grouped_x = cm.predict(dict(exp, path="streamed", chunks=1, source_order="ready"))
    assert grouped_x["gemm_ms"] == pytest.approx(cm.predict(dict(exp, path="batch"))["gemm_ms"] + idle_x)
    late = cm.predict(dict(base, path="streamed", chunks=1, source_order="ready", straggler_ms=1.0,
                           straggler_rank=1))
    assert late["gemm_calls"] == 2
    # a source 10 µs late is caught by the window (one call) and missed by none (two); large forwards do not group
    near = dict(base, path="streamed", chunks=1, source_order="ready", straggler_ms=0.01, straggler_rank=1)
    assert cm.predict(near)["gemm_calls"] == 1 and cm.predict(dict(near, ready_window_us=0.0))["gemm_calls"] == 2
    assert cm.predict(dict(base, tokens=4096, path="streamed", chunks=1, source_order="ready"))["gemm_calls"] == 2
    # DeepGEMM: a grouped step never gets the psum layout, so each of the R steps, the empty one too, is a
    # whole-buffer call: the same loads of every buffer block, the same blocks computed over both calls (up
    # to the sampled partial blocks)
    dg = dict(base, gemm="deep_gemm", block_m=128, path="streamed", chunks=1, source_order="ready")
    assert cm.predict(dg)["gemm_calls"] == 2
    assert cm.predict(dg)["gemm_ms"] == pytest.approx(cm.predict(dict(dg, ready_window_us=None))["gemm_ms"], rel=0.01)


def test_deep_gemm_range_call_loads_the_whole_buffer():
    """A DeepGEMM call over a range loads and stores every block of the buffer (DG_SKIP_US each): an empty
    range costs that and the call's fixed cost, and it grows with the buffer, not with the range."""
    from bench import cost_model_core as core
    sch = core._Schedule(core._norm(dict(ranks=1, tokens=4096, experts_per_pe=256, gemm="deep_gemm",
                                         block_m=128, path="streamed", chunks=2, source_order="rank")),
                         core.load_rates())
    n_buf = -(-4096 * core.TOPK // 128) + 256
    assert sch._whole_call() == pytest.approx((core.CALL_US + n_buf * core.DG_SKIP_US) * 1e-3)
    assert sch._whole_call(100.0) > sch._whole_call()


def test_a_capped_grid_slows_mps_calls_only():
    """chunk_gemm_ctas=60 under MPS (one CTA per SM of a 66-SM client) runs the calls before the sealing one
    at 60/66 speed, as a looping grid of one CTA per SM (LOOP_ONE_PER_SM slower); on one GPU per PE the
    model keeps them as they are."""
    cfg = dict(ranks=2, tokens=4096, experts_per_pe=32, gemm="triton", path="streamed", chunks=4,
               source_order="ready", machine="mps", ready_window_us=None)
    free, capped = cm.predict(cfg), cm.predict(dict(cfg, chunk_gemm_ctas=60))
    assert capped["gemm_ms"] > free["gemm_ms"] * 1.2   # 66/60 * 1.19 on all but the sealing call
    gpu = dict(cfg, machine="gpu")
    assert cm.predict(dict(gpu, chunk_gemm_ctas=60))["gemm_ms"] == pytest.approx(cm.predict(gpu)["gemm_ms"])


def test_cutlass_chunk_order_reads_each_extra_pass_from_hbm():
    """CUTLASS streamed on one GPU per PE: each weight pass beyond the batch path's costs at least a full read
    of an expert's weights from HBM."""
    from bench import cost_model_core as core
    cfg = dict(ranks=1, tokens=4096, experts_per_pe=256, gemm="cutlass", machine="gpu", chunks=2,
               source_order="rank")
    extra = cm.predict(dict(cfg, path="streamed"))["gemm_ms"] - cm.predict(dict(cfg, path="batch"))["gemm_ms"]
    tt, _ = core._block_counts(4096 * core.TOPK / 256, 256, 2, 64, merged=True)
    t1, _ = core._block_counts(4096 * core.TOPK / 256, 256, 1, 64)
    assert extra >= (sum(tt) - t1[0]) * core.W_BYTES / (core.HBM_GBPS * 1e9) * 1e3


def test_measured_skew_draws_are_the_forwards_delays():
    """A row's measured draws are per-PE producer delays: draws that always delay PE 1 by 1 ms predict the
    forward with PE 1 1 ms late, and the prediction is the median forward over the draws, not their mean.
    (1024 tokens, one grouped step per source on time: a late source is not hidden, so delays move the
    forward.)"""
    base = dict(ranks=2, tokens=1024, experts_per_pe=32, gemm="triton", machine="mps", path="streamed",
                chunks=1, source_order="ready")
    late = {ms: cm.predict(dict(base, straggler_ms=ms, straggler_rank=1))["total_ms"] for ms in (0.0, 1.0, 3.0)}
    assert late[0.0] < late[1.0] < late[3.0]
    assert cm.predict(dict(base, skew_ms=2.0, skew_draws=((0.0, 1.0),) * 5))["total_ms"] == pytest.approx(late[1.0])
    mixed = ((0.0, 0.0), (0.0, 1.0), (0.0, 3.0))
    assert cm.predict(dict(base, skew_ms=3.0, skew_draws=mixed))["total_ms"] == pytest.approx(late[1.0])
    assert sum(late.values()) / 3 != pytest.approx(late[1.0])  # the mean would differ


def test_load_rows_gives_a_skew_row_its_draws(tmp_path):
    """A skew row of a result file is predicted over its own draws: its prediction is the one with
    bench.skew's draws for its seed and replay count, and moves with that count."""
    from bench import cost_model_core as core
    rows = [_row(5.0, path="streamed", chunks=1, source_order="ready", ready_window_us=50.0, skew_ms=2.0, n=n,
                 tokens_per_rank=1024, experts_per_pe=32) for n in (3, 30)]
    p = tmp_path / "ep-layer-mps-skew.json"
    p.write_text(json.dumps({"rows": rows}))
    loaded, _ = cm.load_rows([str(p)])
    assert [len(c.skew_draws) for c, *_ in loaded] == [3, 30]
    for c, _, r, _ in loaded:
        assert c.skew_draws == cm.measured_skew_draws(r, 2, 32)
        assert core.predict(c)["total_ms"] != pytest.approx(core.predict(dict(vars(c), skew_draws=None))["total_ms"])


def test_measured_skew_draws_are_the_benchs():
    """load_rows gives a skew row the draws bench.ep_layer timed it with: its seed, its n replays after the
    warm-ups."""
    from bench.skew import WARM_REPLAYS, skew_delays_ms, skew_seed
    r = {"skew_ms": 2.0, "n": 3, "tokens_per_rank": 4096}
    draws = cm.measured_skew_draws(r, 2, 32)
    assert draws == tuple(tuple(skew_delays_ms(2.0, WARM_REPLAYS + j, 2, skew_seed(4096, 32))) for j in range(3))
    assert cm.measured_skew_draws({"n": 3, "tokens_per_rank": 4096}, 2, 32) is None


def test_each_file_is_modelled_as_the_code_that_measured_it(tmp_path):
    assert cm.measured_code("any.json", {})["last_step_with_seal"] is True
    assert cm.measured_code("any.json", {})["ready_window_us"] is None  # files name their window since grouping
    assert cm.measured_code("any.json", {"separate_seal_gemms": True})["last_step_with_seal"] is False
    assert cm.measured_code("ep-layer-2h200-triton-128-8192-2026-11-30.json", {})["last_step_with_seal"] is False
    # the 2-H200 rows name no routing: they were routed by the router, and are kept, modelled as uniform
    assert cm.measured_code("ep-layer-2h200-triton-128-8192-2026-11-30.json", {})["routing"] == \
        "router_modelled_as_uniform"
    assert cm.measured_code("any.json", {})["routing"] == "uniform"
    streamed = dict(path="streamed", chunks=2, num_slots=2, source_order="ready")
    rows = [_row(5.0, gemm="cutlass"), _row(6.0, gemm="cutlass", **streamed), _row(6.0, **streamed)]
    p = tmp_path / "ep-layer-mps-chunk-combine.json"
    p.write_text(json.dumps({"rows": rows, "args": {"chunk_combine": True, "separate_seal_gemms": True}}))
    loaded, skipped = cm.load_rows([str(p)])
    # the CUTLASS streamed row ran with a stall the model has no term for: skipped by name, the rest kept
    assert skipped == {"chunk_combine (CUTLASS streamed)": 1}
    assert [(c.gemm, c.path, c.last_step_with_seal) for c, *_ in loaded] == [("cutlass", "batch", False),
                                                                             ("triton", "streamed", False)]


def test_the_fit_recovers_the_rates_that_made_the_rows(tmp_path):
    truth = json.loads(json.dumps(cm.load_rates()))
    rows = []
    for T in (1024, 4096, 8192):
        for kw in ({}, dict(path="streamed", chunks=1, source_order="ready", ready_window_us=20.0),
                   dict(path="streamed", chunks=2, num_slots=2, source_order="arrival")):
            # a row that names its window grouped its forward (load_rows reads it so)
            cfg = cm.Config(ranks=2, tokens=T, experts_per_pe=32, machine="mps", group_max_tokens=T,
                            **{k: v for k, v in kw.items() if k != "num_slots"})
            rows.append(_row(cm.predict(cfg, truth)["total_ms"], tokens_per_rank=T, **kw))
    p = _write(tmp_path, rows, "ep-layer-mps-synthetic-fit.json")
    start = json.loads(json.dumps(truth))
    g = start["gemm"]["triton@mps"]
    g["bw_GBps"], g["tflops"] = g["bw_GBps"] * 1.6, g["tflops"] * 0.6   # far from the truth
    fitted = cm.fit([p], [], start=start)["gemm"]["triton@mps"]
    for k in ("t_w_us", "t_b_us_block64"):
        assert fitted[k] == pytest.approx(truth["gemm"]["triton@mps"][k], rel=0.02), k


def test_grouped_steps_grids_grow_with_the_pes():
    """A chunk of the grouped ready order has R steps, each a Triton call with a grid bound for every source
    it may still take: on time the first takes them all and the R - 1 others are empty calls, whose CTAs
    grow with R * (R - 1) / 2 sources' blocks. The bound is the pipeline's."""
    from bench import cost_model_core as core
    from streamring.moe.grid_bounds import grouped_step_bound

    def grids(R, C=1, T=1024):
        sch = core._Schedule(core._norm(dict(ranks=R, tokens=T, experts_per_pe=32, gemm="triton", machine="gpu",
                                             path="streamed", chunks=C, source_order="ready", gemm_grid="bound")),
                             core.load_rates())
        chunk = -(-T // C)
        max_blocks = -(-R * chunk * C * 8 // 64) + 32   # the buffer's capacity: C chunks of ceil(T / C) tokens
        assert [sch.step_bound(j) for j in range(R)] == [grouped_step_bound(R, j, chunk, 8, 64, 32, max_blocks)
                                                         for j in range(R)]
        return sum(sch.empty_ms(sch.step_bound(j)) for j in range(1, R))
    assert grids(8) > 10 * grids(2)
    grids(4, C=3, T=1000)   # chunked, uneven: the pipeline's ceil(T / C) chunk and capacity
    base = dict(tokens=1024, experts_per_pe=32, gemm="triton", machine="gpu", chunks=1, source_order="ready",
                gemm_grid="bound")
    ratio = {}
    for rate in (core.EMPTY_BLOCK_US_SM, 0.0):
        old, core.EMPTY_BLOCK_US_SM = core.EMPTY_BLOCK_US_SM, rate
        try:
            streamed, batch = (cm.predict(dict(base, ranks=16, path=p))["total_ms"] for p in ("streamed", "batch"))
        finally:
            core.EMPTY_BLOCK_US_SM = old
        ratio[rate] = streamed / batch
    # at EP 16 the empty grids, not the GEMMs, cost the on-time forward
    assert ratio[core.EMPTY_BLOCK_US_SM] > 1.2 and ratio[0.0] < 1.05
    # grids sized for the expected blocks launch an idle step's CTAs for one source's blocks: within 3 % of no
    # grid cost at all
    x = {p: cm.predict(dict(base, ranks=16, path=p, gemm_grid="expected"))["total_ms"] for p in ("streamed", "batch")}
    assert x["streamed"] / x["batch"] < ratio[0.0] * 1.03


def test_grids_cost_under_mps_by_the_share():
    """A PE under MPS has 1/R of the SMs: the same empty blocks cost R times as long."""
    from bench import cost_model_core as core
    sch = {m: core._Schedule(core._norm(dict(ranks=4, tokens=1024, experts_per_pe=32, gemm="triton", machine=m,
                                             path="streamed", chunks=1, source_order="ready")), core.load_rates())
           for m in ("gpu", "mps")}
    assert sch["mps"].empty_ms(100) == pytest.approx(4 * sch["gpu"].empty_ms(100))


def test_a_late_grouped_step_pays_its_own_bound():
    """With a late source the first grouped step takes fewer sources than its bound allows: its grid past its
    blocks costs more than on time (step j's bound, not step 0's, for the late step)."""
    from bench import cost_model_core as core
    cfg = dict(ranks=4, tokens=1024, experts_per_pe=32, gemm="triton", machine="mps", path="streamed", chunks=1,
               source_order="ready", gemm_grid="bound")
    sch = core._Schedule(core._norm(cfg), core.load_rates())
    one_then_rest = sch.group_call([1], False, 0) + sch.group_call([1, 3], True, 1)
    rest_with_step0_bound = sch.group_call([1], False, 0) + sch.group_call([1, 3], True, 0)
    assert rest_with_step0_bound > one_then_rest
    # grids sized for the expected blocks: blocks past a call's expectation (here an expectation of none) run on
    # the looping tail, TAIL_SLOWDOWN slower than one CTA per tile; step 0 (expecting every source) launches CTAs
    # for all; a late step expects one source's blocks: with fewer, it pays the CTAs past them and the tail's
    x = core._Schedule(core._norm(dict(cfg, gemm_grid="expected")), core.load_rates())
    _, blocks = core._group_block_counts(x.rows / x.E, x.E, (1, 3), 64, merged=True, parts=4)
    g = core.load_rates()["gemm"]["triton@mps"]
    t_b = 64 * core.FLOP_ROW / (g["tflops"] * 1e12) * 1e3
    assert x.grid_ms(x.step_bound(1), 0, blocks[1]) == pytest.approx(blocks[1] * 4 * t_b * core.TAIL_SLOWDOWN)
    assert x.grid_ms(x.step_bound(0), x.step_expect(0), blocks[0]) > x.empty_ms(x.step_expect(0) - blocks[0]) > 0
    tail = 2 * core.TAIL_CTAS_PER_SM * (core.H200_SMS / 4) / core.TILES_PER_BLOCK
    assert x.grid_ms(x.step_bound(1), x.step_expect(1), 50.0) \
        == pytest.approx(x.empty_ms(-(-x.step_expect(1) // 8) * 8 + tail - 50))


def test_a_steps_dispatch_hides_under_the_previous_call_in_the_current_code():
    """With a step per source, the current code dispatches a step while the previous step's call runs, so the
    forward is shorter by about the hidden dispatches; files of the code before the dispatch's own sort kernel
    are modelled with the dispatch after the call (MEASURED_CODE), later files with the overlap."""
    cfg = dict(ranks=2, tokens=4096, experts_per_pe=32, gemm="triton", path="streamed", chunks=4,
               source_order="arrival", machine="mps", ready_window_us=None)
    over, serial = cm.predict(cfg), cm.predict(dict(cfg, dispatch_during_gemm=False))
    assert over["dispatch_ms"] == pytest.approx(serial["dispatch_ms"])
    hidden = serial["total_ms"] - over["total_ms"]
    # 8 steps: every dispatch but the first (the PE's own source: d_fix alone, no peer bytes) can hide, and at
    # 4096 tokens each call is longer than the next dispatch, so they all do
    first = cm.load_rates()["machine"]["mps"]["d_fix_us"] * 1e-3
    assert hidden == pytest.approx(over["dispatch_ms"] - first), (hidden, over)
    # batch has one step: nothing to hide
    b = dict(cfg, path="batch")
    assert cm.predict(b)["total_ms"] == pytest.approx(cm.predict(dict(b, dispatch_during_gemm=False))["total_ms"])
    assert cm.measured_code("ep-layer-mps2-32experts-one-chunk-late-ranks-2026-12-03.json", {})[
        "dispatch_during_gemm"] is False
    assert cm.measured_code("ep-layer-2h200-triton-128-8192-2026-11-30.json", {})["dispatch_during_gemm"] is False
    assert cm.measured_code("ep-layer-mps2-32experts-one-chunk-paired-2026-12-03.json", {})[
        "dispatch_during_gemm"] is True


def test_the_models_choice_weighs_the_buffers_plan_on_time_and_late():
    """choose_by_model: the buffer's own plan against batch in the model, on time and with a late PE; it says
    it was the model, streams where the model's regret favours it (2 PEs, 32 experts each: a late PE is
    most of the difference) and not where every source step costs a weight pass more than it hides
    (EP64 at 1024 tokens: 4 experts per PE, 64 calls), and refuses shapes its rates do not cover."""
    from bench import cost_model_core as core

    kw = dict(gemm="triton", block_m=64, chunks=1, source_order="ready", link_GBps=450.0)
    two = core.choose_by_model(8192, ranks=2, experts_per_pe=32, **kw)
    assert (two.source, two.path, two.chunks, two.source_order) == ("model", "streamed", 1, "ready"), two
    wide = core.choose_by_model(1024, ranks=64, experts_per_pe=4, **kw)
    assert (wide.source, wide.path) == ("model", "batch") and "regret" in wide.note, wide
    other = core.choose_by_model(8192, ranks=2, experts_per_pe=32, shape=(4096, 2048, 6), **kw)
    assert other.path == "batch" and "covers" in other.note
