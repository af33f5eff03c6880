"""A run with a deliberately injected bug ends with one line saying whether the checks caught it, as intended,
or missed it, and keeps its exit status (non-zero: a check failed). The stress runs of tests/ranks check the
same line on real ranks (conftest.assert_stress_mutation_caught)."""

from __future__ import annotations

import io

from streamring import cli
from streamring.config import load_config
from streamring.host.rank_main import report_stress
from streamring.host.report import Report

DRAIN_ERROR = ("WatchdogError: rank 1: watchdog: waited 3s (wait_timeout_s=3) for drain: acknowledgements of my "
               "chunk 2 (slot 2) route_ready_gen=... missing acks from ranks [0]")


def _stress_row(rank, violations, kinds):
    zero = dict(acquire_wait_median_s=0.0, acquire_wait_max_s=0.0, reuse_wait_median_s=0.0, reuse_wait_max_s=0.0,
                publish_to_acquire_median_s=0.0, publish_to_acquire_max_s=0.0)
    return dict(rank=rank, violations=violations, violation_kinds=kinds, chunks_published=4, tokens_published=64,
                chunks_consumed=8, tokens_checked=128, bytes_read=1000, ring_wraps=1, first_violations=[],
                wall_s=0.1, reuses_checked=4, stopped_early="epoch 1 of 2" if violations else "", **zero)


def _report(mode, rows):
    cfg = load_config(None, [f"stress.inject={mode}"], ranks=len(rows))
    buf = io.StringIO()
    code = report_stress(rows, cfg, 0.1, None, out=Report(file=buf, width=None))
    return code, buf.getvalue().strip().splitlines()


def test_stress_caught_keeps_status_1_and_says_so_last():
    code, lines = _report("skip-ack-wait", [_stress_row(0, 2, {"early_reuse": 2}), _stress_row(1, 0, {})])
    assert code == 1
    assert lines[-2].startswith("FAIL")
    assert lines[-1] == ("streamring stress: the injected bug (skip-ack-wait) was caught, as intended: 2 violations "
                         "(early_reuse: 2); the FAIL and the non-zero exit status are the expected result of --inject")


def test_stress_missed_says_so_last():
    code, lines = _report("skip-ack-wait", [_stress_row(0, 0, {}), _stress_row(1, 0, {})])
    assert code == 0 and lines[-2].startswith("PASS")
    assert lines[-1].startswith("streamring stress: the injected bug (skip-ack-wait) was MISSED: no violation"), lines


def test_stress_without_inject_has_no_verdict():
    cfg = load_config(None, [], ranks=1)
    buf = io.StringIO()
    report_stress([_stress_row(0, 0, {})], cfg, 0.1, None, out=Report(file=buf, width=None))
    assert "injected bug" not in buf.getvalue()


def test_local_launcher_says_last_that_a_drain_watchdog_caught_it(monkeypatch, capsys):
    """Ranks that end with the owner's drain timing out (how skip-acquire and ignore-epoch can be caught) print
    no report: the launcher's last line judges the run from their errors."""
    from streamring.host import launch

    def job(num_ranks, argv, errors=None, **kw):
        errors.update({1: DRAIN_ERROR})
        print("streamring launcher: rank 1 failed first", flush=True)
        return 1

    monkeypatch.setattr(launch, "spawn_local", job)
    assert cli.main(["stress", "--ranks", "2", "--inject", "skip-acquire"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("streamring stress: the injected bug (skip-acquire) was caught, as intended: a consumer "
                           "read a slot before its publish"), last
    monkeypatch.setattr(launch, "spawn_local", lambda num_ranks, argv, errors=None, **kw:
                        errors.update({0: "ValueError: something else"}) or 1)
    assert cli.main(["stress", "--ranks", "2", "--inject", "skip-acquire"]) == 1
    assert "neither caught nor missed" in capsys.readouterr().err.strip().splitlines()[-1]


def test_model_check_caught_says_so_last(capsys):
    assert cli.main(["model-check", "--inject", "skip-ack-wait"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("FAIL")
    assert lines[-1].startswith("streamring model-check: the injected bug (skip-ack-wait) was caught, "
                                "as intended"), lines
