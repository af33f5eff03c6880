"""Single-process unit tests of the protocol's pure parts (generations, layout, plan)."""

import itertools

import pytest

from streamring.ring.layout import (
    ALIGN, MAX_EPOCH, GenState, RingLayout, StreamPlan, classify_gen, gen_str, make_gen, split_gen,
)


def test_generation_roundtrip_and_order():
    for e, s in [(1, 1), (7, 123456), (MAX_EPOCH, 2**32 - 1)]:
        assert split_gen(make_gen(e, s)) == (e, s)
        assert make_gen(e, s) < 2**63
    # every generation of a later epoch is larger than every one of an earlier epoch
    assert make_gen(2, 1) > make_gen(1, 2**32 - 1)
    assert gen_str(make_gen(3, 5)) == "e3:c4" and gen_str(0) == "0"


@pytest.mark.parametrize("epoch,seq", [(0, 1), (1, 0), (MAX_EPOCH + 1, 1), (1, 2**32)])
def test_generation_rejects_out_of_range(epoch, seq):
    with pytest.raises(ValueError):
        make_gen(epoch, seq)


def test_classify_generations():
    S = 4
    g = make_gen(3, 10)
    assert classify_gen(g, g, S) is GenState.READY
    assert classify_gen(0, g, S) is GenState.OLDER  # never published
    assert classify_gen(make_gen(3, 6), g, S) is GenState.OLDER  # previous lap of the slot
    assert classify_gen(make_gen(2, 10), g, S) is GenState.OLDER  # same chunk, earlier epoch (ABA leftover)
    assert classify_gen(make_gen(2, 99), g, S) is GenState.OLDER  # any earlier epoch
    assert classify_gen(make_gen(3, 14), g, S) is GenState.VIOLATION  # next lap already
    assert classify_gen(make_gen(3, 7), g, S) is GenState.VIOLATION  # another slot's sequence
    assert classify_gen(make_gen(4, 2), g, S) is GenState.VIOLATION  # future epoch
    # the ignore-epoch mutation lets the ABA leftover pass as ready
    assert classify_gen(make_gen(2, 10), g, S, ignore_epoch=True) is GenState.READY


@pytest.mark.parametrize("R,S,C,H,K", [(1, 1, 1, 128, 1), (3, 4, 5, 256, 3), (65, 2, 7, 384, 8), (130, 3, 1, 128, 2)])
def test_layout_regions_disjoint_aligned(R, S, C, H, K):
    L = RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=C, hidden=H, topk=K, num_experts=max(K, 8),
                   with_combine=True)
    offs = L.offsets
    spans = []
    for name, size in L._sizes():
        assert offs[name] % ALIGN == 0
        spans.append((offs[name], offs[name] + size))
    for (a0, a1), (b0, b1) in itertools.combinations(spans, 2):
        assert a1 <= b0 or b1 <= a0
    assert L.nbytes >= max(b for _, b in spans)
    assert L.mask_words == (R + 63) // 64
    # every rank has exactly one bit across the mask words
    full = sum(bin(L.full_mask(w)).count("1") for w in range(L.mask_words))
    assert full == R
    # word offsets stay inside their region
    assert L.route_gen_off(R - 1, S - 1) + 8 <= offs["route_ready_gen"] + R * S * 8
    assert L.ack_word_off(S - 1, L.mask_words - 1) + 8 <= offs["ack_mask"] + S * L.mask_words * 8
    d = L.descriptor()
    assert d["off_x"] == offs["x"] and d["total_bytes"] == L.nbytes and d["mask_words"] == L.mask_words


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_slots=0), "ring.num_slots"),
    (dict(tokens_per_slot=0), "ring.tokens_per_slot"),
    (dict(hidden=100), "hidden"),
    (dict(topk=9), "topk"),
])
def test_layout_rejects_bad_sizes(kwargs, field):
    base = dict(num_ranks=2, num_slots=2, tokens_per_slot=4, hidden=128, topk=2, num_experts=8)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        RingLayout(**base)


def test_stream_plan_uneven_and_partial():
    p = StreamPlan(epoch=1, tokens_per_rank=(0, 5, 17), tokens_per_slot=8)
    assert p.num_chunks == 3  # the longest rank decides; others pad with empty chunks
    assert p.chunk_tokens(0, 0) == (0, 0)
    assert p.chunk_tokens(1, 0) == (0, 5) and p.chunk_tokens(1, 1) == (8, 0)
    assert p.chunk_tokens(2, 2) == (16, 1)
    assert StreamPlan(epoch=1, tokens_per_rank=(0, 0), tokens_per_slot=8).num_chunks == 0
