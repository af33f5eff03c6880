"""The host side of the GPU layer, on the CPU (no GPU needed).

* which expert GEMMs ``run`` compares: the batch and the streamed layer get one implementation,
  resolved once (a ``pdl`` streamed layer takes Triton, so its batch layer does too), and the
  report names both;
"""

from __future__ import annotations

import io

import pytest

from streamring.config import load_config
from streamring.host.report import Report

FAST = ["layer.weight_dtype=fp8", "layer.router=deepseek_v3", "layer.num_experts=16", "layer.n_group=4",
        "layer.topk_group=2", "layer.topk=4", "layer.hidden=512", "layer.intermediate=256", "run.block_m=16",
        "run.tokens_per_rank=300", "ring.num_slots=2", "ring.tokens_per_slot=64"]


# --------------------------------------------------------------------------------------------
# Same GEMM on both sides of every comparison
# --------------------------------------------------------------------------------------------
class _FakeEPMoE:
    """Records what ``run`` asks of the GPU layer; resolves ``gemm`` as the real one does."""

    made: list = []

    def __init__(self, heap, shape, fw, tokens, plan, *, gemm="auto", **kw):
        from streamring.moe import gpu_layer

        self.plan, self.asked = plan, gemm
        self.gemm = gpu_layer.resolve_gemm(gemm, (plan.policy,))
        _FakeEPMoE.made.append(self)


@pytest.mark.parametrize("policy,cutlass,want", [("pdl", True, "triton"), ("spin_kernel", True, "cutlass"),
                                                 ("spin_kernel", False, "triton"), ("serialized", True, "cutlass")])
def test_run_gives_batch_and_streamed_the_same_gemm(monkeypatch, policy, cutlass, want):
    """Before: the batch layer resolved 'auto' to CUTLASS while a 'pdl' streamed layer took Triton, and
    streamed != batch measured the two GEMMs' rounding. Now both are built with one resolved value."""
    from streamring import runner
    from streamring.moe import gpu_layer

    monkeypatch.setattr(gpu_layer, "cutlass_available", lambda: cutlass)
    monkeypatch.setattr(gpu_layer, "EPMoE", _FakeEPMoE)
    _FakeEPMoE.made = []
    cfg = load_config(None, FAST + [f"nvshmem.progress={policy}"], backend="nvshmem",
                      ranks=1)
    layers = runner.gpu_run_layers(object(), cfg, runner.shape_from_config(cfg), None, [300], 0)
    assert {m.asked for m in _FakeEPMoE.made} == {want}, "the layers must be given the resolved implementation"
    assert layers["batch"].gemm == layers["stream"].gemm == want
    assert layers["stream"].plan.policy == policy and layers["batch"].plan.policy == "serialized"


def test_resolve_gemm_names_the_allowed_values():
    from streamring.moe.gpu_layer import resolve_gemm

    assert resolve_gemm("cutlass", ("pdl",)) == "cutlass"  # explicit: EPMoE then refuses pdl with a clear error
    with pytest.raises(ValueError, match=r"gemm must be one of \('auto', 'triton', 'cutlass'\), got 'cublas'"):
        resolve_gemm("cublas")


def _fast_row(rank, gemm_batch, gemm_stream):
    return dict(rank=rank, tokens=300, chunks=5, experts_hit=4, bitwise_equal=True, max_abs_stream_minus_batch=0.0,
                ref_ok=True, ref_max_abs_err=0.01, ref_max_err_ratio=0.5, ref_excluded=0, batch_wall_s=0.0,
                stream_wall_s=0.0, epochs=2, scheduler="blocks", rtol=0.03, atol=0.0, path="fast", transport="p2p",
                policy="pdl", gemm=gemm_stream, gemm_batch=gemm_batch, gemm_stream=gemm_stream, ring_errors={})


def _report(rows):
    from streamring.host.rank_main import report_run

    cfg = load_config(None, FAST + ["nvshmem.progress=pdl"], backend="nvshmem", ranks=len(rows))
    buf = io.StringIO()
    code = report_run(rows, cfg, 1.0, None, out=Report(file=buf, width=None))
    return code, buf.getvalue()


def test_report_names_the_gemm_of_both_paths():
    code, text = _report([_fast_row(0, "triton", "triton"), _fast_row(1, "triton", "triton")])
    assert code == 0 and "triton GEMMs on both paths" in text, text


def test_report_fails_a_comparison_across_two_gemms():
    code, text = _report([_fast_row(0, "cutlass", "triton"), _fast_row(1, "triton", "triton")])
    assert code == 1, text
    assert "batch and streamed ran different GEMMs (batch, streamed) {0: ('cutlass', 'triton')}" in text, text


def test_gpu_check_judge_refuses_a_run_across_two_gemms():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_check_steps",
                                                  Path(__file__).resolve().parents[1] / "launch/gpu_check_steps.py")
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    same = {"ok": True, "ranks": [_fast_row(0, "triton", "triton")]}
    ok, note = steps.judge_run(0, "", same)
    assert ok and "GEMMs (batch, stream) [('triton', 'triton')]" in note, note
    ok, note = steps.judge_run(0, "", {"ok": True, "ranks": [_fast_row(0, "cutlass", "triton")]})
    assert not ok and "DIFFER" in note, note
