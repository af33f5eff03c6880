"""Does the test suite bite? Plant each deliberate bug in a temporary copy and run the tests that must catch it.

    python tests/mutate.py                  # every CPU mutation (several minutes; on demand, not in CI)
    python tests/mutate.py --gpu            # the GPU mutations instead (on a GPU machine; cubin rebuilt per copy)
    python tests/mutate.py --only NAME ...  # some of them (--list shows the names)
    python tests/mutate.py --no-baseline    # skip the run of the same tests on the unmutated copy

Each mutation is a list of edits ``(file, exact original snippet, replacement)`` and the tests that must
catch it. An edit whose snippet is not found exactly once stops the script: a mutation cannot rot
silently when the code it breaks changes. Per mutation the script copies the repository to a
temporary directory, applies the edits there, checks that the pytest process and MPI ranks started
from the copy import the copy's ``streamring`` (PYTHONPATH points at the copy; tests/conftest.py puts
its own root first for the ranks it starts), and runs the tests with pytest in the copy.

A mutation is *caught* when pytest reports failed tests (exit 1) - all of its tests when the entry
says so. Any other pytest exit (usage or collection error, nothing collected, a timeout) is an ERROR:
the mutation did not get a fair run. First, the union of all selected tests runs on an unmutated
copy and must pass, so a failure below is the mutation's doing. Exit status 0 iff every mutation is
caught.

The GPU mutations (``--gpu``; the group is left out otherwise, and without a GPU ``--gpu`` says so and
runs nothing) break the device protocol and the EP layer's handoffs; their tests need a GPU. In each
mutated copy the CUDA library is rebuilt first (``python -m streamring.device.build``: the cubin cache is
keyed by the sources' hash, so a mutated ``csrc/`` builds a cubin of its own and an unmutated one reuses
the cached cubin); a failed build is an ERROR, not a catch.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclass(frozen=True)
class Mutation:
    name: str
    rule: str  # what it breaks
    edits: tuple  # (file relative to the repository root, exact original snippet, replacement)
    tests: tuple  # pytest node ids
    need_all: bool = False  # caught only if every listed test fails (else: at least one)
    gpu: bool = False  # needs a GPU: run with --gpu only


RING = "tests/ranks/test_ring_rules.py::test_scripted_ring_rules[shared]"
HOSTILE = "tests/ranks/test_ring_rules.py::test_hostile_peer_table[shared]"
READY = tuple(f"tests/ranks/test_source_order.py::test_stress_ready_order_still_catches_mutations[{m}]"
              for m in ("skip-ack-wait-stress-basic.yaml", "ignore-epoch-stress-aba.yaml",
                        "skip-acquire-stress-basic.yaml"))

MUTATIONS = [
    # -- the ring's own rules ---------------------------------------------------------------------------
    Mutation("skip-acquire", "a consumer reads before the generations are published",
             (("streamring/ring/protocol.py", "        return self.gen_state(src, chunk) is GenState.READY\n",
               "        return self.gen_state(src, chunk) is not GenState.VIOLATION\n"),), (RING,)),
    Mutation("acquire-route-only", "a consumer needs both generations before a read (rule 5)",
             (("streamring/ring/protocol.py",
               '        for field_name, off in (("route_ready_gen", L.route_gen_off(src, slot)),\n'
               '                                ("layout_ready_gen", L.layout_gen_off(src, slot))):\n',
               '        for field_name, off in (("route_ready_gen", L.route_gen_off(src, slot)),):\n'),), (RING,)),
    Mutation("signal-before-payload", "payload before generation (rule 1)",
             (("streamring/ring/protocol.py",
               "            write()\n"
               "            # Rule 1: signal_op is a release; the payload stores above are ordered before it.\n"
               "            self._publish(offset_fn, gen)\n",
               "            self._publish(offset_fn, gen)\n            write()\n"),), (RING,)),
    Mutation("skip-ack-wait", "reuse only after every acknowledgement (rule 3): first lap unguarded",
             (("streamring/ring/protocol.py", "        if prev >= 0 and self.inject is not Inject.SKIP_ACK_WAIT:\n",
               "        if prev > 0 and self.inject is not Inject.SKIP_ACK_WAIT:\n"),), (RING,)),
    Mutation("full-mask-off-by-one", "the full acknowledgement mask misses the last rank",
             (("streamring/ring/layout.py", "        n = min(64, self.num_ranks - lo)\n",
               "        n = min(64, self.num_ranks - lo - 1)\n"),), (RING,)),
    Mutation("ignore-epoch", "the epoch in the generation comparison (rule 6, ABA)",
             (("streamring/ring/layout.py", "    if ignore_epoch:\n        observed &= SEQ_MASK\n",
               "    if True:\n        observed &= SEQ_MASK\n"),), (RING, HOSTILE)),
    Mutation("mask-not-cleared", "the owner clears the mask before reuse (rule 4)",
             (("streamring/ring/protocol.py", "        for w in range(L.mask_words):\n"
                                         "            self.heap.signal_op(self.buf, L.ack_word_off(slot, w), 0, "
                                         "SignalOp.SET, self.me)\n",
               "        for w in range(0):\n"
               "            self.heap.signal_op(self.buf, L.ack_word_off(slot, w), 0, SignalOp.SET, self.me)\n"),),
             (RING,)),
    Mutation("end-stream-without-drain", "the stream end drains every acknowledgement (rule 8)",
             (("streamring/ring/protocol.py", "            if chunk >= 0:\n                yield from self.wait_steps(",
               "            if chunk >= 0 and False:\n                yield from self.wait_steps("),), (RING,)),
    # -- hostile peers ----------------------------------------------------------------------------------
    Mutation("topk-accepts-E", "peer topk_idx validated: E is out of range",
             (("streamring/ring/protocol.py",
               "        if topk_idx.size and (topk_idx.min() < -1 or topk_idx.max() >= E):\n",
               "        if topk_idx.size and (topk_idx.min() < -1 or topk_idx.max() > E):\n"),), (HOSTILE,)),
    Mutation("layout-gen-unchecked", "peer metadata validated: layout generation",
             (("streamring/ring/protocol.py",
               '            checks += [("route_gen", int(meta[META_ROUTE_GEN]), g), '
               '("layout_gen", int(meta[META_LAYOUT_GEN]), g)]\n',
               '            checks += [("route_gen", int(meta[META_ROUTE_GEN]), g)]\n'),), (HOSTILE,)),
    # -- the MoE layer ----------------------------------------------------------------------------------
    Mutation("combine-topk-reversed", "the combiner sums the top-k terms in the reference's order",
             (("streamring/moe/layer.py",
               "                self.y[base:base + valid] = combine(torch.from_numpy(contrib).to(self.dev), w, idx)\n",
               "                self.y[base:base + valid] = combine(torch.from_numpy(contrib).flip(1).to(self.dev), "
               "w.flip(1), idx.flip(1))\n"),),
             ("tests/ranks/test_scenarios.py::test_bitwise_oracle",
              "tests/ranks/test_scenarios.py::test_fuzzed_forward_inputs[3]")),
    Mutation("l2-stores-padding-rows", "the Triton L2 stores only the rows of a block that hold a route",
             (("streamring/device/moe_triton.py", "mask=(tl.arange(0, BM) < used)[:, None])",
               "mask=(tl.arange(0, BM) < BM)[:, None])"),),
             ("tests/unit/test_blocks.py::test_l2_stores_only_the_rows_that_hold_a_route",)),
    Mutation("l2-drops-a-routed-row", "a sealed partial block's routed rows are all computed and stored",
             (("streamring/device/block_alloc.py", "        rows_ready = fill_new % BM\n",
               "        rows_ready = fill_new % BM - 1\n"),),
             ("tests/unit/test_blocks.py::test_l2_stores_only_the_rows_that_hold_a_route",
              "tests/unit/test_blocks.py::test_batch_matches_float32_emulation"), need_all=True),
    Mutation("seal-keeps-partial-blocks-last", "the sealing call's range is laid out expert by expert",
             (("streamring/device/block_alloc.py", "    if SEAL and BY_EXPERT:\n", "    if False:\n"),),
             ("tests/unit/test_seal_by_expert.py::test_the_sealing_range_is_laid_out_expert_by_expert",)),
    Mutation("reservation-without-seal", "the reservation scheduler's seal rule (no deadlock on reuse)",
             (("streamring/moe/layer.py",
               "                seal(lambda rows, lim=n - S: min(r[1] for r in rows) <= lim)\n", ""),),
             ("tests/ranks/test_moe_run.py::test_streamed_equals_batch[tokens-0-1-odd-many-wraps-reservation]",)),
    # -- progress and harness ---------------------------------------------------------------------------
    Mutation("spin-pause-never-yields", "a waiting rank gives its core away",
             (("streamring/device/verbs.py", "    os.sched_yield()\n", "    pass\n"),),
             ("tests/ranks/test_ring_rules.py::test_waiting_rank_gives_its_core_away",)),
    Mutation("ready-order-consumer-crashes", "the ready-order mutation tests demand the expected failure",
             (("streamring/verify/stress.py", "if any(p < batch[-1] and p not in batch for p in pending):",
               "if any(p < batch and p not in batch for p in pending):"),), READY, need_all=True),
    # -- the symmetric heap's regions -------------------------------------------------------------------
    Mutation("region-compare-after-free", "freeing a region next to a leaked one frees only that region",
             (("streamring/device/verbs.py", "@dataclass(frozen=True, eq=False)\nclass Region:",
               "@dataclass(frozen=True)\nclass Region:"),
              ("streamring/device/cpu.py",
               "        self._regions[:] = [r for r in self._regions if r is not region]\n",
               ""),
              ("streamring/device/cpu.py",
               "            self._blocked = None\n        win.Free()\n",
               "            self._blocked = None\n        win.Free()\n        self._regions.remove(region)\n")), (RING,)),
]

GPU_RULES = "tests/gpu/test_gpu_ep_rules.py"
GPU_MUTATIONS = [
    Mutation("acquire-fence-dropped", "the device acquire: ld.acquire.sys of the generations and the fence after",
             (("streamring/device/csrc/ring_protocol.cuh",
               "            uint64_t seen = ld_acquire_sys_u64(words[k]);  // acquire (system scope)\n",
               "            uint64_t seen = ld_relaxed_sys_u64(words[k]);\n"),
              ("streamring/device/csrc/ring_protocol.cuh",
               "    fence_acq_rel_sys();\n"
               "    return true;\n",
               "    return true;\n")),
             # one GPU does not reorder the loads in practice, so the compiled PTX is what shows it
             (f"{GPU_RULES}::test_ring_selftest_under_stress",
              "tests/unit/test_ptx_ring.py::test_the_acquire_is_ordered_in_the_compiled_kernels"), gpu=True),
    Mutation("ack-before-copy", "the EP dispatch acknowledges a slot only after copying its rows out",
             (("streamring/moe/ep_dispatch.py",
               "            bc.dispatch_ep(c, flat_e, flat_w, srcs, (ring_u8, ring_u8.view(torch.float32)), "
               "(d_u8, d_f32),\n"
               "                           (L.x_off(s), L.x_sf_off(s) // 4), step=path.step_index[c, j], "
               "pull=\"token\",\n"
               "                           on_slot_released=release)\n",
               "            release()\n"
               "            bc.dispatch_ep(c, flat_e, flat_w, srcs, (ring_u8, ring_u8.view(torch.float32)), "
               "(d_u8, d_f32),\n"
               "                           (L.x_off(s), L.x_sf_off(s) // 4), step=path.step_index[c, j], "
               "pull=\"token\",\n"
               "                           on_slot_released=None)\n"),),
             (f"{GPU_RULES}::test_slow_copy_keeps_its_slot",), gpu=True),
    Mutation("arrival-counter-not-reset", "the owner resets its arrival counters after each reduce",
             (("streamring/moe/ep_combine.py", "            self.arrived[:path.num_chunks].zero_()\n", ""),),
             (f"{GPU_RULES}::test_arrival_counters_start_from_zero_every_forward[serialized]",
              f"{GPU_RULES}::test_arrival_counters_start_from_zero_every_forward[spin_kernel]"), gpu=True),
    Mutation("meta-valid-off-by-one", "the device metadata check: a valid count past the slot is refused",
             (("streamring/device/csrc/ring_protocol.cuh",
               "    if (valid > (uint64_t)d->tokens_per_slot) {\n",
               "    if (valid > (uint64_t)d->tokens_per_slot + 1) {\n"),),
             ("tests/gpu/test_gpu_hostile.py::test_device_hostile_table_one_pe",), gpu=True),
]

IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis",
                                "docs", "*.png", ".whl", ".site", ".cache", ".gemm-build", "out")


def copy_repo(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, ignore=IGNORE)
    return dest


def apply(copy: Path, m: Mutation) -> None:
    """Apply ``m``'s edits under ``copy``; stop the script if a snippet is not there exactly once."""
    for rel, old, new in m.edits:
        path = copy / rel
        text = path.read_text()
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"mutation {m.name}: the snippet to replace occurs {n} times in {rel} (expected "
                             f"once); update tests/mutate.py to the current code:\n{old}")
        path.write_text(text.replace(old, new))


def env_for(copy: Path) -> dict:
    """The environment of the runs in ``copy``: no MPI rank identity, and the copy instead of this
    repository on PYTHONPATH (other entries, such as a GPU machine's carried packages, stay)."""
    keep = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "HYDRA_", "OMPI_", "PMIX_")) or k.startswith(keep)}
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if p and Path(p).resolve() != ROOT.resolve()]
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *others])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def gpu_missing() -> str | None:
    """Why the GPU mutations cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not importable"
    return None if torch.cuda.is_available() else "no CUDA GPU here (torch.cuda.is_available() is False)"


def build_cubin(copy: Path, timeout_s: int) -> tuple[bool, str]:
    """Build the copy's CUDA library (a mutated csrc/ gets a cubin of its own: the cache key is its hash)."""
    try:
        p = subprocess.run([PY, "-m", "streamring.device.build", "-v"], capture_output=True, text=True, cwd=copy,
                           env=env_for(copy), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"cubin build timed out after {timeout_s}s"
    built = [ln for ln in p.stderr.splitlines() if ln.startswith("streamring build: built") or "cached" in ln]
    return p.returncode == 0, (built[-1] if built else (p.stderr.strip().splitlines() or [f"rc={p.returncode}"])[-1])


def check_imports_copy(copy: Path) -> None:
    """The pytest process and MPI ranks started from the copy must import the copy's package."""
    code = "import os, streamring; print(os.path.realpath(streamring.__file__))"
    mpiexec = Path(PY).parent / "mpiexec"
    runs = {"python": [PY, "-c", code],
            "2 MPI ranks": [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", "2", PY, "-c", code]}
    want = os.path.realpath(copy)
    for what, cmd in runs.items():
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=copy, env=env_for(copy), timeout=120)
        paths = p.stdout.split()
        if p.returncode or not paths or not all(x.startswith(want + os.sep) for x in paths):
            raise SystemExit(f"{what} started in {copy} did not import its streamring: {paths or p.stderr[-500:]}")


def run_tests(copy: Path, tests, timeout_s: int) -> tuple[int, str, float]:
    t0 = time.monotonic()
    # -vv: assertion messages in full (they carry the ranks' stdout and stderr)
    cmd = [PY, "-m", "pytest", "-q", "-vv", "-rf", "--tb=short", "-p", "no:cacheprovider", *tests]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=copy, env=env_for(copy), timeout=timeout_s)
        return p.returncode, p.stdout + p.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as exc:
        return -1, f"timed out after {timeout_s}s\n{exc.stdout or ''}", time.monotonic() - t0


def failed_tests(output: str) -> list[str]:
    return re.findall(r"^FAILED (\S+)", output, flags=re.M)


def first_reason(output: str) -> str:
    """The most telling line of a failed run: a rank's error line, a crash, or an assertion's message."""
    lines = [re.sub(r"^E\s+", "", ln).strip() for ln in output.splitlines()]
    patterns = (r"\] error: \w+: ", r"EXIT STRING: ", r"^\w*(Error|Violation|Exception): (?!rc=)")
    for pat in patterns:
        for ln in lines:
            if re.search(pat, ln):
                return ln
    return next((ln for ln in lines if ln.startswith("FAILED ")), "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the same tests")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run (default 900)")
    ap.add_argument("--logs", metavar="DIR", help="write each mutation's pytest output to DIR/NAME.log")
    ap.add_argument("--gpu", action="store_true", help="the GPU mutations instead of the CPU ones (needs a GPU)")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    everything = MUTATIONS + GPU_MUTATIONS
    chosen = [m for m in everything if m.gpu == args.gpu]
    if args.only:
        unknown = set(args.only) - {m.name for m in everything}
        if unknown:
            ap.error(f"unknown mutation(s) {sorted(unknown)}; known: {[m.name for m in everything]}")
        chosen = [m for m in chosen if m.name in args.only]
        if not chosen:
            ap.error(f"{args.only} are {'CPU' if args.gpu else 'GPU'} mutations: run them "
                     f"{'without' if args.gpu else 'with'} --gpu")
    if args.list:
        for m in everything:
            tag = "\\[gpu] " if m.gpu else ""  # (escaped: rich would read [gpu] as markup)
            console.print(f"{m.name:30} {tag}{m.rule}")
        return 0
    if args.gpu and gpu_missing():
        console.print(f"GPU mutations not run: {gpu_missing()}; run `python tests/mutate.py --gpu` on a GPU machine")
        return 0

    with tempfile.TemporaryDirectory(prefix="streamring-mutate-") as tmp:
        tmp = Path(tmp)
        # Every edit must apply to the current code before anything runs (fail loudly, at once).
        probe = copy_repo(tmp / "probe")
        for m in chosen:
            apply(probe, m)
        shutil.rmtree(probe)
        build_s = 600
        if not args.no_baseline:
            tests = sorted({t for m in chosen for t in m.tests})
            base = copy_repo(tmp / "baseline")
            check_imports_copy(base)
            if args.gpu:
                ok, what = build_cubin(base, build_s)
                if not ok:
                    console.print(f"[red]baseline: the unmutated copy's cubin did not build: {what}[/red]")
                    return 2
            console.print(f"baseline: {len(tests)} tests on the unmutated copy ...")
            rc, out, secs = run_tests(base, tests, args.timeout)
            if rc != 0:
                console.print(out[-4000:])
                console.print(f"[red]baseline failed (pytest exit {rc}): fix the suite before judging mutations[/red]")
                return 2
            console.print(f"baseline passed in {secs:.0f}s")
            shutil.rmtree(base)
        table = Table(title="streamring mutations: each planted in a temporary copy, its tests run there")
        for col in ("mutation", "breaks", "file", "tests failed", "verdict", "how it was caught", "s"):
            table.add_column(col, overflow="fold", ratio=4 if col == "how it was caught" else None)
        results = []
        for m in chosen:
            copy = copy_repo(tmp / m.name)
            apply(copy, m)
            check_imports_copy(copy)
            built, what = build_cubin(copy, build_s) if m.gpu else (True, "")
            console.print(f"{m.name}: {what + '; ' if what else ''}running {len(m.tests)} test(s) ...")
            if built:
                rc, out, secs = run_tests(copy, m.tests, args.timeout)
            else:
                rc, out, secs = -2, f"the mutated copy's cubin did not build: {what}", 0.0
            failed = failed_tests(out)
            if rc == 1 and failed and (len(failed) == len(m.tests) or not m.need_all):
                verdict = "[green]caught[/green]"
            elif rc == 0 or rc == 1:
                verdict = "[red]MISSED[/red]"
            else:
                verdict = f"[yellow]ERROR (pytest exit {rc})[/yellow]"
            results.append("caught" in verdict)
            first = first_reason(out) if rc == 1 else (out.strip().splitlines() or [""])[-1]
            if args.logs:
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                (Path(args.logs) / f"{m.name}.log").write_text(out)
            table.add_row(m.name, m.rule, ", ".join(sorted({e[0].split("/")[-1] for e in m.edits})),
                          f"{len(failed)}/{len(m.tests)}", verdict, first[:240], f"{secs:.0f}")
            shutil.rmtree(copy)
        console.print(table)
        console.print(f"{sum(results)} of {len(results)} mutations caught")
        return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
