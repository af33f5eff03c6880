"""tests/mutate.py's table stays true to the code (no GPU needed; the mutations themselves run on demand).

Every edit's snippet occurs exactly once in its file, every test a mutation names exists, and the GPU
mutations are a group of their own (``--gpu``) whose tests skip cleanly without a GPU.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import mutate as M  # noqa: E402

EVERY = M.MUTATIONS + M.GPU_MUTATIONS


@pytest.mark.parametrize("m", EVERY, ids=[m.name for m in EVERY])
def test_every_snippet_occurs_exactly_once(m):
    for rel, old, new in m.edits:
        text = (ROOT / rel).read_text()
        assert text.count(old) == 1, f"{m.name}: {rel} holds the snippet {text.count(old)} times:\n{old}"
        assert old != new


@pytest.mark.parametrize("m", EVERY, ids=[m.name for m in EVERY])
def test_every_named_test_exists(m):
    for node in m.tests:
        path, _, name = node.partition("::")
        func = name.split("[")[0]
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert func in names, f"{m.name}: {node} names no test of {path}"


def test_gpu_mutations_are_their_own_group():
    names = [m.name for m in EVERY]
    assert len(names) == len(set(names))
    assert {m.name for m in M.GPU_MUTATIONS} == {"acquire-fence-dropped", "ack-before-copy",
                                                  "arrival-counter-not-reset", "meta-valid-off-by-one"}
    assert all(m.gpu for m in M.GPU_MUTATIONS) and not any(m.gpu for m in M.MUTATIONS)


def test_the_mutated_copy_imports_itself_and_keeps_other_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:/opt/site")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    env = M.env_for(tmp_path)
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), "/opt/site"]
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and "OMPI_COMM_WORLD_RANK" not in env


def test_gpu_flag_without_a_gpu_says_so(capsys):
    if M.gpu_missing() is None:
        pytest.skip("a GPU is here: --gpu would run the mutations")
    assert M.main(["--gpu"]) == 0
    assert "GPU mutations not run: no CUDA GPU here" in capsys.readouterr().out
