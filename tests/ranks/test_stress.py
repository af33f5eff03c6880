"""Multi-process stress runs: every shipped config passes, every mutation is caught, the watchdog fires."""

import time

import pytest

from conftest import CONFIGS, assert_stress_mutation_caught

STRESS_CONFIGS = sorted(CONFIGS.glob("stress-*.yaml"))
# the edit loop's stress config: 4 ranks, uneven, zero and partial chunks, 3 epochs, random delays, seconds
QUICK_STRESS_CONFIG = "stress-uneven"
WRAP_REASON = ("stress-wrap laps every rank's 2-slot ring 2,000 times here (10^4 as shipped, by hand); a chunk "
               "costs about 1 ms alone on 2 cores and 5x that beside another test worker, almost all of it the "
               "handoffs of the publish and acknowledge verbs")
# The test's share of stress-wrap: 2,000 chunks per epoch (10^4 as shipped). Every lap exercises the
# same rules (slot reuse after every acknowledgement, the generation check across both epochs); a
# generation's sequence has 32 bits, so no counter wraps at 10^4 either: the shipped size adds laps,
# not cases, at 5x the time.
WRAP_CHUNKS = 2_000


def _config_param(path):
    marks = {QUICK_STRESS_CONFIG: [pytest.mark.quick("stress config")],
             "stress-wrap": [pytest.mark.slow(reason=WRAP_REASON)]}.get(path.stem, [])
    return pytest.param(path, id=path.stem, marks=marks)
QUICK = ["--set", "stress.route_delay.max_s=0.001", "--set", "stress.layout_delay.max_s=0.001",
         "--set", "stress.consumer_delay.max_s=0.001", "--set", "stress.read_hold.max_s=0.001"]


@pytest.mark.parametrize("path", [_config_param(p) for p in STRESS_CONFIGS])
def test_shipped_stress_config_passes(cli, path):
    cap = ["--set", f"stress.chunks_per_rank={WRAP_CHUNKS}"] if path.stem == "stress-wrap" else []
    r = cli("stress", "--config", path, *cap, timeout=300)
    assert r.rc == 0, r
    assert r.json["violations"] == 0
    # every rank consumed every source's every chunk of every epoch
    cfg = r.json["config"]
    ranks = r.json["ranks"]
    consumed = [x["chunks_consumed"] for x in ranks]
    assert len(set(consumed)) == 1, consumed
    published = sum(x["chunks_published"] for x in ranks)
    assert consumed[0] == published, (consumed, published)  # each rank reads every published chunk
    assert len(ranks) == cfg["ranks"]
    window = cfg["cpu"]["window"]
    assert {x["heap"] for x in ranks} == {f"cpu/{'separate' if window == 'separate' else 'shared'}"}, window
    if path.stem == "stress-wrap":  # what that config is for: many laps of every rank's ring
        laps = WRAP_CHUNKS // cfg["ring"]["num_slots"] * cfg["stress"]["epochs"]
        assert min(x["ring_wraps"] for x in ranks) >= laps >= 2_000, ([x["ring_wraps"] for x in ranks], laps)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ranks_and_tokens_checked(cli, ranks):
    r = cli("stress", "--ranks", ranks, "--set", "stress.chunks_per_rank=25", "--set", "ring.num_slots=3",
            "--set", "stress.partial_last=5", *QUICK)
    assert r.rc == 0, r
    C = 32
    tokens = 24 * C + 5
    for rank in r.json["ranks"]:
        assert rank["tokens_checked"] == ranks * tokens * 2  # 2 epochs, every source
        assert rank["violations"] == 0


def test_more_ranks_than_cores(cli):
    """8 ranks on the machine's cores. That a waiting rank gives its core away (what makes this fast) is
    measured, against a baseline, by test_ring_rules.py::test_waiting_rank_gives_its_core_away."""
    r = cli("stress", "--ranks", 8, "--set", "stress.chunks_per_rank=30", "--set", "ring.num_slots=2")
    assert r.rc == 0, r
    consumed = {x["chunks_consumed"] for x in r.json["ranks"]}
    assert consumed == {8 * 30 * 2}, consumed  # every rank read every rank's every chunk, both epochs


@pytest.mark.slow(reason="65 ranks, the fewest with a second acknowledgement-mask word: 65 Python processes on "
                        "2 cores, each loading numpy, pydantic and mpi4py (about half a second), start for about 20 s")
def test_more_than_64_ranks_use_two_mask_words(cli):
    # 3 chunks on 2 slots: chunk 2 reuses slot 0 once every rank's bit is in both words
    r = cli("stress", "--ranks", 65, "--set", "ring.num_slots=2", "--set", "stress.chunks_per_rank=3",
            "--set", "stress.epochs=1", "--set", "wait_timeout_s=120", timeout=400)
    assert r.rc == 0, r
    assert all(x["chunks_consumed"] == 65 * 3 for x in r.json["ranks"])


def test_separate_windows_path(cli):
    """Win.Allocate (the multi-node code path) on one node."""
    r = cli("stress", "--config", CONFIGS / "stress-uneven.yaml", "--set", "cpu.window=separate")
    assert r.rc == 0, r
    ranks = r.json["ranks"]
    assert {x["heap"] for x in ranks} == {"cpu/separate"}, [x["heap"] for x in ranks]  # that path really ran
    assert r.json["violations"] == 0 and len({x["chunks_consumed"] for x in ranks}) == 1
    assert ranks[0]["chunks_consumed"] == sum(x["chunks_published"] for x in ranks) > 0


INJECT_CASES = [
    ("skip-acquire", CONFIGS / "stress-basic.yaml"),
    ("signal-before-payload", CONFIGS / "stress-basic.yaml"),
    ("skip-ack-wait", CONFIGS / "stress-basic.yaml"),
    ("ignore-epoch", CONFIGS / "stress-aba.yaml"),
]


@pytest.mark.parametrize("mode,path", INJECT_CASES, ids=[m for m, _ in INJECT_CASES])
def test_every_inject_mode_is_caught(cli, mode, path):
    r = cli("stress", "--config", path, "--inject", mode, "--set", "wait_timeout_s=5", "--set", "ranks=3",
            "--set", "stress.chunks_per_rank=" + ("2" if mode == "ignore-epoch" else "16"),
            # the early generation's window, as test_multihost widens it: on 2 busy cores a consumer process can
            # go unscheduled through every short window, and the mutation would go uncaught
            *(["--set", "stress.inject_delay_s=0.05"] if mode == "signal-before-payload" else []), timeout=120)
    assert_stress_mutation_caught(r, mode)


def test_broken_protocol_reports_its_violations_without_waiting_for_the_watchdog(cli):
    """skip-acquire wedges the ring after its first bad read; the first violation stops every rank's epoch
    (the stop word), so the job reports long before the watchdog, with one FAIL verdict."""
    t0 = time.monotonic()
    r = cli("stress", "--config", CONFIGS / "stress-basic.yaml", "--inject", "skip-acquire",
            "--set", "wait_timeout_s=60", timeout=200)
    assert r.rc == 1, r
    assert time.monotonic() - t0 < 45, r  # well before the 60 s watchdog
    assert r.json is not None and r.json["violations"] > 0, r
    assert "watchdog" not in r.err, r
    fail = [ln for ln in r.out.splitlines() if ln.startswith("FAIL")]
    assert len(fail) == 1 and "stale_or_torn" in fail[0] and "token reads compared" in fail[0], r.out
    assert any(x["stopped_early"] for x in r.json["ranks"]), r.json["ranks"]


def test_watchdog_names_stalled_rank_and_slot_states(cli):
    t0 = time.monotonic()
    r = cli("stress", "--ranks", 3, "--set", "wait_timeout_s=2", "--set", "stress.stragglers={1: 1000}",
            "--set", "stress.route_delay.max_s=0.01", "--set", "stress.chunks_per_rank=4", timeout=60)
    assert r.rc != 0, r
    assert time.monotonic() - t0 < 60
    assert "watchdog" in r.err and ("source rank 1" in r.err or "source 1" in r.err), r
    assert "route_ready_gen" in r.err and "ack_mask" in r.err and "missing acks" in r.err


def test_mpirun_path_and_rank_failure_ends_job(mpirun):
    r = mpirun(3, "-m", "streamring", "stress", "--set", "stress.chunks_per_rank=5")
    assert r.rc == 0, r
    assert "PASS" in r.out
    # a bad value on the ranks' side: every rank exits, non-zero, promptly
    t0 = time.monotonic()
    r = mpirun(3, "-m", "streamring", "stress", "--set", "stress.tokens_per_chunk=[1, 2]")
    assert r.rc != 0 and "one entry per rank" in r.err, r
    assert time.monotonic() - t0 < 60


def test_bad_config_exits_2_with_field(cli):
    r = cli("stress", "--set", "ring.num_slots=0", json_out=False)
    assert r.rc == 2 and "ring.num_slots" in r.err, r


@pytest.mark.slow(reason="CI's share of the soak: 4 ranks on 2 cores with random delays and a straggler for "
                        "2,000 wraps each, the one long run with more ranks than cores")
def test_reduced_soak(cli):
    """CI's share of the soak (configs/soak.yaml runs 10^5 wraps by hand)."""
    r = cli("stress", "--config", CONFIGS / "soak-ci.yaml", timeout=400)
    assert r.rc == 0, r
    assert r.json["violations"] == 0
    assert all(x["ring_wraps"] >= 2000 for x in r.json["ranks"]), [x["ring_wraps"] for x in r.json["ranks"]]
