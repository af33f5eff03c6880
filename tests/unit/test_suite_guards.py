"""The suite's own checkers, each shown to catch what it is for (in-process, fast)."""

import torch

from conftest import ROOT, error_types, missing_test_dependencies
from streamring.moe.bitwise import bit_difference, same_bits


def test_bitwise_comparison_sees_signed_zero_and_nan_payloads():
    nan = torch.tensor([1.0, float("nan")])
    assert not torch.equal(nan, nan.clone()) and same_bits(nan, nan.clone())  # the same NaN has the same bits
    a = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    b = a.clone()
    assert same_bits(a, b) and bit_difference(a, b) is None
    b[0, 1] = -0.0
    assert torch.equal(a, b)  # what torch.equal calls equal ...
    assert not same_bits(a, b)  # ... is not bitwise equal
    msg = bit_difference(b, a, "streamed", "batch")
    assert msg == ("streamed != batch: 1 of 4 elements differ in their bits; first at index [0, 1]: "
                   "-0.0 (0x80000000) vs 0.0 (0x00000000)"), msg
    assert not same_bits(a, a.double()) and "torch.float32" in bit_difference(a, a.double())
    assert not same_bits(a, a.reshape(4))
    e = torch.zeros(0, 8)
    assert same_bits(e, e.clone())


def test_missing_test_dependency_is_reported(tmp_path):
    assert missing_test_dependencies() == []  # this environment: every declared test dependency present
    text = (ROOT / "pyproject.toml").read_text()
    assert '"hypothesis>=6.100"' in text
    fake = tmp_path / "pyproject.toml"
    fake.write_text(text.replace('"hypothesis>=6.100"', '"hypothesis>=999", "no-such-package-streamring>=1"'))
    missing = missing_test_dependencies(fake)
    assert missing[0].startswith("hypothesis>=999 (found ") and missing[1] == "no-such-package-streamring>=1 (not installed)"


def test_error_types_reads_the_ranks_error_lines():
    err = ("[streamring rank 2] error: WatchdogError: rank 2: watchdog: waited 5.00s\n"
           "noise TypeError: not a rank line\n[streamring rank 0] error: ProtocolViolation: rank 0: ...\n")
    assert error_types(err) == {"WatchdogError", "ProtocolViolation"}
