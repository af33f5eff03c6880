"""Exhaustive explicit-state model checker of the chunk-ready ring protocol.

``streamring model-check`` explores every interleaving of the protocol steps of
:mod:`streamring.protocol` (the 8-step argument of its module docstring) for a
small configuration (default 2 ranks x 2 slots x 3 chunks x 2 epochs) by
breadth-first search over hashable states with a visited set, and checks:

``no-stale-or-torn-read``
    (1) every consumer read of ``(src, chunk c, epoch e)`` sees exactly the
    payload written for ``plan.gen(c)``, in the route part and in the layout part;
``no-overwrite-before-ack``
    (2) no producer writes a slot while a consumer holds the slot's previous
    chunk (acquired it, not yet acknowledged it);
``no-aba``
    (3) nobody accepts leftovers of an older epoch: neither an acquire that
    accepts a generation word of an older epoch, nor a read that sees payload
    of an older epoch;
``no-protocol-violation``
    (4) :func:`protocol.classify_gen` never says ``VIOLATION`` (the runtime
    raises :class:`protocol.ProtocolViolation`), an acquire never accepts a
    word that is not the expected generation, and no acknowledgement finds its
    bit already set (``Ring.ack`` raises on it when no mutation is injected);
``no-deadlock``
    (5) every reachable state can reach the final state (all epochs done and
    drained);
``serialised-schedule``
    (6) the fully serialised schedule (per chunk: every route producer, every
    layout producer, then every consumer, in rank order) reaches the final
    state without a violation (one deterministic path, no reduction).

Derived from the runtime
========================
Generations come from ``StreamPlan.gen`` (``make_gen``); the consumer's wait
is ``classify_gen``, looked up when a :class:`Model` is built (a patched
function is what gets checked); the chunk count is ``StreamPlan.num_chunks``
(the maximum over ranks, rule 7: odd ranks get one token fewer, so their last
chunk has zero tokens, and they still publish every chunk); the full ack mask
is ``RingLayout.full_mask(word)`` over ``RingLayout.mask_words``; the slot is
``chunk % num_slots``; the mutations are ``protocol.Inject`` /
``protocol.INJECT_MODES``, each changing exactly the step ``protocol.Ring``
changes for it.

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

Reductions (both sound for these properties)
=========================================================
1. *Reads in the hold window.* A consumer's reads change nothing shared; the
   read of a part may happen at any moment between its acquire and its ack
   (route before layout). A read can see a wrong value iff the cell is wrong
   at the acquire or is rewritten with a wrong value while held. So the
   acquire checks both cells, and every flush of a payload cell (release,
   fence, early drain) checks every consumer holding that cell; the trace
   shows the read that would see it. This removes two steps per chunk and
   source without removing an observable outcome.
2. *Partial-order reduction (stubborn sets).* From each state only a
   stubborn set of processes is expanded: the closure, from one enabled
   process, under (D1) "an outside process may, before any process of the
   set moves, execute a step that conflicts with this process's next step"
   (read/write sets over the modelled variables; two ``fetch_or`` commute;
   the look-ahead of an outside process stops where it must wait for a
   process of the set: a generation word only the set's producer can write, an
   ack bit only the set's consumer can set, an epoch end the set blocks) and
   (D2) "a disabled next step brings in a process that must move first to
   enable it". Every enabled member of such a set commutes with everything the
   outside processes can do before the set moves. The state graph is acyclic
   (``2 * sum of program counters + empty buffers + ended ranks``, epoch-major,
   grows on every step), so (Valmari; induction on the longest path from a
   state) the reduced search still reaches every reachable deadlock and the
   final state, and it reaches a violation whenever one is reachable (a
   violation is a step into a terminal error state; the reduction keeps *some*
   violating step, not each one, so once it finds one the other safety
   properties are reported NOT CHECKED). With no violation and no deadlock in
   the reduced graph, every path of the full, acyclic graph ends in the final
   state, so (5) holds; reverse reachability over the explored graph is still
   computed as a cross-check.

   Up to the default sizes (2 ranks, 2 slots, 3 chunks, 2 epochs) the CLI
   explores the full interleaving graph (about 0.4 M states, 2.2 M
   transitions); above them it uses the reduction. ``STREAMRING_MODEL_POR=1``
   or ``0`` (or ``ModelConfig(por=...)``) forces the choice; the tests compare
   both graphs on small sizes (same verdict, same terminal states).

The search stops at the first violation and prints the shortest counter-example
from the initial state (BFS parents); under the reduction that path is then
shortened (replayed without each step in turn while it still ends in the same
violation) so that no single step can be dropped.
"""

from __future__ import annotations

import json
import os
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from . import protocol as P

KINDS = ("route", "layout")
WORD = (1 << 64) - 1

PROP_READ = "no-stale-or-torn-read"
PROP_OVERWRITE = "no-overwrite-before-ack"
PROP_ABA = "no-aba"
PROP_PROTOCOL = "no-protocol-violation"
PROP_DEADLOCK = "no-deadlock"
PROP_SERIAL = "serialised-schedule"
PROPERTIES = (PROP_READ, PROP_OVERWRITE, PROP_ABA, PROP_PROTOCOL, PROP_DEADLOCK, PROP_SERIAL)
PROPERTY_TEXT = {
    PROP_READ: "(1) every read sees exactly the payload of its generation (route and layout)",
    PROP_OVERWRITE: "(2) no slot overwrite while a reader holds its previous chunk",
    PROP_ABA: "(3) no leftovers of an older epoch accepted or read",
    PROP_PROTOCOL: "(4) classify_gen never says VIOLATION; no double acknowledgement",
    PROP_DEADLOCK: "(5) every reachable state can reach the final state",
    PROP_SERIAL: "(6) the serialised schedule completes without violation",
}
NOT_CHECKED = "NOT CHECKED (stopped at the first violation)"
TRACE_PRINT_MAX = 40  # console lines of a counter-example; --json has every step


def _g(gen: int) -> str:
    return P.gen_str(gen) if gen else "0 (never written)"


def _older_epoch(seen: int, expected: int) -> bool:
    return bool(seen) and P.split_gen(seen)[0] < P.split_gen(expected)[0]


@dataclass
class ModelConfig:
    ranks: int = 2
    slots: int = 2
    chunks: int = 3
    epochs: int = 2
    inject: P.Inject = P.Inject.NONE
    early_drain: bool = True  # pending payload stores may become visible before the release
    por: bool | None = None  # stubborn-set partial-order reduction; None: only above the default sizes
    stop_at_first: bool = True  # False: keep exploring (violations are terminal), for cross-checks
    max_states: int | None = None  # None: exhaustive
    # consumer: sources of a chunk in rank order, or any ready source first (stress.source_order)
    source_order: str = "rank"

    def validate(self) -> None:
        problems = []
        for name in ("ranks", "slots", "chunks", "epochs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"--{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.epochs, int) and self.epochs > P.MAX_EPOCH:
            problems.append(f"--epochs must be <= {P.MAX_EPOCH}")
        if self.por is None:
            self.por = not (self.ranks <= 2 and self.slots <= 2 and self.chunks <= 3 and self.epochs <= 2)
        if not isinstance(self.inject, P.Inject):
            problems.append(f"inject must be a protocol.Inject, got {self.inject!r}")
        if self.source_order not in P.SOURCE_ORDERS:
            problems.append(f"--source-order must be one of {P.SOURCE_ORDERS}, got {self.source_order!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class Violation:
    properties: tuple[str, ...]
    message: str


class Trans:
    """One enabled step: its process, a description (formatted lazily), the successor or a violation."""

    __slots__ = ("pid", "desc", "state", "violation")

    def __init__(self, pid, desc, state, violation=None):
        self.pid = pid
        self.desc = desc
        self.state = state
        self.violation = violation


@dataclass
class CheckResult:
    config: dict
    states: int = 0
    transitions: int = 0
    time_s: float = 0.0
    exhaustive: bool = True
    properties: dict = field(default_factory=dict)
    counterexample: dict | None = None
    serialised: dict | None = None
    final_reachable: bool | None = None
    terminal_states: int = 0
    violations_found: int = 0
    reduction: str = ""

    @property
    def ok(self) -> bool:
        return self.exhaustive and all(v == "PASS" for v in self.properties.values())

    def to_dict(self) -> dict:
        return {
            "command": "model-check",
            "config": self.config,
            "states": self.states,
            "transitions": self.transitions,
            "time_s": round(self.time_s, 3),
            "exhaustive": self.exhaustive,
            "reduction": self.reduction,
            "properties": dict(self.properties),
            "final_reachable": self.final_reachable,
            "counterexample": self.counterexample,
            "serialised": self.serialised,
            "ok": self.ok,
        }


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------
class Model:
    """The protocol as a transition system over flat tuples (see the module docstring).

    Processes (pid): for rank ``r``: ``6r`` route producer, ``6r+1`` layout producer,
    ``6r+2`` consumer, ``6r+3``/``6r+4`` pending-store drain of route/layout, ``6r+5`` end of
    epoch; ``6R`` is the collective begin of the next epoch.
    """

    def __init__(self, cfg: ModelConfig):
        cfg.validate()
        self.cfg = cfg
        R, S, E = cfg.ranks, cfg.slots, cfg.epochs
        self.R, self.S, self.E = R, S, E
        self.inject = cfg.inject
        self.skip_acquire = cfg.inject is P.Inject.SKIP_ACQUIRE
        self.skip_ack_wait = cfg.inject is P.Inject.SKIP_ACK_WAIT
        # Looked up now (not at import) so that the function the runtime uses is the one checked.
        self._classify = P.classify_gen
        self._ignore_epoch = cfg.inject is P.Inject.IGNORE_EPOCH
        self._cmemo: dict = {}
        layout = P.RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=1, hidden=P.SF_BLOCK, topk=1,
                              num_experts=1)
        self.mask_words = layout.mask_words
        self.full = tuple(layout.full_mask(w) for w in range(layout.mask_words))
        tokens = tuple(cfg.chunks - (r % 2 if R > 1 else 0) for r in range(R))
        self.plans = [None] + [P.StreamPlan(epoch=e, tokens_per_rank=tokens, tokens_per_slot=1)
                               for e in range(1, E + 1)]
        self.C = C = self.plans[1].num_chunks
        if C != cfg.chunks:
            raise ValueError(f"StreamPlan.num_chunks = {C}, expected {cfg.chunks}")
        # one int object per generation, shared by every state that holds it
        self.gens = [None] + [tuple(self.plans[e].gen(c) for c in range(C)) for e in range(1, E + 1)]
        self.last_chunk = [max((c for c in range(C) if c % S == s), default=-1) for s in range(S)]
        pubs = [("publish", t) for t in range(R)]
        if cfg.inject is P.Inject.SIGNAL_BEFORE_PAYLOAD:
            self.steps = [("reserve", 0)] + pubs + [("write", 0), ("fence", 0)]
        else:
            self.steps = [("reserve", 0), ("write", 0)] + pubs
        self.nsteps = len(self.steps)
        self.pdone = C * self.nsteps
        self.cdone = C * R * 2  # per (chunk, src): acquire, ack
        # flat state layout
        self.EP, self.END, self.PPC, self.CPC = 0, R, 2 * R, 4 * R
        self.PSL, self.PVL = 5 * R, 7 * R  # pending slot (-1: none) / value, index 2r + k
        self.PAY = 9 * R  # + (2r + k) * S + s
        self.RDY = self.PAY + 2 * R * S  # + ((2t + k) * R + r) * S + s
        self.ACK = self.RDY + 2 * R * R * S  # + r * S + s
        self.COL = self.ACK + R * S  # + r * S + s
        # source_order='ready': the source a consumer holds (-1: none) and the sources of its
        # current chunk it has acknowledged (bit mask); unused (constant) in rank order
        self.HLD = self.COL + R * S
        self.DNM = self.HLD + R
        self.NFIELDS = self.DNM + R
        self.ready_order = cfg.source_order == "ready"
        self.all_src = (1 << R) - 1
        self.NP = 6 * R + 1
        self.BEGIN = 6 * R
        self._init_bits()
        self._fut_cache: dict = {}

    # -- variables as bits, for the dependency relation -------------------------------------
    def _init_bits(self) -> None:
        R, S = self.R, self.S
        n = 0

        def new():
            nonlocal n
            n += 1
            return 1 << (n - 1)

        self.b_rdy = [[[[new() for _ in range(S)] for _ in range(R)] for _ in range(2)] for _ in range(R)]
        self.b_pay = [[[new() for _ in range(S)] for _ in range(2)] for _ in range(R)]
        self.b_pend = [[new() for _ in range(2)] for _ in range(R)]
        self.b_ack = [[new() for _ in range(S)] for _ in range(R)]
        self.b_col = [[new() for _ in range(S)] for _ in range(R)]
        self.b_pos = [[[new() for _ in range(S)] for _ in range(R)] for _ in range(R)]  # [d][r][s] held?
        self.b_done = [new() for _ in range(self.NP)]
        self.b_end = [new() for _ in range(R)]
        self.ALL = (1 << n) - 1
        self.b_pos_rs = [[0] * S for _ in range(R)]
        for d in range(R):
            for r in range(R):
                for s in range(S):
                    self.b_pos_rs[r][s] |= self.b_pos[d][r][s]
        self.b_pos_r = [0] * R
        self.b_pay_rk = [[0, 0] for _ in range(R)]
        self.b_ack_r = [0] * R
        self.b_col_r = [0] * R
        for r in range(R):
            for s in range(S):
                self.b_pos_r[r] |= self.b_pos_rs[r][s]
                self.b_ack_r[r] |= self.b_ack[r][s]
                self.b_col_r[r] |= self.b_col[r][s]
                for k in (0, 1):
                    self.b_pay_rk[r][k] |= self.b_pay[r][k][s]
        self.role_pids = [6 * r + i for r in range(R) for i in (0, 1, 2)]

    # -- helpers ---------------------------------------------------------------------------
    def initial(self) -> tuple:
        st = [0] * self.NFIELDS
        for r in range(self.R):
            st[self.EP + r] = 1
            st[self.PSL + 2 * r] = st[self.PSL + 2 * r + 1] = -1
            st[self.HLD + r] = -1
        return tuple(st)

    def classify(self, observed: int, expected: int) -> P.GenState:
        key = (observed, expected)
        res = self._cmemo.get(key)
        if res is None:
            res = self._classify(observed, expected, self.S, ignore_epoch=self._ignore_epoch)
            self._cmemo[key] = res
        return res

    def mask_full(self, m: int) -> bool:
        return all(((m >> (64 * w)) & WORD) == self.full[w] for w in range(self.mask_words))

    def missing_bits(self, m: int) -> list[int]:
        return [b for b in range(self.R) if not (m >> b) & 1]

    def is_final(self, st: tuple) -> bool:
        return all(st[self.END + r] == 1 and st[self.EP + r] == self.E for r in range(self.R))

    def role_done(self, st: tuple, pid: int) -> bool:
        r, i = divmod(pid, 6)
        if st[self.END + r]:
            return True
        if i == 2:
            return st[self.CPC + r] >= self.cdone
        return st[self.PPC + 2 * r + i] >= self.pdone

    def _holders(self, st, r: int, s: int):
        """Consumers holding (acquired, not acked) a chunk of ``r`` in slot ``s``: (d, chunk, epoch)."""
        R = self.R
        for d in range(R):
            pc = st[self.CPC + d]
            if pc < self.cdone and pc & 1 and not st[self.END + d]:
                c2, src = divmod(pc >> 1, R)
                if self.ready_order:
                    src = st[self.HLD + d]
                if src == r and c2 % self.S == s:
                    yield d, c2, st[self.EP + d]

    def _flush(self, lst: list, r: int, k: int):
        """Make the pending store of producer (r, k) visible; return a read violation it causes, if any."""
        i = 2 * r + k
        s = lst[self.PSL + i]
        if s < 0:
            return None
        v = lst[self.PVL + i]
        lst[self.PAY + i * self.S + s] = v
        lst[self.PSL + i] = -1
        lst[self.PVL + i] = 0
        for d, c2, e2 in self._holders(lst, r, s):
            g2 = self.gens[e2][c2]
            if v != g2:
                props = (PROP_READ, PROP_ABA) if _older_epoch(v, g2) else (PROP_READ,)
                return Violation(props, (
                    f"stale read: rank {d} holds src {r} chunk {c2} (epoch {e2}, slot {s}; acquired, not yet "
                    f"acknowledged) and the {KINDS[k]} part changes under it to {_g(v)}: its read sees {_g(v)}, "
                    f"expected {P.gen_str(g2)}")), (d, k, r, c2, s, v)
        return None

    # -- transitions -----------------------------------------------------------------------
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
            cr, cl = self.classify(vr, g), self.classify(vl, g)
            V, RD = P.GenState.VIOLATION, P.GenState.READY
            ready = cr is RD and cl is RD
        desc = ("acquire", d, src, c, s, g, vr, vl)
        if ready:
            viol = None
            if vr is not None and (vr != g or vl != g):
                bad = vr if vr != g else vl
                older = _older_epoch(bad, g)
                viol = Violation((PROP_ABA,) if older else (PROP_PROTOCOL,), (
                    f"rank {d} accepted generation {_g(bad)} as ready for {P.gen_str(g)} "
                    f"(src {src} chunk {c} slot {s})"
                    + (": a leftover of an older epoch (ABA)" if older else "")))
            else:
                # reads of the hold window, done right away (reduction 1)
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
                        f"(epoch {e}, slot {s}) and saw {_g(v)}, expected {P.gen_str(g)}"
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
                   f"{P.gen_str(g)}: classify_gen says VIOLATION (Ring.gen_state raises "
                   f"ProtocolViolation)")
            return ((Trans(pid, desc, None, Violation((PROP_PROTOCOL,), msg)),), acc_r, acc_w, 0, ())
        nes = tuple(6 * src + k for k, cl_ in ((0, cr), (1, cl)) if cl_ is not RD)
        return ((), 0, 0, 0, nes)

    def expand(self, st: tuple):
        """Per process: ``(transitions, accR, accW, accO, nes)``.

        ``transitions`` are the enabled steps (at most one per process, or its violation);
        ``acc*`` the variables the next step reads / writes / fetch-ors; ``nes`` the pids of
        which one must move before a disabled process can (a necessary enabling set).
        """
        R, S = self.R, self.S
        inject = self.inject
        procs = [None] * self.NP
        all_ended = True
        for r in range(R):
            e = st[self.EP + r]
            base = 6 * r
            if st[self.END + r]:
                nxt = (self.BEGIN,) if e < self.E else ()
                for i in range(6):
                    procs[base + i] = ((), 0, 0, 0, nxt)
                continue
            all_ended = False
            gens = self.gens[e]
            # ---- producers and their pending stores ------------------------------------
            for k in (0, 1):
                i = 2 * r + k
                pid = base + k
                pc = st[self.PPC + i]
                if pc >= self.pdone:
                    procs[pid] = ((), 0, 0, 0, (self.BEGIN,) if e < self.E else ())
                else:
                    c, j = divmod(pc, self.nsteps)
                    step, t = self.steps[j]
                    s = c % S
                    g = gens[c]
                    done_bit = self.b_done[pid] if pc + 1 == self.pdone else 0
                    if step == "reserve":
                        prev = c - S
                        if prev < 0 or self.skip_ack_wait:
                            lst = list(st)
                            lst[self.PPC + i] = pc + 1
                            op = "reserve-first" if prev < 0 else "reserve-skip"
                            procs[pid] = ((Trans(pid, (op, r, k, c, s, prev), tuple(lst)),), 0, 0, 0, ())
                        else:
                            gp = gens[prev]
                            ci, ai = self.COL + r * S + s, self.ACK + r * S + s
                            if st[ci] == gp:
                                lst = list(st)
                                lst[self.PPC + i] = pc + 1
                                procs[pid] = ((Trans(pid, ("reserve-collected", r, k, c, s, prev), tuple(lst)),),
                                              self.b_col[r][s], 0, 0, ())
                            elif self.mask_full(st[ai]):
                                lst = list(st)
                                lst[self.PPC + i] = pc + 1
                                lst[ci] = gp
                                lst[ai] = 0
                                procs[pid] = ((Trans(pid, ("reserve-collect", r, k, c, s, prev), tuple(lst)),),
                                              0, self.b_col[r][s] | self.b_ack[r][s], 0, ())
                            else:
                                nes = tuple(6 * b + 2 for b in self.missing_bits(st[ai]))
                                procs[pid] = ((), 0, 0, 0, nes)
                    elif step == "write":
                        acc_r, acc_w = self.b_pos_rs[r][s] | self.b_pend[r][k], self.b_pend[r][k] | done_bit
                        viol = None
                        for d, c2, e2 in self._holders(st, r, s):
                            if (e2, c2) != (e, c):
                                viol = Violation((PROP_OVERWRITE,), (
                                    f"rank {r} {KINDS[k]} producer overwrites slot {s} with chunk {c} (epoch {e}) "
                                    f"while rank {d} holds chunk {c2} (epoch {e2}) of that slot: acquired, not "
                                    f"yet acknowledged"))
                                break
                        if viol is not None:
                            procs[pid] = ((Trans(pid, ("write", r, k, c, s, g), None, viol),), acc_r, acc_w, 0, ())
                        else:
                            lst = list(st)
                            self._flush(lst, r, k)  # (always empty here: each write is followed by a release)
                            lst[self.PSL + i] = s
                            lst[self.PVL + i] = g
                            lst[self.PPC + i] = pc + 1
                            procs[pid] = ((Trans(pid, ("write", r, k, c, s, g), tuple(lst)),), acc_r, acc_w, 0, ())
                    else:  # publish to t, or fence: both release (flush) first
                        lst = list(st)
                        ps = lst[self.PSL + i]
                        acc_r, acc_w = self.b_pend[r][k], done_bit
                        if ps >= 0:
                            acc_r |= self.b_pos_rs[r][ps]
                            acc_w |= self.b_pend[r][k] | self.b_pay[r][k][ps]
                        fl = self._flush(lst, r, k)
                        if step == "publish":
                            lst[self.RDY + ((2 * t + k) * R + r) * S + s] = g
                            acc_w |= self.b_rdy[t][k][r][s]
                            desc = ("publish", r, k, c, s, g, t, ps >= 0)
                        else:
                            desc = ("fence", r, k, c, s, g, ps >= 0)
                        lst[self.PPC + i] = pc + 1
                        if fl is not None:
                            procs[pid] = ((Trans(pid, desc + (fl[1],), None, fl[0]),), acc_r, acc_w, 0, ())
                        else:
                            procs[pid] = ((Trans(pid, desc + (None,), tuple(lst)),), acc_r, acc_w, 0, ())
                # pending-store drain
                mpid = base + 3 + k
                ps = st[self.PSL + i]
                if self.cfg.early_drain and ps >= 0:
                    lst = list(st)
                    v = lst[self.PVL + i]
                    fl = self._flush(lst, r, k)
                    acc_r = self.b_pend[r][k] | self.b_pos_rs[r][ps]
                    acc_w = self.b_pend[r][k] | self.b_pay[r][k][ps]
                    desc = ("drain", r, k, ps, v, fl[1] if fl else None)
                    tr = Trans(mpid, desc, None, fl[0]) if fl else Trans(mpid, desc, tuple(lst))
                    procs[mpid] = ((tr,), acc_r, acc_w, 0, ())
                else:
                    procs[mpid] = ((), 0, 0, 0, (pid,))
            # ---- consumer ---------------------------------------------------------------
            d = r
            pid = base + 2
            cpc = st[self.CPC + d]
            if cpc >= self.cdone:
                procs[pid] = ((), 0, 0, 0, (self.BEGIN,) if e < self.E else ())
            else:
                item, phase = divmod(cpc, 2)
                c, src = divmod(item, R)
                if self.ready_order and phase == 1:
                    src = st[self.HLD + d]  # the source it holds, whichever rank that is
                s = c % S
                done_bit = self.b_done[pid] if cpc + 1 == self.cdone else 0
                if phase == 0 and not self.ready_order:
                    procs[pid] = self._acquire_step(st, d, pid, src, c, e, cpc)
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
                    procs[pid] = (tuple(trans), acc_r, acc_w, 0, () if trans else ("all",) + tuple(groups))
                else:  # ack
                    ai = self.ACK + src * S + s
                    m = st[ai]
                    bit = 1 << d
                    desc = ("ack", d, src, c, s, m, m | bit)
                    acc_w = self.b_pos[d][src][s] | done_bit
                    if m & bit and inject is P.Inject.NONE:
                        msg = (f"rank {d}: ack bit already set in rank {src}'s ack_mask[slot={s}] when "
                               f"acknowledging chunk {c} (double acknowledgement: Ring.ack raises)")
                        procs[pid] = ((Trans(pid, desc, None, Violation((PROP_PROTOCOL,), msg)),),
                                      0, acc_w, self.b_ack[src][s], ())
                    else:
                        lst = list(st)
                        lst[ai] = m | bit
                        lst[self.CPC + d] = cpc + 1
                        if self.ready_order:
                            done = st[self.DNM + d] | (1 << src)
                            lst[self.DNM + d] = 0 if done == self.all_src else done  # chunk complete
                            lst[self.HLD + d] = -1
                        procs[pid] = ((Trans(pid, desc, tuple(lst)),), 0, acc_w, self.b_ack[src][s], ())
            # ---- end_stream (drain) -----------------------------------------------------
            pid = base + 5
            # (the rank has not ended here, so a role is done when its program counter is)
            unfinished = ()
            if st[self.PPC + 2 * r] < self.pdone or st[self.PPC + 2 * r + 1] < self.pdone or cpc < self.cdone:
                unfinished = tuple(p for p, pc_, end_ in ((base, st[self.PPC + 2 * r], self.pdone),
                                                          (base + 1, st[self.PPC + 2 * r + 1], self.pdone),
                                                          (base + 2, cpc, self.cdone)) if pc_ < end_)
            if unfinished:
                procs[pid] = ((), 0, 0, 0, unfinished)
            else:
                nes = ()
                for s in range(S):
                    lc = self.last_chunk[s]
                    m = st[self.ACK + r * S + s]
                    if lc >= 0 and st[self.COL + r * S + s] != gens[lc] and not self.mask_full(m):
                        nes = tuple(6 * b + 2 for b in self.missing_bits(m))
                        break
                if nes:
                    procs[pid] = ((), 0, 0, 0, nes)
                else:
                    lst = list(st)
                    for s in range(S):
                        lc = self.last_chunk[s]
                        if lc >= 0 and lst[self.COL + r * S + s] != gens[lc]:
                            lst[self.COL + r * S + s] = gens[lc]
                            lst[self.ACK + r * S + s] = 0
                    lst[self.END + r] = 1
                    acc_r = self.b_done[base] | self.b_done[base + 1] | self.b_done[base + 2]
                    acc_w = self.b_ack_r[r] | self.b_col_r[r] | self.b_end[r]
                    procs[pid] = ((Trans(pid, ("end", r, e), tuple(lst)),), acc_r, acc_w, 0, ())
        # ---- begin_stream of the next epoch (collective) ----------------------------------
        e = st[self.EP]
        if all_ended and e < self.E:
            lst = list(st)
            for r in range(R):
                lst[self.EP + r] += 1
                lst[self.END + r] = 0
                lst[self.PPC + 2 * r] = lst[self.PPC + 2 * r + 1] = 0
                lst[self.CPC + r] = 0
                lst[self.HLD + r] = -1
                lst[self.DNM + r] = 0
            procs[self.BEGIN] = ((Trans(self.BEGIN, ("begin", e + 1), tuple(lst)),), 0, self.ALL, 0, ())
        elif all_ended:
            procs[self.BEGIN] = ((), 0, 0, 0, ())
        else:
            procs[self.BEGIN] = ((), 0, 0, 0, tuple(6 * r + 5 for r in range(R) if not st[self.END + r]))
        return procs

    def successors(self, st: tuple) -> list[Trans]:
        return [t for p in self.expand(st) for t in p[0]]

    # -- partial-order reduction -------------------------------------------------------------
    def _future(self, st: tuple, pid: int):
        """What ``pid`` may access from now on within this epoch, cut where it must wait.

        A list ``[(blockers, R, W, O), ...]``: the accesses of the steps before the i-th wait
        point, which cannot be passed while a process of ``blockers`` (a pid mask) stands
        still; the last entry (blockers 0) holds everything up to the end of the epoch.
        """
        R, S = self.R, self.S
        r, i = divmod(pid, 6)
        if pid == self.BEGIN:
            return ((0, 0, 0, 0),)
        if st[self.END + r]:
            return ((0, 0, 0, 0),)
        e = st[self.EP + r]
        gens = self.gens[e]
        if i in (0, 1):
            k = i
            pc = st[self.PPC + 2 * r + k]
            key = (pid, pc, e, st[self.ACK + r * S:self.ACK + r * S + S], st[self.COL + r * S:self.COL + r * S + S])
            res = self._fut_cache.get(key)
            if res is not None:
                return res
            segs, aR, aW = [], 0, 0
            for j in range(pc, self.pdone):
                c, jj = divmod(j, self.nsteps)
                step, t = self.steps[jj]
                s = c % S
                if step == "reserve":
                    if c >= S and not self.skip_ack_wait:
                        if st[self.COL + r * S + s] != gens[c - S]:
                            bl = 0
                            for b in self.missing_bits(st[self.ACK + r * S + s]):
                                bl |= 1 << (6 * b + 2)
                            if bl:
                                segs.append((bl, aR, aW, 0))
                        aR |= self.b_col[r][s] | self.b_ack[r][s]
                        aW |= self.b_col[r][s] | self.b_ack[r][s]
                elif step == "write":
                    aR |= self.b_pos_rs[r][s] | self.b_pend[r][k]
                    aW |= self.b_pend[r][k]
                else:
                    aR |= self.b_pos_rs[r][s] | self.b_pend[r][k]
                    aW |= self.b_pend[r][k] | self.b_pay[r][k][s]
                    if step == "publish":
                        aW |= self.b_rdy[t][k][r][s]
            aW |= self.b_done[pid]
            segs.append((0, aR, aW, 0))
            res = tuple(segs)
            self._fut_cache[key] = res
            return res
        if i == 2 and self.ready_order:
            # any pending source in any order: over-approximate with every access of every
            # remaining (chunk, source) step, reachable without waiting (sound, less reduction)
            d = r
            pc = st[self.CPC + d]
            aR = aW = aO = 0
            for j in range(pc - (pc % (2 * R)), self.cdone):
                item, phase = divmod(j, 2)
                c, src = divmod(item, R)
                s = c % S
                aR |= self.b_rdy[d][0][src][s] | self.b_rdy[d][1][src][s] | self.b_pay[src][0][s] | self.b_pay[src][1][s]
                aW |= self.b_pos[d][src][s]
                aO |= self.b_ack[src][s]
            return ((0, aR, aW | self.b_done[pid], aO),)
        if i == 2:
            d = r
            pc = st[self.CPC + d]
            key = (pid, pc, e, st[self.RDY + 2 * d * R * S:self.RDY + 2 * (d + 1) * R * S])
            res = self._fut_cache.get(key)
            if res is not None:
                return res
            segs, aR, aW, aO = [], 0, 0, 0
            for j in range(pc, self.cdone):
                item, phase = divmod(j, 2)
                c, src = divmod(item, R)
                s = c % S
                if phase == 0:
                    if not self.skip_acquire:
                        bl = 0
                        for k in (0, 1):
                            w = st[self.RDY + ((2 * d + k) * R + src) * S + s]
                            if self.classify(w, gens[c]) is P.GenState.OLDER:
                                bl |= 1 << (6 * src + k)  # only that producer writes this word
                        if bl:
                            segs.append((bl, aR, aW, aO))
                        aR |= self.b_rdy[d][0][src][s] | self.b_rdy[d][1][src][s]
                    aR |= self.b_pay[src][0][s] | self.b_pay[src][1][s]
                    aW |= self.b_pos[d][src][s]
                else:
                    aO |= self.b_ack[src][s]
                    aW |= self.b_pos[d][src][s]
            aW |= self.b_done[pid]
            segs.append((0, aR, aW, aO))
            res = tuple(segs)
            self._fut_cache[key] = res
            return res
        if i in (3, 4):
            k = i - 3
            ps = st[self.PSL + 2 * r + k]
            aR = aW = 0
            if ps >= 0:
                aR = self.b_pend[r][k] | self.b_pos_rs[r][ps]
                aW = self.b_pend[r][k] | self.b_pay[r][k][ps]
            # later drains need a later write of the producer first
            return ((1 << (6 * r + k), aR, aW, 0),
                    (0, aR | self.b_pend[r][k] | self.b_pos_r[r], aW | self.b_pend[r][k] | self.b_pay_rk[r][k], 0))
        # end of epoch: waits for the rank's roles, and for the missing ack bits of its last chunks
        bl = 0
        for p in (6 * r, 6 * r + 1, 6 * r + 2):
            if not self.role_done(st, p):
                bl |= 1 << p
        for s in range(S):
            lc = self.last_chunk[s]
            if lc >= 0 and st[self.COL + r * S + s] != gens[lc]:
                for b in self.missing_bits(st[self.ACK + r * S + s]):
                    bl |= 1 << (6 * b + 2)
        aR = self.b_done[6 * r] | self.b_done[6 * r + 1] | self.b_done[6 * r + 2]
        aW = self.b_ack_r[r] | self.b_col_r[r] | self.b_end[r]
        return ((bl, 0, 0, 0), (0, aR, aW, 0)) if bl else ((0, aR, aW, 0),)

    def stubborn(self, st: tuple, procs) -> list[Trans]:
        """Enabled steps of a stubborn set of processes (module docstring, reduction 2)."""
        NP = self.NP
        enabled = [p for p in range(NP) if procs[p][0]]
        if len(enabled) <= 1:
            return [t for p in enabled for t in procs[p][0]]
        # crossing into the next epoch needs every role done; a stopped unfinished role blocks it
        cross_bl = 0
        for p in self.role_pids:
            if not self.role_done(st, p):
                cross_bl |= 1 << p
        last_epoch = st[self.EP] >= self.E
        futs = [None] * NP
        best = None
        for seed in enabled:
            T = 1 << seed
            work = [seed]
            n_en = 1
            while work:
                p = work.pop()
                trans, aR, aW, aO, nes = procs[p]
                if trans:
                    for q in range(NP):
                        if (T >> q) & 1:
                            continue
                        fu = futs[q]
                        if fu is None:
                            fu = futs[q] = self._future(st, q)
                        fR = fW = fO = 0
                        for bl, fR, fW, fO in fu:
                            if bl & T:
                                break
                        else:
                            if not last_epoch and not (cross_bl & T):
                                fR = fW = fO = self.ALL
                        if (aW & (fR | fW | fO)) or (fW & (aR | aO)) or (aR & fO) or (aO & fR):
                            T |= 1 << q
                            work.append(q)
                            if procs[q][0]:
                                n_en += 1
                else:
                    if not nes:
                        continue
                    # ("all", g1, g2, ...): one process of EVERY group (a ready-order consumer
                    # waits for any of several sources); else one process of nes
                    groups = nes[1:] if nes[0] == "all" else (nes,)
                    for grp in groups:
                        for q in grp:  # prefer an enabling process already in the set
                            if (T >> q) & 1:
                                break
                        else:
                            q = grp[0]
                            T |= 1 << q
                            work.append(q)
                            if procs[q][0]:
                                n_en += 1
                if best is not None and n_en >= best[0]:
                    break
            else:
                if best is None or n_en < best[0]:
                    best = (n_en, T)
                    if n_en == 1:
                        break
        T = best[1]
        return [t for p in enabled if (T >> p) & 1 for t in procs[p][0]]

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
            return f"r{r}.{KINDS[k]}: write payload {P.gen_str(g)} of chunk {c} into slot {s} (pending store, not yet visible)"
        if op in ("publish", "fence", "drain"):
            if op == "publish":
                _, r, k, c, s, g, tgt, flushed, rd = d
                text = f"r{r}.{KINDS[k]}: publish chunk {c} gen {P.gen_str(g)} -> rank {tgt}"
                text += " (release: pending payload becomes visible)" if flushed else ""
            elif op == "fence":
                _, r, k, c, s, g, flushed, rd = d
                text = f"r{r}.{KINDS[k]}: fence after chunk {c}" + (" (pending payload becomes visible)" if flushed else "")
            else:
                _, r, k, s, v, rd = d
                text = f"r{r}.{KINDS[k]}: pending payload {P.gen_str(v)} of slot {s} drains to memory early (legal)"
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
                text = (f"r{dd}.consumer: acquire src {src} chunk {c} (slot {s}), expecting {P.gen_str(g)}: "
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


# --------------------------------------------------------------------------------------
# Search
# --------------------------------------------------------------------------------------
def _path(model: Model, states: list, parent: array, sid: int) -> list[Trans]:
    """The steps of the path (BFS parents) from the initial state to state ``sid``."""
    chain = []
    while sid > 0:
        chain.append(sid)
        sid = parent[sid]
    chain.reverse()
    steps, cur = [], states[0]
    for nid in chain:
        nxt = states[nid]
        for t in model.successors(cur):
            if t.state == nxt:
                steps.append(t)
                break
        else:  # pragma: no cover - every BFS edge is a step of the model
            raise AssertionError("BFS edge is not a step of the model")
        cur = nxt
    return steps


def _replay(model: Model, pids: list[int]):
    """Run the processes ``pids`` in order (each has at most one step); None if one cannot move.

    Returns ``(steps, end_state)``; a violation may only be the last step (then end_state is None).
    """
    st, steps = model.initial(), []
    for i, pid in enumerate(pids):
        ts = model.expand(st)[pid][0]
        if not ts:
            return None
        t = ts[0]
        steps.append(t)
        if t.violation is not None:
            return (steps, None) if i == len(pids) - 1 else None
        st = t.state
    return steps, st


def _minimise(model: Model, steps: list[Trans], goal) -> list[Trans]:
    """Drop steps of a counter-example while ``goal(steps, end_state)`` still holds (1-minimal)."""
    pids = [t.pid for t in steps]
    i = 0
    while i < len(pids):
        cand = pids[:i] + pids[i + 1:]
        rep = _replay(model, cand)
        if rep is not None and goal(*rep):
            pids = cand
        else:
            i += 1
    rep = _replay(model, pids)
    return rep[0]


def run_serialised(model: Model) -> dict:
    """Property (6): per chunk every route producer, every layout producer, then every consumer."""
    R, C = model.R, model.C
    st = model.initial()
    trace: list[str] = []

    def step(pid) -> str | None:
        nonlocal st
        for t in model.expand(st)[pid][0]:
            trace.append(model.label(t))
            if t.violation is not None:
                return f"{', '.join(t.violation.properties)}: {t.violation.message}"
            st = t.state
            return None
        return f"stuck: process {pid} has no enabled step"

    def run(pid, done) -> str | None:
        while not done():
            err = step(pid)
            if err:
                return err
        return None

    err = None
    for e in range(1, model.E + 1):
        for c in range(C):
            for k in (0, 1):
                for r in range(R):
                    err = err or run(6 * r + k, lambda r=r, k=k: st[model.PPC + 2 * r + k] >= (c + 1) * model.nsteps)
            for d in range(R):
                err = err or run(6 * d + 2, lambda d=d: st[model.CPC + d] >= (c + 1) * R * 2)
        for r in range(R):
            err = err or step(6 * r + 5)
        if e < model.E:
            err = err or step(model.BEGIN)
        if err:
            break
    if not err and not model.is_final(st):
        err = "the serialised schedule ended in a non-final state"
    return {"result": "PASS" if not err else "FAIL", "steps": len(trace), "error": err,
            "trace_tail": trace[-10:] if err else []}


def check(cfg: ModelConfig, progress=None) -> CheckResult:
    """Explore the model of ``cfg`` breadth-first (stops at the first violation unless told not to)."""
    model = Model(cfg)
    res = CheckResult(config={"ranks": cfg.ranks, "slots": cfg.slots, "chunks": cfg.chunks, "epochs": cfg.epochs,
                              "inject": cfg.inject.value, "early_drain": cfg.early_drain, "por": cfg.por,
                              "source_order": cfg.source_order,
                              "max_states": cfg.max_states})
    res.reduction = ("reads folded into the hold window; stubborn-set partial-order reduction "
                     "(keeps a violation if one is reachable, every deadlock and the final state)" if cfg.por else
                     "reads folded into the hold window; every interleaving (no partial-order reduction)")
    t0 = time.perf_counter()
    init = model.initial()
    ids = {init: 0}
    states = [init]
    parent = array("l", [-1])
    esrc, edst = array("l"), array("l")
    queue = deque([0])
    violation = None  # (parent id, Trans)
    violations = []  # every violating step (stop_at_first=False)
    deadlocks = []
    terminals = []
    bounded = False
    is_final = model.is_final
    ntrans = 0
    nterminal = 0
    por = cfg.por
    while queue:
        sid = queue.popleft()
        st = states[sid]
        procs = model.expand(st)
        ts = model.stubborn(st, procs) if por else [t for p in procs for t in p[0]]
        if not ts:
            nterminal += 1
            terminals.append(sid)
            if not is_final(st):
                deadlocks.append(sid)
                if cfg.stop_at_first:
                    break
            continue
        for t in ts:
            ntrans += 1
            if t.violation is not None:
                if cfg.stop_at_first:
                    violation = (sid, t)
                    break
                violations.append((sid, t))
                continue
            ns = t.state
            nid = ids.get(ns)
            if nid is None:
                nid = len(states)
                ids[ns] = nid
                states.append(ns)
                parent.append(sid)
                queue.append(nid)
            esrc.append(sid)
            edst.append(nid)
        if violation:
            break
        if cfg.max_states is not None and len(states) >= cfg.max_states:
            bounded = True
            break
        if progress is not None and sid and sid % 50000 == 0:
            progress(len(states), ntrans, time.perf_counter() - t0)
    if violation is None and violations:
        violation = violations[0]
    res.states, res.transitions, res.terminal_states = len(states), ntrans, nterminal
    res.violations_found = len(violations) if violations else (1 if violation else 0)
    res._violation_set = {(states[s], t.desc) for s, t in violations}  # for cross-checks
    stopped = cfg.stop_at_first and (violation is not None or deadlocks)
    res.exhaustive = not bounded and not stopped
    props = {p: NOT_CHECKED for p in PROPERTIES}
    if not stopped and not (por and violations):
        # (the reduction preserves the existence of a violation, not every violation: with
        # violations found under it the other safety properties stay NOT CHECKED)
        for p in (PROP_READ, PROP_OVERWRITE, PROP_ABA, PROP_PROTOCOL):
            props[p] = "PASS" if not bounded else f"PASS up to {cfg.max_states} states (BOUNDED, not a proof)"
    if violation is not None:
        sid, t = violation
        steps = _path(model, states, parent, sid) + [t]
        if por:  # the reduced graph's shortest path may carry steps that play no part
            prop = t.violation.properties[0]
            steps = _minimise(model, steps, lambda ss, end: bool(ss) and ss[-1].violation is not None
                              and ss[-1].violation.properties[0] == prop)
            t = steps[-1]
        trace = [model.label(x) for x in steps[:-1]] + [model.label(t) + "   <-- VIOLATION"]
        for v in violations or [violation]:
            for p in v[1].violation.properties:
                props[p] = "FAIL"
        res.counterexample = {"properties": list(t.violation.properties), "message": t.violation.message,
                              "steps": len(trace), "trace": trace}
    if deadlocks:
        props[PROP_DEADLOCK] = "FAIL"
        if res.counterexample is None:
            steps = _path(model, states, parent, deadlocks[0])
            if por:
                steps = _minimise(model, steps, lambda ss, end: end is not None and not model.successors(end)
                                  and not model.is_final(end))
            trace = [model.label(x) for x in steps]
            res.counterexample = {"properties": [PROP_DEADLOCK], "steps": len(trace), "trace": trace,
                                  "message": "deadlock: a reachable non-final state where no process can move"}
    elif not stopped and not bounded:
        bad, nfinal = _cannot_reach_final(model, states, esrc, edst)
        res.final_reachable = nfinal > 0
        if bad is None:
            props[PROP_DEADLOCK] = "PASS"
        elif violations and props[PROP_DEADLOCK] == NOT_CHECKED:
            pass  # the states that lead only to violations cannot reach the final state
        else:
            props[PROP_DEADLOCK] = "FAIL"
            trace = [model.label(x) for x in _path(model, states, parent, bad)]
            res.counterexample = res.counterexample or {
                "properties": [PROP_DEADLOCK], "steps": len(trace), "trace": trace,
                "message": "from the last state of this trace the final state is unreachable"}
    elif bounded:
        props[PROP_DEADLOCK] = "NOT CHECKED (bounded search)"
    res.time_s = time.perf_counter() - t0
    ser = run_serialised(model)
    res.serialised = ser
    props[PROP_SERIAL] = ser["result"]
    res.properties = props
    res._terminal_set = {states[i] for i in terminals}
    return res


def _cannot_reach_final(model: Model, states: list, esrc: array, edst: array) -> tuple[int | None, int]:
    """Reverse reachability from the final states over the explored graph.

    Returns the first (BFS-shortest) state that cannot reach a final state (None if every
    state can) and the number of final states.
    """
    n = len(states)
    start = array("l", bytes(8 * (n + 1)))
    for d in edst:
        start[d + 1] += 1
    for i in range(n):
        start[i + 1] += start[i]
    fill = array("l", start)
    rev = array("l", bytes(8 * len(edst)))
    for s, d in zip(esrc, edst):
        rev[fill[d]] = s
        fill[d] += 1
    seen = bytearray(n)
    stack = [i for i in range(n) if model.is_final(states[i])]
    nfinal = len(stack)
    for i in stack:
        seen[i] = 1
    while stack:
        v = stack.pop()
        for j in range(start[v], start[v + 1]):
            u = rev[j]
            if not seen[u]:
                seen[u] = 1
                stack.append(u)
    idx = seen.find(0)
    return (None if idx < 0 else idx), nfinal


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def summary_lines(res: CheckResult) -> list[str]:
    c = res.config
    if res.exhaustive:
        kind = "exhaustive" + (", over the reduced graph" if c["por"] else "")
    elif res.counterexample is not None:
        kind = "stopped at the first violation"
    else:
        kind = f"BOUNDED at {c['max_states']} states: not a proof"
    return [
        f"streamring model-check: {c['ranks']} ranks x {c['slots']} slots x {c['chunks']} chunks x "
        f"{c['epochs']} epochs, inject={c['inject']}",
        f"explored {res.states} states, {res.transitions} transitions in {res.time_s:.2f}s ({kind})",
        f"reduction: {res.reduction}",
    ]


def print_result(res: CheckResult) -> None:
    from rich.text import Text

    from .host.report import Column, Report

    out = Report()
    for line in summary_lines(res):
        out.line(line)
    rows = []
    for p, v in res.properties.items():
        style = "green" if v == "PASS" else ("red" if v == "FAIL" else "yellow")
        rows.append([p, PROPERTY_TEXT[p], Text(v, style=style)])
    out.table("properties", [Column("property", justify="left"), Column("meaning", justify="left", wrap=True),
                             Column("result", justify="left")], rows)
    ce = res.counterexample
    if ce:
        out.line(f"counter-example [{', '.join(ce['properties'])}]: {ce['message']}")
        how = ("shortest path (BFS)" if not res.config["por"] else
               "path in the reduced graph, then shortened until no single step can be dropped")
        out.line(f"  {how}, {ce['steps']} steps:")
        trace = ce["trace"]
        first = max(0, len(trace) - TRACE_PRINT_MAX)
        if first:
            out.line(f"  ... {first} earlier steps not shown (all in --json)")
        for i, line in enumerate(trace[first:], start=first + 1):
            out.line(f"  {i:3d}. {line}")
    ser = res.serialised
    if ser and ser["result"] != "PASS":
        out.line(f"serialised schedule: {ser['error']}")
        for line in ser["trace_tail"]:
            out.line(f"    {line}")
    n = len(res.properties)
    out.line(f"PASS: every property holds ({n} checked in {res.states} states)" if res.ok else
             f"FAIL: {', '.join(p for p, v in res.properties.items() if v == 'FAIL') or 'the check'} failed")


def model_check_main(args) -> int:
    """Entry point of ``streamring model-check``: 0 iff every property holds."""
    try:
        inject = P.Inject(args.inject) if getattr(args, "inject", None) else P.Inject.NONE
        por = getattr(args, "por", None)
        env = os.environ.get("STREAMRING_MODEL_POR", "auto").strip().lower()
        if por is None and env in ("0", "1", "off", "on"):
            por = env in ("1", "on")
        cfg = ModelConfig(ranks=args.ranks, slots=args.slots, chunks=args.chunks, epochs=args.epochs,
                          inject=inject, por=por, max_states=getattr(args, "max_states", None),
                          source_order=getattr(args, "source_order", "rank") or "rank")
        cfg.validate()
    except ValueError as exc:
        print(f"streamring model-check: {exc}", file=sys.stderr)
        return 2
    res = check(cfg)
    print_result(res)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(res.to_dict(), indent=2))
    return 0 if res.ok else 1
