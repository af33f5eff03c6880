"""RFC later optimisation: consumers handle the sources of a chunk in readiness order
(``source_order: ready``), behind a flag that is off by default. The model-checker side is in
tests/unit/test_model.py."""

import pytest

from conftest import CONFIGS, assert_stress_mutation_caught


def test_default_is_rank_order():
    from streamring.config import load_config

    cfg = load_config(None)
    assert cfg.stress.source_order == "rank" and cfg.run.source_order == "rank"


def test_stress_ready_order_with_stragglers_passes_and_reorders(cli):
    r = cli("stress", "--config", CONFIGS / "stress-ready-order.yaml", timeout=300)
    assert r.rc == 0, r
    assert r.json["violations"] == 0
    ranks = r.json["ranks"]
    consumed = {x["chunks_consumed"] for x in ranks}
    assert len(consumed) == 1 and consumed.pop() == sum(x["chunks_published"] for x in ranks)
    # the flag did something: some chunk of a later rank was handled before an earlier rank's
    assert sum(x["sources_out_of_rank_order"] for x in ranks) > 0


@pytest.mark.parametrize("mode,path", [("skip-ack-wait", "stress-basic.yaml"), ("ignore-epoch", "stress-aba.yaml"),
                                       ("skip-acquire", "stress-basic.yaml")])
def test_stress_ready_order_still_catches_mutations(cli, mode, path):
    r = cli("stress", "--config", CONFIGS / path, "--inject", mode, "--set", "stress.source_order=ready",
            "--set", "wait_timeout_s=5", "--set", "ranks=3",
            "--set", "stress.chunks_per_rank=" + ("2" if mode == "ignore-epoch" else "16"), timeout=120)
    assert_stress_mutation_caught(r, mode)  # the expected kind of failure, not any exit 1
    if r.json is not None:
        assert r.json["config"]["stress"]["source_order"] == "ready"


@pytest.mark.parametrize("scheduler", ["chunk_local", "reservation"])
def test_run_ready_order_is_bitwise_equal_to_batch(cli, scheduler):
    r = cli("run", "--ranks", 4, "--set", "run.source_order=ready", "--set", f"run.scheduler={scheduler}",
            "--set", "run.tokens_per_rank=[0, 5, 77, 120]", "--set", "run.routing=uniform",
            "--set", "ring.num_slots=2", "--set", "ring.tokens_per_slot=16", timeout=400)
    assert r.rc == 0, r
    assert r.json["ok"]
    for row in r.json["ranks"]:
        assert row["bitwise_equal"] and row["ref_ok"]


def test_bad_source_order_names_the_allowed_values(cli):
    r = cli("stress", "--set", "stress.source_order=random", json_out=False)
    assert r.rc == 2 and "source_order" in r.err and "'rank'" in r.err and "'ready'" in r.err, r
