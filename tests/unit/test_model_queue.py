"""``streamring model-check --layer queue``: the persistent consumer's work-queue handoffs.

The correct protocol passes every property at several sizes (every interleaving: the model has no
reduction, so there is no reduced graph to compare); each mutation gives a short counter-example
that names its property and ends at the violating step; the CLI exits 0 / 1 / 2.
"""

from __future__ import annotations

import json

import pytest

from streamring.cli import main
from streamring.device.queue_order import item_of
from streamring.verify.names import QUEUE_INJECT_MODES
from streamring.verify.queue import (PROP_DONE, PROP_L1, PROP_OWNER, PROP_READY, QUEUE_PROPERTIES, QueueConfig,
                                     QueueModel, check_queue)


@pytest.mark.parametrize("kw", [{}, {"ctas": 1}, {"chunks": 2}, {"chunks": 1}, {"blocks": 4}, {"tiles": 3, "group": 1},
                                {"block_rows": 3, "chunks": 4}])
def test_the_correct_queue_passes_every_property(kw):
    res = check_queue(QueueConfig(**kw))
    assert res.ok, (kw, res.properties, res.counterexample)
    assert set(res.properties) == set(QUEUE_PROPERTIES) and res.exhaustive and res.final_reachable


def test_default_size_state_count_is_pinned():
    """The CLI's default sizes: a change of the model shows here first (and the run stays in seconds)."""
    res = check_queue(QueueConfig(chunks=3))
    assert (res.states, res.transitions) == (9646, 23528)
    assert res.time_s < 20


@pytest.mark.parametrize("inject,prop,max_steps", [("claim-before-ready", PROP_READY, 5),
                                                   ("l2-before-l1", PROP_L1, 40),
                                                   ("arrival-before-store", PROP_OWNER, 60)])
def test_each_mutation_gives_a_short_counterexample(inject, prop, max_steps):
    res = check_queue(QueueConfig(chunks=3, inject=inject))
    assert not res.ok and res.properties[prop] == "FAIL"
    ce = res.counterexample
    assert ce["properties"] == [prop] and ce["steps"] <= max_steps, ce
    assert ce["trace"][-1].endswith("<-- VIOLATION")
    if inject == "arrival-before-store":
        # the block's last tile signals the owner, the owner reads, and only then would the tile be stored
        signal = max(i for i, line in enumerate(ce["trace"]) if "arrived[" in line and "+=" in line)
        assert "owner: arrived" in ce["trace"][-1] and signal < len(ce["trace"]) - 1
    if inject == "l2-before-l1":
        assert "[no wait: l2-before-l1]" in ce["trace"][-2]


def test_mutations_list_matches_the_kernel_bits():
    from streamring.device.persistent_moe import QUEUE_INJECT_BITS

    assert set(QUEUE_INJECT_MODES) == set(QUEUE_INJECT_BITS) - {"none"}


def test_the_model_claims_items_in_the_kernels_order():
    m = QueueModel(QueueConfig())
    assert [m.item(t) for t in range(40)] == [item_of(t, 2, 2, 2) for t in range(40)]
    # the data of the default size: 5 rows over 3 chunks, the last block partial (ready at the seal)
    assert m.chunk_of == [0, 0, 1, 1, 2] and m.runs == [[(0, 2)], [(1, 2)], [(2, 1)]]
    assert m.ready_after == [1, 2, 2] and m.expected == [2, 2, 1]


def test_an_owner_waiting_for_a_row_never_signalled_is_a_deadlock(monkeypatch):
    """Negative control of the liveness check: an owner that expects one row more than its chunk's blocks
    carry waits forever (no-deadlock fails, with its trace) although no safety property breaks."""
    real = QueueModel.__init__

    def one_more_row(self, cfg):
        real(self, cfg)
        self.expected[-1] += 1

    monkeypatch.setattr(QueueModel, "__init__", one_more_row)
    res = check_queue(QueueConfig(chunks=3))
    assert res.properties["no-deadlock"] == "FAIL" and res.counterexample["properties"] == ["no-deadlock"]
    assert all(v in ("PASS", "NOT CHECKED (stopped at the first violation)") for k, v in res.properties.items()
               if k != "no-deadlock")


def test_a_final_state_with_a_missing_tile_is_caught():
    """Negative control of all-items-done: the check itself, on a final state whose block 0 ran one L2
    tile short."""
    m = QueueModel(QueueConfig())
    st = list(m.initial())
    st[0], st[2], st[3], st[4] = 2 * m.C + 1, m.B, 1, m.C
    for i in range(m.N):
        st[m.O_CTA + 3 * i] = 9  # EXIT
    for b in range(m.B):
        st[m.O_L1 + b] = st[m.O_L2 + b] = m.NT
        st[m.O_H1 + b] = st[m.O_Y + b] = m.mask
    assert m.is_final(tuple(st)) and m.final_violation(tuple(st)) is None
    st[m.O_L2] = m.NT - 1
    v = m.final_violation(tuple(st))
    assert v is not None and v.properties == (PROP_DONE,)


def test_cli_exit_codes_and_json(tmp_path, capsys):
    assert main(["model-check", "--layer", "queue"]) == 0
    assert "PASS: every property holds" in capsys.readouterr().out
    out = tmp_path / "q.json"
    assert main(["model-check", "--layer", "queue", "--inject", "arrival-before-store", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["config"]["layer"] == "queue" and data["counterexample"]["properties"] == [PROP_OWNER]
    capsys.readouterr()
    assert main(["model-check", "--layer", "queue", "--blocks", "0"]) == 2
    assert "--blocks must be an integer >= 1" in capsys.readouterr().err
    assert main(["model-check", "--layer", "queue", "--inject", "skip-acquire"]) == 2
    assert main(["model-check", "--inject", "claim-before-ready"]) == 2
    assert "needs --layer queue" in capsys.readouterr().err
