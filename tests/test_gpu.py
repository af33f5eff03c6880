"""NVSHMEM GPU backend.

Tests marked ``gpu`` need a CUDA GPU and nvshmem4py (+ cuda.core); elsewhere (CI) they
skip with the reason. The others run anywhere: the device descriptor in
``ring_desc.cuh`` mirrors ``RingLayout.descriptor()``, build.py fails clearly without
nvcc or NVSHMEM headers, and (when nvcc and the headers are present) the cubin builds.
"""

from __future__ import annotations

import importlib
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from streamring.config import NvshmemConfig
from streamring.device import build
from streamring.host import gpu
from streamring.protocol import RingLayout, make_gen

CSRC = Path(__file__).resolve().parents[1] / "streamring" / "device" / "csrc"


# --------------------------------------------------------------------------------------------
# No GPU needed
# --------------------------------------------------------------------------------------------
def _header_fields() -> list[tuple[str, str]]:
    """Independent parse of struct RingDesc (not gpu.parse_struct_fields)."""
    text = (CSRC / "ring_desc.cuh").read_text()
    body = re.search(r"struct\s+RingDesc\s*\{(.*?)\n\};", text, re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([\w\s]+?)\s*(\*?)\s*(\w+);", line)
        assert m, f"unparsed line in RingDesc: {line!r}"
        fields.append((m.group(1).strip() + m.group(2), m.group(3)))
    return fields


@pytest.mark.parametrize("layout", [
    RingLayout(num_ranks=1, num_slots=1, tokens_per_slot=1, hidden=128, topk=1, num_experts=1),
    RingLayout(num_ranks=66, num_slots=5, tokens_per_slot=32, hidden=7168, topk=8, num_experts=256,
               with_combine=True),
])
def test_ring_desc_fields_mirror_descriptor(layout):
    fields = _header_fields()
    keys = list(layout.descriptor().keys())
    layout_part = fields[: len(keys)]
    assert [n for _, n in layout_part] == keys, "RingDesc's first fields must be descriptor() keys, in order"
    assert all(t == "int64_t" for t, _ in layout_part), layout_part
    assert tuple(n for _, n in fields[len(keys):]) == gpu.STREAM_FIELDS
    assert all(t in ("int64_t", "uint64_t*", "unsignedlonglong*", "unsigned long long*")
               for t, _ in fields), fields  # every field is 8 bytes: packed int64 words
    text = (CSRC / "ring_desc.cuh").read_text()
    assert int(re.search(r"#define RING_DESC_WORDS (\d+)", text).group(1)) == len(fields) == gpu.RING_DESC_WORDS
    assert int(re.search(r"#define RING_DESC_LAYOUT_WORDS (\d+)", text).group(1)) == len(keys)


def test_parser_and_check_header_agree():
    assert [n for _, n in gpu.parse_struct_fields((CSRC / "ring_desc.cuh").read_text())] == \
        [n for _, n in _header_fields()]
    gpu.check_header()


def test_check_header_catches_a_missing_field(tmp_path):
    text = (CSRC / "ring_desc.cuh").read_text().replace("    int64_t off_x_sf;\n", "")
    bad = tmp_path / "ring_desc.cuh"
    bad.write_text(text)
    with pytest.raises(ValueError, match="RingDesc fields"):
        gpu.check_header(bad)


def test_pack_desc_is_descriptor_order():
    L = RingLayout(num_ranks=3, num_slots=4, tokens_per_slot=16, hidden=256, topk=2, num_experts=8)
    words = gpu.pack_desc(L, epoch_ptr=0x1000, num_chunks=9, status_ptr=0x2000, deadline_cycles=77, off_wake=L.nbytes)
    assert words.dtype == np.int64 and len(words) == gpu.RING_DESC_WORDS
    for i, (k, v) in enumerate(L.descriptor().items()):
        assert words[i] == v, k
    tail = dict(zip(gpu.STREAM_FIELDS, words[len(L.descriptor()):].tolist()))
    assert tail == {"epoch": 0x1000, "num_chunks": 9, "status": 0x2000, "deadline_cycles": 77, "off_wake": L.nbytes}


def test_generation_packing_matches_protocol():
    # ring_make_gen(epoch, chunk) = (epoch << 32) | (chunk + 1), as protocol.make_gen(epoch, chunk + 1)
    text = (CSRC / "ring_desc.cuh").read_text()
    assert "(epoch << RING_SEQ_BITS) | (uint64_t)(chunk + 1)" in text
    assert "#define RING_SEQ_BITS 32" in text
    assert make_gen(5, 3) == (5 << 32) | 3


def test_policies_match_config_choices():
    choices = NvshmemConfig.model_fields["progress"].annotation.__args__
    assert tuple(choices) == gpu.POLICIES


def test_decode_status():
    w = [0] * gpu.RS_WORDS
    w[gpu.RS_VIOLATIONS] = 2
    w[gpu.RS_FIRST_ERROR] = 4 | (3 << 8) | (17 << 24)
    st = gpu.decode_status(w)
    assert st["violations"] == 2 and st["first_error"]["what"] == "payload mismatch"
    assert st["first_error"]["src"] == 3 and st["first_error"]["chunk"] == 17


def test_build_error_names_nvcc_when_absent(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    for var in ("NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(build, "FALLBACK_CUDA_HOMES", [])
    monkeypatch.setenv("STREAMRING_CACHE", str(tmp_path / "cache"))
    with pytest.raises(build.BuildError, match="nvcc") as info:
        build.build_cubin()
    assert "PATH" in str(info.value) and "NVCC=" in str(info.value)


def test_build_error_names_nvshmem_headers_when_absent(monkeypatch, tmp_path):
    for var in ("STREAMRING_NVSHMEM_INC", "NVSHMEM_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)  # import fails
    monkeypatch.setitem(sys.modules, "nvidia.nvshmem", None)
    with pytest.raises(build.BuildError, match="NVSHMEM headers"):
        build.find_nvshmem_include()


def test_cache_key_depends_on_arch_and_compiler():
    a = build.source_digest("sm_90", "nvcc 13.0", None)
    assert a == build.source_digest("sm_90", "nvcc 13.0", None)
    assert a != build.source_digest("sm_100", "nvcc 13.0", None)
    assert a != build.source_digest("sm_90", "nvcc 12.9", None)


def _toolchain_or_skip():
    try:
        build.find_nvcc()
    except build.BuildError as exc:
        pytest.skip(f"no nvcc: {exc}")
    try:
        build.find_nvshmem_lib(build.find_nvshmem_include())
    except build.BuildError as exc:
        pytest.skip(f"no NVSHMEM headers/device library (set STREAMRING_NVSHMEM_INC): {str(exc)[:200]}")


def test_cubin_builds_and_is_cached(monkeypatch, tmp_path):
    _toolchain_or_skip()
    monkeypatch.setenv("STREAMRING_CACHE", str(tmp_path))
    path = build.build_cubin()
    assert path.is_file() and path.stat().st_size > 10_000
    assert path.read_bytes()[:4] == b"\x7fELF"
    mtime = path.stat().st_mtime_ns
    assert build.build_cubin() == path and path.stat().st_mtime_ns == mtime  # cache hit


# --------------------------------------------------------------------------------------------
# GPU (skip without a CUDA GPU and nvshmem4py)
# --------------------------------------------------------------------------------------------
def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    for mod in ("nvshmem.core", "cuda.core"):
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001
            return f"{mod} is not importable ({exc}); install nvshmem4py-cu13 / cuda-core"
    return None


_REASON = _gpu_skip_reason()
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=f"GPU test skipped: {_REASON}")


@pytest.fixture(scope="module")
def heap():
    from streamring.device.nvshmem import NvshmemHeap

    h = NvshmemHeap.bootstrap(launcher="local")
    yield h
    h.close()


@pytest.mark.gpu
@needs_gpu
def test_verbs_single_pe(heap):
    import torch

    from streamring.device.verbs import SignalOp, VerbError, WaitTimeout

    assert heap.name == "nvshmem" and heap.rank == 0 and heap.num_ranks == 1
    r = heap.alloc("t", 4096)
    try:
        assert isinstance(r.local, torch.Tensor) and r.local.is_cuda and r.local.dtype == torch.uint8
        assert int(r.local.sum()) == 0
        data = np.arange(100, dtype=np.int32)
        heap.put(r, 256, data, 0)  # an offset inside the allocation, not its start
        out = heap.get(r, 256, np.empty(100, dtype=np.int32), 0)
        assert np.array_equal(out, data)
        assert np.array_equal(r.local[256:656].cpu().numpy().view(np.int32), data)
        heap.put_signal(r, 1024, np.full(16, 7, np.uint8), r, 8, 41, SignalOp.SET, 0)
        assert heap.signal_fetch(r, 8) == 41
        assert np.array_equal(heap.get(r, 1024, np.empty(16, np.uint8), 0), np.full(16, 7, np.uint8))
        heap.signal_op(r, 8, 1, SignalOp.ADD, 0)
        assert heap.signal_fetch(r, 8) == 42
        big = (1 << 62) + 5
        heap.signal_op(r, 16, big, SignalOp.SET, 0)
        assert heap.signal_fetch(r, 16) == big
        # device atomics return the old value (nvshmem4py's host atomics would not)
        assert heap.atomic_fetch_or(r, 24, 0b01, 0) == 0
        assert heap.atomic_fetch_or(r, 24, 0b10, 0) == 0b01
        assert heap.signal_fetch(r, 24) == 0b11
        assert heap.atomic_fetch_add(r, 32, 5, 0) == 0
        assert heap.atomic_fetch_add(r, 32, 5, 0) == 5
        heap.fence()
        heap.quiet()
        heap.barrier(time.monotonic() + 10)
        assert heap.allgather_int(3) == [3] and heap.allgather_obj({"a": 1}) == [{"a": 1}]
        with pytest.raises(VerbError):
            heap.put(r, 4090, np.zeros(16, np.uint8), 0)
        with pytest.raises(VerbError):
            heap.signal_op(r, 8, 1, SignalOp.SET, 1)
        with pytest.raises(WaitTimeout):
            heap.signal_wait_until(r, 40, __import__("streamring.device.verbs", fromlist=["Cmp"]).Cmp.EQ, 1,
                                   time.monotonic() + 0.05)
        # larger than the staging buffer: chunked puts and gets
        r2 = heap.alloc("big", heap.stage_bytes + 4096)
        blob = np.random.default_rng(0).integers(0, 255, heap.stage_bytes + 1000, dtype=np.uint8)
        heap.put(r2, 8, blob, 0)
        assert np.array_equal(heap.get(r2, 8, np.empty_like(blob), 0), blob)
        heap.free(r2)
    finally:
        heap.free(r)


@pytest.mark.gpu
@needs_gpu
def test_stress_on_nvshmem_single_pe(heap):
    from streamring.config import load_config
    from streamring.stress import run_stress

    cfg = load_config(None, ["backend=nvshmem", "ranks=1", "stress.chunks_per_rank=10", "ring.num_slots=3",
                             "stress.epochs=2"])
    res = run_stress(heap, cfg)
    assert res.violations == 0, res.first_violations
    assert res.chunks_consumed == 20 and res.chunks_published == 20


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("policy", gpu.POLICIES)
def test_graph_replay_with_device_epoch(heap, policy):
    r = gpu.graph_check(heap, policy, replays=200, num_slots=2, num_chunks=5, deadline_s=5.0, check_every=50)
    if policy == "green_ctx" and r["mode"] == "not run":
        pytest.skip(f"green contexts unavailable: {r['error']}")
    assert r["ok"], r
    assert r["epoch_end"] == 1 + 1 + 200
    assert r["consumed"] == 201 * 5


@pytest.mark.gpu
@needs_gpu
def test_graph_negative_control_is_detected(heap):
    r = gpu.graph_check(heap, "spin_kernel", replays=20, num_slots=2, num_chunks=4, inject="skip-acquire",
                        delay_us=50.0, deadline_s=0.5, check_every=5)
    assert r["detected"], r
