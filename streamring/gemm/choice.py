"""Which expert GEMM implementation (and which variant of it) runs a shape: the measured heuristic.

``python -m bench.gemm --table PATH`` times every implementation of the block consumer's expert GEMMs
on one H200 (every backend's variants) and writes, per (rows per expert, N, K), every time and the
fastest; the committed copy is :data:`TABLE_PATH`. :func:`choose_gemm` picks one GEMM's implementation
from it, :func:`choose_layer` one implementation for both GEMMs of a layer (the expert-parallel layer's
``gemm="auto"`` resolves through it), :func:`setup_consumer` prepares a
:class:`~streamring.moe.blocks.BlockConsumer` for the choice.

Everything here reads the backend registry (:mod:`streamring.gemm.backends`) and names no backend: a table
key is parsed by the backend it names, a backend says whether it runs here (``probe``) and which of its
variants a block size runs, and gives its options for a choice.

Where the table has no measured entry for (N, K) near the asked rows per expert (within a factor of
:data:`NEAREST_FACTOR`), or the table is marked ``"measured": false``, the rule that held before the
table existed decides: the available backend of the lowest ``fallback_rank``, with its own variant for the
rows per expert; the only backend asked for where none ranked is; else the last ranked one (the one that runs
wherever the layer runs). The choice says which decided (:attr:`GemmChoice.source`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping

from .backends import backend, backends, names, unavailable

TABLE_PATH = Path(__file__).with_name("table.json")
#: a measured entry serves rows-per-expert values within this factor of its own
NEAREST_FACTOR = 2.0


@dataclass(frozen=True)
class GemmChoice:
    """One GEMM's implementation: ``impl`` (a backend name), the fields of its variant as its table keys name
    them (``tile``, ``out``: the L1 output dtype, ``raster`` and ``swizzle``: a tile order; a backend without
    variants leaves the defaults); ``ms`` the measured median (None when the fallback rule chose); ``source``
    what decided."""

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
    """The table's name of an implementation variant, as its backend names it (the backend's name alone where
    it has no variants, or where ``impl`` names no backend)."""
    try:
        b = backend(impl)
    except (ValueError, RuntimeError):
        return impl
    return b.variant_key(GemmChoice(impl, tile, out, raster, swizzle))


def parse_key(key: str) -> GemmChoice:
    """:func:`variant_key` backwards (ValueError for a key that names no implementation loaded here)."""
    name, *fields = key.split(":")
    try:
        variant = backend(name).parse_variant(fields)
    except (ValueError, RuntimeError):
        variant = None
    if variant is None:
        raise ValueError(f"table key {key!r} names no implementation "
                         f"({', '.join(b.key_form() for b in backends().values())})")
    return GemmChoice(name, **variant)


def _ranked() -> list:
    """The backends the fallback rule knows, in its order."""
    return sorted((b for b in backends().values() if b.fallback_rank is not None),
                  key=lambda b: (b.fallback_rank, b.name))


def fallback(rows_per_expert: float, available: Iterable[str], why: str = "") -> GemmChoice:
    """The rule before the table: the available backend of the lowest ``fallback_rank`` with its own variant
    for ``rows_per_expert``; where none ranked is available, the one implementation asked for (unmeasured, a
    backend without a rank is not preferred to any); else the last ranked one, which runs wherever the layer
    runs."""
    avail = set(available) & set(names())
    note = f" ({why})" if why else ""
    ranked = _ranked()
    pick = next((b for b in ranked if b.name in avail), None)
    if pick is None and len(avail) == 1:
        return GemmChoice(next(iter(avail)), source=f"asked for explicitly{note}")
    pick = pick or ranked[-1]
    fields, rule = pick.fallback_variant(rows_per_expert)
    return GemmChoice(pick.name, **fields, source=f"fallback rule: {rule}{note}")


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
    known, so only what runs at every block size): its backend says."""
    return backend(choice.impl).runs_variant(choice, block_m)


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
    avail = set(available) & set(names())
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
        for impl in sorted(avail & set(names())):
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


def available_impls(block_m: int) -> dict[str, str]:
    """Each implementation -> "" when the layer can use it here, else why not: its block sizes, then its
    ``probe`` (which loads nothing that is not built and never builds: a build takes minutes, see
    :func:`resolve_layer` for what a run says instead)."""
    out = {}
    for name in names():
        try:
            b = backend(name)
        except RuntimeError as exc:
            out[name] = str(exc)
            continue
        sizes = b.capabilities.block_sizes
        if sizes is not None and block_m not in sizes:
            out[name] = f"block_m must be {' or '.join(map(str, sizes))} for {name}, the plan has {block_m}"
        else:
            out[name] = b.probe(block_m)
    return out


def resolve_layer(gemm: str, block_m: int, shape, tokens_per_rank, table: Mapping | None = None) -> LayerChoice:
    """The expert-parallel layer's GEMMs for its ``gemm`` argument: ``"auto"`` takes the fastest
    available implementation of the table at the layer's rows per expert (every PE's tokens x top-k /
    experts), and each backend it leaves out may say so (``left_out``: e.g. a library not built); an explicit
    implementation takes its own fastest variants after its ``require`` (ValueError for a setting it does
    not take, RuntimeError where it cannot run here)."""
    rows_per_expert = sum(int(t) for t in tokens_per_rank) * shape.topk / shape.num_experts
    if gemm == "auto":
        avail: Mapping[str, str] = available_impls(block_m)
    elif gemm in names():
        backend(gemm).require(block_m)
        avail = {gemm: ""}
    else:
        raise ValueError(f"gemm must be 'auto' or one of {names()}, got {gemm!r}")
    choice = choose_layer(rows_per_expert, shape.hidden, shape.intermediate, avail, table, block_m=block_m)
    if gemm == "auto":
        instead = backend(choice.impl).label()
        for name, why in avail.items():
            if why and not unavailable(name):
                backend(name).left_out(why, instead)
    return choice


def backend_options(choice: LayerChoice, *, staging_y: bool) -> dict:
    """The options of ``choice``'s backend (:mod:`streamring.gemm.backends`) for a block consumer.
    ``staging_y``: the caller reads ``bc.y``'s rows of each ready range right after computing them (the
    expert-parallel layer), so a backend may overwrite the other rows."""
    if choice.impl not in names():
        raise ValueError(f"choice.impl must be one of {names()}, got {choice.impl!r}")
    return backend(choice.impl).options(choice, staging_y=staging_y)


def setup_consumer(bc, choice: LayerChoice, *, staging_y: bool):
    """Make ``bc``'s expert GEMMs of ``choice`` (allocates: before any graph capture; ``staging_y`` as in
    :func:`backend_options`); returns the backend."""
    return bc.experts(choice.impl, **backend_options(choice, staging_y=staging_y))
