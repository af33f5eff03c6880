"""``gemm="auto"`` from whole-layer measurements, where a run measured several backends' layers side by side.

The GEMM table (:mod:`streamring.gemm.choice`) times each backend's expert GEMMs alone. A layer adds what each
backend's path costs around its GEMMs (the result rows' copy to their owners, one call per GEMM, the staging of
the L1 output), and where the GEMMs are short (decode sizes) that decides: the backend with the faster GEMMs can
run the slower layer (docs/performance.md, "Decode"). A row of :data:`TABLE_PATH` (``python -m
bench.make_layer_table``) holds the batch path's median of every backend that ONE device run measured for one
setting (PEs, experts per PE, the expert shape, block size, tokens per PE), and where that run also measured a
backend's default streamed plan on time, its median (``streamed_ms``); medians of different runs are never
compared, so a row decides only between backends measured under the same conditions.

:func:`choose` answers for a buffer: the row of the buffer's setting whose tokens per PE is nearest its maximum
(within :data:`NEAREST_FACTOR`), and of the available backends that row measured, the one whose faster path is
fastest: each backend's batch median, or its streamed median where that is lower (the path ``streaming="auto"``
takes where the tuned table measured the win; at decode sizes a backend's streamed plan can beat another's batch
path while its own batch path is the slower one, docs/performance.md, "Decode"). A buffer driven only with
``streaming=False`` may then run a batch path up to that difference slower than the other backend's: its
``gemm_choice.source`` prints every time compared. ``None`` (the GEMM table decides) where no row applies or the
row measured fewer than two available backends.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

TABLE_PATH = Path(__file__).with_name("layer_table.json")
#: a row serves buffers whose maximum tokens per PE is within this factor of its own
NEAREST_FACTOR = 2.0
#: the setting a row is measured for, in the order of its key
SETTING = ("ranks", "experts_per_pe", "hidden", "intermediate", "topk", "block_m")


@dataclass(frozen=True)
class LayerRowChoice:
    """The backend a measured layer row picks, and why (``source``: the row and every time it compared)."""

    impl: str
    source: str


def load_table(path: str | Path | None = None) -> list[dict]:
    """The rows (an empty list where the file is missing). A row: the :data:`SETTING` fields, ``tokens_per_rank``,
    ``batch_ms`` (backend -> median ms), ``run`` (where it was measured) and, optionally, ``streamed_ms``
    (backend -> the default streamed plan's on-time median in the same run)."""
    p = Path(TABLE_PATH if path is None else path)
    if not p.is_file():
        return []
    rows = json.loads(p.read_text()).get("rows", [])
    for i, r in enumerate(rows):
        missing = [k for k in (*SETTING, "tokens_per_rank", "batch_ms", "run") if k not in r]
        if missing:
            raise ValueError(f"layer table {p}: rows[{i}] has no {', '.join(repr(k) for k in missing)}")
    return rows


def choose(setting: Mapping, max_tokens_per_rank: int, available: Mapping[str, str],
           rows: Optional[list] = None) -> Optional[LayerRowChoice]:
    """The fastest available backend of the measured row nearest ``setting`` at ``max_tokens_per_rank`` (see the
    module doc); ``available``: backend -> "" where it can run here (:func:`streamring.gemm.choice.available_impls`).
    """
    rows = load_table() if rows is None else rows
    usable = {k for k, why in available.items() if not why}
    best, best_d = None, None
    for r in rows:
        if any(r[k] != setting[k] for k in SETTING) or len(usable & set(r["batch_ms"])) < 2:
            continue
        d = abs(math.log(r["tokens_per_rank"] / max(1, max_tokens_per_rank)))
        if d <= math.log(NEAREST_FACTOR) and (best_d is None or d < best_d):
            best, best_d = r, d
    if best is None:
        return None
    streamed = best.get("streamed_ms", {})
    times = {k: min(v, streamed.get(k, v)) for k, v in best["batch_ms"].items() if k in usable}
    impl = min(times, key=times.get)

    def said(k: str) -> str:
        b = best["batch_ms"][k]
        return f"{k} {b:.3f} ms" if times[k] == b else f"{k} {times[k]:.3f} ms streamed (batch {b:.3f})"

    compared = ", ".join(said(k) for k in sorted(times, key=times.get))
    return LayerRowChoice(impl, f"measured layer: {compared} at {best['tokens_per_rank']} tokens per PE, "
                                f"{best['ranks']} PE(s), block_m {best['block_m']} ({best['run']})")
