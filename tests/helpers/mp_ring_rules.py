"""The ring's rules and its hostile-peer checks on real MPI ranks, scripted step by step with barriers.

Run by tests/ranks/test_ring_rules.py as ``mpiexec -n N python tests/helpers/mp_ring_rules.py SCENARIO [SCENARIO ...]``.
Every step that matters happens between two barriers, so what each rank may observe is fixed:
no result here depends on timing (the stress harness covers the timing-dependent side).
No torch import: a job starts in about a second.

Each scenario asserts on every rank and prints ``SCENARIO OK <name>`` on rank 0; any failure prints
the traceback and aborts the job with a non-zero exit code.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

import numpy as np

import streamring.ring.protocol as ring_protocol
from mp_main import run_scenarios
from streamring.device.cpu import MpiHeap
from streamring.device.verbs import SignalOp, VerbError
from streamring.ring.layout import (
    MAX_EPOCH, MAX_SEQ, META_BASE, META_CHUNK, META_LAYOUT_GEN, META_LAYOUT_NS, META_ROUTE_GEN, META_ROUTE_NS,
    META_VALID, META_WORDS, GenState, RingLayout, gen_str, make_gen,
)
from streamring.ring.protocol import ProtocolViolation, Ring

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class VerbLog:
    """Records the one-sided verbs this rank issues on its (real) heap while active.

    The calls still go through to the MPI heap; the log only says which bytes of
    which rank were touched, so a test can check them against the spans the
    protocol allows.
    """

    VERBS = ("get", "put", "put_signal", "signal_op", "atomic_fetch_or", "atomic_fetch_add")

    def __init__(self, heap):
        self.heap = heap
        self.calls: list[tuple] = []  # (verb, offset, nbytes, pe)

    def __enter__(self):
        for name in self.VERBS:
            real = getattr(self.heap, name)

            def spy(*args, _name=name, _real=real):
                offset = args[1]
                if _name in ("get", "put"):
                    nbytes, pe = args[2].nbytes, args[3]
                elif _name == "put_signal":
                    nbytes, pe = args[2].nbytes, args[7]
                elif _name == "signal_op":
                    nbytes, pe = 8, args[4]
                else:
                    nbytes, pe = 8, args[3]
                self.calls.append((_name, int(offset), int(nbytes), int(pe)))
                return _real(*args)

            setattr(self.heap, name, spy)  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc):
        for name in self.VERBS:
            delattr(self.heap, name)
        return False

    def writes(self):
        return [c for c in self.calls if c[0] != "get"]


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def expect_violation(fn, *needles):
    try:
        fn()
    except ProtocolViolation as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        check(not missing, f"ProtocolViolation {text!r} does not name {missing}")
        return text
    raise AssertionError(f"no ProtocolViolation (expected one naming {needles})")


# --------------------------------------------------------------------------------------
# The payload every rank publishes: a function of (source rank, chunk, token), so a read can be checked
# --------------------------------------------------------------------------------------
def payload(L: RingLayout, src: int, base: int, valid: int):
    t = np.arange(base, base + valid, dtype=np.int64)[:, None]
    k = np.arange(L.topk, dtype=np.int64)[None, :]
    topk_idx = (src + t * L.topk + k) % (L.num_experts + 1) - 1  # every value of [-1, E): -1 is a masked route
    topk_w = (src * 100 + t * 10 + k).astype(np.float32)
    cols = np.arange(L.hidden, dtype=np.int64)[None, :]
    x = ((src * 31 + t * 7 + cols) % 256).astype(np.uint8)
    x_sf = (src + t + np.arange(L.sf_cols)[None, :] / 8).astype(np.float32)
    return np.ascontiguousarray(topk_idx), np.ascontiguousarray(topk_w), x, x_sf


def publish(ring: Ring, chunk: int, route=True, layout=True):
    plan = ring.plan
    base, valid = plan.chunk_tokens(ring.me, chunk)
    idx, w, x, sf = payload(ring.layout, ring.me, base, valid)
    if route:
        ring.publish_route(chunk, idx, w)
    if layout:
        ring.publish_layout(chunk, x, sf)


def check_view(ring: Ring, view, src: int, chunk: int):
    base, valid = ring.plan.chunk_tokens(src, chunk)
    idx, w, x, sf = payload(ring.layout, src, base, valid)
    check(view.valid == valid and view.token_base == base, f"view of ({src}, {chunk}): {view.valid}, {view.token_base}")
    for name, got, want in (("topk_idx", view.topk_idx, idx), ("topk_weights", view.topk_weights, w),
                            ("x", view.x, x), ("x_sf", view.x_sf, sf)):
        check(got.shape == want.shape and got.tobytes() == want.tobytes(),
              f"rank {ring.me}: {name} of source {src} chunk {chunk} differs from what it published")


# --------------------------------------------------------------------------------------
# Hostile peer: every metadata word and topk_idx corrupted with boundary values
# --------------------------------------------------------------------------------------
def hostile_table(heap):
    """A peer corrupts one word at a time after publishing; every rank must refuse it, naming the source
    rank and the field, before touching anything outside the chunk's own rows; nothing is written."""
    R, me = heap.num_ranks, heap.rank
    EVIL = 1
    E, K, C, S = 6, 3, 4, 2
    L = RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=C, hidden=128, topk=K, num_experts=E)
    ring = Ring(heap, L, wait_timeout_s=20)
    EPOCH, CH = 3, 1  # chunk 1 of epoch 3: slot 1, token base 4, 3 valid tokens (a partial chunk)
    plan = ring.begin_stream(EPOCH, 7)
    slot, g = CH % S, plan.gen(CH)
    base, valid = plan.chunk_tokens(EVIL, CH)
    assert (slot, base, valid) == (1, 4, 3)
    for c in range(plan.num_chunks):
        check(ring.try_reserve(c), f"slot of chunk {c} not free at the start")
        publish(ring, c)
    for src in range(R):
        ring.acquire(src, CH)
    heap.barrier()

    # What a consumer may touch when it reads (EVIL, CH): the metadata and the chunk's valid rows, on EVIL only.
    allowed = [(L.meta_off(slot), L.meta_off(slot) + META_WORDS * 8)] + [
        (off(slot, 0), off(slot, valid)) for off in (L.x_off, L.x_sf_off, L.topk_idx_off, L.topk_weights_off)]

    old_epoch_same_seq = make_gen(EPOCH - 1, CH + 1)
    common = {E, -1, -2, base - 1, base + 1, valid + 1, old_epoch_same_seq}
    meta_rows = {  # word: (field named in the error, values); every value differs from the published one
        META_CHUNK: ("chunk_index", common | {CH - 1, CH + 1, INT64_MAX}),
        META_BASE: ("token_base", common | {0, C, INT64_MIN}),
        META_VALID: ("valid_count", common | {0, valid - 1, C, C + 1, INT64_MAX}),
        META_ROUTE_GEN: ("route_gen", common | {0, make_gen(EPOCH, CH), make_gen(EPOCH, CH + 1 + S),
                                                   make_gen(EPOCH + 1, CH + 1), INT64_MAX}),
        META_LAYOUT_GEN: ("layout_gen", common | {0, make_gen(EPOCH, CH), make_gen(EPOCH, CH + 1 + S),
                                                     make_gen(EPOCH + 1, CH + 1), INT64_MAX}),
    }
    published = np.empty(META_WORDS, np.int64)
    heap.get(ring.buf, L.meta_off(slot), published, EVIL)
    rows = []  # (label, target, value, expected) ; expected: ("violation", needles) | "ok" | "older"
    for word, (field, values) in meta_rows.items():
        for v in sorted(values):
            if v != published[word]:
                rows.append((f"meta {field} = {v}", ("meta", word), v,
                             ("violation", (f"source rank {EVIL} slot {slot} chunk {CH}: {field} = {v},",))))
    # Timestamps (words 4 and 6) and the spare word 7 feed statistics only: any value is harmless.
    for word in (META_ROUTE_NS, META_LAYOUT_NS, 7):
        for v in (-1, INT64_MAX):
            rows.append((f"meta word {word} = {v}", ("meta", word), v, "ok"))
    # topk_idx: -1 is a valid (masked) route; -2, E and beyond are not.
    for v in (E, E + 1, -2, INT64_MIN, INT64_MAX):
        rows.append((f"topk_idx[1][2] = {v}", ("topk", 1, 2), v,
                     ("violation", (f"topk_idx from source rank {EVIL} holds {v},", f"outside [-1, {E})"))))
    for v in (-1, 0, E - 1):
        rows.append((f"topk_idx[1][2] = {v}", ("topk", 1, 2), v, "ok"))
    # A row of the slot beyond the chunk's valid count is not part of the chunk: never read, never checked.
    rows.append((f"topk_idx[{valid}][0] = {E} (beyond the valid rows)", ("topk", valid, 0), E, "ok"))
    # The generation words the peer signals into every consumer.
    for field in ("route_ready_gen", "layout_ready_gen"):
        for v in (make_gen(EPOCH, CH + 1 + S), make_gen(EPOCH, CH), make_gen(EPOCH + 1, CH + 1),
                  make_gen(MAX_EPOCH, 1), 2**64 - 1):
            rows.append((f"{field} := {gen_str(v)}", ("gen", field), v,
                         ("violation", (f"{field}[src={EVIL}][slot={slot}]",))))
        for v in (0, old_epoch_same_seq, make_gen(EPOCH - 1, MAX_SEQ)):
            rows.append((f"{field} := {gen_str(v)}", ("gen", field), v, "older"))

    def set_word(target, value):
        """EVIL writes one word of its own slot (or signals every rank's generation word); returns the old value."""
        kind = target[0]
        if kind == "gen":
            off = (L.route_gen_off if target[1] == "route_ready_gen" else L.layout_gen_off)(EVIL, slot)
            for pe in range(R):
                heap.signal_op(ring.buf, off, int(value), SignalOp.SET, pe)
            return g
        off = L.meta_off(slot) + target[1] * 8 if kind == "meta" else L.topk_idx_off(slot, target[1]) + target[2] * 8
        old = np.empty(1, np.int64)
        heap.get(ring.buf, off, old, EVIL)
        heap.put(ring.buf, off, np.array([value], np.int64), EVIL)
        return int(old[0])

    failures = []
    for label, target, value, want in rows:
        heap.barrier()
        if me == EVIL:
            restore = set_word(target, value)
        heap.barrier()
        mine_before = ring.buf.local.copy()
        outcome, log = None, VerbLog(heap)
        try:
            with log:
                if target[0] == "gen":
                    outcome = ring.gen_state(EVIL, CH)
                else:
                    view = ring.read_chunk(EVIL, CH)
                    outcome = "ok"
        except ProtocolViolation as exc:
            outcome = exc
        except Exception as exc:  # noqa: BLE001 - recorded as a failure of this row; the ranks stay in step
            outcome = f"{type(exc).__name__}: {exc}"
        problems = []
        if want == "ok":
            if outcome != "ok":
                problems.append(f"refused: {outcome}")
            else:
                try:
                    check_view(ring, view, EVIL, CH) if target != ("topk", 1, 2) else None
                except AssertionError as exc:
                    problems.append(str(exc))
        elif want == "older":
            if outcome is not GenState.OLDER:
                problems.append(f"classified {outcome!r}, expected OLDER (keep waiting)")
        else:
            if not isinstance(outcome, ProtocolViolation):
                problems.append(f"accepted ({outcome!r}), expected a ProtocolViolation")
            else:
                missing = [n for n in want[1] if n not in str(outcome)]
                if missing:
                    problems.append(f"message {str(outcome)!r} does not name {missing}")
        # Nothing read outside the chunk's rows of the peer's slot, nothing written anywhere.
        for verb, off, n, pe in log.calls:
            if verb != "get":
                problems.append(f"wrote: {verb} at offset {off} of rank {pe}")
            elif pe != EVIL or not any(lo <= off and off + n <= hi for lo, hi in allowed):
                problems.append(f"read bytes [{off}, {off + n}) of rank {pe}: outside the chunk's rows")
        if target[0] == "meta" and want != "ok" and [c[1] for c in log.calls] != [L.meta_off(slot)]:
            problems.append(f"bad metadata not refused before the payload was read: {log.calls}")
        if not np.array_equal(ring.buf.local, mine_before):
            problems.append("my symmetric buffer changed during the read")
        if problems:
            failures.append(f"rank {me}: {label}: " + "; ".join(problems))
        heap.barrier()
        if me == EVIL:
            set_word(target, restore)
    heap.barrier()
    # Every rank's verdicts together: one readable failure naming each row that went wrong.
    every = [f for fs in heap.allgather_obj(failures) for f in fs]
    check(not every, f"{len(every)} hostile-peer rows not handled as required, first: {every[0] if every else ''}"
                     f"\n  " + "\n  ".join(every))
    # Restored: the same chunk reads correctly, and the stream ends normally (the checks broke nothing).
    for src in range(R):
        for c in range(plan.num_chunks):
            ring.acquire(src, c)
            check_view(ring, ring.read_chunk(src, c), src, c)
            ring.ack(src, c)
    ring.end_stream()
    if me == 0:
        print(f"hostile peer: {len(rows)} rows refused or accepted as required on {R} ranks")
    ring.close()


# --------------------------------------------------------------------------------------
# The ring's rules, step by step
# --------------------------------------------------------------------------------------
def scripted_ring(heap):
    """Both generations before a read; reuse only after the last rank's acknowledgement; the mask cleared
    before reuse; payload before generation (verb order); the drain; an older epoch's word with the same
    sequence is older, not ready."""
    R, me = heap.num_ranks, heap.rank
    check(R >= 3, "needs 3 ranks: an acknowledgement that is neither the first nor the last")
    L = RingLayout(num_ranks=R, num_slots=1, tokens_per_slot=2, hidden=128, topk=2, num_experts=4)
    ring = Ring(heap, L, wait_timeout_s=20)
    plan = ring.begin_stream(1, 4)  # 2 chunks per rank on 1 slot: chunk 1 reuses chunk 0's slot
    check(plan.num_chunks == 2, plan)

    def refused_everywhere(chunk, why):
        states = {src: ring.gen_state(src, chunk) for src in range(R)}
        check(all(s is GenState.OLDER for s in states.values()) and not any(ring.try_acquire(s, chunk)
                                                                            for s in range(R)),
              f"rank {me}: {why}: acquire of chunk {chunk} not refused: {states}")

    # 1. Only the route published: no rank may acquire (rule 5: the consumer needs both generations).
    check(ring.try_reserve(0), "slot 0 not free at the start")
    with VerbLog(heap) as log:
        publish(ring, 0, layout=False)
    heap.barrier()
    refused_everywhere(0, "only route_ready_gen published")
    # Rule 1 in verbs: every payload and metadata put of the producer precedes its first generation signal.
    names = [c[0] for c in log.calls]
    check("signal_op" in names and "put" in names and max(i for i, n in enumerate(names) if n == "put")
          < names.index("signal_op"), f"route producer's verbs out of order (payload before generation): {names}")
    heap.barrier()
    with VerbLog(heap) as log:
        publish(ring, 0, route=False)
    names = [c[0] for c in log.calls]
    check(max(i for i, n in enumerate(names) if n == "put") < names.index("signal_op"),
          f"layout producer's verbs out of order (payload before generation): {names}")
    heap.barrier()
    for src in range(R):
        check(ring.try_acquire(src, 0), f"rank {me}: both generations of ({src}, 0) published, acquire refused")
        check_view(ring, ring.read_chunk(src, 0), src, 0)
    heap.barrier()

    # 2. Acknowledgements one rank at a time: reuse of the slot stays refused until the last one (rule 3).
    order = list(range(1, R)) + [0]  # the owner of rank 0's own chunk acknowledges last
    for i, acker in enumerate(order):
        if me == acker:
            for src in range(R):
                ring.ack(src, 0)
        heap.barrier()
        last = i == len(order) - 1
        free = ring.try_reserve(1)
        check(free is last, f"rank {me}: reuse of slot 0 for chunk 1 {'refused' if last else 'allowed'} after "
                            f"the acknowledgements of ranks {order[:i + 1]} (of {R})")
        heap.barrier()
    # Rule 4: the owner cleared its mask when it collected the acknowledgements.
    word = heap.signal_fetch(ring.buf, L.ack_word_off(0, 0))
    check(word == 0, f"rank {me}: ack_mask of slot 0 is {word:#x} after collection, expected 0")
    heap.barrier()

    # 3. Second lap of the slot, layout first this time: still refused until the route comes too.
    publish(ring, 1, route=False)
    heap.barrier()
    refused_everywhere(1, "only layout_ready_gen published (route still holds the previous lap)")
    heap.barrier()
    publish(ring, 1, layout=False)
    heap.barrier()
    for src in range(R):
        check(ring.try_acquire(src, 1), f"rank {me}: ({src}, 1) not acquirable after both publishes")
        check_view(ring, ring.read_chunk(src, 1), src, 1)
        ring.ack(src, 1)  # a bit left over from chunk 0 would raise "ack bit already set" here
    ring.end_stream()  # the drain: every acknowledgement of my last chunk collected, the mask cleared
    check(heap.signal_fetch(ring.buf, L.ack_word_off(0, 0)) == 0, f"rank {me}: ack_mask not clear after the drain")
    heap.barrier()

    # 4. Epoch 2 on the same buffers: the words still hold epoch 1's chunk 1 (sequence 2). Chunk 1 of epoch 2
    # has the same sequence: that leftover is OLDER (keep waiting), never READY (rule 6, ABA).
    plan = ring.begin_stream(2, 4)
    for src in range(R):
        seen = heap.signal_fetch(ring.buf, L.route_gen_off(src, 0))
        check(seen == make_gen(1, 2), f"rank {me}: route word of {src} holds {gen_str(seen)}, expected e1:c1")
        st = ring.gen_state(src, 1)
        check(st is GenState.OLDER, f"rank {me}: epoch 1's word {gen_str(seen)} classified {st} while expecting "
                                    f"{gen_str(plan.gen(1))}: an older epoch must be OLDER")
        check(not ring.try_acquire(src, 1), f"rank {me}: acquired ({src}, 1) of epoch 2 from epoch 1's leftover")
    heap.barrier()
    for c in range(2):
        ring.reserve(c)
        publish(ring, c)
        for src in range(R):
            ring.acquire(src, c)
            check_view(ring, ring.read_chunk(src, c), src, c)
            ring.ack(src, c)
    ring.end_stream()
    heap.barrier()
    ring.close()


# --------------------------------------------------------------------------------------
# A waiting rank gives its core away
# --------------------------------------------------------------------------------------
def waiting_gives_core_away(heap):
    """Two ranks pinned to ONE core play ping-pong through a signal word; each wait is the ring's own
    ``Ring.wait_until``. Measured: the CPU time a waiter burns per handoff, for the pause as shipped,
    for an explicit ``os.sched_yield`` (the yielding baseline) and for no pause at all (the negative
    control), interleaved in short rounds so that load on the machine hits all three alike.

    The claim (``verbs.spin_pause``): ranks may outnumber cores, and a waiting rank gives its core to
    the rank it waits for instead of burning its scheduler slice. The no-pause control burns a whole
    slice per handoff (4 ms here: a 250 Hz tick). The sched_yield baseline burns tens of microseconds
    on an idle machine and about 1 ms under a load average of 10 on 2 cores (the scheduler does not
    always hand the core to the peer at once). The shipped pause runs the very same loop as the
    baseline, so a correct build measures about 1x it: 0.85-1.3x seen under that load, but on an idle
    CI machine, where both are a few tens of microseconds, one run measured 47 against 23 us (2.04x).
    A ratio to the baseline alone is noise at that scale; what tells a yielding waiter from a burning
    one is which reference it sits nearer: the verdict is "yields" when the shipped figure is below
    the geometric mean of the baseline and the control (47 us against sqrt(23 x 3945) = 301 us in that
    run; 1.84x the baseline under load, where the control is >= 3.4x it). A build whose waiter never
    yields measures as the control and lands above. The control must exceed 2x the baseline, or the
    run could not tell the two apart: then the test fails as inconclusive rather than pass.
    """
    R, me = heap.num_ranks, heap.rank
    check(R == 2, "needs exactly 2 ranks")
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    cpus = heap.allgather_obj(cpu)
    check(len(set(cpus)) == 1, f"ranks not pinned to one core: {cpus}")
    L = RingLayout(num_ranks=R, num_slots=1, tokens_per_slot=1, hidden=128, topk=1, num_experts=2)
    ring = Ring(heap, L, wait_timeout_s=30)
    words = heap.alloc("pingpong", 16)
    shipped = ring_protocol.spin_pause
    variants = {"shipped": shipped, "sched_yield": os.sched_yield, "no_pause": lambda: None}
    # short rounds, interleaved: a burst of load from other jobs on the machine falls on all three alike
    N, ROUNDS = 10, 16
    cpu_s = {name: [] for name in variants}
    value = 0
    try:
        for _ in range(ROUNDS):
            for name, pause in variants.items():
                ring_protocol.spin_pause = pause  # what Ring.wait_until calls between polls
                heap.barrier()
                for _ in range(N):
                    value += 1
                    v = value
                    if me == 0:
                        heap.signal_op(words, 0, v, SignalOp.SET, 1)
                    t0 = time.process_time()
                    ring.wait_until(lambda: heap.signal_fetch(words, 8 * (1 - me)) == v, "ping-pong")
                    cpu_s[name].append(time.process_time() - t0)
                    if me == 1:
                        heap.signal_op(words, 8, v, SignalOp.SET, 0)
    finally:
        ring_protocol.spin_pause = shipped
    every = heap.allgather_obj(cpu_s)
    med = {name: statistics.median(x for r in every for x in r[name]) for name in variants}
    if me == 0:
        print("CPU time a waiter burns per handoff, 2 ranks on one core (median): "
              + ", ".join(f"{n} {v * 1e6:.0f} us" for n, v in med.items()))
    base, burn = med["sched_yield"], med["no_pause"]
    check(burn > 2.0 * base,
          f"inconclusive: a waiter without any pause burned {burn * 1e6:.0f} us per handoff, not more "
          f"than 2x the yielding baseline {base * 1e6:.0f} us (were the ranks really sharing one core?)")
    bound = math.sqrt(base * burn)  # nearer the yielding baseline than the burning control, on a log scale
    check(med["shipped"] < bound,
          f"a waiting rank does not give its core away: {med['shipped'] * 1e6:.0f} us of CPU per handoff, nearer "
          f"the {burn * 1e6:.0f} us of a waiter without any pause than the {base * 1e6:.0f} us of sched_yield "
          f"(bound: their geometric mean, {bound * 1e6:.0f} us)")
    heap.barrier()
    heap.free(words)
    ring.close()


# --------------------------------------------------------------------------------------
# Bad inputs: nothing half-published
# --------------------------------------------------------------------------------------
def expect(exc, fn, needle):
    try:
        fn()
    except exc as e:
        check(needle in str(e), f"message {str(e)!r} lacks {needle!r}")
        return e
    raise AssertionError(f"{fn} did not raise {exc.__name__} ({needle})")


def publish_bad_inputs(heap):
    """Bad arguments to the publish calls, reserve and begin_stream are refused before anything is published;
    the same chunk then publishes and reads fine, and the verbs check their bounds."""
    L = RingLayout(num_ranks=heap.num_ranks, num_slots=2, tokens_per_slot=4, hidden=128, topk=2, num_experts=8)
    ring = Ring(heap, L, wait_timeout_s=10)
    ring.begin_stream(1, 6)  # chunk 0: 4 tokens, chunk 1: 2 tokens
    assert ring.try_reserve(0)
    idx = np.zeros((4, 2), np.int64)
    w = np.ones((4, 2), np.float32)
    x = np.zeros((4, 128), np.uint8)
    sf = np.ones((4, 1), np.float32)
    route_word = L.route_gen_off(heap.rank, 0)
    before = [heap.signal_fetch(ring.buf, route_word)]
    expect(ValueError, lambda: ring.publish_route(0, np.full((4, 2), 8, np.int64), w), "topk_idx values must be in [-1, 8)")
    expect(ValueError, lambda: ring.publish_route(0, np.full((4, 2), -2, np.int64), w), "topk_idx")
    expect(TypeError, lambda: ring.publish_route(0, idx.astype(np.int32), w), "topk_idx must have dtype int64")
    expect(ValueError, lambda: ring.publish_route(0, np.zeros((5, 2), np.int64), np.ones((5, 2), np.float32)),
           "topk_idx must have shape (4, 2)")  # over the chunk's valid count / slot capacity
    expect(ValueError, lambda: ring.publish_layout(0, np.zeros((4, 256), np.uint8), sf), "x must have shape (4, 128)")
    expect(TypeError, lambda: ring.publish_layout(0, x.astype(np.float32), sf), "x must have dtype uint8")
    expect(TypeError, lambda: ring.publish_layout(0, list(x), sf), "x must be a numpy array")
    expect(ValueError, lambda: ring.try_reserve(2), "chunk 2 outside [0, 2)")
    # nothing was half-published: my generation words are unchanged everywhere
    heap.barrier()
    assert heap.signal_fetch(ring.buf, route_word) == before[0] == 0
    for src in range(heap.num_ranks):
        assert heap.signal_fetch(ring.buf, L.route_gen_off(src, 0)) == 0
    heap.barrier()
    # and the same chunk publishes fine afterwards
    ring.publish_route(0, idx, w)
    ring.publish_layout(0, x, sf)
    for src in range(heap.num_ranks):
        ring.acquire(src, 0)
        v = ring.read_chunk(src, 0)
        assert v.valid == 4 and (v.topk_idx == 0).all()
        ring.ack(src, 0)
    ring.reserve(1)
    ring.publish_route(1, idx[:2], w[:2])
    ring.publish_layout(1, x[:2], sf[:2])
    for src in range(heap.num_ranks):
        ring.acquire(src, 1)
        assert ring.read_chunk(src, 1).valid == 2  # the final partial chunk
        ring.ack(src, 1)
    ring.end_stream()
    # epochs must grow
    expect(ValueError, lambda: ring.begin_stream(1, 0), "stream_epoch must be in (1,")
    # verbs check their bounds (shared windows have none)
    expect(VerbError, lambda: heap.put(ring.buf, L.nbytes - 4, np.zeros(8, np.uint8), 0), "outside")
    expect(VerbError, lambda: heap.signal_op(ring.buf, 0, 1, SignalOp.SET,
                                             heap.num_ranks), "pe")
    ring.close()


# --------------------------------------------------------------------------------------
# Freeing a region while an equal-looking one leaked
# --------------------------------------------------------------------------------------
def leaked_region_close(heap):
    """A failed forward leaves its buffers allocated; freeing the rebuilt ones (same name, same size) and
    closing the heap later must work (it used to compare regions through freed memory: a segfault)."""
    leaked = heap.alloc("moe-stream-ring", 1 << 20)  # noqa: F841 - left for heap.close()
    fresh = heap.alloc("moe-stream-ring", 1 << 20)
    heap.free(fresh)
    again = heap.alloc("moe-stream-ring", 1 << 20)
    heap.free(again)
    check(heap._regions == [leaked] and heap._regions[0] is leaked, "the leaked region was dropped or duplicated")
    # heap.close() at the end of the job frees the leaked one


SCENARIOS = {f.__name__: f for f in (hostile_table, scripted_ring, waiting_gives_core_away, leaked_region_close,
                                     publish_bad_inputs)}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv[1:], MpiHeap(window=os.environ.get("STREAMRING_TEST_WINDOW", "auto")))
