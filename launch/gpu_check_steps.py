#!/usr/bin/env python3
"""The GPU check's steps, each with a timeout, under one time budget; prints a table.

Started by ``launch/gpu_check.sh`` (which installs the carried wheels, sets PYTHONPATH
and starts/stops the MPS daemon around the multi-PE phase). Writes under ``$OUT``
(default ./out): ``gpu_check.log`` (every step's output), ``summary.json``,
``bench.json``. Exit 0 iff every expectation held (a step skipped for lack of time
counts as a failure: nothing is claimed that did not run).

Phases: ``--phase single`` (1 PE, no MPS), ``--phase multi`` (2, 3 and 4 PEs; the
caller has started MPS), ``--phase report`` (prints the table of both phases).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from streamring.ring.policies import PROGRESS_POLICIES, REFUSED_POLICIES  # noqa: E402  (plain data, no GPU imports)
OUT = Path(os.environ.get("OUT") or ROOT / "out")
LOG = OUT / "gpu_check.log"
STATE = OUT / "summary.json"
TMP = Path(os.environ.get("STREAMRING_CHECK_TMP", "/tmp/streamring-check"))
CONFIGS = ROOT / "configs"
PY = sys.executable or "python3"


def _now() -> float:
    return time.monotonic()


T_START = float(os.environ.get("GPU_CHECK_T0", "0")) or time.time()
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "520"))
REPLAYS = os.environ.get("GPU_CHECK_REPLAYS", "10000")  # graph replays per policy in gpu-check steps


def elapsed() -> float:
    return time.time() - T_START


def load_state() -> dict:
    if STATE.exists():
        return json.loads(STATE.read_text())
    return {"steps": []}


def save_state(state: dict) -> None:
    STATE.write_text(json.dumps(state, indent=1, default=str))


def log(text: str) -> None:
    with LOG.open("a") as f:
        f.write(text)
    sys.stdout.write(text)
    sys.stdout.flush()


#: Every stress --inject mode with the config and chunk count that makes it show (ignore-epoch
#: needs a wrap onto an old epoch's leftover: the aba config, 2 chunks); each must fail.
STRESS_INJECT_CASES = (("skip-acquire", "stress-basic.yaml", 16),
                       ("signal-before-payload", "stress-basic.yaml", 16),
                       ("skip-ack-wait", "stress-basic.yaml", 16),
                       ("ignore-epoch", "stress-aba.yaml", 2))


def mpiexec(n: int, *args: str) -> list[str]:
    return ["mpiexec", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(n), PY, *args]


def run_step(state: dict, name: str, cmd: list[str], timeout: float, *, pes: int, expect: str = "pass",
             judge=None, env: dict | None = None, json_path: Path | None = None) -> dict:
    """Run one step; ``judge(rc, output, json_or_None) -> (ok, note)`` decides the verdict."""
    step = {"name": name, "pes": pes, "expect": expect, "cmd": " ".join(cmd)}
    only = os.environ.get("GPU_CHECK_ONLY")
    if only and not re.search(only, f"{name} pes={pes}"):
        return step  # not selected: neither run nor recorded
    left = BUDGET_S - elapsed()
    if left < 20:
        step.update(verdict="SKIP", note=f"time budget spent ({elapsed():.0f}s of {BUDGET_S:.0f}s)", wall_s=0.0)
        log(f"\n=== {name}: SKIPPED (time budget)\n")
        state["steps"].append(step)
        save_state(state)
        return step
    timeout = min(timeout, left - 10)
    e = dict(os.environ)
    e["PYTHONUNBUFFERED"] = "1"
    if env:
        e.update(env)
    if json_path and json_path.exists():
        json_path.unlink()
    log(f"\n=== {name} (PEs={pes}, timeout {timeout:.0f}s, t={elapsed():.0f}s)\n$ {' '.join(cmd)}\n")
    t0 = _now()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        # mpiexec and its ranks run in their own session: take the whole group down
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        out, _ = proc.communicate()
        rc = 124
        out = (out or "") + f"\n[gpu_check] TIMEOUT after {timeout:.0f}s: killed\n"
    wall = _now() - t0
    log(out[-20000:] + f"\n--- rc={rc} wall={wall:.1f}s\n")
    data = None
    if json_path and json_path.exists():
        try:
            data = json.loads(json_path.read_text())
        except ValueError:
            data = None
    ok, note = (judge or judge_rc)(rc, out, data)
    if expect == "fail":
        ok, note = judge_expected_failure(rc, out, data)
    step.update(rc=rc, wall_s=round(wall, 1), verdict="PASS" if ok else "FAIL", note=note)
    if data is not None:
        step["json"] = data
    state["steps"].append(step)
    save_state(state)
    log(f"=== {name}: {step['verdict']} ({note})\n")
    return step


def judge_rc(rc, out, data):
    return rc == 0, f"rc={rc}"


def judge_stress(rc, out, data):
    if rc != 0 or data is None:
        return False, f"rc={rc}" + ("" if data else ", no json")
    ranks = data["ranks"]
    consumed = [x["chunks_consumed"] for x in ranks]
    published = sum(x["chunks_published"] for x in ranks)
    ok = data["violations"] == 0 and len(set(consumed)) == 1 and consumed[0] == published
    return ok, f"violations={data['violations']} consumed/rank={consumed[0]} published={published} " \
               f"wall={data.get('wall_s', 0):.1f}s"


def judge_expected_failure(rc, out, data):
    # stress: violations in its JSON or a watchdog; run (EP layer): streamed != batch, ring errors
    # or an output outside its tolerance on some rank
    fast = data is not None and isinstance(data.get("ranks"), list) and data.get("command") == "run" and any(
        not r.get("bitwise_equal", True) or r.get("ring_errors") or not r.get("ref_ok", True) for r in data["ranks"])
    caught = fast or (data is not None and data.get("violations", 0) > 0) or "watchdog" in out or \
        "violation" in out.lower()
    ok = rc != 0 and caught
    v = data.get("violations") if data else None
    return ok, f"rc={rc} (expected != 0), caught={caught}, violations={v}"


def judge_graph(rc, out, data):
    if data is None:
        return False, f"rc={rc}, no json"
    bad = [f"{r['policy']}/{r['inject']}" for r in data if r.get("verdict") not in ("PASS", "n/a")]
    na = [r["policy"] for r in data if r.get("verdict") == "n/a"]
    replays = {r["policy"]: r.get("replays") for r in data if r.get("inject") == "none"}
    note = f"rc={rc} replays={replays}" + (f" FAILED={bad}" if bad else "") + (f" n/a={na}" if na else "")
    return rc == 0 and not bad, note


def judge_pytest(rc, out, data):
    tail = [ln for ln in out.strip().splitlines() if ("passed" in ln or "failed" in ln or "skipped" in ln)]
    return rc == 0, (tail[-1].strip() if tail else f"rc={rc}")


def judge_run(rc, out, data):
    if rc != 0 or data is None:
        return False, f"rc={rc}" + ("" if data else ", no json")
    rows = data["ranks"]
    eq = all(r["bitwise_equal"] for r in rows)
    worst = max(r["ref_max_err_ratio"] for r in rows)
    # the EP layer's rows name both sides' GEMMs: a comparison across two implementations proves nothing
    gemms = sorted({(r["gemm_batch"], r["gemm_stream"]) for r in rows if "gemm_batch" in r})
    same_gemm = all(b == s for b, s in gemms)
    return bool(data["ok"]) and eq and same_gemm, (
        f"stream==batch bitwise on {sum(r['bitwise_equal'] for r in rows)}/{len(rows)} "
        + (f"ranks, GEMMs (batch, stream) {gemms}{'' if same_gemm else ' DIFFER'}, " if gemms else "ranks, ")
        + f"worst err/tol vs f64 {worst:.3f}, batch "
        f"{max(r['batch_wall_s'] for r in rows):.2f}s stream {max(r['stream_wall_s'] for r in rows):.2f}s")


def run_cmd(n: int, json_path: Path, *extra: str) -> list[str]:
    return mpiexec(n, "-m", "streamring", "run", "--backend", "nvshmem", "--set", f"ranks={n}",
                   "--json", str(json_path), *extra)


def stress_cmd(n: int, json_path: Path, *extra: str) -> list[str]:
    return mpiexec(n, "-m", "streamring", "stress", "--backend", "nvshmem", "--set", f"ranks={n}",
                   "--json", str(json_path), *extra)


#: the GPU tests of the single-PE phase (natively; the Triton kernels' CPU-interpreter tests among them)
SINGLE_PE_GPU_TESTS = ("tests/unit/test_gpu.py", "tests/gpu/test_gpu_ep.py", "tests/gpu/test_gpu_ep_rules.py",
                       "tests/gpu/test_gpu_persistent.py", "tests/gpu/test_gpu_hostile.py",
                       "tests/unit/test_ep_kernels.py", "tests/unit/test_blocks.py",
                       "tests/unit/test_persistent_consumer.py")


def phase_single(state: dict) -> None:
    TMP.mkdir(parents=True, exist_ok=True)
    run_step(state, "build cubin", [PY, "-m", "streamring.device.build", "-v"], 240, pes=0)
    gj = TMP / "graph-1.json"
    run_step(state, f"gpu-check x{REPLAYS} replays, all policies + negative controls", mpiexec(
        1, "-m", "streamring", "gpu-check", "--policies", "all", "--replays", REPLAYS, "--controls",
        "--json", str(gj)), 150, pes=1, judge=judge_graph, json_path=gj)
    sj = TMP / "stress-1.json"
    run_step(state, "stress default", stress_cmd(1, sj, "--set", "stress.chunks_per_rank=16"), 90, pes=1,
             judge=judge_stress, json_path=sj)
    rj = TMP / "run-1.json"
    run_step(state, "MoE run (router, chunk_local) streamed vs batch", run_cmd(
        1, rj, "--set", "run.tokens_per_rank=200"), 120, pes=1, judge=judge_run, json_path=rj)
    for policy in EP_POLICIES:  # every policy the expert-parallel layer offers, one PE
        fj = TMP / f"fast-1-{policy}.json"
        run_step(state, f"EP layer run: policy {policy}", run_cmd(1, fj, *FAST, "--set", f"nvshmem.progress={policy}"),
                 150, pes=1, judge=judge_run, json_path=fj)
    files = [f for f in SINGLE_PE_GPU_TESTS if (ROOT / f).exists()]
    run_step(state, "pytest the GPU layer's tests (native, 1 PE)",
             [PY, "-m", "pytest", "-q", "-rs", *files, "-p", "no:cacheprovider"], 360, pes=1, judge=judge_pytest)
    run_step(state, "HF DeepSeek-V3 swap on the GPU layer (1 PE)",
             mpiexec(1, "tests/helpers/mp_hf.py", "drop_in_gpu"), 150, pes=1,
             judge=lambda rc, out, data: (rc == 0 and "SCENARIO OK" in out, f"rc={rc}"))
    bj = OUT / "bench.json"
    run_step(state, "bench_signal_latency", mpiexec(1, "-m", "bench.signal_latency", "--json", str(bj)), 120,
             pes=1, json_path=bj)


def mps_env(n: int) -> dict:
    """The environment of a PE when n share one GPU under MPS: an equal share of the SMs, and an equal share
    of the 32 hardware work queues one process asks for (launch/device_env.sh; each stream its own queue,
    for the stream_wait policy). With 32 queues per client, 4 clients could not create their contexts
    (CUDA out of memory in torch.cuda.set_device) where 2 and 3 could (docs/gpu.md); the first step of
    the phase (:func:`mps_contexts`) prints what else holds the GPU when a context fails."""
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // n), "CUDA_DEVICE_MAX_CONNECTIONS": str(max(4, 32 // n))}


def phase_multi(state: dict) -> None:
    TMP.mkdir(parents=True, exist_ok=True)
    mps = mps_env
    for n in (2, 4):  # first of all: the contexts themselves (says what else holds the GPU if they fail)
        run_step(state, f"MPS: {n} processes each make a CUDA context",
                 [PY, "launch/gpu_check_steps.py", "--mps-contexts", str(n)], 60, pes=n, env=mps(n))
    # 2 PEs
    gj = TMP / "graph-2.json"
    run_step(state, f"gpu-check x{REPLAYS} replays, all policies", mpiexec(
        2, "-m", "streamring", "gpu-check", "--policies", "all", "--replays", REPLAYS, "--json", str(gj)),
        150, pes=2, judge=judge_graph, json_path=gj, env=mps(2))
    sj = TMP / "stress-2.json"
    run_step(state, "stress default", stress_cmd(2, sj, "--set", "stress.chunks_per_rank=16"), 90, pes=2,
             judge=judge_stress, json_path=sj, env=mps(2))
    rj = TMP / "run-2.json"
    run_step(state, "MoE run (router, chunk_local) streamed vs batch", run_cmd(2, rj), 120, pes=2,
             judge=judge_run, json_path=rj, env=mps(2))
    for policy in EP_POLICIES:
        if policy == "green_ctx":  # MPS clients cannot create green contexts (docs/gpu.md)
            continue
        fj = TMP / f"fast-2-{policy}.json"
        run_step(state, f"EP layer run: policy {policy}", run_cmd(2, fj, *FAST, "--set", f"nvshmem.progress={policy}"),
                 150, pes=2, judge=judge_run, json_path=fj, env=mps(2))
    # the ready order's grouped dispatch steps: forwards this small group the sources ready together, the
    # straggler's source gets a step of its own (the same run, with its other sizes, passed under MPS in
    # launch/ep_mps_bench.sh step 1b)
    fj = TMP / "fast-2-ready.json"
    run_step(state, "EP layer run: ready source order + straggler 3 ms on rank 1", run_cmd(
        2, fj, *FAST, "--set", "run.source_order=ready", "--set", "run.straggler={rank: 1, ms: 3}"), 150, pes=2,
        judge=judge_run, json_path=fj, env=mps(2))
    tj = TMP / "torchrun-2.json"
    run_step(state, "torchrun bootstrap: stress", ["torchrun", "--nproc-per-node", "2", "-m", "streamring", "stress",
                                                   "--backend", "nvshmem", "--set", "stress.chunks_per_rank=8",
                                                   "--json", str(tj)], 90, pes=2, judge=judge_stress,
             json_path=tj, env=mps(2))
    # 4 PEs
    rj = TMP / "run-4.json"
    run_step(state, "MoE run (deepseek_v3 fp8, reservation, tokens 0/1/77/300)", run_cmd(
        4, rj, "--set", "layer.router=deepseek_v3", "--set", "layer.num_experts=16", "--set", "layer.n_group=4",
        "--set", "layer.topk_group=2", "--set", "layer.topk=4", "--set", "layer.weight_dtype=fp8",
        "--set", "run.scheduler=reservation", "--set", "run.tokens_per_rank=[0, 1, 77, 300]",
        "--set", "ring.num_slots=2", "--set", "ring.tokens_per_slot=16"), 150, pes=4, judge=judge_run,
        json_path=rj, env=mps(4))
    gj = TMP / "graph-4.json"
    run_step(state, f"gpu-check x{REPLAYS} replays, all policies", mpiexec(
        4, "-m", "streamring", "gpu-check", "--policies", "all", "--replays", REPLAYS, "--json", str(gj)),
        150, pes=4, judge=judge_graph, json_path=gj, env=mps(4))
    # 3 PEs: every inject mode must be caught (as the CPU suite does), then the 3-rank configs
    for mode, cfg, chunks in STRESS_INJECT_CASES:
        ij = TMP / f"inject-{mode}.json"
        run_step(state, f"stress --inject {mode} ({cfg})", stress_cmd(
            3, ij, "--config", str(CONFIGS / cfg), "--inject", mode, "--set", "wait_timeout_s=5",
            "--set", f"stress.chunks_per_rank={chunks}"), 60, pes=3, expect="fail", json_path=ij, env=mps(3))
    # reduced soak through the host verbs: random delays and a straggler on 4 PEs (the CPU suite runs 2000 chunks
    # per epoch; host verbs cost tens of us each, so 1000 here)
    kj = TMP / "soak.json"
    run_step(state, "soak (soak-ci.yaml, 1000 chunks x 2 epochs)", stress_cmd(
        4, kj, "--config", str(CONFIGS / "soak-ci.yaml"), "--set", "stress.chunks_per_rank=1000"), 120, pes=4,
        judge=judge_stress, json_path=kj, env=mps(4))
    for cfg in sorted(CONFIGS.glob("stress-*.yaml")):
        import yaml

        tree = yaml.safe_load(cfg.read_text()) or {}
        n = int(tree.get("ranks", 4))
        if n not in (2, 3, 4):
            n = 4
        extra = ["--config", str(cfg)]
        chunks = (tree.get("stress") or {}).get("chunks_per_rank", 16)
        if isinstance(chunks, int) and chunks > 300:
            # host verbs cost ~tens of us each: cap very long configs (stress-wrap: 5000 -> 300)
            extra += ["--set", "stress.chunks_per_rank=300"]
        cj = TMP / f"{cfg.stem}.json"
        run_step(state, f"stress {cfg.name}" + (" (chunks capped at 300)" if "--set" in extra else ""),
                 stress_cmd(n, cj, *extra), 90, pes=n, judge=judge_stress, json_path=cj, env=mps(n))


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for ln in out.splitlines() if ln.startswith("GPU "))


#: the progress policies the expert-parallel layer offers (every one runs in every phase)
EP_POLICIES = tuple(p for p in PROGRESS_POLICIES if p not in REFUSED_POLICIES)

FAST = ["--set", "layer.weight_dtype=fp8", "--set", "layer.router=deepseek_v3", "--set", "layer.num_experts=16",
        "--set", "layer.n_group=4", "--set", "layer.topk_group=2", "--set", "layer.topk=4", "--set", "layer.hidden=512",
        "--set", "layer.intermediate=256", "--set", "layer.routed_scaling_factor=2.5", "--set", "run.block_m=16",
        "--set", "run.tokens_per_rank=300", "--set", "ring.num_slots=2", "--set", "ring.tokens_per_slot=64",
        "--set", "run.epochs=3"]


def phase_gpus(state: dict) -> None:
    """One PE per GPU (no MPS) on a machine with several GPUs: the device ring, the expert-parallel
    GPU layer (every progress policy, both transports, uneven and empty ranks, a straggler, the
    protocol mutations) and the host-verb backend across GPUs."""
    n = gpu_count()
    if n < 2:
        state["steps"].append({"name": "one PE per GPU", "pes": n, "expect": "pass", "verdict": "SKIP",
                               "note": f"{n} GPU(s): the one-PE-per-GPU phase needs 2 or more"})
        save_state(state)
        return
    TMP.mkdir(parents=True, exist_ok=True)
    gj = TMP / f"graph-{n}gpu.json"
    run_step(state, f"gpu-check x{REPLAYS} replays, all policies + negative controls (one PE per GPU)", mpiexec(
        n, "-m", "streamring", "gpu-check", "--policies", "all", "--replays", REPLAYS, "--controls",
        "--json", str(gj)), 150, pes=n, judge=judge_graph, json_path=gj)
    # the ring's own progress under every policy runs in the gpu-check step above
    for policy in EP_POLICIES:
        rj = TMP / f"fast-{policy}.json"
        run_step(state, f"EP layer run: policy {policy}", run_cmd(
            n, rj, *FAST, "--set", f"nvshmem.progress={policy}"), 150, pes=n, judge=judge_run, json_path=rj)
    for name, extra in (("transport nv (NVSHMEM RMA between GPUs)", ["--set", "nvshmem.transport=nv"]),
                        ("uneven tokens, an empty rank", ["--set", "run.tokens_per_rank=[0, 301]"
                                                          if n == 2 else f"run.tokens_per_rank={[0] + [301] * (n - 1)}"]),
                        ("straggler 5 ms on rank 1", ["--set", "run.straggler={rank: 1, ms: 5}"]),
                        ("ready source order + straggler 5 ms on rank 1",
                         ["--set", "run.source_order=ready", "--set", "run.straggler={rank: 1, ms: 5}"]),
                        ("ready source order, transport nv", ["--set", "run.source_order=ready", "--set",
                                                              "nvshmem.transport=nv"]),
                        ("reservation-size blocks of 64, 8 chunks", ["--set", "run.block_m=64", "--set",
                                                                     "ring.tokens_per_slot=40"])):
        rj = TMP / f"fast-{len(state['steps'])}.json"
        run_step(state, f"EP layer run: {name}", run_cmd(n, rj, *FAST, *extra), 150, pes=n, judge=judge_run,
                 json_path=rj)
    for mode in ("skip-acquire", "signal-before-payload", "ignore-epoch", "skip-ack-wait"):
        ij = TMP / f"fast-inject-{mode}.json"
        extra = ["--set", f"run.inject={mode}", "--set", "run.straggler={rank: 1, ms: 3}", "--set", "wait_timeout_s=3"]
        if mode == "skip-ack-wait":
            extra += ["--set", "ring.num_slots=1", "--set", "ring.tokens_per_slot=16"]
        run_step(state, f"EP layer run --inject {mode} (must fail)", run_cmd(n, ij, *FAST, *extra), 120, pes=n,
                 expect="fail", json_path=ij)
    rj = TMP / "hostverbs.json"
    run_step(state, "host-verb layer run (torch ops, reference path)", run_cmd(
        n, rj, "--set", "run.gpu_path=host_verbs", "--set", "run.tokens_per_rank=120"), 150, pes=n,
        judge=judge_run, json_path=rj)
    sj = TMP / f"stress-{n}gpu.json"
    run_step(state, "stress default (host verbs)", stress_cmd(n, sj, "--set", "stress.chunks_per_rank=16"), 90, pes=n,
             judge=judge_stress, json_path=sj)
    for mode, cfg, chunks in STRESS_INJECT_CASES:
        ij = TMP / f"inject-{mode}-{n}gpu.json"
        run_step(state, f"stress --inject {mode} ({cfg})", stress_cmd(
            n, ij, "--config", str(CONFIGS / cfg), "--inject", mode, "--set", "wait_timeout_s=5",
            "--set", f"stress.chunks_per_rank={chunks}", "--set", f"ranks={n}"), 60, pes=n, expect="fail",
            json_path=ij)
    tj = TMP / f"torchrun-{n}gpu.json"
    run_step(state, "torchrun bootstrap: stress", ["torchrun", "--nproc-per-node", str(n), "-m", "streamring", "stress",
                                                   "--backend", "nvshmem", "--set", "stress.chunks_per_rank=8",
                                                   "--json", str(tj)], 90, pes=n, judge=judge_stress, json_path=tj)
    bj = OUT / f"signal-latency-{n}gpu.json"
    run_step(state, "bench_signal_latency", mpiexec(n, "-m", "bench.signal_latency", "--json", str(bj)), 120,
             pes=n, json_path=bj)


# ------------------------------------------------------------------------------------------------------
# Phases faults1 / faults / mutate (about 6 minutes together, with launch/sanitize.sh in phase sanitize:
# run them in a call of their own, `GPU_CHECK_PHASES="faults mutate sanitize" bash launch/gpu_check.sh`)
# ------------------------------------------------------------------------------------------------------
#: wait_timeout_s of the rank-failure runs: the survivor must say what it waited for within about this long
FAULT_TIMEOUT_S = 3.0
#: what a survivor may take beyond its device deadline to notice and say so (host poll, Python, output)
FAULT_SLACK_S = 3.0
#: MiB of GPU memory a finished job may leave above what was used before it (the driver's and MPS's own)
LEFTOVER_MIB = 512


def gpu_memory_used() -> list[int]:
    """MiB used on each GPU (nvidia-smi); [] when it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return [int(v) for v in out.split()]
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return []


def gpu_compute_apps() -> list[str]:
    """The GPU's compute processes other than the MPS server (``pid, name, MiB`` each)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ["(nvidia-smi failed)"]
    return [ln.strip() for ln in out.splitlines() if ln.strip() and "nvidia-cuda-mps-server" not in ln]


def processes_matching(marker: str) -> list[str]:
    """Processes whose command line holds ``marker`` (this one excluded)."""
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.split(" ", 1)[0] != str(os.getpid())]


PROBES = {"memory": gpu_memory_used, "apps": gpu_compute_apps, "processes": processes_matching, "sleep": time.sleep}


def survivor_report(out: str, wait_timeout_s: float = FAULT_TIMEOUT_S) -> tuple[bool, str]:
    """(a): the surviving rank 0 printed the line naming rank 1, the chunk and the generation it waited
    for, and noticed within ``wait_timeout_s`` + FAULT_SLACK_S of its forward's launch."""
    lines = [ln for ln in out.splitlines() if "rank 0: watchdog: the device waited" in ln]
    if not lines:
        return False, "no 'rank 0: watchdog: the device waited ...' line"
    line = lines[0][lines[0].index("rank 0: watchdog"):]
    named = re.search(r"generation (e\d+:c\d+) \(0x[0-9a-f]+\) of source rank 1 \(chunk (\d+)", line)
    acks = re.search(r"acknowledgements of my chunk (\d+).* from ranks \[1\]", line)
    noticed = re.search(r"noticed ([0-9.]+)s after the forward's launch", line)
    took = float(noticed.group(1)) if noticed else float("inf")
    in_time = took <= wait_timeout_s + FAULT_SLACK_S
    what = (f"waited for rank 1 chunk {named.group(2)} generation {named.group(1)}" if named else
            f"waited for rank 1's acknowledgement of chunk {acks.group(1)}" if acks else f"unclear: {line[:160]}")
    return bool((named or acks) and in_time), f"{what}, noticed after {took:.2f}s (deadline {wait_timeout_s:g}s)"


def launcher_names(launcher: str, out: str) -> tuple[bool, str]:
    """(c): the launcher names the failed rank: the survivor that aborted, or the killed or stopped one."""
    if launcher == "mpirun":
        m = re.search(r"MPI_ABORT was invoked on rank (\d+)", out) or \
            re.search(r"process rank (\d+) with PID \d+ .*(?:exited on signal|signal)", out)
        return bool(m), (f"mpirun names rank {m.group(1)}" if m else "mpirun named no rank")
    if launcher == "local":
        m = re.search(r"streamring launcher: rank (\d+) \(pid \d+\) (was the first rank to stop running|stopped with: "
                      r"\w+|died or hung without reporting)", out)
        return bool(m), (f"the local launcher: rank {m.group(1)} {m.group(2)}" if m else
                         "the local launcher named no rank")
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", out, flags=re.S)
    return bool(m), (f"torchrun's root cause: rank {m.group(1)}, exitcode {m.group(2)}" if m else
                     "torchrun printed no root cause")


def cleanup_after(marker: str, baseline_mib: list[int], probes: dict = PROBES, patience_s: float = 30.0
                  ) -> tuple[bool, str]:
    """No process of the job left, no compute process on the GPU, its memory back to the baseline."""
    waited = 0.0
    while True:
        left, apps, mem = probes["processes"](marker), probes["apps"](), probes["memory"]()
        back = bool(mem) and len(mem) == len(baseline_mib) and all(
            m <= b + LEFTOVER_MIB for m, b in zip(mem, baseline_mib))
        if (not left and not apps and back) or waited >= patience_s:
            break
        probes["sleep"](1.0)
        waited += 1.0
    ok = not left and not apps and back
    note = (f"{len(left)} processes left" + (f" ({left[0][:80]})" if left else "") +
            f", GPU compute apps {apps or 'none'}, memory used {mem} MiB (before {baseline_mib}) after {waited:.0f}s")
    return ok, note


def fault_judge(launcher: str, marker: str, probes: dict = PROBES, mpirun_recovery: bool = False):
    """The judge of one rank-failure step: (a) the survivor's line in time, (b) a non-zero exit with the
    survivor's own error, (c) the launcher naming a failed rank, then the clean-up.

    ``mpirun_recovery``: Open MPI's mpirun ran with orte_enable_recovery=1 (without it, it ends every rank
    the moment one is killed, before the survivor can say anything). It then exits 0 even after an
    MPI_Abort (launch/faults.sh measures it), so (b) takes mpirun's own line that rank 0 aborted with
    a non-zero error code instead of mpirun's exit code."""
    baseline = probes["memory"]()

    def judge(rc, out, data):
        a_ok, a = survivor_report(out)
        own_error = "[streamring rank 0] error: WatchdogError:" in out
        aborted = re.search(r"MPI_ABORT was invoked on rank 0 in communicator \w+\s+with errorcode ([1-9]\d*)", out)
        b_ok = own_error and (rc != 0 or bool(launcher == "mpirun" and mpirun_recovery and aborted))
        b = f"rc={rc}" + (f" (mpirun under orte_enable_recovery exits 0 after any abort; rank 0 aborted with errorcode "
                          f"{aborted.group(1)})" if rc == 0 and aborted and mpirun_recovery else "")
        c_ok, c = launcher_names(launcher, out)
        d_ok, d = cleanup_after(marker, baseline, probes)
        verdict = lambda ok: "ok" if ok else "FAILED"  # noqa: E731
        return a_ok and b_ok and c_ok and d_ok, (f"(a) {verdict(a_ok)}: {a}; (b) {verdict(b_ok)}: {b}; "
                                                 f"(c) {verdict(c_ok)}: {c}; clean-up {verdict(d_ok)}: {d}")

    return judge


def fault_cmd(launcher: str, kind: str, json_path: Path) -> list[str]:
    """``streamring run`` of the EP layer on 2 PEs in which rank 1 is killed or stopped mid-forward."""
    args = ["run", "--backend", "nvshmem", "--set", "ranks=2", "--json", str(json_path), *FAST,
            "--set", f"wait_timeout_s={FAULT_TIMEOUT_S:g}", "--set", f"run.fault={{rank: 1, epoch: 1, kind: {kind}}}"]
    if launcher == "mpirun":
        return mpiexec(2, "-m", "streamring", *args)
    if launcher == "torchrun":
        return ["torchrun", "--nproc-per-node", "2", "-m", "streamring", *args]
    return [PY, "-m", "streamring", *args]  # the local launcher starts the ranks through mpiexec itself


def mps_accepts_a_client() -> tuple[bool, str]:
    """Whether a new CUDA client can make a context now (a tensor on the GPU), and the error if not."""
    try:
        r = subprocess.run([PY, "-c", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"],
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "a new client did not make its context within 120 s"
    lines = [ln for ln in (r.stderr or "").splitlines() if "Error" in ln]
    return r.returncode == 0, (lines[-1] if lines else f"rc={r.returncode}")[:200]


def mps_fresh_for(name: str, state: dict) -> None:
    """Before a rank-failure step under MPS: a killed or stopped client of the step before can leave the
    MPS server refusing new clients ("CUDA-capable device(s) is/are busy or unavailable" at the next
    step's set_device, seen 2026-12-01). Probe; if refused, say so and restart the daemon (the step's
    own verdict then says nothing about the step before)."""
    if not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return
    ok, why = mps_accepts_a_client()
    if ok:
        return
    note = f"before '{name}': the MPS server refused a new client ({why}); the MPS daemon was restarted"
    try:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, capture_output=True, timeout=30)
        time.sleep(1.0)  # the control daemon removes its pipe on the way out
        started = subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, text=True, timeout=30)
        ok, why = mps_accepts_a_client() if started.returncode == 0 else (False, f"-d rc={started.returncode}")
    except subprocess.TimeoutExpired as exc:
        ok, why = False, f"{' '.join(exc.cmd)} ran past {exc.timeout:g} s"
    note += "" if ok else f", and it still refuses ({why})"
    log(f"\n[gpu_check] {note}\n")
    state.setdefault("notes", []).append(note)
    save_state(state)


def phase_faults1(state: dict) -> None:
    """One PE, no MPS: the device hostile-peer table, the layer's refusal after it, the EP handoff rules."""
    run_step(state, "pytest test_gpu_hostile, test_gpu_ep_rules (1 PE)",
             [PY, "-m", "pytest", "-q", "-rs", "tests/gpu/test_gpu_hostile.py", "tests/gpu/test_gpu_ep_rules.py",
              "-p", "no:cacheprovider"], 300, pes=1, judge=judge_pytest)


def phase_faults(state: dict) -> None:
    """Two PEs (one per GPU, or both on one GPU under MPS, started by the caller): the hostile-peer table
    with a peer that is another PE, and a rank killed or stopped mid-forward under mpirun, the local
    launcher and torchrun."""
    TMP.mkdir(parents=True, exist_ok=True)
    share = {} if gpu_count() >= 2 else {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    run_step(state, "device hostile-peer table, PE 1 hostile",
             mpiexec(2, "tests/helpers/mp_gpu_hostile.py", "hostile_table"), 120, pes=2, env=share, judge=lambda rc, out, data: (
                 rc == 0 and "SCENARIO OK hostile_table" in out,
                 next((ln for ln in out.splitlines() if "refused or accepted" in ln or "SCENARIO FAILED" in ln),
                      f"rc={rc}")))
    # stopped ranks first: a SIGKILLed MPS client is the harder clean-up for the GPU
    for launcher, kind in (("mpirun", "hang"), ("mpirun", "kill"), ("local", "hang"), ("local", "kill"),
                           ("torchrun", "hang"), ("torchrun", "kill")):
        jp = TMP / f"fault-{launcher}-{kind}.json"
        env = dict(share)
        if kind == "kill" and launcher in ("mpirun", "local"):
            # Open MPI's mpirun otherwise ends every rank the moment one is killed, before the survivor's
            # device deadline: it then names the killed rank itself, and the survivor says nothing
            env["OMPI_MCA_orte_enable_recovery"] = "1"
        what = "SIGKILL" if kind == "kill" else "SIGSTOP"
        name = f"rank 1 {what} mid-forward under {launcher}: rank 0 names it, exits, nothing left"
        mps_fresh_for(name, state)
        judge = fault_judge(launcher, str(jp), mpirun_recovery="OMPI_MCA_orte_enable_recovery" in env)
        run_step(state, name, fault_cmd(launcher, kind, jp), 120 if launcher == "torchrun" else 90, pes=2, env=env,
                 judge=judge)


def phase_mutate(state: dict) -> None:
    """tests/mutate.py --gpu: each GPU mutation planted in a copy (cubin rebuilt there) must be caught. The
    unmutated baseline of the same tests is phase faults1's pytest step."""
    def judge(rc, out, data):
        total = re.search(r"(\d+) of (\d+) mutations caught", out)
        rows = [ln for ln in out.splitlines() if re.search(r"\b(caught|MISSED|ERROR)\b", ln) and "│" in ln]
        note = (total.group(0) if total else f"rc={rc}, no summary") + (
            ("; " + " | ".join(" ".join(r.replace("│", " ").split())[:90] for r in rows)) if rows else "")
        return rc == 0 and bool(total), note
    run_step(state, "GPU mutations (tests/mutate.py --gpu --no-baseline)",
             [PY, "tests/mutate.py", "--gpu", "--no-baseline", "--timeout", "240"],
             420, pes=1, judge=judge)


def phase_sanitize(state: dict) -> None:
    """launch/sanitize.sh: compute-sanitizer over the ring self-test, one EP forward and the hostile table."""
    def judge(rc, out, data):
        summary = [ln.strip() for ln in out.splitlines() if ln.startswith("sanitize:")]
        return rc == 0, " | ".join(summary)[-600:] or f"rc={rc}"
    # what is left of the check's budget, or less when SANITIZE_BUDGET_S says so (a phase after this one)
    left = min(BUDGET_S - elapsed() - 15, float(os.environ.get("SANITIZE_BUDGET_S", "1e9")) + 15)
    run_step(state, "compute-sanitizer (launch/sanitize.sh)", ["bash", "launch/sanitize.sh"], max(left, 30), pes=1,
             env={"SANITIZE_BUDGET_S": str(int(max(left - 10, 20)))}, judge=judge)


def budget_skipped(steps: list[dict]) -> list[dict]:
    """The steps this check's time budget skipped (:func:`run_step`)."""
    return [s for s in steps if s.get("verdict") == "SKIP" and "time budget" in s.get("note", "")]


def resume_command(steps: list[dict]) -> str | None:
    """The command that runs, in a new call, exactly the steps this check's budget skipped (``GPU_CHECK_ONLY``
    matches ``"<name> pes=<PEs>"``); None when the budget skipped none."""
    import shlex

    skipped = budget_skipped(steps)
    if not skipped:
        return None
    rx = "^(" + "|".join(re.escape(f"{s['name']} pes={s['pes']}") for s in skipped) + ")$"
    return f"GPU_CHECK_ONLY={shlex.quote(rx)} bash launch/gpu_check.sh"


def report(state: dict) -> int:
    lines = ["", "GPU check summary (elapsed %.0fs)" % elapsed(),
             f"{'step':<66} {'PEs':>3} {'expect':<6} {'verdict':<7} {'wall s':>7}  note", "-" * 140]
    for s in state["steps"]:
        lines.append(f"{s['name'][:66]:<66} {s['pes']:>3} {s['expect']:<6} {s['verdict']:<7} "
                     f"{s.get('wall_s', 0):>7.1f}  {s.get('note', '')[:120]}")
    # graph rows and bench, in short
    for s in state["steps"]:
        if s["name"].startswith("gpu-check") and isinstance(s.get("json"), list):
            for r in s["json"]:
                lines.append(f"   graph PEs={r.get('pes')} {r.get('policy'):<12} inject={r.get('inject'):<22} "
                             f"{r.get('verdict'):<5} mode={str(r.get('mode'))[:40]:<40} replays={r.get('replays')} "
                             f"us/replay={r.get('us_per_replay', 0):.1f} viol={r.get('violations')} "
                             f"tmo={r.get('timeouts')}")
        if s["name"] == "bench_signal_latency" and isinstance(s.get("json"), dict):
            raw = s["json"]["raw"]
            lines.append(f"   bench raw put_signal->signal_wait p50 {raw['p50_us']:.2f} us")
            for r in s["json"]["policies"]:
                if "error" in r:
                    lines.append(f"   bench {r['policy']:<12} n/a: {r['error'][:80]}")
                else:
                    lines.append(f"   bench {r['policy']:<12} pub->acq p50 {r['pub_acq_p50_us']:.2f} us "
                                 f"({r['pub_acq_p50_us'] / raw['p50_us']:.3f}x raw), per chunk "
                                 f"{r['per_chunk_us']:.2f} us ({r['per_chunk_us'] / raw['p50_us']:.3f}x raw)")
    lines += [f"note: {n}" for n in state.get("notes", [])]
    fails = [s for s in state["steps"] if s["verdict"] != "PASS"]
    resume = resume_command(state["steps"])
    if resume:
        lines.append(f"the budget skipped {len(budget_skipped(state['steps']))} steps; "
                     f"to run just those (a new call): {resume}")
    lines.append(f"RESULT: {'PASS' if not fails else 'FAIL'}: {len(state['steps']) - len(fails)} of "
                 f"{len(state['steps'])} steps met their expectation")
    log("\n".join(lines) + "\n")
    return 0 if not fails else 1


_MPS_CLIENT = r"""
import os, sys, time
try:
    import torch
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    print(f"ok pid {os.getpid()}", flush=True)
    time.sleep(2)
except Exception as exc:
    print(f"FAIL pid {os.getpid()}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
    sys.exit(1)
"""


def mps_contexts(n: int) -> int:
    """Can ``n`` processes create a CUDA context each on this GPU under the running MPS daemon? (The
    multi-PE phase's first step, ``--mps-contexts N``.) Starts them at once, each with
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / n and the phase's CUDA_DEVICE_MAX_CONNECTIONS, each holding
    its context until all have tried; one line per process, and on a failure what else holds the GPU
    (nvidia-smi's compute processes: leftovers of an earlier step) and the connections each asked for.
    Exit 0 iff all ``n`` succeed."""
    env = dict(os.environ, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(100 // n))
    procs = [subprocess.Popen([PY, "-c", _MPS_CLIENT], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(n)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    ok = sum(p.returncode == 0 for p in procs)
    conns = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)")
    print(f"mps contexts: {ok} of {n} processes made a context (CUDA_DEVICE_MAX_CONNECTIONS={conns}, "
          f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 // n})")
    for o in outs:
        print("  " + o.splitlines()[-1] if o else "  (no output)")
    if ok < n:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        print("  other compute processes on the GPU now: " + (apps.replace("\n", "; ") or "none"))
        print("  (leftovers would show above; with none, the clients' connection count is the suspect: run the "
              "step again with another CUDA_DEVICE_MAX_CONNECTIONS)")
    return 0 if ok == n else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["single", "multi", "gpus", "report", "mps-failed", "faults1",
                                        "faults", "mutate", "sanitize"])
    ap.add_argument("--mps-contexts", type=int, metavar="N", help="only: N processes each make a CUDA context")
    args = ap.parse_args()
    if args.mps_contexts:
        return mps_contexts(args.mps_contexts)
    if not args.phase:
        ap.error("--phase or --mps-contexts is required")
    OUT.mkdir(parents=True, exist_ok=True)
    state = load_state()
    if args.phase == "single":
        phase_single(state)
    elif args.phase == "multi":
        phase_multi(state)
    elif args.phase == "gpus":
        phase_gpus(state)
    elif args.phase in ("faults1", "faults", "mutate", "sanitize"):
        {"faults1": phase_faults1, "faults": phase_faults, "mutate": phase_mutate,
         "sanitize": phase_sanitize}[args.phase](state)
    elif args.phase == "mps-failed":
        state["steps"].append({"name": "start the MPS daemon (multi-PE steps)", "pes": 0, "expect": "pass",
                               "verdict": "FAIL", "note": "nvidia-cuda-mps-control -d failed: no multi-PE step ran"})
        save_state(state)
    else:
        return report(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
