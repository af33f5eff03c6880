"""bench.weight_floor: its kernel reads every word of a tensor once (the fold it stores matches one computed on the
host from every word; a word it skipped would change it)."""

import os

import pytest

torch = pytest.importorskip("torch", reason="bench.weight_floor needs torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")

import numpy as np  # noqa: E402

from bench import weight_floor as WF  # noqa: E402


def _fold_on_host(t) -> np.ndarray:
    """Per program, the xor of its STEPS rows of BLOCK words (past the end: zeros), rows one after the other."""
    words = t.contiguous().view(torch.uint8).view(torch.int32).reshape(-1).numpy()
    per = WF.BLOCK * WF.STEPS
    padded = np.zeros(-(-words.size // per) * per, dtype=np.int32)
    padded[:words.size] = words
    return np.bitwise_xor.reduce(padded.reshape(-1, WF.STEPS, WF.BLOCK), axis=1).reshape(-1)


@pytest.mark.parametrize("shape", [(2, 300, 256), (WF.BLOCK * WF.STEPS // 1024 + 3, 1024)])
def test_every_word_is_read_once(shape):
    g = torch.Generator().manual_seed(len(shape))
    t = torch.randint(-128, 127, shape, generator=g, dtype=torch.int8).view(torch.uint8)
    out = torch.zeros(WF.programs_for(t) * WF.BLOCK, dtype=torch.int32)
    WF.read_once(t, out)
    assert np.array_equal(out.numpy(), _fold_on_host(t))
    before = out.clone()
    t.view(-1)[-1] ^= 1  # the last byte is read too: flipping it changes the program's fold, as on the host
    WF.read_once(t, out)
    assert np.array_equal(out.numpy(), _fold_on_host(t)) and not torch.equal(out, before)
