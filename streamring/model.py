"""Exhaustive explicit-state model checker of the chunk-ready ring protocol.

``streamring model-check`` explores every interleaving of the protocol steps of
:mod:`streamring.protocol` (the 8-step argument of its module docstring) for a
small configuration (default 2 ranks x 2 slots x 3 chunks x 2 epochs) by
breadth-first search over hashable states with a visited set, and checks:

``no-stale-or-torn-read``
    a consumer's read of ``(src, chunk c, epoch e)`` sees exactly the payload
    written for ``plan.gen(c)``, in the route part and in the layout part;
``no-overwrite-before-ack``
    no producer writes a slot while a consumer holds the slot's previous chunk
    (acquired it, not yet acknowledged it);
``no-aba``
    nobody accepts leftovers of an older epoch: neither an acquire that accepts
    a generation word that is not the expected one, nor a read that sees the
    payload of an older epoch;
``no-protocol-violation``
    :func:`protocol.classify_gen` never says ``VIOLATION`` (the runtime would
    raise :class:`protocol.ProtocolViolation`), and no acknowledgement finds
    its bit already set (``Ring.ack`` raises on it when no mutation is injected);
``no-deadlock``
    every reachable state can still reach the final state (all epochs done and
    drained): reverse reachability over the whole explored graph;
``serialised-schedule``
    the fully serialised schedule (per chunk: every route producer, every
    layout producer, then every consumer, in rank order) reaches the final
    state without a violation (one deterministic path).

The model is derived from the runtime's protocol module, so the two cannot
drift: generations come from ``StreamPlan.gen`` (``make_gen``), the consumer's
wait is ``classify_gen`` (looked up when a model is built, so a patched
function is what gets checked), the number of chunks is ``StreamPlan.num_chunks``
(the maximum over ranks, rule 7: the last rank has fewer tokens and still
publishes every chunk), the full acknowledgement mask is
``RingLayout.full_mask(word)`` over ``RingLayout.mask_words``, the slot is
``chunk % num_slots``, and the mutations are ``protocol.Inject`` /
``protocol.INJECT_MODES``, each changing exactly the step that ``protocol.Ring``
changes for it.

Processes and atomic steps, for rank ``r`` (all ranks run the same code):

* route producer and layout producer (independent, so either order occurs),
  per chunk ``c`` of the epoch's plan, slot ``s = c % S``, ``g = plan.gen(c)``:

  - ``reserve``: ``Ring.try_reserve``; for ``c >= S`` it needs the acks of
    ``c - S`` (``Ring.try_collect_acks``): either this rank already collected
    them (``_collected[s] == gen(c - S)``, shared by both producers), or the ack
    mask is full, and then it records ``_collected[s]`` and clears the mask in
    the same step (atomic: after the mask is full nobody but the owner writes
    it, so splitting the check from the clear adds no behaviour);
    ``skip-ack-wait`` skips the wait entirely, as ``try_reserve`` does;
  - ``write``: a plain store of the payload cell ``payload[r][kind][s] := g``
    (the value stands for ``(r, g, kind)``: rank and part are the cell's).
    Stores are weak: the value goes to the producer's *pending* store buffer
    and is not visible to any reader (other ranks and this rank's consumer,
    which is another thread) until it is flushed;
  - ``publish -> rank t``, one step per target in the order of ``Ring._publish``
    (every rank, the owner included): ``ready_gen[t][kind][r][s] := g``. Each
    ``signal_op`` is a release, so it first flushes the producer's pending
    stores to memory (the first target's step does it);
  - with ``signal-before-payload`` the order is that of
    ``Ring._write_then_publish`` under the mutation: publish to every rank,
    then write (pending), then ``fence`` (flushes);
  - ``drains early`` (a memory-system step of its own): a pending store may
    become visible at any time before the release, which is legal too.

* consumer on ``d``, per chunk ``c`` and per source ``src`` (in that order, as
  the stress harness does): ``acquire`` (both generation words *at d* classify
  ``READY`` with ``classify_gen``; ``OLDER`` waits; ``VIOLATION`` is a property
  failure; ``skip-acquire`` proceeds without looking, as ``Ring.gen_state``
  does; ``ignore-epoch`` passes ``ignore_epoch=True``), ``read route part``,
  ``read layout part`` (each reads the visible payload cell and checks it),
  ``ack`` (``fetch_or`` of bit ``d`` into ``ack_mask[s]`` of ``src``). The two
  generation words are read in one step: a mask that reads READY stays READY
  until this consumer acknowledges, so reading them apart adds no behaviour
  of the correct protocol (a ``VIOLATION`` value would be seen in either form).

* end of epoch on ``r`` (``Ring.end_stream``): once its three roles are done,
  the owner waits for the full masks of its last ``min(S, chunks)`` chunks
  (one atomic step, same argument as for ``reserve``), then ``begin_stream`` of
  the next epoch is collective (its allgather), so it is one step once every
  rank has ended. No memory is cleared between epochs. ``barrier=False``
  (API only) lets each rank begin its next epoch alone, a stronger check.

Signal words and the ack mask are atomics with release/acquire semantics:
their steps are sequentially consistent, and weak memory is modelled where it
matters, on the plain payload stores. Bookkeeping that nothing reads
(``consumed_gen``, ``_slot_chunk``, metadata timestamps) is left out.

The search is exhaustive (no partial-order reduction, no state bound unless
``max_states`` is given through the API, and then the output says
"BOUNDED"). It stops at the first violation and prints the shortest
counter-example from the initial state (BFS parents).
"""

from __future__ import annotations

import json
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
    PROP_READ: "(1) every read sees exactly the payload of its generation (route and layout parts)",
    PROP_OVERWRITE: "(2) no slot overwrite while a reader holds its previous chunk",
    PROP_ABA: "(3) no leftovers of an older epoch accepted",
    PROP_PROTOCOL: "(4) classify_gen never says VIOLATION; no double acknowledgement",
    PROP_DEADLOCK: "(5) every reachable state can reach the final state",
    PROP_SERIAL: "(6) the serialised schedule completes without violation",
}

TRACE_PRINT_MAX = 40  # console lines of a counter-example; the JSON has every step


def _g(gen: int) -> str:
    return P.gen_str(gen) if gen else "0 (never written)"


@dataclass
class ModelConfig:
    ranks: int = 2
    slots: int = 2
    chunks: int = 3
    epochs: int = 2
    inject: P.Inject = P.Inject.NONE
    barrier: bool = True  # begin_stream is collective (its allgather); False: each rank goes on alone
    early_drain: bool = True  # pending payload stores may become visible before the release
    max_states: int | None = None  # None: exhaustive

    def validate(self) -> None:
        problems = []
        for name, lo in (("ranks", 1), ("slots", 1), ("chunks", 1), ("epochs", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                problems.append(f"--{name} must be an integer >= {lo}, got {v!r}")
        if isinstance(self.epochs, int) and self.epochs > P.MAX_EPOCH:
            problems.append(f"--epochs must be <= {P.MAX_EPOCH}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class Violation:
    properties: tuple[str, ...]
    message: str


@dataclass
class Trans:
    proc: tuple  # which process steps: ("route", r), ("layout", r), ("consumer", d), ("mem", r, k), ("end", r), ...
    desc: tuple  # what it does, formatted only for traces
    state: tuple | None  # successor (None for a violating step)
    violation: Violation | None = None


@dataclass
class CheckResult:
    config: dict
    states: int = 0
    transitions: int = 0
    time_s: float = 0.0
    exhaustive: bool = True
    properties: dict = field(default_factory=dict)  # name -> PASS | FAIL | NOT CHECKED ...
    counterexample: dict | None = None
    serialised: dict | None = None
    final_reachable: bool | None = None
    reduction: str = "none (full interleaving semantics)"

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


class Model:
    """The protocol as a transition system over flat tuples (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        cfg.validate()
        self.cfg = cfg
        R, S, E = cfg.ranks, cfg.slots, cfg.epochs
        self.R, self.S, self.E = R, S, E
        self.inject = cfg.inject
        # Looked up now (not at import) so that the function the runtime uses is the one checked.
        self._classify = P.classify_gen
        self._ignore_epoch = cfg.inject is P.Inject.IGNORE_EPOCH
        self._cmemo: dict = {}
        layout = P.RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=1, hidden=P.SF_BLOCK, topk=1,
                              num_experts=1)
        self.mask_words = layout.mask_words
        self.full = tuple(layout.full_mask(w) for w in range(layout.mask_words))
        # Uneven ranks (rule 7): odd ranks have one token fewer, so their last chunk is a zero-token
        # chunk; every rank still publishes plan.num_chunks chunks.
        tokens = tuple(cfg.chunks - (r % 2 if R > 1 else 0) for r in range(R))
        self.plans = [None] + [P.StreamPlan(epoch=e, tokens_per_rank=tokens, tokens_per_slot=1)
                               for e in range(1, E + 1)]
        self.C = self.plans[1].num_chunks
        if self.C != cfg.chunks:
            raise ValueError(f"StreamPlan.num_chunks = {self.C}, expected {cfg.chunks}")
        # one int object per generation, shared by every state that holds it
        self.gens = [None] + [tuple(self.plans[e].gen(c) for c in range(self.C)) for e in range(1, E + 1)]
        # the last chunk of every slot (what end_stream drains: Ring._slot_chunk)
        self.last_chunk = [max((c for c in range(self.C) if c % S == s), default=-1) for s in range(S)]
        # producer program, as Ring._write_then_publish orders it
        pubs = [("publish", t) for t in range(R)]
        if cfg.inject is P.Inject.SIGNAL_BEFORE_PAYLOAD:
            self.steps = [("reserve", 0)] + pubs + [("write", 0), ("fence", 0)]
        else:
            self.steps = [("reserve", 0), ("write", 0)] + pubs
        self.nsteps = len(self.steps)
        self.pdone = self.C * self.nsteps
        self.cdone = self.C * R * 4
        # flat state layout
        self.EP = 0
        self.END = R
        self.PPC = 2 * R  # + 2r + k
        self.CPC = 4 * R  # + d
        self.PSL = 5 * R  # pending slot (-1: none) + 2r + k
        self.PVL = 7 * R  # pending value + 2r + k
        self.PAY = 9 * R  # + (2r + k) * S + s
        self.RDY = self.PAY + 2 * R * S  # + ((2d + k) * R + r) * S + s
        self.ACK = self.RDY + 2 * R * R * S  # + r * S + s
        self.COL = self.ACK + R * S  # + r * S + s
        self.NFIELDS = self.COL + R * S

    # -- helpers ---------------------------------------------------------------------------
    def initial(self) -> tuple:
        R = self.R
        st = [0] * self.NFIELDS
        for r in range(R):
            st[self.EP + r] = 1
            st[self.PSL + 2 * r] = st[self.PSL + 2 * r + 1] = -1
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

    def is_final(self, st: tuple) -> bool:
        R = self.R
        return all(st[self.END + r] == 1 and st[self.EP + r] == self.E for r in range(R))

    def _flush(self, lst: list, r: int, k: int) -> None:
        i = 2 * r + k
        s = lst[self.PSL + i]
        if s >= 0:
            lst[self.PAY + i * self.S + s] = lst[self.PVL + i]
            lst[self.PSL + i] = -1
            lst[self.PVL + i] = 0

    # -- transitions -----------------------------------------------------------------------
    def successors(self, st: tuple) -> list[Trans]:
        R, S, C = self.R, self.S, self.C
        out: list[Trans] = []
        inject = self.inject
        all_ended = True
        for r in range(R):
            e = st[self.EP + r]
            if st[self.END + r]:
                if not self.cfg.barrier and e < self.E:
                    lst = list(st)
                    self._begin(lst, r)
                    out.append(Trans(("begin", r), ("begin", r, e + 1), tuple(lst)))
                continue
            all_ended = False
            gens = self.gens[e]
            # ---- producers --------------------------------------------------------------
            for k in (0, 1):
                i = 2 * r + k
                pc = st[self.PPC + i]
                if pc < self.pdone:
                    c, j = divmod(pc, self.nsteps)
                    step, t = self.steps[j]
                    s = c % S
                    g = gens[c]
                    if step == "reserve":
                        prev = c - S
                        if prev < 0:
                            lst = list(st)
                            lst[self.PPC + i] = pc + 1
                            out.append(Trans((KINDS[k], r), ("reserve-first", r, k, c, s), tuple(lst)))
                        elif inject is P.Inject.SKIP_ACK_WAIT:
                            lst = list(st)
                            lst[self.PPC + i] = pc + 1
                            out.append(Trans((KINDS[k], r), ("reserve-skip", r, k, c, s, prev), tuple(lst)))
                        else:
                            gp = gens[prev]
                            ai = self.ACK + r * S + s
                            if st[self.COL + r * S + s] == gp:
                                lst = list(st)
                                lst[self.PPC + i] = pc + 1
                                out.append(Trans((KINDS[k], r), ("reserve-collected", r, k, c, s, prev), tuple(lst)))
                            elif self.mask_full(st[ai]):
                                lst = list(st)
                                lst[self.PPC + i] = pc + 1
                                lst[self.COL + r * S + s] = gp
                                lst[ai] = 0
                                out.append(Trans((KINDS[k], r), ("reserve-collect", r, k, c, s, prev), tuple(lst)))
                    elif step == "write":
                        viol = self._overwrite_check(st, r, e, c, s, k)
                        if viol is not None:
                            out.append(Trans((KINDS[k], r), ("write", r, k, c, s, g), None, viol))
                        else:
                            lst = list(st)
                            self._flush(lst, r, k)  # (never non-empty here: every write is followed by a release)
                            lst[self.PSL + i] = s
                            lst[self.PVL + i] = g
                            lst[self.PPC + i] = pc + 1
                            out.append(Trans((KINDS[k], r), ("write", r, k, c, s, g), tuple(lst)))
                    elif step == "publish":
                        lst = list(st)
                        flushed = lst[self.PSL + i] >= 0
                        self._flush(lst, r, k)
                        lst[self.RDY + ((2 * t + k) * R + r) * S + s] = g
                        lst[self.PPC + i] = pc + 1
                        out.append(Trans((KINDS[k], r), ("publish", r, k, c, s, g, t, flushed), tuple(lst)))
                    else:  # fence
                        lst = list(st)
                        flushed = lst[self.PSL + i] >= 0
                        self._flush(lst, r, k)
                        lst[self.PPC + i] = pc + 1
                        out.append(Trans((KINDS[k], r), ("fence", r, k, c, s, g, flushed), tuple(lst)))
                if self.cfg.early_drain and st[self.PSL + i] >= 0:
                    lst = list(st)
                    s_, v_ = lst[self.PSL + i], lst[self.PVL + i]
                    self._flush(lst, r, k)
                    out.append(Trans(("mem", r, k), ("drain", r, k, s_, v_), tuple(lst)))
            # ---- consumer ---------------------------------------------------------------
            d = r
            cpc = st[self.CPC + d]
            if cpc < self.cdone:
                item, phase = divmod(cpc, 4)
                c, src = divmod(item, R)
                s = c % S
                g = gens[c]
                if phase == 0:
                    if inject is P.Inject.SKIP_ACQUIRE:
                        lst = list(st)
                        lst[self.CPC + d] = cpc + 1
                        out.append(Trans(("consumer", d), ("acquire-skip", d, src, c, s, g), tuple(lst)))
                    else:
                        vr = st[self.RDY + ((2 * d + 0) * R + src) * S + s]
                        vl = st[self.RDY + ((2 * d + 1) * R + src) * S + s]
                        cr, cl = self.classify(vr, g), self.classify(vl, g)
                        V, RD = P.GenState.VIOLATION, P.GenState.READY
                        if cr is V or cl is V:
                            name, seen = ("route_ready_gen", vr) if cr is V else ("layout_ready_gen", vl)
                            msg = (f"rank {d}: {name}[src={src}][slot={s}] = {_g(seen)} while expecting {P.gen_str(g)}: "
                                   f"classify_gen says VIOLATION (Ring.gen_state raises ProtocolViolation)")
                            out.append(Trans(("consumer", d), ("acquire-violation", d, src, c, s, g, vr, vl), None,
                                             Violation((PROP_PROTOCOL,), msg)))
                        elif cr is RD and cl is RD:
                            if vr != g or vl != g:
                                bad = vr if vr != g else vl
                                older = P.split_gen(bad)[0] < P.split_gen(g)[0]
                                msg = (f"rank {d} accepted generation {_g(bad)} as ready for {P.gen_str(g)} "
                                       f"(src {src} chunk {c} slot {s})" + (": a leftover of an older epoch" if older else ""))
                                props = (PROP_ABA,) if older else (PROP_PROTOCOL,)
                                out.append(Trans(("consumer", d), ("acquire", d, src, c, s, g, vr, vl), None,
                                                 Violation(props, msg)))
                            else:
                                lst = list(st)
                                lst[self.CPC + d] = cpc + 1
                                out.append(Trans(("consumer", d), ("acquire", d, src, c, s, g, vr, vl), tuple(lst)))
                elif phase in (1, 2):
                    k = phase - 1
                    v = st[self.PAY + (2 * src + k) * S + s]
                    if v != g:
                        props = [PROP_READ]
                        what = "torn" if k == 1 else "stale"
                        if v and P.split_gen(v)[0] < P.split_gen(g)[0]:
                            props.append(PROP_ABA)
                            what += " (older epoch: ABA)"
                        msg = (f"{what} read: rank {d} read the {KINDS[k]} part of src {src} chunk {c} (epoch {e}, slot {s}) "
                               f"and saw {_g(v)}, expected {P.gen_str(g)}"
                               + (" (its route part was correct)" if k == 1 else ""))
                        out.append(Trans(("consumer", d), ("read", d, k, src, c, s, v), None,
                                         Violation(tuple(props), msg)))
                    else:
                        lst = list(st)
                        lst[self.CPC + d] = cpc + 1
                        out.append(Trans(("consumer", d), ("read", d, k, src, c, s, v), tuple(lst)))
                else:  # ack
                    ai = self.ACK + src * S + s
                    m = st[ai]
                    bit = 1 << d
                    if m & bit and inject is P.Inject.NONE:
                        msg = (f"rank {d}: ack bit already set in rank {src}'s ack_mask[slot={s}] when acknowledging "
                               f"chunk {c} (double acknowledgement: Ring.ack raises ProtocolViolation)")
                        out.append(Trans(("consumer", d), ("ack", d, src, c, s, m, m | bit), None,
                                         Violation((PROP_PROTOCOL,), msg)))
                    else:
                        lst = list(st)
                        lst[ai] = m | bit
                        lst[self.CPC + d] = cpc + 1
                        out.append(Trans(("consumer", d), ("ack", d, src, c, s, m, m | bit), tuple(lst)))
            # ---- end_stream (drain) -----------------------------------------------------
            if (cpc == self.cdone and st[self.PPC + 2 * r] == self.pdone
                    and st[self.PPC + 2 * r + 1] == self.pdone):
                ok = True
                for s in range(S):
                    lc = self.last_chunk[s]
                    if lc >= 0 and st[self.COL + r * S + s] != gens[lc] and not self.mask_full(st[self.ACK + r * S + s]):
                        ok = False
                        break
                if ok:
                    lst = list(st)
                    for s in range(S):
                        lc = self.last_chunk[s]
                        if lc >= 0 and lst[self.COL + r * S + s] != gens[lc]:
                            lst[self.COL + r * S + s] = gens[lc]
                            lst[self.ACK + r * S + s] = 0
                    lst[self.END + r] = 1
                    out.append(Trans(("end", r), ("end", r, e), tuple(lst)))
        if all_ended and self.cfg.barrier:
            e = st[self.EP]
            if e < self.E:
                lst = list(st)
                for r in range(R):
                    self._begin(lst, r)
                out.append(Trans(("begin",), ("begin", None, e + 1), tuple(lst)))
        return out

    def _begin(self, lst: list, r: int) -> None:
        lst[self.EP + r] += 1
        lst[self.END + r] = 0
        lst[self.PPC + 2 * r] = lst[self.PPC + 2 * r + 1] = 0
        lst[self.CPC + r] = 0

    def _overwrite_check(self, st: tuple, r: int, e: int, c: int, s: int, k: int) -> Violation | None:
        """Property (2): does a consumer hold (acquired, not acked) the slot's previous content?"""
        R, S = self.R, self.S
        for d in range(R):
            cpc = st[self.CPC + d]
            if cpc >= self.cdone:
                continue
            item, phase = divmod(cpc, 4)
            if phase == 0:
                continue
            c2, src = divmod(item, R)
            e2 = st[self.EP + d]
            if src == r and c2 % S == s and (e2, c2) != (e, c):
                return Violation((PROP_OVERWRITE,), (
                    f"rank {r} {KINDS[k]} producer overwrites slot {s} with chunk {c} (epoch {e}) while rank {d} "
                    f"holds chunk {c2} (epoch {e2}) of that slot: acquired, not yet acknowledged"))
        return None

    # -- labels ----------------------------------------------------------------------------
    def label(self, t: Trans) -> str:
        d = t.desc
        op = d[0]
        if op.startswith("reserve"):
            _, r, k, c, s = d[:5]
            head = f"r{r}.{KINDS[k]}: reserve chunk {c} (slot {s})"
            if op == "reserve-first":
                return head + ": first lap of the slot"
            prev = d[5]
            if op == "reserve-skip":
                return head + f" WITHOUT waiting for the acks of chunk {prev} [skip-ack-wait]"
            if op == "reserve-collected":
                return head + f": acks of chunk {prev} already collected"
            return head + f": ack mask of chunk {prev} full -> collected, mask cleared"
        if op == "write":
            _, r, k, c, s, g = d
            return f"r{r}.{KINDS[k]}: write payload of chunk {c} ({P.gen_str(g)}) into slot {s} (pending store, not yet visible)"
        if op == "publish":
            _, r, k, c, s, g, tgt, flushed = d
            extra = " (release: pending payload becomes visible)" if flushed else ""
            return f"r{r}.{KINDS[k]}: publish chunk {c} gen {P.gen_str(g)} -> rank {tgt}{extra}"
        if op == "fence":
            _, r, k, c, s, g, flushed = d
            return f"r{r}.{KINDS[k]}: fence after the payload of chunk {c}" + (" (payload becomes visible)" if flushed else "")
        if op == "drain":
            _, r, k, s, v = d
            return f"r{r}.{KINDS[k]}: pending payload {P.gen_str(v)} of slot {s} drains to memory early (legal)"
        if op == "acquire-skip":
            _, dd, src, c, s, g = d
            return f"r{dd}.consumer: acquire src {src} chunk {c} (slot {s}) WITHOUT reading the generations [skip-acquire]"
        if op in ("acquire", "acquire-violation"):
            _, dd, src, c, s, g, vr, vl = d
            return (f"r{dd}.consumer: acquire src {src} chunk {c} (slot {s}), expecting {P.gen_str(g)}: "
                    f"route_ready_gen={_g(vr)} -> {self.classify(vr, g).name}, "
                    f"layout_ready_gen={_g(vl)} -> {self.classify(vl, g).name}")
        if op == "read":
            _, dd, k, src, c, s, v = d
            return f"r{dd}.consumer: read {KINDS[k]} part of src {src} chunk {c} (slot {s}): sees {_g(v)}"
        if op == "ack":
            _, dd, src, c, s, m0, m1 = d
            return f"r{dd}.consumer: ack src {src} chunk {c}: rank {src}'s ack_mask[slot {s}] {m0:#b} -> {m1:#b}"
        if op == "end":
            _, r, e = d
            return f"r{r}: end_stream epoch {e}: last chunks of every slot acknowledged (drained)"
        if op == "begin":
            _, r, e = d
            who = "all ranks" if r is None else f"r{r}"
            return f"{who}: begin_stream epoch {e} (memory not cleared)"
        return repr(d)


# --------------------------------------------------------------------------------------
# Search
# --------------------------------------------------------------------------------------
def _path(model: Model, states: list, parent: array, sid: int) -> list[str]:
    """Labels of the shortest path (BFS parents) from the initial state to state ``sid``."""
    chain = []
    while sid > 0:
        chain.append(sid)
        sid = parent[sid]
    chain.reverse()
    lines, cur = [], states[0]
    for nid in chain:
        nxt = states[nid]
        for t in model.successors(cur):
            if t.state == nxt:
                lines.append(model.label(t))
                break
        else:  # pragma: no cover - the graph is deterministic
            lines.append("?")
        cur = nxt
    return lines


def run_serialised(model: Model) -> dict:
    """Property (6): per chunk every route producer, every layout producer, then every consumer, by rank."""
    R, C = model.R, model.C
    st = model.initial()
    trace: list[str] = []

    def step(proc) -> str | None:
        nonlocal st
        for t in model.successors(st):
            if t.proc == proc:
                trace.append(model.label(t))
                if t.violation is not None:
                    return f"{', '.join(t.violation.properties)}: {t.violation.message}"
                st = t.state
                return None
        return f"stuck: {proc[0]} of rank {proc[1] if len(proc) > 1 else '-'} has no enabled step"

    def run(proc, done) -> str | None:
        while not done():
            err = step(proc)
            if err:
                return err
        return None

    err = None
    for e in range(1, model.E + 1):
        for c in range(C):
            for k in (0, 1):
                for r in range(R):
                    err = err or run((KINDS[k], r), lambda r=r, k=k: st[model.PPC + 2 * r + k] >= (c + 1) * model.nsteps)
            for d in range(R):
                err = err or run(("consumer", d), lambda d=d: st[model.CPC + d] >= (c + 1) * R * 4)
        for r in range(R):
            err = err or step(("end", r))
        if e < model.E:
            if model.cfg.barrier:
                err = err or step(("begin",))
            else:
                for r in range(R):
                    err = err or step(("begin", r))
        if err:
            break
    if not err and not model.is_final(st):
        err = "the serialised schedule ended in a non-final state"
    return {"result": "PASS" if not err else "FAIL", "steps": len(trace), "error": err,
            "trace_tail": trace[-10:] if err else []}


def check(cfg: ModelConfig, progress=None) -> CheckResult:
    """Explore the model of ``cfg`` breadth-first; stop at the first violation."""
    model = Model(cfg)
    res = CheckResult(config={"ranks": cfg.ranks, "slots": cfg.slots, "chunks": cfg.chunks, "epochs": cfg.epochs,
                              "inject": cfg.inject.value, "barrier": cfg.barrier, "early_drain": cfg.early_drain,
                              "max_states": cfg.max_states})
    t0 = time.perf_counter()
    init = model.initial()
    ids = {init: 0}
    states = [init]
    parent = array("l", [-1])
    esrc, edst = array("l"), array("l")
    queue = deque([0])
    violation = None  # (parent id, Trans)
    deadlock_sid = None
    bounded = False
    succ = model.successors
    is_final = model.is_final
    ntrans = 0
    while queue:
        sid = queue.popleft()
        st = states[sid]
        ts = succ(st)
        if not ts and not is_final(st):
            deadlock_sid = sid
            break
        for t in ts:
            ntrans += 1
            if t.violation is not None:
                violation = (sid, t)
                break
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
        if progress is not None and sid % 100000 == 0 and sid:
            progress(len(states), ntrans, time.perf_counter() - t0)
    res.states, res.transitions = len(states), ntrans
    res.exhaustive = not bounded and violation is None and deadlock_sid is None
    props = {p: "NOT CHECKED (stopped at the first violation)" for p in PROPERTIES}
    if violation is not None:
        sid, t = violation
        trace = _path(model, states, parent, sid) + [model.label(t) + "   <-- VIOLATION"]
        for p in t.violation.properties:
            props[p] = "FAIL"
        res.counterexample = {"properties": list(t.violation.properties), "message": t.violation.message,
                              "steps": len(trace), "trace": trace}
    elif deadlock_sid is not None:
        props[PROP_DEADLOCK] = "FAIL"
        trace = _path(model, states, parent, deadlock_sid)
        res.counterexample = {"properties": [PROP_DEADLOCK], "steps": len(trace), "trace": trace,
                              "message": "a reachable non-final state has no enabled step (deadlock)"}
    else:
        safety = "PASS" if not bounded else f"PASS up to the bound ({cfg.max_states} states) - BOUNDED, not a proof"
        for p in (PROP_READ, PROP_OVERWRITE, PROP_ABA, PROP_PROTOCOL):
            props[p] = safety
        if bounded:
            props[PROP_DEADLOCK] = "NOT CHECKED (bounded search)"
        else:
            bad, nfinal = _cannot_reach_final(model, states, esrc, edst)
            res.final_reachable = nfinal > 0
            if bad is None:
                props[PROP_DEADLOCK] = "PASS"
            else:
                props[PROP_DEADLOCK] = "FAIL"
                trace = _path(model, states, parent, bad)
                res.counterexample = {"properties": [PROP_DEADLOCK], "steps": len(trace), "trace": trace,
                                      "message": "from the last state of this trace the final state (all epochs "
                                                 "done) is unreachable (livelock/deadlock)"}
    res.time_s = time.perf_counter() - t0
    ser = run_serialised(model)
    res.serialised = ser
    props[PROP_SERIAL] = ser["result"]
    res.properties = props
    return res


def _cannot_reach_final(model: Model, states: list, esrc: array, edst: array) -> tuple[int | None, int]:
    """Reverse reachability from the final states.

    Returns the first (BFS-shortest) state that cannot reach a final state (None if none) and the
    number of final states.
    """
    n = len(states)
    # CSR of the reverse graph (edges dst -> src)
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
def format_result(res: CheckResult) -> list[str]:
    """Plain-text lines of a result (tables are printed with rich by :func:`print_result`)."""
    lines = []
    c = res.config
    lines.append(f"streamring model-check: {c['ranks']} ranks x {c['slots']} slots x {c['chunks']} chunks x "
                 f"{c['epochs']} epochs, inject={c['inject']}")
    kind = "exhaustive" if res.exhaustive else ("BOUNDED" if c.get("max_states") and res.counterexample is None
                                                else "stopped at the first violation")
    lines.append(f"explored {res.states} states, {res.transitions} transitions in {res.time_s:.2f}s ({kind}; "
                 f"reduction: {res.reduction})")
    return lines


def print_result(res: CheckResult) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    for line in format_result(res):
        console.print(line, markup=False)
    table = Table(title="properties")
    table.add_column("property")
    table.add_column("meaning")
    table.add_column("result")
    for p, v in res.properties.items():
        style = "green" if v == "PASS" else ("red" if v == "FAIL" else "yellow")
        table.add_row(p, PROPERTY_TEXT[p], f"[{style}]{v}[/{style}]")
    console.print(table)
    ce = res.counterexample
    if ce:
        console.print(f"counter-example ({', '.join(ce['properties'])}): {ce['message']}", markup=False)
        trace = ce["trace"]
        first = 0
        if len(trace) > TRACE_PRINT_MAX:
            first = len(trace) - TRACE_PRINT_MAX
            console.print(f"  ... {first} earlier steps (shortest path; the whole trace is in --json)", markup=False)
        for i, line in enumerate(trace[first:], start=first + 1):
            console.print(f"  {i:3d}. {line}", markup=False)
    ser = res.serialised
    if ser and ser["result"] != "PASS":
        console.print(f"serialised schedule: {ser['error']}", markup=False)
        for line in ser["trace_tail"]:
            console.print(f"    {line}", markup=False)
    console.print("PASS: every property holds" if res.ok else "FAIL", markup=False)


def model_check_main(args) -> int:
    """Entry point of ``streamring model-check``: 0 iff every property holds."""
    inject = P.Inject(args.inject) if getattr(args, "inject", None) else P.Inject.NONE
    cfg = ModelConfig(ranks=args.ranks, slots=args.slots, chunks=args.chunks, epochs=args.epochs, inject=inject,
                      max_states=getattr(args, "max_states", None))
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"streamring model-check: {exc}")
        return 2
    res = check(cfg)
    print_result(res)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(res.to_dict(), indent=2))
    return 0 if res.ok else 1
