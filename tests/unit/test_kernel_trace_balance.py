"""bench.kernel_trace's GEMM balance: each traced replay's GEMM launches per PE side by side, the slowest PE's over
the fastest's per launch, replays of one case kept apart, and a results file's nested traces all found."""

from __future__ import annotations

from bench import kernel_trace as KT


def _tl(rank, durs, path="batch", late_ms=0.0):
    ks = [{"name": "_ep_place_rows_kernel", "stream": 7, "start_us": 0.0, "dur_us": 700.0}]
    ks += [{"name": "_ZN7cutlass13device_kernelINS_4gemm", "stream": 7, "start_us": 1000.0 * i, "dur_us": d}
           for i, d in enumerate(durs)]
    return {"tokens": 4096, "gemm": "cutlass", "path": path, "rank": rank, "straggler_rank": 1 if late_ms else None,
            "straggler_ms": late_ms, "kernels": ks}


def test_spread_per_launch_and_replays_kept_apart():
    rows = KT.gemm_balance([_tl(0, [3200.0, 3310.0]), _tl(1, [6070.0, 2230.0]),
                            _tl(0, [4160.0, 2080.0]), _tl(1, [4170.0, 2090.0])])
    assert len(rows) == 2  # the same case replayed twice: two rows, not the second overwriting the first
    assert rows[0]["durations_us"] == [[3200.0, 3310.0], [6070.0, 2230.0]]  # the place kernel is not a GEMM
    assert rows[0]["spread"] == [round(6070 / 3200, 3), round(3310 / 2230, 3)]
    assert rows[1]["spread"][0] == round(4170 / 4160, 3)
    assert rows[0]["span_us"] == 6070.0 and rows[1]["span_us"] == 4170.0  # first start to the last end over PEs


def test_results_file_traces_found_at_both_levels():
    results = {"runs": {"a": {"timelines": [_tl(0, [1.0]), _tl(1, [2.0])]},
                        "b": {"by_run": {"x": {"timelines": [_tl(0, [5.0], "streamed", 3.0), _tl(1, [5.0], "streamed",
                                                                                               3.0)]},
                                         "y": {"rows": []}}},
                        "c": {"rows": []}}}
    assert [n for n, _ in KT.results_timelines(results)] == ["a", "b/x"]
    text = KT.print_gemm_balance(results)
    assert "first spread 2.00" in text and "PE 1 3.0 ms late" in text
