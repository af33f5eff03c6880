"""The package stays readable: no module over 600 lines, no function over 60, in every sub-package and at
the top level (counted with ast; Python only, the CUDA sources are exempt), and the buffer an engine holds
(``EPBuffer``) sets at most 20 attributes of its own (its parts hold the rest).

    python tests/unit/test_module_sizes.py    # the sizes, largest first
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "streamring"
VERIFY = PKG / "verify"
CHECKED = (".", "verify", "ring", "gemm", "moe", "device", "host")  # every folder of the package
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
MAX_BUFFER_ATTRIBUTES = 20


def module_sizes(root: Path = VERIFY) -> dict[str, int]:
    return {p.name: len(p.read_text().splitlines()) for p in sorted(root.glob("*.py"))}


def function_sizes(root: Path = VERIFY) -> dict[str, int]:
    """``module:qualified.name`` -> lines (``end_lineno - lineno + 1``) of every function and method."""
    out = {}
    for path in sorted(root.glob("*.py")):
        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{path.name}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                    walk(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")

        walk(ast.parse(path.read_text()), "")
    return out


def own_attributes(path: Path, class_name: str) -> set[str]:
    """The names ``class_name``'s methods assign as ``self.NAME`` (any method, any depth; with ast)."""
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


@pytest.mark.parametrize("package", CHECKED)
def test_no_module_over_the_limit(package):
    big = {m: n for m, n in module_sizes(PKG / package).items() if n > MAX_MODULE_LINES}
    assert not big, f"modules of {package}/ over {MAX_MODULE_LINES} lines: {big}"


@pytest.mark.parametrize("package", CHECKED)
def test_no_function_over_the_limit(package):
    big = {f: n for f, n in function_sizes(PKG / package).items() if n > MAX_FUNCTION_LINES}
    assert not big, f"functions of {package}/ over {MAX_FUNCTION_LINES} lines: {big}"


def test_the_buffer_sets_at_most_20_attributes_of_its_own():
    attrs = own_attributes(PKG / "moe" / "ep_buffer.py", "EPBuffer")
    assert 0 < len(attrs) <= MAX_BUFFER_ATTRIBUTES, sorted(attrs)


def test_the_attribute_count_sees_every_assignment(tmp_path):
    """Negative control: assignments in any method, nested or augmented, each name once."""
    (tmp_path / "b.py").write_text("class B:\n    def __init__(self):\n        self.a = 1\n        self.a = 2\n"
                                   "        if True:\n            self.b, self.c = 3, 4\n"
                                   "    def later(self):\n        self.d += 1\n        x = self.e\n")
    assert own_attributes(tmp_path / "b.py", "B") == {"a", "b", "c", "d"}


def test_the_counts_see_a_long_function(tmp_path):
    """Negative control: a module with a 101-line function and 801 lines is reported."""
    body = "\n".join(f"    x{i} = {i}" for i in range(100))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n" + "\n" * 700)
    assert function_sizes(tmp_path) == {"long.py:f": 101}
    assert module_sizes(tmp_path)["long.py"] > MAX_MODULE_LINES


if __name__ == "__main__":
    ok = True
    for package in CHECKED:
        mods, funcs = module_sizes(PKG / package), function_sizes(PKG / package)
        print(f"{package}/")
        for name, n in sorted(mods.items(), key=lambda x: -x[1]):
            print(f"{n:5d}  {name}")
        print()
        for name, n in sorted(funcs.items(), key=lambda x: -x[1])[:15]:
            print(f"{n:5d}  {name}")
        print()
        ok &= max(mods.values()) <= MAX_MODULE_LINES and max(funcs.values()) <= MAX_FUNCTION_LINES
    sys.exit(0 if ok else 1)
