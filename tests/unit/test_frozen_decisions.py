"""The runtime's two table-driven choices keep their answers: ``gemm="auto"`` on the committed GEMM table
(``streamring/gemm/table.json`` through :func:`streamring.gemm.choice.choose_layer`) and ``streaming="auto"`` on
the committed tuned table (``streamring/moe/adaptive_table.json`` through :func:`streamring.moe.adaptive.choose`).

The expected answers (``tests/helpers/frozen_decisions.json``) were written by this file's ``--write`` from the
code before the GEMM backends became a registry and the cost model left the package; a change of either
table, or of a rule on purpose, rewrites them with::

    .venv/bin/python tests/unit/test_frozen_decisions.py --write

What each answer holds: for ``gemm_auto`` (key: rows per expert, hidden x intermediate, the available
implementations, the consumer's block size) the implementation, both GEMMs' table keys and what decided
(``measured``, ``rule``: the fallback rule, ``asked``: the one implementation asked for, unmeasured); for
``streaming_auto`` (key: GEMM, PEs, experts per PE, tokens, the smallest chunk, the buffer's block size) the path and every field of the
plan, and what decided.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

FROZEN = Path(__file__).resolve().parents[1] / "helpers" / "frozen_decisions.json"


def _kind(source: str) -> str:
    return "measured" if source.startswith("measured") else "rule" if source.startswith("fallback") else "asked"


def gemm_decisions() -> dict:
    from streamring.gemm import choice as GC

    t = GC.load_table()
    rpes = sorted({float(e["rows_per_expert"]) for e in t["entries"]} | {0.5, 1.0, 3.0, 32.0, 100.0, 127.9, 128.0,
                                                                           300.0, 1000.0, 5000.0, 100000.0})
    impls = ("cutlass", "deep_gemm", "triton")
    subsets = [c for n in range(4) for c in itertools.combinations(impls, n)]
    out = {}
    for rpe, (h, i), avail, bm in itertools.product(rpes, ((7168, 2048), (4096, 2048)), subsets, (None, 16, 64, 128)):
        lc = GC.choose_layer(rpe, h, i, set(avail), t, block_m=bm)
        out[f"{rpe:g} {h}x{i} {'+'.join(avail) or '-'} bm{bm}"] = f"{lc.impl} {lc.l1.key} {lc.l2.key} {_kind(lc.source)}"
    return out


def adaptive_decisions() -> dict:
    from streamring.moe import adaptive

    t = adaptive.load_table()
    rows = t["rows"]
    settings = sorted({(r.get("gemm"), r.get("ranks"), r.get("experts_per_pe")) for r in rows}, key=str)
    settings += [("triton", 8, 32), ("cutlass", 2, 32), (None, None, None)]
    toks = sorted({1, 16, 100, 100000} | {r["tokens"] + d for r in rows for d in (-1, 0, 1)} |
                  {2 * r["tokens"] for r in rows})
    out = {}
    for (g, r, e), n, m, bm in itertools.product(settings, toks, (1, 16), (None, 16, 64, 128)):
        c = adaptive.choose(n, t, gemm=g, ranks=r, experts_per_pe=e, block_m=bm, min_chunk_tokens=m)
        out[f"{g} R{r} E{e} T{n} min{m}" + (f" bm{bm}" if bm else "")] = (f"{c.path} bm{c.block_m} chunk{c.chunk_tokens} slots{c.num_slots} "
                                             f"{c.policy} tab{c.table_tokens} C{c.chunks} {c.source_order} "
                                             f"w{c.ready_window_us} {c.source}")
    return out


def _diff(want: dict, got: dict) -> list[str]:
    keys = sorted(set(want) | set(got))
    return [f"{k}: {want.get(k)} -> {got.get(k)}" for k in keys if want.get(k) != got.get(k)]


def test_gemm_auto_decides_as_before_on_the_committed_table():
    bad = _diff(json.loads(FROZEN.read_text())["gemm_auto"], gemm_decisions())
    assert not bad, f"{len(bad)} gemm='auto' decisions changed:\n" + "\n".join(bad[:30])


def test_streaming_auto_decides_as_before_on_the_committed_table():
    bad = _diff(json.loads(FROZEN.read_text())["streaming_auto"], adaptive_decisions())
    assert not bad, f"{len(bad)} streaming='auto' decisions changed:\n" + "\n".join(bad[:30])


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/unit/test_frozen_decisions.py --write")
    FROZEN.write_text(json.dumps({"gemm_auto": gemm_decisions(), "streaming_auto": adaptive_decisions()}, indent=0,
                                 sort_keys=True) + "\n")
    print(f"wrote {FROZEN}")
