"""The model checker's state: its configuration, properties and the flat tuple a state is.

``streamring model-check`` checks these properties of the ring protocol
(:mod:`streamring.ring.protocol`; the steps are in :mod:`streamring.verify.steps`):

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
    (4) :func:`ring.layout.classify_gen` never says ``VIOLATION`` (the runtime
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
is ``classify_gen``, looked up when a model is built (a patched
function is what gets checked); the chunk count is ``StreamPlan.num_chunks``
(the maximum over ranks, rule 7: odd ranks get one token fewer, so their last
chunk has zero tokens, and they still publish every chunk); the full ack mask
is ``RingLayout.full_mask(word)`` over ``RingLayout.mask_words``; the slot is
``chunk % num_slots``; the mutations are ``ring.policies.Inject`` /
``ring.policies.INJECT_MODES``, each changing exactly the step ``protocol.Ring``
changes for it.


State layout
============
A state is a flat tuple of ints (hashable; one int object per generation, shared by every state
that holds it), laid out by :class:`RingState`: per rank its epoch, whether it ended the epoch,
its producers' and consumer's program counters and pending stores; per producer and slot the
payload cells; per target, kind, producer and slot the generation words; per owner and slot the
ack mask and the generation whose acks it collected; per consumer (``source_order='ready'``)
the source it holds and the sources of its chunk it has acknowledged. The expert-parallel layer
(:mod:`streamring.verify.ep`) appends its fields after these. For the partial-order reduction
every modelled variable is also a bit (``b_*``), so that a step's read and write sets are masks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ring import layout as ring_layout
from ..ring.layout import MAX_EPOCH, SF_BLOCK, GenState, RingLayout, StreamPlan, gen_str, split_gen
from ..ring.policies import INJECT_MODES, SOURCE_ORDERS, Inject
from .names import EP_INJECT_MODES, LAYERS, MODEL_INJECT_MODES, EPInject

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
    """The ``ring.policies.Inject`` or :class:`EPInject` named ``value`` (None or "none": no mutation)."""
    if not value or value == "none":
        return Inject.NONE
    if value in EP_INJECT_MODES:
        return EPInject(value)
    if value in INJECT_MODES:
        return Inject(value)
    raise ValueError(f"--inject must be one of {MODEL_INJECT_MODES}, got {value!r}")


def _g(gen: int) -> str:
    return gen_str(gen) if gen else "0 (never written)"


def _cv(v: int) -> str:
    """A combine entry's value: which epoch, chunk and rank wrote it."""
    if not v:
        return "0 (never written)"
    return f"rank {(v & 0xFF) - 1}'s result for chunk {(v >> 8) & 0xFF} of epoch {v >> 16}"


def _cval(e: int, c: int, d: int) -> int:
    return (e << 16) | (c << 8) | (d + 1)


def _older_epoch(seen: int, expected: int) -> bool:
    return bool(seen) and split_gen(seen)[0] < split_gen(expected)[0]


@dataclass
class ModelConfig:
    ranks: int = 2
    slots: int = 2
    chunks: int = 3
    epochs: int = 2
    inject: Inject = Inject.NONE
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
        if isinstance(self.epochs, int) and self.epochs > MAX_EPOCH:
            problems.append(f"--epochs must be <= {MAX_EPOCH}")
        if self.layer not in LAYERS:
            problems.append(f"--layer must be one of {LAYERS}, got {self.layer!r}")
        if self.por is None:
            # the ep layer's full graph is far larger (2 ranks x 1 slot x 2 chunks x 1 epoch: 669,240
            # states): it always uses the reduction unless told otherwise
            self.por = self.layer == "ep" or not (self.ranks <= 2 and self.slots <= 2 and self.chunks <= 3
                                                  and self.epochs <= 2)
        if not isinstance(self.inject, (Inject, EPInject)):
            problems.append(f"inject must be a ring.policies.Inject or verify.names.EPInject, got {self.inject!r}")
        elif isinstance(self.inject, EPInject) and self.inject is not EPInject.NONE and self.layer != "ep":
            problems.append(f"--inject {self.inject.value} breaks a handoff of the expert-parallel layer: "
                            f"it needs --layer ep")
        if self.source_order not in SOURCE_ORDERS:
            problems.append(f"--source-order must be one of {SOURCE_ORDERS}, got {self.source_order!r}")
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


class RingState:
    """The ring protocol's state space: the flat layout of a state, the modelled variables as bits,
    and what the steps ask of a state (module docstring, "State layout").

    Processes (pid) of rank ``r``: ``6r`` route producer, ``6r+1`` layout producer, ``6r+2``
    consumer, ``6r+3``/``6r+4`` pending-store drain of route/layout, ``6r+5`` end of epoch;
    ``6R`` (``BEGIN``) is the collective begin of the next epoch. A layer that adds processes or
    fields extends :meth:`_init_layer` (fields, before the bits) and :meth:`_init_bits`.
    """

    LAYER = "ring"

    def __init__(self, cfg: ModelConfig):
        cfg.validate()
        if cfg.layer != self.LAYER:
            raise ValueError(f"{type(self).__name__} models --layer {self.LAYER}, got --layer {cfg.layer} "
                             f"(search.make_model picks the model of a layer)")
        self.cfg = cfg
        R, S, E = cfg.ranks, cfg.slots, cfg.epochs
        self.R, self.S, self.E = R, S, E
        # the ring's mutation (ring.policies.Inject); a layer's own mutation is the layer's business
        self.inject = inject = cfg.inject if isinstance(cfg.inject, Inject) else Inject.NONE
        self.skip_acquire = inject is Inject.SKIP_ACQUIRE
        self.skip_ack_wait = inject is Inject.SKIP_ACK_WAIT
        # Looked up now (not at import) so that the function the runtime uses is the one checked.
        self._classify = ring_layout.classify_gen
        self._ignore_epoch = inject is Inject.IGNORE_EPOCH
        self._cmemo: dict = {}
        self._init_plan()
        self._init_fields()
        self._init_layer()
        self._init_bits()
        self._fut_cache: dict = {}

    def _init_plan(self) -> None:
        """Sizes and generations as the runtime derives them (module docstring, "Derived from the
        runtime"): the full ack mask, each epoch's ``StreamPlan``, the chunk count, the generations,
        each slot's last chunk."""
        cfg, R, S, E = self.cfg, self.R, self.S, self.E
        layout = RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=1, hidden=SF_BLOCK, topk=1,
                              num_experts=1)
        self.mask_words = layout.mask_words
        self.full = tuple(layout.full_mask(w) for w in range(layout.mask_words))
        tokens = tuple(cfg.chunks - (r % 2 if R > 1 else 0) for r in range(R))
        self.plans = [None] + [StreamPlan(epoch=e, tokens_per_rank=tokens, tokens_per_slot=1)
                               for e in range(1, E + 1)]
        self.C = C = self.plans[1].num_chunks
        if C != cfg.chunks:
            raise ValueError(f"StreamPlan.num_chunks = {C}, expected {cfg.chunks}")
        # one int object per generation, shared by every state that holds it
        self.gens = [None] + [tuple(self.plans[e].gen(c) for c in range(C)) for e in range(1, E + 1)]
        self.last_chunk = [max((c for c in range(C) if c % S == s), default=-1) for s in range(S)]

    def _init_fields(self) -> None:
        """The producer's and the consumer's steps per chunk, the flat layout of a state (module
        docstring, "State layout") and the processes."""
        R, S, C = self.R, self.S, self.C
        pubs = [("publish", t) for t in range(R)]
        if self.inject is Inject.SIGNAL_BEFORE_PAYLOAD:
            self.steps = [("reserve", 0)] + pubs + [("write", 0), ("fence", 0)]
        else:
            self.steps = [("reserve", 0), ("write", 0)] + pubs
        self.nsteps = len(self.steps)
        self.pdone = C * self.nsteps
        # consumer steps per (chunk, src): acquire (+ the reads in the hold window), ack
        self.NPH = 2
        self.cdone = C * R * self.NPH
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
        self.ready_order = self.cfg.source_order == "ready"
        self.all_src = (1 << R) - 1
        self.NP = 6 * R + 1
        self.BEGIN = 6 * R
        # what a finished role waits for before it moves again: the collective begin
        self.next_epoch_wait = [(self.BEGIN,)] * R
        # a rank's own roles: its end of epoch waits for every one of them
        self.roles_of = [(6 * r, 6 * r + 1, 6 * r + 2) for r in range(R)]

    def _init_layer(self) -> None:
        """A layer's own fields and processes (appended after the ring's; the ring has none)."""

    # -- variables as bits, for the dependency relation -------------------------------------
    def _bit(self) -> int:
        """A new variable's bit."""
        self._nbits += 1
        return 1 << (self._nbits - 1)

    def _init_bits(self) -> None:
        R, S = self.R, self.S
        self._nbits = 0
        new = self._bit
        self.b_rdy = [[[[new() for _ in range(S)] for _ in range(R)] for _ in range(2)] for _ in range(R)]
        self.b_pay = [[[new() for _ in range(S)] for _ in range(2)] for _ in range(R)]
        self.b_pend = [[new() for _ in range(2)] for _ in range(R)]
        self.b_ack = [[new() for _ in range(S)] for _ in range(R)]
        self.b_col = [[new() for _ in range(S)] for _ in range(R)]
        self.b_pos = [[[new() for _ in range(S)] for _ in range(R)] for _ in range(R)]  # [d][r][s] held?
        self.b_done = [new() for _ in range(self.NP)]
        self.b_end = [new() for _ in range(R)]
        self.ALL = (1 << self._nbits) - 1
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
        self.rank_of = [p // 6 for p in range(6 * R)] + [-1]  # BEGIN: no rank

    # -- helpers ---------------------------------------------------------------------------
    def initial(self) -> tuple:
        st = [0] * self.NFIELDS
        for r in range(self.R):
            st[self.EP + r] = 1
            st[self.PSL + 2 * r] = st[self.PSL + 2 * r + 1] = -1
            st[self.HLD + r] = -1
        return tuple(st)

    def classify(self, observed: int, expected: int) -> GenState:
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
                    f"expected {gen_str(g2)}")), (d, k, r, c2, s, v)
        return None
