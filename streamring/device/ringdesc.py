"""Python mirror of ``csrc/ring_desc.cuh``: the device-visible ring descriptor and status words.

Device layer: knows no protocol. ``LAYOUT_FIELDS`` lists the keys of
``streamring.protocol.RingLayout.descriptor()`` in header order; the protocol
module asserts its descriptor has exactly these keys, and
``tests/test_gpu.py`` parses the header and compares, so the Python and CUDA
sides cannot drift apart.
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

RS_VIOLATIONS, RS_TIMEOUTS, RS_FIRST_ERROR, RS_ABORT, RS_CONSUMED, RS_PUBLISHED, RS_BAD_SEEN, RS_BAD_WANT = range(8)
RS_WORDS = 16
ERROR_NAMES = {1: "acquire timeout", 2: "reuse (ack) timeout", 3: "newer/foreign generation", 4: "payload mismatch",
               5: "metadata mismatch", 6: "double acknowledgement", 7: "drain timeout", 8: "changed while held"}
INJECT_BITS = {"none": 0, "skip-acquire": 1, "signal-before-payload": 2, "skip-ack-wait": 4, "ignore-epoch": 8}
RING_ROUTE, RING_LAYOUT = 0, 1
CLOCK_HZ = 2.0e9  # clock64 cycles per second used for deadlines (H200 boost clock is ~1.98 GHz)


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
    """Raise if ``ring_desc.cuh``'s RingDesc does not mirror ``RingLayout.descriptor()`` + STREAM_FIELDS."""
    path = path or CSRC / "ring_desc.cuh"
    fields = parse_struct_fields(Path(path).read_text())
    names = tuple(n for _, n in fields)
    if names != DESC_FIELDS:
        raise ValueError(f"RingDesc fields {names} != descriptor keys + stream state {DESC_FIELDS}")
    bad = [(t, n) for t, n in fields[: len(LAYOUT_FIELDS)] if t != "int64_t"]
    if bad:
        raise ValueError(f"RingDesc layout fields must be int64_t: {bad}")


def pack_desc(layout, *, epoch_ptr: int, num_chunks: int, status_ptr: int, deadline_cycles: int,
              off_wake: int = -1) -> np.ndarray:
    """The RingDesc of ``layout`` (anything with ``descriptor()``) + stream state as int64 words."""
    d = layout.descriptor()
    if tuple(d) != LAYOUT_FIELDS:
        raise ValueError("RingLayout.descriptor() keys changed: update ring_desc.cuh and gpu.LAYOUT_FIELDS")
    vals = [int(d[k]) for k in LAYOUT_FIELDS] + [int(epoch_ptr), int(num_chunks), int(status_ptr),
                                                 int(deadline_cycles), int(off_wake)]
    return np.array(vals, dtype=np.int64)


def decode_status(words) -> dict:
    w = [int(x) & 0xFFFFFFFFFFFFFFFF for x in words]
    first = w[RS_FIRST_ERROR]
    err = None
    if first:
        code, src, chunk = first & 0xFF, (first >> 8) & 0xFFFF, (first >> 24) & 0xFFFFFFFF
        err = {"code": code, "what": ERROR_NAMES.get(code, "?"), "src": src, "chunk": chunk,
               "seen": hex(w[RS_BAD_SEEN]), "want": hex(w[RS_BAD_WANT])}
    return {"violations": w[RS_VIOLATIONS], "timeouts": w[RS_TIMEOUTS], "aborted": bool(w[RS_ABORT]),
            "consumed": w[RS_CONSUMED], "published": w[RS_PUBLISHED], "first_error": err}
