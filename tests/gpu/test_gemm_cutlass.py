"""The CUTLASS FP8 blockwise grouped GEMM over ready blocks (device/csrc/gemm/gemm_blockwise_fp8.cu,
gemm/cutlass_lib.py, gemm/build.py) and the CUTLASS path of the block consumer (gemm/cutlass.py).

Runs anywhere (CPU):
* the build command line and cache key; CUTLASS discovery says what it tried;
* the ctypes signatures against the C declarations parsed from the .cu (and the parser catches a
  deliberately mismatched signature);
* the library built here (``.gemm-build/``, if present) loads without a GPU, reports its build info
  and variants, and its create call fails with a CUDA error message, not a crash;
* every argument check of ``GroupedGemm.run`` (on CPU tensors, ``require_cuda=False``);
* the pure-Python reference of the device's ready range -> groups conversion (hand cases and a
  property test);
* ``moe_triton.swiglu_quant_blocks`` (Triton's CPU interpreter without a GPU) against a torch
  emulation, only on ready blocks.

Needs an sm_90 GPU and the library (skipped otherwise, with the reason):
* against a float64 reference of the dequantized operands, elementwise within
  ``2^-9 * sum_k |a_k w_k|`` (+ the output rounding), for both tiles and both output dtypes,
  random data and scales, poisoned outputs, M = 0 groups, ragged ready ranges; rows of blocks that
  are not ready keep the poison; the tolerance is shown to catch one wrong 128x128 scale block;
* the device problem arrays against the Python reference;
* bitwise: a block computed alone == the same block inside a long merged run (other tile offsets),
  ranges computed piecewise == at once, a capped persistent grid == the full grid;
* CUDA graph capture and replay with the ready list changed between replays;
* the status word (range longer than max_items, bad block id) with trap_on_error off;
* the block consumer with gemm_impl="cutlass" against "triton", and streamed == batch bitwise.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import gpu_skip
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from streamring.gemm import build as BG  # noqa: E402
from streamring.gemm import cutlass as CG  # noqa: E402
import ready_range_reference as RR  # noqa: E402
from streamring.device.build import BuildError, find_nvcc  # noqa: E402
from bench import block_paths  # noqa: E402

FP8 = torch.float8_e4m3fn
SRC = Path(BG.SOURCE)


# ----------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------
def test_build_command_line():
    cmd = BG.build_command("nvcc", Path("/cut"), Path("/o/lib.so"), "abc123")
    assert cmd[0] == "nvcc"
    for flag in ("-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-shared",
                 "-Xcompiler=-fPIC", "-I/cut/include", "-I/cut/tools/util/include", '-DSR_GEMM_SOURCE_HASH="abc123"'):
        assert flag in cmd, flag
    i = cmd.index("-cudart")
    assert cmd[i + 1] == "static"  # the .so needs only the driver at run time
    assert str(SRC) in cmd and cmd[cmd.index("-o") + 1] == "/o/lib.so"
    assert not any(c.startswith("-arch") for c in cmd)  # the -gencode form only (see HOPPER.md)


def test_part_commands_split_the_variants_and_link_statically():
    compiles, link = BG.part_commands("nvcc", Path("/cut"), Path("/o/lib.so"), "abc", Path("/tmp/b"), parts=2,
                                      patch_dir=Path("/tmp/b/patch"))
    assert len(compiles) == 2
    for p, cmd in enumerate(compiles):
        assert f"-DSR_GEMM_PART={p}" in cmd and "-DSR_GEMM_NUM_PARTS=2" in cmd and "-c" in cmd
        assert cmd[cmd.index("-o") + 1] == f"/tmp/b/part{p}.o" and "-shared" not in cmd
        # the patched header's folder comes before CUTLASS's own include folder
        assert cmd.index("-I/tmp/b/patch") < cmd.index("-I/cut/include")
        assert "-gencode=arch=compute_90a,code=sm_90a" in cmd
    assert link[-2:] == ["-o", "/o/lib.so"] and "/tmp/b/part0.o" in link and "/tmp/b/part1.o" in link
    assert link[link.index("-cudart") + 1] == "static" and "-shared" in link


def test_every_variant_belongs_to_exactly_one_part():
    text = SRC.read_text()
    n = int(re.search(r"constexpr int kNumVariants = (\d+);", text).group(1))
    for v in range(n):
        assert f"SR_VARIANT_DECL({v})" in text
        assert (f"#if SR_GEMM_OWNS({v})\nSR_VARIANT_DEF({v})" in text) != (f"#if SR_GEMM_OWNS({v})\nSR_PAIR_VARIANT_DEF({v})"
                                                                         in text)
        assert f"case {v}: return new_plan_{v}();" in text and f"case {v}: variant_info_{v}(out); return true;" in text
    assert n == CG.NUM_VARIANTS


def test_the_grid_cap_per_sm_is_the_libraries():
    assert int(re.search(r"constexpr int kMaxCtasPerSm = (\d+);", SRC.read_text()).group(1)) == CG.MAX_CTAS_PER_SM


def test_cutlass_patch_relaxes_exactly_the_three_shape_asserts(tmp_path):
    try:
        root = BG.find_cutlass()
    except BuildError as exc:
        pytest.skip(f"CUTLASS headers not here: {str(exc)[:120]}")
    original = (root / "include" / BG.PATCHED_HEADER).read_text()
    new = BG.patched_header_text(original)
    if new == original:
        pytest.skip("this CUTLASS checks sizes already (>= 4.3): nothing to patch")
    assert new.count("cute::size(LayoutAccum{}) == cute::size(LayoutScale") == 3
    assert "LayoutAccum{}.shape() ==" not in new
    # everything else unchanged
    strip = lambda t: re.sub(r"static_assert\([^;]*\);", "", t)  # noqa: E731
    assert strip(new) == strip(original)
    out = BG.patch_cutlass(root, tmp_path)
    assert (out / BG.PATCHED_HEADER).read_text() == new
    with pytest.raises(BuildError, match="found 1 of the 3"):
        BG.patched_header_text(original.replace("LayoutAccum{}.shape() == LayoutScaleA{}.shape()", "true", 1)
                               .replace("LayoutAccum{}.shape() == LayoutScaleB{}.shape()", "true", 1))


def test_cache_key_depends_on_every_input():
    base = BG.cache_key("src", "nvcc 13.0", "4.2.0")
    assert base == BG.cache_key("src", "nvcc 13.0", "4.2.0")
    assert len({base, BG.cache_key("src2", "nvcc 13.0", "4.2.0"), BG.cache_key("src", "nvcc 13.1", "4.2.0"),
                BG.cache_key("src", "nvcc 13.0", "4.3.0")}) == 4


def test_find_cutlass_says_what_it_tried(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMRING_CUTLASS_DIR", str(tmp_path / "nope"))
    monkeypatch.setattr(BG, "REPO", tmp_path)
    monkeypatch.setattr(BG.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BuildError) as ei:
        BG.find_cutlass()
    msg = str(ei.value)
    assert "STREAMRING_CUTLASS_DIR" in msg and "pip download --no-deps nvidia-cutlass==4.2.0.0" in msg
    # a folder with the headers is accepted
    good = tmp_path / "cut"
    (good / "include" / "cutlass").mkdir(parents=True)
    (good / "include" / "cutlass" / "cutlass.h").write_text("")
    (good / "tools" / "util" / "include" / "cutlass" / "util").mkdir(parents=True)
    (good / "tools" / "util" / "include" / "cutlass" / "util" / "packed_stride.hpp").write_text("")
    monkeypatch.setenv("STREAMRING_CUTLASS_DIR", str(good))
    assert BG.find_cutlass() == good


# ----------------------------------------------------------------------------------------------
# C signatures <-> ctypes
# ----------------------------------------------------------------------------------------------
def parse_c_signatures(text: str) -> dict:
    """``{name: (return kind, [arg kinds])}`` of every ``SR_API`` function; kinds: 'int', 'str',
    'ptr' (any pointer), 'int*', 'int64*', 'void**'."""
    out = {}
    for m in re.finditer(r"SR_API\s+([\w\s\*]+?)\s*\b(sr_gemm_\w+)\s*\(([^)]*)\)\s*\{", text):
        ret, name, params = m.group(1), m.group(2), m.group(3)

        def kind(t: str) -> str:
            t = " ".join(t.replace("*", " * ").split())
            stars = t.count("*")
            base = t.replace("*", "").replace("const", "").split()
            base = base[0] if base else ""
            if stars == 0:
                return {"int": "int", "void": "void"}[base]
            if stars == 2:
                return "void**"
            if base == "char":
                return "str"
            if base == "int" and "const" not in t:
                return "int*"
            if base == "int64_t":
                return "int64*"
            return "ptr"

        args = [] if params.strip() in ("", "void") else [
            kind(re.sub(r"\b\w+\s*$", "", p.strip())) for p in params.split(",")]
        out[name] = (kind(ret), args)
    return out


def ctypes_kind(t) -> str:
    if t is ctypes.c_int:
        return "int"
    if t is ctypes.c_char_p:
        return "str"
    if t is ctypes.c_void_p:
        return "ptr"
    if t is ctypes.POINTER(ctypes.c_int):
        return "int*"
    if t is ctypes.POINTER(ctypes.c_int64):
        return "int64*"
    if t is ctypes.POINTER(ctypes.c_void_p):
        return "void**"
    raise AssertionError(f"unexpected ctypes type {t}")


def signature_mismatches(c_sigs: dict, py_sigs: dict) -> list[str]:
    bad = []
    if set(c_sigs) != set(py_sigs):
        bad.append(f"names differ: C {sorted(set(c_sigs) - set(py_sigs))} Python {sorted(set(py_sigs) - set(c_sigs))}")
    for name in set(c_sigs) & set(py_sigs):
        c_ret, c_args = c_sigs[name]
        res, args = py_sigs[name]
        py_args = [ctypes_kind(a) for a in args]
        # an `int*` the C side only reads may be passed as a plain pointer (torch tensors' data_ptr())
        compat = [c == p or (c == "int*" and p == "ptr") for c, p in zip(c_args, py_args)]
        if ctypes_kind(res) != c_ret or len(c_args) != len(py_args) or not all(compat):
            bad.append(f"{name}: C ({c_ret}; {c_args}) vs ctypes ({ctypes_kind(res)}; {py_args})")
    return bad


def test_ctypes_signatures_match_the_c_declarations():
    c_sigs = parse_c_signatures(SRC.read_text())
    assert "sr_gemm_run" in c_sigs and len(c_sigs["sr_gemm_run"][1]) == 19
    assert signature_mismatches(c_sigs, CG.SIGNATURES) == []


def test_signature_check_catches_a_mismatch():
    c_sigs = parse_c_signatures(SRC.read_text())
    broken = dict(CG.SIGNATURES)
    res, args = broken["sr_gemm_run"]
    broken["sr_gemm_run"] = (res, args[:2] + args[3:])  # ready_len forgotten
    assert any("sr_gemm_run" in m for m in signature_mismatches(c_sigs, broken))
    broken = dict(CG.SIGNATURES)
    res, args = broken["sr_gemm_create"]
    broken["sr_gemm_create"] = (res, [ctypes.c_void_p] + args[1:])  # an int passed as a pointer
    assert any("sr_gemm_create" in m for m in signature_mismatches(c_sigs, broken))


def _built_library() -> Path | None:
    try:
        return CG.library_path(build=False)
    except CG.GemmLibraryError:
        return None


def test_library_loads_and_describes_itself():
    path = _built_library()
    if path is None:
        pytest.skip("no library built from this source (python -m streamring.gemm.build --out .gemm-build)")
    lib = CG.load_library()
    info = CG.library_info()
    assert f"source_sha256={BG.source_sha256()}" in info["build_info"] and "cutlass=4.2.0" in info["build_info"]
    v = info["variants"]
    assert v["coop128:bfloat16"]["tile_mnk"] == [128, 128, 128] and v["coop128:bfloat16"]["cluster_mn"] == [1, 2]
    assert v["pingpong64:float32"]["tile_mnk"] == [64, 128, 128] and v["pingpong64:float32"]["cluster_mn"] == [1, 1]
    assert v["coop128:float32"]["out_bytes"] == 4 and v["pingpong64:bfloat16"]["out_bytes"] == 2
    assert v["coop192_m2:bfloat16"]["tile_mnk"] == [128, 192, 128] and v["coop192_m2:bfloat16"]["sf_n"] == 64
    assert all(x["smem_bytes"] > 48 * 1024 and x["stages"] >= 2 for x in v.values())
    assert CG.table_mismatches(v) == []  # Python's TILE_TABLE describes the library's variants
    assert lib.sr_gemm_num_variants() == CG.NUM_VARIANTS
    # argument errors come back as codes with a message (no CUDA call needed)
    arr = (ctypes.c_int * 10)()
    bad = CG.NUM_VARIANTS
    assert lib.sr_gemm_variant_info(bad, arr) != 0 and f"variant {bad}".encode() in lib.sr_gemm_last_error()
    plan = ctypes.c_void_p()
    assert lib.sr_gemm_create(0, 100, 7168, 16, 0, 1, 0, 1, ctypes.byref(plan)) != 0
    assert b"multiples of 128" in lib.sr_gemm_last_error() and not plan.value
    assert lib.sr_gemm_create(0, 128, 7168, 16, 0, 1, 2, 1, ctypes.byref(plan)) != 0
    assert b"raster must be 0" in lib.sr_gemm_last_error()
    assert lib.sr_gemm_create(0, 128, 7168, 16, 0, 1, 0, 3, ctypes.byref(plan)) != 0
    assert b"swizzle must be 1, 2, 4 or 8" in lib.sr_gemm_last_error()
    assert lib.sr_gemm_create(bad, 128, 7168, 16, 0, 1, 0, 1, ctypes.byref(plan)) != 0 or not torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_create_without_a_gpu_reports_the_cuda_error():
    if _built_library() is None:
        pytest.skip("no library built from this source")
    lib = CG.load_library()
    plan = ctypes.c_void_p()
    rc = lib.sr_gemm_create(0, 4096, 7168, 16, 0, 1, 0, 1, ctypes.byref(plan))
    assert rc != 0 and not plan.value
    assert b"cudaGetDeviceCount" in lib.sr_gemm_last_error()


# ----------------------------------------------------------------------------------------------
# argument checks (CPU tensors, require_cuda=False)
# ----------------------------------------------------------------------------------------------
def _cpu_args(n=256, k=384, e=3, nb=5, bm=16):
    return dict(n=n, k=k, out_dtype=torch.bfloat16, capacity=8,
                ready_list=torch.zeros(nb, dtype=torch.int32), ready_hi=torch.zeros(3, dtype=torch.int32),
                lo_index=0, hi_index=1, max_items=4, block_expert=torch.zeros(nb, dtype=torch.int32),
                a=torch.zeros(nb * bm, k, dtype=FP8), a_sf=torch.ones(nb * bm, k // 128),
                w=torch.zeros(e, n, k, dtype=FP8), w_sf=torch.ones(e, n // 128, k // 128),
                d=torch.zeros(nb * bm, n, dtype=torch.bfloat16), block_m=bm, max_ctas=None)


def test_check_run_args_accepts_consistent_tensors():
    rs = CG.check_run_args(**_cpu_args(), require_cuda=False)
    assert (rs.num_blocks, rs.num_experts, rs.rows) == (5, 3, 80)


@pytest.mark.parametrize("change, match", [
    (dict(ready_list=torch.zeros(5, dtype=torch.int64)), "ready_list must be torch.int32"),
    (dict(ready_hi=torch.zeros(3, 1, dtype=torch.int32)), "ready_hi must have 1 dimensions"),
    (dict(hi_index=3), "hi_index=3 outside ready_hi's 3 entries"),
    (dict(max_items=9), r"max_items must be in \[0, capacity=8\]"),
    (dict(block_m=0), "block_m must be positive"),
    (dict(lo_index=1.0), "lo_index must be an int"),
    (dict(block_expert=torch.zeros(0, dtype=torch.int32)), "block_expert is empty"),
    (dict(a=torch.zeros(80, 384, dtype=torch.uint8)), "a must be torch.float8_e4m3fn"),
    (dict(a=torch.zeros(79, 384, dtype=FP8)), r"a must be \[rows >= num_blocks\*block_m = 80, K=384\]"),
    (dict(a_sf=torch.ones(80, 4)), r"a_sf must be \[rows >= 80, K/128=3\]"),
    (dict(w=torch.zeros(3, 128, 384, dtype=FP8)), r"w must be \[E, N=256, K=384\]"),
    (dict(w_sf=torch.ones(3, 2, 2)), r"w_sf must be \[E=3, N/128=2, K/128=3\]"),
    (dict(d=torch.zeros(80, 256, dtype=torch.float32)), "d must be torch.bfloat16"),
    (dict(d=torch.zeros(256, 80, dtype=torch.bfloat16).t()), "d must be contiguous"),
    (dict(max_ctas=0), "max_ctas must be None or a positive int"),
])
def test_check_run_args_names_the_bad_argument(change, match):
    args = _cpu_args()
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        CG.check_run_args(**args, require_cuda=False)


def test_check_run_args_wants_cuda_tensors():
    with pytest.raises(ValueError, match="ready_list must be a CUDA tensor"):
        CG.check_run_args(**_cpu_args())


def test_grouped_gemm_validates_its_configuration():
    with pytest.raises(ValueError, match="tile must be one of"):
        CG.GroupedGemm(256, 256, tile="huge", capacity=4)
    with pytest.raises(ValueError, match="out_dtype"):
        CG.GroupedGemm(256, 256, out_dtype=torch.float16, capacity=4)
    with pytest.raises(ValueError, match="n must be a positive multiple of 128"):
        CG.GroupedGemm(200, 256, capacity=4)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        CG.GroupedGemm(256, 256, capacity=0)
    g = CG.GroupedGemm(256, 384, out_dtype=torch.float32, tile="pingpong64", capacity=4)
    assert g.variant == 3 and g.status() == 0  # nothing created before the first run
    with pytest.raises(ValueError, match="tile 'coop192_m2' has no float32 output"):
        CG.GroupedGemm(256, 256, out_dtype=torch.float32, tile="coop192_m2", capacity=4)
    with pytest.raises(ValueError, match="raster must be one of"):
        CG.GroupedGemm(256, 256, capacity=4, raster="k")
    with pytest.raises(ValueError, match="swizzle must be one of"):
        CG.GroupedGemm(256, 256, capacity=4, swizzle=3)
    g = CG.GroupedGemm(256, 384, tile="coop192_n2", capacity=4, raster="n", swizzle=2)
    assert (g.variant, g.sf_n, g.raster, g.swizzle) == (6, 64, "n", 2)
    g = CG.GroupedGemm(256, 384, tile="pair192", capacity=4)
    assert (g.variant, g.sf_n, g.tile_block_m) == (9, 64, 128) and CG.GroupedGemm(256, 384, capacity=4).tile_block_m is None


def test_check_run_args_block_tiles_want_128_row_blocks_and_room_for_every_block():
    args = _cpu_args()
    args.update(require_cuda=False, tile_block_m=128)
    with pytest.raises(ValueError, match="block_m must be 128 for a one-block-per-tile tile"):
        CG.check_run_args(**args)
    nb = args["block_expert"].numel()
    args.update(block_m=128, a=torch.zeros(nb * 128, args["k"], dtype=FP8),
                a_sf=torch.ones(nb * 128, args["k"] // 128), d=torch.zeros(nb * 128, args["n"], dtype=torch.bfloat16))
    assert CG.check_run_args(**args).rows == nb * 128
    args.update(capacity=nb - 1, max_items=nb - 1)
    with pytest.raises(ValueError, match="more than capacity"):
        CG.check_run_args(**args)


def parse_variant_table(text: str) -> dict:
    """``{variant: (tile M, N, K, cluster M, N, sf_n, out, block_tile)}`` from the ``using V<i> = Config<...>``
    and ``using V<i> = PairConfig<...>`` lines (a PairConfig's cluster: its 4th and 5th arguments, 2x1 when
    left out; its kernel and epilogue schedules are not compared)."""
    tiles = {"CoopTile": (128, 128, 128), "PingTile": (64, 128, 128), "Tile192": (128, 192, 128),
             "PingTile192": (64, 192, 128)}
    clusters = {"ClusterN2": (1, 2), "ClusterM2": (2, 1), "Cluster1": (1, 1)}
    out = {}
    for m in re.finditer(r"using V(\d+) = Config<(\w+), (\w+), \w+, \w+, ([\w:]+)(?:, (\d+))?>;", text):
        v, tile, cl, dt, sfn = m.groups()
        out[int(v)] = (*tiles[tile], *clusters[cl], int(sfn or 128), "f32" if dt == "float" else "bf16", False)
    for m in re.finditer(r"using V(\d+) = PairConfig<(\w+), ([\w:]+)(?:, (\d+))?(?:, (\d))?(?:, (\d))?(?:,\s+[\w:]+)*>;",
                         text):
        v, tile, dt, sfn, cm, cn = m.groups()
        out[int(v)] = (*tiles[tile], int(cm or 2), int(cn or 1), int(sfn or 128), "f32" if dt == "float" else "bf16",
                       True)
    return out


def test_python_variant_table_matches_the_cu():
    table = parse_variant_table(SRC.read_text())
    assert len(table) == CG.NUM_VARIANTS
    py = {}
    for name, t in CG.TILE_TABLE.items():
        for dt, vid in t.variants.items():
            py[vid] = (*t.mnk, *t.cluster, t.sf_n, "f32" if dt == torch.float32 else "bf16", t.block_tile)
    assert py == table
    assert CG.variant_id("coop128", torch.float32) == 1 and CG.variant_id("pingpong192", torch.bfloat16) == 7


def test_weight_scales_for_repeats_each_scale():
    w_sf = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    assert CG.weight_scales_for(w_sf, 128) is w_sf
    r = CG.weight_scales_for(w_sf, 64)
    assert r.shape == (2, 6, 4) and r.is_contiguous()
    assert torch.equal(r[:, 0::2], w_sf) and torch.equal(r[:, 1::2], w_sf)
    with pytest.raises(ValueError, match="sf_n must divide 128"):
        CG.weight_scales_for(w_sf, 96)


def test_check_run_args_wants_repeated_scales_for_64_row_tiles():
    args = _cpu_args()
    with pytest.raises(ValueError, match=r"w_sf must be \[E=3, N/64=4, K/128=3\].*weight_scales_for"):
        CG.check_run_args(**args, require_cuda=False, sf_n=64)
    args["w_sf"] = CG.weight_scales_for(args["w_sf"], 64)
    CG.check_run_args(**args, require_cuda=False, sf_n=64)


# ----------------------------------------------------------------------------------------------
# ready range -> groups (pure-Python reference of the setup kernel)
# ----------------------------------------------------------------------------------------------
def test_ready_groups_merges_runs_of_one_expert():
    be = [1, 1, 0, 2, 2, 2, 2, 2, 3, 3, 3]  # block -> expert
    rl = [3, 4, 5, 8, 9, 10, 2, 0, 1, 6, 7]
    groups, st = RR.ready_groups(rl, [0, 11], 0, 1, 11, be, 16, 4)
    assert st == 0
    assert groups == [(3 * 16, 3 * 16, 2), (3 * 16, 8 * 16, 3), (16, 2 * 16, 0), (2 * 16, 0, 1), (2 * 16, 6 * 16, 2)]
    # consecutive ids of different experts, and descending ids, are not merged
    assert RR.ready_groups([2, 3], [0, 2], 0, 1, 2, [0, 0, 0, 1], 8, 2)[0] == [(8, 16, 0), (8, 24, 1)]
    assert RR.ready_groups([1, 0], [0, 2], 0, 1, 2, [0, 0], 8, 1)[0] == [(8, 8, 0), (8, 0, 0)]
    # a sub-range
    assert RR.ready_groups(rl, [0, 2, 6], 1, 2, 8, be, 16, 4)[0] == [(16, 5 * 16, 2), (3 * 16, 8 * 16, 3)]


def test_ready_groups_status_bits():
    be = [0, 0, 0, 0]
    assert RR.ready_groups([0, 1, 2, 3], [0, 4], 0, 1, 2, be, 4, 1) == ([(8, 0, 0)], 1)  # clamped to 2 items
    assert RR.ready_groups([0, 1], [2, 1], 0, 1, 2, be, 4, 1) == ([], 2)
    assert RR.ready_groups([0, 9, 1], [0, 3], 0, 1, 3, be, 4, 1) == ([(4, 0, 0), (4, 4, 0)], 4)  # breaks the run
    assert RR.ready_groups([0, 1], [0, 2], 0, 1, 2, [0, 5], 4, 1) == ([(4, 0, 0)], 8)
    assert RR.ready_groups([0, 1], [0, 3], 0, 1, 5, be, 4, 1) == ([], 16)
    assert "longer than max_items" in CG.status_text(1) and CG.status_text(0) == "ok"


def test_ready_groups_property():
    hyp = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    @hyp.settings(max_examples=200, deadline=None)
    @hyp.given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.randoms(use_true_random=False),
               st.integers(1, 50))
    def prop(be, rnd, max_items):
        nb = len(be)
        rl = list(range(nb))
        # shuffle whole segments so that some runs stay consecutive
        cuts = sorted(rnd.sample(range(1, nb), min(nb - 1, rnd.randint(0, 6)))) if nb > 1 else []
        segs = [rl[a:b] for a, b in zip([0] + cuts, cuts + [nb])]
        rnd.shuffle(segs)
        rl = [b for s in segs for b in s]
        groups, status = RR.ready_groups(rl, [0, nb], 0, 1, max_items, be, 8, 4)
        n = min(nb, max_items)
        assert status == (1 if nb > max_items else 0)
        # the groups expand to exactly the items, in order, each group one expert's consecutive ids
        flat = []
        for m, row0, e in groups:
            assert m % 8 == 0 and m > 0 and row0 % 8 == 0
            ids = list(range(row0 // 8, row0 // 8 + m // 8))
            assert all(be[b] == e for b in ids)
            flat += ids
        assert flat == rl[:n]
        # maximal: no two neighbouring groups could have been one
        for (m1, r1, e1), (m2, r2, e2) in zip(groups, groups[1:]):
            assert not (e1 == e2 and r1 + m1 == r2)
        assert len(groups) <= max_items

    prop()


# ----------------------------------------------------------------------------------------------
# SwiGLU + FP8 requant over ready blocks (GPU, or Triton's CPU interpreter)
# ----------------------------------------------------------------------------------------------
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def fp8_step(q: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at |q| (quantized units): 2^(floor(log2|q|) - 3), 2^-9 for subnormals."""
    return torch.exp2(torch.floor(torch.log2(q.abs().float().clamp_min(2.0 ** -6))) - 3.0)


@pytest.mark.parametrize("gu_dtype, bm", [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 64)])
def test_swiglu_quant_blocks_matches_the_emulation_on_ready_blocks_only(gu_dtype, bm):
    pytest.importorskip("triton", reason="Triton is not installed")
    from streamring.device import moe_triton as K

    nb, I = 6, 256
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(nb * bm, 2 * I, generator=g) * 3).to(gu_dtype).to(DEV)
    roww = (torch.rand(nb * bm, generator=g) + 0.1).to(DEV)
    ready_list = torch.tensor([4, 1, 2, 0, 5, 3], dtype=torch.int32, device=DEV)
    ready_hi = torch.tensor([1, 4], dtype=torch.int32, device=DEV)  # blocks 1, 2, 0
    h1 = torch.full((nb * bm, I), 0x7F, dtype=torch.uint8, device=DEV).view(FP8)  # NaN poison
    h1sf = torch.full((nb * bm, I // 128), float("nan"), device=DEV)
    h1sfw = torch.full_like(h1sf, float("nan"))
    K.swiglu_quant_blocks(ready_list, ready_hi, 0, 1, 5, gu, h1, h1sf, roww, h1sfw, block_m=bm)
    rows = torch.cat([torch.arange(b * bm, (b + 1) * bm) for b in (1, 2, 0)]).to(DEV)
    other = torch.cat([torch.arange(b * bm, (b + 1) * bm) for b in (3, 4, 5)]).to(DEV)
    # untouched rows keep the poison
    assert bool((h1.view(torch.uint8)[other] == 0x7F).all()) and bool(h1sf[other].isnan().all())
    assert bool(h1sfw[other].isnan().all())
    # emulation: silu(g) * u in float32, per-row 128-column scale amax/448, e4m3 rounding
    x = gu[rows].float()
    h = torch.nn.functional.silu(x[:, :I]) * x[:, I:]
    s = h.view(-1, I // 128, 128).abs().amax(dim=2).clamp_min(1e-12) / 448.0
    torch.testing.assert_close(h1sf[rows], s, rtol=2e-6, atol=0)
    q = h1[rows].float()
    q_ref = (h.view(-1, I // 128, 128) / s[:, :, None]).clamp(-448, 448).view(-1, I)
    assert bool(((q - q_ref).abs() <= fp8_step(q_ref) * 0.5 + 1e-6 * q_ref.abs() + 1e-12).all())
    # routing weight folded into L2's scales: exactly the kernel's own scale times the weight
    assert torch.equal(h1sfw[rows], h1sf[rows] * roww[rows][:, None])


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
def _sm90_library_reason() -> str | None:
    """On top of the suite's GPU check (gpu_skip): the GPU the library is built for, and the library."""
    if torch.cuda.get_device_capability() != (9, 0):
        return f"the library is built for sm_90a, this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    try:
        CG.load_library()
    except CG.GemmLibraryError as exc:
        return f"CUTLASS GEMM library unavailable: {str(exc)[:300]}"
    return None


needs_gpu = gpu_skip.needs_gpu(extra=_sm90_library_reason)

VARIANTS = [(tile, dt) for tile, t in CG.TILE_TABLE.items() for dt in t.variants]
NEW_TILES = ["coop128_m2", "coop192_m2", "coop192_n2", "pingpong192"]  # issue 21's (bf16 only)
BLOCK_TILES = list(CG.BLOCK_TILES)


class Problem:
    """Random FP8 operands (random block scales too) for ``nb`` blocks of ``bm`` rows and ``e`` experts."""

    def __init__(self, n=256, k=384, e=5, nb=24, bm=64, seed=0, out_dtype=torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.n, self.k, self.e, self.nb, self.bm = n, k, e, nb, bm
        rows = nb * bm
        self.a = torch.randn(rows, k, generator=g, device="cuda").clamp(-440, 440).to(FP8)
        self.a_sf = torch.exp2(torch.randint(-4, 4, (rows, k // 128), generator=g, device="cuda").float()) * (
            1 + torch.rand(rows, k // 128, generator=g, device="cuda"))
        self.w = (torch.randn(e, n, k, generator=g, device="cuda") * 4).clamp(-440, 440).to(FP8)
        self.w_sf = torch.exp2(torch.randint(-6, -2, (e, n // 128, k // 128), generator=g, device="cuda").float()) * (
            1 + torch.rand(e, n // 128, k // 128, generator=g, device="cuda"))
        # runs: blocks of one expert mostly consecutive, as the allocator hands them out
        be = torch.sort(torch.randint(0, e, (nb,), generator=g, device="cuda")).values.to(torch.int32)
        self.block_expert = be.contiguous()
        self.out_dtype = out_dtype
        self.d = self.poisoned()

    def poisoned(self):
        return torch.full((self.nb * self.bm, self.n), float("nan"), dtype=self.out_dtype, device="cuda")

    def ready(self, ids):
        return torch.tensor(ids, dtype=torch.int32, device="cuda")

    def reference(self, blocks, w_sf=None):
        """float64 ``(rows of blocks) @ W[e]^T`` and ``sum_k |a_k w_k|`` (for the tolerance)."""
        w_sf = self.w_sf if w_sf is None else w_sf
        outs, absums = [], []
        for b in blocks:
            r = slice(b * self.bm, (b + 1) * self.bm)
            e = int(self.block_expert[b])
            a = (self.a[r].double().view(self.bm, -1, 128) * self.a_sf[r].double()[:, :, None]).view(self.bm, -1)
            w = (self.w[e].double().view(self.n // 128, 128, self.k // 128, 128)
                 * w_sf[e].double()[:, None, :, None]).reshape(self.n, self.k)
            outs.append(a @ w.t())
            absums.append(a.abs() @ w.abs().t())
        return torch.cat(outs), torch.cat(absums)


def within_tolerance(got, ref, absum, out_dtype) -> torch.Tensor:
    """Elementwise: ``|got - ref| <= 2^-9 * sum|a w| + output rounding`` (NaN is outside)."""
    rnd = 2.0 ** -8 if out_dtype == torch.bfloat16 else 0.0
    return (got.double() - ref).abs() <= 2.0 ** -9 * absum + rnd * ref.abs() + 1e-300


def run(plan, p, ready_ids, lo=0, hi=1, ready_hi=None, max_items=None, d=None, max_ctas=None):
    rl = p.ready(ready_ids) if not isinstance(ready_ids, torch.Tensor) else ready_ids
    rh = p.ready([0, len(ready_ids)]) if ready_hi is None else ready_hi
    d = p.d if d is None else d
    plan.run(rl, rh, lo, hi, plan.capacity if max_items is None else max_items, p.block_expert, p.a, p.a_sf, p.w,
             CG.weight_scales_for(p.w_sf, plan.sf_n), d, block_m=p.bm, max_ctas=max_ctas)
    return d


def rows_of(blocks, bm):
    return torch.cat([torch.arange(b * bm, (b + 1) * bm) for b in blocks]).cuda()


@needs_gpu
@pytest.mark.parametrize("tile, out_dtype", VARIANTS)
@pytest.mark.parametrize("bm", [64, 16, 128])
def test_matches_float64_reference_only_ready_rows_written(tile, out_dtype, bm):
    if CG.TILE_TABLE[tile].block_tile and bm != 128:
        pytest.skip("a one-block-per-tile tile takes 128-row blocks only")
    p = Problem(bm=bm, nb=40 if bm == 16 else 24, out_dtype=out_dtype, seed=bm)
    plan = CG.GroupedGemm(p.n, p.k, out_dtype=out_dtype, tile=tile, capacity=64, trap_on_error=False)
    ids = list(range(p.nb))
    ready = [ids[i] for i in (list(range(3, 11)) + [0, 1] + list(range(14, p.nb - 3)))]  # runs, a gap, a tail left out
    run(plan, p, ready, max_items=len(ready) + 9)  # groups past the last have M = 0
    plan.check()
    ref, absum = p.reference(ready)
    got = p.d[rows_of(ready, p.bm)]
    ok = within_tolerance(got, ref, absum, out_dtype)
    assert bool(ok.all()), f"{int((~ok).sum())} elements outside the tolerance; worst " \
                           f"{float(((got.double() - ref).abs() / (2.0 ** -9 * absum)).max())}"
    # rows of blocks not in the range keep the poison
    rest = sorted(set(ids) - set(ready))
    assert bool(p.d[rows_of(rest, p.bm)].isnan().all())


@needs_gpu
def test_tolerance_catches_one_wrong_scale_block():
    p = Problem(out_dtype=torch.float32)
    plan = CG.GroupedGemm(p.n, p.k, out_dtype=torch.float32, capacity=32)
    ready = list(range(p.nb))
    run(plan, p, ready)
    bad_sf = p.w_sf.clone()
    e = int(p.block_expert[0])
    bad_sf[e, 1, 2] *= 1.1  # one 128x128 block of one expert 10 % off
    ref, absum = p.reference(ready, w_sf=bad_sf)
    ok = within_tolerance(p.d[rows_of(ready, p.bm)], ref, absum, torch.float32)
    affected = (p.block_expert[torch.arange(p.nb, device="cuda")] == e).repeat_interleave(p.bm)
    assert not bool(ok[affected][:, 128:256].all())  # caught
    assert bool(ok[~affected].all())


@needs_gpu
@pytest.mark.parametrize("tile", ["coop128", "pingpong64", "coop192_m2"])
def test_device_groups_match_the_reference(tile):
    p = Problem(bm=16, nb=30, seed=4)
    plan = CG.GroupedGemm(p.n, p.k, tile=tile, capacity=40, trap_on_error=False)
    ready = [5, 6, 7, 8, 0, 1, 2, 20, 21, 9, 29, 28]
    rh = p.ready([0, 2, 2 + len(ready)])
    rl = p.ready([13, 14] + ready)
    w_sf = CG.weight_scales_for(p.w_sf, plan.sf_n)
    plan.setup_only(rl, rh, 1, 2, 20, p.block_expert, p.a, p.a_sf, p.w, w_sf, p.d, block_m=p.bm)
    got = plan.read_groups(20)
    groups, status = RR.ready_groups(rl.cpu(), rh.cpu(), 1, 2, 20, p.block_expert.cpu(), p.bm, p.e)
    assert status == 0 and plan.status() == 0
    assert got["m"][:len(groups)] == [m for m, _, _ in groups] and set(got["m"][len(groups):]) == {0}
    for g, (m, row0, e) in enumerate(groups):
        assert got["a"][g] == p.a.data_ptr() + row0 * p.k
        assert got["sfa"][g] == p.a_sf.data_ptr() + row0 * (p.k // 128) * 4
        assert got["b"][g] == p.w.data_ptr() + e * p.n * p.k
        assert got["sfb"][g] == w_sf.data_ptr() + e * (p.n // plan.sf_n) * (p.k // 128) * 4
        assert got["d"][g] == p.d.data_ptr() + row0 * p.n * p.d.element_size()


@needs_gpu
@pytest.mark.parametrize("tile", ["coop128", "pingpong64", *NEW_TILES])
def test_a_block_alone_equals_the_block_inside_a_long_run_bitwise(tile):
    p = Problem(bm=64, nb=12, e=1, seed=9)  # one expert: all 12 blocks merge into one group
    plan = CG.GroupedGemm(p.n, p.k, tile=tile, capacity=16)
    whole = run(plan, p, list(range(12)), d=p.poisoned())
    for b in (0, 1, 5, 11):  # tile-row offsets 0, 64, 64 (3rd tile), 64 (6th tile) inside the run
        alone = run(plan, p, [b], d=p.poisoned())
        r = slice(b * p.bm, (b + 1) * p.bm)
        assert torch.equal(alone[r], whole[r]), f"block {b}"
    # two-block runs starting at odd blocks (another offset of every row)
    pair = run(plan, p, [3, 4], d=p.poisoned())
    assert torch.equal(pair[3 * 64:5 * 64], whole[3 * 64:5 * 64])


@needs_gpu
@pytest.mark.parametrize("tile", ["coop128", "pingpong64", *NEW_TILES])
def test_ragged_ranges_piecewise_equal_at_once(tile):
    p = Problem(bm=16, nb=40, seed=11)
    plan = CG.GroupedGemm(p.n, p.k, tile=tile, capacity=48)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(2)).tolist()
    order[5:15] = sorted(order[5:15])
    rl = p.ready(order)
    at_once = run(plan, p, rl, ready_hi=p.ready([0, 40]), d=p.poisoned())
    cuts = p.ready([0, 3, 3, 17, 18, 40])  # an empty range, a one-block range, uneven others
    piece = p.poisoned()
    for j in range(5):
        run(plan, p, rl, lo=j, hi=j + 1, ready_hi=cuts, max_items=40, d=piece)
    assert torch.equal(piece, at_once)
    # an empty range writes nothing
    empty = run(plan, p, rl, lo=1, hi=2, ready_hi=cuts, d=p.poisoned())
    assert bool(empty.isnan().all())


@needs_gpu
@pytest.mark.parametrize("tile", ["coop128", "coop192_m2"])
def test_capped_persistent_grid_equals_the_full_grid(tile):
    p = Problem(bm=64, nb=20, seed=13)
    plan = CG.GroupedGemm(p.n, p.k, capacity=24, tile=tile)
    full = run(plan, p, list(range(20)), d=p.poisoned())
    for ctas in (1, 3, 16):
        capped = run(plan, p, list(range(20)), d=p.poisoned(), max_ctas=ctas)
        assert torch.equal(capped, full), ctas


@needs_gpu
@pytest.mark.parametrize("tile", ["coop128", "coop192_m2", "pingpong64", "block128_n2", "pair128"])
def test_grid_in_waves_equals_the_one_wave_grid(tile):
    """max_ctas above the SMs (a grid that runs in waves, each CTA a share of the tiles; past
    MAX_CTAS_PER_SM per SM capped) computes every tile and the same bits as one CTA per SM."""
    bm = 128 if CG.TILE_TABLE[tile].block_tile else 64
    p = Problem(bm=bm, nb=40, seed=29)
    plan = CG.GroupedGemm(p.n, p.k, capacity=48, tile=tile)
    ids = list(range(40))
    full = run(plan, p, ids, d=p.poisoned())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ctas in (sms + 2, 4 * sms, CG.MAX_CTAS_PER_SM * sms, 10 ** 6):
        got = run(plan, p, ids, d=p.poisoned(), max_ctas=ctas)
        assert torch.equal(got, full), ctas
    plan.check()


@needs_gpu
@pytest.mark.parametrize("tile", ["coop128", "coop192_m2", "pingpong64"])
def test_raster_and_swizzle_do_not_change_a_bit(tile):
    p = Problem(bm=64, nb=20, seed=21, n=384)
    ref = run(CG.GroupedGemm(p.n, p.k, capacity=24, tile=tile), p, list(range(20)), d=p.poisoned())
    for raster, swizzle in (("n", 1), ("m", 2), ("n", 4)):
        got = run(CG.GroupedGemm(p.n, p.k, capacity=24, tile=tile, raster=raster, swizzle=swizzle), p,
                  list(range(20)), d=p.poisoned())
        assert torch.equal(got, ref), (raster, swizzle)


@needs_gpu
@pytest.mark.parametrize("bm, tiles", [(64, NEW_TILES), (128, BLOCK_TILES)])
def test_new_tiles_agree_with_coop128_to_rounding(bm, tiles):
    """Every tile computes the same products; only the accumulation's rounding may differ (bf16 out)."""
    p = Problem(bm=bm, nb=16, seed=23, n=384, k=512)
    ids = list(range(16))
    ref = run(CG.GroupedGemm(p.n, p.k, capacity=16, out_dtype=torch.float32), p, ids,
              d=torch.full((p.nb * p.bm, p.n), float("nan"), device="cuda"))
    for tile in tiles:
        got = run(CG.GroupedGemm(p.n, p.k, capacity=16, tile=tile), p, ids, d=p.poisoned())
        rel = float((got.float() - ref).norm() / ref.norm())
        assert rel < 2.0 ** -8, (tile, rel)


@needs_gpu
@pytest.mark.parametrize("tile", ["coop128", "pingpong64", "coop192_m2", "pair128"])
def test_cuda_graph_replay_follows_the_device_ready_list(tile):
    p = Problem(bm=128 if CG.TILE_TABLE[tile].block_tile else 64, nb=16, seed=17)
    plan = CG.GroupedGemm(p.n, p.k, tile=tile, capacity=16)
    rl = p.ready(list(range(16)))
    rh = p.ready([0, 4])
    d = p.poisoned()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(plan, p, rl, ready_hi=rh, max_items=16, d=d)  # eager first (builds the kernel parameters)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(plan, p, rl, ready_hi=rh, max_items=16, d=d)
    for ids, n in (([9, 10, 11, 2], 4), ([0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13], 11)):
        d.fill_(float("nan"))
        rl[:len(ids)] = p.ready(ids)
        rh[1] = n
        g.replay()
        torch.cuda.synchronize()
        eager = run(plan, p, rl, ready_hi=rh, max_items=16, d=p.poisoned())
        assert torch.equal(d.isnan(), eager.isnan()) and torch.equal(torch.nan_to_num(d), torch.nan_to_num(eager))
        assert not bool(d[rows_of(ids, p.bm)].isnan().any())


@needs_gpu
def test_status_word_reports_bad_ranges():
    p = Problem(bm=16, nb=10, seed=19)
    plan = CG.GroupedGemm(p.n, p.k, capacity=10, trap_on_error=False)
    run(plan, p, list(range(10)), max_items=4)  # 10 ready, room for 4
    assert plan.status() == 1
    with pytest.raises(CG.GemmLibraryError, match="longer than max_items"):
        plan.check()
    assert bool(p.d[:64].isnan().logical_not().all()) and bool(p.d[64:].isnan().all())
    plan.reset_status()
    run(plan, p, [0, 1, 57, 3], d=p.poisoned())
    assert plan.status() == 4
    plan.reset_status()
    run(plan, p, [0, 1], ready_hi=p.ready([2, 1]), d=p.poisoned())
    assert plan.status() == 2


# ----------------------------------------------------------------------------------------------
# one-block tiles (one 128-row block per tile; pair tiles: two per 2x1 cluster, the weight tile
# multicast per tile; block128: one per CTA)
# ----------------------------------------------------------------------------------------------
def _pair_problem(seed, nb=21, e=4):
    """128-row blocks whose experts come in runs of 1 to 4 blocks: consecutive ready pairs are of one
    expert (multicast) or of two (each CTA loads its own weight tile)."""
    return Problem(bm=128, nb=nb, e=e, seed=seed)


@needs_gpu
@pytest.mark.parametrize("tile", BLOCK_TILES)
def test_pair_tile_ranges_piecewise_equal_at_once_and_match_float64(tile):
    p = _pair_problem(31)
    plan = CG.GroupedGemm(p.n, p.k, tile=tile, capacity=p.nb, trap_on_error=False)
    order = list(range(p.nb))
    order[3:9] = [8, 3, 5, 4, 7, 6]  # pairs straddle experts differently than in block order
    rl = p.ready(order[:19])  # odd: the last cluster has one item; blocks 19 and 20 not ready
    at_once = run(plan, p, rl, ready_hi=p.ready([0, 19]), max_items=p.nb, d=p.poisoned())
    plan.check()
    ref, absum = p.reference(order[:19])
    got = at_once[rows_of(order[:19], p.bm)]
    ok = within_tolerance(got, ref, absum, torch.bfloat16)
    assert bool(ok.all()), int((~ok).sum())
    assert bool(at_once[rows_of([19, 20], p.bm)].isnan().all())
    # chunks of 0, 1, 2, 3 and 13 items: every block's pair (and multicast) differs, its bits do not
    cuts = p.ready([0, 0, 1, 3, 6, 19])
    piece = p.poisoned()
    for j in range(5):
        run(plan, p, rl, lo=j, hi=j + 1, ready_hi=cuts, max_items=p.nb, d=piece)
    plan.check()
    assert torch.equal(piece.isnan(), at_once.isnan())
    assert torch.equal(torch.nan_to_num(piece), torch.nan_to_num(at_once))


@needs_gpu
@pytest.mark.parametrize("tile", BLOCK_TILES)
def test_pair_tile_order_and_grid_do_not_change_a_bit(tile):
    p = _pair_problem(37, nb=30, e=3)
    ids = list(range(p.nb))
    ref = run(CG.GroupedGemm(p.n, p.k, capacity=p.nb, tile=tile), p, ids, d=p.poisoned())
    for raster, swizzle, ctas in (("n", 1, None), ("m", 2, None), ("m", 8, None), ("m", 1, 2), ("n", 4, 6)):
        got = run(CG.GroupedGemm(p.n, p.k, capacity=p.nb, tile=tile, raster=raster, swizzle=swizzle), p, ids,
                  d=p.poisoned(), max_ctas=ctas)
        assert torch.equal(got, ref), (raster, swizzle, ctas)


@needs_gpu
def test_pair_tile_refuses_a_block_twice_with_two_partners():
    p = _pair_problem(47, nb=12, e=4)
    be = p.block_expert.tolist()
    a = next(b for b in range(1, 12) if be[b] != be[1])  # block 0 paired once with 1, once with a
    assert be[a] != be[1]
    plan = CG.GroupedGemm(p.n, p.k, tile="pair128", capacity=12, trap_on_error=False)
    d = run(plan, p, [0, 1, a, 0], d=p.poisoned())
    assert plan.status() == 64
    with pytest.raises(CG.GemmLibraryError, match="a block id appears twice"):
        plan.check()
    assert bool(d.isnan().all())  # nothing computed
    plan.reset_status()
    run(plan, p, [0, 1, 0, 1], d=p.poisoned())  # twice, same partner each time: consistent, computed
    assert plan.status() == 0
    # one block per CTA (no cluster decision to agree on): the same range is computed
    single = CG.GroupedGemm(p.n, p.k, tile="block128", capacity=12, trap_on_error=False)
    d = run(single, p, [0, 1, a, 0], d=p.poisoned())
    assert single.status() == 0 and not bool(d[rows_of([0, 1, a], p.bm)].isnan().any())


# ----------------------------------------------------------------------------------------------
# the block consumer on the CUTLASS path
# ----------------------------------------------------------------------------------------------
def _moe_setup(dev="cuda"):
    from streamring.moe import blocks as B
    from streamring.moe.weights import MoEWeights
    from streamring.moe.math import MoEShape

    shape = MoEShape(hidden=256, intermediate=256, num_experts=8, topk=2, router="deepseek_v3", n_group=4,
                     topk_group=2, routed_scaling_factor=2.5, weight_dtype="fp8")
    fw = MoEWeights.random_fp8(shape, 3, dev).fp8_blocks()
    g = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(97, shape.hidden, generator=g).to(torch.bfloat16).to(dev)
    return B, shape, fw, x


@needs_gpu
@pytest.mark.parametrize("l1_dtype", [torch.float32, torch.bfloat16])
def test_consumer_cutlass_matches_triton(l1_dtype):
    B, shape, fw, x = _moe_setup()
    T = x.shape[0]
    outs, h1s = {}, {}
    for impl in ("triton", "cutlass"):
        prod = B.Producer(T, shape.num_experts, "cuda")
        sc = block_paths.scratch_buffers(shape, T, "cuda")
        prod.route(x, fw, shape, sc["idx"], sc["w"])
        prod.layout(x, sc["q"], sc["sf"])
        bc = B.BlockConsumer(shape, T, 1, 64, "cuda")
        if impl == "cutlass":
            bc.experts("cutlass", l1_out_dtype=l1_dtype, trap_on_error=False)
        out = torch.zeros_like(x)
        B.moe_forward(sc["idx"], sc["w"], sc["q"], sc["sf"], fw, bc, out, gemm_impl=impl)
        if impl == "cutlass":
            bc.experts("cutlass").check()
        outs[impl] = out.float()
        real = bc.tok_row.view(-1)
        h1s[impl] = (bc.h1.view(FP8)[real].float().view(real.numel(), -1, 128) * bc.h1_sf[real][:, :, None]).flatten(1)
    # fp32 L1 output: the two paths' accumulators differ in the last bits, an e4m3 rounding of h
    # flips very rarely; bf16: g and u are rounded to 2^-9 first, which flips ~5 % of the h
    # values by one e4m3 step (2^-3..2^-4 relative): ~2 % relative error
    limit = 5e-3 if l1_dtype == torch.float32 else 4e-2
    ht, hc = h1s["triton"], h1s["cutlass"]
    rel_h = float((hc - ht).norm() / ht.norm())
    assert rel_h < limit, rel_h
    rel = float((outs["cutlass"] - outs["triton"]).norm() / outs["triton"].norm())
    assert rel < limit, rel


@needs_gpu
@pytest.mark.parametrize("chunk, tiles, bm", [(13, ("coop128", "coop128"), 16), (40, ("coop128", "coop128"), 16),
                                              (13, ("coop192_m2", "pingpong192"), 16),
                                              (40, ("coop128_m2", "coop192_n2"), 16),
                                              (13, ("pair128", "block128"), 128), (40, ("block128_n2", "pair128_n2"), 128),
                                              (27, ("block64pp", "block64pp"), 128)])
def test_consumer_cutlass_streamed_equals_batch_bitwise(chunk, tiles, bm):
    B, shape, fw, x = _moe_setup()
    T = x.shape[0]
    ys = []
    for streamed in (False, True):
        prod = B.Producer(T, shape.num_experts, "cuda")
        sc = block_paths.scratch_buffers(shape, T, "cuda")
        bc = B.BlockConsumer(shape, T, -(-T // chunk) + 1, bm, "cuda")
        l1_dtype = torch.float32 if tiles[0] == "coop128" else torch.bfloat16
        bc.experts("cutlass", trap_on_error=False, tile_l1=tiles[0], tile_l2=tiles[1], l1_out_dtype=l1_dtype)
        y = torch.zeros_like(x)
        if streamed:
            block_paths.streamed_forward_serial(x, fw, shape, prod, bc, sc, chunk, y, gemm_impl="cutlass")
        else:  # the batch path: produce everything, one dispatch + seal, one GEMM pass
            prod.route(x, fw, shape, sc["idx"], sc["w"])
            prod.layout(x, sc["q"], sc["sf"])
            B.moe_forward(sc["idx"], sc["w"], sc["q"], sc["sf"], fw, bc, y, gemm_impl="cutlass")
        bc.experts("cutlass").check()
        ys.append(y)
    assert torch.equal(ys[0], ys[1])


def test_compute_cutlass_refuses_unknown_impls():
    pytest.importorskip("triton", reason="Triton is not installed")
    B, shape, fw, x = _moe_setup(DEV)
    bc = B.BlockConsumer(shape, 4, 1, 64, DEV)
    with pytest.raises(ValueError, match=r"gemm implementation must be one of \('triton', 'cutlass', 'deep_gemm'\), "
                                         r"got 'cublas'"):
        bc.compute(0, 1, 1, fw, impl="cublas")


def test_run_parts_prints_a_line_per_compile_unit(tmp_path):
    """gemm.build compiles its parts at once; each unit's line (with the seconds since the build began)
    is printed as it finishes, and a failed unit's command and output come back in the BuildError.
    Real nvcc on two small translation units (no GPU needed)."""
    try:
        nvcc = find_nvcc()
    except BuildError as exc:
        pytest.skip(f"no nvcc: {exc}")
    good = tmp_path / "good.cu"
    good.write_text("__global__ void k(int *p) { p[threadIdx.x] = 1; }\n")
    bad = tmp_path / "bad.cu"
    bad.write_text("__global__ void k(int *p) { p[threadIdx.x] = undeclared_name; }\n")
    lines = []
    cmds = [[nvcc, "-c", str(good), "-o", str(tmp_path / f"{i}.o")] for i in range(2)]
    BG.run_parts(cmds, lines.append, what="good.cu")
    assert len(lines) == 2, lines
    for n, line in enumerate(lines, 1):
        assert re.fullmatch(rf"compile unit {n}/2 \(part [01] of good\.cu\) compiled after \d+ s", line), line
    assert sorted(int(re.search(r"part (\d)", x).group(1)) for x in lines) == [0, 1]
    lines.clear()
    with pytest.raises(BuildError, match=r"(?s)nvcc failed .*bad\.cu.*undeclared_name"):
        BG.run_parts([cmds[0], [nvcc, "-c", str(bad), "-o", str(tmp_path / "bad.o")]], lines.append, what="x.cu")
    assert len(lines) == 2 and sum("FAILED" in x for x in lines) == 1, lines
