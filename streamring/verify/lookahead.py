"""The ring's look-ahead, for the partial-order reduction: what each process may access from now on
within its epoch, cut where it must wait (:func:`future`), and what an outside process may touch once
it crosses into a later epoch (:func:`beyond_epoch`).

The stubborn-set search (:mod:`streamring.verify.search`) asks a model through
:meth:`RingModel._future <streamring.verify.steps.RingModel._future>` and ``_beyond_epoch``; these
are the ring's answers, read off the model's state layout and variable bits
(:mod:`streamring.verify.state`). ``model`` is a :class:`~streamring.verify.steps.RingModel` (or a
layer's subclass): a layer changes the ring's look-ahead only through the model's hooks
``_drain_later`` (what the later early drains of a producer may touch), ``_end_blockers`` and
``_end_writes`` (its end of epoch), and adds its own processes' look-ahead
(:mod:`streamring.verify.ep_lookahead`).

Each answer must over-approximate: every access a process can make before the cut, and every
process (``blockers``, a pid mask) of which one must move before it can pass the cut. Results that
depend only on a few fields of the state are cached in ``model._fut_cache``.
"""

from __future__ import annotations

from ..ring.layout import GenState


def future(model, st: tuple, pid: int):
    """What ``pid`` may access from now on within this epoch, cut where it must wait.

    A list ``[(blockers, R, W, O), ...]``: the accesses of the steps before the i-th wait
    point, which cannot be passed while a process of ``blockers`` (a pid mask) stands
    still; the last entry (blockers 0) holds everything up to the end of the epoch.
    """
    if pid == model.BEGIN:
        return ((0, 0, 0, 0),)
    r, i = divmod(pid, 6)
    if st[model.END + r]:
        return ((0, 0, 0, 0),)
    e = st[model.EP + r]
    if i in (0, 1):
        return future_producer(model, st, pid, r, i, e)
    if i == 2 and model.ready_order:
        return future_consumer_any(model, st, pid, r)
    if i == 2:
        return future_consumer(model, st, pid, r, e)
    if i in (3, 4):
        return future_drain(model, st, r, i - 3)
    return future_end(model, st, r, e)


def future_producer(model, st: tuple, pid: int, r: int, k: int, e: int):
    """The ``KINDS[k]`` producer of rank ``r``: its remaining steps of epoch ``e``, cut at each reserve
    that waits for ack bits (the consumers missing from the mask are the blockers)."""
    S = model.S
    gens = model.gens[e]
    pc = st[model.PPC + 2 * r + k]
    key = (pid, pc, e, st[model.ACK + r * S:model.ACK + r * S + S], st[model.COL + r * S:model.COL + r * S + S])
    res = model._fut_cache.get(key)
    if res is not None:
        return res
    segs, aR, aW = [], 0, 0
    for j in range(pc, model.pdone):
        c, jj = divmod(j, model.nsteps)
        step, t = model.steps[jj]
        s = c % S
        if step == "reserve":
            if c >= S and not model.skip_ack_wait:
                if st[model.COL + r * S + s] != gens[c - S]:
                    bl = 0
                    for b in model.missing_bits(st[model.ACK + r * S + s]):
                        bl |= 1 << (6 * b + 2)
                    if bl:
                        segs.append((bl, aR, aW, 0))
                aR |= model.b_col[r][s] | model.b_ack[r][s]
                aW |= model.b_col[r][s] | model.b_ack[r][s]
        elif step == "write":
            aR |= model.b_pos_rs[r][s] | model.b_pend[r][k]
            aW |= model.b_pend[r][k]
        else:
            aR |= model.b_pos_rs[r][s] | model.b_pend[r][k]
            aW |= model.b_pend[r][k] | model.b_pay[r][k][s]
            if step == "publish":
                aW |= model.b_rdy[t][k][r][s]
    aW |= model.b_done[pid]
    segs.append((0, aR, aW, 0))
    res = tuple(segs)
    model._fut_cache[key] = res
    return res


def future_consumer_any(model, st: tuple, pid: int, d: int):
    """Ready order: any pending source in any order: over-approximated with every access of every
    remaining (chunk, source) step, reachable without waiting (sound, less reduction)."""
    R, S, NPH = model.R, model.S, model.NPH
    pc = st[model.CPC + d]
    aR = aW = aO = 0
    for j in range(pc - (pc % (NPH * R)), model.cdone):
        item, phase = divmod(j, NPH)
        c, src = divmod(item, R)
        s = c % S
        aR |= model.b_rdy[d][0][src][s] | model.b_rdy[d][1][src][s] | model.b_pay[src][0][s] | model.b_pay[src][1][s]
        aW |= model.b_pos[d][src][s]
        aO |= model.b_ack[src][s]
    return ((0, aR, aW | model.b_done[pid], aO),)


def future_consumer(model, st: tuple, pid: int, d: int, e: int):
    """The rank-order consumer of rank ``d``: its remaining acquires and acks of epoch ``e``, cut at
    each acquire whose generation words still read OLDER (their producers are the blockers)."""
    R, S, NPH = model.R, model.S, model.NPH
    gens = model.gens[e]
    pc = st[model.CPC + d]
    key = (pid, pc, e, st[model.RDY + 2 * d * R * S:model.RDY + 2 * (d + 1) * R * S])
    res = model._fut_cache.get(key)
    if res is not None:
        return res
    segs, aR, aW, aO = [], 0, 0, 0
    for j in range(pc, model.cdone):
        item, phase = divmod(j, NPH)
        c, src = divmod(item, R)
        s = c % S
        if phase == 0:
            if not model.skip_acquire:
                bl = 0
                for k in (0, 1):
                    w = st[model.RDY + ((2 * d + k) * R + src) * S + s]
                    if model.classify(w, gens[c]) is GenState.OLDER:
                        bl |= 1 << (6 * src + k)  # only that producer writes this word
                if bl:
                    segs.append((bl, aR, aW, aO))
                aR |= model.b_rdy[d][0][src][s] | model.b_rdy[d][1][src][s]
            aR |= model.b_pay[src][0][s] | model.b_pay[src][1][s]
            aW |= model.b_pos[d][src][s]
        else:
            aO |= model.b_ack[src][s]
            aW |= model.b_pos[d][src][s]
    aW |= model.b_done[pid]
    segs.append((0, aR, aW, aO))
    res = tuple(segs)
    model._fut_cache[key] = res
    return res


def future_drain(model, st: tuple, r: int, k: int):
    """The early drain of producer ``(r, k)``: its pending store now; later ones only after that
    producer's next write (the layer's ``_drain_later`` says what they may touch)."""
    ps = st[model.PSL + 2 * r + k]
    aR = aW = 0
    if ps >= 0:
        aR = model.b_pend[r][k] | model.b_pos_rs[r][ps]
        aW = model.b_pend[r][k] | model.b_pay[r][k][ps]
    # later drains need a later write of the producer first
    later_r, later_w = model._drain_later(st, r, k)
    return ((1 << (6 * r + k), aR, aW, 0), (0, aR | later_r, aW | later_w, 0))


def future_end(model, st: tuple, r: int, e: int):
    """End of epoch: waits for the rank's roles, and for the missing ack bits of its last chunks."""
    S = model.S
    gens = model.gens[e]
    roles = model.roles_of[r]
    bl = model._end_blockers(st, r)
    for p in roles:
        if not model.role_done(st, p):
            bl |= 1 << p
    for s in range(S):
        lc = model.last_chunk[s]
        if lc >= 0 and st[model.COL + r * S + s] != gens[lc]:
            for b in model.missing_bits(st[model.ACK + r * S + s]):
                bl |= 1 << (6 * b + 2)
    aR = 0
    for p in roles:
        aR |= model.b_done[p]
    aW = model.b_ack_r[r] | model.b_col_r[r] | model.b_end[r] | model._end_writes(r, e, aR)
    return ((bl, 0, 0, 0), (0, aR, aW, 0)) if bl else ((0, aR, aW, 0),)


def beyond_epoch(model, st: tuple):
    """What an outside process may touch in later epochs, as ``f(q, T) -> variable mask`` (``T``: the
    stubborn set, a pid mask), or None when nothing can cross (the last epoch). In the ring nothing
    crosses into the next epoch before every role is done (the collective begin): while a process
    of ``T`` holds an unfinished role, nothing; otherwise, outside the last epoch, anything."""
    if st[model.EP] >= model.E:
        return None
    cross_bl = 0
    for p in model.role_pids:
        if not model.role_done(st, p):
            cross_bl |= 1 << p
    ALL = model.ALL
    return lambda q, T: 0 if cross_bl & T else ALL
