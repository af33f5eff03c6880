"""bench.compare_runs pairs the cases of several ep_layer result files: each run's ratio to its own on-time batch,
and to the first run; a case one run lacks is a dash, a streamed output that was not bitwise equal is named."""

from __future__ import annotations

import json

from bench import compare_runs as CR


def _row(path, ms, late_ms=0.0, pe=None, bitwise=True):
    return {"tokens_per_rank": 4096, "gemm": "cutlass", "path": path, "straggler_rank": pe, "straggler_ms": late_ms,
            "lateness": "producer" if late_ms else "none", "median_ms": ms, "bitwise_equal_to_batch": bitwise}


def test_ratios_within_a_run_and_across_runs(tmp_path, capsys):
    a = [_row("batch", 8.0), _row("streamed", 8.4), _row("streamed", 11.0, 3.0, 1)]
    b = [_row("batch", 8.2), _row("streamed", 8.2), _row("streamed", 9.02, 3.0, 1, bitwise=False)]
    lines = {ln["case"]: ln for ln in CR.compare({"a": a, "b": b})}
    late = lines[(4096, "cutlass", "streamed", 1, 3.0, "producer")]
    assert abs(late["a"]["over_on_time_batch"] - 11.0 / 8.0) < 1e-9
    assert abs(late["b"]["over_on_time_batch"] - 9.02 / 8.2) < 1e-9  # its own run's batch, not the first run's
    assert abs(late["b"]["over_first"] - 9.02 / 11.0) < 1e-9
    (tmp_path / "a.json").write_text(json.dumps({"rows": a}))
    (tmp_path / "b.json").write_text(json.dumps({"rows": b[:2] + [b[2]]}))
    (tmp_path / "c.json").write_text(json.dumps({"rows": a[:2]}))  # lacks the late case
    assert CR.main([f"a={tmp_path / 'a.json'}", f"b={tmp_path / 'b.json'}", f"c={tmp_path / 'c.json'}"]) == 0
    out = capsys.readouterr().out
    assert "NOT bitwise equal to batch in: ['b']" in out
    late_line = [ln for ln in out.splitlines() if "PE1 3ms" in ln][0]
    assert late_line.rstrip().endswith("-")


def test_a_file_without_rows_is_an_error(tmp_path):
    (tmp_path / "e.json").write_text(json.dumps({"rows": []}))
    assert CR.main([f"e={tmp_path / 'e.json'}"]) == 2
