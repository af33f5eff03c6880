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
    words = t.contiguous().view(torch.uint8).view(torch.int32).reshape(-1).numpy().astype(np.int64)
    per = WF.BLOCK * WF.STEPS
    out = []
    for p in range(-(-words.size // per)):
        chunk = np.zeros(per, dtype=np.int64)
        part = words[p * per:(p + 1) * per]
        chunk[:part.size] = part
        acc = np.bitwise_xor.reduce(chunk.reshape(WF.STEPS, WF.BLOCK), axis=0)
        out.append(((int(acc.sum()) + 2 ** 31) % 2 ** 32) - 2 ** 31)
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("shape", [(2, 300, 256), (WF.BLOCK * WF.STEPS // 1024 + 3, 1024)])
def test_every_word_is_read_once(shape):
    g = torch.Generator().manual_seed(len(shape))
    t = torch.randint(-128, 127, shape, generator=g, dtype=torch.int8).view(torch.uint8)
    out = torch.zeros(WF.programs_for(t), dtype=torch.int32)
    WF.read_once(t, out)
    assert np.array_equal(out.numpy().astype(np.int64), _fold_on_host(t))
    before = out.clone()
    t.view(-1)[-1] ^= 1  # the last byte is read too: flipping it changes the last program's word, as on the host
    WF.read_once(t, out)
    assert np.array_equal(out.numpy().astype(np.int64), _fold_on_host(t)) and int(out[-1]) != int(before[-1])
