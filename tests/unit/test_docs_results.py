"""docs/results holds only what the docs cite: every file there is cited by a page (docs/*.md or the
README), every docs/results path a page cites exists, and there are at most MAX_FILES of them (its own
README.md, the index, not counted). The negative controls break a copy of the tree each way and check
that the same check reports it."""

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES = 60
# a results path as the pages write it: results/NAME or docs/results/NAME, in a link or in backticks
CITE = re.compile(r"results/([A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])")


def pages(root: Path) -> list[Path]:
    return sorted((root / "docs").glob("*.md")) + [root / "README.md"]


def cited(root: Path) -> dict[str, list[str]]:
    """Each results file name a page cites -> the pages citing it."""
    out: dict[str, list[str]] = {}
    for page in pages(root):
        for name in set(CITE.findall(page.read_text(encoding="utf-8"))):
            out.setdefault(name, []).append(str(page.relative_to(root)))
    return out


def problems(root: Path) -> list[str]:
    results = root / "docs" / "results"
    files = sorted(p.name for p in results.iterdir() if p.name != "README.md")
    cites = cited(root)
    found = []
    for name in files:
        if name not in cites:
            found.append(f"docs/results/{name} is cited by no page (docs/*.md, README.md): cite it or delete it")
    for name, by in sorted(cites.items()):
        if not (results / name).exists():
            found.append(f"{', '.join(by)} cite docs/results/{name}, which does not exist")
    if len(files) > MAX_FILES:
        found.append(f"docs/results holds {len(files)} files (README.md aside), more than {MAX_FILES}")
    return found


def test_docs_results_holds_what_the_docs_cite():
    assert problems(ROOT) == []


def test_results_index_lists_every_file():
    index = (ROOT / "docs/results/README.md").read_text(encoding="utf-8")
    files = sorted(p.name for p in (ROOT / "docs/results").iterdir() if p.name != "README.md")
    missing = [f for f in files if f"[{f}]({f})" not in index]
    assert not missing, f"docs/results/README.md has no line for {missing}"


@pytest.fixture
def tree(tmp_path):
    """A copy of the pages and docs/results, where the check must find nothing."""
    (tmp_path / "docs").mkdir()
    for page in pages(ROOT):
        shutil.copy(page, tmp_path / page.relative_to(ROOT))
    shutil.copytree(ROOT / "docs/results", tmp_path / "docs/results")
    assert problems(tmp_path) == []
    return tmp_path


def test_negative_control_an_uncited_file(tree):
    (tree / "docs/results/gemm-uncited-2026-12-03.json").write_text("{}")
    assert problems(tree) == ["docs/results/gemm-uncited-2026-12-03.json is cited by no page "
                              "(docs/*.md, README.md): cite it or delete it"]


def test_negative_control_a_cited_file_that_is_gone(tree):
    page = tree / "docs/performance.md"
    page.write_text(page.read_text() + "\nSee [x](results/ep-layer-gone-2026-12-03.json).\n")
    assert problems(tree) == ["docs/performance.md cite docs/results/ep-layer-gone-2026-12-03.json, "
                              "which does not exist"]
    # a cited file deleted is caught the same way, from the README too
    name = next(n for n, by in cited(tree).items() if "README.md" not in by)
    (tree / "docs/results" / name).unlink()
    assert any(p.endswith(f"docs/results/{name}, which does not exist") for p in problems(tree))


def test_negative_control_too_many_files(tree):
    page = tree / "docs/performance.md"
    extra = [f"filler-{i:02d}-2026-12-03.log" for i in range(MAX_FILES + 1)]
    for name in extra:
        (tree / "docs/results" / name).write_text("x")
    page.write_text(page.read_text() + "".join(f"\n[{n}](results/{n})" for n in extra))
    found = problems(tree)
    assert len(found) == 1 and f"more than {MAX_FILES}" in found[0], found
