"""Adaptive choice between the batch path and a streamed plan, per token count.

The choice comes from a tuned table measured on the target GPU (``adaptive_table.json`` next
to this module, produced by ``python -m bench.make_adaptive_table`` from the layer benchmark; the
command is recorded in the table). A token count uses the row of the largest measured token
count not above it (the smallest row below every measured count). A row says ``batch`` where
no streamed configuration beat the batch path in the same interleaved run - so the adaptive
policy is never slower than batch at a measured size; between measured sizes it extrapolates.
Where the table has no row of a setting (GEMM implementation, PE count, experts per PE) the answer is
the batch path: it is the correctness fallback and what streaming must beat, and a measurement of
another setting, or another GPU's, says nothing of this one. The runtime holds no performance model;
the fitted one, and its comparison with this table, live in ``bench/`` (``python -m bench.cost_model``).

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
    #: what decided: ``measured`` (a row of the tuned table) or ``none`` (the table has no row for the setting:
    #: the batch path); ``EPBuffer.adaptive_streaming`` adds ``other schedule`` (the row's streamed plan is not
    #: the buffer's own: the batch path), the research model in ``bench/`` answers ``model``
    source: str = "measured"


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
           experts_per_pe: int | None = None, block_m: int | None = None,
           min_chunk_tokens: int = 16) -> AdaptiveChoice:
    """The batch path or a streamed plan for ``tokens`` tokens (per rank), from ``table`` (default: the
    repo's tuned table). ``gemm``, ``ranks`` and ``experts_per_pe`` keep the rows measured with that GEMM
    implementation, rank count and per-PE expert load (rows without ``experts_per_pe`` held 256 experts
    over their ranks); when none is left, the batch path (the correctness fallback: nothing was measured
    for that setting). ``block_m`` (the buffer's block size): where a row of that block size lies within 2x of
    ``tokens``, only the rows of that block size decide (at decode sizes the block size decides which path
    wins); otherwise the rows of the other block sizes, nearest in tokens, of one token count the nearest
    block size. A streamed row whose chunks would hold fewer than ``min_chunk_tokens`` tokens at this count
    gives the batch path."""
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    t = table if table is not None else load_table()
    rows = [r for r in t["rows"] if (gemm is None or r.get("gemm", gemm) == gemm)
            and (ranks is None or r.get("ranks", ranks) == ranks)
            and (experts_per_pe is None or r.get("experts_per_pe", 256 // r.get("ranks", 1)) == experts_per_pe)]
    own = [r for r in rows if block_m is not None and int(r["block_m"]) == block_m]
    if any(tokens / 2 <= r["tokens"] <= 2 * tokens for r in own):
        rows = own
    elif own:  # its own rows lie far from this count: they do not extrapolate, the other sizes' rows decide
        rows = [r for r in rows if int(r["block_m"]) != block_m] or own
    if not rows:
        return AdaptiveChoice(tokens, "batch", 0, tokens, source="none",
                              note=f"no measured row for gemm={gemm!r} on {ranks} ranks with {experts_per_pe} experts "
                                   f"per PE: the batch path")
    # among rows of one token count, the block size nearest the buffer's is taken (the last in this order)
    rows = sorted(rows, key=lambda r: (r["tokens"], -abs(int(r["block_m"]) - (block_m or 0))))
    row = [r for r in rows if r["tokens"] == rows[0]["tokens"]][-1]  # below every row: the smallest count's
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
