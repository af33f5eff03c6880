"""The block allocator's kernel compiles for sm_90 (no GPU needed) in every variant a forward launches: the
off-GPU tests run it in Triton's interpreter, which accepts code the compiler may refuse (the layout's loops over
a range read from memory, its runtime branch) and has no threads. So the barriers of the expert-by-expert layout
(this kernel's ready-list stores before any thread reads them back, the range's loads before any thread's stores
into it) are checked here in the compiled code: the layout variants hold more ``bar.sync`` than the same source
compiled with its ``tl.debug_barrier()`` calls removed. In a process of its own (compiled mode; this session's other
modules run the interpreter); skipped with the reason where the installed Triton cannot compile sm_90."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests/helpers")
try:
    from ptx_queue import _compile  # sm_90 PTX off the GPU, as the persistent consumer's check compiles it
except Exception as e:
    print(json.dumps({"skip": f"this Triton cannot compile off the GPU: {e!r}"})); sys.exit(0)
import importlib.util, tempfile
from pathlib import Path
from streamring.device import block_alloc as BA
# the same source without its barriers, loaded as a module of its own (Triton compiles from the source file)
src = Path(BA.__file__).read_text()
assert src.count("tl.debug_barrier()") == 2, "the layout's two barriers"
d = tempfile.mkdtemp()
f = Path(d) / "block_alloc_no_barrier.py"
f.write_text(src.replace("tl.debug_barrier()", "pass"))
spec = importlib.util.spec_from_file_location("block_alloc_no_barrier", f)
NB = importlib.util.module_from_spec(spec)
spec.loader.exec_module(NB)
sig = {"counts_ptr": "*i32", "state_ptr": "*i32", "expert_blocks_ptr": "*i32", "block_expert_ptr": "*i32",
       "ready_list_ptr": "*i32", "block_rows_ptr": "*i32", "ready_hi_ptr": "*i32", "hi_index": "i32",
       "pending_ptr": "*i64", "by_expert_from": "i32"}
out = {}
def bars(mod, consts):
    s = dict(sig)
    s.update({k: "constexpr" for k in consts})
    return _compile(mod._alloc_blocks_kernel, s, consts, 4).count("bar.sync")
for seal, seal_if, by_expert in [(False, False, False), (True, False, False), (True, True, False), (True, True, True),
                                 (True, False, True)]:
    consts = dict(E=32, EP=32, BM=128, MAXB=40, SEAL=seal, SEAL_IF=seal_if, BY_EXPERT=by_expert, TILE=128)
    try:
        n = bars(BA, consts)
    except Exception as e:
        if not out:
            print(json.dumps({"skip": f"this Triton cannot compile sm_90 here: {type(e).__name__}: {e}"[:400]}))
            sys.exit(0)
        raise
    out[f"{seal}/{seal_if}/{by_expert}"] = [n, bars(NB, consts)]
print(json.dumps(out))
"""


def test_every_variant_compiles_and_the_layout_keeps_its_barriers():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    assert len(got) == 5, got
    for key, (with_barriers, without) in got.items():
        if key.endswith("/True"):  # the layout's variants: its barriers are in the compiled code
            assert with_barriers > without, (key, got)
        else:  # the others have no barrier of the source's own
            assert with_barriers == without, (key, got)
