"""The expert-parallel layer's look-ahead, for the partial-order reduction (``--layer ep``).

``--layer ep`` always uses the reduction, and its look-ahead knows more waits.
A compute waits for its consumer's copy; a reduce for its producers' publish and
for the adds that only the computes still owing rows of that chunk can make (each
of them needed when the others' rows cannot complete the count); a rank's end of
epoch, hence everything its processes do in later epochs, for its own roles, the
producers that have still to publish to it, the consumers that have still to
acknowledge its last chunk and the computes its reduce waits for. Past its end
of epoch an outside process may touch anything except what belongs to an owner
that the set keeps from ending the same or an earlier epoch (its slots,
generation words, ack masks, combine area, counters, reduce): another rank
reaches those in a later epoch only by acquiring that owner's chunk of that
epoch. That needs an acquire that reads the generation word and classifies every
word of an earlier epoch as OLDER; this is checked on the classify in use when a
model is built (``skip-acquire``, ``ignore-epoch`` or a patched
``classify_gen`` turn the step off). The graph stays acyclic (per rank: epoch,
then program counters, compute progress and empty buffers). The tests compare
the reduced and the full graph of the ep layer on small sizes, for the correct
protocol and for every mutation.

``model`` is an :class:`~streamring.verify.ep.EPModel`; its ``_future``, ``_drain_later``,
``_end_blockers`` and ``_beyond_epoch`` answer with these functions (the ring's processes keep the
ring's look-ahead, :mod:`streamring.verify.lookahead`). :func:`arrival_blockers` also gives the
owner's reduce its necessary enabling set.
"""

from __future__ import annotations


def pending_adds(model, st, r: int, c: int, e: int) -> list[int]:
    """Per consumer: the adds to owner ``r``'s ``arrived[c]`` (owner epoch ``e``) not made yet.

    A consumer one epoch behind the owner may still owe adds of that older epoch (only when
    the owner did not wait for them: skip-arrival-wait) and owes every add of epoch ``e``; a
    consumer ahead of the owner has made every add of epoch ``e`` (its end of epoch waited for
    its compute) and cannot add for a later one before the owner publishes it. (A consumer
    that accepted a chunk of another epoch stopped there: a violation is terminal.)"""
    out = []
    for d in range(model.R):
        ed = st[model.EP + d]
        n = 0
        if not st[model.END + d] and ed <= e:
            owed = model.ent_mask[ed][d][r][c] & ~st[model.CMP + d]
            cur = st[model.CCUR + d]
            if cur >= 0 and st[model.CPH + d] == 2:
                owed &= ~(1 << cur)
            n = owed.bit_count()
            if ed < e:
                n += model.ent_mask[e][d][r][c].bit_count()
        out.append(n)
    return out


def arrival_blockers(model, st, r: int, c: int, e: int) -> tuple[int, tuple]:
    """The owner's wait ``arrived[c] == expected[c]``: ``(bl, nes)``: the compute processes each
    of which must move before it passes (a pid mask), and a necessary enabling set."""
    a = st[model.ARR + r * model.C + c]
    need = model.expected[e][r][c] - a
    if need == 0:
        return 0, ()
    pend = pending_adds(model, st, r, c, e)
    tot = sum(pend)
    if need < 0 or tot < need:  # adds only grow it: this wait never passes
        return 0, ()
    bl = 0
    for d, n in enumerate(pend):
        if n and tot - n < need:
            bl |= 1 << model.CP[d]
    return bl, ("all",) + tuple((model.CP[d],) for d, n in enumerate(pend) if n)


def drain_later(model, st: tuple, r: int, k: int) -> tuple[int, int]:
    """What the later early drains of producer ``(r, k)`` may read and write: only the slots it still
    writes in this epoch (a rank's next epoch begins at its own end of epoch)."""
    S = model.S
    later_r = later_w = model.b_pend[r][k]
    pc = st[model.PPC + 2 * r + k]
    for c in range(pc // model.nsteps, model.C if pc < model.pdone else 0):
        later_r |= model.b_pos_rs[r][c % S]
        later_w |= model.b_pay[r][k][c % S]
    return later_r, later_w


def future(model, st: tuple, pid: int):
    """:meth:`RingModel._future <streamring.verify.steps.RingModel._future>` of ``BEGIN`` and of the
    layer's processes (compute, combine drain, reduce); the ring's processes are the ring's."""
    if pid == model.BEGIN:  # never moves: the cut with every process as a blocker keeps it out of the sets
        return ((model.ALLP, 0, 0, 0),)
    r = model.rank_of[pid]
    if st[model.END + r]:
        return ((0, 0, 0, 0),)
    e = st[model.EP + r]
    if pid == model.CP[r]:
        return future_compute(model, st, r, e)
    if pid == model.CDP[r]:
        return future_combine_drain(model, st, r, e)
    return future_reduce(model, st, r, e)


def future_compute(model, st: tuple, d: int, e: int):
    """The compute of consumer ``d``: every entry it has still to compute in epoch ``e``; those of
    chunks its consumer has not copied yet lie past a cut that waits for that consumer."""
    mask, cur = st[model.CMP + d], st[model.CCUR + d]
    aR = aW = aO = bR = bW = bO = 0  # now available / waiting for the consumer's copy
    blocked = False
    for j, (src, c, k) in enumerate(model.entries[e][d]):
        if (mask >> j) & 1:
            continue
        cR = model.b_cpend[d] | model.b_cell[src][c][k] | model.b_cell_red[model._cell(src, c, k)]
        cW = model.b_cpend[d] | model.b_cell[src][c][k]
        if j == cur or model._copied(st, d, src, c):
            aR, aW, aO = aR | cR, aW | cW, aO | model.b_arr[src][c]
        else:
            blocked = True
            bR, bW, bO = bR | cR, bW | cW, bO | model.b_arr[src][c]
    done = model.b_done[model.CP[d]]
    if blocked:
        return ((1 << (6 * d + 2), aR, aW, aO), (0, aR | bR, aW | bW | done, aO | bO))
    return ((0, aR, aW | done, aO),)


def future_combine_drain(model, st: tuple, d: int, e: int):
    """The early drain of consumer ``d``'s pending combine store: that store now; later ones (any
    entry not computed yet) only after a later combine write of its compute."""
    aR = aW = 0
    if st[model.CPS + d] >= 0:
        src, c, k = model.entries[e][d][st[model.CCUR + d]]
        aR = aW = model.b_cpend[d] | model.b_cell[src][c][k]
    later = model.b_cpend[d]
    mask = st[model.CMP + d]
    for j, (src, c, k) in enumerate(model.entries[e][d]):
        if not (mask >> j) & 1:
            later |= model.b_cell[src][c][k]
    return ((1 << model.CP[d], aR, aW, 0), (0, aR | later, aW | later, 0))


def future_reduce(model, st: tuple, r: int, e: int):
    """The owner's reduce: per chunk still to reduce, a cut that waits for its producers' publish and
    for the computes whose adds ``arrived == expected`` needs (:func:`arrival_blockers`)."""
    segs, aR, aW = [], 0, 0
    for c in range(st[model.RED + r], model.C):
        bl = 0
        for k in (0, 1):
            if st[model.PPC + 2 * r + k] < (c + 1) * model.nsteps:
                bl |= 1 << (6 * r + k)
        if not model.skip_arrival_wait:
            bl |= arrival_blockers(model, st, r, c, e)[0]
        if bl:
            segs.append((bl, aR, aW, 0))
        aR |= model.b_arr[r][c] | model.b_cells_rc[r][c]
        aW |= model.b_arr[r][c] | model.b_red[r][c]
    segs.append((0, aR, aW | model.b_done[model.RP[r]], 0))
    return tuple(segs)


def cross_blockers(model, st: tuple) -> list[int]:
    """Per rank, processes each of which must move before that rank's end of epoch.

    Its own unfinished roles; every producer that has still to publish a chunk of this epoch
    to it, and every consumer that has still to acknowledge its last chunk of this epoch (its
    ack mask holds only that chunk's acks once the producer collected the previous lap's; of
    a rank behind it: all of them); every compute that must still add to one of its arrived
    counters for its reduce to pass."""
    if model._xb_cache[0] is st:
        return model._xb_cache[1]
    R, C, NPH = model.R, model.C, model.NPH
    out = []
    last_pub = model.last_pub
    for r in range(R):
        e = st[model.EP + r]
        bl = 0
        for p in model.roles_of[r]:
            if not model.role_done(st, p):
                bl |= 1 << p
        for r2 in range(R):
            e2 = st[model.EP + r2]
            # (skip-ack-wait: acks of an earlier chunk of the slot, of this or of the previous
            # epoch, may still sit in the mask and fill it: no consumer is needed for certain)
            consumer_needed = not model.skip_ack_wait
            if e2 < e:
                bl |= (1 << (6 * r2)) | (1 << (6 * r2 + 1)) | (consumer_needed << (6 * r2 + 2))
            elif e2 == e and r2 != r and not st[model.END + r2]:
                for k in (0, 1):
                    # (skip-acquire: a consumer needs the payload, not the publish)
                    if st[model.PPC + 2 * r2 + k] <= last_pub[r] and not model.skip_acquire:
                        bl |= 1 << (6 * r2 + k)
                if not consumer_needed:
                    continue
                pc = st[model.CPC + r2]
                if not model.ready_order:
                    acked = pc >= ((C - 1) * R + r) * NPH + 2
                else:
                    cur = pc // (R * NPH)
                    acked = cur > C - 1 or (cur == C - 1 and (bool((st[model.DNM + r2] >> r) & 1)
                                                              or st[model.HLD + r2] == r))
                if not acked:
                    bl |= 1 << (6 * r2 + 2)
        # the computes whose adds its reduce waits for
        if not model.skip_arrival_wait and not st[model.END + r]:
            for c in range(st[model.RED + r], C):
                bl |= arrival_blockers(model, st, r, c, e)[0]
        out.append(bl)
    model._xb_cache = (st, out)
    return out


def beyond_epoch(model, st: tuple):
    """Each rank crosses into its next epoch on its own, once nothing of the set blocks its end of
    epoch (:func:`cross_blockers`); in its later epochs it touches nothing of an owner that cannot
    end this epoch (a process it needs is in the set) and is not ahead (module docstring). None
    when every rank is in the last epoch."""
    EP, R, ALL, b_owner = model.EP, model.R, model.ALL, model.b_owner
    can_cross = [st[EP + r] < model.E for r in range(R)]
    if not any(can_cross):  # every rank is in the last epoch
        return None
    cross_r = cross_blockers(model, st)
    rank_of = model.rank_of
    others = range(R if model.exact_acquire else 0)

    def beyond(q: int, T: int) -> int:
        rq = rank_of[q]
        if not can_cross[rq] or cross_r[rq] & T:
            return 0
        nxt_ = ALL
        eq = st[EP + rq]
        for r2 in others:
            if r2 != rq and cross_r[r2] & T and st[EP + r2] <= eq:
                nxt_ &= ~b_owner[r2]
        return nxt_

    return beyond
