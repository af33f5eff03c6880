"""Tests for the exhaustive model checker of the ring protocol (streamring.verify: state, steps, ep, search)."""

import contextlib
import io
import json

import pytest

from streamring.cli import build_parser, main
from streamring.ring import layout as ring_layout
from streamring.ring.layout import GenState, RingLayout, StreamPlan, classify_gen, make_gen
from streamring.ring.policies import INJECT_MODES, Inject
from streamring.verify.ep import EPModel
from streamring.verify.names import EP_INJECT_MODES, MODEL_INJECT_MODES, EPInject
from streamring.verify.search import check, run_serialised
from streamring.verify.state import (
    EP_PROPERTIES,
    PROP_ABA,
    PROP_COMBINE_OVERWRITE,
    PROP_COMBINE_READ,
    PROP_COUNTER,
    PROP_DEADLOCK,
    PROP_OVERWRITE,
    PROP_PROTOCOL,
    PROPERTIES,
    ModelConfig,
    parse_inject,
)
from streamring.verify.steps import RingModel

from conftest import ROOT, quick_subset

# the pages that quote the model checks' state counts
DOCS = "".join((ROOT / "docs" / name).read_text() for name in ("verification.md", "cli.md"))


@pytest.fixture(autouse=True)
def _no_por_override(monkeypatch):
    monkeypatch.delenv("STREAMRING_MODEL_POR", raising=False)


def _cli(tmp_path, *argv):
    path = tmp_path / "mc.json"
    rc = main(["model-check", *argv, "--json", str(path)])
    return rc, json.loads(path.read_text())


DEFAULT_SIZES_REASON = ("every interleaving at the default sizes (2 ranks x 2 slots x 3 chunks x 2 epochs: "
                        "410,978 states), the numbers docs/verification.md quotes; one run, shared by the tests that read it")


@pytest.fixture(scope="session")
def default_check(tmp_path_factory):
    """``streamring model-check`` at its default sizes, run once for the tests that read it:
    ``(exit code, JSON, printed text)``. Session scope: a pytest-xdist worker that runs other modules'
    tests between the two readers keeps it (a module-scoped one would be computed again)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc, data = _cli(tmp_path_factory.mktemp("default"))
    return rc, data, out.getvalue()


# --------------------------------------------------------------------------------------
# The correct protocol
# --------------------------------------------------------------------------------------
@pytest.mark.slow(reason=DEFAULT_SIZES_REASON)
@pytest.mark.xdist_group("model-check-default-sizes")  # one worker computes default_check for both readers
def test_correct_protocol_passes_exhaustively(default_check):
    rc, data, out = default_check
    assert rc == 0, out
    assert data["ok"] is True
    assert data["config"] == {**data["config"], "ranks": 2, "slots": 2, "chunks": 3, "epochs": 2, "inject": "none"}
    assert data["exhaustive"] is True
    assert data["config"]["por"] is False  # default sizes: every interleaving, no partial-order reduction
    # Exhaustive means every interleaving: docs/verification.md quotes the exact counts of the default sizes,
    # and a model that explores fewer states (a pruning bug, a step that never fires) must not pass.
    quoted = f"{data['states']:,} states, {data['transitions']:,} transitions"
    assert quoted in DOCS, f"the check explored {quoted}; docs/verification.md quotes other numbers"
    assert data["time_s"] > 0
    assert data["final_reachable"] is True
    assert data["counterexample"] is None
    assert data["properties"] == {p: "PASS" for p in PROPERTIES}
    assert f"explored {data['states']} states, {data['transitions']} transitions" in out
    assert "PASS: every property holds" in out


def test_serialised_schedule_passes():
    model = RingModel(ModelConfig())
    res = run_serialised(model)
    assert res["result"] == "PASS", res
    R, C, E = 2, 3, 2
    per_epoch = R * 2 * C * (2 + R) + R * C * R * 2 + R  # producers, consumers (acquire, ack), ends
    assert res["steps"] == E * per_epoch + (E - 1)  # + the begins


@pytest.mark.parametrize("mode", INJECT_MODES)
def test_serialised_schedule_of_each_mutation_runs(mode):
    # Nothing overlaps in the serialised schedule, so even the mutated steps complete.
    assert run_serialised(RingModel(ModelConfig(inject=Inject(mode))))["result"] == "PASS"


# --------------------------------------------------------------------------------------
# Every mutation is caught
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [pytest.param(m, marks=[pytest.mark.slow(
    reason="the CLI at its default sizes finds ignore-epoch's first violation about 200,000 states deep")]
    if m == "ignore-epoch" else []) for m in INJECT_MODES])
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
    first = {m: check(ModelConfig(inject=Inject(m))).counterexample["properties"][0] for m in
             ("skip-acquire", "signal-before-payload")}
    assert first == {"skip-acquire": "no-stale-or-torn-read", "signal-before-payload": "no-stale-or-torn-read"}


@pytest.mark.slow(reason="the first violation under ignore-epoch at 2 chunks lies 80,000 states deep (3 s)")
def test_ignore_epoch_is_aba_when_the_leftover_matches():
    # 2 chunks on 2 slots: epoch 1 leaves e1:c0 in slot 0, whose sequence equals e2:c0's.
    res = check(ModelConfig(chunks=2, inject=Inject.IGNORE_EPOCH))
    assert not res.ok
    assert res.counterexample["properties"] == [PROP_ABA]
    assert "older epoch" in res.counterexample["message"]


def test_skip_ack_wait_overwrite_is_caught_as_such(monkeypatch):
    # With the runtime's classify_gen the consumer first sees a generation newer than it
    # expects (a protocol violation); with one that waits instead, the overwrite itself shows.
    assert check(ModelConfig(inject=Inject.SKIP_ACK_WAIT)).counterexample["properties"] == [PROP_PROTOCOL]
    original = classify_gen

    def waits(observed, expected, num_slots, ignore_epoch=False):
        st = original(observed, expected, num_slots, ignore_epoch)
        return GenState.OLDER if st is GenState.VIOLATION else st

    monkeypatch.setattr(ring_layout, "classify_gen", waits)
    res = check(ModelConfig(inject=Inject.SKIP_ACK_WAIT))
    assert res.counterexample["properties"] == [PROP_OVERWRITE]
    assert "holds chunk 0" in res.counterexample["message"]


# --------------------------------------------------------------------------------------
# The model is tied to the runtime's protocol module
# --------------------------------------------------------------------------------------
def test_model_uses_the_runtime_classify_gen(monkeypatch):
    # (the reduced graph is a subgraph of the full one: a violation found there is a real path, found
    # in 100 states instead of 200,000)
    original = classify_gen

    def broken(observed, expected, num_slots, ignore_epoch=False):
        return original(observed, expected, num_slots, ignore_epoch=True)  # forgets the epoch

    monkeypatch.setattr(ring_layout, "classify_gen", broken)
    res = check(ModelConfig(por=True))
    assert not res.ok
    assert res.counterexample["properties"][0] in (PROP_PROTOCOL, PROP_ABA)
    assert "epoch 2" in "\n".join(res.counterexample["trace"])
    res2 = check(ModelConfig(chunks=1))  # epoch 1 leaves e1:c0 in slot 0, whose sequence is e2:c0's
    assert res2.counterexample["properties"] == [PROP_ABA]
    monkeypatch.setattr(ring_layout, "classify_gen", original)
    assert check(ModelConfig(chunks=1)).ok


def test_model_uses_the_runtime_full_mask(monkeypatch):
    # A full mask with one bit more than there are ranks can never be reached: reuse and drain block.
    original = RingLayout.full_mask
    monkeypatch.setattr(RingLayout, "full_mask", lambda self, w: (original(self, w) << 1) | 1)
    res = check(ModelConfig(por=True))  # a terminal state of the reduced graph is one of the full graph
    assert not res.ok
    assert res.properties[PROP_DEADLOCK] == "FAIL"
    assert run_serialised(RingModel(ModelConfig()))["result"] == "FAIL"


def test_model_uses_the_runtime_generations(monkeypatch):
    gens = RingModel(ModelConfig()).gens
    assert gens[2][1] == make_gen(2, 2) == StreamPlan(epoch=2, tokens_per_rank=(3, 2), tokens_per_slot=1).gen(1)
    calls = []
    original = make_gen
    monkeypatch.setattr(ring_layout, "make_gen", lambda e, s: calls.append((e, s)) or original(e, s))
    RingModel(ModelConfig(chunks=2, epochs=2))
    assert sorted(set(calls)) == [(1, 1), (1, 2), (2, 1), (2, 2)]


def test_consumer_that_never_sees_ready_deadlocks(monkeypatch):
    monkeypatch.setattr(ring_layout, "classify_gen", lambda *a, **k: GenState.OLDER)
    res = check(ModelConfig(chunks=1, epochs=1))
    assert res.properties[PROP_DEADLOCK] == "FAIL"
    assert "deadlock" in res.counterexample["message"]


# --------------------------------------------------------------------------------------
# The partial-order reduction agrees with the full interleaving graph
# --------------------------------------------------------------------------------------
def assert_reduction_agrees(**kw):
    """The partial-order reduction against the full interleaving graph at the sizes ``kw``: the same
    verdict, a subset of its violations (the reduced graph is a subgraph), the same terminal states
    (the final state and every deadlock), no more states. Returns the full graph's result."""
    full = check(ModelConfig(por=False, **kw))
    red = check(ModelConfig(por=True, **kw))
    assert bool(full._violation_set) == bool(red._violation_set)
    assert red._violation_set <= full._violation_set
    assert full._terminal_set == red._terminal_set
    assert red.states <= full.states
    return full


@pytest.mark.parametrize("mode", quick_subset(("none",) + INJECT_MODES, quick=("none", "signal-before-payload"),
                                              reason="the ring's full graph at 2 ranks: up to 3 s on 2 cores"))
@pytest.mark.parametrize("sizes", [(2, 1, 2, 1), (1, 2, 3, 2)])
def test_reduction_preserves_verdict_and_terminal_states(mode, sizes):
    R, S, C, E = sizes
    kw = dict(ranks=R, slots=S, chunks=C, epochs=E, inject=Inject(mode), stop_at_first=False)
    assert_reduction_agrees(**kw)


@pytest.mark.parametrize("mode", quick_subset(("none",) + INJECT_MODES, quick=("none", "skip-acquire"),
                                              reason="3 ranks under the reduction: up to 3 s on 2 cores"))
def test_larger_configuration_under_reduction(mode):
    res = check(ModelConfig(ranks=3, slots=2, chunks=3, epochs=2, inject=Inject(mode)))
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


def test_every_model_check_option_has_help():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["model-check"]
    missing = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
    assert missing == [], missing


# --------------------------------------------------------------------------------------
# source_order='ready': the consumer takes any ready source of its chunk (RFC later optimisation)
# --------------------------------------------------------------------------------------
@pytest.mark.slow(reason="docs/cli.md's claim for the ready order: every interleaving at the default sizes "
                        "(879,348 states; its partial-order reduction leaves almost as many, so no cheaper proof)")
@pytest.mark.xdist_group("model-check-default-sizes")
def test_ready_order_passes_at_the_default_sizes_and_explores_more(tmp_path, capsys, default_check):
    rc, data = _cli(tmp_path, "--source-order", "ready")
    assert rc == 0, capsys.readouterr().out
    assert data["config"]["source_order"] == "ready"
    assert data["properties"] == {p: "PASS" for p in PROPERTIES}
    rank = default_check[1]
    assert rank["config"]["source_order"] == "rank" and data["config"] == {**rank["config"], "source_order": "ready"}
    # both orders of the two sources are explored: strictly more states than the rank order, and
    # exactly as many as docs/cli.md quotes
    assert data["states"] > rank["states"]
    assert f"2 ranks, {data['states']:,} states" in DOCS, f"{data['states']:,} states; docs/cli.md quotes others"


@pytest.mark.parametrize("mode", INJECT_MODES)
def test_ready_order_mutations_give_counterexamples(mode):
    # ignore-epoch on 1 slot, 1 chunk: the slot still holds epoch 1's chunk 0, whose sequence is epoch
    # 2's; the ABA shows at once (at the default sizes the first violation lies about 440,000 states
    # deep, a minute of search for the same verdict)
    sizes = dict(slots=1, chunks=1) if mode == "ignore-epoch" else {}
    res = check(ModelConfig(inject=Inject(mode), source_order="ready", **sizes))
    assert not res.ok and res.counterexample["properties"]
    if mode == "ignore-epoch":
        assert res.counterexample["properties"] == [PROP_ABA]


@pytest.mark.parametrize("mode", ("none", pytest.param("skip-ack-wait", marks=pytest.mark.slow(
    reason="the full graph of an unguarded reuse in ready order (2 ranks, 1 slot, 2 chunks)")),
    pytest.param("signal-before-payload", marks=pytest.mark.slow(
        reason="the full graph of ready order with a pending payload store (2 ranks, 1 slot, 2 chunks): 2 to 5 s"))))
def test_ready_order_reduction_preserves_verdict(mode):
    kw = dict(ranks=2, slots=1, chunks=2, epochs=1, inject=Inject(mode), stop_at_first=False, source_order="ready")
    assert_reduction_agrees(**kw)


def test_bad_source_order_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:  # argparse names the allowed values
        main(["model-check", "--source-order", "random"])
    assert info.value.code == 2 and "'rank', 'ready'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--source-order must be one of"):
        ModelConfig(source_order="random").validate()


# --------------------------------------------------------------------------------------
# --layer ep: the expert-parallel GPU layer's handoffs (early input_consumed ack, remote
# combine and its arrived counters, the owner's reduce; each rank begins its next epoch alone)
# --------------------------------------------------------------------------------------
def test_ep_layer_passes_at_the_default_sizes(tmp_path, capsys):
    rc, data = _cli(tmp_path, "--layer", "ep")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert data["config"] == {**data["config"], "layer": "ep", "ranks": 2, "slots": 2, "chunks": 3, "epochs": 2,
                              "inject": "none", "topk": 2, "por": True}
    assert data["exhaustive"] is True and data["final_reachable"] is True
    assert data["properties"] == {p: "PASS" for p in EP_PROPERTIES}
    # the reduced graph (2,421 states, 3,771 transitions, as the ep module's docstring quotes): a change
    # of the model or of the reduction shows here
    assert 2_300 <= data["states"] <= 2_550 and 3_600 <= data["transitions"] <= 4_000
    assert "layer=ep (topk 2)" in out and "PASS: every property holds" in out
    for p in (PROP_COMBINE_READ, PROP_COMBINE_OVERWRITE, PROP_COUNTER):
        assert p in out


def test_ep_routing_has_empty_contributions_and_an_empty_chunk():
    m = EPModel(ModelConfig(layer="ep"))
    for e in (1, 2):
        rows = {(r, c, d): 0 for r in range(2) for c in range(3) for d in range(2)}
        for d in range(2):
            for r, c, _k in m.entries[e][d]:
                rows[(r, c, d)] += 1
        assert m.expected[e][1][2] == 0  # rank 1 has one token fewer: its last chunk is empty
        # some consumer has no row of a chunk that has rows: it must add nothing, and is not waited for
        assert any(n == 0 and m.expected[e][r][c] > 0 for (r, c, d), n in rows.items())
        assert all(m.expected[e][r][c] == sum(rows[(r, c, d)] for d in range(2)) for r in range(2) for c in range(3))
    assert m.route[1] != m.route[2]  # new inputs, new routing every epoch


def test_ep_serialised_schedule_passes():
    res = run_serialised(EPModel(ModelConfig(layer="ep")))
    assert res["result"] == "PASS", res
    R, C, E, K, tokens = 2, 3, 2, 2, 3 + 2
    ring = R * 2 * C * (2 + R) + R * C * R * 2 + R  # producers, consumers (acquire, ack), ends
    ep = K * tokens * 2 + R * C  # per entry: write, release+add; per owner and chunk: reduce
    assert res["steps"] == E * (ring + ep)  # (no collective begin: each end begins the next epoch)


@pytest.mark.parametrize("mode", EP_INJECT_MODES)
def test_ep_serialised_schedule_of_each_mutation(mode):
    # Serialised, nothing overlaps: every broken handoff still completes, except the counter that is
    # never reset, which in epoch 2 counts past its expected value and never matches it.
    res = run_serialised(EPModel(ModelConfig(layer="ep", inject=EPInject(mode))))
    assert res["result"] == ("FAIL" if mode == "no-counter-reset" else "PASS"), res
    if mode == "no-counter-reset":
        assert "stuck" in res["error"] and "epoch 2" in "\n".join(res["trace_tail"])


EP_EXPECTED = {
    "ack-before-copy": (PROP_OVERWRITE, "its copy out of the slot has not completed"),
    "signal-before-combine": (PROP_COMBINE_READ, "still pending"),
    "skip-arrival-wait": (PROP_COMBINE_READ, "never written"),
    "no-counter-reset": (PROP_COUNTER, "was not reset"),
    "combine-by-slot": (PROP_COMBINE_OVERWRITE, "not reduced yet"),
}


@pytest.mark.parametrize("mode", EP_INJECT_MODES)
def test_ep_each_broken_handoff_gives_a_counterexample(tmp_path, capsys, mode):
    rc, data = _cli(tmp_path, "--layer", "ep", "--inject", mode)
    out = capsys.readouterr().out
    assert rc == 1 and data["ok"] is False
    ce = data["counterexample"]
    prop, words = EP_EXPECTED[mode]
    assert ce["properties"][0] == prop and words in ce["message"]
    assert data["properties"][prop] == "FAIL"
    assert ce["steps"] == len(ce["trace"]) and ce["trace"][-1].endswith("<-- VIOLATION")
    assert f"[{mode}]" in "\n".join(ce["trace"])  # the broken step is in the trace, named
    *_, fail, verdict = out.rstrip().splitlines()  # the FAIL line, then the injected bug's verdict
    assert "counter-example" in out and prop in out and fail.startswith("FAIL: ") and prop in fail
    assert verdict.startswith(f"streamring model-check: the injected bug ({mode}) was caught, as intended"), verdict


@pytest.mark.slow(reason="five ep mutations searched and their counter-examples shortened: about 3 s on 2 cores")
def test_ep_counterexamples_are_short():
    # one epoch suffices for three of them; the counter needs a second epoch of rank 0
    lens = {m: check(ModelConfig(layer="ep", inject=EPInject(m))).counterexample["steps"] for m in EP_INJECT_MODES}
    assert lens["ack-before-copy"] <= 20 and lens["signal-before-combine"] <= 20 and lens["skip-arrival-wait"] <= 12
    assert lens["no-counter-reset"] <= 110 and lens["combine-by-slot"] <= 60
    res = check(ModelConfig(layer="ep", slots=1, chunks=1, inject=EPInject.NO_COUNTER_RESET))
    assert res.counterexample["properties"][0] == PROP_COUNTER and res.counterexample["steps"] <= 40


def test_no_counter_reset_reads_the_previous_epochs_entries():
    ce = check(ModelConfig(layer="ep", inject=EPInject.NO_COUNTER_RESET)).counterexample
    assert ce["properties"] == [PROP_COUNTER, PROP_COMBINE_READ]
    assert "(epoch 2)" in ce["message"] and "result for chunk 0 of epoch 1" in ce["message"]


@pytest.mark.parametrize("mode", INJECT_MODES)
def test_ep_layer_still_catches_every_ring_mutation(mode):
    # (ignore-epoch at 2 chunks, where the leftover of epoch 1 in slot 0 has the sequence of e2:c0)
    res = check(ModelConfig(layer="ep", inject=Inject(mode), chunks=2 if mode == "ignore-epoch" else 3))
    assert not res.ok and res.counterexample["properties"]
    if mode == "ignore-epoch":
        assert res.counterexample["properties"] == [PROP_ABA]


def test_ep_mutations_and_topk_need_the_ep_layer(capsys):
    assert main(["model-check", "--inject", "ack-before-copy"]) == 2
    assert "needs --layer ep" in capsys.readouterr().err
    assert main(["model-check", "--topk", "1"]) == 2
    assert "needs --layer ep" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["model-check", "--layer", "moe"])
    assert "'ring', 'ep'" in capsys.readouterr().err


def test_ep_owner_waiting_for_an_empty_contribution_deadlocks(monkeypatch):
    # A broken count: the owner expects at least one row from every consumer, also from one
    # that has none of the chunk. Nothing ever adds it: the owner, and with it its rank, hangs.
    original = EPModel._init_layer

    def counts_empty_contributions(self):
        original(self)
        for e in range(1, self.E + 1):
            for r in range(self.R):
                for c in range(self.C):
                    if self.expected[e][r][c]:
                        self.expected[e][r][c] = sum(max(1, sum(1 for x in self.entries[e][d] if x[:2] == (r, c)))
                                                     for d in range(self.R))

    monkeypatch.setattr(EPModel, "_init_layer", counts_empty_contributions)
    res = check(ModelConfig(layer="ep"))
    assert res.properties[PROP_DEADLOCK] == "FAIL"
    assert run_serialised(EPModel(ModelConfig(layer="ep")))["result"] == "FAIL"


def test_ep_exact_acquire_is_checked_on_the_classify_in_use(monkeypatch):
    assert EPModel(ModelConfig(layer="ep")).exact_acquire is True
    assert EPModel(ModelConfig(layer="ep", inject=Inject.IGNORE_EPOCH)).exact_acquire is False
    assert EPModel(ModelConfig(layer="ep", inject=Inject.SKIP_ACQUIRE)).exact_acquire is False
    original = classify_gen
    monkeypatch.setattr(ring_layout, "classify_gen", lambda o, e, n, ignore_epoch=False: original(o, e, n, True))
    assert EPModel(ModelConfig(layer="ep")).exact_acquire is False


EP_SIZES = [(2, 1, 1, 2, 2), (1, 2, 3, 2, 2), (1, 1, 3, 2, 2)]
# 2 chunks of 2 ranks on one slot, one entry per token: the slot reused under the early
# acknowledgement (full graphs of up to 240,000 states; the sizes above cover the ring mutations;
# here the reduction must not assume the acks of an earlier lap are gone under skip-ack-wait)
EP_SIZE_REUSE = (2, 1, 2, 1, 1)


EP_REDUCTION_CASES = ([(m, z) for m in ("none",) + MODEL_INJECT_MODES for z in EP_SIZES]
                      + [(m, EP_SIZE_REUSE) for m in ("none", "skip-ack-wait", "ack-before-copy", "combine-by-slot")])


EP_REUSE_REASON = ("the full graph at the size where a slot is reused under the early acknowledgement (up to "
                   "240,000 states), where skip-ack-wait leaves an earlier lap's acks in the mask")


# the edit loop keeps the cases under a second (full graphs of a few thousand states)
EP_QUICK_SIZES = EP_SIZES[2:]
EP_SMALL_REASON = "the full graph of the ep layer at 2 ranks or 3 chunks: 1 to 4 s each on 2 cores"


@pytest.mark.parametrize("mode,sizes", [
    pytest.param(m, z, id=f"{m}-{'x'.join(map(str, z[:4]))}-topk{z[4]}",
                 marks=[pytest.mark.slow(reason=EP_REUSE_REASON)] if z == EP_SIZE_REUSE else
                 [] if z in EP_QUICK_SIZES and m not in ("skip-arrival-wait",) else
                 [pytest.mark.slow(reason=EP_SMALL_REASON)])
    for m, z in EP_REDUCTION_CASES])
def test_ep_reduction_preserves_verdict_and_terminal_states(mode, sizes):
    R, S, C, E, K = sizes
    kw = dict(layer="ep", ranks=R, slots=S, chunks=C, epochs=E, topk=K, inject=parse_inject(mode),
              stop_at_first=False)
    assert_reduction_agrees(**kw)


@pytest.mark.parametrize("mode", quick_subset(("none", "ack-before-copy", "signal-before-combine", "skip-arrival-wait"),
                                              quick=["signal-before-combine"],
                                              reason="the ep layer's full graph in ready order: about 2 s on 2 cores"))
def test_ep_ready_order(mode):
    kw = dict(layer="ep", ranks=2, slots=1, chunks=1, epochs=2, inject=parse_inject(mode), stop_at_first=False,
              source_order="ready")
    full = assert_reduction_agrees(**kw)
    assert bool(full._violation_set) == (mode != "none")
    # (at 3 chunks the ready order's coarse look-ahead leaves far more states: 2 chunks here)
    assert check(ModelConfig(layer="ep", chunks=2, source_order="ready", inject=parse_inject(mode))).ok is (
        mode == "none")
