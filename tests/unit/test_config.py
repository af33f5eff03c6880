"""Config schema: defaults, YAML files, --set overrides, errors that name the field."""

import pytest

from streamring.config import DEFAULT_CONFIG, ConfigError, load_config, parse_override

from conftest import CONFIGS


def test_default_config_and_file_agree():
    assert load_config().model_dump() == DEFAULT_CONFIG
    assert load_config(CONFIGS / "default.yaml").model_dump() == DEFAULT_CONFIG


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    load_config(path)


def test_set_overrides_dotted_keys_and_types():
    cfg = load_config(None, ["ring.num_slots=3", "stress.chunks_per_rank=[0, 2]", "layer.router=deepseek_v3",
                             "stress.stragglers={1: 2.5}"], ranks=2)
    assert cfg.ring.num_slots == 3 and cfg.stress.chunks_per_rank == [0, 2]
    assert cfg.layer.router == "deepseek_v3" and cfg.stress.stragglers == {1: 2.5} and cfg.ranks == 2


@pytest.mark.parametrize("override,needle", [
    ("ring.num_slots=0", "ring.num_slots"),
    ("ring.tokens_per_slot=-1", "ring.tokens_per_slot"),
    ("backend=gpu", "'cpu' or 'nvshmem'"),
    ("layer.router=foo", "'softmax_topk' or 'deepseek_v3'"),
    ("layer.hidden=200", "layer.hidden must be a multiple of 128"),
    ("layer.topk=9", "layer.topk must be in [1, num_experts=8]"),
    ("nvshmem.producer_sms=12", "multiple of 8"),
    ("stress.inject=bogus", "skip-acquire"),
    ("ring.num_slot=3", "ring.num_slot: unknown key"),
    ("stress.route_delay={min_s: 2, max_s: 1}", "max_s"),
    ("run.tokens_per_rank=-3", "run.tokens_per_rank"),
])
def test_bad_values_name_field_and_allowed_values(override, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    assert needle in str(ei.value)


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("ring.num_slots")
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_arrival_order_is_the_gpu_layers_and_needs_a_slot_per_chunk():
    """run.source_order 'arrival' is refused before launch off the expert-parallel GPU layer, and on it when a
    forward has more chunks than the ring has slots (the errors name the fields)."""
    from streamring.runner import ConfigError, check_run_job

    cpu = load_config(None, ["run.source_order=arrival"])
    with pytest.raises(ConfigError, match="run.source_order 'arrival' is a dispatch order of the expert-parallel"):
        check_run_job(cpu, 4)
    gpu = ["backend=nvshmem", "layer.weight_dtype=fp8", "run.source_order=arrival", "run.tokens_per_rank=100",
           "ring.tokens_per_slot=32"]
    with pytest.raises(ConfigError, match=r"needs ring.num_slots >= the chunks of a forward \(100 tokens / "
                                          r"ring.tokens_per_slot=32 = 4\), got ring.num_slots="):
        check_run_job(load_config(None, gpu + ["ring.num_slots=2"]), 4)
    check_run_job(load_config(None, gpu + ["ring.num_slots=4"]), 4)


@pytest.mark.parametrize("override,lines", [
    ("ring.num_slot=3", ["ring.num_slot: unknown key; the keys of ring are num_slots, tokens_per_slot "
                         "(did you mean ring.num_slots?)"]),
    ("rn.tokens_per_rank=3", ["rn: unknown key; the top-level keys are backend, ranks, wait_timeout_s, progress_s, "
                              "ring, cpu, nvshmem, layer, run, stress (did you mean run?)"]),
    ("run.tokens_per_rank=-5", ["run.tokens_per_rank: got -5; it must be a whole number >= 0, or a list, each entry "
                                "a whole number >= 0 (tokens on each rank: one number for all, or one per rank)"]),
    ("run.tokens_per_rank=[1, -5]", ["run.tokens_per_rank[1]: got -5; it must be a whole number >= 0"]),
    ("ring.num_slots=abc", ["ring.num_slots: got 'abc'; it must be a whole number in [1, 4096] (slots in the ring (S))"]),
    ("run.mode=fast", ["run.mode: got 'fast'; it must be one of 'both', 'batch' or 'stream'"]),
    ("run.straggler={rnk: 1, ms: 2}", ["run.straggler.rank: missing; it must be a whole number >= 0",
                                       "run.straggler.rnk: unknown key; the keys of run.straggler are rank, ms "
                                       "(did you mean run.straggler.rank?)"]),
    ("nvshmem.symmetric_size=5", ["nvshmem.symmetric_size: got 5; it must be a whole number >= 1048576, or null"]),
])
def test_config_errors_in_plain_words(override, lines):
    """The field, the value given, the allowed range or values (or the keys of the section and the closest
    one); no pydantic internals (union branch names, "Input should be")."""
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    text = str(ei.value)
    got = text.splitlines()[1:]
    assert text.startswith("invalid config:") and len(got) == len(lines), text
    for line, want in zip(got, lines):
        assert line.strip().startswith(want), (line, want)
    for internal in ("constrained-int", "list[", "Input should", "Extra inputs", "configs/default.yaml"):
        assert internal not in text, text
