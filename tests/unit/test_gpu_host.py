"""The host side of the GPU layer, on the CPU (no GPU needed).

* which expert GEMMs ``run`` compares: the batch and the streamed path of one buffer run one
  implementation, resolved once, and the report names it for both;
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from streamring.config import load_config
from streamring.host.report import Report

FAST = ["layer.weight_dtype=fp8", "layer.router=deepseek_v3", "layer.num_experts=16", "layer.n_group=4",
        "layer.topk_group=2", "layer.topk=4", "layer.hidden=512", "layer.intermediate=256", "run.block_m=16",
        "run.tokens_per_rank=300", "ring.num_slots=2", "ring.tokens_per_slot=64"]


# --------------------------------------------------------------------------------------------
# Same GEMM on both sides of every comparison
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cutlass,want", [(True, "cutlass"), (False, "triton")])
def test_auto_resolves_once_for_both_paths(monkeypatch, cutlass, want):
    """'auto' stands for one implementation, resolved once per buffer (the measured table where it has
    an entry, else CUTLASS when its library loads, else Triton). ``run`` builds ONE buffer, whose batch and
    streamed paths both run what it resolved (``EPBuffer.gemm``), so a streamed-vs-batch comparison never
    measures two GEMMs' rounding; the row names it for both."""
    from streamring.moe import ep_buffer
    from streamring.gemm import choice as GC
    from streamring.moe.math import MoEShape

    avail = {"triton": "", "cutlass": "" if cutlass else "not built", "deep_gemm": "not installed"}
    monkeypatch.setattr(GC, "available_impls", lambda block_m, policy="serialized": dict(avail))
    shape = MoEShape(hidden=512, intermediate=256, num_experts=16, topk=4, weight_dtype="fp8", block_m=16)
    assert ep_buffer.resolve_gemm("auto", shape, 2, 300, 16).impl == want
    assert ep_buffer.resolve_gemm("triton", shape, 2, 300, 16).impl == "triton"


def test_resolve_gemm_names_the_allowed_values():
    from streamring.moe.ep_buffer import resolve_gemm
    from streamring.moe.math import MoEShape

    shape = MoEShape(hidden=512, intermediate=256, num_experts=16, topk=4, weight_dtype="fp8", block_m=16)
    with pytest.raises(ValueError, match=r"gemm must be one of \('auto', 'triton', 'cutlass', 'deep_gemm'\), "
                                         r"got 'cublas'"):
        resolve_gemm("cublas", shape, 2, 300, 16)


def _fast_row(rank, gemm_batch, gemm_stream):
    return dict(rank=rank, tokens=300, chunks=5, experts_hit=4, bitwise_equal=True, max_abs_stream_minus_batch=0.0,
                ref_ok=True, ref_max_abs_err=0.01, ref_max_err_ratio=0.5, ref_excluded=0, batch_wall_s=0.0,
                stream_wall_s=0.0, epochs=2, scheduler="blocks", rtol=0.03, atol=0.0, path="fast", transport="p2p",
                policy="spin_kernel", gemm=gemm_stream, gemm_batch=gemm_batch, gemm_stream=gemm_stream, ring_errors={})


def _report(rows):
    from streamring.host.rank_main import report_run

    cfg = load_config(None, FAST + ["nvshmem.progress=spin_kernel"], backend="nvshmem", ranks=len(rows))
    buf = io.StringIO()
    code = report_run(rows, cfg, 1.0, None, out=Report(file=buf, width=None))
    return code, buf.getvalue()


def test_report_names_the_gemm_of_both_paths():
    code, text = _report([_fast_row(0, "triton", "triton"), _fast_row(1, "triton", "triton")])
    assert code == 0 and "triton GEMMs on both paths" in text, text


def test_report_fails_a_comparison_across_two_gemms():
    code, text = _report([_fast_row(0, "cutlass", "triton"), _fast_row(1, "triton", "triton")])
    assert code == 1, text
    assert "batch and streamed ran different GEMMs (batch, streamed) {0: ('cutlass', 'triton')}" in text, text


def test_gpu_check_judge_refuses_a_run_across_two_gemms():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_check_steps",
                                                  Path(__file__).resolve().parents[2] / "launch/gpu_check_steps.py")
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    same = {"ok": True, "ranks": [_fast_row(0, "triton", "triton")]}
    ok, note = steps.judge_run(0, "", same)
    assert ok and "GEMMs (batch, stream) [('triton', 'triton')]" in note, note
    ok, note = steps.judge_run(0, "", {"ok": True, "ranks": [_fast_row(0, "cutlass", "triton")]})
    assert not ok and "DIFFER" in note, note


# --------------------------------------------------------------------------------------------
# The device status words: decoded, and said in one line naming source, chunk and generation
# --------------------------------------------------------------------------------------------
def _words(code_name, src, chunk, seen, want, field=-1, violations=0, timeouts=0):
    from streamring.device import ringdesc as D

    w = [0] * D.RS_WORDS
    w[D.RS_FIRST_ERROR] = (D.ERROR_CODES[code_name] | ((src & 0xFFFF) << 8) | ((chunk & 0xFFFFFFFF) << 24)
                           | (((field + 1) & 0xFF) << 56))
    w[D.RS_BAD_SEEN], w[D.RS_BAD_WANT] = seen, want
    w[D.RS_VIOLATIONS], w[D.RS_TIMEOUTS] = violations, timeouts
    w[D.RS_ABORT] = int(bool(timeouts))
    return D.decode_status(w)


def test_decode_status_names_the_metadata_word_and_no_source():
    from streamring.device import ringdesc as D

    st = _words("RE_META", 1, 3, 5, 4, field=D.META_VALID, violations=1)
    assert st["first_error"]["field"] == "valid count" and st["first_error"]["src"] == 1, st
    assert st["first_error"]["chunk"] == 3 and st["first_error"]["what"] == "metadata mismatch", st
    st = _words("RE_COMBINE_TIMEOUT", -1, 2, 12, 40, timeouts=1)
    assert st["first_error"]["src"] == -1 and st["first_error"]["field"] is None, st
    # the packing the device writes (record_error in csrc/ring_protocol.cuh) and nothing else
    src = (Path(__file__).resolve().parents[2] / "streamring/device/csrc/ring_protocol.cuh").read_text()
    assert "((unsigned long long)((field + 1) & 0xff) << 56)" in src and "(src & 0xffff) << 8" in src


def test_describe_acquire_timeout_names_source_chunk_and_generation():
    from streamring.device import ringdesc as D

    want, seen = (5 << 32) | 1, (4 << 32) | 5
    st = _words("RE_ACQUIRE_TIMEOUT", 1, 0, seen, want, timeouts=3)
    line = D.describe_status(st, pe=0, num_slots=2, deadline_s=3.0)
    assert line == ("rank 0: watchdog: the device waited 3s (wait_timeout_s=3) for route+layout generation e5:c0 "
                    "(0x500000001) of source rank 1 (chunk 0, slot 0); it last saw e4:c4 (0x400000005): rank 1 is "
                    "dead, stopped or stuck (violations 0, timeouts 3)"), line


@pytest.mark.parametrize("name,src,chunk,seen,want,field,needles", [
    ("RE_REUSE_TIMEOUT", 0, 2, 0x1, 0x3, -1, ["reuse of my slot", "my chunk 2", "from ranks [1]", "0x1 of 0x3"]),
    ("RE_DRAIN_TIMEOUT", 0, 4, 0x5, 0x7, -1, ["end-of-stream drain", "from ranks [1]"]),
    ("RE_COMBINE_TIMEOUT", -1, 3, 12, 40, -1, ["result rows of my chunk 3: 12 of 40 arrived"]),
    ("RE_ACQUIRE_TIMEOUT", 0, 1, 0x6, 0, -1, ["chunk 1 of any of the source ranks [1, 2]", "ready source order"]),
    ("RE_META", 1, 1, 4, 3, 2, ["violation: metadata of source rank 1, chunk 1, slot 1: valid count = 0x4, "
                                "expected 0x3"]),
    ("RE_NEWER_GEN", 1, 1, (3 << 32) | 4, (3 << 32) | 2, -1, ["source rank 1 signalled generation e3:c3",
                                                              "e3:c1 (0x300000002) was expected"]),
    ("RE_COMBINE_COUNT", -1, 0, 44, 40, -1, ["44 result rows arrived for my chunk 0, 40 expected"]),
    ("RE_DOUBLE_ACK", 1, 0, 1, 1, -1, ["double acknowledgement (source rank 1, chunk 0, slot 0"]),
])
def test_describe_every_error_code(name, src, chunk, seen, want, field, needles):
    from streamring.device import ringdesc as D

    timeout = D.ERROR_CODES[name] in D.TIMEOUT_CODES
    st = _words(name, src, chunk, seen, want, field=field, violations=0 if timeout else 1, timeouts=int(timeout))
    line = D.describe_status(st, pe=0, num_slots=2, deadline_s=2.5)
    assert line.startswith("rank 0: " + ("watchdog: " if timeout else "device ring violation: ")), line
    for n in needles:
        assert n in line, (n, line)


def test_describe_no_error_and_bad_routes_only():
    from streamring.device import ringdesc as D

    st = D.decode_status([0] * D.RS_WORDS)
    assert D.describe_status(st, pe=3) == ""
    st["bad_routes"] = 2
    line = D.describe_status(st, pe=3)
    assert line.startswith("rank 3: device ring violation: 2 routes (topk_idx)") and "[-1, num_experts)" in line


# --------------------------------------------------------------------------------------------
# A GPU rank fails: the configuration, the survivor's error, the GPU check's judges
# --------------------------------------------------------------------------------------------
def test_run_fault_is_checked_before_launch():
    from streamring.config import ConfigError
    from streamring.runner import check_run_job

    ok = load_config(None, FAST + ["run.fault={rank: 1, epoch: 1, kind: hang}", "run.epochs=3"], backend="nvshmem")
    check_run_job(ok, 2)
    for extra, ranks, needle in ((["run.fault={rank: 2}"], 2, r"run.fault.rank must be in \[0, 2\)"),
                                 (["run.fault={rank: 1, epoch: 3}", "run.epochs=3"], 2,
                                  r"run.fault.epoch must be in \[0, run.epochs=3\), got 3"),
                                 (["run.fault={rank: 1}", "run.mode=batch"], 2, "run.mode must be 'both' or 'stream'")):
        with pytest.raises(ConfigError, match=needle):
            check_run_job(load_config(None, FAST + extra, backend="nvshmem"), ranks)
    with pytest.raises(ConfigError, match="the CPU backend's rank-failure test is stress.fault"):
        check_run_job(load_config(None, ["run.fault={rank: 1}"]), 2)


def _survivor_error(seen_epoch=2, want_epoch=3, chunk=0, elapsed=3.04):
    """What the surviving rank prints: DeviceRing.check's error, as abort_job writes it."""
    from types import SimpleNamespace

    from streamring.ring.device import DeviceRing
    from streamring.ring.protocol import WatchdogError

    st = _words("RE_ACQUIRE_TIMEOUT", 1, chunk, (seen_epoch << 32) | 5, (want_epoch << 32) | (chunk + 1), timeouts=3)
    ring = SimpleNamespace(me=0, layout=SimpleNamespace(num_slots=2), deadline_s=3.0)
    with pytest.raises(WatchdogError) as info:
        DeviceRing.check(ring, st, elapsed_s=elapsed)
    return f"[streamring rank 0] error: WatchdogError: {info.value}"


def test_survivor_error_is_one_line_naming_source_chunk_generation():
    text = _survivor_error()
    first = text.splitlines()[0]
    assert first.endswith("of source rank 1 (chunk 0, slot 0); it last saw e2:c4 (0x200000005): rank 1 is dead, "
                          "stopped or stuck (violations 0, timeouts 3); noticed 3.04s after the forward's launch"), first
    assert "generation e3:c0 (0x300000001)" in first and "device status: {" in text.splitlines()[1]


def test_ring_check_passes_a_clean_status_and_reports_an_unfinished_forward():
    from types import SimpleNamespace

    from streamring.device import ringdesc as D
    from streamring.ring.device import DeviceRing
    from streamring.ring.protocol import ProtocolViolation, WatchdogError

    ring = SimpleNamespace(me=1, layout=SimpleNamespace(num_slots=2), deadline_s=3.0)
    clean = D.decode_status([0] * D.RS_WORDS)
    DeviceRing.check(ring, clean)
    with pytest.raises(WatchdogError, match=r"rank 1: watchdog: the forward did not finish within 11s"):
        DeviceRing.check(ring, clean, finished=False, host_deadline_s=11)
    with pytest.raises(ProtocolViolation, match="metadata of source rank 0, chunk 2, slot 0: valid count = 0x5"):
        DeviceRing.check(ring, _words("RE_META", 0, 2, 5, 4, field=D.META_VALID, violations=1))


def _faulted_ring(**waits):
    """A ring whose wait beacon holds ``waits`` (kind -> (code name, src, chunk, want))."""
    from types import SimpleNamespace

    import torch

    from streamring.device import ringdesc as D
    from streamring.ring.device import DeviceRing

    words = [0] * D.WB_WORDS
    for kind, (code, src, chunk, want) in waits.items():
        k = D.WB_KINDS.index(kind)
        words[2 * k + D.WB_PACKED] = D.ERROR_CODES[code] | ((src & 0xFFFF) << 8) | (chunk << 24)
        words[2 * k + D.WB_WANT] = want
    ring = SimpleNamespace(me=0, layout=SimpleNamespace(num_slots=2), wait_beacon_t=torch.tensor(words))
    ring.slow_waits = lambda: DeviceRing.slow_waits(ring)
    return ring


def test_device_fault_names_the_slow_waits_from_the_beacon():
    """A peer that died under MPS takes its heap with it; this PE's next access faults and its status words
    are lost. The wait beacon (host memory) still says what the device waited for, a source's chunk first,
    in the words the GPU check's judge reads."""
    from streamring.ring.device import DeviceRing

    exc = RuntimeError("CUDA error: an illegal memory access was encountered\nSearch for ...")
    ring = _faulted_ring(ack=("RE_REUSE_TIMEOUT", 0, 0, 0b10), acquire=("RE_ACQUIRE_TIMEOUT", 1, 0, (3 << 32) | 1))
    first = DeviceRing.describe_fault(ring, exc, 0.41).splitlines()[0]
    assert first.startswith("rank 0: watchdog: the device waited for route+layout generation e3:c0 (0x300000001) of "
                            "source rank 1 (chunk 0, slot 0), then its context failed (CUDA error: an illegal memory "
                            "access was encountered)"), first
    assert "it also waited for the acknowledgements of my chunk 0, slot 0 from ranks [1] (the reuse of my slot)" in \
        first and first.endswith("noticed 0.41s after the forward's launch"), first
    ok, note = _steps().survivor_report(f"[streamring rank 0] error: WatchdogError: {first}")
    assert ok and "waited for rank 1 chunk 0 generation e3:c0" in note, note
    # the acknowledgement wait alone is also what the judge accepts (a peer that never acknowledged)
    acks = DeviceRing.describe_fault(_faulted_ring(ack=("RE_REUSE_TIMEOUT", 0, 4, 0b10)), exc, 0.3).splitlines()[0]
    ok, note = _steps().survivor_report(acks)
    assert ok and "acknowledgement of chunk 4" in note, (note, acks)
    # ready order, and the combine's arrival wait
    assert "chunk 3 of any of the source ranks [1, 2] (ready source order)" in DeviceRing.describe_fault(
        _faulted_ring(acquire_any=("RE_ACQUIRE_TIMEOUT", 1, 3, 0b110)), exc)
    assert "the result rows of my chunk 2 (40 expected)" in DeviceRing.describe_fault(
        _faulted_ring(combine=("RE_COMBINE_TIMEOUT", -1, 2, 40)), exc)
    # no slow wait before the fault: said so, no invented source
    bare = DeviceRing.describe_fault(_faulted_ring(), exc).splitlines()[0]
    assert "before any of its waits went slow" in bare and "source rank" not in bare, bare


def test_wait_forward_blames_a_peer_only_with_evidence(monkeypatch):
    """A device fault during the forward becomes a WatchdogError naming the pending wait only when a wait
    is pending (the beacon) or the host names a dead peer; any other CUDA error is raised as it is."""
    from streamring.ring import device as DR
    from streamring.ring.protocol import WatchdogError

    class Faulted:
        def query(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(DR, "DIAGNOSTIC_HOOKS", [])
    quiet = _faulted_ring()
    quiet.describe_fault = lambda exc, elapsed=None: DR.DeviceRing.describe_fault(quiet, exc, elapsed)
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        DR.DeviceRing.wait_forward(quiet, Faulted(), 5.0)
    assert not isinstance(info.value, WatchdogError)
    pending = _faulted_ring(acquire=("RE_ACQUIRE_TIMEOUT", 1, 0, (3 << 32) | 1))
    pending.describe_fault = lambda exc, elapsed=None: DR.DeviceRing.describe_fault(pending, exc, elapsed)
    with pytest.raises(WatchdogError, match=r"waited for route\+layout generation e3:c0"):
        DR.DeviceRing.wait_forward(pending, Faulted(), 5.0)
    monkeypatch.setattr(DR, "DIAGNOSTIC_HOOKS", [lambda: "peers not running normally:\n  rank 1 (pid 7): not running"])
    with pytest.raises(WatchdogError, match="before any of its waits went slow") as info:
        DR.DeviceRing.wait_forward(quiet, Faulted(), 5.0)
    assert "rank 1 (pid 7): not running" in str(info.value)


def test_replay_holds_a_sigterm_until_the_forward_ends():
    """torchrun SIGTERMs the other workers when one dies: the survivor first finishes its forward (its
    device waits end at their deadline) and says what it waited for, then stops."""
    import os
    import signal

    from streamring.ring.protocol import WatchdogError
    from streamring.runner import replay_checked

    class Layer:
        instrument = None  # no protocol mutation: its replay is checked

        def __init__(self, error):
            self.error = error

        def replay(self, graph):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the forward runs
            if self.error:
                raise WatchdogError("rank 0: watchdog: the device waited 3s ...")
            return {}

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(WatchdogError, match="the device waited 3s"):
        replay_checked(Layer(error=True), None)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        replay_checked(Layer(error=False), None)
    assert signal.getsignal(signal.SIGTERM) == before


def _steps():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_steps",
                                                  Path(__file__).resolve().parents[2] / "launch/gpu_check_steps.py")
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    return steps


MPIRUN_ABORT = """--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD
with errorcode 1.
"""
TORCHRUN_ROOT_CAUSE = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
streamring FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_10:00:00
  host      : h200
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""
LOCAL_LAUNCHER = ("streamring launcher: rank 1 (pid 4242) was the first rank to stop running (T (stopped)): the "
                  "failed rank\n")


class _Probes:
    """Fake process/GPU probes: the job's processes and memory go away after ``settle`` polls."""

    def __init__(self, settle=2, before=(1000,), after=(1100,), apps_after=()):
        self.polls, self.settle, self.before, self.after, self.apps_after = 0, settle, list(before), list(after), \
            list(apps_after)
        self.d = {"memory": self.memory, "apps": self.apps, "processes": self.processes, "sleep": lambda s: None}

    def memory(self):
        return self.before if self.polls == 0 else (self.after if self.polls > self.settle else [60000])

    def apps(self):
        return ["4242, python3, 2048 MiB"] if self.polls <= self.settle else self.apps_after

    def processes(self, marker):
        self.polls += 1
        return [f"4242 python3 -m streamring run --json {marker}"] if self.polls <= self.settle else []


@pytest.mark.parametrize("launcher,tail", [("mpirun", MPIRUN_ABORT), ("torchrun", TORCHRUN_ROOT_CAUSE),
                                           ("local", LOCAL_LAUNCHER)])
def test_fault_judge_on_recorded_outputs(launcher, tail):
    steps = _steps()
    out = "rank 1: run.fault: SIGKILL of this rank (pid 4242) in the streamed forward\n" + _survivor_error() + "\n" + tail
    probes = _Probes()
    ok, note = steps.fault_judge(launcher, "/tmp/streamring-check/fault-x.json", probes.d)(1, out, None)
    assert ok, note
    assert "(a) ok: waited for rank 1 chunk 0 generation e3:c0, noticed after 3.04s" in note, note
    assert "(c) ok" in note and "clean-up ok: 0 processes left" in note, note


def test_fault_judge_refuses_what_is_missing():
    steps = _steps()

    def judge(out, rc=1, probes=None):
        return steps.fault_judge("mpirun", "m", (probes or _Probes()).d)(rc, out, None)

    ok, note = judge(MPIRUN_ABORT)
    assert not ok and "(a) FAILED: no 'rank 0: watchdog" in note, note
    ok, note = judge(_survivor_error(elapsed=7.5) + "\n" + MPIRUN_ABORT)
    assert not ok and "noticed after 7.50s (deadline 3s)" in note, note
    ok, note = judge(_survivor_error() + "\n" + MPIRUN_ABORT, rc=0)
    assert not ok and "(b) FAILED: rc=0" in note, note
    # mpirun under orte_enable_recovery exits 0 after an abort: its own line that rank 0 aborted with a
    # non-zero code stands in for the exit code, and only then
    recovering = steps.fault_judge("mpirun", "m", _Probes().d, mpirun_recovery=True)
    ok, note = recovering(0, _survivor_error() + "\n" + MPIRUN_ABORT, None)
    assert ok and "rank 0 aborted with errorcode 1" in note, note
    ok, note = recovering(0, _survivor_error() + "\n" + MPIRUN_ABORT.replace("errorcode 1", "errorcode 0"), None)
    assert not ok and "(b) FAILED: rc=0" in note, note
    ok, note = recovering(0, MPIRUN_ABORT, None)
    assert not ok and "(b) FAILED" in note, note
    ok, note = judge(_survivor_error())
    assert not ok and "(c) FAILED: mpirun named no rank" in note, note
    stuck = _Probes(settle=10**6)
    ok, note = judge(_survivor_error() + "\n" + MPIRUN_ABORT, probes=stuck)
    assert not ok and "clean-up FAILED: 1 processes left" in note and "2048 MiB" in note, note
    leaked = _Probes(after=(1000 + 600,))
    ok, note = judge(_survivor_error() + "\n" + MPIRUN_ABORT, probes=leaked)
    assert not ok and "memory used [1600] MiB (before [1000])" in note, note


def test_mutate_and_sanitize_judges_on_recorded_outputs(monkeypatch):
    steps = _steps()
    seen = {}
    monkeypatch.setattr(steps, "run_step", lambda state, name, cmd, timeout, **kw: seen.update(kw, cmd=cmd))
    steps.phase_mutate({"steps": []})
    assert seen["cmd"][1:3] == ["tests/mutate.py", "--gpu"]
    table = ("│ ack-before-copy │ the EP dispatch acknowledges │ ep_buffer.py │ 1/1 │ caught │ AssertionError │ 31 │\n"
             "│ acquire-fence-dropped │ the device acquire │ ring_protocol.cuh │ 0/1 │ MISSED │  │ 40 │\n"
             "1 of 2 mutations caught\n")
    ok, note = seen["judge"](1, table, None)
    assert not ok and note.startswith("1 of 2 mutations caught") and "MISSED" in note, note
    ok, note = seen["judge"](0, table.replace("1 of 2", "2 of 2").replace("MISSED", "caught"), None)
    assert ok, note
    steps.phase_sanitize({"steps": []})
    out = ("sanitize: memcheck ring: PASS (plain run) ERROR SUMMARY: 0 errors\n"
           "sanitize: racecheck ep: NOT RUN (budget of 120s spent)\nsanitize: clean (elapsed 118s)\n")
    ok, note = seen["judge"](0, out, None)
    assert ok and "memcheck ring: PASS" in note and "racecheck ep: NOT RUN" in note, note
    assert not seen["judge"](3, "sanitize: compute-sanitizer not found on this host", None)[0]


def test_gpu_check_names_the_command_that_resumes_the_steps_its_budget_skipped():
    """A check stopped by its budget prints a GPU_CHECK_ONLY command whose regex selects exactly the skipped steps
    (as run_step matches "<name> pes=<PEs>"), special characters of the names escaped; none when nothing was skipped."""
    import importlib.util
    import re
    import shlex
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_check_steps",
                                                  Path(__file__).resolve().parents[2] / "launch/gpu_check_steps.py")
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    ran = [{"name": "stress --inject skip-acquire (stress-basic.yaml)", "pes": 3, "verdict": "PASS", "note": ""},
           {"name": "stress --inject signal-before-payload (stress-basic.yaml)", "pes": 3, "verdict": "SKIP",
            "note": "time budget spent (483s of 500s)"},
           {"name": "soak (soak-ci.yaml, 1000 chunks x 2 epochs)", "pes": 4, "verdict": "SKIP",
            "note": "time budget spent (483s of 500s)"},
           {"name": "EP layer run: policy green_ctx", "pes": 2, "verdict": "SKIP", "note": "n/a under MPS"}]
    cmd = steps.resume_command(ran)
    assert cmd and cmd.endswith(" bash launch/gpu_check.sh"), cmd
    rx = shlex.split(cmd.split(" bash ")[0])[0].split("=", 1)[1]
    chosen = [s["name"] for s in ran if re.search(rx, f"{s['name']} pes={s['pes']}")]
    assert chosen == [ran[1]["name"], ran[2]["name"]], chosen
    assert not re.search(rx, f"{ran[1]['name']} pes=4")  # the PE count is part of the match
    assert steps.resume_command(ran[:1]) is None
