"""The search's form of a state: the model's flat tuple packed into one int.

Field ``i`` of the tuple becomes its value's *code* (the value's index in that field's table, in
the order the values were first seen) in bits ``[b i, b i + b)``, ``b`` 8 or 16 bits a field.
Equal tuples give equal ints and different tuples different ints, so the visited set keeps its
meaning; an int of a few hundred bits hashes and compares several times faster than a tuple of
tens of ints and takes a fraction of its memory. What a process reads is then a mask (:meth:`StateCodec.mask`), and a step that writes
a few fields is ``(x & keep) | put`` (:class:`streamring.verify.memo.Step`).

The models, their look-ahead and the results keep the tuple (:meth:`StateCodec.decode`,
:class:`DecodedStates`).
"""

from __future__ import annotations

import sys
from array import array

class FieldOverflow(ValueError):
    """A field of the state took more distinct values than its code has room for."""


class StateCodec:
    """Tuples of ``nfields`` values to ints and back (module docstring); the tables grow as new
    values are seen. ``bits`` per field: 8 (up to 256 distinct values of each field; smaller ints,
    faster) or 16 (65,536)."""

    TYPECODES = {8: "B", 16: "H"}  # an unsigned array item of each width

    def __init__(self, nfields: int, bits: int = 8):
        self.nfields, self.bits = nfields, bits
        self.code_mask = (1 << bits) - 1
        self._typecode = self.TYPECODES[bits]
        self._codes = [{} for _ in range(nfields)]  # per field: value -> code
        self._values = [[] for _ in range(nfields)]  # per field: code -> value

    def code(self, field: int, value) -> int:
        """``value``'s code in ``field``, shifted to the field's bits."""
        codes = self._codes[field]
        c = codes.get(value)
        if c is None:
            c = len(codes)
            if c > self.code_mask:
                raise FieldOverflow(f"field {field} of the state takes more than {c} distinct values")
            codes[value] = c
            self._values[field].append(value)
        return c << (self.bits * field)

    def encode(self, st: tuple) -> int:
        x = 0
        for field, value in enumerate(st):
            x |= self.code(field, value)
        return x

    def decode(self, x: int) -> tuple:
        codes = array(self._typecode, x.to_bytes(self.bits // 8 * self.nfields, sys.byteorder))
        return tuple(map(list.__getitem__, self._values, codes))

    def mask(self, fields) -> int:
        """The bits of ``fields``."""
        m = 0
        for f in fields:
            m |= self.code_mask << (self.bits * f)
        return m


class DecodedStates:
    """A read-only sequence of the tuples of encoded states (decoded when read)."""

    def __init__(self, codec: StateCodec, states: list):
        self.codec, self.states = codec, states

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> tuple:
        return self.codec.decode(self.states[i])
