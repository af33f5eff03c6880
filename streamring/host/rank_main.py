"""What every rank runs for ``streamring run`` / ``stress``, and rank 0's report."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rich.text import Text

from ..config import Config, ConfigError
from ..device.memcheck import HeapSizeError
from ..ring.protocol import DIAGNOSTIC_HOOKS
from .bootstrap import abort_job, make_heap, watch_blocked_calls
from .jobstate import job_dir, peer_report, record_job_files, register_rank, report_status
from .launch import SPAWNED_ENV, Launcher, detect_launcher
from .prelaunch import agree_on_problems, job_problems
from .progress import Heartbeat
from .preload import PRELOADED_ENV
from ..verify.inject_verdict import run_verdict, stress_error_caught, stress_error_verdict, stress_verdict
from .report import Column, Report


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def _med_max(r: dict, name: str) -> str:
    return f"{_ms(r[name + '_median_s'])}/{_ms(r[name + '_max_s'])}"


STRESS_COLUMNS = [
    Column("rank"), Column("chunks published", "chunks_pub"), Column("tokens published", "tokens_pub"),
    Column("chunks consumed", "chunks_cons"), Column("tokens checked", "tokens_checked"), Column("MB read", "MB_read"),
    Column("wraps"), Column("violations"), Column("acquire wait med/max ms", "acq_wait_ms"),
    Column("reuse wait med/max ms", "reuse_wait_ms"), Column("publish->acquire med/max ms", "pub_to_acq_ms"),
    Column("chunks/s", "chunks_per_s"),
]


def report_stress(results: list[dict], cfg: Config, wall_s: float, json_path: str | None,
                  out: Report | None = None) -> int:
    """Print the stress table on rank 0, write JSON; return the exit code (0 iff no violation)."""
    out = out or Report()
    rows, total_viol = [], 0
    for r in results:
        total_viol += r["violations"]
        rows.append([str(r["rank"]), str(r["chunks_published"]), str(r["tokens_published"]),
                     str(r["chunks_consumed"]), str(r["tokens_checked"]), f"{r['bytes_read'] / 1e6:.2f}",
                     str(r["ring_wraps"]),
                     Text(str(r["violations"]), style="red" if r["violations"] else ""),
                     _med_max(r, "acquire_wait"), _med_max(r, "reuse_wait"), _med_max(r, "publish_to_acquire"),
                     f"{r['chunks_consumed'] / r['wall_s']:.0f}" if r["wall_s"] else "-"])
    title = (f"streamring stress: {len(results)} ranks, ring {cfg.ring.num_slots} slots x {cfg.ring.tokens_per_slot} "
             f"tokens, {cfg.stress.epochs} epochs, source order {cfg.stress.source_order}, inject "
             f"{cfg.stress.inject}")
    out.table(title, STRESS_COLUMNS, rows)
    for r in results:
        for text in r["first_violations"]:
            out.line(Text.assemble(("violation ", "red"), text))
    reads = sum(r["tokens_checked"] for r in results)
    reuses = sum(r["reuses_checked"] for r in results)
    compared = (f"{reads} token reads compared with the pattern of their (source, generation, token) after "
                f"acquire (and again after a hold), {reuses} slot overwrites checked against every consumer's "
                f"acknowledgement")
    if total_viol == 0:
        verdict = Text.assemble(("PASS", "green"), f": no violation: {compared} (wall {wall_s:.2f}s)")
    else:
        kinds: dict = {}
        for r in results:
            for k, n in r["violation_kinds"].items():
                kinds[k] = kinds.get(k, 0) + n
        ranks = [r["rank"] for r in results if r["violations"]]
        stopped = next((r["stopped_early"] for r in results if r["stopped_early"]), "")
        verdict = Text.assemble(("FAIL", "red"), f": {total_viol} violation{'s' if total_viol != 1 else ''} ("
                                f"{', '.join(f'{k}: {n}' for k, n in sorted(kinds.items()))}) seen by ranks "
                                f"{ranks}; {compared}"
                                + (f"; stopped in {stopped}, every rank ended that epoch early" if stopped else "")
                                + f" (wall {wall_s:.2f}s)")
    out.line(verdict)
    if cfg.stress.inject != "none":  # the last line says whether a FAIL above is the expected result
        kinds_all: dict = {}
        for r in results:
            for k, n in r["violation_kinds"].items():
                kinds_all[k] = kinds_all.get(k, 0) + n
        out.line(stress_verdict(cfg.stress.inject, total_viol, kinds_all))
    if json_path:
        Path(json_path).write_text(json.dumps({
            "command": "stress", "config": cfg.model_dump(), "ranks": results, "violations": total_viol,
            "wall_s": wall_s}, indent=2, default=str))
    return 0 if total_viol == 0 else 1


def _early_problems(command: str, cfg: Config, json_path: str | None) -> list[str]:
    """Under a launcher other than ours (mpirun, srun): the pre-launch check, agreed on by every rank."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_on_node = node.Get_size()
    node.Free()
    mine = job_problems(command, cfg, comm.Get_size(), json_path if comm.Get_rank() == 0 else None,
                        ranks_on_this_node=ranks_on_node)
    return agree_on_problems(comm, mine, cfg.wait_timeout_s)


def process_facts() -> dict:
    """How this rank's process started, for its row in the JSON: ``preloaded`` (a fork of the launcher's
    preload server, :mod:`streamring.host.preload`, or a fresh interpreter) and, where torch is loaded,
    ``torch_threads`` (its intra-op threads: a preloaded rank must run as many as a fresh one)."""
    torch = sys.modules.get("torch")
    return {"preloaded": os.environ.get(PRELOADED_ENV) == "1",
            "torch_threads": torch.get_num_threads() if torch is not None else None}


def rank_main(command: str, cfg: Config, json_path: str | None = None) -> int:
    """Run ``command`` on this rank; any exception takes the whole job down.

    Problems knowable before the heap exists (see :mod:`streamring.host.prelaunch`) are
    printed once, by rank 0, and every rank returns 2. The local launcher has checked
    them already, before starting the ranks.
    """
    try:
        code = _check_before_the_heap(command, cfg, json_path)
        if code is not None:
            return code
        heap, watching = _start_heap(cfg)
        codes = heap.allgather_int(_run_command(heap, command, cfg, json_path))
        report_status(heap.rank, "ok")
        heap.close()
        watching.stop()
        sys.stdout.flush()
        return max(codes)
    except BaseException as exc:  # noqa: BLE001 - any failure must end the whole job
        if isinstance(exc, SystemExit) and exc.code == 0:
            raise
        _report_failure(command, cfg, exc)
        abort_job(exc, 2 if isinstance(exc, (ConfigError, HeapSizeError)) else 1)
        return 1


def _check_before_the_heap(command: str, cfg: Config, json_path: str | None) -> int | None:
    """What a rank does before its heap exists: under our launcher, record its pid first (so a failure can name
    it); under another launcher (mpirun, srun), the pre-launch check agreed on by every rank, whose problems
    rank 0 prints: exit code 2 on every rank. None: go on."""
    if job_dir() is not None:
        from mpi4py import MPI

        register_rank(MPI.COMM_WORLD.Get_rank())
    if detect_launcher() is Launcher.MPI and not os.environ.get(SPAWNED_ENV):
        problems = _early_problems(command, cfg, json_path)
        if problems:
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_rank() == 0:
                for p in problems:
                    print(f"streamring: {p}", file=sys.stderr)
            return 2
    return None


def _start_heap(cfg: Config) -> tuple:
    """``(heap, watchdog)``: this rank's symmetric heap, with its pid and the job files each allocation maps
    recorded for the launcher, the peers' states among the diagnostics of a blocked call, and the watchdog of
    blocked calls started; returns after a barrier of every rank."""
    heap = make_heap(cfg)
    register_rank(heap.rank)
    if hasattr(heap, "after_alloc"):
        heap.after_alloc.append(lambda region, r=heap.rank: record_job_files(r))
    DIAGNOSTIC_HOOKS.append(lambda n=heap.num_ranks: peer_report(n))
    watching = watch_blocked_calls(heap, cfg.wait_timeout_s, DIAGNOSTIC_HOOKS)
    heap.barrier()
    return heap, watching


def _run_command(heap, command: str, cfg: Config, json_path: str | None) -> int:
    """Run ``stress`` or ``run`` on this rank, gather every rank's results and report them on rank 0 (its exit
    code; 0 on the other ranks). Rank 0 says what the job does at least every ``progress_s`` seconds (a long
    run is not silent)."""
    t0 = time.monotonic()
    heartbeat = Heartbeat(f"streamring {command}", cfg.progress_s if heap.rank == 0 else 0)
    if command == "stress":
        from ..verify.stress import result_dict, run_stress

        with heartbeat:
            res = result_dict(run_stress(heap, cfg, heartbeat)) | process_facts()
            heartbeat.what = "collecting every rank's results"
            results = heap.allgather_obj(res)
        wall = time.monotonic() - t0
        return report_stress(results, cfg, wall, json_path) if heap.rank == 0 else 0
    if command == "run":
        from ..runner import run_layer

        with heartbeat:
            res = run_layer(heap, cfg, heartbeat) | process_facts()
            heartbeat.what = "collecting every rank's results"
            results = heap.allgather_obj(res)
        wall = time.monotonic() - t0
        return report_run(results, cfg, wall, json_path) if heap.rank == 0 else 0
    raise ValueError(f"unknown command {command!r}")


def _report_failure(command: str, cfg: Config, exc: BaseException) -> None:
    """Say how this rank failed before the job is aborted: under our launcher in its status file (the launcher
    names the failed rank from it, and says a stress mutation's verdict last, from every rank's status);
    otherwise, for a stress run whose mutation this error shows caught, the verdict on stderr."""
    if job_dir() is not None:
        try:
            from mpi4py import MPI

            report_status(MPI.COMM_WORLD.Get_rank(), f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001
            pass
    elif command == "stress" and stress_error_caught(cfg.stress.inject, f"{type(exc).__name__}: {exc}"):
        print(stress_error_verdict(cfg.stress.inject, [f"{type(exc).__name__}: {exc}"]), file=sys.stderr,
              flush=True)


RUN_COLUMNS = [
    Column("rank"), Column("tokens"), Column("chunks"), Column("local experts hit", "local_experts_hit"),
    Column("stream vs batch", "stream_vs_batch"), Column("max |stream-batch|", "max_abs_diff"),
    Column("max err vs f64 ref", "max_err_f64"), Column("err/tol", "err_over_tol"),
    Column("batch s", "batch_s"), Column("stream s", "stream_s"),
]


def run_legend(ranks: int, experts: int, mode: str, epochs: int, fast: bool) -> str:
    """The one line under the ``run`` table that says what its columns count."""
    per = experts // ranks
    parts = [f"local experts hit = of the rank's own {per} experts (rank r holds {per}r..{per}r+{per - 1} of "
             f"{experts}), those that got a routed row"]
    if mode == "both":
        parts.append("stream vs batch = the streamed output against the batch output")
    parts.append(f"err = {'sampled tokens ' if fast else ''}against a float64 reference, err/tol > 1 fails")
    parts.append(f"times = wall seconds of the {epochs} epoch{'s' if epochs != 1 else ''} per path")
    return "legend: " + "; ".join(parts)


def report_run(results: list[dict], cfg: Config, wall_s: float, json_path: str | None,
               out: Report | None = None) -> int:
    """Rank 0's table and JSON; exit code 1 when an output is outside its tolerance.

    The verdict names what was compared: with ``run.mode=both`` the streamed output
    against the batch output (bitwise) and both against the float64 reference; with
    ``batch`` or ``stream`` only that path against the reference.
    """
    out = out or Report()
    L, mode = cfg.layer, cfg.run.mode
    both = mode == "both"
    rows = _run_rows(results, mode, L.num_experts // len(results))
    fast = results[0].get("path") == "fast"
    out.table(_run_title(results, cfg, fast), RUN_COLUMNS, rows)
    out.line(run_legend(len(results), L.num_experts, mode, cfg.run.epochs, fast))
    failed = {
        "differ": [r["rank"] for r in results if both and not r["bitwise_equal"]],
        "outside": [r["rank"] for r in results if not r["ref_ok"]],
        "ring_errors": {r["rank"]: r["ring_errors"] for r in results if r.get("ring_errors")},
        # streamed against batch is a test of the protocol only when both ran the same GEMMs
        "gemm_differ": {r["rank"]: (r["gemm_batch"], r["gemm_stream"]) for r in results
                        if r.get("gemm_batch", r.get("gemm")) != r.get("gemm_stream", r.get("gemm"))},
    }
    ok = not failed["differ"] and not failed["outside"] and not failed["gemm_differ"]
    out.line(_run_verdict(results, mode, fast, wall_s, **failed))
    if cfg.run.inject != "none":
        out.line(run_verdict(cfg.run.inject, ok and not failed["ring_errors"]))
    if json_path:
        Path(json_path).write_text(json.dumps({"command": "run", "config": cfg.model_dump(), "ranks": results,
                                               "ok": ok, "wall_s": wall_s}, indent=2, default=str))
    return 0 if ok else 1


def _run_rows(results: list[dict], mode: str, per: int) -> list[list]:
    """The ``run`` table's rows, one per rank (:data:`RUN_COLUMNS`; ``per``: each rank's local experts); '-' in
    the columns of a path that did not run."""
    both = mode == "both"
    rows = []
    for r in results:
        same = (Text("bitwise ==") if r["bitwise_equal"] else Text("differ", style="red")) if both else "-"
        rows.append([str(r["rank"]), str(r["tokens"]), str(r["chunks"]) if mode != "batch" else "-",
                     f"{r['experts_hit']}/{per}", same, f"{r['max_abs_stream_minus_batch']:.3g}" if both else "-",
                     f"{r['ref_max_abs_err']:.3g}",
                     Text(f"{r['ref_max_err_ratio']:.3f}") if r["ref_ok"] else
                     Text(f"{r['ref_max_err_ratio']:.3f} FAIL", style="red"),
                     f"{r['batch_wall_s']:.3f}" if mode != "stream" else "-",
                     f"{r['stream_wall_s']:.3f}" if mode != "batch" else "-"])
    return rows


def _run_title(results: list[dict], cfg: Config, fast: bool) -> str:
    """The ``run`` table's title: the layer, the ring and the run's settings; for the expert-parallel GPU layer
    (``fast``: runner.run_layer_gpu) its transport, policy and the GEMMs of each path; a straggler last."""
    L, mode = cfg.layer, cfg.run.mode
    title = (f"streamring run: {len(results)} ranks, {L.num_experts} experts top-{L.topk} ({L.router}, "
             f"{L.weight_dtype}), hidden {L.hidden}, ring {cfg.ring.num_slots}x{cfg.ring.tokens_per_slot}, "
             f"scheduler {cfg.run.scheduler}, {cfg.run.epochs} epochs, routing {cfg.run.routing}, mode {mode}")
    if fast:
        r0 = results[0]
        pairs = sorted({(r.get("gemm_batch", r["gemm"]), r.get("gemm_stream", r["gemm"])) for r in results})
        same = len(pairs) == 1 and pairs[0][0] == pairs[0][1]
        gemms = f"{pairs[0][0]} GEMMs on both paths" if same else f"GEMMs (batch, streamed) {pairs}"
        title = (f"streamring run (GPU layer EPBuffer: transport {r0['transport']}, policy {r0['policy']}, "
                 f"{gemms}): {len(results)} ranks, {L.num_experts} experts top-{L.topk} ({L.router}, "
                 f"fp8), hidden {L.hidden}, ring {cfg.ring.num_slots}x{cfg.ring.tokens_per_slot}, "
                 f"{cfg.run.epochs} epochs, mode {mode}")
    if cfg.run.straggler is not None:
        title += f", straggler: rank {cfg.run.straggler.rank}'s producers {cfg.run.straggler.ms:g} ms late"
    return title


def _run_verdict(results: list[dict], mode: str, fast: bool, wall_s: float, *, differ: list, outside: list,
                 ring_errors: dict, gemm_differ: dict) -> Text:
    """PASS naming what was compared and within which bound, or FAIL naming each failure: the ranks whose
    streamed output differs from the batch output, those outside the float64 reference bound, the device ring
    errors, the ranks whose two paths ran different GEMMs (device ring errors alone do not fail the run)."""
    both = mode == "both"
    tol = (f"float64 reference bound (relative error < {results[0]['rtol']:.0%}: FP8 re-quantized intermediate)"
           if fast else f"float64 reference tolerance (rtol=atol={results[0]['rtol']:.2e})")
    paths = {"both": "the streamed and the batch outputs", "batch": "the batch output",
             "stream": "the streamed output"}[mode]
    not_run = {"both": "", "batch": "; the streamed path was not run (run.mode=batch)",
               "stream": "; the batch path was not run (run.mode=stream)"}[mode]
    if not differ and not outside and not gemm_differ:
        what = (f"streamed == batch bitwise on all {len(results)} ranks, and both within the {tol}" if both else
                f"{paths} within the {tol} on all {len(results)} ranks{not_run}")
        return Text.assemble(("PASS", "green"), f": {what}; wall {wall_s:.2f}s")
    parts = []
    if differ:
        parts.append(f"streamed != batch on ranks {differ}")
    if outside:
        parts.append(f"{paths} outside the {tol} on ranks {outside}")
    if ring_errors:
        parts.append(f"device ring errors {ring_errors}")
    if gemm_differ:
        parts.append(f"batch and streamed ran different GEMMs (batch, streamed) {gemm_differ}: their "
                     f"comparison measures the GEMMs' rounding, not the protocol")
    return Text.assemble(("FAIL", "red"), f": {'; '.join(parts)}{not_run}; wall {wall_s:.2f}s")


def gpu_check_main(launcher, **checks) -> int:
    """``streamring gpu-check`` on this rank: start NVSHMEM, run the self-test, report (rank 0)."""
    try:
        from ..device.nvshmem import NvshmemHeap
        from ..gpu_selftest import run_checks

        heap = NvshmemHeap.bootstrap(launcher=launcher.value)
        register_rank(heap.rank)
        DIAGNOSTIC_HOOKS.append(lambda n=heap.num_ranks: peer_report(n))
        code = run_checks(heap, echo=lambda text: print(text, flush=True), **checks)
        codes = heap.allgather_int(code)
        report_status(heap.rank, "ok")
        heap.close()
        sys.stdout.flush()
        return max(codes)
    except BaseException as exc:  # noqa: BLE001 - any failure must end the whole job
        if isinstance(exc, SystemExit) and exc.code == 0:
            raise
        abort_job(exc, 1)
        return 1
