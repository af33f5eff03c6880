"""The torch op ``streamring::moe_forward`` on 2 real ranks (tests/helpers/mp_moe_ops.py): the op equals
``buf.forward`` bitwise (float32 and bf16 tokens, batch and streamed, valid counts), its fake implementation
gives the output's shape and dtype, ``torch.compile`` keeps it one node with no graph break (eager backend,
``torch._dynamo.explain``, a second token count, and the default inductor backend)."""

import pytest

SCRIPT = "tests/helpers/mp_moe_ops.py"


def test_op_equals_buffer_forward_and_compiles_without_graph_break(mpirun):
    r = mpirun(2, SCRIPT, "op_eager_and_explain", timeout=300)
    assert r.rc == 0 and "SCENARIO OK" in r.out, r


def test_num_tokens_is_validated_and_rows_past_it_are_ignored(mpirun):
    r = mpirun(2, SCRIPT, "num_tokens_errors", timeout=300)
    assert r.rc == 0 and "SCENARIO OK" in r.out, r


@pytest.mark.slow(reason="torch.compile's default backend generates and compiles C++ on both ranks (25-40 s on 2 "
                         "shared cores with a cold inductor cache): the one test of the op under inductor")
def test_op_under_inductor(mpirun):
    """The default backend generates and compiles C++ once, with dynamic shapes (about 25 s on 2 shared cores with
    a cold inductor cache, 8 s warm); a second token count on each rank runs the same graph (no recompile)."""
    r = mpirun(2, SCRIPT, "op_inductor", timeout=400)
    assert r.rc == 0 and "SCENARIO OK" in r.out, r
    assert r.out.count("INDUCTOR rank") == 2, r
