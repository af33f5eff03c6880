"""Every example of README.md and docs/*.md is run or checked here, so an example that drifts from the code fails.

Which block is run how is the table of tests/helpers/doc_examples.py: the Python examples that need a heap run
on 2 real ranks (tests/ranks/test_docs_examples_on_ranks.py); here the GPU buffer's examples run on the
emulated device, the GPU-only ones (CUDA graphs) compile and import, every shell command is checked against
what it names (the CLI's parser and config, scripts with their options, modules with theirs, what an install
asks for), and so is every command written inline in the prose.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import tomllib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the emulated device runs the GPU kernels in Triton's interpreter

from doc_examples import DOC_FILES, HOW, ROOT, Commands, Emulated, GpuOnly, Ranks, Text, all_blocks

from streamring.cli import build_parser
from streamring.config import ConfigError, load_config

BLOCKS = all_blocks()


def _entry(b):
    return HOW.get((b.file, b.index))


def test_every_block_says_how_it_runs():
    """Each fenced block has a table entry whose language and text match it, and every entry has its block."""
    kinds = {"python": (Ranks, Emulated, GpuOnly), "bash": (Commands,), "text": (Text,)}
    for b in BLOCKS:
        e = _entry(b)
        assert e is not None, f"{b.where} is in no entry of tests/helpers/doc_examples.py HOW: say how it runs"
        lang, needle, how = e
        assert b.lang == lang and needle in b.code, (
            f"{b.where}: the entry ({lang}, {needle!r}) no longer matches the block: update HOW\n{b.code}")
        assert isinstance(how, kinds.get(lang, ())), (b.where, how)
    assert set(HOW) == {(b.file, b.index) for b in BLOCKS}, set(HOW) - {(b.file, b.index) for b in BLOCKS}


# ----------------------------------------------------------------------------------------------
# Python: the GPU buffer's examples on the emulated device, the GPU-only ones compiled and imported
# ----------------------------------------------------------------------------------------------
EMULATED_GROUPS = sorted({e[2].group for e in HOW.values() if isinstance(e[2], Emulated)})


@pytest.fixture
def emulated_gpu(monkeypatch):
    """``NvshmemHeap.bootstrap`` gives one emulated PE (tests/helpers/emulated_device.py) and the default progress
    policy is ``serialized``: the only one the emulated device runs (the others need CUDA streams)."""
    from typing import Literal

    from emulated_device import EmulatedHeap

    from streamring.device import nvshmem
    from streamring.moe import ep_buffer, tuning

    class SerialTuning(tuning.EPTuning):
        policy: Literal[tuning.EP_POLICIES] = "serialized"  # type: ignore[valid-type]

    monkeypatch.setattr(nvshmem.NvshmemHeap, "bootstrap", classmethod(lambda cls, *a, **kw: EmulatedHeap()))
    monkeypatch.setattr(tuning, "EPTuning", SerialTuning)
    monkeypatch.setattr(ep_buffer, "EPTuning", SerialTuning)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU emulation of the GPU buffer")
@pytest.mark.parametrize("group", EMULATED_GROUPS)
def test_gpu_buffer_examples_run_on_the_emulated_device(emulated_gpu, group, capsys):
    ns: dict = {"__name__": f"doc_example_{group}"}
    ran = 0
    for b in BLOCKS:
        e = _entry(b)
        if e and isinstance(e[2], Emulated) and e[2].group == group:
            exec(compile(b.code, f"{b.file}:block{b.index}", "exec"), ns)
            ran += 1
    assert ran
    for value in ns.values():  # the examples' buffers go back to their heaps
        if hasattr(value, "close") and type(value).__name__ == "EPBuffer":
            value.close()


@pytest.mark.parametrize("block", [b for b in BLOCKS if isinstance((_entry(b) or (0, 0, 0))[2], GpuOnly)],
                         ids=lambda b: f"{b.file}:{b.index}")
def test_gpu_only_examples_compile_and_import(block):
    """Not run here (the entry says why); every import they make works and every method they call on ``buf``
    exists on the GPU buffer."""
    tree = ast.parse(block.code)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module([node], []), block.file, "exec"), {})
    from streamring.moe.ep_buffer import EPBuffer

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "buf":
            assert hasattr(EPBuffer, node.func.attr), (block.where, node.func.attr)


# ----------------------------------------------------------------------------------------------
# Shell commands: checked against what they name
# ----------------------------------------------------------------------------------------------
PROGRAMS = ("python", "python3", "streamring", "pip", "bash")
#: files a block's command makes before a later command of the block reads them: (file, the script that writes it)
MADE_BY = {".dg-site/deep_gemm_env.sh": "launch/build_deep_gemm.sh"}
BUILTINS = {"printf", "echo", "cd", "export", "mkdir"}


def _torch_pin() -> str:
    return re.search(r"torch==([\d.]+)", (ROOT / "tests" / "run.sh").read_text()).group(1)


def _extras() -> set:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _placeholder(tok: str) -> bool:
    """A word the reader replaces (``FILE``, ``DIR``, ``YOUR_EXAMPLE.py``): upper case before any extension."""
    stem = tok.split(".")[0]
    return len(stem) > 1 and stem.replace("_", "").isalpha() and stem.isupper()


def _program(tok: str) -> str:
    return tok.rsplit("/", 1)[-1]


def check_streamring(args: list[str]) -> list[str]:
    """The arguments parse with the CLI's parser; for run and stress the config and every --set validate."""
    try:
        ns = build_parser().parse_args(args)
    except SystemExit:
        return [f"streamring {' '.join(args)}: the CLI's parser refuses it"]
    if ns.command in ("run", "stress"):
        overrides = list(ns.overrides) + ([f"stress.inject={ns.inject}"] if getattr(ns, "inject", None) else [])
        try:
            load_config(ROOT / ns.config if ns.config else None, overrides, ranks=ns.ranks, backend=ns.backend)
        except ConfigError as exc:
            return [f"streamring {' '.join(args)}: {exc}"]
    if ns.command == "timeline" and not ns.input.isupper() and not (ROOT / ns.input).exists():
        return [f"streamring timeline: no {ns.input}"]
    return []


def check_module(module: str, args: list[str]) -> list[str]:
    """The module exists (a file of this repository where it is one) and every --option passed is in its source."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None:
        return [f"python -m {module}: no such module"]
    if module == "streamring":
        return check_streamring(args)
    if "--" in args:  # what follows is a command the module runs (streamring.host.netns)
        i = args.index("--")
        return check_module(module, args[:i]) + check_command(args[i + 1:])
    src = open(spec.origin).read() if spec.origin and spec.origin.endswith(".py") else ""
    if module.split(".")[0] in ("streamring", "bench"):
        return [f"python -m {module}: no option {a}" for a in args
                if a.startswith("--") and f'"{a.split("=")[0]}"' not in src]
    return []


def check_script(path: str, args: list[str]) -> list[str]:
    f = ROOT / path
    if not f.is_file():
        return [f"{path}: no such script"]
    p = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    if p.returncode:
        return [f"{path}: {p.stderr.strip()}"]
    text = f.read_text()
    return [f"{path}: no option {a}" for a in args if a.startswith("--") and a not in text]


def check_pip(args: list[str]) -> list[str]:
    out = []
    for a in args:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", a)
        if m:
            out += [f"pip install: no extra {x!r} in pyproject.toml" for x in m.group(1).split(",")
                    if x not in _extras()]
        if a.startswith("torch==") and a != f"torch=={_torch_pin()}":
            out.append(f"pip install {a}: tests/run.sh pins torch=={_torch_pin()}")
    return out


def check_command(words: list[str]) -> list[str]:
    """One simple command (its words); what it names must exist and accept what it passes."""
    while words and (re.match(r"^\w+=", words[0]) or words[0] == "env"):
        words = words[1:]  # environment assignments
    if not words:
        return []
    prog, rest = _program(words[0]), words[1:]
    if prog in ("mpiexec", "mpirun", "srun"):
        i = 0
        while i < len(rest) and _program(rest[i]) not in PROGRAMS:
            i += 1
        return check_command(rest[i:]) if i < len(rest) else [f"{' '.join(words)}: starts no program"]
    if prog in BUILTINS:
        return []
    if prog in (".", "source"):
        made = MADE_BY.get(rest[0])
        if made:
            return [] if rest[0] in (ROOT / made).read_text() else [f"{made} does not make {rest[0]}"]
        return [] if (ROOT / rest[0]).is_file() else [f". {rest[0]}: no such file"]
    if prog == "bash":
        return check_script(rest[0], rest[1:])
    if prog == "streamring":
        return check_streamring(rest)
    if prog in ("pip", "pip3"):
        return check_pip(rest[1:]) if rest[:1] == ["install"] else []
    if prog.startswith("python"):
        if rest[:1] == ["-c"]:
            try:
                compile(rest[1], "<python -c>", "exec")
                return []
            except SyntaxError as exc:
                return [f"python -c: {exc}"]
        if rest[:1] == ["-m"]:
            if rest[1] == "venv":
                return []
            if rest[1] == "pip":
                return check_pip(rest[3:]) if rest[2:3] == ["install"] else []
            return check_module(rest[1], rest[2:])
        if rest and rest[0].endswith(".py"):  # a script of this repository, or the reader's (a placeholder)
            return [] if _placeholder(rest[0]) or (ROOT / rest[0]).is_file() else [f"python {rest[0]}: no such file"]
    return [f"{' '.join(words)}: a command the docs check does not know (tests/unit/test_docs_examples.py)"]


def commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments dropped, command substitutions
    stood in for, split at &&, ||, ; and |, redirections dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        line = re.sub(r"\$\([^)]*\)", "SUBST", line)
        words, cmd = shlex.split(line, comments=True), []
        i = 0
        while i < len(words):
            w = words[i]
            if w in ("&&", "||", ";", "|"):
                out.append(cmd)
                cmd = []
            elif w in (">", ">>", "<", "2>"):
                i += 1
            else:
                cmd.append(w)
            i += 1
        out.append(cmd)
    return [c for c in out if c]


@pytest.mark.parametrize("block", [b for b in BLOCKS if isinstance((_entry(b) or (0, 0, 0))[2], Commands)],
                         ids=lambda b: f"{b.file}:{b.index}")
def test_shell_examples_name_what_exists(block):
    p = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert p.returncode == 0, (block.where, p.stderr)
    problems = [x for c in commands(block.code) for x in check_command(c)]
    assert not problems, f"{block.where}:\n  " + "\n  ".join(problems)


INLINE = re.compile(r"`((?:\.venv/bin/)?(?:streamring|mpiexec|mpirun) [^`]+|python3? -m [^`]+"
                    r"|bash (?:launch|tests)/[^`]+)`")


def test_inline_commands_name_what_exists():
    """Commands written inline in the prose (`streamring run --set ...`, `bash launch/x.sh`, `python -m m --opt`)
    are held to the same checks; a span with a placeholder (``...``, ``a / b``) is prose, not a command."""
    problems = []
    for f in DOC_FILES:
        text = re.sub(r"^```.*?^```", "", f.read_text(), flags=re.M | re.S)  # (the blocks are checked above)
        for m in INLINE.finditer(text):
            span = " ".join(m.group(1).split())
            if "..." in span or " / " in span or "COMMAND" in span:
                continue
            for c in commands(span):
                problems += [f"{f.relative_to(ROOT)}: `{span}`: {x}" for x in check_command(c)]
    assert not problems, "\n".join(problems)


def test_the_checks_can_fail():
    """The command checks refuse what drifted: an option the parser lacks, a config key, a script, a module's
    option, an extra."""
    assert check_command(["streamring", "timeline", "X", "--tokens", "1", "2", "--bogus"])
    assert check_command(["streamring", "run", "--set", "ring.num_slot=3"])
    assert check_command(["bash", "launch/layer_h200.sh"])
    assert check_command(["python", "-m", "streamring.gemm.build", "--bogus"])
    assert check_command(["pip", "install", "-e", ".[nope]"])
    assert not check_command(["env", "A=1", "mpiexec", "-n", "2", "python", "-m", "streamring", "run"])
