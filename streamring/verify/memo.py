"""The model's expansion, memoised per process on the fields it reads (its footprint).

A process's entry of ``model.expand(st)`` (its enabled steps, what its next step reads and
writes, its necessary enabling set) is a function of the fields of ``model.footprint(pid)``
(:mod:`streamring.verify.footprints`), and at the default sizes the explored states hold only
about 47,000 distinct footprint values over their 5.3 million (state, process) pairs. The memo
works on the search's encoded states (:mod:`streamring.verify.codec`): it computes each entry once
per distinct footprint value (the state's bits under the footprint's mask) and keeps each step as
:class:`Step`, the fields it writes and their new values, which hold for every state of that
footprint value; a successor is the state with those fields replaced (:meth:`Step.apply`).

Checked, not assumed: each entry is computed on a tuple whose fields outside the footprint are
:class:`_Unread` placeholders. Any use of such a value (comparison, arithmetic, hashing, truth,
indexing, formatting) raises :class:`FootprintError`, and so does a placeholder that ends up in a
step's description, a successor's other field or the entry (the memo hashes each of them). So a
footprint that leaves out a field the process uses fails on the first state where it matters
instead of giving other successors; a placeholder still in a successor is a field the step did not
write.
"""

from __future__ import annotations

from itertools import compress
from operator import is_not, itemgetter

from .codec import StateCodec
from .state import Trans


class FootprintError(RuntimeError):
    """A process's expansion used a field outside its declared footprint (a model bug)."""


class _Unread:
    """A field outside the footprint of the process being expanded: every use of it raises."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<field {self.index}: outside the footprint>"


def _refuse(self, *args):
    raise FootprintError(f"the expansion used field {self.index} (read it, or copied it into a step, which "
                         f"hashing the step finds), and the field is outside the process's footprint")


for _name in ("eq ne lt le gt ge hash bool index int float format str len iter contains getitem "
              "add radd sub rsub mul rmul floordiv rfloordiv truediv rtruediv mod rmod divmod rdivmod "
              "pow rpow lshift rlshift rshift rrshift and rand or ror xor rxor neg pos abs invert "
              "round trunc floor ceil").split():
    setattr(_Unread, f"__{_name}__", _refuse)


class Step:
    """One enabled step of a process, for every state with the same footprint value: its
    description, its violation (None: a successor), and what it writes: the successor of an
    encoded state ``x`` is ``(x & keep) | put``."""

    __slots__ = ("pid", "desc", "violation", "keep", "put")

    def __init__(self, pid: int, desc: tuple, violation, keep: int, put: int):
        self.pid, self.desc, self.violation, self.keep, self.put = pid, desc, violation, keep, put

    def apply(self, x: int) -> int:
        """The successor of the encoded state ``x`` (a step without a violation)."""
        return (x & self.keep) | self.put

    def trans(self) -> Trans:
        """A violating step as :meth:`RingModel.expand <streamring.verify.steps.RingModel.expand>`
        gives it."""
        return Trans(self.pid, self.desc, None, self.violation)


class ExpansionMemo:
    """``model.expand`` of encoded states (``codec``, a :class:`~streamring.verify.codec.StateCodec`
    of ``bits`` a field), each process's entry memoised on its footprint's values; the entries hold
    :class:`Step` objects where the model's hold :class:`~streamring.verify.state.Trans`."""

    def __init__(self, model, bits: int = 8):
        self.model = model
        n = len(model.initial())
        self.codec = StateCodec(n, bits)
        self._blank = tuple(_Unread(i) for i in range(n))
        self._fields = range(n)
        footprints = [model.footprint(pid) for pid in range(model.NP)]
        # per process: its entries by the bits of its footprint in a state
        self._entries = [{} for _ in footprints]
        self._keys = [(self.codec.mask(fields), entries.get) for fields, entries in zip(footprints, self._entries)]
        # per process: (a state's values + the placeholders) -> the state seen through its footprint
        self._masked = [itemgetter(*(f if f in fields else n + f for f in range(n))) for fields in footprints]

    def expand(self, x: int) -> list:
        """Per process ``(steps, accR, accW, accO, nes)`` of the encoded state ``x``, as
        ``model.expand`` with steps as :class:`Step`."""
        out = [entry(x & mask) for mask, entry in self._keys]
        if None in out:  # (an entry is a non-empty tuple)
            seen = self.codec.decode(x) + self._blank
            for pid, got in enumerate(out):
                if got is None:
                    mask = self._keys[pid][0]
                    out[pid] = self._entries[pid][x & mask] = self._compute(seen, pid)
        return out

    def _compute(self, seen: tuple, pid: int):
        """Process ``pid``'s entry for the footprint value of a state, computed on a tuple of the
        footprint's values and placeholders elsewhere (module docstring); ``seen``: the state's
        values followed by the placeholders."""
        codec = self.codec
        masked = self._masked[pid](seen)
        entry = self.model.expand_process(masked, pid)
        trans, acc_r, acc_w, acc_o, nes = entry
        hash(entry[1:])  # (a placeholder in the entry refuses its hash: FootprintError)
        steps = []
        for t in trans:
            hash(t.desc)
            keep, put = -1, 0
            if t.violation is None:
                new = t.state
                # (a field the step did not write still holds the very object it was given; a
                # placeholder copied into another field refuses the hash of its code)
                written = list(compress(self._fields, map(is_not, new, masked)))
                keep = ~codec.mask(written)
                for f in written:
                    put |= codec.code(f, new[f])
            steps.append(Step(t.pid, t.desc, t.violation, keep, put))
        return (tuple(steps), acc_r, acc_w, acc_o, nes)
