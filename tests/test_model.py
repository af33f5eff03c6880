"""Tests for streamring.model: the exhaustive model checker of the ring protocol."""

import json

import pytest

import streamring.protocol as P
from streamring.cli import main
from streamring.model import (
    PROP_ABA,
    PROP_DEADLOCK,
    PROP_OVERWRITE,
    PROP_PROTOCOL,
    PROPERTIES,
    Model,
    ModelConfig,
    check,
    run_serialised,
)

from conftest import ROOT

README = (ROOT / "README.md").read_text()


@pytest.fixture(autouse=True)
def _no_por_override(monkeypatch):
    monkeypatch.delenv("STREAMRING_MODEL_POR", raising=False)


def _cli(tmp_path, *argv):
    path = tmp_path / "mc.json"
    rc = main(["model-check", *argv, "--json", str(path)])
    return rc, json.loads(path.read_text())


# --------------------------------------------------------------------------------------
# The correct protocol
# --------------------------------------------------------------------------------------
def test_correct_protocol_passes_exhaustively(tmp_path, capsys):
    rc, data = _cli(tmp_path)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert data["ok"] is True
    assert data["config"] == {**data["config"], "ranks": 2, "slots": 2, "chunks": 3, "epochs": 2, "inject": "none"}
    assert data["exhaustive"] is True
    assert data["config"]["por"] is False  # default sizes: every interleaving, no partial-order reduction
    # Exhaustive means every interleaving: the README quotes the exact counts of the default sizes,
    # and a model that explores fewer states (a pruning bug, a step that never fires) must not pass.
    quoted = f"{data['states']:,} states, {data['transitions']:,} transitions"
    assert quoted in README, f"the check explored {quoted}; README.md quotes other numbers"
    assert data["time_s"] > 0
    assert data["final_reachable"] is True
    assert data["counterexample"] is None
    assert data["properties"] == {p: "PASS" for p in PROPERTIES}
    assert f"explored {data['states']} states, {data['transitions']} transitions" in out
    assert "PASS: every property holds" in out


def test_serialised_schedule_passes():
    model = Model(ModelConfig())
    res = run_serialised(model)
    assert res["result"] == "PASS", res
    R, C, E = 2, 3, 2
    per_epoch = R * 2 * C * (2 + R) + R * C * R * 2 + R  # producers, consumers (acquire, ack), ends
    assert res["steps"] == E * per_epoch + (E - 1)  # + the begins


@pytest.mark.parametrize("mode", P.INJECT_MODES)
def test_serialised_schedule_of_each_mutation_runs(mode):
    # Nothing overlaps in the serialised schedule, so even the mutated steps complete.
    assert run_serialised(Model(ModelConfig(inject=P.Inject(mode))))["result"] == "PASS"


# --------------------------------------------------------------------------------------
# Every mutation is caught
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", P.INJECT_MODES)
def test_each_inject_mode_gives_a_counterexample(tmp_path, capsys, mode):
    rc, data = _cli(tmp_path, "--inject", mode)
    out = capsys.readouterr().out
    assert rc == 1
    assert data["ok"] is False
    ce = data["counterexample"]
    assert ce is not None and ce["trace"] and ce["steps"] == len(ce["trace"])
    assert ce["properties"] and set(ce["properties"]) <= set(PROPERTIES)
    for p in ce["properties"]:
        assert data["properties"][p] == "FAIL"
        assert p in out
    assert ce["trace"][-1].endswith("<-- VIOLATION")
    assert "counter-example" in out and "FAIL" in out


def test_inject_modes_name_the_expected_property():
    first = {m: check(ModelConfig(inject=P.Inject(m))).counterexample["properties"][0] for m in
             ("skip-acquire", "signal-before-payload")}
    assert first == {"skip-acquire": "no-stale-or-torn-read", "signal-before-payload": "no-stale-or-torn-read"}


def test_ignore_epoch_is_aba_when_the_leftover_matches():
    # 2 chunks on 2 slots: epoch 1 leaves e1:c0 in slot 0, whose sequence equals e2:c0's.
    res = check(ModelConfig(chunks=2, inject=P.Inject.IGNORE_EPOCH))
    assert not res.ok
    assert res.counterexample["properties"] == [PROP_ABA]
    assert "older epoch" in res.counterexample["message"]


def test_skip_ack_wait_overwrite_is_caught_as_such(monkeypatch):
    # With the runtime's classify_gen the consumer first sees a generation newer than it
    # expects (a protocol violation); with one that waits instead, the overwrite itself shows.
    assert check(ModelConfig(inject=P.Inject.SKIP_ACK_WAIT)).counterexample["properties"] == [PROP_PROTOCOL]
    original = P.classify_gen

    def waits(observed, expected, num_slots, ignore_epoch=False):
        st = original(observed, expected, num_slots, ignore_epoch)
        return P.GenState.OLDER if st is P.GenState.VIOLATION else st

    monkeypatch.setattr(P, "classify_gen", waits)
    res = check(ModelConfig(inject=P.Inject.SKIP_ACK_WAIT))
    assert res.counterexample["properties"] == [PROP_OVERWRITE]
    assert "holds chunk 0" in res.counterexample["message"]


# --------------------------------------------------------------------------------------
# The model is tied to the runtime's protocol module
# --------------------------------------------------------------------------------------
def test_model_uses_the_runtime_classify_gen(monkeypatch):
    original = P.classify_gen

    def broken(observed, expected, num_slots, ignore_epoch=False):
        return original(observed, expected, num_slots, ignore_epoch=True)  # forgets the epoch

    monkeypatch.setattr(P, "classify_gen", broken)
    res = check(ModelConfig())
    assert not res.ok
    assert res.counterexample["properties"][0] in (PROP_PROTOCOL, PROP_ABA)
    assert "epoch 2" in "\n".join(res.counterexample["trace"])
    res2 = check(ModelConfig(chunks=2))
    assert res2.counterexample["properties"] == [PROP_ABA]
    monkeypatch.setattr(P, "classify_gen", original)
    assert check(ModelConfig(chunks=2)).ok


def test_model_uses_the_runtime_full_mask(monkeypatch):
    # A full mask with one bit more than there are ranks can never be reached: reuse and drain block.
    original = P.RingLayout.full_mask
    monkeypatch.setattr(P.RingLayout, "full_mask", lambda self, w: (original(self, w) << 1) | 1)
    res = check(ModelConfig())
    assert not res.ok
    assert res.properties[PROP_DEADLOCK] == "FAIL"
    assert run_serialised(Model(ModelConfig()))["result"] == "FAIL"


def test_model_uses_the_runtime_generations(monkeypatch):
    gens = Model(ModelConfig()).gens
    assert gens[2][1] == P.make_gen(2, 2) == P.StreamPlan(epoch=2, tokens_per_rank=(3, 2), tokens_per_slot=1).gen(1)
    calls = []
    original = P.make_gen
    monkeypatch.setattr(P, "make_gen", lambda e, s: calls.append((e, s)) or original(e, s))
    Model(ModelConfig(chunks=2, epochs=2))
    assert sorted(set(calls)) == [(1, 1), (1, 2), (2, 1), (2, 2)]


def test_consumer_that_never_sees_ready_deadlocks(monkeypatch):
    monkeypatch.setattr(P, "classify_gen", lambda *a, **k: P.GenState.OLDER)
    res = check(ModelConfig(chunks=1, epochs=1))
    assert res.properties[PROP_DEADLOCK] == "FAIL"
    assert "deadlock" in res.counterexample["message"]


# --------------------------------------------------------------------------------------
# The partial-order reduction agrees with the full interleaving graph
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ("none",) + P.INJECT_MODES)
@pytest.mark.parametrize("sizes", [(2, 1, 2, 1), (1, 2, 3, 2)])
def test_reduction_preserves_verdict_and_terminal_states(mode, sizes):
    R, S, C, E = sizes
    kw = dict(ranks=R, slots=S, chunks=C, epochs=E, inject=P.Inject(mode), stop_at_first=False)
    full = check(ModelConfig(por=False, **kw))
    red = check(ModelConfig(por=True, **kw))
    assert bool(full._violation_set) == bool(red._violation_set)
    assert red._violation_set <= full._violation_set  # the reduced graph is a subgraph
    assert full._terminal_set == red._terminal_set  # final state and every deadlock
    assert red.states <= full.states


@pytest.mark.parametrize("mode", ("none",) + P.INJECT_MODES)
def test_larger_configuration_under_reduction(mode):
    res = check(ModelConfig(ranks=3, slots=2, chunks=3, epochs=2, inject=P.Inject(mode)))
    assert res.config["por"] is True
    assert res.ok is (mode == "none")
    if mode != "none":
        assert res.counterexample["properties"]


def test_por_can_be_forced_on_the_default_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMRING_MODEL_POR", "1")
    rc, data = _cli(tmp_path)
    assert rc == 0 and data["config"]["por"] is True and data["properties"] == {p: "PASS" for p in PROPERTIES}


def test_bad_sizes_are_usage_errors(capsys):
    assert main(["model-check", "--ranks", "0"]) == 2
    assert "--ranks" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# source_order='ready': the consumer takes any ready source of its chunk (RFC later optimisation)
# --------------------------------------------------------------------------------------
def test_ready_order_passes_at_the_default_sizes_and_explores_more(tmp_path, capsys):
    rc, data = _cli(tmp_path, "--source-order", "ready")
    assert rc == 0, capsys.readouterr().out
    assert data["config"]["source_order"] == "ready"
    assert data["properties"] == {p: "PASS" for p in PROPERTIES}
    rank = check(ModelConfig())
    # both orders of the two sources are explored: strictly more states than the rank order, and
    # exactly as many as the README quotes
    assert data["states"] > rank.states
    assert f"2 ranks, {data['states']:,} states" in README, f"{data['states']:,} states; README.md quotes others"


@pytest.mark.parametrize("mode", P.INJECT_MODES)
def test_ready_order_mutations_give_counterexamples(mode):
    res = check(ModelConfig(inject=P.Inject(mode), source_order="ready"))
    assert not res.ok and res.counterexample["properties"]


@pytest.mark.parametrize("mode", ("none", "skip-ack-wait", "signal-before-payload"))
def test_ready_order_reduction_preserves_verdict(mode):
    kw = dict(ranks=2, slots=1, chunks=2, epochs=1, inject=P.Inject(mode), stop_at_first=False, source_order="ready")
    full = check(ModelConfig(por=False, **kw))
    red = check(ModelConfig(por=True, **kw))
    assert bool(full._violation_set) == bool(red._violation_set)
    assert red._violation_set <= full._violation_set
    assert full._terminal_set == red._terminal_set
    assert red.states <= full.states


def test_bad_source_order_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:  # argparse names the allowed values
        main(["model-check", "--source-order", "random"])
    assert info.value.code == 2 and "'rank', 'ready'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--source-order must be one of"):
        ModelConfig(source_order="random").validate()
