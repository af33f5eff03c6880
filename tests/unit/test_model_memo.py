"""The model checker's memoised expansion (streamring.verify.memo) against the model's own expansion."""

import random

import pytest

from streamring.ring.policies import INJECT_MODES
from streamring.verify import search
from streamring.verify.codec import FieldOverflow, StateCodec
from streamring.verify.memo import ExpansionMemo, FootprintError, _Unread
from streamring.verify.names import EP_INJECT_MODES
from streamring.verify.search import make_model
from streamring.verify.state import ModelConfig, parse_inject
from streamring.verify.steps import RingModel

CONFIGS = ([dict(inject=m) for m in ("none",) + INJECT_MODES]
           + [dict(inject=m, source_order="ready", slots=1) for m in ("none", "skip-ack-wait")]
           + [dict(layer="ep", chunks=2, epochs=2, slots=1, inject=m) for m in ("none",) + EP_INJECT_MODES]
           + [dict(layer="ep", chunks=1, source_order="ready", inject="skip-ack-wait")])


def _states(model, near: int = 200, walks: int = 6):
    """States of the model's own expansion: the first ``near`` breadth-first, and those along
    ``walks`` random runs to a state without successors (every epoch, every phase)."""
    seen, order = {model.initial()}, [model.initial()]
    for st in order:
        for t in model.successors(st):
            if t.state is not None and t.state not in seen and len(order) < near:
                seen.add(t.state)
                order.append(t.state)
    rng = random.Random(7)
    for _ in range(walks):
        st = model.initial()
        while nxt := [t.state for t in model.successors(st) if t.state is not None]:
            st = rng.choice(nxt)
            if st not in seen:
                seen.add(st)
                order.append(st)
    return order


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_memo_gives_the_models_expansion(kw):
    cfg = ModelConfig(**{**kw, "inject": parse_inject(kw["inject"])})
    model = make_model(cfg)
    memo = ExpansionMemo(model)
    codec = memo.codec
    for st in _states(model):
        x = codec.encode(st)
        assert codec.decode(x) == st
        for want, got in zip(model.expand(st), memo.expand(x), strict=True):
            assert got[1:] == want[1:]
            assert [(s.pid, s.desc, s.violation is None) for s in got[0]] == [
                (t.pid, t.desc, t.violation is None) for t in want[0]]
            for s, t in zip(got[0], want[0]):
                if t.violation is None:
                    assert codec.decode(s.apply(x)) == t.state
                else:
                    assert s.trans().violation.message == t.violation.message


def test_a_footprint_without_a_field_the_process_reads_fails_loudly():
    class Forgetful(RingModel):
        def footprint(self, pid):  # the consumers forget their generation words
            fp = super().footprint(pid)
            return tuple(f for f in fp if not self.RDY <= f < self.ACK) if pid % 6 == 2 else fp

    model = Forgetful(ModelConfig())
    with pytest.raises(FootprintError, match="outside"):
        memo = ExpansionMemo(model)
        memo.expand(memo.codec.encode(model.initial()))


@pytest.mark.parametrize("use", [lambda v: v + 1, lambda v: 1 + v, lambda v: v == 0, lambda v: v < 0,
                                 lambda v: bool(v), lambda v: hash(v), lambda v: [0][v], lambda v: f"{v}",
                                 lambda v: v & 1, lambda v: 1 >> v, lambda v: divmod(v, 2)])
def test_a_placeholder_refuses_every_use(use):
    with pytest.raises(FootprintError):
        use(_Unread(3))


def test_a_field_copied_into_a_step_without_being_read_fails_loudly():
    class Copier(RingModel):
        def _expand_drain(self, st, r, k):  # a description that carries a field outside the footprint
            trans, *rest = super()._expand_drain(st, r, k)
            return (tuple(type(t)(t.pid, t.desc + (st[self.ACK],), t.state, t.violation) for t in trans), *rest)

    model = Copier(ModelConfig())
    memo = ExpansionMemo(model)
    x = memo.codec.encode(model.initial())
    with pytest.raises(FootprintError, match="outside"):
        for _ in range(20):  # until a producer's store is pending and its drain can move
            x = [s for entry in memo.expand(x) for s in entry[0]][0].apply(x)


def test_codec_round_trip_and_overflow():
    narrow, wide = StateCodec(3, bits=8), StateCodec(3, bits=16)
    for v in range(256):
        for codec in (narrow, wide):
            assert codec.decode(codec.encode((v, -v, 1 << 40))) == (v, -v, 1 << 40)
    with pytest.raises(FieldOverflow, match="field 0"):
        narrow.encode((256, 0, 1 << 40))
    assert wide.decode(wide.encode((256, 0, 1 << 40))) == (256, 0, 1 << 40)


def test_the_search_starts_over_with_wider_fields_when_a_field_overflows(monkeypatch):
    cfg = ModelConfig(chunks=1, epochs=1)
    want = search.explore(make_model(cfg), cfg)
    widths = []

    class Overflowing(ExpansionMemo):  # its 8-bit codes hold only 2 values a field
        def __init__(self, model, bits=8):
            super().__init__(model, bits)
            widths.append(bits)
            if bits == 8:
                self.codec.code_mask = 1

    monkeypatch.setattr(search, "ExpansionMemo", Overflowing)
    got = search.explore(make_model(cfg), cfg)
    assert widths == [8, 16]
    assert (len(got.codes), got.transitions) == (len(want.codes), want.transitions)
    assert list(got.states) == list(want.states)
