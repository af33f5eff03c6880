"""The search: breadth-first exploration of a model's states, its partial-order reduction, the
serialised schedule, and the counter-examples it reports.

``streamring model-check`` explores every interleaving of the protocol steps of
:mod:`streamring.ring.protocol` (the 8-step argument of its module docstring) for a small
configuration (default 2 ranks x 2 slots x 3 chunks x 2 epochs) by breadth-first search over
hashable states with a visited set, and checks the properties of :mod:`streamring.verify.state`.

Partial-order reduction (stubborn sets; sound for these properties)
===================================================================
From each state only a stubborn set of processes is expanded: the closure, from one enabled
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

The look-ahead of each process (what it may access until it must wait) is the model's
(``_future``, ``_beyond_epoch``): :mod:`streamring.verify.lookahead` for the ring's processes,
:mod:`streamring.verify.ep_lookahead` for the ep layer's.

Counter-examples
================
The search stops at the first violation and prints the shortest counter-example
from the initial state (BFS parents); under the reduction that path is then
shortened (replayed without blocks of steps, of halving size from the end
backwards, while it still ends in the same violation) until no single step can
be dropped.
"""

from __future__ import annotations

import os
import sys
import time
from array import array
from dataclasses import dataclass, field
from itertools import repeat

from .codec import DecodedStates, FieldOverflow, StateCodec
from .ep import EPModel
from .memo import ExpansionMemo
from .report import NOT_CHECKED, CheckResult, finish, print_result
from .state import PROP_DEADLOCK, PROP_SERIAL, ModelConfig, Trans, parse_inject
from .steps import RingModel

MODELS = {RingModel.LAYER: RingModel, EPModel.LAYER: EPModel}


def make_model(cfg: ModelConfig) -> RingModel:
    """The model of ``cfg.layer``."""
    cfg.validate()
    return MODELS[cfg.layer](cfg)


def stubborn(model: RingModel, st: tuple, procs) -> list:
    """Enabled steps of a stubborn set of processes (module docstring): of the sets grown from each
    enabled process, one with the fewest enabled members (the first found, stopping at one)."""
    enabled = [p for p in range(model.NP) if procs[p][0]]
    if len(enabled) <= 1:
        return [t for p in enabled for t in procs[p][0]]
    look = _Lookahead(model, st, procs)
    best_n, best_T = model.NP + 1, 0
    for seed in enabled:
        grown = _grow(look, seed, best_n)
        if grown is not None:
            best_n, best_T = grown
            if best_n == 1:
                break
    return [t for p in enabled if (best_T >> p) & 1 for t in procs[p][0]]


class _Lookahead:
    """What the growth of stubborn sets asks about one state, each computed once across its seeds:
    each process's look-ahead (``model._future``) and the union of its cuts' blockers, what an
    outside process may touch in later epochs (``beyond``, the model's ``_beyond_epoch``; None:
    nothing crosses), and per process ``p`` the processes whose whole look-ahead within the epoch
    its next step conflicts with (:meth:`reach`). Each look-ahead entry holds every access before
    its cut, so the last one holds them all: a process outside the reach of ``p`` conflicts with it
    only through what it may touch in a later epoch, which it reaches only past every cut."""

    def __init__(self, model: RingModel, st: tuple, procs):
        self.model, self.st, self.procs = model, st, procs
        self.beyond = model._beyond_epoch(st)
        self.futs = [None] * model.NP
        self.blockers = [0] * model.NP  # per process: the union of its cuts' blockers
        self._lasts = None  # per process: its last look-ahead entry
        self._reach = [None] * model.NP

    def future(self, q: int) -> tuple:
        """``model._future`` of process ``q`` in this state."""
        fu = self.futs[q]
        if fu is None:
            fu = self.futs[q] = self.model._future(self.st, q)
            for bl, _, _, _ in fu:
                self.blockers[q] |= bl
        return fu

    def reach(self, p: int) -> int:
        """The pid mask of the processes ``q`` whose last look-ahead entry conflicts with ``p``'s
        next step (every process's look-ahead is known from then on)."""
        got = self._reach[p]
        if got is None:
            if self._lasts is None:
                self._lasts = [self.future(q)[-1] for q in range(len(self.futs))]
            _, aR, aW, aO, _ = self.procs[p]
            aRO, got, bit = aR | aO, 0, 1
            for _, fR, fW, fO in self._lasts:
                if (aW & (fR | fW | fO)) or (fW & aRO) or (aR & fO) or (aO & fR):
                    got |= bit
                bit <<= 1
            self._reach[p] = got
        return got


def _grow(look: _Lookahead, seed: int, bound: int):
    """The closure of ``{seed}`` under (D1) and (D2) (module docstring) in the state of ``look``.

    Returns ``(enabled members, pid mask)``, or None as soon as the set holds ``bound`` enabled
    processes (a set that small is known already). The processes outside the set are checked in
    pid order, each against the set as it stands (a larger set cuts its look-ahead earlier)."""
    procs, futs, blockers, beyond = look.procs, look.futs, look.blockers, look.beyond
    every = (1 << len(procs)) - 1
    T = 1 << seed
    work = [seed]
    n_en = 1
    while work:
        p = work.pop()
        trans, aR, aW, aO, nes = procs[p]
        if trans and (aR | aW | aO):  # (a step that accesses nothing conflicts with nothing)
            aRO, reach = aR | aO, look.reach(p)
            scan = (every if beyond is not None else reach) & ~T
            while scan:
                low = scan & -scan
                scan ^= low
                q = low.bit_length() - 1
                fu = futs[q]
                if not low & reach:  # only what q may touch once past every cut, in a later epoch
                    later = 0 if blockers[q] & T else beyond(q, T)
                    if not later:
                        continue
                    _, fR, fW, fO = fu[-1]
                    fR, fW, fO = fR | later, fW | later, fO | later
                else:
                    for bl, fR, fW, fO in fu:
                        if bl & T:
                            break
                    else:
                        later = beyond(q, T) if beyond is not None else 0
                        if later:
                            fR, fW, fO = fR | later, fW | later, fO | later
                if (aW & (fR | fW | fO)) or (fW & aRO) or (aR & fO) or (aO & fR):
                    T |= low
                    work.append(q)
                    if procs[q][0]:
                        n_en += 1
        elif not trans and nes:
            T, added = _add_enablers(procs, nes, T, work)
            n_en += added
        if n_en >= bound:
            return None
    return n_en, T


def _add_enablers(procs, nes: tuple, T: int, work: list) -> tuple[int, int]:
    """(D2) for a disabled process with necessary enabling set ``nes``: ``("all", g1, g2, ...)``,
    one process of EVERY group (a ready-order consumer waits for any of several sources); else one
    process of ``nes``; each time one already in the set ``T`` if any, else the group's first.
    Returns the grown set and how many enabled processes joined it (they are pushed on ``work``)."""
    added = 0
    for grp in (nes[1:] if nes[0] == "all" else (nes,)):
        if not any((T >> q) & 1 for q in grp):
            q = grp[0]
            T |= 1 << q
            work.append(q)
            if procs[q][0]:
                added += 1
    return T, added


def _path(model: RingModel, states: list, parent: array, sid: int) -> list[Trans]:
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


def _replay(model: RingModel, moves: list, st: tuple | None = None):
    """Run the moves ``(pid, choice)`` in order (from ``st``, default the initial state); None if
    one cannot move.

    Returns ``(steps, end_state)``; a violation may only be the last step (then end_state is None).
    """
    st, steps = (model.initial() if st is None else st), []
    for i, (pid, choice) in enumerate(moves):
        t = next((t for t in model.expand_process(st, pid)[0] if _choice(t) == choice), None)
        if t is None:
            return None
        steps.append(t)
        if t.violation is not None:
            return (steps, None) if i == len(moves) - 1 else None
        st = t.state
    return steps, st


def _minimise(model: RingModel, steps: list[Trans], goal) -> list[Trans]:
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

def run_serialised(model: RingModel) -> dict:
    """Property (6): the model's serialised schedule (:meth:`RingModel.serial_schedule`) from the
    initial state, one deterministic path, no reduction."""
    st = model.initial()
    trace: list[str] = []

    def step(pid) -> str | None:
        nonlocal st
        for t in model.expand_process(st, pid)[0]:
            trace.append(model.label(t))
            if t.violation is not None:
                return f"{', '.join(t.violation.properties)}: {t.violation.message}"
            st = t.state
            return None
        return f"stuck: process {pid} has no enabled step"

    err = None
    for pid, done in model.serial_schedule():
        if done is None:
            err = step(pid)
        else:
            while not err and not done(st):
                err = step(pid)
        if err:
            break
    if not err and not model.is_final(st):
        err = "the serialised schedule ended in a non-final state"
    return {"result": "PASS" if not err else "FAIL", "steps": len(trace), "error": err,
            "trace_tail": trace[-10:] if err else []}


@dataclass
class Explored:
    """What a breadth-first search explored: states by id (encoded by ``codec``; :attr:`states`
    reads them as the model's tuples), their BFS parents, every edge."""

    codes: list
    codec: StateCodec
    parent: array
    esrc: array = field(default_factory=lambda: array("l"))
    edst: array = field(default_factory=lambda: array("l"))
    transitions: int = 0
    terminals: list = field(default_factory=list)  # ids of the states without a successor
    deadlocks: list = field(default_factory=list)  # ... of those, the non-final ones
    violation: tuple | None = None  # (parent id, Trans): the first violating step (stop_at_first)
    violations: list = field(default_factory=list)  # every violating step (stop_at_first=False)
    bounded: bool = False  # stopped at cfg.max_states

    @property
    def states(self) -> DecodedStates:
        return DecodedStates(self.codec, self.codes)


def explore(model: RingModel, cfg: ModelConfig, progress=None) -> Explored:
    """Breadth-first search from the initial state (stops at the first violation or deadlock unless
    ``cfg.stop_at_first`` is False; violations are terminal). The states are encoded
    (:mod:`streamring.verify.codec`) and their steps come from the model's expansion memoised per
    process (:class:`streamring.verify.memo.ExpansionMemo`): 8 bits a field, or, once a field takes
    more than 256 values, the search starts over with 16."""
    try:
        return _explore(model, cfg, progress, ExpansionMemo(model, bits=8))
    except FieldOverflow:
        return _explore(model, cfg, progress, ExpansionMemo(model, bits=16))


def _explore(model: RingModel, cfg: ModelConfig, progress, memo: ExpansionMemo) -> Explored:
    """:func:`explore` with the states encoded by ``memo.codec``."""
    t0 = time.perf_counter()
    codec, expand = memo.codec, memo.expand
    init = codec.encode(model.initial())
    ids = {init: 0}
    g = Explored(codes=[init], codec=codec, parent=array("l", [-1]))
    codes, parent, esrc, edst = g.codes, g.parent, g.esrc, g.edst
    is_final, known = model.is_final, ids.setdefault
    ntrans = 0
    por = cfg.por
    sid, n = -1, 1  # the state being expanded; the number of states found
    # (ids are given in the order states are found, so the BFS queue is the ids in order)
    while sid + 1 < n:
        sid += 1
        x = codes[sid]
        procs = expand(x)
        steps = stubborn(model, codec.decode(x), procs) if por else [t for p in procs for t in p[0]]
        if not steps:
            g.terminals.append(sid)
            if not is_final(codec.decode(x)):
                g.deadlocks.append(sid)
                if cfg.stop_at_first:
                    break
            continue
        ntrans += len(steps)
        edges = len(edst)
        for t in steps:
            if t.violation is not None:
                if cfg.stop_at_first:
                    g.violation = (sid, t.trans())
                    ntrans -= len(steps) - 1 - steps.index(t)  # (the steps after it are not taken)
                    break
                g.violations.append((sid, t.trans()))
                continue
            ns = (x & t.keep) | t.put  # (Step.apply, inlined on the hot path)
            nid = known(ns, n)  # (one hash of the state: its id, or n for a new one)
            if nid == n:
                codes.append(ns)
                parent.append(sid)
                n += 1
            edst.append(nid)
        esrc.extend(repeat(sid, len(edst) - edges))
        if g.violation:
            break
        if cfg.max_states is not None and n >= cfg.max_states:
            g.bounded = True
            break
        if progress is not None and sid and sid % 50000 == 0:
            progress(n, ntrans, time.perf_counter() - t0)
    g.transitions = ntrans
    if g.violation is None and g.violations:
        g.violation = g.violations[0]
    return g


def check(cfg: ModelConfig, progress=None) -> CheckResult:
    """Explore the model of ``cfg`` breadth-first (stops at the first violation unless told not to)."""
    model = make_model(cfg)
    res = CheckResult(config={"layer": cfg.layer, "ranks": cfg.ranks, "slots": cfg.slots, "chunks": cfg.chunks,
                              "epochs": cfg.epochs, "inject": cfg.inject.value, "early_drain": cfg.early_drain,
                              "por": cfg.por, "source_order": cfg.source_order,
                              "max_states": cfg.max_states})
    res.config.update(model.result_config())
    por = cfg.por
    res.reduction = ("reads folded into the hold window; stubborn-set partial-order reduction "
                     "(keeps a violation if one is reachable, every deadlock and the final state)" if por else
                     "reads folded into the hold window; every interleaving (no partial-order reduction)")
    t0 = time.perf_counter()
    g = explore(model, cfg, progress)
    states, violations = g.states, g.violations
    res.states, res.transitions, res.terminal_states = len(states), g.transitions, len(g.terminals)
    res.violations_found = len(violations) if violations else (1 if g.violation else 0)
    sources = {s: states[s] for s in {s for s, _ in violations}}  # (decoded once per state)
    res._violation_set = {(sources[s], t.desc) for s, t in violations}  # for cross-checks
    stopped = cfg.stop_at_first and (g.violation is not None or g.deadlocks)
    res.exhaustive = not g.bounded and not stopped
    props = {p: NOT_CHECKED for p in model.properties}
    if not stopped and not (por and violations):
        # (the reduction preserves the existence of a violation, not every violation: with
        # violations found under it the other safety properties stay NOT CHECKED)
        for p in model.safety:
            props[p] = "PASS" if not g.bounded else f"PASS up to {cfg.max_states} states (BOUNDED, not a proof)"
    if g.violation is not None:
        res.counterexample = _violation_trace(model, g, props, por)
    _deadlock_verdict(model, cfg, g, res, props, stopped)
    res.time_s = time.perf_counter() - t0
    ser = run_serialised(model)
    res.serialised = ser
    props[PROP_SERIAL] = ser["result"]
    res.properties = props
    res._terminal_set = {states[i] for i in g.terminals}
    return res


def _violation_trace(model: RingModel, g: Explored, props: dict, por: bool) -> dict:
    """The counter-example of the first violation (marks every violated property FAIL in ``props``)."""
    sid, t = g.violation
    steps = _path(model, g.states, g.parent, sid) + [t]
    if por:  # the reduced graph's shortest path may carry steps that play no part
        prop = t.violation.properties[0]
        steps = _minimise(model, steps, lambda ss, end: bool(ss) and ss[-1].violation is not None
                          and ss[-1].violation.properties[0] == prop)
        t = steps[-1]
    trace = [model.label(x) for x in steps[:-1]] + [model.label(t) + "   <-- VIOLATION"]
    for v in g.violations or [g.violation]:
        for p in v[1].violation.properties:
            props[p] = "FAIL"
    return {"properties": list(t.violation.properties), "message": t.violation.message,
            "steps": len(trace), "trace": trace}


def _deadlock_verdict(model: RingModel, cfg: ModelConfig, g: Explored, res: CheckResult, props: dict,
                      stopped: bool) -> None:
    """Property (5): a deadlock found, or reverse reachability of the final state over the graph."""
    states, parent = g.states, g.parent
    if g.deadlocks:
        props[PROP_DEADLOCK] = "FAIL"
        if res.counterexample is None:
            steps = _path(model, states, parent, g.deadlocks[0])
            if cfg.por:
                steps = _minimise(model, steps, lambda ss, end: end is not None and not model.successors(end)
                                  and not model.is_final(end))
            trace = [model.label(x) for x in steps]
            res.counterexample = {"properties": [PROP_DEADLOCK], "steps": len(trace), "trace": trace,
                                  "message": "deadlock: a reachable non-final state where no process can move"}
    elif not stopped and not g.bounded:
        bad, nfinal = cannot_reach_final(model, states, g.esrc, g.edst, g.terminals)
        res.final_reachable = nfinal > 0
        if bad is None:
            props[PROP_DEADLOCK] = "PASS"
        elif g.violations and props[PROP_DEADLOCK] == NOT_CHECKED:
            pass  # the states that lead only to violations cannot reach the final state
        else:
            props[PROP_DEADLOCK] = "FAIL"
            trace = [model.label(x) for x in _path(model, states, parent, bad)]
            res.counterexample = res.counterexample or {
                "properties": [PROP_DEADLOCK], "steps": len(trace), "trace": trace,
                "message": "from the last state of this trace the final state is unreachable"}
    elif g.bounded:
        props[PROP_DEADLOCK] = "NOT CHECKED (bounded search)"


def cannot_reach_final(model: RingModel, states: list, esrc: array, edst: array,
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
    return finish(check(cfg), print_result, report, getattr(args, "json", None))
