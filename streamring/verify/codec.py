"""The search's form of a state: the model's flat tuple packed into one int.

Field ``i`` of the tuple becomes its value's *code* (the value's index in that field's table, in
the order the values were first seen) in bits ``[16 i, 16 i + 16)``. Equal tuples give equal ints
and different tuples different ints, so the visited set keeps its meaning; an int of a few hundred
bits hashes and compares several times faster than a tuple of tens of ints and takes a third of
its memory. What a process reads is then a mask (:meth:`StateCodec.mask`), and a step that writes
a few fields is ``(x & keep) | put`` (:class:`streamring.verify.memo.Step`).

The models, their look-ahead and the results keep the tuple (:meth:`StateCodec.decode`,
:class:`DecodedStates`).
"""

from __future__ import annotations

import sys
from array import array

BITS = 16  # per field: up to 65,536 distinct values of one field
CODE_MASK = (1 << BITS) - 1


class StateCodec:
    """Tuples of ``nfields`` values to ints and back (module docstring); the tables grow as new
    values are seen."""

    def __init__(self, nfields: int):
        self.nfields = nfields
        self._codes = [{} for _ in range(nfields)]  # per field: value -> code
        self._values = [[] for _ in range(nfields)]  # per field: code -> value

    def code(self, field: int, value) -> int:
        """``value``'s code in ``field``, shifted to the field's bits."""
        codes = self._codes[field]
        c = codes.get(value)
        if c is None:
            c = len(codes)
            if c > CODE_MASK:
                raise ValueError(f"field {field} of the state takes more than {CODE_MASK + 1} distinct values")
            codes[value] = c
            self._values[field].append(value)
        return c << (BITS * field)

    def encode(self, st: tuple) -> int:
        x = 0
        for field, value in enumerate(st):
            x |= self.code(field, value)
        return x

    def value(self, x: int, field: int):
        return self._values[field][(x >> (BITS * field)) & CODE_MASK]

    def decode(self, x: int) -> tuple:
        codes = array("H", x.to_bytes(2 * self.nfields, sys.byteorder))  # (BITS is 16: one "H" per field)
        return tuple(map(list.__getitem__, self._values, codes))

    @staticmethod
    def mask(fields) -> int:
        """The bits of ``fields``."""
        m = 0
        for f in fields:
            m |= CODE_MASK << (BITS * f)
        return m


class DecodedStates:
    """A read-only sequence of the tuples of encoded states (decoded when read)."""

    def __init__(self, codec: StateCodec, states: list):
        self.codec, self.states = codec, states

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> tuple:
        return self.codec.decode(self.states[i])
