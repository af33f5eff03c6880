"""gemm="auto" from whole-layer rows (streamring/moe/layer_choice.py, bench/make_layer_table.py)."""

import json
from pathlib import Path

import pytest

from bench.common import dsv3_shape
from bench.make_layer_table import layer_rows
from streamring.gemm import choice as GC
from streamring.moe import layer_choice
from streamring.moe.ep_config import resolve_gemm

ROOT = Path(__file__).resolve().parents[2]
BOTH = {"triton": "", "cutlass": ""}
SETTING = dict(ranks=2, experts_per_pe=32, hidden=7168, intermediate=2048, topk=8, block_m=64)


def row(tokens, ms, run="r", **setting):
    return {**SETTING, **setting, "tokens_per_rank": tokens, "batch_ms": ms, "run": run}


ROWS = [row(1024, {"cutlass": 3.95, "triton": 3.37}), row(4096, {"cutlass": 8.61, "triton": 10.28})]


def test_the_faster_layer_wins_not_the_faster_gemms():
    c = layer_choice.choose(SETTING, 1024, BOTH, ROWS)
    assert c.impl == "triton" and "triton 3.370 ms, cutlass 3.950 ms" in c.source
    assert layer_choice.choose(SETTING, 4096, BOTH, ROWS).impl == "cutlass"
    # the nearest row in tokens per PE, within a factor of 2
    assert layer_choice.choose(SETTING, 700, BOTH, ROWS).impl == "triton"
    assert layer_choice.choose(SETTING, 3000, BOTH, ROWS).impl == "cutlass"
    assert layer_choice.choose(SETTING, 256, BOTH, ROWS) is None
    assert layer_choice.choose(SETTING, 16384, BOTH, ROWS) is None


def test_a_row_decides_only_between_available_backends_of_the_same_setting():
    # one available backend measured: nothing to compare, the GEMM table decides
    assert layer_choice.choose(SETTING, 1024, {"triton": "", "cutlass": "not built"}, ROWS) is None
    for other in (dict(ranks=1), dict(block_m=16), dict(experts_per_pe=64), dict(hidden=4096)):
        assert layer_choice.choose({**SETTING, **other}, 1024, BOTH, ROWS) is None, other


def test_a_backends_streamed_plan_counts_where_it_is_its_faster_path():
    # decode, 2 PEs, block_m 128: CUTLASS's batch path is the slower, its streamed plan the fastest of all
    r = row(128, {"cutlass": 1.93, "triton": 1.83}, block_m=128, streamed_ms={"cutlass": 1.36, "triton": 1.84})
    c = layer_choice.choose({**SETTING, "block_m": 128}, 128, BOTH, [r])
    assert c.impl == "cutlass"
    assert "cutlass 1.360 ms streamed (batch 1.930), triton 1.830 ms" in c.source
    # a streamed plan slower than its batch path changes nothing; without streamed rows the batch medians decide
    slow = row(128, {"cutlass": 1.93, "triton": 1.83}, block_m=128, streamed_ms={"cutlass": 2.5})
    assert layer_choice.choose({**SETTING, "block_m": 128}, 128, BOTH, [slow]).impl == "triton"
    # an unavailable backend's streamed time never decides
    assert layer_choice.choose({**SETTING, "block_m": 128}, 128, {"triton": "", "cutlass": "not built"}, [r]) is None


def test_resolve_gemm_takes_the_layer_row_and_the_backends_own_variants(monkeypatch, tmp_path):
    path = tmp_path / "layer_table.json"
    path.write_text(json.dumps({"rows": [row(1024, {"cutlass": 3.37, "triton": 3.95})]}))
    monkeypatch.setattr(layer_choice, "TABLE_PATH", path)
    shape = dsv3_shape(64, 64)
    monkeypatch.setattr(GC, "available_impls", lambda bm: dict(BOTH))
    monkeypatch.setattr(GC.backend("cutlass"), "require", lambda bm: None)
    c = resolve_gemm("auto", shape, 2, 1024, 64)
    assert c.impl == "cutlass" and c.source.startswith("measured layer: cutlass 3.370 ms, triton 3.950 ms")
    assert c.l1.impl == c.l2.impl == "cutlass"
    # no row of the setting: the GEMM table, as before
    assert not resolve_gemm("auto", shape, 2, 8192 * 4, 64).source.startswith("measured layer")
    assert resolve_gemm("triton", shape, 2, 1024, 64).impl == "triton"  # an explicit choice is never overridden


def test_the_table_maker_compares_backends_only_within_one_run():
    base = dict(path="batch", lateness="none", straggler_ms=0.0, skew_ms=0.0, chunk_gemm_ctas=None,
                reserved_sms=None, ranks=2, experts_per_pe=32, block_m=64, tokens_per_rank=1024, shape="dsv3")
    rows = [{**base, "run": "a", "gemm": "cutlass", "median_ms": 4.0},
            {**base, "run": "a", "gemm": "cutlass", "median_ms": 3.9},  # twice in one run: the smaller
            {**base, "run": "a", "gemm": "triton", "median_ms": 3.4},
            {**base, "run": "a", "gemm": "triton", "median_ms": 2.0, "path": "streamed"},
            {**base, "run": "a", "gemm": "triton", "median_ms": 1.0, "straggler_ms": 3.0},
            {**base, "run": "b", "gemm": "cutlass", "median_ms": 1.0}]  # alone in its run: no row
    out = layer_rows(rows)
    assert len(out) == 1 and out[0]["batch_ms"] == {"cutlass": 3.9, "triton": 3.4} and out[0]["run"] == "a"
    assert {k: out[0][k] for k in SETTING} == SETTING
    assert "streamed_ms" not in out[0]  # the streamed row above is not the default plan (no chunks, order, ...)


def test_the_table_maker_keeps_only_the_default_streamed_plan_on_time():
    base = dict(lateness="none", straggler_ms=0.0, skew_ms=0.0, chunk_gemm_ctas=None, reserved_sms=None, ranks=2,
                experts_per_pe=32, block_m=128, tokens_per_rank=128, shape="dsv3", run="a")
    plan = dict(path="streamed", chunks=1, source_order="ready", consumer="per_chunk", policy="spin_kernel",
                streamed_grid_waves=1, launch_ahead=False)
    rows = [{**base, "path": "batch", "gemm": "cutlass", "median_ms": 1.93},
            {**base, "path": "batch", "gemm": "triton", "median_ms": 1.83},
            {**base, **plan, "gemm": "cutlass", "median_ms": 1.40},
            {**base, **plan, "gemm": "cutlass", "median_ms": 1.36},  # twice: the smaller
            {**base, **plan, "gemm": "triton", "median_ms": 1.84},
            {**base, **plan, "gemm": "cutlass", "median_ms": 1.0, "chunk_gemm_ctas": 60},  # not the default grid
            {**base, **plan, "gemm": "cutlass", "median_ms": 1.0, "chunks": 2},
            {**base, **plan, "gemm": "cutlass", "median_ms": 1.0, "straggler_ms": 3.0},
            {**base, **plan, "gemm": "cutlass", "median_ms": 1.0, "launch_ahead": True},
            {**base, **plan, "gemm": "cutlass", "median_ms": 1.0, "streamed_grid_waves": 2}]
    (out,) = layer_rows(rows)
    assert out["batch_ms"] == {"cutlass": 1.93, "triton": 1.83}
    assert out["streamed_ms"] == {"cutlass": 1.36, "triton": 1.84}


def test_the_committed_table_is_what_its_sources_make(tmp_path):
    from bench.make_layer_table import main

    committed = json.loads(layer_choice.TABLE_PATH.read_text())
    sources = [str(ROOT / p) for p in committed["produced_by"].split()[3:]]
    assert sources and main([*sources, "--out", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["rows"] == committed["rows"]
    assert all(len(r["batch_ms"]) >= 2 for r in layer_choice.load_table())


def test_a_malformed_row_names_its_field(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"rows": [{"ranks": 2}]}))
    with pytest.raises(ValueError, match=r"rows\[0\] has no .*'batch_ms'"):
        layer_choice.load_table(p)


def test_the_committed_decode_rows_take_cutlass_for_its_streamed_path():
    # 2 PEs, 32 experts, block_m 128, decode: CUTLASS's batch layer is the slower, its streamed one the fastest
    setting = {**SETTING, "block_m": 128}
    for tokens in (128, 256):
        c = layer_choice.choose(setting, tokens, BOTH)
        assert c is not None and c.impl == "cutlass", (tokens, c)
        assert "streamed (batch" in c.source.split(",")[0], c.source


def test_an_open_block_size_is_128_where_cutlass_or_deep_gemm_compute(monkeypatch, tmp_path):
    """EPTuning.block_m=None: 128-row blocks where the GEMMs are CUTLASS or DeepGEMM (asked for, or what "auto"
    resolves to at 128), the shape's block size otherwise; an explicit block size is never changed."""
    from streamring.moe import ep_config as CFG

    path = tmp_path / "layer_table.json"
    path.write_text(json.dumps({"rows": [
        row(4096, {"cutlass": 8.20, "triton": 11.45}, block_m=128),
        row(1024, {"cutlass": 4.30, "triton": 4.15}, block_m=128)]}))
    monkeypatch.setattr(layer_choice, "TABLE_PATH", path)
    monkeypatch.setattr(GC, "available_impls", lambda bm: dict(BOTH))
    monkeypatch.setattr(GC.backend("cutlass"), "require", lambda bm: None)
    shape = dsv3_shape(16, 64)
    bm, c = CFG.resolve_block_and_gemm("auto", shape, 2, 4096, None)
    assert (bm, c.impl) == (128, "cutlass")
    # "auto" resolving to Triton at 128: the shape's block size, and the GEMMs resolved again there
    bm, c = CFG.resolve_block_and_gemm("auto", shape, 2, 1024, None)
    assert bm == shape.block_m == 16 and c == resolve_gemm("auto", shape, 2, 1024, 16)
    assert CFG.resolve_block_and_gemm("cutlass", shape, 2, 1024, None)[0] == 128
    assert CFG.resolve_block_and_gemm("triton", shape, 2, 4096, None)[0] == 16
    assert CFG.resolve_block_and_gemm("auto", shape, 2, 4096, 64)[0] == 64
    # CUTLASS not built: "auto" takes Triton, on the shape's block size
    monkeypatch.setattr(GC, "available_impls", lambda bm: {"triton": "", "cutlass": "not built"})
    bm, c = CFG.resolve_block_and_gemm("auto", shape, 2, 4096, None)
    assert (bm, c.impl) == (16, "triton")


def test_a_persistent_consumer_takes_the_gemms_it_runs_when_left_open(monkeypatch, tmp_path):
    """EPTuning(consumer="persistent") with gemm="auto" where CUTLASS is built and faster: the buffer's GEMMs are the
    backend the persistent kernel is made of (Triton), which check_gemm accepts; an explicit CUTLASS is still refused
    with the field named, and the per-chunk consumer keeps auto's answer."""
    from streamring.moe import ep_config as CFG
    from streamring.moe.tuning import EPTuning

    path = tmp_path / "layer_table.json"
    path.write_text(json.dumps({"rows": [row(4096, {"cutlass": 8.20, "triton": 11.45}, block_m=128)]}))
    monkeypatch.setattr(layer_choice, "TABLE_PATH", path)
    monkeypatch.setattr(GC, "available_impls", lambda bm: dict(BOTH))
    monkeypatch.setattr(GC.backend("cutlass"), "require", lambda bm: None)
    shape = dsv3_shape(16, 64)
    persistent = EPTuning(consumer="persistent")
    assert CFG.consumer_gemm("auto", persistent) == "triton"
    bm, c = CFG.resolve_block_and_gemm(CFG.consumer_gemm("auto", persistent), shape, 2, 4096, None)
    assert (bm, c.impl) == (shape.block_m, "triton")
    CFG.check_gemm(persistent, c.impl, on_gpu=True)
    with pytest.raises(ValueError, match="tuning.consumer 'persistent'.*got 'cutlass'"):
        CFG.check_gemm(persistent, CFG.consumer_gemm("cutlass", persistent), on_gpu=True)
    per_chunk = EPTuning()
    assert CFG.consumer_gemm("auto", per_chunk) == "auto"
    assert CFG.resolve_block_and_gemm(CFG.consumer_gemm("auto", per_chunk), shape, 2, 4096, None)[1].impl == "cutlass"
