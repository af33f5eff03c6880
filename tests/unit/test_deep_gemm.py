"""DeepGEMM as the block consumer's expert GEMMs (``gemm_impl="deep_gemm"``): gemm/deep_gemm.py,
gemm/deep_gemm_triton.py, gemm/deep_gemm.py, gemm/build_deep_gemm.py.

Runs anywhere (CPU):
* ``ready_m_indices`` (torch, what the GPU runs) against a pure-Python reference: hand cases, every
  status bit, a property test; its output is the expert on exactly the rows of the range's blocks;
* ``copy_ready_rows`` under Triton's CPU interpreter: only the ready blocks' rows change;
* the refusals: ``block_m`` other than 128 (naming the field and the allowed value), ``max_ctas``;
  ``deep_gemm_available()`` says why not here and builds nothing;
* the offline build recipe: the carried tarballs (``.deepgemm/``, if packed here) unpack into the
  tree DeepGEMM's build and JIT expect, and the compile command has setup.py's flags and folders.

Needs an sm_90 GPU and ``import deep_gemm`` (skipped otherwise, with the reason):
* what the module doc says DeepGEMM does with -1 rows (zeros stored, computed rows exact) and that
  its output matches a float64 reference of the dequantized operands;
* the consumer with ``gemm_impl="deep_gemm"`` against Triton, and streamed == batch bitwise.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from streamring.gemm import build_deep_gemm as BDG  # noqa: E402
from streamring.gemm import deep_gemm as DG  # noqa: E402
import ready_range_reference as RR  # noqa: E402
from bench import block_paths  # noqa: E402

FP8 = torch.float8_e4m3fn
REPO = Path(__file__).resolve().parents[2]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------
# m_indices of a ready range
# ----------------------------------------------------------------------------------------------
def _m_indices(rl, rh, lo, hi, max_items, be, e, bm):
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    status = torch.zeros(1, dtype=torch.int32)
    out = DG.ready_m_indices(t(rl), t(rh), lo, hi, max_items, t(be), e, bm, status=status)
    return out.tolist(), int(status)


def test_m_indices_mark_exactly_the_ready_blocks():
    be = [1, 1, 0, 2, 2, 0]
    got, st = _m_indices([4, 3, 0, 5, 1, 2], [1, 4], 0, 1, 6, be, 3, 2)  # blocks 3, 0, 5
    assert st == 0
    assert got == [1, 1, -1, -1, -1, -1, 2, 2, -1, -1, 0, 0]
    assert (got, st) == RR.m_indices([4, 3, 0, 5, 1, 2], [1, 4], 0, 1, 6, be, 3, 2)


@pytest.mark.parametrize("rl, rh, max_items, be, bit", [
    ([0, 1, 2, 3], [0, 4], 2, [0, 0, 0, 0], 1),   # longer than max_items: the first 2 only
    ([0, 1], [2, 1], 2, [0, 0], 2),               # negative
    ([0, 9, 1], [0, 3], 3, [0, 0], 4),            # a block id out of range: skipped
    ([0, 1], [0, 2], 2, [0, 5], 8),               # an expert out of range: skipped
    ([0, 1], [0, 3], 5, [0, 0], 16),              # the range runs past the list
])
def test_m_indices_status_bits_match_the_reference(rl, rh, max_items, be, bit):
    got, st = _m_indices(rl, rh, 0, 1, max_items, be, 2, 4)
    ref, ref_st = RR.m_indices(rl, rh, 0, 1, max_items, be, 2, 4)
    assert st == ref_st == bit and got == ref
    assert "ok" != DG.status_text(bit)


def test_m_indices_property():
    rnd = random.Random(7)
    for _ in range(300):
        nb = rnd.randint(1, 12)
        e = rnd.randint(1, 4)
        be = [rnd.randint(-1, e) for _ in range(nb)]  # some experts out of range on purpose
        n_list = rnd.randint(0, 14)
        rl = [rnd.randint(-1, nb) for _ in range(n_list)]
        rh = [rnd.randint(-2, n_list + 1) for _ in range(3)]
        lo, hi = rnd.randint(0, 2), rnd.randint(0, 2)
        max_items = rnd.randint(0, 10)
        bm = rnd.choice([1, 2, 4])
        assert _m_indices(rl, rh, lo, hi, max_items, be, e, bm) == \
            RR.m_indices(rl, rh, lo, hi, max_items, be, e, bm)


def test_m_indices_out_buffer_is_checked():
    t = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="out must be a contiguous int32 tensor of num_blocks\\*block_m = 8"):
        DG.ready_m_indices(t, torch.tensor([0, 0], dtype=torch.int32), 0, 1, 1, t[:2], 1, 4,
                           out=torch.zeros(7, dtype=torch.int32))


def test_mn_major_scales_have_the_layout_deep_gemm_passes_through():
    s = DG.mn_major_scales(256, 56, "cpu")
    # DeepGEMM's get_mn_major_tma_aligned_tensor returns a 2-D float tensor as is when
    # stride(0) == 1 and stride(1) == align(rows, 4)
    assert s.shape == (256, 56) and s.stride() == (1, 256) and s.dtype == torch.float32
    src = torch.randn(256, 56)
    s.copy_(src)
    assert torch.equal(s, src)
    with pytest.raises(ValueError, match="multiple of 4"):
        DG.mn_major_scales(10, 4, "cpu")


# ----------------------------------------------------------------------------------------------
# the psum layout of one allocation (what DeepGEMM's psum scheduler walks)
# ----------------------------------------------------------------------------------------------
def _psum_consumer(chunks, num_experts=4, block_m=16, seed=0):
    """A real BlockConsumer after len(chunks) dispatches (``chunks``: tokens per dispatch, top-2 routes
    drawn with ``seed``) and the seal (Triton's CPU interpreter without a GPU)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from streamring.moe import blocks as B
    from streamring.moe.math import MoEShape

    shape = MoEShape(hidden=128, intermediate=128, num_experts=num_experts, topk=2, weight_dtype="fp8")
    T = sum(chunks)
    bc = B.BlockConsumer(shape, T, len(chunks) + 1, block_m, DEV)
    g = torch.Generator().manual_seed(seed)
    bc.begin()
    base = 0
    for c, n in enumerate(chunks):
        idx = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(n)]).to(DEV)
        w = torch.rand(n, 2, generator=g).to(DEV)
        q = torch.zeros(n, 128, dtype=FP8, device=DEV)
        sf = torch.ones(n, 1, device=DEV)
        bc.dispatch(c, idx, w, q, sf, base)
        base += n
    bc.seal(len(chunks))
    return bc, shape


def _rows_psum_walks(psum, bm):
    """expert -> the rows DeepGEMM's psum scheduler gives it: ``[align(psum[e-1], bm), psum[e])``."""
    rows, last = {}, 0
    for e, end in enumerate(psum):
        start = -(-last // bm) * bm
        rows[e] = list(range(start, end)) if end > start else []
        last = end
    return rows


def _rows_of_experts(bc, num_experts, bm):
    """expert -> the rows its routes were placed in (the block table, in fill order)."""
    fill = bc.state[:num_experts].tolist()
    eb = bc.expert_blocks.tolist()
    return {e: [eb[e][p // bm] * bm + p % bm for p in range(fill[e])] for e in range(num_experts)}


@pytest.mark.parametrize("tokens, seed", [(1, 0), (9, 1), (40, 2), (64, 3)])
def test_psum_layout_of_one_allocation_walks_exactly_each_experts_rows(tokens, seed):
    bc, shape = _psum_consumer([tokens], seed=seed)
    assert bc.covers_one_allocation(0, 2) and not bc.covers_one_allocation(1, 2)
    status = torch.zeros(1, dtype=torch.int32, device=DEV)
    psum = DG.psum_layout(bc.state, bc.expert_blocks, bc.ready_hi, 0, 2, shape.num_experts, 16, status=status)
    assert int(status) == 0
    assert _rows_psum_walks(psum.tolist(), 16) == _rows_of_experts(bc, shape.num_experts, 16)


def test_psum_layout_refuses_blocks_of_two_allocations_and_partial_ranges():
    # 3 dispatches: later chunks hand out blocks after earlier ones, so an expert's blocks are not
    # contiguous in expert order (seed chosen so that they are not) - bit 32 and an all-zero psum
    bc, shape = _psum_consumer([20, 20, 20], seed=4)
    assert not bc.covers_one_allocation(0, 4)
    status = torch.zeros(1, dtype=torch.int32, device=DEV)
    psum = DG.psum_layout(bc.state, bc.expert_blocks, bc.ready_hi, 0, 4, shape.num_experts, 16, status=status)
    assert int(status) == 32 and psum.tolist() == [0] * shape.num_experts
    assert "not laid out expert by expert" in DG.status_text(32)
    # one allocation, but a range that leaves the seal's blocks out
    bc, shape = _psum_consumer([40], seed=2)
    status.zero_()
    DG.psum_layout(bc.state, bc.expert_blocks, bc.ready_hi, 0, 1, shape.num_experts, 16, status=status)
    assert int(status) == 32
    with pytest.raises(ValueError, match="num_experts = 4"):
        DG.psum_layout(bc.state, bc.expert_blocks, bc.ready_hi, 0, 2, 4, 16, out=torch.zeros(3, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# copy of the ready rows (Triton; the CPU interpreter without a GPU)
# ----------------------------------------------------------------------------------------------
def test_copy_ready_rows_touches_only_the_range():
    pytest.importorskip("triton", reason="Triton is not installed")
    bm, nb, h = 4, 6, 96
    src = torch.randn(nb * bm, h).to(torch.bfloat16).to(DEV)
    dst = torch.full((nb * bm, h), 7.0, dtype=torch.bfloat16, device=DEV)
    rl = torch.tensor([5, 2, 0, 3, 1, 4], dtype=torch.int32, device=DEV)
    rh = torch.tensor([1, 3], dtype=torch.int32, device=DEV)  # blocks 2, 0
    DG.copy_ready_rows(rl, rh, 0, 1, 4, src, dst, block_m=bm)
    for b in range(nb):
        r = slice(b * bm, (b + 1) * bm)
        if b in (2, 0):
            assert torch.equal(dst[r], src[r]), b
        else:
            assert bool((dst[r] == 7.0).all()), b
    with pytest.raises(ValueError, match="alike"):
        DG.copy_ready_rows(rl, rh, 0, 1, 4, src, dst.float(), block_m=bm)


# ----------------------------------------------------------------------------------------------
# refusals and availability
# ----------------------------------------------------------------------------------------------
def test_block_m_other_than_128_is_refused_by_name():
    with pytest.raises(ValueError, match=r"plan\.block_m must be 128 for gemm='deep_gemm'.*got 64"):
        DG.check_block_m(64, "plan.block_m")
    DG.check_block_m(128)


def _tiny_consumer(block_m, dev=DEV):
    pytest.importorskip("triton", reason="Triton is not installed")
    from streamring.moe import blocks as B
    from streamring.moe.math import MoEShape

    shape = MoEShape(hidden=256, intermediate=256, num_experts=4, topk=2, router="softmax_topk",
                     weight_dtype="fp8")
    return B, B.BlockConsumer(shape, 8, 1, block_m, dev)


def test_consumer_refuses_deep_gemm_with_other_block_m_and_max_ctas():
    B, bc = _tiny_consumer(64)
    with pytest.raises(ValueError, match=r"block_m \(BlockConsumer\.block_m, the plan's block_m\) must be 128"):
        bc.experts("deep_gemm")
    with pytest.raises(ValueError, match="max_ctas must be None for gemm='deep_gemm'"):
        bc.compute(0, 1, 1, None, impl="deep_gemm", max_ctas=16)
    from streamring.gemm.backends import names

    assert "deep_gemm" in names()


def test_availability_gives_a_reason_and_builds_nothing(tmp_path, monkeypatch):
    a = DG.deep_gemm_available(refresh=True)
    assert isinstance(a.reason, str) and a.reason
    if not torch.cuda.is_available():
        assert not a and a.reason == "no CUDA GPU"
        B, bc = _tiny_consumer(128)
        with pytest.raises(RuntimeError, match="gemm='deep_gemm' is not available: no CUDA GPU"):
            bc.experts("deep_gemm")


def test_gemm_layer_names_deep_gemm():
    from streamring.config import RunConfig

    assert RunConfig.model_fields["gemm"].annotation.__args__ == ("auto", "triton", "cutlass", "deep_gemm")


# ----------------------------------------------------------------------------------------------
# the offline build recipe
# ----------------------------------------------------------------------------------------------
def _fake_info():
    return {"torch": "2.11.0+cu130", "cuda": "13.0", "include_dirs": ["/t/include", "/t/include/torch/csrc/api/include"],
            "library_dirs": ["/t/lib"], "cxx11_abi": 1, "pybind_flags": [], "python_include": "/py/include",
            "ext_suffix": ".cpython-312-x86_64-linux-gnu.so", "torch_lib": "/t/lib",
            "nvidia_include_dirs": ["/site/nvidia/cu13/include"]}


def test_compile_command_has_setup_py_flags_and_folders():
    cmd = BDG.compile_command(Path("/b/DeepGEMM"), Path("/b/_C.so"), _fake_info(), "/usr/local/cuda")
    assert cmd[0] == "g++" and "-shared" in cmd and cmd[-2:] == ["-o", "/b/_C.so"]
    for flag in ("-std=c++17", "-O3", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=1", "-DTORCH_EXTENSION_NAME=_C",
                 "-I/usr/local/cuda/include", "-I/usr/local/cuda/include/cccl", "-I/b/DeepGEMM/deep_gemm/include",
                 "-I/b/DeepGEMM/third-party/cutlass/include", "-I/b/DeepGEMM/third-party/fmt/include",
                 "-I/t/include", "-I/py/include", "-I/site/nvidia/cu13/include", "/b/DeepGEMM/csrc/python_api.cpp", "-lcudart", "-lnvrtc",
                 "-ltorch_python", "-L/usr/local/cuda/lib64", "-L/t/lib"):
        assert flag in cmd, flag


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None, reason="needs g++ and nm")
def test_a_compiler_that_links_libstdcxx_statically_is_skipped(tmp_path, monkeypatch):
    # the H200 host's $CXX links libstdc++.a into shared objects: _C then carried a second C++ runtime
    # and crashed in std::regex. A wrapper that does the same is skipped for the plain g++.
    static = tmp_path / "static-g++"
    static.write_text(f"#!/bin/sh\nexec {shutil.which('g++')} -static-libstdc++ \"$@\"\n")
    static.chmod(0o755)
    monkeypatch.delenv("DG_CXX", raising=False)
    monkeypatch.setenv("CXX", str(static))
    logs = []
    chosen = BDG.choose_compiler(tmp_path / "work", logs.append)
    assert os.path.realpath(chosen) == os.path.realpath(shutil.which("g++")), logs
    assert "statically" in logs[0] and "_ZNSt6locale7classicEv" in logs[0], logs
    assert BDG.static_libstdcxx(str(static), tmp_path / "w2")  # the probe itself sees it
    # DG_CXX is taken as is; a missing one is refused by name
    monkeypatch.setenv("DG_CXX", str(static))
    assert BDG.choose_compiler(tmp_path / "work", logs.append) == str(static)
    monkeypatch.setenv("DG_CXX", str(tmp_path / "nope"))
    with pytest.raises(BDG.DeepGemmBuildError, match="DG_CXX"):
        BDG.choose_compiler(tmp_path / "work", logs.append)


def test_missing_tarballs_say_how_to_make_them(tmp_path):
    with pytest.raises(BDG.DeepGemmBuildError, match="launch/pack_deep_gemm.sh"):
        BDG.check_sources(tmp_path)


@pytest.mark.skipif(not (REPO / ".deepgemm" / BDG.TARBALLS["deepgemm"]).is_file(),
                    reason="DeepGEMM's tarballs are not packed here (bash launch/pack_deep_gemm.sh)")
def test_carried_tarballs_unpack_into_the_tree_the_build_and_jit_expect(tmp_path):
    root = BDG.unpack(REPO / ".deepgemm", tmp_path / "b")
    # setup.py's include folders and the JIT's include root (deep_gemm/include + the copied cute/cutlass)
    inc = root / "deep_gemm" / "include" / "deep_gemm"
    assert (inc / "impls" / "sm90_fp8_gemm_1d2d.cuh").is_file() and (inc / "scheduler" / "gemm.cuh").is_file()
    text = (root / "deep_gemm" / "__init__.py").read_text()
    assert "__version__ = '2.6.1'" in text and "m_grouped_fp8_gemm_nt_contiguous" in text
    # every header the JIT's kernel sources include resolves in the installed layout
    so = tmp_path / "_C.so"
    so.write_bytes(b"")
    pkg = BDG.install(root, so, tmp_path / "site", ".so")
    assert (pkg / "_C.so").is_file() and (pkg / "include" / "cute" / "tensor.hpp").is_file()
    assert (pkg / "include" / "cutlass" / "cutlass.h").is_file()
    import re

    for cuh in (pkg / "include" / "deep_gemm").rglob("*.cuh"):
        for m in re.finditer(r'#include <((?:cute|cutlass|deep_gemm)/[^>]+)>', cuh.read_text()):
            assert (pkg / "include" / m.group(1)).is_file(), f"{cuh.name}: {m.group(1)}"
    # the C++ sources' includes of fmt and cutlass resolve in the build tree
    for hdr in ("fmt/base.h", "fmt/format.h", "cute/arch/mma_sm100_desc.hpp", "cutlass/cutlass.h"):
        assert any((root / d / hdr).is_file() for d in ("third-party/fmt/include", "third-party/cutlass/include")), hdr
    # a corrupted tarball is refused by the MANIFEST
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in BDG.TARBALLS.values():
        (bad / name).write_bytes((REPO / ".deepgemm" / name).read_bytes())
    (bad / "MANIFEST").write_text((REPO / ".deepgemm" / "MANIFEST").read_text())
    with open(bad / BDG.TARBALLS["fmt"], "ab") as f:
        f.write(b"x")
    with pytest.raises(BDG.DeepGemmBuildError, match="differs from the MANIFEST"):
        BDG.check_sources(bad)


# ----------------------------------------------------------------------------------------------
# GPU with deep_gemm
# ----------------------------------------------------------------------------------------------
_AVAIL = DG.deep_gemm_available()
needs_deep_gemm = pytest.mark.skipif(not _AVAIL, reason=f"deep_gemm unavailable: {_AVAIL.reason}")


def _deq_rows(q, sf):
    n, k = q.shape
    return (q.double().view(n, k // 128, 128) * sf.double()[:, :, None]).view(n, k)


def _deq_w(w, sf):
    n, k = w.shape
    return (w.double().view(n // 128, 128, k // 128, 128) * sf.double()[:, None, :, None]).reshape(n, k)


@needs_deep_gemm
def test_deep_gemm_minus_one_rows_get_zeros_and_ready_rows_match_float64():
    dg = DG.load()
    g = torch.Generator(device="cuda").manual_seed(1)
    nb, bm, e, n, k = 10, 128, 3, 512, 768
    a = torch.randn(nb * bm, k, generator=g, device="cuda").clamp(-440, 440).to(FP8)
    a_sf = torch.rand(nb * bm, k // 128, generator=g, device="cuda") + 0.5
    w = (torch.randn(e, n, k, generator=g, device="cuda") * 4).clamp(-440, 440).to(FP8)
    w_sf = torch.rand(e, n // 128, k // 128, generator=g, device="cuda") * 0.01 + 0.001
    be = torch.tensor([0, 0, 1, 2, 2, 2, 1, 0, 1, 2], dtype=torch.int32, device="cuda")
    rl = torch.tensor([3, 4, 0, 7, 9], dtype=torch.int32, device="cuda")
    rh = torch.tensor([0, 5], dtype=torch.int32, device="cuda")
    m_idx = DG.ready_m_indices(rl, rh, 0, 1, nb, be, e, bm)
    a_mn = DG.mn_major_scales(nb * bm, k // 128, "cuda")
    a_mn.copy_(a_sf)
    d = torch.full((nb * bm, n), 3.0, dtype=torch.bfloat16, device="cuda")
    dg.m_grouped_fp8_gemm_nt_contiguous((a, a_mn), (w, w_sf), d, m_idx)
    torch.cuda.synchronize()
    for b in range(nb):
        r = slice(b * bm, (b + 1) * bm)
        if b in (3, 4, 0, 7, 9):
            ex = int(be[b])
            ref = _deq_rows(a[r], a_sf[r]) @ _deq_w(w[ex], w_sf[ex]).t()
            absum = _deq_rows(a[r], a_sf[r]).abs() @ _deq_w(w[ex], w_sf[ex]).abs().t()
            err = (d[r].double() - ref).abs()
            assert bool((err <= 2.0 ** -9 * absum + 2.0 ** -8 * ref.abs()).all()), b
        else:
            # what gemm.deep_gemm's doc says: -1 rows are stored, as zeros (not left alone)
            assert bool((d[r] == 0).all()), b


@needs_deep_gemm
def test_deep_gemm_rows_do_not_depend_on_the_ready_range_bitwise():
    dg = DG.load()
    g = torch.Generator(device="cuda").manual_seed(2)
    nb, bm, e, n, k = 12, 128, 2, 384, 512
    a = torch.randn(nb * bm, k, generator=g, device="cuda").to(FP8)
    a_mn = DG.mn_major_scales(nb * bm, k // 128, "cuda")
    a_mn.copy_(torch.rand(nb * bm, k // 128, generator=g, device="cuda") + 0.5)
    w = torch.randn(e, n, k, generator=g, device="cuda").to(FP8)
    w_sf = torch.rand(e, n // 128, k // 128, generator=g, device="cuda") * 0.01 + 0.001
    be = torch.tensor([0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1], dtype=torch.int32, device="cuda")
    rl = torch.arange(nb, dtype=torch.int32, device="cuda")
    whole = torch.zeros(nb * bm, n, dtype=torch.bfloat16, device="cuda")
    dg.m_grouped_fp8_gemm_nt_contiguous((a, a_mn), (w, w_sf), whole,
                                        DG.ready_m_indices(rl, torch.tensor([0, nb], dtype=torch.int32,
                                                                            device="cuda"), 0, 1, nb, be, e, bm))
    for cut in ((0, 1), (1, 4), (4, 5), (5, 12)):
        part = torch.zeros_like(whole)
        rh = torch.tensor(cut, dtype=torch.int32, device="cuda")
        dg.m_grouped_fp8_gemm_nt_contiguous((a, a_mn), (w, w_sf), part, DG.ready_m_indices(rl, rh, 0, 1, nb, be, e, bm))
        r = slice(cut[0] * bm, cut[1] * bm)
        assert torch.equal(part[r], whole[r]), cut


def _moe_setup(dev="cuda"):
    from streamring.moe import blocks as B
    from streamring.moe.weights import MoEWeights
    from streamring.moe.math import MoEShape

    shape = MoEShape(hidden=256, intermediate=256, num_experts=8, topk=2, router="deepseek_v3", n_group=4,
                     topk_group=2, routed_scaling_factor=2.5, weight_dtype="fp8")
    fw = MoEWeights.random_fp8(shape, 3, dev).fp8_blocks()
    g = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(640, shape.hidden, generator=g).to(torch.bfloat16).to(dev)  # ~160 rows per expert: full blocks too
    return B, shape, fw, x


@needs_deep_gemm
def test_consumer_deep_gemm_matches_triton():
    B, shape, fw, x = _moe_setup()
    T = x.shape[0]
    outs = {}
    for impl in ("triton", "deep_gemm"):
        prod = B.Producer(T, shape.num_experts, "cuda")
        sc = block_paths.scratch_buffers(shape, T, "cuda")
        prod.route(x, fw, shape, sc["idx"], sc["w"])
        prod.layout(x, sc["q"], sc["sf"])
        bc = B.BlockConsumer(shape, T, 1, 128, "cuda")
        out = torch.zeros_like(x)
        B.moe_forward(sc["idx"], sc["w"], sc["q"], sc["sf"], fw, bc, out, gemm_impl=impl)
        if impl == "deep_gemm":
            bc.experts("deep_gemm").check()
        outs[impl] = out.float()
    # bf16 L1 output before SwiGLU (as CUTLASS's bf16 variant): ~2 % relative (test_gemm_cutlass)
    rel = float((outs["deep_gemm"] - outs["triton"]).norm() / outs["triton"].norm())
    assert rel < 4e-2, rel


@needs_deep_gemm
@pytest.mark.parametrize("chunk, keep", [(37, True), (200, True), (640, False)])
def test_consumer_deep_gemm_streamed_equals_batch_bitwise(chunk, keep):
    """The batch call (psum layout) and the streamed calls (m_indices) give equal rows bitwise.
    keep=False: L2 writes y directly, and DeepGEMM's zeros on the -1 rows of the seal's call wipe
    the first chunk's rows - why a consumer whose y must keep other rows uses the scratch + copy."""
    B, shape, fw, x = _moe_setup()
    T = x.shape[0]
    ys = []
    for streamed in (False, True):
        prod = B.Producer(T, shape.num_experts, "cuda")
        sc = block_paths.scratch_buffers(shape, T, "cuda")
        bc = B.BlockConsumer(shape, T, -(-T // chunk) + 1, 128, "cuda")
        # one chunk (chunk == T) may write y directly: a single range, plus the seal's
        bc.experts("deep_gemm", keep_rows_outside_range=keep)
        y = torch.zeros_like(x)
        if streamed:
            block_paths.streamed_forward_serial(x, fw, shape, prod, bc, sc, chunk, y, gemm_impl="deep_gemm")
        else:
            prod.route(x, fw, shape, sc["idx"], sc["w"])
            prod.layout(x, sc["q"], sc["sf"])
            B.moe_forward(sc["idx"], sc["w"], sc["q"], sc["sf"], fw, bc, y, gemm_impl="deep_gemm")
        bc.experts("deep_gemm").check()
        # the batch call covers the forward's one allocation: the psum layout; a stream's seal call does not
        assert bc.experts("deep_gemm").last_used_psum is (not streamed)
        ys.append(y)
    assert torch.equal(ys[0], ys[1]) == keep


def test_missing_cuda_headers_are_named_before_compiling(tmp_path):
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "cuda_runtime.h").write_text("")
    cmd = ["g++", f"-I{tmp_path / 'inc'}", "x.cpp"]
    missing = BDG.missing_headers(cmd)
    assert "cuda_runtime.h" not in missing and "cusparse.h" in missing and "nvrtc.h" in missing
