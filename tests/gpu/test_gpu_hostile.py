"""A hostile peer on the device (tests/helpers/mp_gpu_hostile.py): its table and judge here on the CPU, the
table itself on a GPU (skipped without one, with the reason).

GPU: every metadata word, ``topk_idx`` entry and generation word a peer controls, corrupted one at a time
at boundary values on both sides, ends in its documented status word naming the source and chunk (or in
the dropped-route count), through ``ring_acquire_checked``, ``ring_wait_any`` and ``ep_gather``; and the
EP layer refuses to go on after such a word until it is rebuilt. One PE natively; two PEs when two GPUs
(or an MPS daemon, as in the GPU check's faults phase) are there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_skip import gpu_skip_reason, needs_gpu

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
import mp_gpu_hostile as H  # noqa: E402


# --------------------------------------------------------------------------------------------
# The table and its judge (CPU)
# --------------------------------------------------------------------------------------------
def test_table_corrupts_every_field_on_both_sides():
    from streamring.device.ringdesc import META_FIELD_NAMES, META_VALID
    from streamring.ring.layout import make_gen

    rows = H.hostile_rows()
    by_field = {}
    for r in rows:
        if isinstance(r.want, tuple):
            by_field.setdefault(r.want[1], set()).add(r.value)
    assert set(by_field) == set(META_FIELD_NAMES.values())
    # out of range in both directions, as the issue lists them; a count inside the slot is the peer's to
    # choose (consumers learn it) and must be accepted as it is
    assert {H.C + 1, -1, -2} <= by_field["valid count"]
    legal_counts = {r.value for r in rows if r.target == ("meta", META_VALID) and r.want == "ok"}
    assert {0, H.VALID - 1, H.VALID + 1, H.C} <= legal_counts
    assert {H.BASE - 1, H.BASE + 1} <= by_field["token base"]
    assert {H.CH - 1, H.CH + 1} <= by_field["chunk index"]
    older_epoch, later_lap = make_gen(H.EPOCH - 1, H.CH + 1), make_gen(H.EPOCH, H.CH + 1 + H.S)
    for field in ("route generation", "layout generation"):
        assert {older_epoch, later_lap} <= by_field[field], field
    bad_ids = {r.value for r in rows if r.want == "bad_route"}
    assert {H.E, -2} <= bad_ids
    legal_ids = {r.value for r in rows if r.target[0] == "topk" and r.want == "ok"}
    assert {-1, 0, H.E - 1} <= legal_ids
    gen_rows = {(r.target[1], r.want) for r in rows if r.target[0] == "gen"}
    assert gen_rows == {("route", "newer"), ("route", "older"), ("layout", "newer"), ("layout", "older")}
    assert len(rows) == len({(r.target, r.value) for r in rows}), "a row is listed twice"


def _status(code_name=None, src=0, chunk=0, seen=0, want=0, field=-1, violations=0, timeouts=0):
    from streamring.device import ringdesc as D

    w = [0] * D.RS_WORDS
    if code_name:
        w[D.RS_FIRST_ERROR] = (D.ERROR_CODES[code_name] | (src << 8) | (chunk << 24) | (((field + 1) & 0xFF) << 56))
    w[D.RS_BAD_SEEN], w[D.RS_BAD_WANT] = seen & H.U64, want
    w[D.RS_VIOLATIONS], w[D.RS_TIMEOUTS] = violations, timeouts
    return D.decode_status(w)


def test_judge_accepts_the_documented_word_and_nothing_else():
    from streamring.device.ringdesc import META_VALID

    row = next(r for r in H.hostile_rows() if r.want == ("meta", "valid count") and r.value == H.C + 1)
    right = _status("RE_META", 1, H.CH, H.C + 1, H.VALID, META_VALID, violations=1)
    assert H.judge_row(row, "acquire", right, 0, evil=1) == []
    assert H.judge_row(row, "acquire", _status(), 0, evil=1)[0].startswith("accepted")
    wrong_src = _status("RE_META", 0, H.CH, H.C + 1, H.VALID, META_VALID, violations=1)
    assert "expected" in H.judge_row(row, "acquire", wrong_src, 0, evil=1)[0]
    older = next(r for r in H.hostile_rows() if r.want == "older" and r.value == 0)
    assert H.judge_row(older, "acquire", _status("RE_ACQUIRE_TIMEOUT", 1, H.CH, 0, 1, timeouts=1), 0, 1) == []
    assert H.judge_row(older, "acquire", _status("RE_NEWER_GEN", 1, H.CH, 0, 1, violations=1), 0, 1) != []
    bad = next(r for r in H.hostile_rows() if r.want == "bad_route" and r.value == H.E)
    assert H.judge_row(bad, "gather", _status(), 1, 1, entry_out=H.E // 2, local_experts=H.E // 2) == []
    assert H.judge_row(bad, "gather", _status(), 0, 1) == ["dropped routes = 0, expected 1"]
    assert "not dropped" in H.judge_row(bad, "gather", _status(), 1, 1, entry_out=0, local_experts=6)[0]
    ok = next(r for r in H.hostile_rows() if r.target == ("none",))
    assert H.judge_row(ok, "ready", _status(), 0, 1) == []
    assert H.judge_row(ok, "ready", _status("RE_META", 1, 1, 0, 0, 0, violations=1), 0, 1) != []


# --------------------------------------------------------------------------------------------
# On a GPU
# --------------------------------------------------------------------------------------------
GPU_MODULES = ("nvshmem.core", "cuda.core", "triton")


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_COMM_WORLD", "HYDRA_")) and k not in ("RANK", "WORLD_SIZE",
                                                                                              "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _mps_share(pes: int) -> dict:
    """Under MPS every PE gets an equal share of the GPU (NVSHMEM's full multi-process mode needs it)."""
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // pes)} if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else {}


def run_scenarios(pes: int, *scenarios: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """tests/helpers/mp_gpu_hostile.py on ``pes`` PEs (1: this Python directly; more: the MPI's mpiexec)."""
    script = [sys.executable, str(ROOT / "tests" / "helpers" / "mp_gpu_hostile.py"), *scenarios]
    cmd = script
    if pes > 1:
        from streamring.host.launch import _is_openmpi, find_mpiexec

        mpiexec = find_mpiexec()
        extra = ["--oversubscribe", "--bind-to", "none"] if _is_openmpi(mpiexec) else []
        cmd = [mpiexec, "-n", str(pes), *extra, *script]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**_env(), **_mps_share(pes)},
                          timeout=timeout)


def _several_pes_reason():
    if gpu_skip_reason(*GPU_MODULES) is not None:
        return f"GPU test skipped: {gpu_skip_reason(*GPU_MODULES)}"
    import torch

    if torch.cuda.device_count() >= 2:
        return None
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe and Path(pipe).is_dir() and shutil.which("nvidia-cuda-mps-control"):
        return None
    return "two PEs need two GPUs, or an MPS daemon (CUDA_MPS_PIPE_DIRECTORY) to share one"


def _ok(r, *scenarios):
    assert r.returncode == 0 and all(f"SCENARIO OK {s}" in r.stdout for s in scenarios), \
        f"rc={r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"


@pytest.mark.gpu
@needs_gpu(*GPU_MODULES)
def test_device_hostile_table_one_pe():
    """One PE is its own peer: every row through the same kernels and words as between PEs."""
    r = run_scenarios(1, "hostile_table")
    _ok(r, "hostile_table")
    assert "rows x checks refused or accepted as required on 1 PEs" in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(_several_pes_reason() is not None, reason=str(_several_pes_reason()))
def test_device_hostile_table_two_pes():
    """PE 1 is hostile: PE 0 names source 1 in every refusal."""
    r = run_scenarios(2, "hostile_table")
    _ok(r, "hostile_table")


@pytest.mark.gpu
@needs_gpu(*GPU_MODULES)
def test_layer_refuses_to_continue_until_rebuilt():
    r = run_scenarios(1, "layer_broken")
    _ok(r, "layer_broken")
