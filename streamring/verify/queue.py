"""Exhaustive model check of the persistent consumer's work-queue handoffs (``--layer queue``).

``streamring model-check --layer queue`` explores every interleaving (breadth-first over hashable
states with a visited set) of the processes of one forward on one PE:

* **dispatch**: per chunk ``s``: ``copy s`` (the chunk's rows into their blocks: the dispatch copy),
  then ``publish s`` (the ready word := number of full blocks, release: ``WorkQueue.publish``); at the
  end ``seal`` (every block ready, SEALED set: ``WorkQueue.seal``). Rows are appended to blocks of
  ``block_rows`` rows in order, chunk after chunk (RFC option 2: blocks fill across chunks), the last
  block partial: it becomes ready only at the seal.
* **CTA** ``i`` of the persistent grid (``--ctas``), the kernel's loop: ``claim`` (the claim counter's
  fetch-add; ``t >= total_items(cap)`` ends the CTA), ``wait ready`` (enabled once the position is
  ready or the queue sealed; then: sealed and ``t >= total_items(final)`` ends it, a position past the
  final count is a no-op), an L1 item: ``L1 store`` (reads the block's rows, writes its h1 tile) then
  ``L1 release`` (``l1_done += 1``); an L2 item: ``wait L1`` (enabled once ``l1_done == nt1``),
  ``L2 compute`` (reads the block's h1), ``L2 store`` (its columns of the block's rows into the owner),
  ``L2 done`` (``l2_done += 1``; the add that returns ``nt2 - 1`` is the block's last tile) and, for
  the last tile, one ``signal`` per chunk with rows in the block (``arrived[chunk] += rows``, release).
  The item order is ``streamring.device.queue_order.item_of`` itself, the function the kernel mirrors.
* **owner**: per chunk ``c`` in order, once ``arrived[c] == expected[c]`` (acquire), reads every row of
  the chunk (``ep_wait_arrivals`` then ``combine_owner``).

Properties:

``no-compute-on-unready-block``  an L1 item reads its block's rows only after the dispatch copied them;
``no-l2-before-its-l1``          an L2 item reads its block's h1 only after every L1 tile stored it;
``no-owner-read-before-store``   the owner reads a chunk's rows only after every L2 tile stored them;
``no-arrival-above-expected``    no signal takes ``arrived[c]`` above the chunk's routed rows;
``all-items-done``               in every final state each block's L1 and L2 tiles ran exactly once
                                 (``l1_done == nt1``, ``l2_done == nt2``, every h1 and result tile stored);
``no-deadlock``                  every reachable state can reach a final state (dispatch sealed, every
                                 CTA ended, the owner reduced every chunk).

Memory: the handoff words are atomics with release/acquire semantics and the data stores are
modelled sequentially consistent at their step; what makes that sound on the GPU (every thread's
fence, the barrier, then one thread's release; the acquire, then the barrier before the loads) is
checked in the generated PTX (``tests/helpers/ptx_queue.py``). Deadlines are left out: a wait that can never
be satisfied is a deadlock here (on the device it is a recorded timeout).

Mutations (``--inject``; each must give a counter-example): ``claim-before-ready`` (no ready wait:
the word is read once, an unready position is computed anyway), ``l2-before-l1`` (no wait for
``l1_done``), ``arrival-before-store`` (``L2 done`` and the last tile's signals come before the
tile's store).

The CLI's default sizes (2 CTAs, 3 blocks of 2 rows over 3 chunks, 2 N-tiles per layer, groups of
2) take 9,646 states (0.4 s), every interleaving; 3 CTAs take 443,966 states (6 s). The
counter-examples are shortest paths (BFS): 3 steps (claim-before-ready), 36 (l2-before-l1), 49
(arrival-before-store). No partial-order reduction: none is needed at these sizes.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass

from ..device.queue_order import L1, item_of, total_items
from .names import QUEUE_INJECT_MODES
from .report import NOT_CHECKED, CheckResult, finish, print_counterexample, print_properties, print_verdict
from .search import cannot_reach_final
from .state import PROP_DEADLOCK, Violation


PROP_READY = "no-compute-on-unready-block"
PROP_L1 = "no-l2-before-its-l1"
PROP_OWNER = "no-owner-read-before-store"
PROP_COUNT = "no-arrival-above-expected"
PROP_DONE = "all-items-done"
QUEUE_PROPERTIES = (PROP_READY, PROP_L1, PROP_OWNER, PROP_COUNT, PROP_DONE, PROP_DEADLOCK)
QUEUE_PROPERTY_TEXT = {
    PROP_READY: "an L1 item reads its block's rows only after the dispatch copied them",
    PROP_L1: "an L2 item reads its block's h1 only after all its L1 tiles stored it",
    PROP_OWNER: "the owner reads a chunk's rows only after every L2 tile stored them",
    PROP_COUNT: "no arrival signal takes arrived[c] above the chunk's routed rows",
    PROP_DONE: "in every final state every L1 and L2 tile ran exactly once",
    PROP_DEADLOCK: "every reachable state can reach a final state",
}

# CTA program counters
CLAIM, WAIT, L1_STORE, L1_REL, WAIT_L1, L2_COMP, L2_STORE, L2_DONE, SIGNAL, EXIT = range(10)


@dataclass
class QueueConfig:
    ctas: int = 2
    blocks: int = 3
    block_rows: int = 2
    chunks: int = 3  # as the CLI's --chunks default
    tiles: int = 2  # N-tiles of L1 and of L2
    group: int = 2
    inject: str = "none"

    def validate(self) -> None:
        problems = []
        for name in ("ctas", "blocks", "block_rows", "chunks", "tiles", "group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.inject not in ("none",) + QUEUE_INJECT_MODES:
            problems.append(f"--inject must be one of {('none',) + QUEUE_INJECT_MODES} with --layer queue, "
                            f"got {self.inject!r}")
        if not problems:
            rows = (self.blocks - 1) * self.block_rows + 1
            if self.chunks > rows:
                problems.append(f"--chunks ({self.chunks}) must be at most the rows ({rows} = (blocks - 1) x "
                                f"block rows + 1 partial): every chunk carries a row")
        if problems:
            raise ValueError("; ".join(problems))


class QueueModel:
    """The transition system (see the module docstring). A state is a flat tuple::

        (dispatch pc, claim counter, ready count, sealed, owner pc,
         per CTA (pc, t, aux), l1_done[B], l2_done[B], h1 tile mask[B], stored tile mask[B], arrived[C])
    """

    def __init__(self, cfg: QueueConfig):
        cfg.validate()
        self.cfg = cfg
        B, M, C, N = cfg.blocks, cfg.block_rows, cfg.chunks, cfg.ctas
        self.B, self.C, self.N, self.NT = B, C, N, cfg.tiles
        rows = (B - 1) * M + 1
        self.chunk_of = [j * C // rows for j in range(rows)]  # rows split over the chunks in order
        self.block_rows = [[j for j in range(rows) if j // M == b] for b in range(B)]
        # (chunk, rows) runs of each block: what its last L2 tile signals
        self.runs = [[(c, sum(1 for j in self.block_rows[b] if self.chunk_of[j] == c)) for c in range(C)
                      if any(self.chunk_of[j] == c for j in self.block_rows[b])] for b in range(B)]
        self.last_chunk = [max(self.chunk_of[j] for j in self.block_rows[b]) for b in range(B)]
        self.expected = [sum(1 for j in range(rows) if self.chunk_of[j] == c) for c in range(C)]
        self.full = [len(self.block_rows[b]) == M for b in range(B)]
        # publish s: full blocks whose rows are all copied after chunk s (blocks fill in order)
        self.ready_after = [sum(1 for b in range(B) if self.full[b] and self.last_chunk[b] <= s) for s in range(C)]
        self.cap = B  # the ready list's capacity
        self.total_cap = total_items(self.cap, self.NT, self.NT, cfg.group)
        self.mask = (1 << self.NT) - 1
        self.O_CTA = 5
        self.O_L1 = self.O_CTA + 3 * N
        self.O_L2 = self.O_L1 + B
        self.O_H1 = self.O_L2 + B
        self.O_Y = self.O_H1 + B
        self.O_ARR = self.O_Y + B
        self.skip_ready = cfg.inject == "claim-before-ready"
        self.skip_l1 = cfg.inject == "l2-before-l1"
        self.arrival_first = cfg.inject == "arrival-before-store"

    def initial(self) -> tuple:
        return (0, 0, 0, 0, 0) + (CLAIM, 0, 0) * self.N + (0,) * (4 * self.B + self.C)

    def is_final(self, st) -> bool:
        return (st[0] == 2 * self.C + 1 and st[4] == self.C
                and all(st[self.O_CTA + 3 * i] == EXIT for i in range(self.N)))

    def item(self, t):
        return item_of(t, self.NT, self.NT, self.cfg.group)

    # -- steps ------------------------------------------------------------------------------------------
    def successors(self, st):
        """``[(label, next state or None, Violation or None)]`` of every enabled step."""
        out = []
        C, B = self.C, self.B
        s = list(st)
        # dispatch
        dpc = st[0]
        if dpc < 2 * C:
            c = dpc // 2
            n = list(s)
            n[0] = dpc + 1
            if dpc % 2 == 0:
                out.append((("copy", c), tuple(n), None))
            else:
                n[2] = max(n[2], self.ready_after[c])
                out.append((("publish", c, n[2]), tuple(n), None))
        elif dpc == 2 * C:
            n = list(s)
            n[0], n[2], n[3] = dpc + 1, B, 1
            out.append((("seal", B), tuple(n), None))
        # owner
        opc = st[4]
        if opc < C and st[self.O_ARR + opc] == self.expected[opc]:
            n = list(s)
            n[4] = opc + 1
            bad = [b for b, runs in enumerate(self.runs) if any(c == opc for c, _ in runs)
                   and st[self.O_Y + b] != self.mask]
            v = None
            if bad:
                v = Violation((PROP_OWNER,), f"the owner reads chunk {opc}'s rows after arrived[{opc}] == "
                                             f"{self.expected[opc]}, but block {bad[0]}'s result tiles "
                                             f"{self._tiles(self.mask & ~st[self.O_Y + bad[0]])} are not stored yet")
            out.append((("reduce", opc), tuple(n), v))
        for i in range(self.N):
            out.extend(self._cta(st, i))
        return out

    @staticmethod
    def _tiles(mask):
        return [k for k in range(mask.bit_length()) if mask >> k & 1]

    def _cta(self, st, i):
        """CTA ``i``'s next step in the kernel's loop, ``[(label, next state, Violation or None)]``;
        ``[]`` while it waits or once it exited."""
        o = self.O_CTA + 3 * i
        pc = st[o]
        if pc == EXIT:
            return []
        if pc <= WAIT:
            return self._cta_claim(st, i, o, pc)
        if pc <= L1_REL:
            return self._cta_l1(st, i, o, pc)
        return self._cta_l2(st, i, o, pc)

    @staticmethod
    def _move(n: list, o: int, pc: int, t: int, aux: int = 0) -> tuple:
        """The state ``n`` with the CTA whose registers start at ``o`` set to ``(pc, t, aux)``."""
        n[o], n[o + 1], n[o + 2] = pc, t, aux
        return tuple(n)

    def _cta_claim(self, st, i, o, pc):
        """``claim`` (the claim counter's fetch-add; past ``total_items(cap)`` the CTA ends) and ``wait
        ready`` (enabled once the claimed position is ready or the queue sealed; then the CTA ends past
        the final count of items, skips a position past the final ready count, or runs the item)."""
        t = st[o + 1]
        n = list(st)
        if pc == CLAIM:
            t2 = st[1]
            n[1] = t2 + 1
            if t2 >= self.total_cap:
                return [(("claim", i, t2, None), self._move(n, o, EXIT, t2), None)]
            return [(("claim", i, t2, self.item(t2)), self._move(n, o, WAIT, t2), None)]
        layer, pos, _tile = self.item(t)
        ready, sealed = st[2], st[3]
        if not self.skip_ready and not (sealed or ready > pos):
            return []
        if sealed and t >= total_items(ready, self.NT, self.NT, self.cfg.group):
            return [(("end", i, t), self._move(n, o, EXIT, t), None)]
        if self.skip_ready:
            work = pos < self.cap and not (sealed and pos >= ready)
        else:
            work = pos < ready
        if not work:
            return [(("noop", i, t), self._move(n, o, CLAIM, t), None)]
        nxt = self._move(n, o, L1_STORE if layer == L1 else WAIT_L1, t)
        return [(("ready", i, t, ready, sealed), nxt, None)]

    def _cta_l1(self, st, i, o, pc):
        """An L1 item: ``L1 store`` (reads the block's rows: they must be copied; stores its h1 tile),
        then ``L1 release`` (``l1_done += 1``)."""
        t = st[o + 1]
        _layer, pos, tile = self.item(t)
        n = list(st)
        if pc == L1_STORE:
            v = None
            if st[0] <= 2 * self.last_chunk[pos]:
                v = Violation((PROP_READY,), f"CTA {i} computes L1 tile {tile} of block {pos} before the dispatch "
                                             f"copied its rows of chunk {self.last_chunk[pos]}")
            n[self.O_H1 + pos] |= 1 << tile
            return [(("l1", i, pos, tile), self._move(n, o, L1_REL, t), v)]
        n[self.O_L1 + pos] += 1
        return [(("l1rel", i, pos, tile, n[self.O_L1 + pos]), self._move(n, o, CLAIM, t), None)]

    def _cta_l2(self, st, i, o, pc):
        """An L2 item: ``wait L1`` (``l1_done == nt1``), ``L2 compute`` (reads the block's h1: every L1
        tile must be stored), ``L2 store``, ``L2 done`` and, after the block's last tile, one ``signal``
        per chunk with rows in the block (``aux``: which); ``arrival-before-store`` puts the store after
        the done and the signals."""
        t, aux = st[o + 1], st[o + 2]
        _layer, pos, tile = self.item(t)
        n = list(st)
        move = self._move
        if pc == WAIT_L1:
            if not self.skip_l1 and st[self.O_L1 + pos] != self.NT:
                return []
            return [(("l1seen", i, pos, st[self.O_L1 + pos]), move(n, o, L2_COMP, t), None)]
        if pc == L2_COMP:
            v = None
            if st[self.O_H1 + pos] != self.mask:
                v = Violation((PROP_L1,), f"CTA {i} computes L2 tile {tile} of block {pos} from h1 whose L1 tiles "
                                          f"{self._tiles(self.mask & ~st[self.O_H1 + pos])} are not stored yet")
            return [(("l2", i, pos, tile), move(n, o, L2_DONE if self.arrival_first else L2_STORE, t), v)]
        if pc == L2_STORE:
            n[self.O_Y + pos] |= 1 << tile
            return [(("l2store", i, pos, tile), move(n, o, CLAIM if self.arrival_first else L2_DONE, t), None)]
        if pc == L2_DONE:
            old = st[self.O_L2 + pos]
            n[self.O_L2 + pos] = old + 1
            after = L2_STORE if self.arrival_first else CLAIM
            if old == self.NT - 1:
                return [(("l2done", i, pos, tile, old, True), move(n, o, SIGNAL, t, 0), None)]
            return [(("l2done", i, pos, tile, old, False), move(n, o, after, t), None)]
        if pc == SIGNAL:
            c, rows = self.runs[pos][aux]
            n[self.O_ARR + c] += rows
            v = None
            if n[self.O_ARR + c] > self.expected[c]:
                v = Violation((PROP_COUNT,), f"arrived[{c}] = {n[self.O_ARR + c]} after CTA {i}'s signal for block "
                                             f"{pos}, above the chunk's {self.expected[c]} routed rows")
            nxt = move(n, o, SIGNAL, t, aux + 1) if aux + 1 < len(self.runs[pos]) else \
                move(n, o, L2_STORE if self.arrival_first else CLAIM, t)
            return [(("signal", i, pos, c, rows), nxt, v)]
        raise AssertionError(f"CTA pc {pc}")

    def final_violation(self, st):
        """PROP_DONE at a final state."""
        for b in range(self.B):
            l1, l2 = st[self.O_L1 + b], st[self.O_L2 + b]
            if l1 != self.NT or l2 != self.NT or st[self.O_H1 + b] != self.mask or st[self.O_Y + b] != self.mask:
                return Violation((PROP_DONE,), f"final state: block {b} has l1_done {l1}, l2_done {l2} (want "
                                               f"{self.NT} each), h1 tiles {self._tiles(st[self.O_H1 + b])}, stored "
                                               f"tiles {self._tiles(st[self.O_Y + b])}")
        return None

    def label(self, d) -> str:
        op = d[0]
        if op == "copy":
            return f"dispatch: copy chunk {d[1]}'s rows into their blocks"
        if op == "publish":
            return f"dispatch: publish after chunk {d[1]}: ready = {d[2]} (release)"
        if op == "seal":
            return f"dispatch: seal: ready = {d[1]}, SEALED (release)"
        if op == "reduce":
            return f"owner: arrived[{d[1]}] == {self.expected[d[1]]} (acquire), reads chunk {d[1]}'s rows"
        if op == "claim":
            what = "past the last item: ends" if d[3] is None else \
                f"L{'1' if d[3][0] == L1 else '2'} block {d[3][1]} tile {d[3][2]}"
            return f"CTA {d[1]}: claim t={d[2]} -> {what}"
        if op == "end":
            return f"CTA {d[1]}: sealed, t={d[2]} past the last item: ends"
        if op == "noop":
            return f"CTA {d[1]}: t={d[2]} past the final count: no-op"
        if op == "ready":
            return (f"CTA {d[1]}: t={d[2]}: ready word {d[3]}{' SEALED' if d[4] else ''} (acquire)"
                    + (" [no wait: claim-before-ready]" if self.skip_ready else ""))
        if op == "l1":
            return f"CTA {d[1]}: L1 tile {d[3]} of block {d[2]}: reads its rows, stores its h1 tile"
        if op == "l1rel":
            return f"CTA {d[1]}: l1_done[{d[2]}] = {d[4]} (release)"
        if op == "l1seen":
            return (f"CTA {d[1]}: l1_done[{d[2]}] == {d[3]} (acquire)"
                    + (" [no wait: l2-before-l1]" if self.skip_l1 else ""))
        if op == "l2":
            return f"CTA {d[1]}: L2 tile {d[3]} of block {d[2]}: reads its h1"
        if op == "l2store":
            return f"CTA {d[1]}: stores L2 tile {d[3]} of block {d[2]} into the owner's rows"
        if op == "l2done":
            return f"CTA {d[1]}: l2_done[{d[2]}] {d[4]} -> {d[4] + 1} (acq_rel){': the last tile' if d[5] else ''}"
        if op == "signal":
            return f"CTA {d[1]}: arrived[{d[3]}] += {d[4]} (block {d[2]}'s rows; release)"
        return repr(d)


@dataclass
class QueueExplored:
    """What :func:`explore_queue` explored: states by id, each one's BFS parent and the step into it,
    every edge, and where the search stopped."""

    states: list
    parent: array
    plabel: list  # the label of the step from its parent into each state (None: the initial state)
    esrc: array
    edst: array
    transitions: int = 0
    terminals: int = 0
    bad: tuple | None = None  # (state id, label or None at a final state, Violation): the violation found
    deadlock: int | None = None  # a non-final state without a successor

    def path(self, model: QueueModel, sid: int) -> list[str]:
        """The labels of the steps from the initial state to state ``sid`` (BFS parents: a shortest path)."""
        labs = []
        while sid > 0:
            labs.append(self.plabel[sid])
            sid = self.parent[sid]
        return [model.label(x) for x in reversed(labs)]


def explore_queue(model: QueueModel) -> QueueExplored:
    """Breadth-first over every interleaving from the initial state; stops at the first violation (of a
    step, or of :meth:`QueueModel.final_violation` at a final state) or deadlock."""
    init = model.initial()
    ids, states, parent, plabel = {init: 0}, [init], array("l", [-1]), [None]
    esrc, edst = array("l"), array("l")
    queue = deque([0])
    bad = None  # (state id, label, Violation)
    deadlock = None
    ntrans = nterm = 0
    while queue and bad is None and deadlock is None:
        sid = queue.popleft()
        st = states[sid]
        succ = model.successors(st)
        if not succ:
            nterm += 1
            if not model.is_final(st):
                deadlock = sid
            else:
                v = model.final_violation(st)
                if v is not None:
                    bad = (sid, None, v)
            continue
        for lab, ns, v in succ:
            ntrans += 1
            if v is not None:
                bad = (sid, lab, v)
                break
            nid = ids.get(ns)
            if nid is None:
                nid = len(states)
                ids[ns] = nid
                states.append(ns)
                parent.append(sid)
                plabel.append(lab)
                queue.append(nid)
            esrc.append(sid)
            edst.append(nid)
    return QueueExplored(states, parent, plabel, esrc, edst, ntrans, nterm, bad, deadlock)


def check_queue(cfg: QueueConfig) -> CheckResult:
    """Breadth-first over every interleaving of ``cfg``; stops at the first violation or deadlock. With
    neither, every safety property holds and no-deadlock is reverse reachability of a final state."""
    model = QueueModel(cfg)
    res = CheckResult(config={"layer": "queue", "ctas": cfg.ctas, "blocks": cfg.blocks, "block_rows": cfg.block_rows,
                              "chunks": cfg.chunks, "tiles": cfg.tiles, "group": cfg.group, "inject": cfg.inject,
                              "por": False})
    res.reduction = "none: every interleaving"
    t0 = time.perf_counter()
    g = explore_queue(model)
    res.states, res.transitions, res.terminal_states = len(g.states), g.transitions, g.terminals
    props = {p: NOT_CHECKED for p in QUEUE_PROPERTIES}
    if g.bad is not None:
        sid, lab, v = g.bad
        trace = g.path(model, sid) + ([model.label(lab) + "   <-- VIOLATION"] if lab is not None else [])
        if lab is None:
            trace.append("(final state)   <-- VIOLATION")
        props[v.properties[0]] = "FAIL"
        res.counterexample = {"properties": list(v.properties), "message": v.message, "steps": len(trace),
                              "trace": trace}
        res.violations_found = 1
        res.exhaustive = False
    elif g.deadlock is not None:
        props[PROP_DEADLOCK] = "FAIL"
        trace = g.path(model, g.deadlock)
        res.counterexample = {"properties": [PROP_DEADLOCK], "steps": len(trace), "trace": trace,
                              "message": "deadlock: a reachable non-final state where no process can move"}
        res.exhaustive = False
    else:
        for p in QUEUE_PROPERTIES:
            props[p] = "PASS"
        unreachable, nfinal = cannot_reach_final(model, g.states, g.esrc, g.edst)
        res.final_reachable = nfinal > 0
        if unreachable is not None:
            props[PROP_DEADLOCK] = "FAIL"
            trace = g.path(model, unreachable)
            res.counterexample = {"properties": [PROP_DEADLOCK], "steps": len(trace), "trace": trace,
                                  "message": "from the last state of this trace no final state is reachable"}
    res.properties = props
    res.time_s = time.perf_counter() - t0
    return res


def print_queue_result(res: CheckResult, report) -> None:
    """Print ``res`` (``report``: :mod:`streamring.host.report`, handed in by the CLI)."""
    c = res.config
    out = report.Report()
    out.line(f"streamring model-check --layer queue: {c['ctas']} CTAs, {c['blocks']} blocks of {c['block_rows']} rows "
             f"(the last partial) over {c['chunks']} chunks, {c['tiles']} N-tiles per layer, groups of {c['group']}, "
             f"inject={c['inject']}")
    kind = "exhaustive" if res.exhaustive else "stopped at the first violation"
    out.line(f"explored {res.states} states, {res.transitions} transitions in {res.time_s:.2f}s ({kind})")
    print_properties(out, report.Column, res.properties, QUEUE_PROPERTY_TEXT)
    if res.counterexample:
        print_counterexample(out, res.counterexample, "shortest path (BFS)")
    print_verdict(out, res)


def queue_check_main(args, report) -> int:
    """``streamring model-check --layer queue``: 0 iff every property holds, 1 on a counter-example, 2 on
    bad arguments. ``report``: :mod:`streamring.host.report`, which prints the tables (the CLI hands it
    in: this package sits below host in the layering)."""
    try:
        cfg = QueueConfig(ctas=args.ctas, blocks=args.blocks, block_rows=args.block_rows, chunks=args.chunks,
                          tiles=args.tiles, group=args.group, inject=getattr(args, "inject", None) or "none")
        cfg.validate()
    except ValueError as exc:
        print(f"streamring model-check: {exc}", file=sys.stderr)
        return 2
    return finish(check_queue(cfg), print_queue_result, report, getattr(args, "json", None))
