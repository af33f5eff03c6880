"""The package's arrows point one way: launch/CLI -> host -> MoE -> ring/gemm -> device (backend verbs).

Parsed from the source (no imports run): a module may import from its own layer or below,
never from above.
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "streamring"

# rank: higher may import lower. ring (the protocol, its layout, its device form and the cooperative
# roles) and gemm (the expert GEMM backends, their choice and builds) sit on device, below moe; verify
# (the stress harness, which host starts on every rank, and the model checkers), the GPU self-test and
# the layer runner drive the ring and the MoE layer; the config's schema sits beside them (it reads the
# names of the ring's policies, gemm's backends and moe's routers: moe.routing, torch-free); the other
# top-level tools (cli, timeline) sit with launch; host above moe/ring/gemm/verify; device at the bottom.
RANK = {"device": 0, "ring": 1, "gemm": 1, "config": 2, "moe": 2, "verify": 2, "gpu_selftest": 2, "runner": 2,
        "host": 3}
TOP = 4


def layer_of(module: str) -> int:
    parts = module.split(".")
    if parts[0] != "streamring" or len(parts) < 2:
        return TOP
    return RANK.get(parts[1], TOP)


def imports(path: Path, root: Path = PKG):
    mod = "streamring." + ".".join(path.relative_to(root).with_suffix("").parts)
    pkg = mod.rsplit(".", 1)[0] if path.name != "__init__.py" else mod.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("streamring"):
                continue
            if node.module:
                yield mod, target, node.lineno
            else:  # `from .. import protocol`: each name is a module of that package
                for a in node.names:
                    yield mod, f"{target}.{a.name}", node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("streamring"):
                    yield mod, a.name, node.lineno


def violations(root: Path = PKG) -> list[str]:
    bad = []
    for path in root.rglob("*.py"):
        for mod, target, line in imports(path, root):
            if layer_of(target) > layer_of(mod):
                bad.append(f"{mod}:{line} imports {target}")
    return bad


def test_no_module_imports_from_a_layer_above():
    bad = violations()
    assert not bad, "imports against the arrows:\n" + "\n".join(bad)


def test_the_checker_catches_a_violation(tmp_path):
    """Negative control: a moe module importing host (relative and absolute) is reported."""
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "bad.py").write_text("from ..host.rank_main import rank_main\nimport streamring.host.launch\n"
                                             "from ..device import verbs\nfrom ..ring.device import DeviceRing\n")
    assert violations(tmp_path) == ["streamring.moe.bad:1 imports streamring.host.rank_main",
                                    "streamring.moe.bad:2 imports streamring.host.launch"]


def test_the_checker_keeps_ring_above_device_only(tmp_path):
    """ring may use the device verbs and kernels, never the MoE layer above it (relative and absolute)."""
    (tmp_path / "ring").mkdir()
    (tmp_path / "ring" / "bad.py").write_text("from ..moe.layer import MoEBuffer\nfrom ..device.verbs import SignalOp\n"
                                              "from .layout import RingLayout\nimport streamring.verify.state\n")
    assert violations(tmp_path) == ["streamring.ring.bad:1 imports streamring.moe.layer",
                                    "streamring.ring.bad:4 imports streamring.verify.state"]


def test_the_checker_keeps_gemm_between_device_and_moe(tmp_path):
    """gemm may use device (kernels, the build cache), never moe or host; device may not reach up to gemm."""
    (tmp_path / "gemm").mkdir()
    (tmp_path / "gemm" / "bad.py").write_text("from ..device.build import cache_dir\nfrom ..moe.blocks import FP8\n"
                                              "from . import cutlass\nimport streamring.host.launch\n")
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / "bad.py").write_text("from ..gemm.build import main\n")
    assert sorted(violations(tmp_path)) == ["streamring.device.bad:1 imports streamring.gemm.build",
                                            "streamring.gemm.bad:2 imports streamring.moe.blocks",
                                            "streamring.gemm.bad:4 imports streamring.host.launch"]


def test_the_checker_keeps_verify_below_host(tmp_path):
    """verify may drive the protocol but not reach up into host (the CLI hands it host's report)."""
    (tmp_path / "verify").mkdir()
    (tmp_path / "verify" / "bad.py").write_text("from ..host import report\nfrom ..ring.protocol import Ring\n"
                                                "from ..moe import layer\n")
    assert violations(tmp_path) == ["streamring.verify.bad:1 imports streamring.host"]


def test_host_is_job_hosting_only():
    """host/ holds launchers, bootstrap, ranks and job state; nothing there launches device work
    itself (no CUDA, Triton or NVSHMEM import at module level)."""
    host = PKG / "host"
    assert sorted(p.name for p in host.glob("*.py")) == [
        "__init__.py", "bootstrap.py", "envcheck.py", "jobfiles.py", "jobstate.py", "launch.py", "netns.py",
        "prelaunch.py", "preload.py", "preload_stub.py", "progress.py", "rank_main.py", "report.py"]
    for path in host.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only: lazy imports inside functions are the bootstrap's job
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                assert not n.split(".")[0] in ("triton", "cuda", "nvshmem"), f"{path.name} imports {n}"


# What a process loads is what it pays for at start-up, in every multi-rank test: the local launcher
# checks a job before its ranks start, and a stress rank drives only the ring (neither needs torch).
LIGHT_PROCESS = """
import sys
from streamring.cli import build_parser
from streamring.config import load_config
from streamring.host.launch import spawn_local
from streamring.host.prelaunch import job_problems
from streamring.host.rank_main import rank_main
from streamring.verify.stress import run_stress
cfg = load_config(None, [])
assert job_problems("run", cfg, 4, None, 4) == [] and job_problems("stress", cfg, 4, None, 4) == []
assert job_problems("run", cfg, 3, None, 3), "a layer of 8 experts on 3 ranks must be refused"
print(sorted(m for m in ("torch", "triton", "matplotlib", "hypothesis") if m in sys.modules))
"""


def test_launcher_and_stress_ranks_load_no_torch():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", LIGHT_PROCESS], capture_output=True, text=True, timeout=120,
                       cwd=PKG.parent)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[0] == "[]", p.stdout


@pytest.mark.slow(reason="a Python process that loads torch (1.5 s on a quiet 2-core machine, several under load)")
def test_the_light_process_check_sees_torch():
    """Negative control: the same check in a process that touches the MoE layer reports torch."""
    import subprocess
    import sys

    code = LIGHT_PROCESS.replace("print(", "import streamring.moe.layer\nprint(")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PKG.parent)
    assert p.returncode == 0 and "'torch'" in p.stdout, (p.stdout, p.stderr)


def import_graph(root: Path = PKG) -> dict:
    """``module -> modules it imports`` (every import statement, at module level or inside a function), parsed from
    the source; ``from pkg import name`` counts as an import of ``pkg.name`` where that is a module."""
    top = root.name
    modules = {".".join((top, *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
               for p in root.rglob("*.py")}
    graph: dict = {}
    for path in root.rglob("*.py"):
        for mod, target, _ in imports(path, root):
            mod = mod.replace("streamring", top, 1).removesuffix(".__init__")
            target = target.replace("streamring", top, 1)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != mod:
                graph.setdefault(mod, set()).add(target)
    return graph


def import_cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle in the package, direct or through others (a function-level import counts too)."""
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_sees_a_cycle_through_a_function_level_import(tmp_path):
    """Negative control: a -> b at module level, b -> a inside a function."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import x\n")
    (tmp_path / "c.py").write_text("from .a import y\n")
    assert import_cycles(import_graph(tmp_path)) == [[f"{tmp_path.name}.a", f"{tmp_path.name}.b"]]
