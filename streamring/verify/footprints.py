"""Which fields of a state each process's expansion reads or writes (its *footprint*).

``model.expand_process(st, pid)`` (:mod:`streamring.verify.steps`, :mod:`streamring.verify.ep`) is
a function of the fields of ``footprint(pid)`` alone, and the fields its steps change are in the
footprint or are written with values that depend only on it (a plain store whose old value nobody
reads: a payload cell, a generation word, a collected combine entry). The memo of the expansion
(:mod:`streamring.verify.memo`) keys each process's entry by these fields, and checks on each
entry it computes that no other field is used (:class:`~streamring.verify.memo.FootprintError`):
a footprint too small fails loudly, one too large only costs memo hits.

Every process of rank ``r`` reads ``EP[r]`` and ``END[r]`` (the epoch it is in, whether the rank
ended it). The ring's processes (``model`` a :class:`~streamring.verify.steps.RingModel`):
:func:`ring_footprint`; the expert-parallel layer's (:class:`~streamring.verify.ep.EPModel`):
:func:`ep_footprint`.
"""

from __future__ import annotations


def _span(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def holder_fields(model) -> list[int]:
    """What ``_holders`` reads (who holds a slot): every consumer's program counter, end flag,
    epoch and (ready order) held source."""
    R = model.R
    return _span(model.CPC, R) + _span(model.END, R) + _span(model.EP, R) + _span(model.HLD, R)


def ring_footprint(model, pid: int) -> tuple[int, ...]:
    """The fields the ring's process ``pid`` reads or writes (module docstring), sorted."""
    R, S = model.R, model.S
    if pid == model.BEGIN:  # every rank's epoch and end flag; resets the rest to constants
        return tuple(_span(model.EP, R) + _span(model.END, R))
    r, i = divmod(pid, 6)
    own = [model.EP + r, model.END + r]
    if i in (0, 1, 3, 4):  # producer (r, k) and the early drain of its pending store
        k = i % 3
        own += [model.PSL + 2 * r + k, model.PVL + 2 * r + k] + holder_fields(model)
        if i < 2:  # reserve: its ack masks and collected generations
            own += [model.PPC + 2 * r + k] + _span(model.ACK + r * S, S) + _span(model.COL + r * S, S)
    elif i == 2:  # consumer: its generation words, every payload cell, every ack mask
        own += [model.CPC + r, model.HLD + r, model.DNM + r] + _span(model.RDY + 2 * r * R * S, 2 * R * S)
        own += _span(model.PAY, 2 * R * S) + _span(model.ACK, R * S)
    else:  # end of epoch: its roles' progress, its ack masks and collected generations
        own += [model.PPC + 2 * r, model.PPC + 2 * r + 1, model.CPC + r]
        own += _span(model.ACK + r * S, S) + _span(model.COL + r * S, S)
    return tuple(sorted(set(own)))


def ep_footprint(model, pid: int) -> tuple[int, ...]:
    """The fields process ``pid`` of the expert-parallel layer's model reads or writes, sorted: the
    ring's processes read the layer's fields only at the end of epoch (the compute and reduce it
    waits for, the counters it carries into the next epoch)."""
    R, C, K = model.R, model.C, model.K
    if pid == model.BEGIN:  # never moves
        return ()
    r = model.rank_of[pid]
    if pid < model.BEGIN:
        own = list(ring_footprint(model, pid))
        if pid == 6 * r + 5:
            own += [model.CCUR + r, model.CMP + r, model.RED + r] + _span(model.ARR + r * C, C)
        return tuple(sorted(set(own)))
    own = [model.EP + r, model.END + r, model.CCUR + r, model.CPS + r, model.CPV + r]
    if pid == model.CP[r]:  # its copies, the owners' combine cells, counters and reduce progress
        own += [model.CPH + r, model.CMP + r, model.CPC + r, model.DNM + r] + _span(model.EP, R)
        own += _span(model.CMB, R * C * K) + _span(model.ARR, R * C) + _span(model.ARRO, R * C)
        own += _span(model.LRE, R * C)
    elif pid == model.RP[r]:  # its producers, counters, combine area; the adds still owed to it
        own += [model.RED + r, model.PPC + 2 * r, model.PPC + 2 * r + 1]
        own += _span(model.ARR + r * C, C) + _span(model.ARRO + r * C, C) + _span(model.CMB + r * C * K, C * K)
        own += _span(model.EP, R) + _span(model.END, R) + _span(model.CMP, R) + _span(model.CCUR, R)
        own += _span(model.CPH, R) + _span(model.CPS, R) + _span(model.CPV, R)
    return tuple(sorted(set(own)))
