"""Property-based tests (hypothesis) of the config loader and the protocol's pure API.

Every input either loads/works or is rejected with ConfigError/ValueError that
names a field: never another exception type.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamring.config import DEFAULT_CONFIG, ConfigError, load_config
from streamring.ring.layout import GenState, RingLayout, classify_gen, make_gen, split_gen

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.integers(-5, 50), max_size=5))


def _paths(tree, prefix=""):
    for k, v in tree.items():
        p = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _paths(v, p + ".")
        else:
            yield p


KEYS = sorted(_paths(DEFAULT_CONFIG)) + ["ring.bogus", "nope", "stress.fault", "stress.stragglers"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(KEYS), SCALARS), max_size=6))
def test_config_overrides_validate_or_name_the_field(pairs):
    overrides = []
    for key, value in pairs:
        if isinstance(value, str):
            value = repr(value)  # quote strings for YAML
        elif value is None:
            value = "null"
        elif isinstance(value, bool):
            value = "true" if value else "false"
        overrides.append(f"{key}={value}")
    try:
        cfg = load_config(None, overrides)
    except ConfigError as exc:
        text = str(exc)
        assert text.startswith("invalid config") or "--set" in text
        assert any(key.split(".")[0] in text for key, _ in pairs) or "--set" in text
        return
    # accepted: every value is within its declared constraints
    assert cfg.ring.num_slots >= 1 and cfg.ring.tokens_per_slot >= 1
    assert cfg.layer.hidden % 128 == 0 and 1 <= cfg.layer.topk <= cfg.layer.num_experts
    assert cfg.backend in ("cpu", "nvshmem")


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200), st.integers(0, 70), st.integers(-3, 40), st.integers(0, 600), st.integers(-2, 12),
       st.integers(0, 20))
def test_layout_accepts_or_rejects_cleanly(R, S, C, H, K, E):
    try:
        L = RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=C, hidden=H, topk=K, num_experts=E)
    except ValueError as exc:
        assert any(f in str(exc) for f in ("num_slots", "tokens_per_slot", "hidden", "topk", "num_experts",
                                           "num_ranks"))
        return
    assert L.nbytes > 0 and L.mask_words * 64 >= R
    assert L.x_off(S - 1, C - 1) + H <= L.offsets["x_sf"]


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 2**31 - 1), st.integers(1, 2**32 - 1), st.integers(0, 2**63 - 1), st.integers(1, 64))
def test_classify_never_accepts_another_generation(epoch, seq, observed, S):
    g = make_gen(epoch, seq)
    state = classify_gen(observed, g, S)
    assert (state is GenState.READY) == (observed == g)
    if state is GenState.OLDER and observed:
        oe, os_ = split_gen(observed)
        assert oe < epoch or (oe == epoch and os_ < seq)
