"""Facts the docs and the embedded config state about the code, checked against the code: what
configs/default.yaml offers for each choice, and the EPTuning defaults docs/engine.md names."""

from __future__ import annotations

import re
import typing

from conftest import CONFIGS, ROOT

from streamring.config import Config
from streamring.moe.tuning import EPTuning
from streamring.ring.policies import REFUSED_POLICIES


def _field(model, dotted: str):
    *head, last = dotted.split(".")
    for k in head:
        model = model.model_fields[k].annotation
    return model.model_fields[last]


def test_default_yaml_offers_exactly_what_the_schema_takes():
    """Every ``key: value  # a | b | c`` comment of configs/default.yaml lists the schema's allowed values (a
    refused progress policy is not offered)."""
    seen = 0
    path: list[tuple[int, str]] = []
    for line in (CONFIGS / "default.yaml").read_text().splitlines():
        m = re.match(r"^( *)(\w+):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m[1]), m[2], m[3]
        path = [(i, k) for i, k in path if i < indent] + [(indent, key)]
        value, _, comment = rest.partition("#")
        if not value.strip() or "|" not in comment:
            continue
        offered = [part.split()[0] for part in comment.split("|")]
        dotted = ".".join(k for _, k in path)
        allowed = list(typing.get_args(_field(Config, dotted).annotation))
        if dotted == "nvshmem.progress":
            allowed = [a for a in allowed if a not in REFUSED_POLICIES]
        assert offered == allowed, (dotted, offered, allowed)
        seen += 1
    assert seen >= 7, seen


def test_engine_md_names_the_eptuning_defaults():
    """docs/engine.md's "Options" and "Defaults" say the default EPTuning has, for every field they name."""
    text = (ROOT / "docs" / "engine.md").read_text()
    named = 0
    for name, field in EPTuning.model_fields.items():
        for value in re.findall(rf"`{name}` \(`([\w.]+)` default", text):
            assert value == str(field.default), (name, value, field.default)
            named += 1
        for value in re.findall(rf"`EPTuning\.{name}` to `([\w.]+)`", text):
            assert value == str(field.default), (name, value, field.default)
            named += 1
    assert named >= 4, named
