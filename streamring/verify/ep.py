"""The expert-parallel GPU layer's handoffs (``--layer ep``), on top of the ring's steps.

The streamed MoE layer on GPUs (:mod:`streamring.moe.ep_buffer`) changes three
handoffs; the ring steps (:mod:`streamring.verify.steps`) stay as they are, except that each rank
begins its next epoch on its own (``ring_advance_epoch`` in the captured graph: no allgather, no
barrier). Per rank ``r`` (every rank owns its chunks and consumes every rank's chunks):

* **early ``input_consumed`` acknowledgement**: the consumer's copy of the rows routed to its
  experts out of ``src``'s slot is the acquire's reads (the reads in the hold window,
  :mod:`streamring.verify.steps`); it acknowledges right after the copy, so the slot's reuse
  does not wait for the combine. ``ack-before-copy`` acknowledges first and ends the copy in a
  later step (``copied``): the slot stays held until then, and a producer that reuses it
  meanwhile is (2).
* **compute and remote combine** (process ``compute`` of consumer ``d``, its GEMM stream): for
  each combine entry ``(owner, token, k)`` routed to ``d`` whose chunk it has copied (any
  order: blocks fill across chunks and complete when full or at the seal), ``write`` its
  result into the owner's combine area at ``(token, k)`` (a plain store, pending: invisible
  to the owner until this thread's release; it may drain early, process ``cdrain``), then
  ``release, add 1`` to the owner's ``arrived[chunk]`` (one word per chunk index, at the
  owner). ``signal-before-combine`` adds first and releases in a later step. An entry is one
  row, so a consumer with ``n`` rows of a chunk adds ``n`` times; one with none adds nothing.
  Compute steps start only after the acknowledgement: they touch neither the slot nor the
  ack mask, so starting them between the copy and the acknowledgement adds no outcome.
* **the owner's reduce** (process ``reduce``), chunk by chunk once its producers published
  the chunk: wait ``arrived[c] == expected[c]`` (acquire), read every entry of the chunk, reset
  ``arrived[c] := 0``, in one step (``skip-arrival-wait`` does not wait; ``no-counter-reset``
  does not reset). One step is exact for the correct protocol: once the count is complete
  no consumer writes an entry of the chunk or adds to its counter until the owner publishes
  the chunk in its next epoch, which comes after the reset in program order. The reset is a
  plain store of the owner, ordered before the next epoch's publish (the streams join before
  ``ring_advance_epoch``), so it is visible before any add of the next epoch.
* **end of epoch**: the rank's producers, consumer, compute and reduce are done and the last
  acks of every slot are collected; it then begins its next epoch. Nothing is cleared: the
  combine area, the counters and the ack masks keep their values.

The combine area is indexed by logical token: ``combine-by-slot`` indexes it by slot instead (as
the CPU layer's ``combine[slot][token][k]``, which is why that layer acknowledges only after its
combine): with the early acknowledgement, the slot's next chunk is computed into the entries of
the previous one before its owner reduced them (d).

Routing (abstract, new every epoch): entry ``k`` (``--topk``, default 2) of owner ``r``'s logical
token ``t`` (one token per chunk) goes to rank ``(r + k * (t + e)) % R`` in epoch ``e``; so at the
default sizes some chunks send both entries to one consumer and none to the other, and odd
ranks' last chunk has no token (``expected`` 0: its reduce passes at once). Combine entries hold
``(epoch, chunk, writer)``; the ghost ``ARRO`` counts the adds of ``arrived[c]`` made in an earlier
epoch of the owner (property (e)) and ``LRE`` the epoch of the owner's last reduce of each chunk
(property (d)); none of them is visible to the protocol.

Mutations of this layer: :class:`EPInject` / ``EP_INJECT_MODES`` (``--layer ep`` only); every
``ring.policies.Inject`` mode still applies to its ring steps. The default sizes of this layer
(2 ranks x 2 slots x 3 chunks x 2 epochs) always use the partial-order reduction: their full
graph is far
beyond reach (2 ranks x 1 slot x 2 chunks x 1 epoch alone has 669,240 states). Reduced, they
take 2,421 states and 3,771 transitions (0.4 s); 3 ranks take 440,350 states (2.8 minutes);
``--source-order ready`` takes 553,532 states (2.8 minutes) at the default sizes (its look-ahead is
coarse, as in the ring model).

The look-ahead of its partial-order reduction (the layer's waits, and what a rank may touch once
it crosses into its next epoch on its own) is :mod:`streamring.verify.ep_lookahead`.
"""

from __future__ import annotations

from ..ring.layout import GenState
from . import ep_lookahead, footprints
from .names import EPInject
from .state import (EP_PROPERTIES, PROP_COMBINE_OVERWRITE, PROP_COMBINE_READ, PROP_COUNTER, PROP_DEADLOCK,
                    PROP_SERIAL, Trans, Violation, _cv, _cval)
from .steps import RingModel


def route_entries(plans: list, R: int, C: int, E: int, K: int) -> tuple:
    """The abstract routing (module docstring), new every epoch (new inputs): entry ``k`` of owner
    ``r``'s logical token ``t`` goes to rank ``(r + k * (t + e)) % R`` in epoch ``e``; ``plans[e]``
    gives each chunk's tokens. A chunk without tokens (rule 7) has no entries (expected 0); a
    consumer with no entry of a chunk contributes nothing to it.

    Returns, each indexed by epoch (``[0]`` unused):

    * ``entries[e][d]``: the ``(owner, chunk, k)`` that consumer ``d`` computes, in chunk order;
    * ``expected[e][r][c]``: the entries of ``(r, c)``, known to the owner from its own routing;
    * ``route[e]``: ``(r, c, k) -> d``;
    * ``ent_mask[e][d][r][c]``: the bits (indices into ``entries[e][d]``) of the entries of ``(r, c)``;
    * ``full_cmp[e][d]``: every entry of consumer ``d`` as a mask (its compute is done at that mask).
    """
    entries, expected, route = [None], [None], [None]
    for e in range(1, E + 1):
        plan = plans[e]
        ents = [[] for _ in range(R)]
        exp = [[0] * C for _ in range(R)]
        rt = {}
        for c in range(C):
            for r in range(R):
                base, valid = plan.chunk_tokens(r, c)
                for t in range(base, base + valid):
                    for k in range(K):
                        d = (r + k * (t + e)) % R
                        ents[d].append((r, c, k))
                        exp[r][c] += 1
                        rt[(r, c, k)] = d
        entries.append(tuple(tuple(x) for x in ents))
        expected.append(exp)
        route.append(rt)
    ent_mask = [None]
    for e in range(1, E + 1):
        em = [[[0] * C for _ in range(R)] for _ in range(R)]
        for d in range(R):
            for j, (r, c, _k) in enumerate(entries[e][d]):
                em[d][r][c] |= 1 << j
        ent_mask.append(em)
    # (chunk c holds the logical token c: tokens_per_slot is 1)
    full_cmp = [None] + [[(1 << len(entries[e][d])) - 1 for d in range(R)] for e in range(1, E + 1)]
    return entries, expected, route, ent_mask, full_cmp


class EPModel(RingModel):
    """The ring plus the expert-parallel layer's processes (module docstring).

    For rank ``r`` it adds ``CP[r] = 6R+1+3r`` its compute, ``CDP[r]`` the drain of its pending
    combine store and ``RP[r]`` its reduce as owner; ``BEGIN`` (``6R``) never moves: each rank's
    end of epoch begins its next epoch.
    """

    LAYER = "ep"
    properties = EP_PROPERTIES
    safety = tuple(p for p in EP_PROPERTIES if p not in (PROP_DEADLOCK, PROP_SERIAL))

    def result_config(self) -> dict:
        return {"topk": self.cfg.topk}

    def _init_layer(self) -> None:
        """The layer's mutation, routing, fields and processes (module docstring)."""
        R, C, E, K = self.R, self.C, self.E, self.cfg.topk
        self.K = K
        self._init_mutation()
        self.entries, self.expected, self.route, self.ent_mask, self.full_cmp = route_entries(self.plans, R, C, E, K)
        n = self.NFIELDS
        self.CCUR, self.CPH, self.CMP, self.CPS, self.CPV = n, n + R, n + 2 * R, n + 3 * R, n + 4 * R
        self.CMB = n + 5 * R  # + cell: combine[owner r][token c][k] (0 or _cval(epoch, chunk, writer))
        self.ARR = self.CMB + R * C * K  # + r * C + c: arrived[c] at owner r
        self.ARRO = self.ARR + R * C  # ghost: the part of ARR added in an earlier epoch of the owner
        self.LRE = self.ARRO + R * C  # ghost, + r * C + c: the epoch of owner r's last reduce of chunk c
        self.RED = self.LRE + R * C  # + r: the owner's next chunk to reduce
        self.NFIELDS = self.RED + R
        # combine entry (r, c, k) -> cell: by logical token (chunk c holds token c), or by slot
        self.cell_of = {(r, c, k): (r * C + (c % self.S if self.combine_by_slot else c)) * K + k
                        for r in range(R) for c in range(C) for k in range(K)}
        # processes: per rank d the compute (GEMM stream), its pending-store drain, the owner's reduce
        self.CP = [6 * R + 1 + 3 * d for d in range(R)]
        self.CDP = [6 * R + 2 + 3 * d for d in range(R)]
        self.RP = [6 * R + 3 + 3 * d for d in range(R)]
        self.NP = 9 * R + 1
        # a finished role moves again after its own rank's end of epoch (ring_advance_epoch, no barrier)
        self.next_epoch_wait = [(6 * r + 5,) for r in range(R)]
        self._xb_cache = (None, None)
        self.exact_acquire = self._acquire_is_exact()

    def _init_mutation(self) -> None:
        """The layer's mutation (:class:`~streamring.verify.names.EPInject`; the ring's,
        ``ring.policies.Inject``, is the base's) and the consumer's steps per (chunk, src) it sets."""
        self.ep_inject = self.cfg.inject if isinstance(self.cfg.inject, EPInject) else EPInject.NONE
        # consumer steps per (chunk, src): acquire (+ the copy's reads), ack; with ack-before-copy:
        # acquire, ack, then the copy's reads end (the slot is held until then)
        self.ack_before_copy = self.ep_inject is EPInject.ACK_BEFORE_COPY
        self.NPH = 3 if self.ack_before_copy else 2
        self.cdone = self.C * self.R * self.NPH
        self.sig_before_combine = self.ep_inject is EPInject.SIGNAL_BEFORE_COMBINE
        self.skip_arrival_wait = self.ep_inject is EPInject.SKIP_ARRIVAL_WAIT
        self.no_counter_reset = self.ep_inject is EPInject.NO_COUNTER_RESET
        self.combine_by_slot = self.ep_inject is EPInject.COMBINE_BY_SLOT

    def _acquire_is_exact(self) -> bool:
        """Does the acquire classify every generation word of an earlier epoch (or 0) as OLDER?

        The reduction assumes, for a rank's later epochs, that nothing of an owner is touched
        before that owner publishes a chunk of that epoch (:mod:`streamring.verify.ep_lookahead`):
        true when the acquire looks at the generations and this holds. Checked on the classify in
        use (a mutation or a patched function turns the assumption off)."""
        OLDER = GenState.OLDER
        return not self.skip_acquire and all(
            self.classify(w, g) is OLDER
            for e in range(2, self.E + 1) for g in self.gens[e]
            for w in [0] + [w for e2 in range(1, e) for w in self.gens[e2]])

    def _init_bits(self) -> None:
        super()._init_bits()
        R, S, C, K = self.R, self.S, self.C, self.K
        new = self._bit
        b_cellidx = [new() for _ in range(R * C * K)]
        self.b_cpend = [new() for _ in range(R)]
        self.b_arr = [[new() for _ in range(C)] for _ in range(R)]  # arrived[c] (and its ghost)
        self.b_red = [[new() for _ in range(C)] for _ in range(R)]  # "owner reduced c" (and its epoch)
        self.ALL = (1 << self._nbits) - 1
        # b_cell[r][c][k]: the cell of entry (r, c, k); b_cell_red[cell]: the reduce progress of
        # every chunk that writes the cell (read by the overwrite check)
        self.b_cell = [[[b_cellidx[self.cell_of[(r, c, k)]] for k in range(K)] for c in range(C)]
                       for r in range(R)]
        self.b_cell_red = [0] * (R * C * K)
        for (r, c, k), cell in self.cell_of.items():
            self.b_cell_red[cell] |= self.b_red[r][c]
        self.b_cells_rc = [[sum(set(self.b_cell[r][c])) for c in range(C)] for r in range(R)]
        self.b_cells_r = [0] * R
        for r in range(R):
            for c in range(C):
                self.b_cells_r[r] |= self.b_cells_rc[r][c]
        self.b_arr_r = [sum(self.b_arr[r]) for r in range(R)]
        self.b_red_r = [sum(self.b_red[r]) for r in range(R)]
        # what belongs to owner r: its slots, their generation words at every rank, its ack
        # masks, the holders of its slots, its combine area and counters, its reduce, its own
        # pending stores and progress; in a later epoch another rank touches these only after
        # r published a chunk of that epoch
        self.b_owner = []
        for r in range(R):
            b = self.b_pay_rk[r][0] | self.b_pay_rk[r][1] | self.b_pend[r][0] | self.b_pend[r][1]
            b |= self.b_ack_r[r] | self.b_col_r[r] | self.b_pos_r[r] | self.b_cells_r[r] | self.b_arr_r[r]
            b |= self.b_red_r[r] | self.b_cpend[r] | self.b_end[r]
            for p in list(range(6 * r, 6 * r + 6)) + [self.CP[r], self.CDP[r], self.RP[r]]:
                b |= self.b_done[p]
            for t in range(R):
                for k in (0, 1):
                    for s in range(S):
                        b |= self.b_rdy[t][k][r][s]
            self.b_owner.append(b)
        # the producer step that publishes the last chunk to rank t
        self.last_pub = [(self.C - 1) * self.nsteps + self.steps.index(("publish", t)) for t in range(R)]
        self.rank_of += [r for r in range(R) for _ in range(3)]
        # a rank's own roles: its end of epoch waits for every one of them
        self.roles_of = [(6 * r, 6 * r + 1, 6 * r + 2, self.CP[r], self.RP[r]) for r in range(R)]
        self.ALLP = (1 << self.NP) - 1

    def initial(self) -> tuple:
        st = list(super().initial())
        for r in range(self.R):
            st[self.CCUR + r] = st[self.CPS + r] = -1
        return tuple(st)

    def role_done(self, st: tuple, pid: int) -> bool:
        if pid <= self.BEGIN:
            return super().role_done(st, pid)
        r = self.rank_of[pid]  # compute or reduce of rank r
        if st[self.END + r]:
            return True
        if pid == self.RP[r]:
            return st[self.RED + r] >= self.C
        return st[self.CCUR + r] < 0 and st[self.CMP + r] == self.full_cmp[st[self.EP + r]][r]

    # -- helpers ---------------------------------------------------------------------------
    def _copied(self, st, d: int, src: int, c: int) -> bool:
        """Has consumer ``d`` finished copying ``src``'s chunk ``c`` (this epoch) out of the slot?

        Its compute may start on those rows from then on. (The correct consumer acknowledges right
        after the copy; its compute steps touch neither the slot nor the ack mask, so letting them
        start only after the acknowledgement drops no outcome.)"""
        pc = st[self.CPC + d]
        if pc >= self.cdone:
            return True
        R, NPH = self.R, self.NPH
        if not self.ready_order:
            return pc >= (c * R + src + 1) * NPH
        cur = pc // (R * NPH)
        return c < cur or (c == cur and bool((st[self.DNM + d] >> src) & 1))

    def _cflush(self, lst: list, d: int) -> bool:
        """Make the pending combine store of consumer ``d``'s compute visible (True if there was one)."""
        cell = lst[self.CPS + d]
        if cell < 0:
            return False
        lst[self.CMB + cell] = lst[self.CPV + d]
        lst[self.CPS + d] = -1
        lst[self.CPV + d] = 0
        return True

    def _cell(self, r: int, c: int, k: int) -> int:
        return self.cell_of[(r, c, k)]

    def _cname(self, r: int, c: int, k: int) -> str:
        if self.combine_by_slot:
            return f"rank {r}'s combine[slot {c % self.S}][k={k}]"
        return f"rank {r}'s combine[token {c}][k={k}]"

    # -- transitions -----------------------------------------------------------------------
    def _ended_entry(self, pid: int, e: int):
        if pid > self.BEGIN:  # the layer's processes: a rank begins its next epoch at its end of epoch
            return ((), 0, 0, 0, ())
        return super()._ended_entry(pid, e)

    def footprint(self, pid: int) -> tuple[int, ...]:
        return footprints.ep_footprint(self, pid)

    def _expand_role(self, st: tuple, pid: int, r: int, e: int, nxt: tuple):
        """The layer's processes of rank ``r`` (epoch ``e``): compute, combine drain, reduce."""
        if pid < self.BEGIN:
            return super()._expand_role(st, pid, r, e, nxt)
        if pid == self.CP[r]:
            return self._expand_compute(st, r, e, nxt)
        if pid == self.CDP[r]:
            return self._expand_combine_drain(st, r, e)
        return self._expand_reduce(st, r, e, nxt)

    def _expand_compute(self, st: tuple, r: int, e: int, nxt: tuple):
        """The compute of consumer ``r`` (its GEMM stream): one combine entry (owner, token, k) at a
        time, in any order among the rows it has copied (blocks fill across chunks, complete in any
        order): write the result (pending), then release and add 1 to the owner's ``arrived[c]``."""
        cur = st[self.CCUR + r]
        if cur >= 0:
            return self._compute_finish(st, r, e, cur)
        return self._compute_start(st, r, e, nxt)

    def _compute_finish(self, st: tuple, d: int, e: int, cur: int):
        """Consumer ``d``'s compute after writing entry ``cur`` (pending): release (the store becomes
        visible), then add 1 to the owner's ``arrived[c]``, in one step; ``signal-before-combine``
        adds first (``cadd``) and releases in a later step (``cfence``). The entry is then done."""
        C = self.C
        cp = self.CP[d]
        src, c, k = self.entries[e][d][cur]
        mask = st[self.CMP + d]
        ai = self.ARR + src * C + c
        bit = 1 << cur
        done_bit = self.b_done[cp] if (mask | bit) == self.full_cmp[e][d] else 0
        ph = st[self.CPH + d]
        lst = list(st)
        if ph == 1 and not self.sig_before_combine:
            # release (the pending combine store becomes visible), then atomic add to arrived[c]
            flushed = self._cflush(lst, d)
            a0 = lst[ai]
            lst[ai] = a0 + 1
            if e < st[self.EP + src]:  # a late add of an older epoch (ghost)
                lst[self.ARRO + src * C + c] += 1
            lst[self.CMP + d] = mask | bit
            lst[self.CCUR + d] = -1
            lst[self.CPH + d] = 0
            desc = ("csignal", d, src, c, k, a0, flushed)
            return ((Trans(cp, desc, tuple(lst)),), self.b_cpend[d],
                    self.b_cpend[d] | self.b_cell[src][c][k] | done_bit, self.b_arr[src][c], ())
        if ph == 1:  # signal-before-combine: the add, with the combine store still pending
            a0 = lst[ai]
            lst[ai] = a0 + 1
            if e < st[self.EP + src]:
                lst[self.ARRO + src * C + c] += 1
            lst[self.CPH + d] = 2
            desc = ("cadd", d, src, c, k, a0, lst[self.CPS + d] >= 0)
            return ((Trans(cp, desc, tuple(lst)),), 0, 0, self.b_arr[src][c], ())
        # signal-before-combine: the release, after the add
        flushed = self._cflush(lst, d)
        lst[self.CMP + d] = mask | bit
        lst[self.CCUR + d] = -1
        lst[self.CPH + d] = 0
        desc = ("cfence", d, src, c, k, flushed)
        return ((Trans(cp, desc, tuple(lst)),), self.b_cpend[d],
                self.b_cpend[d] | self.b_cell[src][c][k] | done_bit, 0, ())

    def _compute_start(self, st: tuple, d: int, e: int, nxt: tuple):
        """Consumer ``d``'s compute between entries: one step per entry not computed yet whose chunk
        its consumer has copied, each writing the entry's result into the owner's combine area (a
        plain store, pending until the release), or its violation when that cell still holds a value
        the owner has not reduced (d). None copied: it waits for its consumer, or, all done, for the
        next epoch (``nxt``)."""
        C = self.C
        cp = self.CP[d]
        mask = st[self.CMP + d]
        trans, acc_r = [], self.b_cpend[d]
        for j, (src, c, k) in enumerate(self.entries[e][d]):
            if (mask >> j) & 1 or not self._copied(st, d, src, c):
                continue
            cell = self._cell(src, c, k)
            acc_r |= self.b_cell[src][c][k] | self.b_cell_red[cell]
            desc = ("cwrite", d, src, c, k, e)
            old = st[self.CMB + cell]
            oe, oc = old >> 16, (old >> 8) & 0xFF
            if old and (oe, oc) != (e, c) and st[self.LRE + src * C + oc] < oe:
                msg = (f"rank {d} (epoch {e}) writes its result for chunk {c} into {self._cname(src, c, k)} "
                       f"while that entry still holds {_cv(old)}, which rank {src} has not reduced yet")
                trans.append(Trans(cp, desc, None, Violation((PROP_COMBINE_OVERWRITE,), msg)))
                continue
            lst = list(st)
            lst[self.CPS + d] = cell  # a plain store: pending until this thread's release
            lst[self.CPV + d] = _cval(e, c, d)
            lst[self.CCUR + d] = j
            lst[self.CPH + d] = 1
            trans.append(Trans(cp, desc, tuple(lst)))
        if trans:
            return (tuple(trans), acc_r, self.b_cpend[d], 0, ())
        if mask == self.full_cmp[e][d]:
            return ((), 0, 0, 0, nxt)
        return ((), 0, 0, 0, (6 * d + 2,))  # rows not copied yet: its consumer moves first

    def _expand_combine_drain(self, st: tuple, r: int, e: int):
        """The early drain of consumer ``r``'s pending combine store (legal)."""
        d = r
        cp, cdp = self.CP[d], self.CDP[d]
        ents = self.entries[e][d]
        cell = st[self.CPS + d]
        if self.cfg.early_drain and cell >= 0:
            lst = list(st)
            v = lst[self.CPV + d]
            self._cflush(lst, d)
            src, c, k = ents[st[self.CCUR + d]]  # (the store belongs to the entry in progress)
            return ((Trans(cdp, ("cdrain", d, src, c, k, v), tuple(lst)),), self.b_cpend[d],
                    self.b_cpend[d] | self.b_cell[src][c][k], 0, ())
        else:
            return ((), 0, 0, 0, (cp,))

    def _expand_reduce(self, st: tuple, r: int, e: int, nxt: tuple):
        """The owner's reduce of its chunks, in chunk order: once it published chunk ``c``, wait
        ``arrived[c] == expected[c]``, read every entry of the chunk, reset the counter."""
        C, K = self.C, self.K
        rp = self.RP[r]
        red = st[self.RED + r]
        if red >= C:
            return ((), 0, 0, 0, nxt)
        c = red
        need = tuple(6 * r + k for k in (0, 1) if st[self.PPC + 2 * r + k] < (c + 1) * self.nsteps)
        if need:  # only after it published chunk c
            return ((), 0, 0, 0, need)
        ai = self.ARR + r * C + c
        a, x = st[ai], self.expected[e][r][c]
        if a != x and not self.skip_arrival_wait:
            return ((), 0, 0, 0, ep_lookahead.arrival_blockers(self, st, r, c, e)[1])
        seen = tuple(st[self.CMB + self._cell(r, c, k)] for k in range(K))
        desc = ("reduce", r, c, e, a, x, seen)
        acc_r = self.b_arr[r][c] | self.b_cells_rc[r][c]
        acc_w = self.b_arr[r][c] | self.b_red[r][c] | (self.b_done[rp] if c + 1 == C else 0)
        props, msgs = [], []
        carried = st[self.ARRO + r * C + c]
        if a == x and carried and not self.skip_arrival_wait:
            props.append(PROP_COUNTER)
            msgs.append(f"rank {r}'s wait arrived[{c}] == {x} (epoch {e}) is satisfied by a count holding "
                        f"{carried} add(s) of an earlier epoch (arrived[{c}] was not reset)")
        rt = self.route[e]
        for k in range(K):
            want_d = rt.get((r, c, k))
            if want_d is None:
                continue
            v = seen[k]
            want = _cval(e, c, want_d)
            if v != want:
                props.append(PROP_COMBINE_READ)
                pend = st[self.CPV + want_d] == want and st[self.CPS + want_d] == self._cell(r, c, k)
                msgs.append(f"rank {r} reduces chunk {c} (epoch {e}) and reads {self._cname(r, c, k)} = "
                            f"{_cv(v)}, expected {_cv(want)}"
                            + (f" (rank {want_d}'s store of it is still pending: not released)" if pend else ""))
                break
        if props:
            return ((Trans(rp, desc, None, Violation(tuple(dict.fromkeys(props)), "; ".join(msgs))),),
                    acc_r, acc_w, 0, ())
        lst = list(st)
        if not self.no_counter_reset:
            lst[ai] = 0  # (visible before any add of the next epoch: see the module docstring)
            lst[self.ARRO + r * C + c] = 0
        lst[self.RED + r] = c + 1
        lst[self.LRE + r * C + c] = e
        return ((Trans(rp, desc, tuple(lst)),), acc_r, acc_w, 0, ())

    def _release_step(self, st: tuple, d: int, pid: int, src: int, c: int, s: int, cpc: int, phase: int,
                      done_bit: int):
        """The early ``input_consumed`` ack, right after the copy; with ack-before-copy the ack comes
        first (the slot stays held) and the copy's reads end in a later step (``copied``)."""
        if not self.ack_before_copy:
            return super()._release_step(st, d, pid, src, c, s, cpc, phase, done_bit)
        if phase == 1:
            return self._ack_step(st, d, pid, src, c, s, cpc, done_bit, releases_slot=False)
        lst = list(st)
        lst[self.CPC + d] = cpc + 1
        if self.ready_order:
            self._source_done(st, lst, d, src)
        return ((Trans(pid, ("copied", d, src, c, s), tuple(lst)),), 0, self.b_pos[d][src][s] | done_bit, 0, ())

    def _layer_unfinished(self, st: tuple, r: int) -> tuple:
        return tuple(p for p in (self.CP[r], self.RP[r]) if not self.role_done(st, p))

    def _end_step(self, lst: list, r: int, e: int) -> tuple[int, int]:
        """The last epoch ends the rank; an earlier one begins its next epoch at once."""
        if e >= self.E:
            return super()._end_step(lst, r, e)
        self._advance_epoch(lst, r)
        b_done = self.b_done
        return (b_done[self.CP[r]] | b_done[self.RP[r]],
                self.b_red_r[r] | self.b_arr_r[r] | self.b_pos_r[r] | sum(b_done[p] for p in self.roles_of[r]))

    def _expand_begin(self, st: tuple):
        return ((), 0, 0, 0, ())  # each rank begins its next epoch at its end of epoch

    def _advance_epoch(self, lst: list, r: int) -> None:
        """Rank ``r`` begins its next epoch on its own (``ring_advance_epoch``, no barrier).

        Nothing in symmetric memory is cleared; the arrived counters keep whatever is left in
        them (the correct owner reset each one after its reduce), which the ghost ``ARRO``
        now marks as added in an earlier epoch."""
        C = self.C
        lst[self.EP + r] += 1
        lst[self.PPC + 2 * r] = lst[self.PPC + 2 * r + 1] = 0
        lst[self.CPC + r] = 0
        lst[self.HLD + r] = -1
        lst[self.DNM + r] = 0
        lst[self.CCUR + r] = -1
        lst[self.CPH + r] = 0
        lst[self.CMP + r] = 0
        lst[self.RED + r] = 0
        for c in range(C):
            lst[self.ARRO + r * C + c] = lst[self.ARR + r * C + c]

    # -- look-ahead, for the partial-order reduction (verify.ep_lookahead) ----------------
    def _future(self, st: tuple, pid: int):
        if pid >= self.BEGIN:
            return ep_lookahead.future(self, st, pid)
        return super()._future(st, pid)

    def _drain_later(self, st: tuple, r: int, k: int) -> tuple[int, int]:
        return ep_lookahead.drain_later(self, st, r, k)

    def _end_blockers(self, st: tuple, r: int) -> int:
        return ep_lookahead.cross_blockers(self, st)[r]

    def _end_writes(self, r: int, e: int, reads: int) -> int:
        """... and it begins the next epoch (:meth:`_advance_epoch`)."""
        if e < self.E:
            return self.b_red_r[r] | self.b_arr_r[r] | self.b_pos_r[r] | reads
        return 0

    def _beyond_epoch(self, st: tuple):
        return ep_lookahead.beyond_epoch(self, st)

    # -- labels ----------------------------------------------------------------------------
    def label(self, t: Trans) -> str:
        d = t.desc
        op = d[0]
        if op == "ack":
            if self.ack_before_copy:
                return super().label(t) + " BEFORE its copy out of the slot completed [ack-before-copy]"
            return super().label(t) + " (input_consumed: right after the copy)"
        if op == "end":
            _, r, e = d
            more = f"; begins epoch {e + 1} on its own (no barrier)" if e < self.E else ""
            return super().label(t) + more
        if op == "copied":
            _, dd, src, c, s = d
            return f"r{dd}.consumer: copy of src {src} chunk {c} (slot {s}) out of the slot complete"
        if op == "cwrite":
            _, dd, src, c, k, e = d
            return (f"r{dd}.compute: write its result for chunk {c} (epoch {e}) into {self._cname(src, c, k)} "
                    f"(pending store, not yet visible)" + (" [combine-by-slot]" if self.combine_by_slot else ""))
        if op in ("csignal", "cadd"):
            _, dd, src, c, k, a0, flag = d
            if op == "csignal":
                return (f"r{dd}.compute: release" + (" (pending combine store becomes visible)" if flag else "")
                        + f", then add 1 to rank {src}'s arrived[{c}]: {a0} -> {a0 + 1}")
            return (f"r{dd}.compute: add 1 to rank {src}'s arrived[{c}]: {a0} -> {a0 + 1} BEFORE releasing its "
                    f"combine store{' (still pending)' if flag else ''} [signal-before-combine]")
        if op == "cfence":
            _, dd, src, c, k, flag = d
            return f"r{dd}.compute: release" + (" (pending combine store becomes visible)" if flag else "")
        if op == "cdrain":
            _, dd, src, c, k, v = d
            return f"r{dd}.compute: pending store to {self._cname(src, c, k)} drains to memory early (legal)"
        if op == "reduce":
            _, r, c, e, a, x, seen = d
            head = f"r{r}.owner: "
            if a != x:
                head += f"reduce chunk {c} WITHOUT waiting (arrived[{c}] = {a} of {x}) [skip-arrival-wait]"
            else:
                head += f"arrived[{c}] = {a} == expected {x} (epoch {e}): reduce chunk {c}"
            reads = [f"{self._cname(r, c, k)} sees {_cv(v)}" for k, v in enumerate(seen) if (r, c, k) in self.route[e]]
            tail = (f"; arrived[{c}] NOT reset [no-counter-reset]" if self.no_counter_reset
                    else f"; reset arrived[{c}] := 0")
            return head + (": " + ", ".join(reads) if reads else ": no entries") + tail
        return super().label(t)

    # -- the serialised schedule (property 6) ------------------------------------------------
    def _serial_layer(self, e: int, c: int):
        """After chunk ``c``'s consumers: every consumer's compute of its entries of the chunks up to
        ``c``, then every owner's reduce of ``c``."""
        for d in range(self.R):
            yield self.CP[d], (lambda st, d=d: self._computed(st, d, e, c))
        for r in range(self.R):
            yield self.RP[r], None

    def _serial_next_epoch(self, e: int):
        return ()  # each rank's end of epoch began its next epoch

    def _computed(self, st: tuple, d: int, e: int, c: int) -> bool:
        """Has consumer ``d`` computed and signalled every entry of its chunks ``<= c`` (epoch ``e``)?"""
        if st[self.CCUR + d] >= 0:
            return False
        mask = st[self.CMP + d]
        return all((mask >> j) & 1 for j, ent in enumerate(self.entries[e][d]) if ent[1] <= c)
