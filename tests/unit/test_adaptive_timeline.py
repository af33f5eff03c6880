"""The adaptive table/choice and the `streamring timeline` command (no GPU needed)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from streamring.moe import adaptive

ROOT = Path(__file__).resolve().parents[2]


def test_repo_table_loads_and_choices_are_consistent():
    t = adaptive.load_table()
    assert "produced_by" in t and t["rows"]
    for r in t["rows"]:
        c = adaptive.choose(r["tokens"], t, gemm=r.get("gemm"), ranks=r.get("ranks"),
                            experts_per_pe=r.get("experts_per_pe"), block_m=r["block_m"])
        assert c.path == r["path"]
        # a streamed row in the repo table must come with a measured win over batch: on time, or in regret
        # over the late-rank cases measured with it
        if r["path"] == "streamed":
            assert r["streamed_over_batch"] < 1.0 or r["streamed_regret"] < r["batch_regret"], r


def test_choice_between_and_below_measured_sizes():
    table = {"rows": [{"tokens": 128, "path": "batch", "block_m": 16},
                      {"tokens": 8192, "path": "streamed", "block_m": 64, "chunks": 4, "num_slots": 4,
                       "policy": "spin_kernel", "streamed_over_batch": 0.96}]}
    assert adaptive.choose(64, table).path == "batch"  # below every row: the smallest row
    assert adaptive.choose(4096, table).path == "batch"
    c = adaptive.choose(10000, table)
    assert (c.path, c.chunk_tokens, c.num_slots, c.policy, c.block_m) == ("streamed", 2500, 4, "spin_kernel", 64)
    assert adaptive.choose(8192 * 4, table).table_tokens == 8192


def test_choice_keeps_the_rows_of_the_gemm_and_rank_count():
    table = {"rows": [{"tokens": 1024, "gemm": "triton", "ranks": 2, "path": "streamed", "block_m": 64, "chunks": 2,
                       "num_slots": 2, "policy": "spin_kernel", "streamed_over_batch": 0.93},
                      {"tokens": 1024, "gemm": "cutlass", "ranks": 2, "path": "batch", "block_m": 64}]}
    assert adaptive.choose(2048, table, gemm="triton", ranks=2).path == "streamed"
    assert adaptive.choose(2048, table, gemm="cutlass", ranks=2).path == "batch"
    none = adaptive.choose(2048, table, gemm="triton", ranks=8)
    assert none.path == "batch" and "no measured row" in none.note


def test_the_rows_of_the_buffers_block_size_decide_near_their_token_counts():
    def row(tokens, bm, path):
        r = {"tokens": tokens, "gemm": "cutlass", "ranks": 2, "experts_per_pe": 32, "path": path, "block_m": bm}
        if path == "streamed":
            r.update(chunks=1, num_slots=1, policy="spin_kernel", source_order="ready", streamed_over_batch=0.9)
        return r

    table = {"rows": [row(128, 128, "streamed"), row(256, 128, "streamed"), row(128, 64, "batch"),
                      row(256, 64, "batch"), row(4096, 64, "batch")]}
    pick = lambda tokens, bm: adaptive.choose(tokens, table, gemm="cutlass", ranks=2, experts_per_pe=32,  # noqa: E731
                                              block_m=bm, min_chunk_tokens=1)
    assert [pick(t, 128).path for t in (64, 128, 256, 512)] == ["streamed"] * 4  # its own rows, within 2x
    assert [pick(t, 64).path for t in (128, 256, 512)] == ["batch"] * 3
    # its own rows far from the count do not extrapolate: the other sizes' rows decide
    assert (pick(1024, 128).path, pick(1024, 128).block_m, pick(1024, 128).table_tokens) == ("batch", 64, 256)
    assert pick(4096, 128).path == "batch" and pick(4096, 128).table_tokens == 4096
    # no row of its own block size: the rows of every size, of one token count the nearest block size
    assert pick(256, 112).path == "streamed" and pick(256, 80).path == "batch"
    assert pick(256, None).block_m == 64  # no block size given: the smallest distance to 0
    # below every row: the smallest token count's row of the nearest block size
    table["rows"] = [row(1024, 128, "streamed"), row(1024, 64, "batch")]
    assert pick(16, 112).path == "streamed" and pick(16, 80).path == "batch"


def _make_table(tmp_path, bench: dict, gemm_suffix: str = "") -> Path:
    """``python -m bench.make_adaptive_table`` on ``bench`` (written to a file; ``gemm_suffix``: its ``:GEMM``),
    the table's path (asserts the command succeeded)."""
    src, out = tmp_path / "bench.json", tmp_path / "table.json"
    src.write_text(json.dumps(bench))
    r = subprocess.run([sys.executable, "-m", "bench.make_adaptive_table", f"{src}{gemm_suffix}", "--out", str(out)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return out


def test_make_adaptive_table_reads_the_ep_layer_benchmark(tmp_path):
    """The EP-layer benchmark form: one row per path; stragglers and failed checks are not candidates."""
    def row(path, ms, **kw):
        return {"ranks": 2, "tokens_per_rank": 4096, "block_m": 64, "path": path, "straggler_ms": 0.0,
                "median_ms": ms, "bitwise_equal_to_batch": True, **kw}
    stream = dict(chunks=2, num_slots=2, policy="spin_kernel", ok=True)
    bench = {"rows": [row("batch", 8.0), row("streamed", 7.6, streamed_over_batch=0.95, **stream),
                      row("streamed", 5.0, streamed_over_batch=0.625, **{**stream, "ok": False}),
                      {**row("streamed", 4.0, streamed_over_batch=0.5, **stream), "straggler_ms": 1.0},
                      row("batch", 9.0, gemm="cutlass"),
                      row("streamed", 9.9, gemm="cutlass", streamed_over_batch=1.1, **stream),
                      # experiment switches a default buffer does not run, and the host-held delay: no candidates
                      row("streamed", 7.2, gemm="cutlass", streamed_over_batch=0.8, dispatch_beside_grid=True,
                          **stream),
                      row("streamed", 7.2, gemm="cutlass", streamed_over_batch=0.8, seal_by_expert=False, **stream),
                      row("streamed", 7.2, gemm="cutlass", streamed_over_batch=0.8, delay_by="host", **stream)]}
    out = _make_table(tmp_path, bench, ":triton")
    t = adaptive.load_table(out)
    by = {row["gemm"]: row for row in t["rows"]}
    assert by["triton"]["path"] == "streamed" and by["triton"]["streamed_over_batch"] == 0.95  # not 0.625 or 0.5
    assert by["cutlass"]["path"] == "batch" and "1.100x" in by["cutlass"]["reason"]
    assert adaptive.choose(4096, t, gemm="triton", ranks=2).path == "streamed"


def test_a_batch_decision_over_late_cases_names_the_regrets_it_compared(tmp_path):
    """With late cases the decision compares worst-case regrets, not on-time ratios: a streamed plan faster on
    time (0.98x) but slower with a late rank loses, and the reason gives both regrets and the on-time ratio
    rather than one ratio called "x the batch path"."""
    def row(path, ms, **kw):
        return {"ranks": 2, "tokens_per_rank": 4096, "block_m": 128, "path": path, "median_ms": ms,
                "bitwise_equal_to_batch": True, "gemm": "cutlass", **kw}
    stream = dict(chunks=1, num_slots=1, policy="spin_kernel", ok=True)
    late = dict(straggler_ms=3.0, straggler_rank=1)
    bench = {"rows": [row("batch", 8.0), row("streamed", 7.84, streamed_over_batch=0.98, **stream),
                      row("batch", 10.0, **late), row("streamed", 12.0, streamed_over_batch=1.2, **stream, **late)]}
    out = _make_table(tmp_path, bench)
    (t,) = adaptive.load_table(out)["rows"]
    assert t["path"] == "batch" and t["cases"] == 2
    assert t["batch_regret"] == 1.0204 and t["streamed_regret"] == 1.2 and t["streamed_on_time_over_batch"] == 0.98
    assert "1.200x the fastest path" in t["reason"] and "batch path's 1.020x" in t["reason"], t["reason"]
    assert "over 2 cases" in t["reason"] and "on time 0.980x" in t["reason"], t["reason"]


def test_bad_tables_name_the_field(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"rows": [{"tokens": 1, "path": "fast", "block_m": 64}]}))
    with pytest.raises(adaptive.AdaptiveTableError, match=r"rows\[0\].path is 'fast', allowed"):
        adaptive.load_table(p)
    p.write_text(json.dumps({"rows": [{"tokens": 1, "path": "streamed", "block_m": 64, "chunks": 2}]}))
    with pytest.raises(adaptive.AdaptiveTableError, match="has no 'num_slots'"):
        adaptive.load_table(p)
    with pytest.raises(adaptive.AdaptiveTableError, match="not found"):
        adaptive.load_table(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        adaptive.choose(0, {"rows": []})


def test_make_adaptive_table_picks_batch_unless_streaming_wins(tmp_path):
    bench = {"device": "x", "rows": [
        {"tokens": 1024, "block_m": 64, "batch": {"median_ms": 3.0},
         "streamed": [{"ok": True, "streamed_over_batch": 1.05, "chunks": 2, "num_slots": 2, "policy": "spin_kernel"}]},
        {"tokens": 8192, "block_m": 64, "batch": {"median_ms": 11.0},
         "streamed": [{"ok": True, "streamed_over_batch": 0.95, "chunks": 4, "num_slots": 4, "policy": "spin_kernel"},
                      {"ok": False, "streamed_over_batch": 0.5, "chunks": 8, "num_slots": 4, "policy": "serialized"}]}]}
    out = _make_table(tmp_path, bench)
    t = adaptive.load_table(out)
    by = {row["tokens"]: row for row in t["rows"]}
    assert by[1024]["path"] == "batch" and "1.050x" in by[1024]["reason"]
    assert by[8192]["path"] == "streamed" and by[8192]["chunks"] == 4  # the failed 0.5x config is ignored


def _timeline(tokens=1024):
    chunks = []
    t = 0.0
    for c in range(2):
        chunks.append({"produce_start": t, "route_published": t + 50, "layout_published": t + 60, "acquired": t + 61,
                       "dispatched_acked": t + 90, "blocks_done": t + 400, "blocks_ready": 10 + c})
        t += 60
    return {"tokens": tokens, "policy": "spin_kernel", "chunk_tokens": tokens // 2, "num_slots": 2, "block_m": 64,
            "chunks": chunks, "tail": {"start": 0.0, "producer_done": 120.0, "seal_blocks_done": 900.0,
                                       "combine_done": 950.0, "seal_blocks": 7},
            "batch_ms": {"producer": 0.1, "moe": 0.9, "total": 1.0}, "streamed_ms": 0.95}


def test_timeline_command_draws_a_png(tmp_path):
    src = tmp_path / "layer.json"
    src.write_text(json.dumps({"timelines": [_timeline(1024), _timeline(8192), {"tokens": 5, "error": "x"}]}))
    png = tmp_path / "t.png"
    r = subprocess.run([sys.executable, "-m", "streamring", "timeline", str(src), "--out", str(png), "--tokens", "8192"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # chunk 1 was published (120 us) while chunk 0's blocks computed (until 400 us): lead +280 us
    assert "1 of 1 later chunks published" in r.stdout and "+280" in r.stdout


def test_timeline_command_rejects_bad_input(tmp_path):
    bad = _timeline()
    del bad["chunks"][1]["blocks_done"]
    src = tmp_path / "bad.json"
    src.write_text(json.dumps(bad))
    r = subprocess.run([sys.executable, "-m", "streamring", "timeline", str(src), "--out", str(tmp_path / "x.png")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "chunk 1 lacks events ['blocks_done']" in r.stderr
    r = subprocess.run([sys.executable, "-m", "streamring", "timeline", str(tmp_path / "none.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_committed_results_draw():
    """The committed benchmark result has timelines the command can draw."""
    from streamring.timeline import lanes, load_timelines

    tls = load_timelines(ROOT / "docs/results/layer-1pe-h200-prototype-timelines-2026-11-29.json")
    assert {t["tokens"] for t in tls} >= {8192, 32768}
    assert all(len(lanes(t)) == 3 * len(t["chunks"]) + 2 for t in tls)


def test_tuning_validation_names_fields():
    from streamring.moe.tuning import EPTuning

    with pytest.raises(ValueError, match=r"policy\n  Input should be 'serialized', 'stream_wait', 'spin_kernel' or "
                                         r"'green_ctx'"):
        EPTuning(policy="fast")
    with pytest.raises(ValueError, match=r"reserved_sms\n  Input should be greater than or equal to 1"):
        EPTuning(reserved_sms=0)
    with pytest.raises(ValueError, match=r"chunk_gemm_ctas\n  Input should be greater than or equal to 1"):
        EPTuning(chunk_gemm_ctas=0)
    assert EPTuning(policy="stream_wait").policy == "stream_wait"


def test_result_puts_keep_the_default_priority_beside_a_persistent_grid():
    """EPTuning.high_priority_puts None: the puts at the high priority with Triton's CTA-per-tile grids, at the
    default with a persistent-grid backend (CUTLASS, DeepGEMM); an explicit value decides either way."""
    from streamring.gemm.backends import CAPABILITIES
    from streamring.moe.tuning import EPTuning

    rule = {g: EPTuning().puts_at_high_priority(persistent_grid=CAPABILITIES[g].persistent_grid)
            for g in ("triton", "cutlass", "deep_gemm") if g in CAPABILITIES}
    assert rule["triton"] and not rule["cutlass"], rule
    assert all(EPTuning(high_priority_puts=True).puts_at_high_priority(persistent_grid=p) for p in (False, True))
    assert not any(EPTuning(high_priority_puts=False).puts_at_high_priority(persistent_grid=p) for p in (False, True))


def test_priority_streams_follow_the_policy():
    """High-priority producer and dispatch streams with spin_kernel only: a consumer blocked in
    cuStreamWaitValue64 (stream_wait) has no deadline, so nothing may depend on its stream going first; only
    stream_wait rings the doorbells; every kind of streams of the EP layer's policies is one class of
    ring.progress."""
    from streamring.ring import progress as PG
    from streamring.moe.tuning import EP_POLICIES
    from streamring.ring.policies import progress

    assert PG.high_priority(progress("spin_kernel"))
    assert not any(PG.high_priority(progress(p)) for p in ("stream_wait", "serialized", "green_ctx"))
    assert [p for p in EP_POLICIES if progress(p).doorbells] == ["stream_wait"]
    assert {progress(p).streams for p in EP_POLICIES} <= set(PG.KINDS)
    with pytest.raises(ValueError, match="progress policy 'pdl' is refused"):
        PG.make("pdl", "cpu")


def test_make_adaptive_table_weighs_late_ranks_by_regret(tmp_path):
    """With late-rank cases measured, each path's regret is its worst ratio over the fastest path of a case:
    a plan 1.5 % slower on time that hides a 3 ms straggler is taken; one 5 % slower on time that gains 3 %
    with the straggler is not."""
    def rows(T, stream_on_time, stream_late):
        base = {"ranks": 2, "tokens_per_rank": T, "experts_per_pe": 32, "block_m": 64, "gemm": "triton",
                "routing": "uniform"}
        plan = dict(chunks=1, num_slots=1, policy="spin_kernel", source_order="arrival", consumer="per_chunk")
        late = dict(straggler_ms=3.0, straggler_rank=1)
        return [{**base, "path": "batch", "median_ms": 10.0, "straggler_ms": 0.0},
                {**base, "path": "batch", "median_ms": 12.5, **late},
                {**base, **plan, "path": "streamed", "median_ms": stream_on_time, "straggler_ms": 0.0, "ok": True,
                 "bitwise_equal_to_batch": True, "streamed_over_batch": stream_on_time / 10.0},
                {**base, **plan, "path": "streamed", "median_ms": stream_late, **late}]
    out = _make_table(tmp_path, {"rows": rows(4096, 10.15, 10.6) + rows(8192, 10.5, 12.1)})
    by = {row["tokens"]: row for row in adaptive.load_table(out)["rows"]}
    assert by[4096]["path"] == "streamed" and by[4096]["source_order"] == "arrival" and by[4096]["chunks"] == 1
    assert by[4096]["batch_regret"] == round(12.5 / 10.6, 4) and by[4096]["streamed_regret"] == round(10.15 / 10, 4)
    assert by[8192]["path"] == "batch" and by[8192]["streamed_regret"] == 1.05
    c = adaptive.choose(4096, adaptive.load_table(out), gemm="triton", ranks=2, experts_per_pe=32)
    assert (c.path, c.source_order, c.chunks) == ("streamed", "arrival", 1)


def _reachable(start: str) -> set:
    """Every module of this repository that ``start`` imports, directly or through others, at module level or
    inside a function (parsed, not run: a lazy import counts although no call made it), with the top-level
    names it imports from elsewhere."""
    seen, todo = set(), [start]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        base = ROOT.joinpath(*mod.split("."))
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not path.is_file():
            continue
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = pkg.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                todo += [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
    return seen


def test_streaming_auto_imports_no_performance_model():
    """The runtime's streaming="auto" reads the tuned table only: nothing that the table's module or the buffer
    imports, however indirectly and however lazily, is the cost model or any of bench/ (the research code that
    fits and checks it); the same walk from bench.cost_model does reach the model (the check can fail)."""
    for start in ("streamring.moe.adaptive", "streamring.moe.ep_buffer"):
        found = _reachable(start)
        bad = sorted(m for m in found if "cost_model" in m or m.split(".")[0] == "bench")
        assert not bad, (start, bad)
    assert {"streamring.moe.adaptive", "streamring.moe.blocks", "streamring.gemm.choice"} <= found  # (the walk walks)
    assert "bench.cost_model_core" in _reachable("bench.cost_model")
