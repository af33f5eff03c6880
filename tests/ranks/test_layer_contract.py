"""The one contract of the MoE layer's buffers (:mod:`streamring.moe.contract`), run against both: ``MoEBuffer`` on
2 MPI ranks and ``EPBuffer`` on the emulated device (``tests/helpers/contract_cases.py``: one list of cases, each run
the same way on either buffer). A case that holds on one buffer and not on the other fails here, naming the case."""

from __future__ import annotations

import os
import re
import sys

import pytest

from conftest import ROOT, Result, _run
from contract_cases import CASES

SCRIPT = "tests/helpers/contract_cases.py"
_RESULTS: dict = {}


def verdicts(out: str) -> dict:
    return dict(re.findall(r"^CASE (\S+) (ok|FAIL.*)$", out, flags=re.M))


def run_backend(backend: str, mpirun) -> Result:
    if backend not in _RESULTS:
        if backend == "cpu":
            _RESULTS[backend] = mpirun(2, SCRIPT, "cpu", timeout=300)
        else:
            _RESULTS[backend] = Result(_run([sys.executable, SCRIPT, "emulated"], 400,
                                            {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}), None)
    return _RESULTS[backend]


@pytest.mark.slow(reason="the emulated device runs the GPU layer's kernels in Triton's CPU interpreter (30-60 s for the "
                         "whole contract on 2 shared cores); the CPU side runs 2 MPI ranks (10 s)")
@pytest.mark.parametrize("backend", ["cpu", "emulated"], ids=["MoEBuffer-2-ranks", "EPBuffer-emulated"])
def test_every_case_of_the_contract_holds(backend, mpirun):
    """Every case of the one list passes on this buffer (the script prints one verdict per case and ends with
    CONTRACT DONE): the same cases on both buffers, so a difference between them is a failing case here."""
    r = run_backend(backend, mpirun)
    got = verdicts(r.out)
    assert "CONTRACT DONE" in r.out and list(got) == CASES, (list(got), r)  # every case, on either buffer
    failed = {k: v for k, v in got.items() if v != "ok"}
    assert not failed and r.rc == 0, (failed, r)


def test_the_suite_catches_a_buffer_that_breaks_the_contract(tmp_path):
    """Negative control: a MoEBuffer whose forward returns float32 whatever x's dtype (the old contract) fails the
    dtype case, on the emulated side's script run with the CPU buffer on one rank."""
    patch = tmp_path / "sitecustomize.py"
    patch.write_text("import streamring.moe.layer as L\n"
                     "_f = L.MoEBuffer.forward\n"
                     "def forward(self, x, *a, **k):\n"
                     "    y = _f(self, x, *a, **k)\n"
                     "    return y.float() if k.get('out') is None else y\n"
                     "L.MoEBuffer.forward = forward\n")
    r = Result(_run([sys.executable, SCRIPT, "cpu"], 300, {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}), None)
    got = verdicts(r.out)
    assert got.get("y_in_x_dtype", "").startswith("FAIL"), r
    assert got.get("implements_the_protocol") == "ok", r
