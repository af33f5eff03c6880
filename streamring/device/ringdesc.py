"""The device-visible ring descriptor and every constant the CUDA side shares with Python.

Device layer: knows no protocol. This module is the ONE definition of

* ``LAYOUT_FIELDS``: the keys of ``streamring.ring.layout.RingLayout.descriptor()`` in the order
  of ``struct RingDesc`` in ``csrc/ring_desc.cuh`` (the protocol asserts its descriptor has
  exactly these keys; :func:`check_header` checks the header before every build);
* the constants of the device protocol: slot metadata words (``META_*``), generation packing
  (``SEQ_BITS``), status words (``RS_*``), error codes (``RE_*``), inject bits (``INJ_*``),
  publication kinds (``RING_ROUTE``/``RING_LAYOUT``), generation classes (``GEN_*``).

``streamring.device.build`` writes them into the generated header ``ring_consts.cuh``
(:func:`consts_header`) that ``ring_desc.cuh`` includes, so the Python and CUDA sides cannot
drift apart: nothing is copied by hand.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

CSRC = Path(__file__).resolve().parent / "csrc"

LAYOUT_FIELDS = (
    "num_ranks", "num_slots", "tokens_per_slot", "hidden", "topk", "num_experts", "mask_words", "sf_cols",
    "off_route_ready_gen", "off_layout_ready_gen", "off_consumed_gen", "off_ack_mask", "off_meta", "off_x",
    "off_x_sf", "off_topk_idx", "off_topk_weights", "off_combine", "stride_x_slot", "stride_x_sf_slot",
    "stride_topk_idx_slot", "stride_topk_weights_slot", "meta_words", "total_bytes",
)
STREAM_FIELDS = ("epoch", "num_chunks", "status", "deadline_cycles", "off_wake", "wait_beacon")
DESC_FIELDS = LAYOUT_FIELDS + STREAM_FIELDS
DESC_INDEX = {name: i for i, name in enumerate(DESC_FIELDS)}
RING_DESC_WORDS = len(DESC_FIELDS)

# -- generations: (epoch << SEQ_BITS) | sequence; sequence = chunk + 1 (0 = never published) ------------------
SEQ_BITS = 32
SEQ_MASK = (1 << SEQ_BITS) - 1
GEN_READY, GEN_OLDER, GEN_VIOLATION = 0, 1, 2  # device form of protocol.GenState

# -- slot metadata words (int64): route owns 0..4, layout owns 5..6 (disjoint: either publish order) -----------
META_WORDS = 8
META_CHUNK, META_BASE, META_VALID, META_ROUTE_GEN, META_ROUTE_NS, META_LAYOUT_GEN, META_LAYOUT_NS = range(7)

# -- publication kinds ---------------------------------------------------------------------------------------
RING_ROUTE, RING_LAYOUT = 0, 1

# -- device status words of a ring (RingDesc.status) ----------------------------------------------------------
RS_VIOLATIONS, RS_TIMEOUTS, RS_FIRST_ERROR, RS_ABORT, RS_CONSUMED, RS_PUBLISHED, RS_BAD_SEEN, RS_BAD_WANT = range(8)
RS_WORDS = 16

# -- the wait beacon (RingDesc.wait_beacon), in pinned host memory: per kind of device wait, the last one that went
#    slow, as 2 words (packed as RS_FIRST_ERROR, then what it waits for) ------------------------------------------
WB_ACQUIRE, WB_ACQUIRE_ANY, WB_ACK, WB_COMBINE = range(4)  # want: generation | pending sources | pending acks | rows
WB_KINDS = ("acquire", "acquire_any", "ack", "combine")
WB_PACKED, WB_WANT = 0, 1
WB_WORDS = 2 * len(WB_KINDS)

# -- error codes of RS_FIRST_ERROR (code | src << 8 | chunk << 24 | (meta word + 1) << 56) ---------------------
ERRORS = {
    "RE_ACQUIRE_TIMEOUT": (1, "acquire timeout"),
    "RE_REUSE_TIMEOUT": (2, "reuse (ack) timeout"),
    "RE_NEWER_GEN": (3, "newer/foreign generation"),
    "RE_PAYLOAD": (4, "payload mismatch"),
    "RE_META": (5, "metadata mismatch"),
    "RE_DOUBLE_ACK": (6, "double acknowledgement"),
    "RE_DRAIN_TIMEOUT": (7, "drain timeout"),
    "RE_CHANGED_WHILE_HELD": (8, "changed while held"),
    "RE_COMBINE_TIMEOUT": (9, "combine arrival timeout"),
    "RE_COMBINE_COUNT": (10, "combine arrival count above expected"),
    # the persistent expert consumer (device/persistent_moe.py): src = -1, chunk = the ready-list position
    "RE_QUEUE_TIMEOUT": (11, "work-queue wait for a ready block timeout"),
    "RE_L1_WAIT_TIMEOUT": (12, "L2 wait for its block's L1 tiles timeout"),
}
ERROR_NAMES = {code: what for code, what in ERRORS.values()}
ERROR_CODES = {name: code for name, (code, _) in ERRORS.items()}
TIMEOUT_CODES = frozenset(ERROR_CODES[n] for n in ("RE_ACQUIRE_TIMEOUT", "RE_REUSE_TIMEOUT", "RE_DRAIN_TIMEOUT",
                                                   "RE_COMBINE_TIMEOUT"))
#: the metadata word an RE_META names (its RS_FIRST_ERROR field), as the errors say it
META_FIELD_NAMES = {META_CHUNK: "chunk index", META_BASE: "token base", META_VALID: "valid count",
                    META_ROUTE_GEN: "route generation", META_LAYOUT_GEN: "layout generation"}
NO_SOURCE = 0xFFFF  # the src of an error that has no single source (the owner's combine): -1 on the device

# -- deliberate mutations of the device protocol (ring.policies.Inject values -> bits) ------------------------------
INJECT_BITS = {"none": 0, "skip-acquire": 1, "signal-before-payload": 2, "skip-ack-wait": 4, "ignore-epoch": 8}

CLOCK_HZ = 2.0e9  # clock64 cycles per second used for deadlines (H200 boost clock is ~1.98 GHz)


def consts_header() -> str:
    """Text of the generated ``ring_consts.cuh`` (every constant above as a ``#define``)."""
    defs = {
        "RING_DESC_WORDS": RING_DESC_WORDS, "RING_DESC_LAYOUT_WORDS": len(LAYOUT_FIELDS),
        "RING_SEQ_BITS": SEQ_BITS, "RING_SEQ_MASK": f"{SEQ_MASK:#x}ull",
        "GEN_READY": GEN_READY, "GEN_OLDER": GEN_OLDER, "GEN_VIOLATION": GEN_VIOLATION,
        "META_WORDS": META_WORDS, "META_CHUNK": META_CHUNK, "META_BASE": META_BASE, "META_VALID": META_VALID,
        "META_ROUTE_GEN": META_ROUTE_GEN, "META_ROUTE_NS": META_ROUTE_NS, "META_LAYOUT_GEN": META_LAYOUT_GEN,
        "META_LAYOUT_NS": META_LAYOUT_NS, "RING_ROUTE": RING_ROUTE, "RING_LAYOUT": RING_LAYOUT,
        "RS_VIOLATIONS": RS_VIOLATIONS, "RS_TIMEOUTS": RS_TIMEOUTS, "RS_FIRST_ERROR": RS_FIRST_ERROR,
        "RS_ABORT": RS_ABORT, "RS_CONSUMED": RS_CONSUMED, "RS_PUBLISHED": RS_PUBLISHED,
        "RS_BAD_SEEN": RS_BAD_SEEN, "RS_BAD_WANT": RS_BAD_WANT, "RS_WORDS": RS_WORDS,
        "WB_ACQUIRE": WB_ACQUIRE, "WB_ACQUIRE_ANY": WB_ACQUIRE_ANY, "WB_ACK": WB_ACK, "WB_COMBINE": WB_COMBINE,
        "WB_PACKED": WB_PACKED, "WB_WANT": WB_WANT,
        **{name: code for name, (code, _) in ERRORS.items()},
        "INJ_SKIP_ACQUIRE": INJECT_BITS["skip-acquire"],
        "INJ_SIGNAL_BEFORE_PAYLOAD": INJECT_BITS["signal-before-payload"],
        "INJ_SKIP_ACK_WAIT": INJECT_BITS["skip-ack-wait"], "INJ_IGNORE_EPOCH": INJECT_BITS["ignore-epoch"],
    }
    lines = ["// GENERATED by streamring/device/build.py from streamring/device/ringdesc.py: do not edit.",
             "#pragma once"]
    lines += [f"#define {k} {v}" for k, v in defs.items()]
    return "\n".join(lines) + "\n"


def parse_struct_fields(text: str, struct: str = "RingDesc") -> list[tuple[str, str]]:
    """``[(type, name), ...]`` of ``struct <struct> { ... };`` in a C header (comments stripped)."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    m = re.search(r"struct\s+" + re.escape(struct) + r"\s*\{(.*?)\};", text, flags=re.S)
    if not m:
        raise ValueError(f"struct {struct} not found")
    fields = []
    for decl in m.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        fm = re.match(r"(.+?)\s*(\**)\s*([A-Za-z_]\w*)$", decl)
        if not fm:
            raise ValueError(f"cannot parse field declaration {decl!r}")
        fields.append(((fm.group(1) + fm.group(2)).replace(" ", ""), fm.group(3)))
    return fields


def check_header(path: Path | None = None) -> None:
    """Raise if ``ring_desc.cuh``'s RingDesc does not mirror ``RingLayout.descriptor()`` + STREAM_FIELDS,
    or if the header defines by hand a constant that the generated header owns."""
    path = Path(path or CSRC / "ring_desc.cuh")
    text = path.read_text()
    fields = parse_struct_fields(text)
    names = tuple(n for _, n in fields)
    if names != DESC_FIELDS:
        raise ValueError(f"RingDesc fields {names} != descriptor keys + stream state {DESC_FIELDS}")
    bad = [(t, n) for t, n in fields[: len(LAYOUT_FIELDS)] if t != "int64_t"]
    if bad:
        raise ValueError(f"RingDesc layout fields must be int64_t: {bad}")
    generated = set(re.findall(r"#define (\w+)", consts_header()))
    copied = generated & set(re.findall(r"#define (\w+)", text))
    if copied:
        raise ValueError(f"{path.name} defines {sorted(copied)} by hand; they are generated into ring_consts.cuh")


def pack_desc(layout, *, epoch_ptr: int, num_chunks: int, status_ptr: int, deadline_cycles: int,
              off_wake: int = -1, wait_beacon_ptr: int = 0) -> np.ndarray:
    """The RingDesc of ``layout`` (anything with ``descriptor()``) + stream state as int64 words.
    ``wait_beacon_ptr``: :data:`WB_WORDS` words of pinned host memory, or 0 (no beacon)."""
    d = layout.descriptor()
    if tuple(d) != LAYOUT_FIELDS:
        raise ValueError("RingLayout.descriptor() keys changed: update ring_desc.cuh and ringdesc.LAYOUT_FIELDS")
    vals = [int(d[k]) for k in LAYOUT_FIELDS] + [int(epoch_ptr), int(num_chunks), int(status_ptr),
                                                 int(deadline_cycles), int(off_wake), int(wait_beacon_ptr)]
    return np.array(vals, dtype=np.int64)


def _decode_packed(first: int) -> dict:
    """``code``, ``what``, ``src``, ``chunk``, ``field`` of an RS_FIRST_ERROR-packed word (non-zero)."""
    code, src, chunk = first & 0xFF, (first >> 8) & 0xFFFF, (first >> 24) & 0xFFFFFFFF
    field = ((first >> 56) & 0xFF) - 1
    return {"code": code, "what": ERROR_NAMES.get(code, "?"), "src": -1 if src == NO_SOURCE else src,
            "chunk": chunk, "field": META_FIELD_NAMES.get(field) if field >= 0 else None}


def decode_beacon(words) -> dict:
    """The wait beacon (:data:`WB_WORDS` words) as ``{kind: wait}`` for each kind of :data:`WB_KINDS` whose
    wait went slow: the wait named as :func:`decode_status` names a first error (``code`` is the timeout
    that wait would record) plus ``want``: the generation (acquire), the mask of sources still pending
    (acquire_any), the mask of ranks whose acknowledgement is pending (ack: ``src`` is the index of that
    64-rank mask word), the rows expected (combine)."""
    w = [int(x) & 0xFFFFFFFFFFFFFFFF for x in words]
    out = {}
    for k, kind in enumerate(WB_KINDS):
        packed = w[2 * k + WB_PACKED]
        if packed:
            out[kind] = {**_decode_packed(packed), "want": w[2 * k + WB_WANT]}
    return out


def decode_status(words) -> dict:
    """The RS_* status words of a ring as a dict (first_error decoded).

    ``first_error``: None, or ``code``, ``what`` (its name), ``src`` (the source PE; -1: none, e.g. the
    owner's combine), ``chunk``, ``field`` (the metadata word an RE_META names, else None), ``seen`` and
    ``want`` (hex: the word the device saw and the one it expected). :func:`describe_status` words it.
    """
    w = [int(x) & 0xFFFFFFFFFFFFFFFF for x in words]
    first = w[RS_FIRST_ERROR]
    err = None
    if first:
        err = {**_decode_packed(first), "seen": hex(w[RS_BAD_SEEN]), "want": hex(w[RS_BAD_WANT])}
    return {"violations": w[RS_VIOLATIONS], "timeouts": w[RS_TIMEOUTS], "aborted": bool(w[RS_ABORT]),
            "consumed": w[RS_CONSUMED], "published": w[RS_PUBLISHED], "first_error": err}


def gen_text(gen: int) -> str:
    """A generation as ``e<epoch>:c<chunk>`` (the protocol's ``gen_str``) and in hex; ``0`` if never set."""
    gen = int(gen) & 0xFFFFFFFFFFFFFFFF
    if gen == 0:
        return "0 (never published)"
    return f"e{gen >> SEQ_BITS}:c{(gen & SEQ_MASK) - 1} ({gen:#x})"


def mask_ranks(mask: int) -> list[int]:
    """The ranks whose bits are set in a 64-bit mask word."""
    return [r for r in range(64) if (mask >> r) & 1]


def describe_status(st: dict, *, pe: int, num_slots: int | None = None, deadline_s: float | None = None) -> str:
    """One line on PE ``pe``'s device status ``st`` (:func:`decode_status`, plus ``bad_routes`` if the
    layer counts them): what the first error waited for or refused, naming the source PE, the chunk and
    the generation; '' when there is no error. Timeouts read ``watchdog: ...`` (as the CPU backend's),
    violations ``device ring violation: ...``."""
    err = st.get("first_error")
    bad_routes = int(st.get("bad_routes") or 0)
    counts = f"violations {st.get('violations', 0)}, timeouts {st.get('timeouts', 0)}" + (
        f", corrupt routes dropped {bad_routes}" if bad_routes else "")
    if err is None:
        if bad_routes:
            return (f"rank {pe}: device ring violation: {bad_routes} routes (topk_idx) from the sources held an "
                    f"expert id outside [-1, num_experts) and were dropped ({counts})")
        return ""
    code, src, chunk = err["code"], err["src"], err["chunk"]
    seen, want = int(err["seen"], 16), int(err["want"], 16)
    slot = f", slot {chunk % num_slots}" if num_slots else ""
    waited = f"waited {deadline_s:g}s (wait_timeout_s={deadline_s:g})" if deadline_s else "waited past its deadline"
    name = {c: n for n, c in ERROR_CODES.items()}.get(code, "")
    if name == "RE_ACQUIRE_TIMEOUT" and want == 0:  # ready order: `seen` is the mask of sources still pending
        what = (f"watchdog: the device {waited} for chunk {chunk} of any of the source ranks "
                f"{mask_ranks(seen)} (ready source order; pending mask {seen:#x})")
    elif name == "RE_ACQUIRE_TIMEOUT":
        what = (f"watchdog: the device {waited} for route+layout generation {gen_text(want)} of source rank {src} "
                f"(chunk {chunk}{slot}); it last saw {gen_text(seen)}: rank {src} is dead, stopped or stuck")
    elif name in ("RE_REUSE_TIMEOUT", "RE_DRAIN_TIMEOUT"):
        step = "the reuse of my slot" if name == "RE_REUSE_TIMEOUT" else "the end-of-stream drain"
        what = (f"watchdog: the device {waited} in {step} for the acknowledgements of my chunk {chunk}{slot} from "
                f"ranks {mask_ranks(want & ~seen)} (ack mask {seen:#x} of {want:#x}): they are dead, stopped or "
                f"stuck")
    elif name == "RE_COMBINE_TIMEOUT":
        what = (f"watchdog: the device {waited} for the result rows of my chunk {chunk}: {seen} of {want} arrived "
                f"(a consumer rank is dead, stopped or stuck)")
    elif name == "RE_META":
        what = (f"device ring violation: metadata of source rank {src}, chunk {chunk}{slot}: "
                f"{err.get('field') or 'a word'} = {seen:#x}, expected {want:#x}")
    elif name == "RE_NEWER_GEN":
        what = (f"device ring violation: source rank {src} signalled generation {gen_text(seen)} for chunk "
                f"{chunk}{slot} while {gen_text(want)} was expected (a newer or foreign generation)")
    elif name == "RE_COMBINE_COUNT":
        what = (f"device ring violation: {seen} result rows arrived for my chunk {chunk}, {want} expected "
                f"(a count carried over or a row sent twice)")
    else:
        who = f"source rank {src}" if src >= 0 else "no single source"
        what = (f"device ring violation: {err['what']} ({who}, chunk {chunk}{slot}; seen {seen:#x}, "
                f"expected {want:#x})")
    return f"rank {pe}: {what} ({counts})"
