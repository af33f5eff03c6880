"""Stress harness: producers and a consumer per rank with random delays, every read checked.

Each rank runs three cooperative roles (route producer, layout producer,
consumer) as generators under one round-robin scheduler: a role yields
whenever it would block (waiting for a generation, for acknowledgements, or
sleeping a random delay), so route and layout complete in random orders and
the consumer runs while later chunks are still being produced. Ranks are
real processes, so cross-rank interleavings are real.

Checkers (independent of the protocol steps they check):

* every consumer read of ``(src, chunk)`` is compared with the pattern that
  ``src`` writes for that generation (x, x_sf, topk_idx, topk_weights and
  metadata), twice: right after the read and again after a hold, before the
  acknowledgement. A mismatch is a *stale* (old generation), *torn* (mixed)
  or *changed* (overwritten while held) read;
* before every overwrite the producer checks that its slot's previous chunk
  was fully acknowledged (``consumed_gen`` or a full mask): otherwise *early
  reuse*.

Any violation makes the exit code non-zero. The ``--inject`` mutations of
``streamring.ring.policies.Inject`` must each produce violations.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..config import Config, ConfigError, per_rank
from ..ring.layout import META_BASE, META_CHUNK, META_VALID, META_WORDS, GenState, RingLayout, make_gen
from ..ring.policies import Inject
from ..ring.protocol import ProtocolViolation, Ring
from ..ring.roles import run_roles, sleep_for, wait_for
from ..device.verbs import SignalOp, SymmetricHeap

STRESS_EXPERTS = 64
STRESS_TOPK = 4
STRESS_HIDDEN = 128


# --------------------------------------------------------------------------------------
# The verifiable pattern
# --------------------------------------------------------------------------------------
def _mix(v: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised."""
    v = v.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        v ^= v >> np.uint64(30)
        v *= np.uint64(0xBF58476D1CE4E5B9)
        v ^= v >> np.uint64(27)
        v *= np.uint64(0x94D049BB133111EB)
        v ^= v >> np.uint64(31)
    return v


def pattern(src: int, gen: int, token_base: int, valid: int, hidden: int, topk: int, num_experts: int):
    """The payload ``src`` writes for ``gen``: a function of (source rank, generation, logical token)."""
    tok = np.arange(token_base, token_base + valid, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _mix(tok * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(gen) ^ (np.uint64(src) << np.uint64(56)))
    cols = np.arange(hidden, dtype=np.uint64)
    x = ((h[:, None] >> (cols % np.uint64(57))) ^ cols).astype(np.uint8)
    sf_cols = hidden // 128
    x_sf = ((h[:, None] >> np.uint64(40)) + np.arange(sf_cols, dtype=np.uint64)).astype(np.float32)
    ks = np.arange(topk, dtype=np.uint64)
    idx = ((h[:, None] >> np.uint64(8)) + ks * np.uint64(7)) % np.uint64(num_experts + 1)
    topk_idx = idx.astype(np.int64) - 1  # includes masked routes (-1)
    topk_weights = ((h[:, None] >> np.uint64(44)) + ks).astype(np.float32)
    return x, x_sf, topk_idx, topk_weights


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------
@dataclass
class RankResult:
    """What one rank measured."""

    rank: int
    heap: str = ""  # the heap's memory kind, e.g. cpu/shared or cpu/separate
    chunks_published: int = 0
    chunks_consumed: int = 0
    tokens_checked: int = 0
    bytes_read: int = 0
    violations: int = 0
    violation_kinds: dict = field(default_factory=dict)
    first_violations: list = field(default_factory=list)
    sources_out_of_rank_order: int = 0  # source_order='ready': chunks handled before a lower rank's
    reuses_checked: int = 0  # slot overwrites checked against the acknowledgements (early-reuse checker)
    tokens_published: int = 0  # this rank's own tokens (chunks_published counts empty chunks too)
    chunks_with_tokens: int = 0
    stopped_early: str = ""  # why the run stopped before its last epoch ('' = it ran them all)
    acquire_wait_median_s: float = 0.0
    acquire_wait_max_s: float = 0.0
    reuse_wait_median_s: float = 0.0
    reuse_wait_max_s: float = 0.0
    publish_to_acquire_median_s: float = 0.0
    publish_to_acquire_max_s: float = 0.0
    wall_s: float = 0.0
    ring_wraps: int = 0

    def add_violation(self, kind: str, text: str) -> None:
        self.violations += 1
        self.violation_kinds[kind] = self.violation_kinds.get(kind, 0) + 1
        if len(self.first_violations) < 5:
            self.first_violations.append(text)


def _med(xs):
    return float(statistics.median(xs)) if xs else 0.0


# --------------------------------------------------------------------------------------
# Cooperative roles
# --------------------------------------------------------------------------------------
class _Roles:
    def __init__(self, ring: Ring, cfg: Config, result: RankResult, rng: random.Random, stop: "_StopFlag"):
        self.ring = ring
        self.stop = stop
        self.cfg = cfg
        self.res = result
        self.rng = rng
        self.me = ring.me
        self.factor = float(cfg.stress.stragglers.get(self.me, 1.0))
        self.publish_to_acquire: list[float] = []
        self.acquire_waits: list[float] = []
        self.reuse_waits: list[float] = []
        self.own_acked = -1  # last chunk of mine that my own consumer acknowledged (this epoch)

    def maybe_fault(self, step: str, done: int) -> None:
        """Kill (SIGKILL) or stop (SIGSTOP) this process at ``step`` when the config says so."""
        f = self.cfg.stress.fault
        if f is not None and f.rank == self.me and f.at == step and done >= f.after_chunks:
            os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)

    def delay(self, d):
        """Sleep a random delay cooperatively."""
        yield from sleep_for(self.rng.uniform(d.min_s, d.max_s) * self.factor)

    def wait(self, pred, what: str, waits: list | None = None):
        def pred_or_stop():
            if self.stop.is_set():
                raise StressStopped(what)
            return pred()

        yield from wait_for(self.ring, pred_or_stop, what, waits)

    def violation(self, kind: str, text: str) -> None:
        """Record a violation and stop every rank's epoch (see :class:`_StopFlag`)."""
        self.res.add_violation(kind, text)
        self.stop.raise_everywhere()

    def drain(self):
        """The end of an epoch: wait for every acknowledgement of my chunks (``Ring.end_stream``)."""
        for _ in self.ring.drain_steps():
            if self.stop.is_set():
                raise StressStopped("drain")
            yield

    # -- producers ----------------------------------------------------------------------
    def producer(self, kind: str, plan):
        ring, L = self.ring, self.ring.layout
        S = L.num_slots
        d = self.cfg.stress.route_delay if kind == "route" else self.cfg.stress.layout_delay
        for c in range(plan.num_chunks):
            yield from self.delay(d)
            yield from self.wait(lambda: ring.try_reserve(c), f"reuse of my slot {c % S} for chunk {c}",
                                 self.reuse_waits)
            if c >= S:
                self.res.reuses_checked += 1
                # Early-reuse checker, independent of the owner's mask logic: every
                # consumer's own record of what it finished reading from us (its
                # consumed_gen[me][slot], read remotely; our own consumer's progress
                # locally) must already cover chunk c - S.
                slot, prev = c % S, make_gen(plan.epoch, c - S + 1)
                behind = [d for d in range(L.num_ranks) if d != self.me
                          and int(ring.heap.get(ring.buf, L.consumed_gen_off(self.me, slot),
                                                np.empty(1, np.uint64), d)[0]) < prev]
                if self.own_acked < c - S:
                    behind.append(self.me)
                if behind:
                    self.violation(
                        "early_reuse",
                        f"rank {self.me} {kind} producer overwrote slot {slot} with chunk {c} before ranks "
                        f"{sorted(behind)} acknowledged chunk {c - S}",
                    )
            base, valid = plan.chunk_tokens(self.me, c)
            x, x_sf, idx, w = pattern(self.me, plan.gen(c), base, valid, L.hidden, L.topk, L.num_experts)
            self.maybe_fault("publish", c)
            if kind == "route":
                ring.publish_route(c, idx, w)
            else:
                ring.publish_layout(c, x, x_sf)
            if kind == "route":
                self.res.chunks_published += 1
                self.res.tokens_published += valid
                self.res.chunks_with_tokens += valid > 0
            yield

    # -- consumer -----------------------------------------------------------------------
    def _check(self, src, c, plan, meta, arrays, when: str) -> bool:
        L = self.ring.layout
        base, valid = plan.chunk_tokens(src, c)
        want = pattern(src, plan.gen(c), base, valid, L.hidden, L.topk, L.num_experts)
        bad = []
        if (int(meta[META_CHUNK]), int(meta[META_BASE]), int(meta[META_VALID])) != (c, base, valid):
            bad.append(f"meta=(chunk {meta[META_CHUNK]}, base {meta[META_BASE]}, valid {meta[META_VALID]})")
        for name, got, exp in zip(("x", "x_sf", "topk_idx", "topk_weights"), arrays, want):
            if got.shape != exp.shape or not np.array_equal(got, exp):
                bad.append(name)
        if bad:
            kind = "stale_or_torn" if when == "read" else "changed_while_held"
            self.violation(
                kind,
                f"rank {self.me} read of source {src} chunk {c} (epoch {plan.epoch}) {when}: {', '.join(bad)} "
                f"differ from the pattern of that generation",
            )
            return False
        return True

    def _read(self, src, c, plan):
        ring, L = self.ring, self.ring.layout
        slot = c % L.num_slots
        base, valid = plan.chunk_tokens(src, c)
        meta = np.empty(META_WORDS, dtype=np.int64)
        ring.heap.get(ring.buf, L.meta_off(slot), meta, src)
        # Read as many rows as the plan says (not the peer's valid count): the
        # checker must not trust the metadata it is checking.
        arrays = tuple(ring.get_rows(src, f, slot, 0, valid) for f in ("x", "x_sf", "topk_idx", "topk_weights"))
        return meta, arrays

    def consumer(self, plan):
        ring, R = self.ring, self.ring.layout.num_ranks
        by_ready = self.cfg.stress.source_order == "ready"
        for c in range(plan.num_chunks):
            yield from self.delay(self.cfg.stress.consumer_delay)
            pending = list(range(R))
            while pending:
                t0 = time.monotonic()

                def ready(src):
                    try:
                        return ring.gen_state(src, c) is GenState.READY
                    except ProtocolViolation as exc:
                        self.violation("generation", str(exc))
                        return True

                if by_ready:
                    # RFC later optimisation: handle every source whose chunk c is ready, in any
                    # order, instead of waiting for the sources in rank order. The ready set is
                    # taken from the poll that ended the wait (each generation read once, so a
                    # violating word is recorded once).
                    batch = []

                    def any_ready():
                        batch[:] = [s for s in pending if ready(s)]
                        return bool(batch)

                    yield from self.wait(any_ready, f"generations of any of sources {pending} chunk {c}")
                    if any(p < batch[-1] and p not in batch for p in pending):
                        self.res.sources_out_of_rank_order += 1  # a later rank's chunk went before a lower one
                else:
                    yield from self.wait(lambda s=pending[0]: ready(s), f"generations of source {pending[0]} chunk {c}")
                    batch = [pending[0]]
                t_acq = time.monotonic()
                for src in batch:
                    pending.remove(src)
                    self.acquire_waits.append(t_acq - t0)
                    yield from self._consume_one(src, c, plan, t_acq)

    def _consume_one(self, src, c, plan, t_acq):
        ring = self.ring
        self.maybe_fault("consume", c)
        meta, arrays = self._read(src, c, plan)
        pub_ns = max(int(meta[4]), int(meta[6]))
        if pub_ns:
            self.publish_to_acquire.append(max(0.0, t_acq - pub_ns / 1e9))
        ok = self._check(src, c, plan, meta, arrays, "read")
        self.res.tokens_checked += int(arrays[0].shape[0])
        yield from self.delay(self.cfg.stress.read_hold)
        if ok and self.cfg.stress.read_hold.max_s > 0:
            meta2, arrays2 = self._read(src, c, plan)
            self._check(src, c, plan, meta2, arrays2, "after hold")
        self.maybe_fault("ack", c)
        ring.ack(src, c)
        if src == self.me:
            self.own_acked = c
        self.res.chunks_consumed += 1
        yield


def stress_layout(cfg: Config, num_ranks: int) -> RingLayout:
    """The ring of ``streamring stress`` for ``num_ranks`` ranks (its ``nbytes`` is the symmetric heap per rank)."""
    return RingLayout(num_ranks=num_ranks, num_slots=cfg.ring.num_slots, tokens_per_slot=cfg.ring.tokens_per_slot,
                      hidden=STRESS_HIDDEN, topk=STRESS_TOPK, num_experts=STRESS_EXPERTS)


#: Bytes of the stop word region (one uint64, see :class:`_StopFlag`).
STOP_REGION_BYTES = 8


def stress_heap_bytes(cfg: Config, num_ranks: int) -> int:
    """Symmetric bytes every rank of ``streamring stress`` allocates (ring + stop word)."""
    return stress_layout(cfg, num_ranks).nbytes + STOP_REGION_BYTES



def check_stress_job(cfg: Config, num_ranks: int) -> None:
    """Every check of ``cfg.stress`` that needs the number of ranks; raises :class:`ConfigError`.

    The same checks run before the ranks start (the CLI) and on every rank (a library caller).
    """
    st, R = cfg.stress, num_ranks
    per_rank(st.chunks_per_rank, R, "stress.chunks_per_rank")
    tpc = per_rank(st.tokens_per_chunk if st.tokens_per_chunk is not None else cfg.ring.tokens_per_slot, R,
                   "stress.tokens_per_chunk")
    if any(t > cfg.ring.tokens_per_slot or t < 0 for t in tpc):
        raise ConfigError(f"stress.tokens_per_chunk must be in [0, ring.tokens_per_slot={cfg.ring.tokens_per_slot}], "
                          f"got {tpc}")
    if st.partial_last > cfg.ring.tokens_per_slot:
        raise ConfigError(f"stress.partial_last must be in [-1, ring.tokens_per_slot={cfg.ring.tokens_per_slot}], "
                          f"got {st.partial_last}")
    if st.fault is not None and st.fault.rank >= R:
        raise ConfigError(f"stress.fault.rank must be in [0, {R}) (the job has {R} ranks), got {st.fault.rank}")
    if any(r >= R for r in st.stragglers):
        raise ConfigError(f"stress.stragglers keys must be ranks in [0, {R}), got {sorted(st.stragglers)}")


class StressStopped(Exception):
    """Another rank (or this one) recorded a violation: the epoch stops instead of running into the watchdog."""


class _StopFlag:
    """One symmetric word per rank: set on every rank by the first rank that records a violation.

    A mutated protocol often wedges the ring after its first bad read (an early
    acknowledgement is cleared with the previous chunk's mask, so a later drain never
    completes). Without this word every rank would sit in a wait until the watchdog and
    the violations it had recorded would never be reported. Each rank's waits poll its
    own word (rate-limited) and stop the epoch when it is set; all ranks then meet at the
    epoch's barrier and report.
    """

    POLL_S = 0.005

    def __init__(self, heap: SymmetricHeap):
        self.heap = heap
        self.region = heap.alloc("stress-stop", STOP_REGION_BYTES)
        self.raised = False
        self._next_poll = 0.0

    def raise_everywhere(self) -> None:
        """Set the word on every rank (once)."""
        if self.raised:
            return
        self.raised = True
        for pe in range(self.heap.num_ranks):
            self.heap.signal_op(self.region, 0, 1, SignalOp.SET, pe)

    def is_set(self, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now < self._next_poll:
            return self.raised
        self._next_poll = now + self.POLL_S
        self.raised |= self.heap.signal_fetch(self.region, 0) != 0
        return self.raised

    def close(self) -> None:
        self.heap.free(self.region)


def _my_tokens(cfg: Config, chunks: int, tokens_per_chunk: int) -> int:
    """This rank's tokens: full chunks of ``tokens_per_chunk`` tokens (0 tokens -> zero-token chunks) and a partial
    last one. The ring packs tokens densely, so a rank with fewer tokens per chunk than ``tokens_per_slot`` simply has
    fewer chunks of tokens; to keep ``chunks_per_rank`` meaning what it says it gets ``chunks`` full slots (then the
    trimmed last one)."""
    last = cfg.stress.partial_last if cfg.stress.partial_last >= 0 else cfg.ring.tokens_per_slot
    if chunks == 0 or tokens_per_chunk == 0:
        return 0
    return (chunks - 1) * cfg.ring.tokens_per_slot + min(last, tokens_per_chunk)


def _record_waits(res: RankResult, roles) -> None:
    """The acquire, reuse and publish-to-acquire waits the roles measured, as medians and maxima."""
    res.acquire_wait_median_s = _med(roles.acquire_waits)
    res.acquire_wait_max_s = max(roles.acquire_waits, default=0.0)
    res.reuse_wait_median_s = _med(roles.reuse_waits)
    res.reuse_wait_max_s = max(roles.reuse_waits, default=0.0)
    res.publish_to_acquire_median_s = _med(roles.publish_to_acquire)
    res.publish_to_acquire_max_s = max(roles.publish_to_acquire, default=0.0)


def run_stress(heap: SymmetricHeap, cfg: Config, progress=None) -> RankResult:
    """Run the stress configuration on this rank; collective over all ranks.

    ``progress``: an object whose ``what`` is set as each epoch starts (rank 0's progress lines); ``None``:
    nothing is told.

    A violation on any rank stops every rank at the end of the current epoch's work
    that does not wait on the broken protocol, and the results are reported (the
    ``stopped_early`` field), instead of every rank waiting for its watchdog.
    """
    st = cfg.stress
    R, me = heap.num_ranks, heap.rank
    check_stress_job(cfg, R)
    layout = stress_layout(cfg, R)
    ring = Ring(heap, layout, wait_timeout_s=cfg.wait_timeout_s, inject=Inject(st.inject),
                inject_delay_s=st.inject_delay_s)
    stop = _StopFlag(heap)
    chunks = per_rank(st.chunks_per_rank, R, "stress.chunks_per_rank")
    tpc = per_rank(st.tokens_per_chunk if st.tokens_per_chunk is not None else cfg.ring.tokens_per_slot, R,
                   "stress.tokens_per_chunk")
    n = chunks[me]
    my_tokens = _my_tokens(cfg, n, tpc[me])
    res = RankResult(rank=me, heap=heap.memory_kind)
    rng = random.Random(st.seed * 1000003 + me)
    roles = _Roles(ring, cfg, res, rng, stop)
    t0 = time.monotonic()
    for e in range(1, st.epochs + 1):
        if progress is not None:
            progress.what = f"epoch {e} of {st.epochs}, {n} chunks per rank on rank {me}"
        epoch = ring.last_epoch + 1
        plan = ring.begin_stream(epoch, my_tokens)
        roles.own_acked = -1
        published_before = res.chunks_published
        order = ["route", "layout"]
        rng.shuffle(order)
        try:
            run_roles([roles.producer(order[0], plan), roles.producer(order[1], plan), roles.consumer(plan)], heap)
            run_roles([roles.drain()], heap)  # ring.end_stream(), stepped so that a stop word ends it
        except StressStopped:
            ring.abort_stream("a violation stopped the stress run")
        res.ring_wraps += (res.chunks_published - published_before) // layout.num_slots
        # The next epoch starts on the same buffers without clearing them (ABA check).
        # Every rank, stopped or not, meets here: the stop word is then visible to all.
        heap.barrier(time.monotonic() + cfg.wait_timeout_s)
        if stop.is_set(force=True):
            res.stopped_early = f"epoch {e} of {st.epochs}: a rank recorded a violation"
            break
    res.wall_s = time.monotonic() - t0
    res.bytes_read = ring.stats.bytes_read
    _record_waits(res, roles)
    stop.close()
    ring.close()
    return res


def result_dict(r: RankResult) -> dict:
    return asdict(r)
