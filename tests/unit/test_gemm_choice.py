"""The measured GEMM heuristic (streamring/gemm/choice.py) and its committed table.

CPU only: the fallback rule where nothing is measured (and for the committed placeholder), the
nearest measured entry, availability filtering, one implementation for both GEMMs of a layer, the
table keys, and that the table ``bench.gemm`` writes is what ``choose_gemm`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamring.gemm import choice as GC

L1 = (4096, 7168)  # N, K of the DeepSeek-V3 L1 (gate+up)
L2 = (7168, 2048)


def entry(rpe, n, k, times, tokens=None):
    return {"rows_per_expert": rpe, "tokens": tokens, "n": n, "k": k, "times_ms": times,
            "best": min((k_ for k_ in times if not k_.startswith("torch")), key=times.get)}


def table(*entries, measured=True):
    return {"measured": measured, "date": "2026-12-02", "entries": list(entries)}


def test_fallback_is_the_rule_before_the_table():
    c = GC.choose_gemm(32, *L1, {"triton", "cutlass"}, table(measured=False))
    assert (c.impl, c.tile, c.out) == ("cutlass", "pingpong64", "bf16") and c.ms is None
    assert c.source.startswith("fallback rule")
    assert GC.choose_gemm(128, *L1, {"triton", "cutlass"}, table(measured=False)).tile == "coop128"
    assert GC.choose_gemm(127.9, *L1, {"cutlass"}, table()).tile == "pingpong64"
    assert GC.choose_gemm(1024, *L1, {"triton", "deep_gemm"}, table()).impl == "triton"  # DeepGEMM only if measured
    assert GC.choose_gemm(1024, *L1, {"deep_gemm"}, table()).impl == "deep_gemm"  # ... or asked for alone


def test_committed_placeholder_is_marked_and_ignored():
    t = GC.load_table()
    assert t["measured"] is False or all(e.get("times_ms") for e in t["entries"])
    if not t["measured"]:
        assert "NOT MEASURED" in t["note"]
        c = GC.choose_gemm(256, *L1, {"triton", "cutlass", "deep_gemm"})
        assert c.source.startswith("fallback rule") and c.tile == "coop128"


def test_nearest_measured_entry_and_availability():
    t = table(entry(32, *L1, {"cutlass:pingpong64:bf16:m": 1.9, "deep_gemm": 2.4, "triton": 1.95,
                              "torch_scaled_grouped_mm": 2.6}),
              entry(256, *L1, {"cutlass:coop192_m2:bf16:m": 4.1, "cutlass:coop128:bf16:n": 5.0, "deep_gemm": 4.3,
                               "triton": 7.0}))
    c = GC.choose_gemm(256, *L1, {"triton", "cutlass", "deep_gemm"}, t)
    assert (c.impl, c.tile, c.out, c.raster, c.ms) == ("cutlass", "coop192_m2", "bf16", "m", 4.1)
    assert c.source.startswith("measured") and c.key == "cutlass:coop192_m2:bf16:m"
    assert GC.choose_gemm(300, *L1, {"triton", "deep_gemm"}, t).impl == "deep_gemm"  # nearest: 256
    assert GC.choose_gemm(32, *L1, {"triton", "deep_gemm"}, t).impl == "triton"
    # torch's time is kept for reference, never chosen
    assert GC.choose_gemm(32, *L1, set(), t).impl == "triton"
    # too far from every entry (> NEAREST_FACTOR): the rule
    assert GC.choose_gemm(1024, *L1, {"cutlass"}, t).source.startswith("fallback rule")
    # another shape: the rule
    assert GC.choose_gemm(256, 1024, 1024, {"cutlass"}, t).source.startswith("fallback rule")


def test_layer_takes_one_implementation_for_both_gemms():
    t = table(entry(256, *L1, {"cutlass:coop192_m2:bf16:m": 4.1, "deep_gemm": 4.3, "triton": 7.0}),
              entry(256, *L2, {"cutlass:coop128_m2:bf16:n": 2.3, "deep_gemm": 2.2, "triton": 3.3}))  # 6.4 vs 6.5 ms
    lc = GC.choose_layer(256, 7168, 2048, {"triton": "", "cutlass": "", "deep_gemm": ""}, t)
    assert lc.impl == "cutlass" and lc.l1.tile == "coop192_m2" and lc.l2.tile == "coop128_m2" and lc.l2.raster == "n"
    assert lc.source.startswith("measured")
    lc = GC.choose_layer(256, 7168, 2048, {"triton": "", "cutlass": "CUTLASS library unavailable", "deep_gemm": ""}, t)
    assert lc.impl == "deep_gemm" and lc.skipped == {"cutlass": "CUTLASS library unavailable"}
    # one GEMM unmeasured: the rule for both
    lc = GC.choose_layer(256, 7168, 2048, {"cutlass", "triton"}, table(t["entries"][0]))
    assert lc.impl == "cutlass" and lc.l1.tile == lc.l2.tile == "coop128" and lc.source.startswith("fallback")


def test_keys_round_trip_and_bad_keys_are_named():
    for c in (GC.GemmChoice("cutlass", "coop192_n2", "bf16", "n"), GC.GemmChoice("cutlass", "coop128", "f32", "m", 4),
              GC.GemmChoice("deep_gemm"), GC.GemmChoice("triton")):
        back = GC.parse_key(c.key)
        assert (back.impl, back.tile, back.out, back.raster, back.swizzle) == (c.impl, c.tile, c.out, c.raster,
                                                                               c.swizzle)
    # the default swizzle is left out of the key, so the tables measured before it existed still read
    assert GC.GemmChoice("cutlass", "coop128", "bf16", "n").key == "cutlass:coop128:bf16:n"
    assert GC.GemmChoice("cutlass", "coop128", "bf16", "n", 8).key == "cutlass:coop128:bf16:n:s8"
    for bad in ("cutlass:coop128:f16:m", "cutlass:coop128:bf16:m:s1", "cutlass:coop128:bf16:m:s3",
                "cutlass:coop128:bf16:m:4", "cutlass:coop128:bf16:m:", "cutlass:coop128:bf16"):
        with pytest.raises(ValueError, match="names no implementation"):
            GC.parse_key(bad)
    with pytest.raises(ValueError, match="swizzle must be 1 or one of"):
        GC.GemmChoice("cutlass", "coop128", "bf16", "m", 3).key


def test_a_measured_swizzle_reaches_the_choice():
    t = {"measured": True, "entries": [{"rows_per_expert": 256, "n": 4096, "k": 7168,
                                        "times_ms": {"cutlass:coop128:bf16:m": 6.0, "cutlass:coop128:bf16:n:s4": 5.5}}]}
    c = GC.choose_gemm(256, 4096, 7168, {"cutlass"}, t)
    assert (c.tile, c.raster, c.swizzle, c.ms) == ("coop128", "n", 4, 5.5)


def test_resolve_layer_refuses_deep_gemm_with_another_block_m():
    class Shape:
        topk, num_experts, hidden, intermediate = 8, 256, 7168, 2048

    with pytest.raises(ValueError, match=r"block_m must be 128 for gemm='deep_gemm'"):
        GC.resolve_layer("deep_gemm", 64, Shape, [8192])
    with pytest.raises(ValueError, match="gemm must be 'auto' or one of"):
        GC.resolve_layer("cublas", 64, Shape, [8192])
    lc = GC.resolve_layer("triton", 64, Shape, [8192])
    assert lc.impl == "triton"
    lc = GC.resolve_layer("cutlass", 64, Shape, [4096, 4096], table=table())  # 256 rows per expert
    assert (lc.impl, lc.l1.tile) == ("cutlass", "coop128")


def test_the_table_bench_writes_is_what_choose_reads(tmp_path):
    from bench import gemm_lib as BGm

    rows = [
        {"tokens": 8192, "gemm": "l1", "impl": "cutlass_coop192_m2_bf16", "median_ms": 4.0, "rows": 65536,
         "n_dim": 4096, "k_dim": 7168, "block_m": 64, "variant": "cutlass:coop192_m2:bf16:m"},
        {"tokens": 8192, "gemm": "l1", "impl": "deep_gemm", "median_ms": 4.3, "rows": 65536, "n_dim": 4096,
         "k_dim": 7168, "block_m": 128, "variant": "deep_gemm"},
        {"tokens": 8192, "gemm": "l1", "impl": "torch_scaled_grouped_mm", "median_ms": 5.2, "rows": 65536,
         "n_dim": 4096, "k_dim": 7168, "block_m": 64, "variant": None},
        {"tokens": 8192, "gemm": "l1", "impl": "cutlass_coop128_f32", "median_ms": None, "rows": 65536,
         "n_dim": 4096, "k_dim": 7168, "block_m": 64, "variant": "cutlass:coop128:f32:m",
         "error": "failed the correctness check: not timed"},
    ]
    t = BGm.make_table(rows, num_experts=256, topk=8, meta={"device": "NVIDIA H200", "date": "2026-12-02"})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t))
    back = GC.load_table(path)
    assert back["measured"] is True and len(back["entries"]) == 1
    e = back["entries"][0]
    assert e["rows_per_expert"] == 256 and e["best"] == "cutlass:coop192_m2:bf16:m"
    assert "cutlass:coop128:f32:m" not in e["times_ms"]  # not timed: not a candidate
    c = GC.choose_gemm(256, *L1, {"cutlass", "deep_gemm", "triton"}, back)
    assert (c.impl, c.tile, c.ms) == ("cutlass", "coop192_m2", 4.0)


def test_setup_consumer_applies_the_choice():
    pytest.importorskip("triton", reason="Triton is not installed")
    import torch

    from streamring.moe import blocks as B
    from streamring.moe.math import MoEShape

    shape = MoEShape(hidden=256, intermediate=256, num_experts=4, topk=2, router="softmax_topk", weight_dtype="fp8")
    t = table(entry(4, 512, 256, {"cutlass:coop192_m2:bf16:n:s4": 1.0, "triton": 2.0}),
              entry(4, 256, 256, {"cutlass:pingpong64:f32:m": 1.0, "cutlass:coop128:bf16:m": 1.5, "triton": 2.0}))
    lc = GC.choose_layer(4, 256, 256, {"cutlass", "triton"}, t)
    assert lc.impl == "cutlass"
    bc = B.BlockConsumer(shape, 8, 1, 64, "cpu")
    GC.setup_consumer(bc, lc, staging_y=True)
    g1, g2 = bc.experts("cutlass").gemm1, bc.experts("cutlass").gemm2
    assert (g1.tile, g1.raster, g1.swizzle, g1.out_dtype, g1.sf_n) == ("coop192_m2", "n", 4, torch.bfloat16, 64)
    # L2's table entry names an f32 variant; L2's output is bf16 always, its tile and order are what count
    assert (g2.tile, g2.raster, g2.swizzle) == ("pingpong64", "m", 1)
    GC.setup_consumer(bc, GC.LayerChoice("triton", GC.GemmChoice("triton"), GC.GemmChoice("triton"), ""),
                      staging_y=True)
    with pytest.raises(ValueError, match="choice.impl must be one of"):
        GC.setup_consumer(bc, GC.LayerChoice("cublas", GC.GemmChoice("x"), GC.GemmChoice("x"), ""), staging_y=True)


def _run(path, tokens_ms: dict, block_m=64, date="2026-12-02"):
    """A bench.gemm JSON with one Triton and one CUTLASS L1 row per token count."""
    rows = []
    for t, (tri, cut) in tokens_ms.items():
        for impl, variant, ms in (("triton", "triton", tri), ("cutlass_pingpong64_bf16", "cutlass:pingpong64:bf16:m", cut)):
            rows.append({"tokens": t, "gemm": "l1", "impl": impl, "variant": variant, "median_ms": ms, "n_dim": 4096,
                         "k_dim": 7168, "block_m": block_m})
    path.write_text(json.dumps({"meta": {"device": "NVIDIA H200", "date": date, "args": {"block_m": block_m}},
                                "rows": rows}))
    return str(path)


def test_gemm_table_entries_come_whole_from_the_last_run_that_measured_them(tmp_path):
    from bench import make_gemm_table as MT

    old = _run(tmp_path / "old.json", {128: (2.0, 1.9), 1024: (2.1, 2.0)}, date="2026-12-01")
    new = _run(tmp_path / "new.json", {1024: (1.9, 2.0)})
    t = MT.merge([old, new])
    by = {e["tokens"]: e for e in t["entries"]}
    assert by[128]["source"] == old and by[128]["best"] == "cutlass:pingpong64:bf16:m"
    assert by[1024]["source"] == new and by[1024]["times_ms"] == {"triton": 1.9, "cutlass:pingpong64:bf16:m": 2.0}
    assert t["date"] == "2026-12-02"
    # another block size: its own entries beside the others, tagged; another device: refused
    other = _run(tmp_path / "bm16.json", {128: (1.7, 1.9)}, block_m=16)
    t2 = MT.merge([old, other])
    got = {(e["tokens"], e["run_block_m"]): e["source"] for e in t2["entries"]}
    assert got == {(128, 64): old, (1024, 64): old, (128, 16): other}
    assert GC.choose_gemm(128 * 8 / 256, 4096, 7168, {"triton"}, t2, block_m=16).ms == 1.7
    assert GC.choose_gemm(128 * 8 / 256, 4096, 7168, {"triton"}, t2, block_m=64).ms == 2.0
    elsewhere = json.loads(Path(other).read_text())
    elsewhere["meta"]["device"] = "NVIDIA H100"
    Path(other).write_text(json.dumps(elsewhere))
    with pytest.raises(ValueError, match=r"bm16\.json was measured on device 'NVIDIA H100', .*old\.json on 'NVIDIA H200'"):
        MT.merge([old, other])


def test_the_committed_gemm_table_is_what_its_sources_make():
    """streamring/gemm/table.json == make_gemm_table of the runs it names (nothing edited by hand)."""
    from pathlib import Path

    from bench import make_gemm_table as MT

    root = Path(__file__).resolve().parents[2]
    committed = json.loads((root / "streamring/gemm/table.json").read_text())
    cmd = committed["source"].split()
    assert cmd[:3] == ["python", "-m", "bench.make_gemm_table"], committed["source"]
    files = cmd[3:]
    assert files and all((root / f).is_file() for f in files), files
    made = MT.merge([str(root / f) for f in files])
    strip = lambda t: [{k: v for k, v in e.items() if k != "source"} for e in t["entries"]]  # noqa: E731
    assert strip(made) == strip(committed)
    assert [Path(e["source"]).name for e in made["entries"]] == [Path(e["source"]).name for e in committed["entries"]]


def test_bench_variant_specs_carry_the_swizzle():
    import torch

    from bench import gemm_lib as BGm

    v = BGm.parse_variants("coop128:bf16,coop128:f32:n:s4,pingpong64", "l1")
    assert v == {"cutlass_coop128_bf16": ("coop128", torch.bfloat16, "m", 1),
                 "cutlass_coop128_f32_n_s4": ("coop128", torch.float32, "n", 4),
                 "cutlass_pingpong64_bf16": ("pingpong64", torch.bfloat16, "m", 1)}
    assert BGm.parse_variants("coop128:m:s8,pingpong64:n", "l2") == {
        "cutlass_coop128_s8": ("coop128", torch.bfloat16, "m", 8),
        "cutlass_pingpong64_n": ("pingpong64", torch.bfloat16, "n", 1)}
    for bad, gemm in (("coop128:bf16:m:s3", "l1"), ("coop128:m:4", "l2"), ("coop128:bf16:m:s2:x", "l1"),
                      ("coop128:q", "l2")):
        with pytest.raises(ValueError, match="swizzle one of"):
            BGm.parse_variants(bad, gemm)


def test_bench_refuses_eager_timings_in_the_table(capsys):
    from bench import gemm as BGm

    with pytest.raises(SystemExit) as e:
        BGm.main(["--no-graphs", "--table", "never-written.json"])
    assert e.value.code == 2 and "drop --table" in capsys.readouterr().err


def test_block_tiles_only_for_128_row_blocks():
    t = table(entry(512, *L1, {"cutlass:pair128:bf16:m:s4": 3.0, "cutlass:coop128:bf16:m": 4.0, "deep_gemm": 3.5}),
              entry(512, *L2, {"cutlass:pair192:bf16:m": 1.5, "cutlass:coop128:bf16:m": 2.0, "deep_gemm": 1.8}))
    c = GC.choose_gemm(512, *L1, {"cutlass"}, t, block_m=128)
    assert (c.tile, c.swizzle) == ("pair128", 4)
    for bm in (None, 16, 64):  # a pair tile takes one 128-row block per tile
        assert GC.choose_gemm(512, *L1, {"cutlass"}, t, block_m=bm).tile == "coop128"
    lc = GC.choose_layer(512, 7168, 2048, {"cutlass", "deep_gemm"}, t, block_m=128)
    assert (lc.impl, lc.l1.tile, lc.l2.tile) == ("cutlass", "pair128", "pair192")
    assert GC.choose_layer(512, 7168, 2048, {"cutlass", "deep_gemm"}, t, block_m=64).impl == "deep_gemm"
    assert GC.usable_at(GC.parse_key("cutlass:coop128:bf16:m"), 16)


def test_bench_dsv3_shape_scales_the_expert_groups():
    """bench.common.dsv3_shape is the one DeepSeek-V3 shape of every benchmark: 8 groups, top-4 groups at
    256 experts; one group per 32 experts otherwise (at least one), topk_group = min(4, groups)."""
    from bench.common import dsv3_shape

    s = dsv3_shape(64)
    assert (s.hidden, s.intermediate, s.num_experts, s.topk, s.n_group, s.topk_group, s.block_m) == \
        (7168, 2048, 256, 8, 8, 4, 64)
    assert (s.router, s.routed_scaling_factor, s.norm_topk_prob, s.weight_dtype) == ("deepseek_v3", 2.5, True, "fp8")
    assert [(dsv3_shape(16, e).n_group, dsv3_shape(16, e).topk_group) for e in (8, 16, 32, 64, 96, 128, 512)] == \
        [(1, 1), (1, 1), (1, 1), (2, 2), (3, 3), (4, 4), (16, 4)]
    with pytest.raises(ValueError):
        dsv3_shape(16, 100)  # 3 groups do not divide 100 experts


def _no_cutlass_library(monkeypatch, tmp_path):
    """This process as on a machine where the CUTLASS library was never built: an empty build cache,
    no .gemm-build/, no $STREAMRING_GEMM_LIB, nothing loaded or noticed yet."""
    from streamring.gemm import build as BG
    from streamring.gemm import cutlass as CG
    from streamring.gemm import cutlass_lib as CL

    monkeypatch.setenv("STREAMRING_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("STREAMRING_GEMM_LIB", raising=False)
    monkeypatch.setattr(BG, "REPO_BUILD_DIR", tmp_path / "no-gemm-build")
    monkeypatch.setattr(CL, "_lib", None)
    monkeypatch.setattr(CL, "_noticed", set())
    return CG


def test_auto_without_the_cutlass_library_says_so_once_and_never_builds(monkeypatch, tmp_path, capsys):
    """gemm='auto' where the library is absent: CUTLASS is left out with the reason, stderr says once per
    process that it is absent, how long building takes, the command, and which GEMMs run instead; no
    build starts (nothing is compiled into the cache)."""
    CG = _no_cutlass_library(monkeypatch, tmp_path)

    class Plan:
        block_m, policy = 64, "serialized"

    class Shape:
        topk, num_experts, hidden, intermediate = 8, 256, 7168, 2048

    avail = GC.available_impls(64)
    assert avail["cutlass"].startswith(CG.NOT_BUILT) and avail["triton"] == "", avail
    assert capsys.readouterr().err == ""  # asking what is available says nothing; a run's choice does
    lc = GC.resolve_layer("auto", Plan, Shape, [8192])
    assert lc.impl != "cutlass" and "cutlass" in lc.skipped
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("streamring: ")]
    assert len(lines) == 1, err
    want = {"triton": "gemm='auto' runs the Triton GEMMs instead", "deep_gemm": "gemm='auto' runs DeepGEMM instead"}
    assert want[lc.impl] in lines[0], lines
    assert ("the CUTLASS GEMM library is not built" in lines[0] and "about 2 minutes on 16 cores, 3.5 minutes on 2"
            in lines[0] and "`python -m streamring.gemm.build --out .gemm-build`" in lines[0]), lines
    GC.resolve_layer("auto", Plan, Shape, [1024])  # once per process
    assert "streamring: " not in capsys.readouterr().err
    assert not list((tmp_path / "cache").glob("gemm/*.so"))
    with pytest.raises(CG.GemmLibraryMissing):
        CG.load_library(build=False)


def test_a_cutlass_build_inside_a_run_announces_itself(monkeypatch, tmp_path, capsys):
    """Where a CUTLASS GEMM is asked for (a GroupedGemm made: gemm='cutlass') and no library is built,
    the build that starts says so first on stderr, with how long it takes; here CUTLASS's headers are
    absent too, so the build then fails naming what it tried."""
    import importlib.util

    from streamring.gemm import build as BG

    CG = _no_cutlass_library(monkeypatch, tmp_path)
    monkeypatch.setenv("STREAMRING_CUTLASS_DIR", str(tmp_path / "nope"))
    monkeypatch.setattr(BG, "REPO", tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CG.GemmLibraryError, match="cannot be built here: .*CUTLASS's headers were not found"):
        CG.library_path(build=True)
    err = capsys.readouterr().err
    assert err.count("streamring: the CUTLASS GEMM library is not built") == 1, err
    assert "building it now (a line per compile unit follows)" in err and "3.5 minutes on 2" in err, err


def test_every_backend_is_one_class_with_the_registry_capabilities():
    """gemm.backends: each name makes its class, whose ``name`` and ``capabilities`` are the registry's, and
    a call asking for what a backend cannot do is refused by name before any GPU work (the EP buffer's
    capped chunk grids, direct L2 and persistent consumer ask these, not the backend's name)."""
    from streamring.gemm import backends as GB

    assert GB.names() == GB.BUILTIN == ("triton", "cutlass", "deep_gemm") and tuple(GB.backends()) == GB.names()
    for impl in GB.names():
        cls = GB.backend(impl)
        assert cls.name == impl and cls.capabilities is GB.CAPABILITIES[impl] and impl in GB.CAPABILITIES
        for what, kw in (("max_ctas", dict(max_ctas=8)), ("owner_rows", dict(direct=())),
                         ("owner_rows", dict(out=()))):
            if getattr(cls.capabilities, what):
                GB.refuse_unsupported(impl, **kw)
            else:
                with pytest.raises(ValueError, match=f"gemm={impl!r}"):
                    GB.refuse_unsupported(impl, **kw)
    with pytest.raises(ValueError, match=r"gemm implementation must be one of .*got 'cublas'"):
        GB.backend("cublas")
    assert "cublas" not in GB.CAPABILITIES and GB.CAPABILITIES.get("cublas") is None


def test_a_dropped_gemm_plan_is_destroyed_outside_a_capture_and_queued_inside_one(monkeypatch):
    """GroupedGemm's finalizer never frees device memory inside a CUDA graph capture of this thread (it would
    invalidate the capture): it queues the plan, destroyed at once outside a capture, or by the next plan made,
    closed or dropped outside one (a fake library records the destroys; the capture state is the test's)."""
    from streamring.gemm import cutlass_lib as L

    destroyed, capturing = [], [False]

    class FakeLib:
        def sr_gemm_destroy(self, plan):
            destroyed.append(plan)

    monkeypatch.setattr(L.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(L.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(L, "_DROPPED", [])

    def dropped_plan(handle):
        g = L.GroupedGemm(128, 128, capacity=4)
        g._lib, g._plan = FakeLib(), handle
        return g

    p = dropped_plan("outside")
    del p
    assert destroyed == ["outside"] and L._DROPPED == []
    capturing[0] = True
    p = dropped_plan("inside")
    del p
    assert destroyed == ["outside"] and [h for _, h in L._DROPPED] == ["inside"]
    L.destroy_dropped()  # still capturing: nothing
    assert destroyed == ["outside"]
    capturing[0] = False
    L.destroy_dropped()
    assert destroyed == ["outside", "inside"] and L._DROPPED == []
