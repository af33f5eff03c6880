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

With ``--layer ep`` (the expert-parallel GPU layer's handoffs, section below) also:

``no-stale-combine-read``
    (c) the owner's reduce of chunk ``c`` reads, for every routed entry
    ``(token, k)`` of it, exactly the result its consumer wrote in the current
    epoch (not an older epoch's, not one still pending, not an unwritten one);
``no-combine-overwrite-before-reduce``
    (d) no consumer writes an entry of an owner's combine area while it holds a
    value (of an earlier epoch, or of another chunk) that the owner has not
    reduced yet;
``no-counter-carry``
    (e) the owner's wait ``arrived[c] == expected[c]`` is never satisfied by a
    count that holds adds of an earlier epoch.

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

Expert-parallel layer (``--layer ep``)
======================================
The streamed MoE layer on GPUs (``host/moe_gpu.py`` and what replaces it) changes three
handoffs; the ring steps above stay as they are, except that each rank begins its next epoch
on its own (``ring_advance_epoch`` in the captured graph: no allgather, no barrier). Per rank
``r`` (every rank owns its chunks and consumes every rank's chunks):

* **early ``input_consumed`` acknowledgement**: the consumer's copy of the rows routed to its
  experts out of ``src``'s slot is the acquire's reads (reduction 1); it acknowledges right
  after the copy, so nothing waits for the combine any more. ``ack-before-copy``
  acknowledges first and ends the copy in a later step (``copied``): the slot stays held
  until then, and a producer that reuses it meanwhile is (2).
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
``protocol.Inject`` mode still applies to its ring steps. The default sizes of this layer
(2 ranks x 2 slots x 3 chunks x 2 epochs) always use reduction 2: their full graph is far
beyond reach (2 ranks x 1 slot x 2 chunks x 1 epoch alone has 669,240 states). Reduced, they
take 2,421 states and 3,771 transitions (0.4 s); 3 ranks take 440,350 states (3.5 minutes);
``--source-order ready`` takes 553,532 states (3.6 minutes) at the default sizes (its look-ahead is
coarse, as in the ring model).

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
   :class:`Model` is built (``skip-acquire``, ``ignore-epoch`` or a patched
   ``classify_gen`` turn the step off). The graph stays acyclic (per rank: epoch,
   then program counters, compute progress and empty buffers). The tests compare
   the reduced and the full graph of the ep layer on small sizes, for the correct
   protocol and for every mutation.

The search stops at the first violation and prints the shortest counter-example
from the initial state (BFS parents); under the reduction that path is then
shortened (replayed without blocks of steps, of halving size from the end
backwards, while it still ends in the same violation) until no single step can
be dropped.
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

from .. import protocol as P
# the names the CLI offers live in names.py (each rank's CLI loads them, not this checker)
from .names import EP_INJECT_MODES, LAYERS, MODEL_INJECT_MODES, EPInject  # noqa: F401

KINDS = ("route", "layout")
WORD = (1 << 64) - 1

PROP_READ = "no-stale-or-torn-read"
PROP_OVERWRITE = "no-overwrite-before-ack"
PROP_ABA = "no-aba"
PROP_PROTOCOL = "no-protocol-violation"
PROP_DEADLOCK = "no-deadlock"
PROP_SERIAL = "serialised-schedule"
# the expert-parallel layer's handoffs (--layer ep)
PROP_COMBINE_READ = "no-stale-combine-read"
PROP_COMBINE_OVERWRITE = "no-combine-overwrite-before-reduce"
PROP_COUNTER = "no-counter-carry"
PROPERTIES = (PROP_READ, PROP_OVERWRITE, PROP_ABA, PROP_PROTOCOL, PROP_DEADLOCK, PROP_SERIAL)
EP_PROPERTIES = (PROP_READ, PROP_OVERWRITE, PROP_ABA, PROP_PROTOCOL, PROP_COMBINE_READ, PROP_COMBINE_OVERWRITE,
                 PROP_COUNTER, PROP_DEADLOCK, PROP_SERIAL)
PROPERTY_TEXT = {
    PROP_READ: "(1) every read sees exactly the payload of its generation (route and layout)",
    PROP_OVERWRITE: "(2) no slot overwrite while a reader holds its previous chunk",
    PROP_ABA: "(3) no leftovers of an older epoch accepted or read",
    PROP_PROTOCOL: "(4) classify_gen never says VIOLATION; no double acknowledgement",
    PROP_COMBINE_READ: "(c) the owner's reduce reads only combine entries written this epoch by their consumer",
    PROP_COMBINE_OVERWRITE: "(d) no combine entry overwritten (later epoch or chunk) before its owner reduced it",
    PROP_COUNTER: "(e) no arrived[c] satisfied by adds of an earlier epoch",
    PROP_DEADLOCK: "(5) every reachable state can reach the final state",
    PROP_SERIAL: "(6) the serialised schedule completes without violation",
}


def parse_inject(value: str | None):
    """The ``protocol.Inject`` or :class:`EPInject` named ``value`` (None or "none": no mutation)."""
    if not value or value == "none":
        return P.Inject.NONE
    if value in EP_INJECT_MODES:
        return EPInject(value)
    if value in P.INJECT_MODES:
        return P.Inject(value)
    raise ValueError(f"--inject must be one of {MODEL_INJECT_MODES}, got {value!r}")


NOT_CHECKED = "NOT CHECKED (stopped at the first violation)"
TRACE_PRINT_MAX = 40  # console lines of a counter-example; --json has every step


def _g(gen: int) -> str:
    return P.gen_str(gen) if gen else "0 (never written)"


def _cv(v: int) -> str:
    """A combine entry's value: which epoch, chunk and rank wrote it."""
    if not v:
        return "0 (never written)"
    return f"rank {(v & 0xFF) - 1}'s result for chunk {(v >> 8) & 0xFF} of epoch {v >> 16}"


def _cval(e: int, c: int, d: int) -> int:
    return (e << 16) | (c << 8) | (d + 1)


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
    # "ring": the ring protocol as the stress harness runs it; "ep": plus the expert-parallel
    # GPU layer's handoffs (early input_consumed ack, remote combine + arrived counters, reduce)
    layer: str = "ring"
    topk: int = 2  # --layer ep: combine entries (token, k) per token of a chunk

    def validate(self) -> None:
        problems = []
        for name in ("ranks", "slots", "chunks", "epochs", "topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"--{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.epochs, int) and self.epochs > P.MAX_EPOCH:
            problems.append(f"--epochs must be <= {P.MAX_EPOCH}")
        if self.layer not in LAYERS:
            problems.append(f"--layer must be one of {LAYERS}, got {self.layer!r}")
        if self.por is None:
            # the ep layer's full graph is far larger (2 ranks x 1 slot x 2 chunks x 1 epoch: 669,240
            # states): it always uses the reduction unless told otherwise
            self.por = self.layer == "ep" or not (self.ranks <= 2 and self.slots <= 2 and self.chunks <= 3
                                                  and self.epochs <= 2)
        if not isinstance(self.inject, (P.Inject, EPInject)):
            problems.append(f"inject must be a protocol.Inject or verify.names.EPInject, got {self.inject!r}")
        elif isinstance(self.inject, EPInject) and self.inject is not EPInject.NONE and self.layer != "ep":
            problems.append(f"--inject {self.inject.value} breaks a handoff of the expert-parallel layer: "
                            f"it needs --layer ep")
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
    epoch; ``6R`` is the collective begin of the next epoch. ``--layer ep`` adds, for rank
    ``r``, ``CP[r] = 6R+1+3r`` its compute, ``CDP[r]`` the drain of its pending combine store,
    ``RP[r]`` its reduce as owner; there ``6R`` never moves (each end of epoch begins the next).
    """

    def __init__(self, cfg: ModelConfig):
        cfg.validate()
        self.cfg = cfg
        R, S, E = cfg.ranks, cfg.slots, cfg.epochs
        self.R, self.S, self.E = R, S, E
        # the ring's mutation (protocol.Inject) and the ep layer's (EPInject): at most one is set
        self.inject = inject = cfg.inject if isinstance(cfg.inject, P.Inject) else P.Inject.NONE
        self.ep_inject = cfg.inject if isinstance(cfg.inject, EPInject) else EPInject.NONE
        self.skip_acquire = inject is P.Inject.SKIP_ACQUIRE
        self.skip_ack_wait = inject is P.Inject.SKIP_ACK_WAIT
        # Looked up now (not at import) so that the function the runtime uses is the one checked.
        self._classify = P.classify_gen
        self._ignore_epoch = inject is P.Inject.IGNORE_EPOCH
        self.ep = cfg.layer == "ep"
        self.properties = EP_PROPERTIES if self.ep else PROPERTIES
        self.safety = tuple(p for p in self.properties if p not in (PROP_DEADLOCK, PROP_SERIAL))
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
        if inject is P.Inject.SIGNAL_BEFORE_PAYLOAD:
            self.steps = [("reserve", 0)] + pubs + [("write", 0), ("fence", 0)]
        else:
            self.steps = [("reserve", 0), ("write", 0)] + pubs
        self.nsteps = len(self.steps)
        self.pdone = C * self.nsteps
        # consumer steps per (chunk, src): acquire (+ the copy's reads, reduction 1), ack; with
        # ack-before-copy: acquire, ack, then the copy's reads end (the slot is held until then)
        self.ack_before_copy = self.ep_inject is EPInject.ACK_BEFORE_COPY
        self.NPH = NPH = 3 if self.ack_before_copy else 2
        self.cdone = C * R * NPH
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
        if self.ep:
            self._init_ep()
        self._init_bits()
        self._fut_cache: dict = {}

    def _init_ep(self) -> None:
        """The ep layer's routing, fields and processes (module docstring, "Expert-parallel layer")."""
        R, C, E, K = self.R, self.C, self.E, self.cfg.topk
        self.K = K
        self.sig_before_combine = self.ep_inject is EPInject.SIGNAL_BEFORE_COMBINE
        self.skip_arrival_wait = self.ep_inject is EPInject.SKIP_ARRIVAL_WAIT
        self.no_counter_reset = self.ep_inject is EPInject.NO_COUNTER_RESET
        # Abstract routing, new every epoch (new inputs): entry k of owner r's logical token t
        # goes to rank (r + k * (t + e)) % R. A chunk without tokens (rule 7) has no entries
        # (expected 0); a consumer with no entry of a chunk contributes nothing to it.
        # entries[e][d]: the (owner, chunk, k) that consumer d computes in epoch e;
        # expected[e][r][c]: the entries of (r, c), known to the owner from its own routing.
        self.entries = [None]
        self.expected = [None]
        self.route = [None]
        for e in range(1, E + 1):
            plan = self.plans[e]
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
            self.entries.append(tuple(tuple(x) for x in ents))
            self.expected.append(exp)
            self.route.append(rt)
        # ent_mask[e][d][r][c]: the bits (indices into entries[e][d]) of the entries of (r, c)
        self.ent_mask = [None]
        for e in range(1, E + 1):
            em = [[[0] * C for _ in range(R)] for _ in range(R)]
            for d in range(R):
                for j, (r, c, _k) in enumerate(self.entries[e][d]):
                    em[d][r][c] |= 1 << j
            self.ent_mask.append(em)
        # (chunk c holds the logical token c: tokens_per_slot is 1)
        self.full_cmp = [None] + [[(1 << len(self.entries[e][d])) - 1 for d in range(R)] for e in range(1, E + 1)]
        n = self.NFIELDS
        self.CCUR, self.CPH, self.CMP, self.CPS, self.CPV = n, n + R, n + 2 * R, n + 3 * R, n + 4 * R
        self.CMB = n + 5 * R  # + cell: combine[owner r][token c][k] (0 or _cval(epoch, chunk, writer))
        self.ARR = self.CMB + R * C * K  # + r * C + c: arrived[c] at owner r
        self.ARRO = self.ARR + R * C  # ghost: the part of ARR added in an earlier epoch of the owner
        self.LRE = self.ARRO + R * C  # ghost, + r * C + c: the epoch of owner r's last reduce of chunk c
        self.RED = self.LRE + R * C  # + r: the owner's next chunk to reduce
        self.NFIELDS = self.RED + R
        # combine entry (r, c, k) -> cell: by logical token (chunk c holds token c), or by slot
        self.combine_by_slot = self.ep_inject is EPInject.COMBINE_BY_SLOT
        self.cell_of = {(r, c, k): (r * C + (c % self.S if self.combine_by_slot else c)) * K + k
                        for r in range(R) for c in range(C) for k in range(K)}
        # processes: per rank d the compute (GEMM stream), its pending-store drain, the owner's reduce
        self.CP = [6 * R + 1 + 3 * d for d in range(R)]
        self.CDP = [6 * R + 2 + 3 * d for d in range(R)]
        self.RP = [6 * R + 3 + 3 * d for d in range(R)]
        self.NP = 9 * R + 1
        self._xb_cache = (None, None)
        # The reduction assumes, for a rank's later epochs, that nothing of an owner is touched
        # before that owner publishes a chunk of that epoch: true when the acquire looks at the
        # generations and classifies every word of an earlier epoch (or 0) as OLDER. Checked here
        # on the classify in use (a mutation or a patched function turns the assumption off).
        OLDER = P.GenState.OLDER
        self.exact_acquire = not self.skip_acquire and all(
            self.classify(w, g) is OLDER
            for e in range(2, E + 1) for g in self.gens[e]
            for w in [0] + [w for e2 in range(1, e) for w in self.gens[e2]])

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
        if self.ep:
            C, K = self.C, self.K
            b_cellidx = [new() for _ in range(R * C * K)]
            self.b_cpend = [new() for _ in range(R)]
            self.b_arr = [[new() for _ in range(C)] for _ in range(R)]  # arrived[c] (and its ghost)
            self.b_red = [[new() for _ in range(C)] for _ in range(R)]  # "owner reduced c" (and its epoch)
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
        if self.ep:
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
        self.role_pids = [6 * r + i for r in range(R) for i in (0, 1, 2)]
        self.rank_of = [p // 6 for p in range(6 * R)] + [-1]  # BEGIN: no rank
        if self.ep:
            # the producer step that publishes the last chunk to rank t
            self.last_pub = [(self.C - 1) * self.nsteps + self.steps.index(("publish", t)) for t in range(R)]
            for r in range(R):
                self.role_pids += [self.CP[r], self.RP[r]]
                self.rank_of += [r, r, r]
            # a rank's own roles: its end of epoch waits for every one of them
            self.roles_of = [(6 * r, 6 * r + 1, 6 * r + 2, self.CP[r], self.RP[r]) for r in range(R)]
            self.ALLP = (1 << self.NP) - 1

    # -- helpers ---------------------------------------------------------------------------
    def initial(self) -> tuple:
        st = [0] * self.NFIELDS
        for r in range(self.R):
            st[self.EP + r] = 1
            st[self.PSL + 2 * r] = st[self.PSL + 2 * r + 1] = -1
            st[self.HLD + r] = -1
            if self.ep:
                st[self.CCUR + r] = st[self.CPS + r] = -1
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
        if pid > self.BEGIN:  # ep: compute or reduce of rank r
            r = self.rank_of[pid]
            if st[self.END + r]:
                return True
            if pid == self.RP[r]:
                return st[self.RED + r] >= self.C
            return st[self.CCUR + r] < 0 and st[self.CMP + r] == self.full_cmp[st[self.EP + r]][r]
        r, i = divmod(pid, 6)
        if st[self.END + r]:
            return True
        if i == 2:
            return st[self.CPC + r] >= self.cdone
        return st[self.PPC + 2 * r + i] >= self.pdone

    def _holders(self, st, r: int, s: int):
        """Consumers holding (acquired; not acked, or with ack-before-copy not copied) a chunk of ``r``
        in slot ``s``: (d, chunk, epoch)."""
        R, NPH = self.R, self.NPH
        for d in range(R):
            pc = st[self.CPC + d]
            if pc < self.cdone and pc % NPH and not st[self.END + d]:
                c2, src = divmod(pc // NPH, R)
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

    # -- the ep layer's helpers ----------------------------------------------------------
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

    def _pending_adds(self, st, r: int, c: int, e: int) -> list[int]:
        """Per consumer: the adds to owner ``r``'s ``arrived[c]`` (owner epoch ``e``) not made yet.

        A consumer one epoch behind the owner may still owe adds of that older epoch (only when
        the owner did not wait for them: skip-arrival-wait) and owes every add of epoch ``e``; a
        consumer ahead of the owner has made every add of epoch ``e`` (its end of epoch waited for
        its compute) and cannot add for a later one before the owner publishes it. (A consumer
        that accepted a chunk of another epoch stopped there: a violation is terminal.)"""
        out = []
        for d in range(self.R):
            ed = st[self.EP + d]
            n = 0
            if not st[self.END + d] and ed <= e:
                owed = self.ent_mask[ed][d][r][c] & ~st[self.CMP + d]
                cur = st[self.CCUR + d]
                if cur >= 0 and st[self.CPH + d] == 2:
                    owed &= ~(1 << cur)
                n = owed.bit_count()
                if ed < e:
                    n += self.ent_mask[e][d][r][c].bit_count()
            out.append(n)
        return out

    def _arrival_blockers(self, st, r: int, c: int, e: int) -> tuple[int, tuple]:
        """The owner's wait ``arrived[c] == expected[c]``: ``(bl, nes)``: the compute processes each
        of which must move before it passes (a pid mask), and a necessary enabling set."""
        a = st[self.ARR + r * self.C + c]
        need = self.expected[e][r][c] - a
        if need == 0:
            return 0, ()
        pend = self._pending_adds(st, r, c, e)
        tot = sum(pend)
        if need < 0 or tot < need:  # adds only grow it: this wait never passes
            return 0, ()
        bl = 0
        for d, n in enumerate(pend):
            if n and tot - n < need:
                bl |= 1 << self.CP[d]
        return bl, ("all",) + tuple((self.CP[d],) for d, n in enumerate(pend) if n)

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
        ep = self.ep
        # (this runs once per state of every model check: the fields are read as locals)
        EP, END, PPC, PSL, PVL, PAY = self.EP, self.END, self.PPC, self.PSL, self.PVL, self.PAY
        RDY, ACK, COL, CPC, HLD, DNM = self.RDY, self.ACK, self.COL, self.CPC, self.HLD, self.DNM
        NPH, pdone, cdone, nsteps, steps = self.NPH, self.pdone, self.cdone, self.nsteps, self.steps
        b_done, b_pend, b_pay, b_rdy, b_pos = self.b_done, self.b_pend, self.b_pay, self.b_rdy, self.b_pos
        b_pos_rs, b_col, b_ack, last_chunk = self.b_pos_rs, self.b_col, self.b_ack, self.last_chunk
        ready_order, skip_ack_wait = self.ready_order, self.skip_ack_wait
        procs = [None] * self.NP
        all_ended = True
        for r in range(R):
            e = st[EP + r]
            base = 6 * r
            if st[END + r]:
                nxt = (self.BEGIN,) if e < self.E else ()
                for i in range(6):
                    procs[base + i] = ((), 0, 0, 0, nxt)
                if ep:
                    procs[self.CP[r]] = procs[self.CDP[r]] = procs[self.RP[r]] = ((), 0, 0, 0, ())
                continue
            all_ended = False
            gens = self.gens[e]
            # a finished role moves again in the next epoch: after the collective begin (ring), or
            # after its own rank's end of epoch (ep: ring_advance_epoch, no barrier)
            nxt = () if e >= self.E else ((base + 5,) if ep else (self.BEGIN,))
            # ---- producers and their pending stores ------------------------------------
            for k in (0, 1):
                i = 2 * r + k
                pid = base + k
                pc = st[PPC + i]
                if pc >= pdone:
                    procs[pid] = ((), 0, 0, 0, nxt)
                else:
                    c, j = divmod(pc, nsteps)
                    step, t = steps[j]
                    s = c % S
                    g = gens[c]
                    done_bit = b_done[pid] if pc + 1 == pdone else 0
                    if step == "reserve":
                        prev = c - S
                        if prev < 0 or skip_ack_wait:
                            lst = list(st)
                            lst[PPC + i] = pc + 1
                            op = "reserve-first" if prev < 0 else "reserve-skip"
                            procs[pid] = ((Trans(pid, (op, r, k, c, s, prev), tuple(lst)),), 0, 0, 0, ())
                        else:
                            gp = gens[prev]
                            ci, ai = COL + r * S + s, ACK + r * S + s
                            if st[ci] == gp:
                                lst = list(st)
                                lst[PPC + i] = pc + 1
                                procs[pid] = ((Trans(pid, ("reserve-collected", r, k, c, s, prev), tuple(lst)),),
                                              b_col[r][s], 0, 0, ())
                            elif self.mask_full(st[ai]):
                                lst = list(st)
                                lst[PPC + i] = pc + 1
                                lst[ci] = gp
                                lst[ai] = 0
                                procs[pid] = ((Trans(pid, ("reserve-collect", r, k, c, s, prev), tuple(lst)),),
                                              0, b_col[r][s] | b_ack[r][s], 0, ())
                            else:
                                nes = tuple(6 * b + 2 for b in self.missing_bits(st[ai]))
                                procs[pid] = ((), 0, 0, 0, nes)
                    elif step == "write":
                        acc_r, acc_w = b_pos_rs[r][s] | b_pend[r][k], b_pend[r][k] | done_bit
                        viol = None
                        for d, c2, e2 in self._holders(st, r, s):
                            if (e2, c2) != (e, c):
                                how = ("acquired, not yet acknowledged" if st[CPC + d] % NPH == 1 else
                                       "acquired and acknowledged, but its copy out of the slot has not completed")
                                viol = Violation((PROP_OVERWRITE,), (
                                    f"rank {r} {KINDS[k]} producer overwrites slot {s} with chunk {c} (epoch {e}) "
                                    f"while rank {d} holds chunk {c2} (epoch {e2}) of that slot: {how}"))
                                break
                        if viol is not None:
                            procs[pid] = ((Trans(pid, ("write", r, k, c, s, g), None, viol),), acc_r, acc_w, 0, ())
                        else:
                            lst = list(st)
                            self._flush(lst, r, k)  # (always empty here: each write is followed by a release)
                            lst[PSL + i] = s
                            lst[PVL + i] = g
                            lst[PPC + i] = pc + 1
                            procs[pid] = ((Trans(pid, ("write", r, k, c, s, g), tuple(lst)),), acc_r, acc_w, 0, ())
                    else:  # publish to t, or fence: both release (flush) first
                        lst = list(st)
                        ps = lst[PSL + i]
                        acc_r, acc_w = b_pend[r][k], done_bit
                        if ps >= 0:
                            acc_r |= b_pos_rs[r][ps]
                            acc_w |= b_pend[r][k] | b_pay[r][k][ps]
                        fl = self._flush(lst, r, k)
                        if step == "publish":
                            lst[RDY + ((2 * t + k) * R + r) * S + s] = g
                            acc_w |= b_rdy[t][k][r][s]
                            desc = ("publish", r, k, c, s, g, t, ps >= 0)
                        else:
                            desc = ("fence", r, k, c, s, g, ps >= 0)
                        lst[PPC + i] = pc + 1
                        if fl is not None:
                            procs[pid] = ((Trans(pid, desc + (fl[1],), None, fl[0]),), acc_r, acc_w, 0, ())
                        else:
                            procs[pid] = ((Trans(pid, desc + (None,), tuple(lst)),), acc_r, acc_w, 0, ())
                # pending-store drain
                mpid = base + 3 + k
                ps = st[PSL + i]
                if self.cfg.early_drain and ps >= 0:
                    lst = list(st)
                    v = lst[PVL + i]
                    fl = self._flush(lst, r, k)
                    acc_r = b_pend[r][k] | b_pos_rs[r][ps]
                    acc_w = b_pend[r][k] | b_pay[r][k][ps]
                    desc = ("drain", r, k, ps, v, fl[1] if fl else None)
                    tr = Trans(mpid, desc, None, fl[0]) if fl else Trans(mpid, desc, tuple(lst))
                    procs[mpid] = ((tr,), acc_r, acc_w, 0, ())
                else:
                    procs[mpid] = ((), 0, 0, 0, (pid,))
            # ---- consumer ---------------------------------------------------------------
            d = r
            pid = base + 2
            cpc = st[CPC + d]
            if cpc >= cdone:
                procs[pid] = ((), 0, 0, 0, nxt)
            else:
                item, phase = divmod(cpc, NPH)
                c, src = divmod(item, R)
                if ready_order and phase >= 1:
                    src = st[HLD + d]  # the source it holds, whichever rank that is
                s = c % S
                done_bit = b_done[pid] if cpc + 1 == cdone else 0
                if phase == 0 and not ready_order:
                    procs[pid] = self._acquire_step(st, d, pid, src, c, e, cpc)
                elif phase == 0:
                    # any source of chunk c not acknowledged yet, whichever is ready (several steps)
                    trans, acc_r, acc_w, groups = [], 0, 0, []
                    for src2 in range(R):
                        if (st[DNM + d] >> src2) & 1:
                            continue
                        tr, a_r, a_w, _, nes2 = self._acquire_step(st, d, pid, src2, c, e, cpc)
                        acc_r |= a_r
                        acc_w |= a_w
                        trans += tr
                        if not tr:
                            groups.append(nes2)
                    # disabled: for EVERY pending source one of its blocking producers must move
                    procs[pid] = (tuple(trans), acc_r, acc_w, 0, () if trans else ("all",) + tuple(groups))
                elif phase == 2:  # ack-before-copy: the copy's reads end after the acknowledgement
                    lst = list(st)
                    lst[CPC + d] = cpc + 1
                    if ready_order:
                        done = st[DNM + d] | (1 << src)
                        lst[DNM + d] = 0 if done == self.all_src else done  # chunk complete
                        lst[HLD + d] = -1
                    procs[pid] = ((Trans(pid, ("copied", d, src, c, s), tuple(lst)),), 0,
                                  b_pos[d][src][s] | done_bit, 0, ())
                else:  # ack
                    ai = ACK + src * S + s
                    m = st[ai]
                    bit = 1 << d
                    desc = ("ack", d, src, c, s, m, m | bit)
                    # (with ack-before-copy the slot stays held: the copy's reads are still running)
                    acc_w = (b_pos[d][src][s] if not self.ack_before_copy else 0) | done_bit
                    if m & bit and inject is P.Inject.NONE:
                        msg = (f"rank {d}: ack bit already set in rank {src}'s ack_mask[slot={s}] when "
                               f"acknowledging chunk {c} (double acknowledgement: Ring.ack raises)")
                        procs[pid] = ((Trans(pid, desc, None, Violation((PROP_PROTOCOL,), msg)),),
                                      0, acc_w, b_ack[src][s], ())
                    else:
                        lst = list(st)
                        lst[ai] = m | bit
                        lst[CPC + d] = cpc + 1
                        if ready_order and not self.ack_before_copy:
                            done = st[DNM + d] | (1 << src)
                            lst[DNM + d] = 0 if done == self.all_src else done  # chunk complete
                            lst[HLD + d] = -1
                        procs[pid] = ((Trans(pid, desc, tuple(lst)),), 0, acc_w, b_ack[src][s], ())
            # ---- ep layer: compute, its pending combine store, the owner's reduce ----------
            if ep:
                self._expand_ep(st, r, e, nxt, procs)
            # ---- end_stream (drain) -----------------------------------------------------
            pid = base + 5
            # (the rank has not ended here, so a role is done when its program counter is)
            unfinished = ()
            if st[PPC + 2 * r] < pdone:
                unfinished += (base,)
            if st[PPC + 2 * r + 1] < pdone:
                unfinished += (base + 1,)
            if cpc < cdone:
                unfinished += (base + 2,)
            if ep:
                unfinished += tuple(p for p in (self.CP[r], self.RP[r]) if not self.role_done(st, p))
            if unfinished:
                procs[pid] = ((), 0, 0, 0, unfinished)
            else:
                nes = ()
                for s in range(S):
                    lc = last_chunk[s]
                    m = st[ACK + r * S + s]
                    if lc >= 0 and st[COL + r * S + s] != gens[lc] and not self.mask_full(m):
                        nes = tuple(6 * b + 2 for b in self.missing_bits(m))
                        break
                if nes:
                    procs[pid] = ((), 0, 0, 0, nes)
                else:
                    lst = list(st)
                    for s in range(S):
                        lc = last_chunk[s]
                        if lc >= 0 and lst[COL + r * S + s] != gens[lc]:
                            lst[COL + r * S + s] = gens[lc]
                            lst[ACK + r * S + s] = 0
                    acc_r = b_done[base] | b_done[base + 1] | b_done[base + 2]
                    acc_w = self.b_ack_r[r] | self.b_col_r[r] | self.b_end[r]
                    if ep and e < self.E:
                        self._advance_epoch(lst, r)
                        acc_r |= b_done[self.CP[r]] | b_done[self.RP[r]]
                        acc_w |= (self.b_red_r[r] | self.b_arr_r[r] | self.b_pos_r[r]
                                  | sum(b_done[p] for p in self.roles_of[r]))
                    else:
                        lst[END + r] = 1
                    procs[pid] = ((Trans(pid, ("end", r, e), tuple(lst)),), acc_r, acc_w, 0, ())
        # ---- begin_stream of the next epoch (collective) ----------------------------------
        e = st[EP]
        if ep:  # each rank begins its next epoch at its end of epoch (above)
            procs[self.BEGIN] = ((), 0, 0, 0, ())
        elif all_ended and e < self.E:
            lst = list(st)
            for r in range(R):
                lst[EP + r] += 1
                lst[END + r] = 0
                lst[PPC + 2 * r] = lst[PPC + 2 * r + 1] = 0
                lst[CPC + r] = 0
                lst[HLD + r] = -1
                lst[DNM + r] = 0
            procs[self.BEGIN] = ((Trans(self.BEGIN, ("begin", e + 1), tuple(lst)),), 0, self.ALL, 0, ())
        elif all_ended:
            procs[self.BEGIN] = ((), 0, 0, 0, ())
        else:
            procs[self.BEGIN] = ((), 0, 0, 0, tuple(6 * r + 5 for r in range(R) if not st[END + r]))
        return procs

    def _advance_epoch(self, lst: list, r: int) -> None:
        """ep: rank ``r`` begins its next epoch on its own (``ring_advance_epoch``, no barrier).

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

    def _expand_ep(self, st: tuple, r: int, e: int, nxt: tuple, procs: list) -> None:
        """The ep layer's processes of rank ``r`` (epoch ``e``): compute, combine drain, reduce."""
        C, K = self.C, self.K
        d = r
        cp, cdp, rp = self.CP[d], self.CDP[d], self.RP[d]
        ents = self.entries[e][d]
        mask = st[self.CMP + d]
        cur = st[self.CCUR + d]
        full = self.full_cmp[e][d]
        # ---- compute of consumer d (its GEMM stream): one combine entry (owner, token, k) at a time,
        # in any order among the rows it has copied (blocks fill across chunks, complete in any order)
        if cur >= 0:
            src, c, k = ents[cur]
            cell = self._cell(src, c, k)
            ai = self.ARR + src * C + c
            bit = 1 << cur
            done_bit = self.b_done[cp] if (mask | bit) == full else 0
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
                procs[cp] = ((Trans(cp, desc, tuple(lst)),), self.b_cpend[d],
                             self.b_cpend[d] | self.b_cell[src][c][k] | done_bit, self.b_arr[src][c], ())
            elif ph == 1:  # signal-before-combine: the add, with the combine store still pending
                a0 = lst[ai]
                lst[ai] = a0 + 1
                if e < st[self.EP + src]:
                    lst[self.ARRO + src * C + c] += 1
                lst[self.CPH + d] = 2
                desc = ("cadd", d, src, c, k, a0, lst[self.CPS + d] >= 0)
                procs[cp] = ((Trans(cp, desc, tuple(lst)),), 0, 0, self.b_arr[src][c], ())
            else:  # signal-before-combine: the release, after the add
                flushed = self._cflush(lst, d)
                lst[self.CMP + d] = mask | bit
                lst[self.CCUR + d] = -1
                lst[self.CPH + d] = 0
                desc = ("cfence", d, src, c, k, flushed)
                procs[cp] = ((Trans(cp, desc, tuple(lst)),), self.b_cpend[d],
                             self.b_cpend[d] | self.b_cell[src][c][k] | done_bit, 0, ())
        else:
            trans, acc_r = [], self.b_cpend[d]
            for j, (src, c, k) in enumerate(ents):
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
                procs[cp] = (tuple(trans), acc_r, self.b_cpend[d], 0, ())
            elif mask == full:
                procs[cp] = ((), 0, 0, 0, nxt)
            else:
                procs[cp] = ((), 0, 0, 0, (6 * d + 2,))  # rows not copied yet: its consumer moves first
        # ---- early drain of the pending combine store (legal) ------------------------------
        cell = st[self.CPS + d]
        if self.cfg.early_drain and cell >= 0:
            lst = list(st)
            v = lst[self.CPV + d]
            self._cflush(lst, d)
            src, c, k = ents[st[self.CCUR + d]]  # (the store belongs to the entry in progress)
            procs[cdp] = ((Trans(cdp, ("cdrain", d, src, c, k, v), tuple(lst)),), self.b_cpend[d],
                          self.b_cpend[d] | self.b_cell[src][c][k], 0, ())
        else:
            procs[cdp] = ((), 0, 0, 0, (cp,))
        # ---- the owner's reduce of its chunks, in chunk order -----------------------------
        red = st[self.RED + r]
        if red >= C:
            procs[rp] = ((), 0, 0, 0, nxt)
            return
        c = red
        need = tuple(6 * r + k for k in (0, 1) if st[self.PPC + 2 * r + k] < (c + 1) * self.nsteps)
        if need:  # only after it published chunk c
            procs[rp] = ((), 0, 0, 0, need)
            return
        ai = self.ARR + r * C + c
        a, x = st[ai], self.expected[e][r][c]
        if a != x and not self.skip_arrival_wait:
            procs[rp] = ((), 0, 0, 0, self._arrival_blockers(st, r, c, e)[1])
            return
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
            procs[rp] = ((Trans(rp, desc, None, Violation(tuple(dict.fromkeys(props)), "; ".join(msgs))),),
                         acc_r, acc_w, 0, ())
            return
        lst = list(st)
        if not self.no_counter_reset:
            lst[ai] = 0  # (visible before any add of the next epoch: see the module docstring)
            lst[self.ARRO + r * C + c] = 0
        lst[self.RED + r] = c + 1
        lst[self.LRE + r * C + c] = e
        procs[rp] = ((Trans(rp, desc, tuple(lst)),), acc_r, acc_w, 0, ())

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
        if pid == self.BEGIN:
            # (ep: never moves; the cut with every process as a blocker keeps it out of the sets)
            return ((self.ALLP, 0, 0, 0),) if self.ep else ((0, 0, 0, 0),)
        if pid > self.BEGIN:
            return self._future_ep(st, pid)
        r, i = divmod(pid, 6)
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
            NPH = self.NPH
            for j in range(pc - (pc % (NPH * R)), self.cdone):
                item, phase = divmod(j, NPH)
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
            NPH = self.NPH
            for j in range(pc, self.cdone):
                item, phase = divmod(j, NPH)
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
            if self.ep:  # (ep: only of the slots it still writes in this epoch)
                later_r = later_w = self.b_pend[r][k]
                pc = st[self.PPC + 2 * r + k]
                for c in range(pc // self.nsteps, self.C if pc < self.pdone else 0):
                    later_r |= self.b_pos_rs[r][c % S]
                    later_w |= self.b_pay[r][k][c % S]
                return ((1 << (6 * r + k), aR, aW, 0), (0, aR | later_r, aW | later_w, 0))
            return ((1 << (6 * r + k), aR, aW, 0),
                    (0, aR | self.b_pend[r][k] | self.b_pos_r[r], aW | self.b_pend[r][k] | self.b_pay_rk[r][k], 0))
        # end of epoch: waits for the rank's roles, and for the missing ack bits of its last chunks
        # (ep: and for every process its roles need, _cross_blockers)
        roles = self.roles_of[r] if self.ep else (6 * r, 6 * r + 1, 6 * r + 2)
        bl = self._cross_blockers(st)[r] if self.ep else 0
        for p in roles:
            if not self.role_done(st, p):
                bl |= 1 << p
        for s in range(S):
            lc = self.last_chunk[s]
            if lc >= 0 and st[self.COL + r * S + s] != gens[lc]:
                for b in self.missing_bits(st[self.ACK + r * S + s]):
                    bl |= 1 << (6 * b + 2)
        aR = 0
        for p in roles:
            aR |= self.b_done[p]
        aW = self.b_ack_r[r] | self.b_col_r[r] | self.b_end[r]
        if self.ep and e < self.E:  # ... and begins the next epoch (_advance_epoch)
            aW |= self.b_red_r[r] | self.b_arr_r[r] | self.b_pos_r[r] | aR
        return ((bl, 0, 0, 0), (0, aR, aW, 0)) if bl else ((0, aR, aW, 0),)

    def _future_ep(self, st: tuple, pid: int):
        """:meth:`_future` of the ep layer's processes: compute, combine drain, reduce."""
        r = self.rank_of[pid]
        if st[self.END + r]:
            return ((0, 0, 0, 0),)
        e = st[self.EP + r]
        C = self.C
        d = r
        if pid == self.CP[d]:
            mask, cur = st[self.CMP + d], st[self.CCUR + d]
            aR = aW = aO = bR = bW = bO = 0  # now available / waiting for the consumer's copy
            blocked = False
            for j, (src, c, k) in enumerate(self.entries[e][d]):
                if (mask >> j) & 1:
                    continue
                cR = self.b_cpend[d] | self.b_cell[src][c][k] | self.b_cell_red[self._cell(src, c, k)]
                cW = self.b_cpend[d] | self.b_cell[src][c][k]
                if j == cur or self._copied(st, d, src, c):
                    aR, aW, aO = aR | cR, aW | cW, aO | self.b_arr[src][c]
                else:
                    blocked = True
                    bR, bW, bO = bR | cR, bW | cW, bO | self.b_arr[src][c]
            done = self.b_done[pid]
            if blocked:
                return ((1 << (6 * d + 2), aR, aW, aO), (0, aR | bR, aW | bW | done, aO | bO))
            return ((0, aR, aW | done, aO),)
        if pid == self.CDP[d]:
            aR = aW = 0
            if st[self.CPS + d] >= 0:
                src, c, k = self.entries[e][d][st[self.CCUR + d]]
                aR = aW = self.b_cpend[d] | self.b_cell[src][c][k]
            later = self.b_cpend[d]
            mask = st[self.CMP + d]
            for j, (src, c, k) in enumerate(self.entries[e][d]):
                if not (mask >> j) & 1:
                    later |= self.b_cell[src][c][k]
            # later drains need a later combine write of the compute first
            return ((1 << self.CP[d], aR, aW, 0), (0, aR | later, aW | later, 0))
        # the owner's reduce: per chunk, waits for its producers' publish and for arrived == expected
        segs, aR, aW = [], 0, 0
        for c in range(st[self.RED + r], C):
            bl = 0
            for k in (0, 1):
                if st[self.PPC + 2 * r + k] < (c + 1) * self.nsteps:
                    bl |= 1 << (6 * r + k)
            if not self.skip_arrival_wait:
                bl |= self._arrival_blockers(st, r, c, e)[0]
            if bl:
                segs.append((bl, aR, aW, 0))
            aR |= self.b_arr[r][c] | self.b_cells_rc[r][c]
            aW |= self.b_arr[r][c] | self.b_red[r][c]
        segs.append((0, aR, aW | self.b_done[pid], 0))
        return tuple(segs)

    def _cross_blockers(self, st: tuple) -> list[int]:
        """ep: per rank, processes each of which must move before that rank's end of epoch.

        Its own unfinished roles; every producer that has still to publish a chunk of this epoch
        to it, and every consumer that has still to acknowledge its last chunk of this epoch (its
        ack mask holds only that chunk's acks once the producer collected the previous lap's; of
        a rank behind it: all of them); every compute that must still add to one of its arrived
        counters for its reduce to pass."""
        if self._xb_cache[0] is st:
            return self._xb_cache[1]
        R, C, NPH = self.R, self.C, self.NPH
        out = []
        last_pub = self.last_pub
        for r in range(R):
            e = st[self.EP + r]
            bl = 0
            for p in self.roles_of[r]:
                if not self.role_done(st, p):
                    bl |= 1 << p
            for r2 in range(R):
                e2 = st[self.EP + r2]
                # (skip-ack-wait: acks of an earlier chunk of the slot, of this or of the previous
                # epoch, may still sit in the mask and fill it: no consumer is needed for certain)
                consumer_needed = not self.skip_ack_wait
                if e2 < e:
                    bl |= (1 << (6 * r2)) | (1 << (6 * r2 + 1)) | (consumer_needed << (6 * r2 + 2))
                elif e2 == e and r2 != r and not st[self.END + r2]:
                    for k in (0, 1):
                        # (skip-acquire: a consumer needs the payload, not the publish)
                        if st[self.PPC + 2 * r2 + k] <= last_pub[r] and not self.skip_acquire:
                            bl |= 1 << (6 * r2 + k)
                    if not consumer_needed:
                        continue
                    pc = st[self.CPC + r2]
                    if not self.ready_order:
                        acked = pc >= ((C - 1) * R + r) * NPH + 2
                    else:
                        cur = pc // (R * NPH)
                        acked = cur > C - 1 or (cur == C - 1 and (bool((st[self.DNM + r2] >> r) & 1)
                                                                  or st[self.HLD + r2] == r))
                    if not acked:
                        bl |= 1 << (6 * r2 + 2)
            # the computes whose adds its reduce waits for
            if not self.skip_arrival_wait and not st[self.END + r]:
                for c in range(st[self.RED + r], C):
                    bl |= self._arrival_blockers(st, r, c, e)[0]
            out.append(bl)
        self._xb_cache = (st, out)
        return out

    def stubborn(self, st: tuple, procs) -> list[Trans]:
        """Enabled steps of a stubborn set of processes (module docstring, reduction 2)."""
        NP = self.NP
        enabled = [p for p in range(NP) if procs[p][0]]
        if len(enabled) <= 1:
            return [t for p in enabled for t in procs[p][0]]
        # crossing into the next epoch needs every role done; a stopped unfinished role blocks it
        # (ep: each rank crosses on its own; its own blockers, _cross_blockers)
        ep = self.ep
        cross_bl = 0
        if ep:
            cross_r = self._cross_blockers(st)
            can_cross = [st[self.EP + r] < self.E for r in range(self.R)]
            rank_of = self.rank_of
            exact = self.exact_acquire
        else:
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
                            if ep:
                                rq = rank_of[q]
                                if can_cross[rq] and not (cross_r[rq] & T):
                                    # in its later epochs, nothing of an owner that cannot end this
                                    # epoch (a process it needs is in the set) and is not ahead
                                    nxt_ = self.ALL
                                    eq = st[self.EP + rq]
                                    for r2 in range(self.R if exact else 0):
                                        if r2 != rq and cross_r[r2] & T and st[self.EP + r2] <= eq:
                                            nxt_ &= ~self.b_owner[r2]
                                    fR, fW, fO = fR | nxt_, fW | nxt_, fO | nxt_
                            elif not last_epoch and not (cross_bl & T):
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
            text = f"r{dd}.consumer: ack src {src} chunk {c}: rank {src}'s ack_mask[slot {s}] {m0:#b} -> {m1:#b}"
            if self.ack_before_copy:
                text += " BEFORE its copy out of the slot completed [ack-before-copy]"
            elif self.ep:
                text += " (input_consumed: right after the copy)"
            return text
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
        if op == "end":
            _, r, e = d
            text = f"r{r}: end_stream epoch {e}: last chunk of every slot acknowledged (drained)"
            if self.ep and e < self.E:
                text += f"; begins epoch {e + 1} on its own (no barrier)"
            return text
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


def _choice(t: Trans):
    """Which of its enabled steps a process took: the source a ready-order consumer acquired, the
    combine entry an ep compute started; None for a process with one step at a time."""
    op = t.desc[0]
    if op == "acquire":
        return t.desc[2]
    if op == "cwrite":
        return t.desc[2:5]
    return None


def _replay(model: Model, moves: list, st: tuple | None = None):
    """Run the moves ``(pid, choice)`` in order (from ``st``, default the initial state); None if
    one cannot move.

    Returns ``(steps, end_state)``; a violation may only be the last step (then end_state is None).
    """
    st, steps = (model.initial() if st is None else st), []
    for i, (pid, choice) in enumerate(moves):
        t = next((t for t in model.expand(st)[pid][0] if _choice(t) == choice), None)
        if t is None:
            return None
        steps.append(t)
        if t.violation is not None:
            return (steps, None) if i == len(moves) - 1 else None
        st = t.state
    return steps, st


def _minimise(model: Model, steps: list[Trans], goal) -> list[Trans]:
    """Drop steps of a counter-example while ``goal(steps, end_state)`` still holds (1-minimal).

    Blocks of halving size, each pass from the end backwards (a step late in the path is often
    needed only by the steps after it), then single steps until no single step can be dropped."""
    moves = [(t.pid, _choice(t)) for t in steps]
    steps = list(steps)
    # states[i]: the state before moves[i] (a replay without moves[start:end] starts at states[start])
    states = [model.initial()] + [t.state for t in steps[:-1]]

    size = max(1, len(moves) // 2)
    while True:
        changed = False
        end = len(moves)
        while end > 0:
            start = max(0, end - size)
            rep = _replay(model, moves[end:], states[start])
            if rep is not None and goal(steps[:start] + rep[0], rep[1]):
                moves = moves[:start] + moves[end:]
                steps = steps[:start] + rep[0]
                states = states[:start + 1] + [t.state for t in rep[0][:-1]]
                changed = True
            end = start
        if size > 1:
            size //= 2
        elif not changed:
            break
    return steps


def run_serialised(model: Model) -> dict:
    """Property (6): per chunk every route producer, every layout producer, then every consumer.

    ep layer: then every consumer's compute of its entries of that chunk, then every owner's
    reduce of it; each rank ends its epoch (and begins the next) in rank order."""
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

    def computed(d, e, c):  # every entry of chunks <= c computed and signalled
        if st[model.CCUR + d] >= 0:
            return False
        mask = st[model.CMP + d]
        return all((mask >> j) & 1 for j, ent in enumerate(model.entries[e][d]) if ent[1] <= c)

    err = None
    for e in range(1, model.E + 1):
        for c in range(C):
            for k in (0, 1):
                for r in range(R):
                    err = err or run(6 * r + k, lambda r=r, k=k: st[model.PPC + 2 * r + k] >= (c + 1) * model.nsteps)
            for d in range(R):
                err = err or run(6 * d + 2, lambda d=d: st[model.CPC + d] >= (c + 1) * R * model.NPH)
            if model.ep:
                for d in range(R):
                    err = err or run(model.CP[d], lambda d=d, e=e, c=c: computed(d, e, c))
                for r in range(R):
                    err = err or step(model.RP[r])
        for r in range(R):
            err = err or step(6 * r + 5)
        if e < model.E and not model.ep:
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
    res = CheckResult(config={"layer": cfg.layer, "ranks": cfg.ranks, "slots": cfg.slots, "chunks": cfg.chunks,
                              "epochs": cfg.epochs, "inject": cfg.inject.value, "early_drain": cfg.early_drain,
                              "por": cfg.por, "source_order": cfg.source_order,
                              "max_states": cfg.max_states})
    if model.ep:
        res.config["topk"] = cfg.topk
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
    props = {p: NOT_CHECKED for p in model.properties}
    if not stopped and not (por and violations):
        # (the reduction preserves the existence of a violation, not every violation: with
        # violations found under it the other safety properties stay NOT CHECKED)
        for p in model.safety:
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
        bad, nfinal = cannot_reach_final(model, states, esrc, edst, terminals)
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


def cannot_reach_final(model: Model, states: list, esrc: array, edst: array,
                        terminals: list | None = None) -> tuple[int | None, int]:
    """Reverse reachability from the final states over the explored graph.

    Returns the first (BFS-shortest) state that cannot reach a final state (None if every
    state can) and the number of final states. ``terminals``: the ids of the states without a
    successor, where the final states are (nothing moves once every rank ended its last epoch);
    None: look at every state. (numpy: the edges grouped by destination, then one
    vectorised step per BFS level; the set reached does not depend on the order of the search.)
    """
    import numpy as np

    n = len(states)
    src = np.array(esrc, dtype=np.int64)
    dst = np.array(edst, dtype=np.int64)
    order = np.argsort(dst, kind="stable")
    rev = src[order]  # the predecessors of each state, grouped by state
    start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=start[1:])
    seen = np.zeros(n, dtype=bool)
    frontier = np.fromiter((i for i in (range(n) if terminals is None else terminals) if model.is_final(states[i])),
                           dtype=np.int64)
    nfinal = len(frontier)
    seen[frontier] = True
    while len(frontier):
        lo, hi = start[frontier], start[frontier + 1]
        counts = hi - lo
        total = int(counts.sum())
        if total == 0:
            break
        # every index in [lo, hi) of every frontier state, in one array
        offs = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        pred = rev[np.repeat(lo, counts) + offs]
        pred = np.unique(pred[~seen[pred]])
        seen[pred] = True
        frontier = pred
    missing = np.flatnonzero(~seen)
    return (int(missing[0]) if len(missing) else None), nfinal


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
    layer = "" if c.get("layer", "ring") == "ring" else f"layer=ep (topk {c['topk']}), "
    return [
        f"streamring model-check: {c['ranks']} ranks x {c['slots']} slots x {c['chunks']} chunks x "
        f"{c['epochs']} epochs, {layer}inject={c['inject']}",
        f"explored {res.states} states, {res.transitions} transitions in {res.time_s:.2f}s ({kind})",
        f"reduction: {res.reduction}",
    ]


def print_properties(out, column, properties: dict, meaning: dict) -> None:
    """The properties table of a check (``out``: a :class:`~streamring.host.report.Report`; ``column``: its
    :class:`~streamring.host.report.Column`)."""
    from rich.text import Text

    rows = []
    for p, v in properties.items():
        style = "green" if v == "PASS" else ("red" if v == "FAIL" else "yellow")
        rows.append([p, meaning[p], Text(v, style=style)])
    out.table("properties", [column("property", justify="left"), column("meaning", justify="left", wrap=True),
                             column("result", justify="left")], rows)


def print_counterexample(out, ce: dict, how: str) -> None:
    """A counter-example's message and the last TRACE_PRINT_MAX steps of its trace (``how`` it was found)."""
    out.line(f"counter-example [{', '.join(ce['properties'])}]: {ce['message']}")
    out.line(f"  {how}, {ce['steps']} steps:")
    trace = ce["trace"]
    first = max(0, len(trace) - TRACE_PRINT_MAX)
    if first:
        out.line(f"  ... {first} earlier steps not shown (all in --json)")
    for i, line in enumerate(trace[first:], start=first + 1):
        out.line(f"  {i:3d}. {line}")


def print_verdict(out, res: CheckResult) -> None:
    out.line(f"PASS: every property holds ({len(res.properties)} checked in {res.states} states)" if res.ok else
             f"FAIL: {', '.join(p for p, v in res.properties.items() if v == 'FAIL') or 'the check'} failed")


def print_result(res: CheckResult, report) -> None:
    """Print ``res`` (``report``: :mod:`streamring.host.report`, handed in by the CLI)."""
    out = report.Report()
    for line in summary_lines(res):
        out.line(line)
    print_properties(out, report.Column, res.properties, PROPERTY_TEXT)
    ce = res.counterexample
    if ce:
        print_counterexample(out, ce, "shortest path (BFS)" if not res.config["por"] else
                             "path in the reduced graph, then shortened until no single step can be dropped")
    ser = res.serialised
    if ser and ser["result"] != "PASS":
        out.line(f"serialised schedule: {ser['error']}")
        for line in ser["trace_tail"]:
            out.line(f"    {line}")
    print_verdict(out, res)


def model_check_main(args, report) -> int:
    """Entry point of ``streamring model-check``: 0 iff every property holds. ``report``:
    :mod:`streamring.host.report`, which prints the tables (the CLI hands it in: this package sits below
    host in the layering)."""
    try:
        inject = parse_inject(getattr(args, "inject", None))
        por = getattr(args, "por", None)
        env = os.environ.get("STREAMRING_MODEL_POR", "auto").strip().lower()
        if por is None and env in ("0", "1", "off", "on"):
            por = env in ("1", "on")
        cfg = ModelConfig(ranks=args.ranks, slots=args.slots, chunks=args.chunks, epochs=args.epochs,
                          inject=inject, por=por, max_states=getattr(args, "max_states", None),
                          source_order=getattr(args, "source_order", "rank") or "rank",
                          layer=getattr(args, "layer", "ring") or "ring")
        topk = getattr(args, "topk", None)
        if topk is not None:
            if cfg.layer != "ep":
                raise ValueError("--topk routes the combine entries of the ep layer: it needs --layer ep")
            cfg.topk = topk
        cfg.validate()
    except ValueError as exc:
        print(f"streamring model-check: {exc}", file=sys.stderr)
        return 2
    res = check(cfg)
    print_result(res, report)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(res.to_dict(), indent=2))
    return 0 if res.ok else 1
