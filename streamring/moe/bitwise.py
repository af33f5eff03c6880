"""Bitwise comparison of outputs: byte for byte, with a readable first difference.

``torch.equal`` compares values: it calls -0.0 and +0.0 equal and NaN unequal to itself,
so it is not a bitwise check. These helpers compare the bytes (``view(torch.uint8)``).
"""

from __future__ import annotations

from typing import Optional

import torch


def _bytes(t: torch.Tensor, cpu: bool = True) -> torch.Tensor:
    """``t``'s bytes as ``[numel, itemsize]`` uint8 (on the CPU, or where ``t`` is with ``cpu=False``)."""
    t = t.detach().contiguous()
    if cpu:
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8).reshape(t.numel(), t.element_size())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True iff ``a`` and ``b`` have the same dtype, shape and bytes (compared where both are when they
    share a device: a GPU's outputs of a GiB are not copied to the host for a yes/no)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    cpu = a.device != b.device
    return torch.equal(_bytes(a, cpu), _bytes(b, cpu))


def bit_difference(a: torch.Tensor, b: torch.Tensor, a_name: str = "a", b_name: str = "b") -> Optional[str]:
    """``None`` when ``a`` and ``b`` are bitwise equal, else one readable line.

    It names the number of differing elements, the first one's index (row, column for 2-D)
    and both values with their bits in hex.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a_name} is {a.dtype} {list(a.shape)}, {b_name} is {b.dtype} {list(b.shape)}"
    ab, bb = _bytes(a), _bytes(b)
    differ = (ab != bb).any(dim=1)
    n = int(differ.sum())
    if n == 0:
        return None
    i = int(differ.nonzero()[0, 0])
    where = [int(v) for v in torch.unravel_index(torch.tensor(i), tuple(a.shape))] if a.dim() else []
    av, bv = a.detach().reshape(-1)[i].item(), b.detach().reshape(-1)[i].item()
    # bytes are little-endian: print the most significant first
    ah, bh = (bytes(x[i].tolist()[::-1]).hex() for x in (ab, bb))
    return (f"{a_name} != {b_name}: {n} of {a.numel()} elements differ in their bits; first at index {where}: "
            f"{av!r} (0x{ah}) vs {bv!r} (0x{bh})")
