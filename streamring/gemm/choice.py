"""Which expert GEMM implementation (and which variant of it) runs a shape: the measured heuristic.

``python -m bench.gemm --table PATH`` times every implementation of the block consumer's expert GEMMs
on one H200 (CUTLASS variants, DeepGEMM, Triton) and writes, per (rows per expert, N, K), every time
and the fastest; the committed copy is :data:`TABLE_PATH`. :func:`choose_gemm` picks one GEMM's
implementation from it, :func:`choose_layer` one implementation for both GEMMs of a layer (the
expert-parallel layer's ``gemm="auto"`` resolves through it), :func:`setup_consumer` prepares a
:class:`~streamring.moe.blocks.BlockConsumer` for the choice.

Where the table has no measured entry for (N, K) near the asked rows per expert (within a factor of
:data:`NEAREST_FACTOR`), or the table is marked ``"measured": false``, the rule that held before the
table existed decides: CUTLASS with the 64-row ping-pong tile below 128 rows per expert (weight-read
bound), the 128x128 cooperative tile from 128 on (``docs/results/gemm-cutlass-triton-vs-torch-128-32768-2026-11-30.json``), bf16 L1
output; Triton where CUTLASS is not available. The choice says which of the two decided
(:attr:`GemmChoice.source`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping

from .backends import IMPLS

TABLE_PATH = Path(__file__).with_name("table.json")
#: a measured entry serves rows-per-expert values within this factor of its own
NEAREST_FACTOR = 2.0
#: below this many rows per expert the fallback rule takes the 64-row ping-pong tile
PINGPONG_BELOW_ROWS = 128
#: the group scheduler swizzles a key may name after the raster (``gemm.cutlass.SWIZZLES`` less the
#: default 1, which a key leaves out; not imported: that module loads torch)
KEY_SWIZZLES = (2, 4, 8)
#: CUTLASS tiles that take one block per tile (``gemm.cutlass.TILE_TABLE``'s ``block_tile`` tiles; not
#: imported: that module loads torch. tests/unit/test_gemm_choice.py holds the two equal), and the block
#: size they need: a consumer of other blocks never gets them from the table
BLOCK_TILES = ("pair128", "pair192", "pair128_n2", "block128", "block128_n2", "block64pp")
BLOCK_TILE_ROWS = 128


@dataclass(frozen=True)
class GemmChoice:
    """One GEMM's implementation: ``impl`` (:data:`IMPLS`), for CUTLASS its ``tile``
    (``gemm.cutlass.TILE_TABLE``), ``out`` (``"bf16"``/``"f32"``, the L1 output) and ``raster``
    (``"m"``/``"n"``) and ``swizzle`` (1, 2, 4, 8: the group scheduler's tile order); ``ms`` the
    measured median (None when the fallback rule chose); ``source`` what decided."""

    impl: str
    tile: str | None = None
    out: str | None = None
    raster: str = "m"
    swizzle: int = 1
    ms: float | None = None
    source: str = ""

    @property
    def key(self) -> str:
        return variant_key(self.impl, self.tile, self.out, self.raster, self.swizzle)


def variant_key(impl: str, tile: str | None = None, out: str | None = None, raster: str = "m",
                swizzle: int = 1) -> str:
    """The table's name of an implementation variant: ``cutlass:<tile>:<out>:<raster>`` (with
    ``:s<swizzle>`` appended when the swizzle is not 1), ``deep_gemm``, ``triton``."""
    if impl == "cutlass":
        if swizzle != 1 and swizzle not in KEY_SWIZZLES:
            raise ValueError(f"swizzle must be 1 or one of {KEY_SWIZZLES}, got {swizzle!r}")
        return f"cutlass:{tile}:{out or 'bf16'}:{raster}" + (f":s{swizzle}" if swizzle != 1 else "")
    return impl


def parse_key(key: str) -> GemmChoice:
    """:func:`variant_key` backwards (ValueError for a key that names no implementation)."""
    parts = key.split(":")
    swizzles = {f"s{s}": s for s in KEY_SWIZZLES}
    swizzle = 1 if len(parts) == 4 else swizzles.get(parts[4]) if len(parts) == 5 else None
    if (parts[0] == "cutlass" and swizzle is not None and parts[2] in ("bf16", "f32") and parts[3] in ("m", "n")):
        return GemmChoice("cutlass", tile=parts[1], out=parts[2], raster=parts[3], swizzle=swizzle)
    if key in ("deep_gemm", "triton"):
        return GemmChoice(key)
    raise ValueError(f"table key {key!r} names no implementation (cutlass:<tile>:<bf16|f32>:<m|n>[:s<2|4|8>], "
                     f"deep_gemm, triton)")


def fallback(rows_per_expert: float, available: Iterable[str], why: str = "") -> GemmChoice:
    """The rule before the table: CUTLASS ping-pong 64 below 128 rows per expert, else 128x128
    cooperative (bf16 L1 output); Triton without CUTLASS. DeepGEMM only when it is the one
    implementation asked for (unmeasured, it is not preferred to either)."""
    avail = set(available)
    note = f" ({why})" if why else ""
    if "cutlass" in avail:
        tile = "pingpong64" if rows_per_expert < PINGPONG_BELOW_ROWS else "coop128"
        return GemmChoice("cutlass", tile=tile, out="bf16", source=f"fallback rule: {tile} at "
                          f"{rows_per_expert:g} rows per expert{note}")
    if avail == {"deep_gemm"}:
        return GemmChoice("deep_gemm", source=f"asked for explicitly{note}")
    return GemmChoice("triton", source=f"fallback rule: Triton (CUTLASS not available){note}")


def load_table(path: str | Path | None = None) -> dict:
    """The table (``{"measured": bool, "entries": [...]}``); an empty unmeasured one if the file is missing."""
    p = Path(path) if path is not None else TABLE_PATH
    if not p.is_file():
        return {"measured": False, "entries": [], "note": f"{p} not found"}
    return json.loads(p.read_text())


def _nearest_entry(table: Mapping, rows_per_expert: float, n: int, k: int, block_m: int | None = None
                   ) -> dict | None:
    """The entry of (n, k) nearest in rows per expert (within :data:`NEAREST_FACTOR`); among those as near,
    one measured with the consumer's ``block_m`` (``run_block_m``) first."""
    if not table.get("measured"):
        return None
    best, rank = None, None
    for e in table.get("entries", []):
        if e.get("n") != n or e.get("k") != k or not e.get("times_ms"):
            continue
        rpe = float(e["rows_per_expert"])
        if rpe <= 0 or rows_per_expert <= 0:
            continue
        d = abs(math.log(rpe / rows_per_expert))
        r = (round(d, 9), block_m is None or e.get("run_block_m") != block_m)
        if d <= math.log(NEAREST_FACTOR) and (rank is None or r < rank):
            best, rank = e, r
    return best


def _measured_in(entry: Mapping, table: Mapping) -> str:
    """Where an entry's times come from: its run (``bench.make_gemm_table`` names it), else the table's date."""
    return entry.get("source") or table.get("date", "?")


def usable_at(choice: GemmChoice, block_m: int | None) -> bool:
    """Whether a consumer of ``block_m``-row blocks can run ``choice`` (None: the block size is not
    known, so only what runs at every block size)."""
    return choice.tile not in BLOCK_TILES or block_m == BLOCK_TILE_ROWS


def _available_times(entry: Mapping, available: set, block_m: int | None) -> dict:
    out = {}
    for key, ms in entry["times_ms"].items():
        try:
            c = parse_key(key)
        except ValueError:  # e.g. torch's time, kept in the table for reference
            continue
        if c.impl in available and ms is not None and usable_at(c, block_m):
            out[key] = float(ms)
    return out


def _fastest(entry: Mapping, times: Mapping, n: int, k: int, table: Mapping) -> GemmChoice:
    """The fastest of ``times`` (an entry's available variants) as a choice that says where it was measured."""
    key = min(times, key=times.get)
    return replace(parse_key(key), ms=times[key],
                   source=f"measured: {key} {times[key]:.3f} ms at {entry['rows_per_expert']:g} rows per expert "
                          f"(N={n} K={k}, {_measured_in(entry, table)})")


def choose_gemm(rows_per_expert: float, n: int, k: int, available: Iterable[str], table: Mapping | None = None,
                block_m: int | None = None) -> GemmChoice:
    """The fastest measured variant of the ``available`` implementations for one GEMM of ``n`` output
    columns and reduction ``k`` at ``rows_per_expert`` (tokens x top-k / experts) that a consumer of
    ``block_m``-row blocks can run (:func:`usable_at`); the fallback rule where nothing measured applies."""
    avail = set(available) & set(IMPLS)
    table = load_table() if table is None else table
    entry = _nearest_entry(table, rows_per_expert, n, k, block_m)
    if entry is None:
        return fallback(rows_per_expert, avail, f"no measured entry for N={n} K={k} near {rows_per_expert:g} rows "
                                                f"per expert")
    times = _available_times(entry, avail, block_m)
    if not times:
        return fallback(rows_per_expert, avail, f"no available implementation measured at N={n} K={k}")
    return _fastest(entry, times, n, k, table)


@dataclass(frozen=True)
class LayerChoice:
    """The implementation of both GEMMs of a layer (L1: N = 2I, K = H; L2: N = H, K = I)."""

    impl: str
    l1: GemmChoice
    l2: GemmChoice
    source: str
    skipped: dict = field(default_factory=dict)  # implementation -> why it was not a candidate


def choose_layer(rows_per_expert: float, hidden: int, intermediate: int, available: Mapping[str, str] | Iterable[str],
                 table: Mapping | None = None, block_m: int | None = None) -> LayerChoice:
    """One implementation for both GEMMs: the one whose best L1 + best L2 times are smallest where
    both are measured, else the fallback rule. ``available``: implementation names, or
    :func:`available_impls`' mapping (name -> "" when usable, else why not); ``block_m``: the
    consumer's block size (:func:`usable_at`)."""
    if isinstance(available, Mapping):
        skipped = {k: v for k, v in available.items() if v}
        avail = {k for k, v in available.items() if not v}
    else:
        skipped, avail = {}, set(available)
    table = load_table() if table is None else table
    shapes = ((2 * intermediate, hidden), (hidden, intermediate))
    entries = [_nearest_entry(table, rows_per_expert, n, k, block_m) for n, k in shapes]
    totals = {}
    if all(entries):
        for impl in sorted(avail & set(IMPLS)):
            picks = []
            for e, (n, k) in zip(entries, shapes):
                times = _available_times(e, {impl}, block_m)
                if not times:
                    break
                picks.append(_fastest(e, times, n, k, table))
            if len(picks) == 2:
                totals[impl] = picks
    if totals:
        impl = min(totals, key=lambda i: totals[i][0].ms + totals[i][1].ms)
        l1, l2 = totals[impl]
        return LayerChoice(impl, l1, l2, f"measured: {impl} L1 {l1.ms:.3f} + L2 {l2.ms:.3f} ms", skipped)
    why = "no measured entries" if not all(entries) else "no available implementation measured for both GEMMs"
    f = fallback(rows_per_expert, avail, why)
    return LayerChoice(f.impl, f, f, f.source, skipped)


#: how :func:`available_impls` starts the reason of a CUTLASS library that is not built (none found)
CUTLASS_NOT_BUILT = "CUTLASS library not built"


def available_impls(block_m: int) -> dict[str, str]:
    """Each implementation -> "" when the layer can use it here, else why not (loads nothing that is
    not already built: CUTLASS's library from ``.gemm-build``/the cache, DeepGEMM if installed; never
    builds: a build takes minutes, see :func:`resolve_layer` for what a run says instead)."""
    out = {"triton": ""}
    from . import cutlass as CG

    try:
        CG.load_library(build=False)
        CG.library_info()
        out["cutlass"] = ""
    except CG.GemmLibraryMissing as exc:
        out["cutlass"] = f"{CUTLASS_NOT_BUILT}: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - built for another source, cannot load, no GPU
        out["cutlass"] = f"CUTLASS library unavailable: {str(exc)[:200]}"
    from . import deep_gemm as DG

    if block_m != DG.BLOCK_M:
        out["deep_gemm"] = f"block_m must be {DG.BLOCK_M} for deep_gemm, the plan has {block_m}"
    else:
        a = DG.deep_gemm_available()
        out["deep_gemm"] = "" if a else a.reason
    return out


def resolve_layer(gemm: str, block_m: int, shape, tokens_per_rank, table: Mapping | None = None) -> LayerChoice:
    """The expert-parallel layer's GEMMs for its ``gemm`` argument: ``"auto"`` takes the fastest
    available implementation of the table at the layer's rows per expert (every PE's tokens x top-k /
    experts); an explicit implementation takes its own fastest variants (``"deep_gemm"``: ValueError
    unless ``block_m`` is 128, RuntimeError with the reason when DeepGEMM is not available)."""
    rows_per_expert = sum(int(t) for t in tokens_per_rank) * shape.topk / shape.num_experts
    if gemm == "auto":
        avail: Mapping[str, str] = available_impls(block_m)
    elif gemm in IMPLS:
        if gemm == "deep_gemm":
            from . import deep_gemm as DG

            DG.check_block_m(block_m, "block_m")
            a = DG.deep_gemm_available()
            if not a:
                raise RuntimeError(f"gemm='deep_gemm' is not available: {a.reason}")
        avail = {gemm: ""}
    else:
        raise ValueError(f"gemm must be 'auto' or one of {IMPLS}, got {gemm!r}")
    choice = choose_layer(rows_per_expert, shape.hidden, shape.intermediate, avail, table, block_m=block_m)
    if gemm == "auto" and avail.get("cutlass", "").startswith(CUTLASS_NOT_BUILT):
        from . import cutlass as CG

        names = {"triton": "the Triton GEMMs", "deep_gemm": "DeepGEMM"}
        CG.notice_once("gemm-auto-absent", CG.absent_text(
            f"gemm='auto' runs {names.get(choice.impl, choice.impl)} instead (no build starts inside a run)"))
    return choice


def backend_options(choice: LayerChoice, *, staging_y: bool) -> dict:
    """The options of ``choice``'s backend (:mod:`streamring.gemm.backends`) for a block consumer.
    ``staging_y``: the caller reads ``bc.y``'s rows of each ready range right after computing them (the
    expert-parallel layer), so DeepGEMM may overwrite the other rows (see ``DeepGemmExperts``)."""
    if choice.impl == "cutlass":
        import torch

        out = {"bf16": torch.bfloat16, "f32": torch.float32}[choice.l1.out or "bf16"]
        return dict(tile_l1=choice.l1.tile, tile_l2=choice.l2.tile, l1_out_dtype=out, raster_l1=choice.l1.raster,
                    raster_l2=choice.l2.raster, swizzle_l1=choice.l1.swizzle, swizzle_l2=choice.l2.swizzle)
    if choice.impl == "deep_gemm":
        return dict(keep_rows_outside_range=not staging_y)
    if choice.impl == "triton":
        return {}
    raise ValueError(f"choice.impl must be one of {IMPLS}, got {choice.impl!r}")


def setup_consumer(bc, choice: LayerChoice, *, staging_y: bool):
    """Make ``bc``'s expert GEMMs of ``choice`` (allocates: before any graph capture; ``staging_y`` as in
    :func:`backend_options`); returns the backend."""
    return bc.experts(choice.impl, **backend_options(choice, staging_y=staging_y))
