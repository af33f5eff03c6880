"""What every rank runs for ``streamring run`` / ``stress``, and rank 0's report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..config import Config, ConfigError
from ..protocol import DIAGNOSTIC_HOOKS
from .bootstrap import abort_job, make_heap, watch_blocked_calls
from .jobstate import peer_report, register_rank, report_status

console = Console(highlight=False, width=None if sys.stdout.isatty() else 180)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def report_stress(results: list[dict], cfg: Config, wall_s: float, json_path: str | None) -> int:
    """Print the stress table on rank 0, write JSON; return the exit code (0 iff no violation)."""
    t = Table(title=f"streamring stress: {len(results)} ranks, {cfg.ring.num_slots} slots x "
                    f"{cfg.ring.tokens_per_slot} tokens, {cfg.stress.epochs} epochs, inject={cfg.stress.inject}")
    for col in ("rank", "published", "consumed", "tokens checked", "MB read", "wraps", "violations",
                "acq wait med/max ms", "reuse wait med/max ms", "pub->acq med/max ms", "chunks/s"):
        t.add_column(col, justify="right")
    total_viol = 0
    for r in results:
        total_viol += r["violations"]
        t.add_row(str(r["rank"]), str(r["chunks_published"]), str(r["chunks_consumed"]), str(r["tokens_checked"]),
                  f"{r['bytes_read'] / 1e6:.2f}", str(r["ring_wraps"]), str(r["violations"]),
                  f"{_ms(r['acquire_wait_median_s'])}/{_ms(r['acquire_wait_max_s'])}",
                  f"{_ms(r['reuse_wait_median_s'])}/{_ms(r['reuse_wait_max_s'])}",
                  f"{_ms(r['publish_to_acquire_median_s'])}/{_ms(r['publish_to_acquire_max_s'])}",
                  f"{r['chunks_consumed'] / r['wall_s']:.0f}" if r["wall_s"] else "-")
    console.print(t)
    for r in results:
        for text in r["first_violations"]:
            console.print(f"[red]violation[/red] {text}")
    verdict = "PASS: no violation" if total_viol == 0 else f"FAIL: {total_viol} violations"
    console.print(f"{verdict} (wall {wall_s:.2f}s)")
    if json_path:
        Path(json_path).write_text(json.dumps({
            "command": "stress", "config": cfg.model_dump(), "ranks": results, "violations": total_viol,
            "wall_s": wall_s}, indent=2, default=str))
    return 0 if total_viol == 0 else 1


def rank_main(command: str, cfg: Config, json_path: str | None = None) -> int:
    """Run ``command`` on this rank; any exception takes the whole job down."""
    try:
        heap = make_heap(cfg)
        register_rank(heap.rank)
        DIAGNOSTIC_HOOKS.append(lambda n=heap.num_ranks: peer_report(n))
        watching = watch_blocked_calls(heap, cfg.wait_timeout_s, DIAGNOSTIC_HOOKS)
        heap.barrier()
        t0 = time.monotonic()
        if command == "stress":
            from ..stress import result_dict, run_stress

            res = result_dict(run_stress(heap, cfg))
            results = heap.allgather_obj(res)
            wall = time.monotonic() - t0
            code = report_stress(results, cfg, wall, json_path) if heap.rank == 0 else 0
        elif command == "run":
            from ..runner import run_layer

            res = run_layer(heap, cfg)
            results = heap.allgather_obj(res)
            wall = time.monotonic() - t0
            code = report_run(results, cfg, wall, json_path) if heap.rank == 0 else 0
        else:
            raise ValueError(f"unknown command {command!r}")
        codes = heap.allgather_int(code)
        report_status(heap.rank, "ok")
        heap.close()
        watching.set()
        sys.stdout.flush()
        return max(codes)
    except BaseException as exc:  # noqa: BLE001 - any failure must end the whole job
        if isinstance(exc, SystemExit) and exc.code == 0:
            raise
        try:
            from mpi4py import MPI

            report_status(MPI.COMM_WORLD.Get_rank(), f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001
            pass
        abort_job(exc, 2 if isinstance(exc, ConfigError) else 1)
        return 1


def report_run(results: list[dict], cfg: Config, wall_s: float, json_path: str | None) -> int:
    """Rank 0's table and JSON; exit code 1 when an output is outside its tolerance."""
    L = cfg.layer
    t = Table(title=f"streamring run: {len(results)} ranks, {L.num_experts} experts top-{L.topk} ({L.router}, "
                    f"{L.weight_dtype}), hidden {L.hidden}, ring {cfg.ring.num_slots}x{cfg.ring.tokens_per_slot}, "
                    f"scheduler {cfg.run.scheduler}, {cfg.run.epochs} epochs, routing {cfg.run.routing}")
    for col in ("rank", "tokens", "chunks", "experts hit", "stream==batch", "max |stream-batch|",
                "max err vs f64 ref", "err/tol", "batch s", "stream s"):
        t.add_column(col, justify="right")
    ok = True
    for r in results:
        ok &= r["ref_ok"] and (cfg.run.mode != "both" or r["bitwise_equal"])
        t.add_row(str(r["rank"]), str(r["tokens"]), str(r["chunks"]), str(r["experts_hit"]),
                  ("bitwise" if r["bitwise_equal"] else "[red]NO[/red]") if cfg.run.mode == "both" else "-",
                  f"{r['max_abs_stream_minus_batch']:.3g}", f"{r['ref_max_abs_err']:.3g}",
                  f"{r['ref_max_err_ratio']:.3f}" + ("" if r["ref_ok"] else " [red]FAIL[/red]"),
                  f"{r['batch_wall_s']:.3f}", f"{r['stream_wall_s']:.3f}")
    console.print(t)
    console.print(f"{'PASS' if ok else 'FAIL'}: streamed {'==' if ok else '!='} batch bitwise, both within the "
                  f"float64 reference tolerance (rtol=atol={results[0]['rtol']:.2e}); wall {wall_s:.2f}s")
    if json_path:
        Path(json_path).write_text(json.dumps({"command": "run", "config": cfg.model_dump(), "ranks": results,
                                               "ok": ok, "wall_s": wall_s}, indent=2, default=str))
    return 0 if ok else 1
