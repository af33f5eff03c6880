"""The device-visible ring descriptor and every constant the CUDA side shares with Python.

Device layer: knows no protocol. This module is the ONE definition of

* ``LAYOUT_FIELDS``: the keys of ``streamring.protocol.RingLayout.descriptor()`` in the order
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
STREAM_FIELDS = ("epoch", "num_chunks", "status", "deadline_cycles", "off_wake")
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

# -- error codes of RS_FIRST_ERROR (code | src << 8 | chunk << 24) -------------------------------------------
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

# -- deliberate mutations of the device protocol (protocol.Inject values -> bits) ------------------------------
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
              off_wake: int = -1) -> np.ndarray:
    """The RingDesc of ``layout`` (anything with ``descriptor()``) + stream state as int64 words."""
    d = layout.descriptor()
    if tuple(d) != LAYOUT_FIELDS:
        raise ValueError("RingLayout.descriptor() keys changed: update ring_desc.cuh and ringdesc.LAYOUT_FIELDS")
    vals = [int(d[k]) for k in LAYOUT_FIELDS] + [int(epoch_ptr), int(num_chunks), int(status_ptr),
                                                 int(deadline_cycles), int(off_wake)]
    return np.array(vals, dtype=np.int64)


def decode_status(words) -> dict:
    """The RS_* status words of a ring as a dict (first_error decoded)."""
    w = [int(x) & 0xFFFFFFFFFFFFFFFF for x in words]
    first = w[RS_FIRST_ERROR]
    err = None
    if first:
        code, src, chunk = first & 0xFF, (first >> 8) & 0xFFFF, (first >> 24) & 0xFFFFFFFF
        err = {"code": code, "what": ERROR_NAMES.get(code, "?"), "src": src, "chunk": chunk,
               "seen": hex(w[RS_BAD_SEEN]), "want": hex(w[RS_BAD_WANT])}
    return {"violations": w[RS_VIOLATIONS], "timeouts": w[RS_TIMEOUTS], "aborted": bool(w[RS_ABORT]),
            "consumed": w[RS_CONSUMED], "published": w[RS_PUBLISHED], "first_error": err}
