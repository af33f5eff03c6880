"""The CUTLASS library of the expert GEMMs: the ctypes launcher of the FP8 blockwise grouped GEMM over ready
blocks (``csrc/gemm/gemm_blockwise_fp8.cu``): its variant table, C signatures and status bits, finding, building
and loading the library, the argument checks and :class:`GroupedGemm`, one plan. The block consumer's L1/L2
through it, the ``cutlass`` backend, is :mod:`streamring.gemm.cutlass` (which offers these names too).

One :class:`GroupedGemm` is one CUTLASS plan: a kernel variant (tile configuration and output dtype),
the GEMM's ``N`` and ``K``, and a capacity (the most ready items one run may cover). Its
:meth:`GroupedGemm.run` computes, on the current torch stream, for every ready block ``b`` of
``ready_list[ready_hi[lo_index] : ready_hi[hi_index]]``::

    d[b*block_m : (b+1)*block_m, :] = (a ⊙ a_sf)[rows] @ (w[e] ⊙ w_sf[e])^T,   e = block_expert[b]

with FP8 e4m3 operands, ``a_sf`` one float32 scale per row per 128 columns of K, ``w_sf`` one per
128x128 block (for the 192-wide tiles: one per 64x128 block, :func:`weight_scales_for` repeats
the 128x128 ones), fp32 accumulation, ``d`` bfloat16 or float32. The range is read on the device, nothing
is allocated and nothing is read back, so runs can be captured in a CUDA graph. Rows of blocks not in
the range are not written.

Two kinds of tiles (:data:`TILE_TABLE`): the grouped ones run CUTLASS's pointer-array grouped GEMM
over runs of one expert's consecutive blocks (any ``block_m``); the one-block tiles (``block_tile``:
``pair128``, ``pair192``, ``pair128_n2``, ``block128``, ``block128_n2``, ``block64pp``) take one
128-row block per tile (``block64pp``: per two 64-row ping-pong tiles; ``block_m`` must be 128 and
the plan's capacity at least the number of blocks), with one tensor map per operand and the
expert as CUTLASS's batch coordinate; ``pair*`` tiles give ready blocks 2p
and 2p+1 to the two CTAs of a 2x1 cluster and multicast the weight tile when both are one expert's,
``block128_n2`` gives one block's two adjacent N tiles to a 1x2 cluster that shares the A tile,
``pair128_n2`` does both in a 2x2 cluster.

The library is found (and, where nvcc and CUTLASS's headers are available, built) lazily by
:func:`load_library`: ``$STREAMRING_GEMM_LIB``, then the repository's ``.gemm-build/``, then the build
cache of :mod:`streamring.gemm.build`. A library built from another version of the source is
refused (its embedded sha256 must match the source next to this file). A build is never silent: where
none is found and one starts (a ``GroupedGemm`` made, e.g. ``gemm="cutlass"``), stderr says so once per
process, with how long it takes, and a line per compile unit follows; ``gemm="auto"`` never builds
(:meth:`streamring.gemm.cutlass.CutlassExperts.probe` loads with ``build=False``) and says on stderr, once, that the library
is absent and which GEMMs run instead.

Device-side range errors (a range longer than ``max_items``, a negative range, a block or expert id
out of range) set bits of the plan's status word (:data:`STATUS_BITS`); with ``trap_on_error`` (the
default) the setup kernel also prints them and traps, so the next CUDA synchronisation fails.
:meth:`GroupedGemm.check` reads the word (it synchronises) and raises.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
SF_BLOCK = 128


@dataclass(frozen=True)
class Tile:
    """A kernel configuration of the library (``gemm_blockwise_fp8.cu``'s variant table)."""

    mnk: tuple          # tile M, N, K
    cluster: tuple      # cluster M, N (2 along M: the W tile is multicast to both CTAs; along N: the A tile)
    sf_n: int           # rows of W per weight scale the kernel reads (64: w_sf repeated, weight_scales_for)
    variants: dict      # out dtype -> the library's variant id
    doc: str
    block_tile: bool = False  # one block per tile or two (block_m must be BLOCK_TILE_ROWS; the .cu's PairPlan)


# The library's variant table (tests compare it with the .cu and with the loaded library).
TILE_TABLE = {
    "coop128": Tile((128, 128, 128), (1, 2), 128, {torch.bfloat16: 0, torch.float32: 1},
                    "128x128x128 tile, cooperative (2 consumer warpgroups), cluster 1x2 (A multicast)"),
    "pingpong64": Tile((64, 128, 128), (1, 1), 128, {torch.bfloat16: 2, torch.float32: 3},
                       "64x128x128 tile, ping-pong (2 consumer warpgroups on alternate tiles), cluster 1x1"),
    "coop128_m2": Tile((128, 128, 128), (2, 1), 128, {torch.bfloat16: 4},
                       "128x128x128 tile, cooperative, cluster 2x1 (weight tile multicast to both CTAs)"),
    "coop192_m2": Tile((128, 192, 128), (2, 1), 64, {torch.bfloat16: 5},
                       "128x192x128 tile, cooperative, cluster 2x1 (weight multicast), weight scales per 64 rows"),
    "coop192_n2": Tile((128, 192, 128), (1, 2), 64, {torch.bfloat16: 6},
                       "128x192x128 tile, cooperative, cluster 1x2 (A multicast), weight scales per 64 rows"),
    "pingpong192": Tile((64, 192, 128), (1, 1), 64, {torch.bfloat16: 7},
                        "64x192x128 tile, ping-pong, cluster 1x1, weight scales per 64 rows"),
    "pair128": Tile((128, 128, 128), (2, 1), 128, {torch.bfloat16: 8},
                    "128x128x128 tile, cooperative, one 128-row block per tile, ready blocks 2p and 2p+1 in a 2x1 "
                    "cluster sharing the weight tile (multicast) when one expert's; block_m 128 only; swizzle s: "
                    "tiles in bands of 2s pairs", block_tile=True),
    "pair192": Tile((128, 192, 128), (2, 1), 64, {torch.bfloat16: 9},
                    "128x192x128 pair tile (as pair128), weight scales per 64 rows", block_tile=True),
    "block128": Tile((128, 128, 128), (1, 1), 128, {torch.bfloat16: 10},
                     "128x128x128 tile, cooperative, one 128-row block per tile (pair128's layout and order) with a "
                     "1x1 cluster: no multicast; block_m 128 only", block_tile=True),
    "block128_n2": Tile((128, 128, 128), (1, 2), 128, {torch.bfloat16: 11},
                        "128x128x128 tile, cooperative, one 128-row block per tile, a 1x2 cluster: two N tiles of one "
                        "block, the A tile multicast; block_m 128 only", block_tile=True),
    "pair128_n2": Tile((128, 128, 128), (2, 2), 128, {torch.bfloat16: 12},
                       "128x128x128 tile, cooperative, a 2x2 cluster: ready blocks 2p and 2p+1 by two N tiles, the A "
                       "tile shared along N, the weight tile along M when one expert's; block_m 128 only",
                       block_tile=True),
    "block64pp": Tile((64, 128, 128), (1, 1), 128, {torch.bfloat16: 13},
                      "64x128x128 tile, ping-pong, cluster 1x1, a 128-row block's two halves as two tiles (one "
                      "warpgroup's epilogue beside the other's mainloop); block_m 128 only", block_tile=True),
}
#: the block size of every ``block_tile`` tile (``kBlockTileRows`` in the .cu), and those tiles
BLOCK_TILE_ROWS = 128
BLOCK_TILES = tuple(name for name, t in TILE_TABLE.items() if t.block_tile)
TILES = {name: i for i, name in enumerate(TILE_TABLE)}
TILE_DOC = {name: t.doc for name, t in TILE_TABLE.items()}
NUM_VARIANTS = 1 + max(v for t in TILE_TABLE.values() for v in t.variants.values())
OUT_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
RASTERS = {"m": 0, "n": 1}  # the group scheduler's order inside a group (along M / along N)
SWIZZLES = (1, 2, 4, 8)
#: the most CTAs per SM a run's grid may have (``kMaxCtasPerSm`` in the .cu; a larger ``max_ctas`` is capped)
MAX_CTAS_PER_SM = 16


def variant_id(tile: str, out_dtype) -> int:
    """The library's variant of ``tile`` with ``out_dtype`` output (the errors name what exists)."""
    if tile not in TILE_TABLE:
        raise ValueError(f"tile must be one of {sorted(TILE_TABLE)}, got {tile!r}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    t = TILE_TABLE[tile]
    if out_dtype not in t.variants:
        have = ", ".join(str(d).split(".")[-1] for d in t.variants)
        raise ValueError(f"tile {tile!r} has no {str(out_dtype).split('.')[-1]} output (only {have}); "
                         f"out_dtype must be one of those for this tile")
    return t.variants[out_dtype]


def weight_scales_for(w_sf: torch.Tensor, sf_n: int) -> torch.Tensor:
    """``w_sf [E, N/128, K/128]`` as a variant with ``sf_n`` rows per scale reads it: itself for 128,
    each scale repeated ``128 // sf_n`` times along N otherwise (same values: the same products)."""
    if sf_n == SF_BLOCK:
        return w_sf
    if sf_n <= 0 or SF_BLOCK % sf_n:
        raise ValueError(f"sf_n must divide 128, got {sf_n}")
    return w_sf.repeat_interleave(SF_BLOCK // sf_n, dim=1).contiguous()

STATUS_BITS = {
    1: "the ready range is longer than max_items (blocks past max_items were dropped)",
    2: "the ready range is negative (ready_hi[hi_index] < ready_hi[lo_index])",
    4: "a ready block id is outside [0, num_blocks) (skipped)",
    8: "a ready block's expert id is outside [0, num_experts) (skipped)",
    16: "the ready range lies outside the ready list (ready_hi[lo_index] < 0 or ready_hi[hi_index] > its length)",
    32: "psum layout: the blocks are not laid out expert by expert, or the range is not every allocated block "
        "(nothing was computed)",
    64: "pair tile: a block id appears twice in the range with different partners (nothing was computed)",
}

_c_int, _c_void_p, _c_char_p = ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p
_p_int, _p_i64, _p_void_p = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p)
_RUN_ARGS = [_c_void_p,  # plan
             _c_void_p, _c_int, _c_void_p, _c_int, _c_int,  # ready_list, ready_len, ready_hi, lo_index, hi_index
             _c_int,  # max_items
             _c_void_p, _c_int, _c_int, _c_int,  # block_expert, num_blocks, num_experts, block_m
             _c_void_p, _c_void_p, _c_void_p, _c_void_p, _c_void_p,  # a, a_sf, w, w_sf, d
             _c_void_p, _c_int, _c_void_p]  # status, max_ctas, stream
# name -> (restype, argtypes): the C signatures of gemm_blockwise_fp8.cu (tests compare the two)
SIGNATURES = {
    "sr_gemm_last_error": (_c_char_p, []),
    "sr_gemm_build_info": (_c_char_p, []),
    "sr_gemm_num_variants": (_c_int, []),
    "sr_gemm_variant_info": (_c_int, [_c_int, _p_int]),
    "sr_gemm_create": (_c_int, [_c_int, _c_int, _c_int, _c_int, _c_int, _c_int, _c_int, _c_int, _p_void_p]),
    "sr_gemm_destroy": (_c_int, [_c_void_p]),
    "sr_gemm_run": (_c_int, _RUN_ARGS),
    "sr_gemm_setup_only": (_c_int, _RUN_ARGS),
    "sr_gemm_read_groups": (_c_int, [_c_void_p, _c_int, _p_int, _p_i64, _p_i64, _p_i64, _p_i64, _p_i64]),
}


class GemmLibraryError(RuntimeError):
    """The CUTLASS GEMM library cannot be found, built, loaded, or returned an error."""


class GemmLibraryMissing(GemmLibraryError):
    """No library built from this source was found, and none was to be built (``build=False``)."""


_noticed: set[str] = set()


def notice_once(key: str, text: str) -> bool:
    """Print ``streamring: <text>`` on stderr the first time ``key`` is noticed in this process (a run
    resolves its GEMMs once per buffer: the user reads it once); True when it printed."""
    if key in _noticed:
        return False
    _noticed.add(key)
    print(f"streamring: {text}", file=sys.stderr, flush=True)
    return True


def absent_text(doing: str) -> str:
    """The notice of an absent library: what is missing, what this process does instead (``doing``),
    how long building takes and the command that builds it ahead."""
    from ..device.build import cache_dir
    from .build import BUILD_COMMAND, BUILD_TIME, SOURCE

    return (f"the CUTLASS GEMM library is not built from this {SOURCE.name} (none in .gemm-build/ or "
            f"{cache_dir() / 'gemm'}): {doing}. Building it takes {BUILD_TIME}; build it ahead with "
            f"`{BUILD_COMMAND}`")


# ----------------------------------------------------------------------------------------------
# the library
# ----------------------------------------------------------------------------------------------
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: Path | None = None


def _source_sha256() -> str:
    from .build import source_sha256

    return source_sha256()


def candidate_libraries() -> list[Path]:
    """Libraries built from this source, best first: ``$STREAMRING_GEMM_LIB``, ``.gemm-build/``, the cache."""
    from ..device.build import cache_dir
    from .build import LIB_PREFIX, REPO_BUILD_DIR

    want = _source_sha256()
    out = []
    for folder in (REPO_BUILD_DIR, cache_dir() / "gemm"):
        if not folder.is_dir():
            continue
        for meta in sorted(folder.glob(f"{LIB_PREFIX}*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
            try:
                info = json.loads(meta.read_text())
            except (OSError, ValueError):
                continue
            lib = meta.with_suffix(".so")
            if info.get("source_sha256") == want and lib.is_file():
                out.append(lib)
    return out


def library_path(build: bool = True) -> Path:
    """The library to load (builds it when none matches the source and ``build`` is true)."""
    env = os.environ.get("STREAMRING_GEMM_LIB")
    if env:
        p = Path(env)
        if not p.is_file():
            raise GemmLibraryError(f"$STREAMRING_GEMM_LIB={env} is not a file")
        return p
    found = candidate_libraries()
    if found:
        return found[0]
    if not build:
        raise GemmLibraryMissing("no CUTLASS GEMM library built from the current gemm_blockwise_fp8.cu in .gemm-build/ "
                                 "or the build cache; run `python -m streamring.gemm.build --out .gemm-build`")
    from ..device.build import BuildError
    from .build import build as build_library

    notice_once("gemm-build", absent_text("building it now (a line per compile unit follows)"))
    try:
        return build_library(progress=lambda line: print(f"streamring: build_gemm: {line}", file=sys.stderr,
                                                         flush=True))
    except BuildError as exc:
        raise GemmLibraryError(f"the CUTLASS GEMM library is not built and cannot be built here: {exc}") from exc


def load_library(path: str | os.PathLike | None = None, build: bool = True) -> ctypes.CDLL:
    """Load the library once per process (``path`` overrides the search); declares every signature and
    checks the embedded source hash against ``csrc/gemm/gemm_blockwise_fp8.cu``."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if path is not None and Path(path).resolve() != _lib_path:
                raise GemmLibraryError(f"a CUTLASS GEMM library is already loaded from {_lib_path}")
            return _lib
        p = Path(path) if path is not None else library_path(build=build)
        try:
            lib = ctypes.CDLL(str(p))
        except OSError as exc:
            raise GemmLibraryError(f"cannot load {p}: {exc}") from exc
        for name, (res, args) in SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as exc:
                raise GemmLibraryError(f"{p} has no entry point {name} (built from another source?)") from exc
            fn.restype, fn.argtypes = res, args
        info = lib.sr_gemm_build_info().decode()
        want = _source_sha256()
        if f"source_sha256={want}" not in info and not os.environ.get("STREAMRING_GEMM_ANY_SOURCE"):
            raise GemmLibraryError(f"{p} was built from another gemm_blockwise_fp8.cu ({info}); this source has sha256 "
                                   f"{want}. Rebuild: python -m streamring.gemm.build --out .gemm-build")
        _lib, _lib_path = lib, p.resolve()
        return lib


def library_info() -> dict:
    """Path and build info of the loaded library, and what each variant is (tile, shared memory...)."""
    lib = load_library()
    variants = {}
    for tile, t in TILE_TABLE.items():
        for dt, vid in t.variants.items():
            arr = (ctypes.c_int * 10)()
            _check(lib, lib.sr_gemm_variant_info(vid, arr), "sr_gemm_variant_info")
            v = list(arr)
            variants[f"{tile}:{str(dt).split('.')[-1]}"] = {
                "variant": vid, "tile_mnk": v[0:3], "cluster_mn": v[3:5], "smem_bytes": v[5], "threads": v[6],
                "out_bytes": v[7], "stages": v[8], "sf_n": v[9]}
    return {"path": str(_lib_path), "build_info": lib.sr_gemm_build_info().decode(), "variants": variants}


def table_mismatches(variants: dict) -> list[str]:
    """Where :data:`TILE_TABLE` and a library's ``library_info()["variants"]`` disagree."""
    bad = []
    for tile, t in TILE_TABLE.items():
        for dt in t.variants:
            key = f"{tile}:{str(dt).split('.')[-1]}"
            v = variants.get(key)
            if v is None:
                bad.append(f"{key}: missing from the library")
                continue
            want = {"tile_mnk": list(t.mnk), "cluster_mn": list(t.cluster), "sf_n": t.sf_n,
                    "out_bytes": torch.empty(0, dtype=dt).element_size()}
            got = {k: v.get(k) for k in want}
            if got != want:
                bad.append(f"{key}: library {got}, TILE_TABLE {want}")
    return bad


def _check(lib, rc: int, what: str) -> None:
    if rc != 0:
        msg = lib.sr_gemm_last_error().decode(errors="replace")
        raise GemmLibraryError(f"{what} failed (code {rc}): {msg}")


# ----------------------------------------------------------------------------------------------
# argument checks (pure Python: run before the library is touched)
# ----------------------------------------------------------------------------------------------
def _check_tensor(name: str, t, dtype, ndim: int, device=None, require_cuda: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if require_cuda and t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other tensors on {device}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")


@dataclass(frozen=True)
class RunShape:
    """What :func:`check_run_args` derived from the tensors."""

    num_blocks: int
    num_experts: int
    rows: int


def check_run_args(n: int, k: int, out_dtype, capacity: int, ready_list, ready_hi, lo_index, hi_index, max_items,
                   block_expert, a, a_sf, w, w_sf, d, block_m, max_ctas, require_cuda: bool = True,
                   sf_n: int = SF_BLOCK, tile_block_m: int | None = None) -> RunShape:
    """Every check of :meth:`GroupedGemm.run`; the messages name the argument and what it must be.
    (``require_cuda=False``: the same checks on CPU tensors, for tests on machines without a GPU.)"""

    def _tensor(*a, **kw):
        return _check_tensor(*a, require_cuda=require_cuda, **kw)

    for name, v in (("lo_index", lo_index), ("hi_index", hi_index), ("max_items", max_items), ("block_m", block_m)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if max_ctas is not None and (isinstance(max_ctas, bool) or not isinstance(max_ctas, int) or max_ctas <= 0):
        raise ValueError(f"max_ctas must be None or a positive int, got {max_ctas!r}")
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    if not 0 <= max_items <= capacity:
        raise ValueError(f"max_items must be in [0, capacity={capacity}] of this plan, got {max_items}")
    _tensor("ready_list", ready_list, torch.int32, 1)
    dev = ready_list.device
    _tensor("ready_hi", ready_hi, torch.int32, 1, dev)
    for name, v in (("lo_index", lo_index), ("hi_index", hi_index)):
        if not 0 <= v < ready_hi.numel():
            raise ValueError(f"{name}={v} outside ready_hi's {ready_hi.numel()} entries")
    _tensor("block_expert", block_expert, torch.int32, 1, dev)
    num_blocks = block_expert.numel()
    if num_blocks == 0:
        raise ValueError("block_expert is empty (no blocks)")
    if tile_block_m is not None:
        if block_m != tile_block_m:
            raise ValueError(f"block_m must be {tile_block_m} for a one-block-per-tile tile "
                             f"({', '.join(BLOCK_TILES)}), got {block_m}")
        if num_blocks > capacity:
            raise ValueError(f"block_expert has {num_blocks} blocks, more than capacity={capacity}: a one-block tile's plan "
                             "keeps one entry per block id (make the plan with capacity >= the number of blocks)")
    rows = num_blocks * block_m
    _tensor("w", w, FP8, 3, dev)
    e, wn, wk = w.shape
    if (wn, wk) != (n, k):
        raise ValueError(f"w must be [E, N={n}, K={k}] (this plan's N and K), got {tuple(w.shape)}")
    _tensor("w_sf", w_sf, torch.float32, 3, dev)
    if tuple(w_sf.shape) != (e, n // sf_n, k // SF_BLOCK):
        hint = "" if sf_n == SF_BLOCK else " (this tile reads one scale per 64 rows of W: weight_scales_for(w_sf, 64))"
        raise ValueError(f"w_sf must be [E={e}, N/{sf_n}={n // sf_n}, K/128={k // SF_BLOCK}]{hint}, "
                         f"got {tuple(w_sf.shape)}")
    _tensor("a", a, FP8, 2, dev)
    if a.shape[1] != k or a.shape[0] < rows:
        raise ValueError(f"a must be [rows >= num_blocks*block_m = {rows}, K={k}] float8_e4m3fn, got {tuple(a.shape)}")
    _tensor("a_sf", a_sf, torch.float32, 2, dev)
    if a_sf.shape[1] != k // SF_BLOCK or a_sf.shape[0] < rows:
        raise ValueError(f"a_sf must be [rows >= {rows}, K/128={k // SF_BLOCK}] float32, got {tuple(a_sf.shape)}")
    _tensor("d", d, out_dtype, 2, dev)
    if d.shape[1] != n or d.shape[0] < rows:
        raise ValueError(f"d must be [rows >= {rows}, N={n}] {out_dtype}, got {tuple(d.shape)}")
    for name, t in (("a", a), ("w", w), ("d", d)):
        if require_cuda and t.data_ptr() % 16:
            raise ValueError(f"{name} must start 16-byte aligned (TMA), got address {t.data_ptr():#x}")
    return RunShape(num_blocks, e, rows)


def status_text(status: int) -> str:
    return "; ".join(msg for bit, msg in STATUS_BITS.items() if status & bit) or "ok"


# ----------------------------------------------------------------------------------------------
# plans
# ----------------------------------------------------------------------------------------------
class GroupedGemm:
    """One CUTLASS grouped-GEMM plan (created on first use, on the tensors' device).

    ``n``, ``k``: the GEMM's output width and reduction length (multiples of 128);
    ``out_dtype``: ``torch.bfloat16`` or ``torch.float32`` (the one-block tiles have
    bf16 only); ``tile``: a key of :data:`TILE_TABLE` (:data:`TILE_DOC`); ``capacity``: the
    largest ``max_items`` of a run (sizes the problem arrays); ``raster``: ``"m"`` or ``"n"``,
    the order of a group's tiles, and ``swizzle`` (1, 2, 4, 8): CUTLASS's group scheduler options
    (neither changes what a row computes). A tile with ``sf_n`` 64 takes ``w_sf`` as
    :func:`weight_scales_for` makes it. A plan must not run concurrently with itself (one stream
    at a time).
    """

    def __init__(self, n: int, k: int, *, out_dtype=torch.bfloat16, tile: str = "coop128", capacity: int,
                 trap_on_error: bool = True, raster: str = "m", swizzle: int = 1):
        self.variant = variant_id(tile, out_dtype)
        if raster not in RASTERS:
            raise ValueError(f"raster must be one of {sorted(RASTERS)}, got {raster!r}")
        if swizzle not in SWIZZLES:
            raise ValueError(f"swizzle must be one of {SWIZZLES}, got {swizzle!r}")
        self.raster, self.swizzle = raster, swizzle
        self.sf_n = TILE_TABLE[tile].sf_n
        self.tile_block_m = BLOCK_TILE_ROWS if TILE_TABLE[tile].block_tile else None
        for name, v in (("n", n), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % SF_BLOCK:
                raise ValueError(f"{name} must be a positive multiple of 128 (the scale block), got {v!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.n, self.k, self.out_dtype, self.tile, self.capacity = n, k, out_dtype, tile, capacity
        self.trap_on_error = bool(trap_on_error)
        self._plan = None
        self._lib = None
        self.device: torch.device | None = None
        self.status_word: torch.Tensor | None = None

    def __repr__(self):
        return (f"GroupedGemm(n={self.n}, k={self.k}, out_dtype={self.out_dtype}, tile={self.tile!r}, "
                f"capacity={self.capacity}, raster={self.raster!r}, swizzle={self.swizzle})")

    def _ensure(self, device: torch.device) -> None:
        if self._plan is not None:
            if device != self.device:
                raise ValueError(f"this plan lives on {self.device}, the tensors are on {device}")
            return
        lib = load_library()
        destroy_dropped()
        idx = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(idx):
            plan = ctypes.c_void_p()
            _check(lib, lib.sr_gemm_create(self.variant, self.n, self.k, self.capacity, idx, int(self.trap_on_error),
                                           RASTERS[self.raster], self.swizzle, ctypes.byref(plan)),
                   f"sr_gemm_create({self!r})")
        self._lib, self._plan, self.device = lib, plan, torch.device("cuda", idx)
        self.status_word = torch.zeros(1, dtype=torch.int32, device=self.device)

    def _call(self, fn_name: str, ready_list, ready_hi, lo_index, hi_index, max_items, block_expert, a, a_sf, w, w_sf,
              d, block_m, max_ctas) -> None:
        rs = check_run_args(self.n, self.k, self.out_dtype, self.capacity, ready_list, ready_hi, lo_index, hi_index,
                            max_items, block_expert, a, a_sf, w, w_sf, d, block_m, max_ctas, sf_n=self.sf_n,
                            tile_block_m=self.tile_block_m)
        self._ensure(ready_list.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with torch.cuda.device(self.device):
            rc = getattr(self._lib, fn_name)(
                self._plan, ready_list.data_ptr(), ready_list.numel(), ready_hi.data_ptr(), lo_index, hi_index, max_items,
                block_expert.data_ptr(), rs.num_blocks, rs.num_experts, block_m, a.data_ptr(), a_sf.data_ptr(),
                w.data_ptr(), w_sf.data_ptr(), d.data_ptr(), self.status_word.data_ptr(), max_ctas or 0, stream)
        _check(self._lib, rc, fn_name)

    def run(self, ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, block_expert, a, a_sf, w, w_sf,
            d, *, block_m: int, max_ctas: int | None = None) -> None:
        """Grouped GEMM of the ready blocks ``ready_list[ready_hi[lo_index] : ready_hi[hi_index]]`` into ``d``
        on the current stream (see the module doc); ``max_items`` bounds the range (≤ capacity);
        ``max_ctas``: the grid in CTAs, rounded down to whole clusters (None: one per SM, a persistent grid that
        holds every SM until the run ends); fewer than the SMs leave SMs to other streams; more (at most
        :data:`MAX_CTAS_PER_SM` per SM) run in waves, each CTA looping over its share of the tiles, so CTAs
        retire during the run and higher-priority streams' CTAs get SMs between them. The grid never changes
        what a row computes."""
        self._call("sr_gemm_run", ready_list, ready_hi, lo_index, hi_index, max_items, block_expert, a, a_sf, w, w_sf,
                   d, block_m, max_ctas)

    def setup_only(self, ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, block_expert, a, a_sf, w,
                   w_sf, d, *, block_m: int) -> None:
        """Only the range -> problem-array kernel (tests read the arrays with :meth:`read_groups`)."""
        self._call("sr_gemm_setup_only", ready_list, ready_hi, lo_index, hi_index, max_items, block_expert, a, a_sf, w,
                   w_sf, d, block_m, None)

    def read_groups(self, count: int) -> dict:
        """Synchronises; the first ``count`` problems: ``m`` and the raw A/B/SFA/SFB/D pointers."""
        if self._plan is None:
            raise RuntimeError("the plan has not run yet")
        m = (ctypes.c_int * count)()
        ptrs = [(ctypes.c_int64 * count)() for _ in range(5)]
        with torch.cuda.device(self.device):
            _check(self._lib, self._lib.sr_gemm_read_groups(self._plan, count, m, *ptrs), "sr_gemm_read_groups")
        names = ("a", "b", "sfa", "sfb", "d")
        return {"m": list(m), **{nm: list(p) for nm, p in zip(names, ptrs)}}

    def status(self) -> int:
        """The device status word (synchronises the stream); 0 = every range was fine."""
        if self.status_word is None:
            return 0
        return int(self.status_word.item())

    def reset_status(self) -> None:
        if self.status_word is not None:
            self.status_word.zero_()

    def check(self) -> None:
        """Raise :class:`GemmLibraryError` if any run so far found a bad ready range."""
        s = self.status()
        if s:
            raise GemmLibraryError(f"{self!r}: status {s:#x}: {status_text(s)}")

    def close(self) -> None:
        """Destroy the plan (its device memory freed); not while this thread captures a CUDA graph."""
        if self._plan is not None:
            self._lib.sr_gemm_destroy(self._plan)
            self._plan = None
        destroy_dropped()

    def __del__(self):
        # the collector runs wherever an allocation triggers it, inside a caller's CUDA graph capture too, where a
        # destroy's cudaFree would invalidate that capture: the plan is queued, and destroyed at once only outside
        # a capture (destroy_dropped)
        try:
            if self._plan is not None:
                _DROPPED.append((self._lib, self._plan))
                self._plan = None
                destroy_dropped()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the module's globals may be gone
            pass


#: plans dropped while a capture may be underway, each ``(library, handle)``, destroyed by :func:`destroy_dropped`
_DROPPED: list = []


def destroy_dropped() -> None:
    """Destroy the queued plans, unless this thread's current stream is capturing a CUDA graph.

    A destroy frees device memory (``cudaFree``), which a capture does not allow: the capture is invalidated and
    fails at its end (``cudaErrorStreamCaptureInvalidated``). :meth:`GroupedGemm.__del__` queues its plan and calls
    this; a plan queued during a capture is destroyed by the next plan made, closed or dropped outside one. What it
    cannot see: a capture on another thread in torch's default ``global`` mode, which a free from this thread also
    invalidates (``EPBuffer.capture`` captures in ``thread_local`` mode). Safe from several threads (each pop is
    atomic)."""
    if not _DROPPED or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    while True:
        try:
            lib, plan = _DROPPED.pop()
        except IndexError:
            return
        lib.sr_gemm_destroy(plan)
