"""The ring protocol's steps: the transition system the model checker explores.

Processes and atomic steps (rank ``r``; slot ``s = c % S``; ``g = plan.gen(c)``)
==============================================================================
* route producer and layout producer of ``r`` (independent: either order):

  - ``reserve c`` (``Ring.try_reserve``): for ``c >= S`` the acks of ``c - S``
    (``Ring.try_collect_acks``): already collected by this rank
    (``_collected[s] == gen(c - S)``, shared by both producers), or the ack mask
    is full and then ``_collected[s]`` is recorded and the mask cleared in the
    same step (once full, nobody but the owner writes the mask, so splitting the
    check from the clear adds no behaviour). ``skip-ack-wait`` skips the wait;
  - ``write``: a *plain* store ``payload[r][kind][s] := g`` (the value stands
    for ``(r, g, kind)``: rank and part are the cell's). Weak memory: the store
    goes to the producer's pending buffer and no reader (other ranks, nor this
    rank's consumer, another thread) sees it until it is flushed. The buffer is
    per producer, not per rank: route and layout producers are different
    threads, and a release orders only the releasing thread's own stores, so a
    route release does not flush a layout store (a per-rank buffer would be
    flushed by either release: fewer behaviours, so this is the weaker memory);
  - ``publish -> rank t``, one step per target in ``Ring._publish`` order
    (every rank, the owner included): ``ready_gen[t][kind][r][s] := g``. A
    ``signal_op`` is a release: it first flushes the producer's pending stores;
  - ``signal-before-payload`` uses ``Ring._write_then_publish``'s mutated order:
    publish to every rank, then write (pending), then ``fence`` (flush);
  - a pending store may also *drain early* (a memory step of its own), which is
    legal; the reader then sees the new value before the release.

* consumer on ``d``: per chunk ``c``, per source ``src`` in rank order (as the
  stress harness): ``acquire`` (both generation words *at d* classify ``READY``
  with ``classify_gen``; ``OLDER`` waits; ``VIOLATION`` is a failure;
  ``skip-acquire`` proceeds without looking, as ``Ring.gen_state`` does;
  ``ignore-epoch`` passes ``ignore_epoch=True``), then the reads of the route
  part and of the layout part, then ``ack`` (``fetch_or`` of bit ``d`` into
  ``src``'s ``ack_mask[s]``). The two generation words are read in one step:
  once both read READY they stay so until this consumer acknowledges (only the
  owner rewrites them, after the acks), so reading them apart adds no behaviour
  to the correct protocol; a ``VIOLATION`` value is seen either way.
  With ``source_order='ready'`` (``--source-order ready``; the runtime's ``stress.source_order``
  / ``run.source_order``) the consumer acquires *any* source of its current chunk that it has not
  acknowledged yet, in every possible order (one step per ready source), then acknowledges the
  source it holds; it moves to the next chunk when every source is acknowledged. Its
  partial-order reduction over-approximates the consumer's future accesses (every remaining
  step, no wait points), which is sound but weak: the default sizes are explored exhaustively
  (879,348 states against 410,978 in rank order); 3 ranks did not finish in 10 minutes.

* end of epoch (``Ring.end_stream``): once the rank's three roles are done, the
  owner waits for the full masks of its last ``min(S, chunks)`` chunks (one
  step, same argument as for ``reserve``). ``begin_stream`` of the next epoch
  is collective (its allgather): one step once every rank has ended. No memory
  is cleared between epochs.

Signal words and ack masks are atomics with release/acquire semantics, so their
steps are sequentially consistent; weak memory is modelled where it matters,
on the plain payload stores. Bookkeeping nothing reads (``consumed_gen``,
``_slot_chunk``, metadata timestamps) is left out.

*Reads in the hold window* (a reduction, sound for every property): a consumer's reads change
nothing shared; the read of a part may happen at any moment between its acquire and its ack
(route before layout). A read can see a wrong value iff the cell is wrong at the acquire or is
rewritten with a wrong value while held. So the acquire checks both cells, and every flush of a
payload cell (release, fence, early drain) checks every consumer holding that cell; the trace
shows the read that would see it. This removes two steps per chunk and source without removing
an observable outcome.

For the partial-order reduction (:mod:`streamring.verify.search`) every process also says what its
next step reads, writes and fetch-ors (:meth:`RingModel.expand`) and what it may access from now
on until it must wait (:meth:`RingModel._future`; the ring's answers are in
:mod:`streamring.verify.lookahead`).
"""

from __future__ import annotations

from ..ring.layout import GenState, gen_str
from ..ring.policies import Inject
from . import footprints, lookahead
from .state import (KINDS, PROP_ABA, PROP_DEADLOCK, PROP_OVERWRITE, PROP_PROTOCOL, PROP_READ, PROP_SERIAL,
                    PROPERTIES, RingState, Trans, Violation, _g, _older_epoch)


class RingModel(RingState):
    """The ring protocol as a transition system over flat tuples (module docstring).

    :meth:`expand` gives, per process, its enabled steps and the accesses of its next step; a
    layer (:class:`streamring.verify.ep.EPModel`) adds processes through the ``_expand_role``,
    ``_ended_entry``, ``_layer_unfinished`` and ``_end_step`` hooks (and their footprints,
    :meth:`footprint`) and its own look-ahead through ``_future``.
    """

    properties = PROPERTIES
    safety = tuple(p for p in PROPERTIES if p not in (PROP_DEADLOCK, PROP_SERIAL))

    def result_config(self) -> dict:
        """The layer's own sizes, for the result's ``config`` (the ring has none beyond the common ones)."""
        return {}

    # -- transitions -----------------------------------------------------------------------
    def expand(self, st: tuple):
        """Per process: ``(transitions, accR, accW, accO, nes)``.

        ``transitions`` are the enabled steps (at most one per process, or its violation;
        a ready-order consumer may have several); ``acc*`` the variables the next step reads /
        writes / fetch-ors; ``nes`` the pids of which one must move before a disabled process can
        (a necessary enabling set; ``("all", g1, g2, ...)``: one of every group).
        """
        return [self.expand_process(st, pid) for pid in range(self.NP)]

    def expand_process(self, st: tuple, pid: int):
        """``expand(st)[pid]``, reading only the fields of :meth:`footprint` ``(pid)`` (the memo of
        :mod:`streamring.verify.memo` relies on it and checks it)."""
        if pid == self.BEGIN:
            return self._expand_begin(st)
        r = self.rank_of[pid]
        e = st[self.EP + r]
        if st[self.END + r]:
            return self._ended_entry(pid, e)
        # a finished role moves again in the next epoch (after next_epoch_wait)
        nxt = () if e >= self.E else self.next_epoch_wait[r]
        return self._expand_role(st, pid, r, e, nxt)

    def footprint(self, pid: int) -> tuple[int, ...]:
        """The fields :meth:`expand_process` of ``pid`` reads or writes
        (:func:`streamring.verify.footprints.ring_footprint`)."""
        return footprints.ring_footprint(self, pid)

    def _expand_role(self, st: tuple, pid: int, r: int, e: int, nxt: tuple):
        """Process ``pid`` of rank ``r``, which has not ended epoch ``e``."""
        i = pid - 6 * r
        if i < 2:
            return self._expand_producer(st, r, i, e, nxt)
        if i == 2:
            return self._expand_consumer(st, r, e, nxt)
        if i < 5:
            return self._expand_drain(st, r, i - 3)
        return self._expand_end(st, r, e)

    def successors(self, st: tuple) -> list[Trans]:
        return [t for p in self.expand(st) for t in p[0]]

    def _ended_entry(self, pid: int, e: int):
        """A process of a rank that ended epoch ``e``: it waits for the next epoch's begin (if any)."""
        return ((), 0, 0, 0, (self.BEGIN,) if e < self.E else ())

    def _expand_producer(self, st: tuple, r: int, k: int, e: int, nxt: tuple):
        """The ``KINDS[k]`` producer of rank ``r``: reserve, write (pending), publish to each rank."""
        S = self.S
        i = 2 * r + k
        pid = 6 * r + k
        pc = st[self.PPC + i]
        if pc >= self.pdone:
            return ((), 0, 0, 0, nxt)
        c, j = divmod(pc, self.nsteps)
        step, t = self.steps[j]
        s = c % S
        g = self.gens[e][c]
        done_bit = self.b_done[pid] if pc + 1 == self.pdone else 0
        if step == "reserve":
            return self._reserve_step(st, r, k, pid, pc, c, s, e)
        elif step == "write":
            return self._write_step(st, r, k, pid, pc, c, s, e, g, done_bit)
        else:  # publish to t, or fence: both release (flush) first
            lst = list(st)
            ps = lst[self.PSL + i]
            acc_r, acc_w = self.b_pend[r][k], done_bit
            fl = None
            if ps >= 0:  # (nothing pending: the flush has nothing to do)
                acc_r |= self.b_pos_rs[r][ps]
                acc_w |= self.b_pend[r][k] | self.b_pay[r][k][ps]
                fl = self._flush(lst, r, k)
            rd = None if fl is None else fl[1]
            if step == "publish":
                lst[self.RDY + ((2 * t + k) * self.R + r) * S + s] = g
                acc_w |= self.b_rdy[t][k][r][s]
                desc = ("publish", r, k, c, s, g, t, ps >= 0, rd)
            else:
                desc = ("fence", r, k, c, s, g, ps >= 0, rd)
            lst[self.PPC + i] = pc + 1
            tr = Trans(pid, desc, tuple(lst)) if fl is None else Trans(pid, desc, None, fl[0])
            return ((tr,), acc_r, acc_w, 0, ())

    def _reserve_step(self, st: tuple, r: int, k: int, pid: int, pc: int, c: int, s: int, e: int):
        """``reserve c``: the acks of chunk ``c - S`` collected (already, or now from a full mask)."""
        S = self.S
        i = 2 * r + k
        prev = c - S
        if prev < 0 or self.skip_ack_wait:
            lst = list(st)
            lst[self.PPC + i] = pc + 1
            op = "reserve-first" if prev < 0 else "reserve-skip"
            return ((Trans(pid, (op, r, k, c, s, prev), tuple(lst)),), 0, 0, 0, ())
        gp = self.gens[e][prev]
        ci, ai = self.COL + r * S + s, self.ACK + r * S + s
        if st[ci] == gp:
            lst = list(st)
            lst[self.PPC + i] = pc + 1
            return ((Trans(pid, ("reserve-collected", r, k, c, s, prev), tuple(lst)),), self.b_col[r][s], 0, 0, ())
        if self.mask_full(st[ai]):
            lst = list(st)
            lst[self.PPC + i] = pc + 1
            lst[ci] = gp
            lst[ai] = 0
            return ((Trans(pid, ("reserve-collect", r, k, c, s, prev), tuple(lst)),),
                    0, self.b_col[r][s] | self.b_ack[r][s], 0, ())
        nes = tuple(6 * b + 2 for b in self.missing_bits(st[ai]))
        return ((), 0, 0, 0, nes)

    def _write_step(self, st: tuple, r: int, k: int, pid: int, pc: int, c: int, s: int, e: int, g: int,
                    done_bit: int):
        """``write``: a plain store of the payload into slot ``s``, pending until the release."""
        i = 2 * r + k
        acc_r, acc_w = self.b_pos_rs[r][s] | self.b_pend[r][k], self.b_pend[r][k] | done_bit
        for d, c2, e2 in self._holders(st, r, s):
            if (e2, c2) != (e, c):
                how = ("acquired, not yet acknowledged" if st[self.CPC + d] % self.NPH == 1 else
                       "acquired and acknowledged, but its copy out of the slot has not completed")
                viol = Violation((PROP_OVERWRITE,), (
                    f"rank {r} {KINDS[k]} producer overwrites slot {s} with chunk {c} (epoch {e}) "
                    f"while rank {d} holds chunk {c2} (epoch {e2}) of that slot: {how}"))
                return ((Trans(pid, ("write", r, k, c, s, g), None, viol),), acc_r, acc_w, 0, ())
        lst = list(st)
        self._flush(lst, r, k)  # (always empty here: each write is followed by a release)
        lst[self.PSL + i] = s
        lst[self.PVL + i] = g
        lst[self.PPC + i] = pc + 1
        return ((Trans(pid, ("write", r, k, c, s, g), tuple(lst)),), acc_r, acc_w, 0, ())

    def _expand_drain(self, st: tuple, r: int, k: int):
        """The early drain of producer ``(r, k)``'s pending store (a legal memory step of its own)."""
        i = 2 * r + k
        mpid = 6 * r + 3 + k
        ps = st[self.PSL + i]
        if self.cfg.early_drain and ps >= 0:
            lst = list(st)
            v = lst[self.PVL + i]
            fl = self._flush(lst, r, k)
            acc_r = self.b_pend[r][k] | self.b_pos_rs[r][ps]
            acc_w = self.b_pend[r][k] | self.b_pay[r][k][ps]
            desc = ("drain", r, k, ps, v, fl[1] if fl else None)
            tr = Trans(mpid, desc, None, fl[0]) if fl else Trans(mpid, desc, tuple(lst))
            return ((tr,), acc_r, acc_w, 0, ())
        else:
            return ((), 0, 0, 0, (6 * r + k,))

    def _expand_consumer(self, st: tuple, r: int, e: int, nxt: tuple):
        """The consumer of rank ``r``: per chunk and source, acquire (+ reads), then release it."""
        R, NPH = self.R, self.NPH
        d = r
        pid = 6 * r + 2
        cpc = st[self.CPC + d]
        if cpc >= self.cdone:
            return ((), 0, 0, 0, nxt)
        item, phase = divmod(cpc, NPH)
        c, src = divmod(item, R)
        ready_order = self.ready_order
        if ready_order and phase >= 1:
            src = st[self.HLD + d]  # the source it holds, whichever rank that is
        s = c % self.S
        done_bit = self.b_done[pid] if cpc + 1 == self.cdone else 0
        if phase == 0 and not ready_order:
            return self._acquire_step(st, d, pid, src, c, e, cpc)
        elif phase == 0:
            # any source of chunk c not acknowledged yet, whichever is ready (several steps)
            trans, acc_r, acc_w, groups = [], 0, 0, []
            for src2 in range(R):
                if (st[self.DNM + d] >> src2) & 1:
                    continue
                tr, a_r, a_w, _, nes2 = self._acquire_step(st, d, pid, src2, c, e, cpc)
                acc_r |= a_r
                acc_w |= a_w
                trans += tr
                if not tr:
                    groups.append(nes2)
            # disabled: for EVERY pending source one of its blocking producers must move
            return (tuple(trans), acc_r, acc_w, 0, () if trans else ("all",) + tuple(groups))
        else:
            return self._release_step(st, d, pid, src, c, s, cpc, phase, done_bit)

    def _release_step(self, st: tuple, d: int, pid: int, src: int, c: int, s: int, cpc: int, phase: int,
                      done_bit: int):
        """The consumer's steps after its acquire (``phase >= 1``): the ring's is the ack."""
        return self._ack_step(st, d, pid, src, c, s, cpc, done_bit, releases_slot=True)

    def _ack_step(self, st: tuple, d: int, pid: int, src: int, c: int, s: int, cpc: int, done_bit: int,
                  releases_slot: bool):
        """``ack``: ``fetch_or`` of bit ``d`` into ``src``'s ``ack_mask[s]``. ``releases_slot``: the
        consumer's hold of the slot ends here (else a later step ends it)."""
        ai = self.ACK + src * self.S + s
        m = st[ai]
        bit = 1 << d
        desc = ("ack", d, src, c, s, m, m | bit)
        acc_w = (self.b_pos[d][src][s] if releases_slot else 0) | done_bit
        if m & bit and self.inject is Inject.NONE:
            msg = (f"rank {d}: ack bit already set in rank {src}'s ack_mask[slot={s}] when "
                   f"acknowledging chunk {c} (double acknowledgement: Ring.ack raises)")
            return ((Trans(pid, desc, None, Violation((PROP_PROTOCOL,), msg)),), 0, acc_w, self.b_ack[src][s], ())
        lst = list(st)
        lst[ai] = m | bit
        lst[self.CPC + d] = cpc + 1
        if self.ready_order and releases_slot:
            self._source_done(st, lst, d, src)
        return ((Trans(pid, desc, tuple(lst)),), 0, acc_w, self.b_ack[src][s], ())

    def _source_done(self, st: tuple, lst: list, d: int, src: int) -> None:
        """Ready order: consumer ``d`` is done with ``src`` (its chunk complete once every source is)."""
        done = st[self.DNM + d] | (1 << src)
        lst[self.DNM + d] = 0 if done == self.all_src else done  # chunk complete
        lst[self.HLD + d] = -1

    def _acquire_step(self, st, d, pid, src, c, e, cpc):
        """The consumer of ``d`` acquiring ``src``'s chunk ``c``: ``(transitions, accR, accW, accO, nes)``
        (one enabled step or its violation; or, disabled, the producers it waits for)."""
        R, S = self.R, self.S
        s = c % S
        g = self.gens[e][c]
        acc_r = self.b_pay[src][0][s] | self.b_pay[src][1][s]
        acc_w = self.b_pos[d][src][s]
        if self.skip_acquire:
            vr = vl = None
            ready = True
        else:
            acc_r |= self.b_rdy[d][0][src][s] | self.b_rdy[d][1][src][s]
            vr = st[self.RDY + ((2 * d + 0) * R + src) * S + s]
            vl = st[self.RDY + ((2 * d + 1) * R + src) * S + s]
            memo = self._cmemo  # (self.classify, inlined on its hot path)
            cr, cl = memo.get((vr, g)) or self.classify(vr, g), memo.get((vl, g)) or self.classify(vl, g)
            V, RD = GenState.VIOLATION, GenState.READY
            ready = cr is RD and cl is RD
        desc = ("acquire", d, src, c, s, g, vr, vl)
        if ready:
            viol = None
            if vr is not None and (vr != g or vl != g):
                bad = vr if vr != g else vl
                older = _older_epoch(bad, g)
                viol = Violation((PROP_ABA,) if older else (PROP_PROTOCOL,), (
                    f"rank {d} accepted generation {_g(bad)} as ready for {gen_str(g)} "
                    f"(src {src} chunk {c} slot {s})"
                    + (": a leftover of an older epoch (ABA)" if older else "")))
            else:
                # reads of the hold window, done right away (module docstring)
                pr = st[self.PAY + (2 * src + 0) * S + s]
                pl = st[self.PAY + (2 * src + 1) * S + s]
                desc = desc + (pr, pl)
                if pr != g or pl != g:
                    k = 0 if pr != g else 1
                    v = pr if k == 0 else pl
                    what = "stale" if k == 0 else "torn"
                    props = (PROP_READ, PROP_ABA) if _older_epoch(v, g) else (PROP_READ,)
                    viol = Violation(props, (
                        f"{what} read: rank {d} read the {KINDS[k]} part of src {src} chunk {c} "
                        f"(epoch {e}, slot {s}) and saw {_g(v)}, expected {gen_str(g)}"
                        + (" (its route part was correct)" if k == 1 else "")))
            if viol is not None:
                return ((Trans(pid, desc, None, viol),), acc_r, acc_w, 0, ())
            lst = list(st)
            lst[self.CPC + d] = cpc + 1
            if self.ready_order:
                lst[self.HLD + d] = src
            return ((Trans(pid, desc, tuple(lst)),), acc_r, acc_w, 0, ())
        elif cr is V or cl is V:
            name, seen = ("route_ready_gen", vr) if cr is V else ("layout_ready_gen", vl)
            msg = (f"rank {d}: {name}[src={src}][slot={s}] = {_g(seen)} while expecting "
                   f"{gen_str(g)}: classify_gen says VIOLATION (Ring.gen_state raises "
                   f"ProtocolViolation)")
            return ((Trans(pid, desc, None, Violation((PROP_PROTOCOL,), msg)),), acc_r, acc_w, 0, ())
        nes = tuple(6 * src + k for k, cl_ in ((0, cr), (1, cl)) if cl_ is not RD)
        return ((), 0, 0, 0, nes)

    def _layer_unfinished(self, st: tuple, r: int) -> tuple:
        """A layer's roles of rank ``r`` that are not done yet (its end of epoch waits for them)."""
        return ()

    def _expand_end(self, st: tuple, r: int, e: int):
        """``end_stream`` of rank ``r``: once its roles are done, wait for the full masks of its last
        chunks (collect them, clear the masks), then end the epoch (:meth:`_end_step`)."""
        S, ACK, COL = self.S, self.ACK, self.COL
        base = 6 * r
        pid = base + 5
        gens = self.gens[e]
        # (the rank has not ended here, so a role is done when its program counter is)
        unfinished = ()
        if st[self.PPC + 2 * r] < self.pdone:
            unfinished += (base,)
        if st[self.PPC + 2 * r + 1] < self.pdone:
            unfinished += (base + 1,)
        if st[self.CPC + r] < self.cdone:
            unfinished += (base + 2,)
        unfinished += self._layer_unfinished(st, r)
        if unfinished:
            return ((), 0, 0, 0, unfinished)
        for s in range(S):
            lc = self.last_chunk[s]
            m = st[ACK + r * S + s]
            if lc >= 0 and st[COL + r * S + s] != gens[lc] and not self.mask_full(m):
                return ((), 0, 0, 0, tuple(6 * b + 2 for b in self.missing_bits(m)))
        lst = list(st)
        for s in range(S):
            lc = self.last_chunk[s]
            if lc >= 0 and lst[COL + r * S + s] != gens[lc]:
                lst[COL + r * S + s] = gens[lc]
                lst[ACK + r * S + s] = 0
        acc_r = self.b_done[base] | self.b_done[base + 1] | self.b_done[base + 2]
        acc_w = self.b_ack_r[r] | self.b_col_r[r] | self.b_end[r]
        more_r, more_w = self._end_step(lst, r, e)
        return ((Trans(pid, ("end", r, e), tuple(lst)),), acc_r | more_r, acc_w | more_w, 0, ())

    def _end_step(self, lst: list, r: int, e: int) -> tuple[int, int]:
        """Rank ``r`` ends epoch ``e`` in ``lst``; returns the step's further reads and writes."""
        lst[self.END + r] = 1
        return 0, 0

    def _expand_begin(self, st: tuple):
        """``begin_stream`` of the next epoch: collective, one step once every rank has ended."""
        R, EP = self.R, self.EP
        e = st[EP]
        all_ended = all(st[self.END + r] for r in range(R))
        if all_ended and e < self.E:
            lst = list(st)
            for r in range(R):
                lst[EP + r] += 1
                lst[self.END + r] = 0
                lst[self.PPC + 2 * r] = lst[self.PPC + 2 * r + 1] = 0
                lst[self.CPC + r] = 0
                lst[self.HLD + r] = -1
                lst[self.DNM + r] = 0
            return ((Trans(self.BEGIN, ("begin", e + 1), tuple(lst)),), 0, self.ALL, 0, ())
        elif all_ended:
            return ((), 0, 0, 0, ())
        else:
            return ((), 0, 0, 0, tuple(6 * r + 5 for r in range(R) if not st[self.END + r]))

    # -- look-ahead, for the partial-order reduction (verify.lookahead) -------------------
    def _future(self, st: tuple, pid: int):
        """What ``pid`` may access from now on within this epoch, cut where it must wait.

        A list ``[(blockers, R, W, O), ...]``: the accesses of the steps before the i-th wait
        point, which cannot be passed while a process of ``blockers`` (a pid mask) stands
        still; the last entry (blockers 0) holds everything up to the end of the epoch.
        The ring's processes: :func:`streamring.verify.lookahead.future`.
        """
        return lookahead.future(self, st, pid)

    def _drain_later(self, st: tuple, r: int, k: int) -> tuple[int, int]:
        """What the later drains of producer ``(r, k)`` may read and write: any slot of its own."""
        return self.b_pend[r][k] | self.b_pos_r[r], self.b_pend[r][k] | self.b_pay_rk[r][k]

    def _end_blockers(self, st: tuple, r: int) -> int:
        """Processes beyond its own roles that rank ``r``'s end of epoch waits for (the ring: none)."""
        return 0

    def _end_writes(self, r: int, e: int, reads: int) -> int:
        """What a layer's end of epoch writes beyond the ring's (``reads``: its roles' done bits)."""
        return 0

    def _beyond_epoch(self, st: tuple):
        """What an outside process may touch in later epochs, as ``f(q, T) -> variable mask`` (``T``:
        the stubborn set, a pid mask), or None when no process can cross into a later epoch in
        ``st``: :func:`streamring.verify.lookahead.beyond_epoch`."""
        return lookahead.beyond_epoch(self, st)

    # -- labels ----------------------------------------------------------------------------
    def label(self, t: Trans) -> str:
        d = t.desc
        op = d[0]
        if op.startswith("reserve"):
            _, r, k, c, s, prev = d
            head = f"r{r}.{KINDS[k]}: reserve chunk {c} (slot {s})"
            if op == "reserve-first":
                return head + ": first lap of the slot"
            if op == "reserve-skip":
                return head + f" WITHOUT waiting for the acks of chunk {prev} [skip-ack-wait]"
            if op == "reserve-collected":
                return head + f": acks of chunk {prev} already collected"
            return head + f": ack mask of chunk {prev} full -> collected, mask cleared"
        if op == "write":
            _, r, k, c, s, g = d
            return f"r{r}.{KINDS[k]}: write payload {gen_str(g)} of chunk {c} into slot {s} (pending store, not yet visible)"
        if op in ("publish", "fence", "drain"):
            if op == "publish":
                _, r, k, c, s, g, tgt, flushed, rd = d
                text = f"r{r}.{KINDS[k]}: publish chunk {c} gen {gen_str(g)} -> rank {tgt}"
                text += " (release: pending payload becomes visible)" if flushed else ""
            elif op == "fence":
                _, r, k, c, s, g, flushed, rd = d
                text = f"r{r}.{KINDS[k]}: fence after chunk {c}" + (" (pending payload becomes visible)" if flushed else "")
            else:
                _, r, k, s, v, rd = d
                text = f"r{r}.{KINDS[k]}: pending payload {gen_str(v)} of slot {s} drains to memory early (legal)"
            if rd is not None:
                dd, kk, src, c2, s2, v = rd
                text += f"\n       r{dd}.consumer: read {KINDS[kk]} part of src {src} chunk {c2} (slot {s2}): sees {_g(v)}"
            return text
        if op == "acquire":
            _, dd, src, c, s, g, vr, vl = d[:8]
            if vr is None:
                text = (f"r{dd}.consumer: acquire src {src} chunk {c} (slot {s}) WITHOUT reading the generations "
                        f"[skip-acquire]")
            else:
                text = (f"r{dd}.consumer: acquire src {src} chunk {c} (slot {s}), expecting {gen_str(g)}: "
                        f"route_ready_gen={_g(vr)} {self.classify(vr, g).name}, "
                        f"layout_ready_gen={_g(vl)} {self.classify(vl, g).name}")
            if len(d) > 8:
                pr, pl = d[8], d[9]
                text += f"\n       r{dd}.consumer: read route part: sees {_g(pr)}"
                if pr == g:
                    text += f"; read layout part: sees {_g(pl)}"
            return text
        if op == "ack":
            _, dd, src, c, s, m0, m1 = d
            return f"r{dd}.consumer: ack src {src} chunk {c}: rank {src}'s ack_mask[slot {s}] {m0:#b} -> {m1:#b}"
        if op == "end":
            _, r, e = d
            return f"r{r}: end_stream epoch {e}: last chunk of every slot acknowledged (drained)"
        if op == "begin":
            return f"all ranks: begin_stream epoch {d[1]} (memory not cleared)"
        return repr(d)

    # -- the serialised schedule (property 6) ------------------------------------------------
    def serial_schedule(self):
        """Per chunk every route producer, every layout producer, then every consumer, in rank order;
        then each rank's end of epoch. Yields ``(pid, done)``: run ``pid`` until ``done(state)``, or
        one step of it when ``done`` is None."""
        R = self.R
        for e in range(1, self.E + 1):
            for c in range(self.C):
                for k in (0, 1):
                    for r in range(R):
                        yield 6 * r + k, (lambda st, r=r, k=k, c=c: st[self.PPC + 2 * r + k] >= (c + 1) * self.nsteps)
                for d in range(R):
                    yield 6 * d + 2, (lambda st, d=d, c=c: st[self.CPC + d] >= (c + 1) * R * self.NPH)
                yield from self._serial_layer(e, c)
            for r in range(R):
                yield 6 * r + 5, None
            yield from self._serial_next_epoch(e)

    def _serial_layer(self, e: int, c: int):
        """A layer's processes in the serialised schedule, after chunk ``c``'s consumers (ring: none)."""
        return ()

    def _serial_next_epoch(self, e: int):
        """The collective begin after epoch ``e``."""
        if e < self.E:
            yield self.BEGIN, None
