"""Adaptive choice between the batch path and a streamed plan, per token count.

The choice comes from a tuned table measured on the target GPU (``adaptive_table.json`` next
to this module, produced by ``python -m bench.make_adaptive_table`` from the layer benchmark; the
command is recorded in the table). A token count uses the row of the largest measured token
count not above it (the smallest row below every measured count). A row says ``batch`` where
no streamed configuration beat the batch path in the same interleaved run - so the adaptive
policy is never slower than batch at a measured size; between measured sizes it extrapolates.

No GPU import here: an engine can read the plan anywhere.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DEFAULT_TABLE = Path(__file__).with_name("adaptive_table.json")
PATHS = ("batch", "streamed")


class AdaptiveTableError(ValueError):
    """The tuned table is missing or malformed (the message names the field)."""


@dataclass(frozen=True)
class AdaptiveChoice:
    """What to run for ``tokens`` tokens: ``path`` is 'batch' or 'streamed'; for 'streamed',
    ``chunk_tokens``, ``num_slots`` and ``policy`` (a ``streamring.moe.tuning.EP_POLICIES`` name)."""

    tokens: int
    path: str
    block_m: int
    chunk_tokens: int
    num_slots: int = 1
    policy: Optional[str] = None
    table_tokens: int = 0
    note: str = ""
    chunks: int = 1
    source_order: str = "rank"
    #: the ready order's grouping window the row was measured with; None: one source per step (rows
    #: measured before the grouped steps, and every other order)
    ready_window_us: Optional[float] = None
    #: what decided: ``measured`` (a row of the tuned table), ``none`` (the table has no row for the setting:
    #: the batch path) or ``model`` (:mod:`streamring.moe.cost_model`)
    source: str = "measured"


#: late-rank cases the model weighs beside the on-time one (ms of one PE's producer delay)
MODEL_LATE_MS = (1.0, 3.0)


def choose_by_model(tokens: int, *, ranks: int, experts_per_pe: int, gemm: str, block_m: int, chunks: int,
                    source_order: str, link_GBps: float, shape: tuple = (7168, 2048, 8),
                    margin: float = 0.01, ready_window_us: Optional[float] = None) -> AdaptiveChoice:
    """The batch path or the buffer's own streamed plan for ``tokens`` tokens per PE, from the cost model
    (:func:`streamring.moe.cost_model.predict`, one GPU per PE): each path's regret is its worst ratio over
    the faster path in the cases on time and with one PE ``MODEL_LATE_MS`` late, and the streamed plan is
    taken where its regret is below batch's by more than ``margin`` (the tuned table's rule). ``shape``:
    ``(hidden, intermediate, topk)`` of the layer; the model's rates are DeepSeek-V3's expert shapes, so any
    other shape gets the batch path. ``ready_window_us``: the buffer's grouping window (ready order; None: one
    source per step)."""
    from . import cost_model as CM

    if tuple(shape) != (CM.H, CM.I_DIM, CM.TOPK):
        return AdaptiveChoice(tokens, "batch", block_m, tokens, source="model",
                              note=f"no measured row, and the cost model covers (hidden, intermediate, topk) = "
                                   f"{(CM.H, CM.I_DIM, CM.TOPK)} only, not {tuple(shape)}: the batch path")
    if gemm not in CM.load_rates()["gemm"]:
        return AdaptiveChoice(tokens, "batch", block_m, tokens, source="model",
                              note=f"the cost model has no rates for gemm={gemm!r}: the batch path")
    base = dict(ranks=ranks, tokens=tokens, experts_per_pe=experts_per_pe, gemm=gemm, block_m=block_m,
                machine="gpu", link_GBps=link_GBps)
    times = {p: [] for p in ("batch", "streamed")}
    for late in (0.0,) + MODEL_LATE_MS:
        case = dict(base, straggler_ms=late, straggler_rank=ranks - 1 if late else None)
        times["batch"].append(CM.predict(dict(case, path="batch"))["total_ms"])
        times["streamed"].append(CM.predict(dict(case, path="streamed", chunks=chunks, source_order=source_order,
                                                 ready_window_us=ready_window_us))["total_ms"])
    best = [min(b, s) for b, s in zip(times["batch"], times["streamed"])]
    regret = {p: max(t / f for t, f in zip(ts, best)) for p, ts in times.items()}
    path = "streamed" if regret["streamed"] < regret["batch"] * (1.0 - margin) else "batch"
    return AdaptiveChoice(tokens, path, block_m, -(-tokens // chunks) if path == "streamed" else tokens,
                          num_slots=chunks, policy="spin_kernel" if path == "streamed" else None, chunks=chunks,
                          source_order=source_order, ready_window_us=ready_window_us, source="model",
                          note=f"cost model: regret streamed {regret['streamed']:.3f}, batch {regret['batch']:.3f} "
                               f"(on time and {', '.join(format(x, 'g') for x in MODEL_LATE_MS)} ms late)")


def load_table(path: str | Path = DEFAULT_TABLE) -> dict:
    """Read and validate a tuned table (see ``python -m bench.make_adaptive_table``)."""
    p = Path(path)
    if not p.is_file():
        raise AdaptiveTableError(f"adaptive table {p} not found (make it with `python -m bench.make_adaptive_table`)")
    try:
        t = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise AdaptiveTableError(f"adaptive table {p} is not JSON: {exc}") from exc
    rows = t.get("rows") if isinstance(t, dict) else None
    if not rows:
        raise AdaptiveTableError(f"adaptive table {p}: 'rows' is missing or empty")
    for i, r in enumerate(rows):
        for key in ("tokens", "path", "block_m"):
            if key not in r:
                raise AdaptiveTableError(f"adaptive table {p}: rows[{i}] has no '{key}'")
        if r["path"] not in PATHS:
            raise AdaptiveTableError(f"adaptive table {p}: rows[{i}].path is {r['path']!r}, allowed: {PATHS}")
        if r["path"] == "streamed":
            for key in ("chunks", "num_slots", "policy"):
                if key not in r:
                    raise AdaptiveTableError(f"adaptive table {p}: rows[{i}] (streamed) has no '{key}'")
            if int(r["chunks"]) < 1 or (int(r["chunks"]) == 1 and r.get("source_order", "rank") == "rank"):
                raise AdaptiveTableError(f"adaptive table {p}: rows[{i}].chunks must be >= 2 for a streamed row "
                                         f"(>= 1 with source_order 'ready' or 'arrival': a step per source), got "
                                         f"{r['chunks']} with source_order {r.get('source_order', 'rank')!r}")
    return t


def choose(tokens: int, table: dict | None = None, *, gemm: str | None = None, ranks: int | None = None,
           experts_per_pe: int | None = None, min_chunk_tokens: int = 16) -> AdaptiveChoice:
    """The batch path or a streamed plan for ``tokens`` tokens (per rank), from ``table`` (default: the
    repo's tuned table). ``gemm``, ``ranks`` and ``experts_per_pe`` keep the rows measured with that GEMM
    implementation, rank count and per-PE expert load (rows without ``experts_per_pe`` held 256 experts
    over their ranks); when none is left, the batch path (the correctness fallback: nothing was measured
    for that setting). A streamed row whose chunks would hold fewer than
    ``min_chunk_tokens`` tokens at this count gives the batch path."""
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    t = table if table is not None else load_table()
    rows = [r for r in t["rows"] if (gemm is None or r.get("gemm", gemm) == gemm)
            and (ranks is None or r.get("ranks", ranks) == ranks)
            and (experts_per_pe is None or r.get("experts_per_pe", 256 // r.get("ranks", 1)) == experts_per_pe)]
    if not rows:
        return AdaptiveChoice(tokens, "batch", 0, tokens, source="none",
                              note=f"no measured row for gemm={gemm!r} on {ranks} ranks with {experts_per_pe} experts "
                                   f"per PE: the batch path")
    rows = sorted(rows, key=lambda r: r["tokens"])
    row = rows[0]
    for r in rows:
        if r["tokens"] <= tokens:
            row = r
    if row["path"] == "batch":
        return AdaptiveChoice(tokens, "batch", int(row["block_m"]), tokens, table_tokens=int(row["tokens"]),
                              note=row.get("reason", ""))
    chunks = int(row["chunks"])
    chunk_tokens = math.ceil(tokens / chunks)
    if chunk_tokens < min_chunk_tokens:  # too small to stream: the batch path
        return AdaptiveChoice(tokens, "batch", int(row["block_m"]), tokens, table_tokens=int(row["tokens"]),
                              note=f"{chunks} chunks of {tokens} tokens would be under {min_chunk_tokens} tokens "
                                   f"each")
    return AdaptiveChoice(tokens, "streamed", int(row["block_m"]), chunk_tokens, num_slots=int(row["num_slots"]),
                          policy=row["policy"], table_tokens=int(row["tokens"]), chunks=chunks,
                          source_order=row.get("source_order", "rank"), ready_window_us=row.get("ready_window_us"))
