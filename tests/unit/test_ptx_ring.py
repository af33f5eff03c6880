"""The device ring's acquire (``ld.acquire.sys`` of both generations, then ``fence.acq_rel.sys``) in the
compiled PTX of its kernels, with two broken copies that must be reported (``tests/helpers/ptx_ring.py``).

Needs nvcc and the NVSHMEM headers (as the CUDA build does); skipped with the reason where either is
missing. It is what catches the GPU mutation ``acquire-fence-dropped`` (``tests/mutate.py --gpu``),
which no run on one GPU shows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "helpers"


@pytest.mark.slow(reason="three nvcc compiles of ring_kernels.cu (the source and two broken copies), ~20 s")
def test_the_acquire_is_ordered_in_the_compiled_kernels():
    r = subprocess.run([sys.executable, str(HERE / "ptx_ring.py"), "--controls"], check=False, capture_output=True, text=True,
                       cwd=HERE.parents[1], timeout=1200)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every ordering check passed (and every control was reported)" in r.stdout
