"""Every fenced block of README.md and docs/*.md, and how the suite runs it (the table :data:`HOW`).

A block is found by its file and its place among that file's fenced blocks; the table entry names the block's
language and a piece of its text, so a block added, moved or rewritten makes the suite fail until its entry
says how to run it. The kinds:

* :class:`Ranks`: Python run on 2 real CPU ranks (``mpiexec -n 2``, tests/helpers/mp_doc_examples.py), the
  blocks of one ``group`` in one namespace, in the order of the docs;
* :class:`Emulated`: Python of the GPU buffer run in-process on the emulated device
  (tests/helpers/emulated_device.py), one namespace per ``group``;
* :class:`GpuOnly`: Python that needs a CUDA GPU (CUDA graphs): compiled, its imports run, its reason given;
* :class:`Commands`: shell commands, checked, not run (each says why): every ``streamring`` command parses with
  the CLI's parser and its configs and ``--set`` keys validate, every script and module it names exists
  (with the options it passes), every install names what the project declares;
* :class:`Text`: a listing or output, not code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    index: int  # among the fenced blocks of the file, from 0
    line: int  # of the opening fence, from 1
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line} (block {self.index}, {self.lang or 'no language'})"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if lang is None and m:
            lang, start, body = m.group(1), n, []
        elif lang is not None and line.strip() == "```":
            out.append(Block(str(path.relative_to(ROOT)), len(out), start, lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{path}: a fence opened at line {start} is never closed"
    return out


def all_blocks() -> list[Block]:
    return [b for f in DOC_FILES for b in blocks(f)]


@dataclass(frozen=True)
class Ranks:
    group: str


@dataclass(frozen=True)
class Emulated:
    group: str


@dataclass(frozen=True)
class GpuOnly:
    reason: str


@dataclass(frozen=True)
class Commands:
    reason: str


@dataclass(frozen=True)
class Text:
    what: str


GPU_MACHINE = "GPU-machine commands (a CUDA GPU, nvcc, NVSHMEM); here each is checked, not run"
#: (file, index) -> (language, a piece of the block's text, how the suite runs it)
HOW = {
    ("README.md", 0): ("bash", "python3 -m venv .venv", Commands(
        "installs into a venv (the suite runs in the one tests/run.sh made), runs the default job (74 s on 2 "
        "cores; tests/ranks/test_moe_run.py::test_streamed_equals_batch[default-4ranks] runs it) and the suite "
        "itself")),
    ("README.md", 1): ("python", "EPBuffer(heap, shape, max_tokens_per_rank=64)", Emulated("readme")),
    ("README.md", 2): ("python", "buf.capture(x_max, w, y_max", GpuOnly("CUDA graphs need a CUDA GPU")),
    ("docs/architecture.md", 0): ("text", "launch/", Text("the code map")),
    ("docs/cli.md", 0): ("text", "streamring run", Text("the synopsis (tests/unit/test_docs_cli.py checks it)")),
    ("docs/deep_gemm.md", 0): ("bash", "bash launch/pack_deep_gemm.sh", Commands(
        "packs DeepGEMM from git mirrors, then builds it on the GPU host (nvcc)")),
    ("docs/engine.md", 0): ("python", "buf = MoEBuffer(heap, shape", Ranks("engine-cpu")),
    ("docs/engine.md", 1): ("python", "heap = NvshmemHeap.bootstrap(\"mpi\")", Emulated("engine-gpu")),
    ("docs/engine.md", 2): ("python", "buf.capture(x_max, layers[0]", GpuOnly("CUDA graphs need a CUDA GPU")),
    ("docs/engine.md", 3): ("python", "replace_moe_experts(model, buf)", Ranks("engine-hf")),
    ("docs/engine.md", 4): ("python", "weights_from_fp8(router_w, gate8", Ranks("engine-cpu")),
    ("docs/engine.md", 5): ("python", "register_layer(buf, w)", Ranks("engine-cpu")),
    ("docs/gpu.md", 0): ("bash", "python -m streamring.device.build", Commands(GPU_MACHINE)),
    ("docs/gpu.md", 1): ("bash", "streamring gpu-check --controls", Commands(GPU_MACHINE)),
    ("docs/gpu.md", 2): ("text", "WatchdogError", Text("an error line a GPU rank prints")),
    ("docs/gpu.md", 3): ("text", "its context failed", Text("an error line a GPU rank prints")),
    ("docs/gpu.md", 4): ("bash", "bash launch/fetch_wheels.sh --cutlass", Commands(
        "downloads wheels (network) and builds GPU code, then runs on the GPU machine")),
    ("docs/gpu.md", 5): ("bash", "bash launch/sanitize.sh", Commands(GPU_MACHINE)),
    ("docs/gpu.md", 6): ("text", "nvcc -arch=sm_90", Text("the compiler commands the build runs")),
    ("docs/multinode.md", 0): ("bash", "--no-binary=mpi4py", Commands(
        "installs against a site MPI (a cluster's mpicc), then runs 16 ranks")),
    ("docs/multinode.md", 1): ("bash", "mpiexec -f hosts", Commands(
        "needs several hosts (tests/ranks/test_multihost.py runs the same across network namespaces)")),
}
