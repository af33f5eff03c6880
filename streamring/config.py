"""Configuration schema (pydantic), YAML loading and ``--set`` overrides.

Every key is validated; an error says, in plain words, the dotted field, the value given and what the
field allows (:func:`describe` of its schema), or for an unknown key the keys of its section and the
closest one. With no ``--config`` the embedded :data:`DEFAULT_CONFIG` is used.
"""

from __future__ import annotations

import copy
import difflib
import typing
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, field_validator, model_validator

from .ring.layout import SF_BLOCK
from .gemm.backends import names as gemm_names
from .moe.routing import router_names
from .ring.policies import EP_SOURCE_ORDERS, INJECT_MODES, PROGRESS_POLICIES, REFUSED_POLICIES, SOURCE_ORDERS


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RingConfig(_Strict):
    """Ring geometry: ``num_slots`` slots of ``tokens_per_slot`` tokens each, per rank."""

    num_slots: int = Field(4, ge=1, le=4096, description="slots in the ring (S)")
    tokens_per_slot: int = Field(32, ge=1, le=1 << 20, description="tokens per slot (C)")


class CpuConfig(_Strict):
    """CPU backend options."""

    window: Literal["auto", "shared", "separate"] = Field(
        "auto", description="auto: Allocate_shared when all ranks share a node; separate: Win.Allocate"
    )


class NvshmemConfig(_Strict):
    """NVSHMEM backend options."""

    progress: Literal[PROGRESS_POLICIES + tuple(REFUSED_POLICIES)] = Field(  # type: ignore[valid-type]
        "spin_kernel", description="progress policy of the GPU layer (streamring.ring.policies.PROGRESS; the layer "
                                   "refuses those of streamring.ring.policies.REFUSED_POLICIES before launch, with the "
                                   "reason; gpu-check takes --policies)")
    producer_sms: int = Field(16, ge=8, description="green_ctx: SMs of the producer context (multiple of 8)")
    transport: Literal["auto", "p2p", "nv"] = Field(
        "auto", description="GPU layer between PEs: auto (NVLink pointers when every peer has one, else NVSHMEM "
                            "RMA), p2p, or nv (forces NVSHMEM device RMA, as between nodes)")
    symmetric_size: Optional[int] = Field(
        None, ge=1 << 20, description="bytes of NVSHMEM's symmetric heap per PE (sets NVSHMEM_SYMMETRIC_SIZE); "
                                      "null: the environment's value, else NVSHMEM's default of 1 GiB")

    @field_validator("producer_sms")
    @classmethod
    def _mult8(cls, v):
        if v % 8:
            raise ValueError(f"must be a multiple of 8 (green contexts allocate SMs in groups of 8), got {v}")
        return v


class LayerConfig(_Strict):
    """The MoE layer."""

    hidden: int = Field(256, ge=SF_BLOCK)
    intermediate: int = Field(256, ge=SF_BLOCK)
    num_experts: int = Field(8, ge=1)
    topk: int = Field(2, ge=1)
    router: Literal[router_names()] = "softmax_topk"  # type: ignore[valid-type]
    renormalize: bool = True
    n_group: int = Field(1, ge=1)
    topk_group: int = Field(1, ge=1)
    routed_scaling_factor: float = Field(1.0, gt=0)
    norm_topk_prob: bool = True
    weight_dtype: Literal["bf16", "fp8"] = "bf16"
    seed: int = 0

    @model_validator(mode="after")
    def _shape(self):
        for name in ("hidden", "intermediate"):
            v = getattr(self, name)
            if v % SF_BLOCK:
                raise ValueError(f"layer.{name} must be a multiple of {SF_BLOCK}, got {v}")
        if self.topk > self.num_experts:
            raise ValueError(f"layer.topk must be in [1, num_experts={self.num_experts}], got {self.topk}")
        if self.num_experts % self.n_group:
            raise ValueError(f"layer.n_group must divide num_experts={self.num_experts}, got {self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"layer.topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        return self


class RunConfig(_Strict):
    """What ``streamring run`` does."""

    tokens_per_rank: Union[NonNegativeInt, list[NonNegativeInt]] = Field(
        100, description="tokens on each rank: one number for all, or one per rank"
    )
    mode: Literal["both", "batch", "stream"] = "both"
    scheduler: Literal["chunk_local", "reservation"] = "chunk_local"
    source_order: Literal[EP_SOURCE_ORDERS] = Field(  # type: ignore[valid-type]
        "rank", description="streamed consumer: sources of a chunk in rank order, or any ready source first; "
                            "arrival (the expert-parallel GPU layer only): all chunks of the first source to "
                            "publish, then the next (needs ring.num_slots >= the chunks of a forward)")
    block_m: int = Field(16, ge=1, description="rows per expert block")
    epochs: int = Field(2, ge=1, description="forward calls (one stream epoch each) on the same buffers")
    routing: Literal["router", "uniform", "hot_expert", "one_rank"] = "router"
    inject: Literal[("none",) + INJECT_MODES] = Field(  # type: ignore[valid-type]
        "none", description="break one protocol step of the streamed ring (proves the output check can fail)")
    gpu_path: Literal["auto", "fast", "host_verbs"] = Field(
        "auto", description="backend nvshmem: fast = the expert-parallel FP8 GPU layer (EPBuffer: device-side ring, "
                            "Triton kernels, CUDA graphs; needs layer.weight_dtype=fp8); host_verbs = the reference "
                            "layer (MoEBuffer through host verbs, torch ops); auto = fast for fp8 weights")
    straggler: Optional["Straggler"] = Field(
        None, description="delay one rank's producers at the start of every forward, batch and streamed: device "
                          "side on the fast GPU path, its producer roles sleeping on the CPU and host-verb layers")
    gemm: Literal[("auto",) + gemm_names()] = Field(  # type: ignore[valid-type]
        "auto", description="fast GPU path: the expert GEMMs of both the batch and the streamed path (auto: CUTLASS "
                            "when its library is built, else Triton)")
    fault: Optional["ReplayFault"] = Field(
        None, description="fast GPU path: kill or stop one rank in the middle of a streamed forward (rank-failure "
                          "tests; the CPU backend's is stress.fault)")
    launch_ahead: bool = Field(
        False, description="fast GPU path: the streamed graph launches its consumer side ahead of the forward's "
                           "input (EPBuffer.launch_consumer, both in the graph)")


class Straggler(_Strict):
    """A slow rank on purpose: rank ``rank``'s producers start ``ms`` milliseconds late in every forward."""

    rank: int = Field(ge=0)
    ms: float = Field(gt=0, le=10_000)


class ReplayFault(_Strict):
    """Rank ``rank`` fails in the streamed forward of epoch ``epoch`` (0-based) of ``run`` on the GPU layer.

    ``kill``: it launches that forward with its producer held back on the device (the straggler word,
    past ``wait_timeout_s``) and SIGKILLs itself, so it dies while its peers' forwards wait for its
    first chunk. ``hang``: it SIGSTOPs itself right before launching that forward (a stopped host
    launches nothing; work already on the GPU would still complete).
    """

    rank: int = Field(ge=0)
    epoch: int = Field(0, ge=0, description="the epoch of run.epochs whose streamed forward fails")
    kind: Literal["kill", "hang"] = "kill"


class Delay(_Strict):
    """Uniform random delay in seconds between ``min_s`` and ``max_s``."""

    min_s: float = Field(0.0, ge=0)
    max_s: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _order(self):
        if self.max_s < self.min_s:
            raise ValueError(f"max_s ({self.max_s}) must be >= min_s ({self.min_s})")
        return self


class Fault(_Strict):
    """Fault injection: rank ``rank`` is killed (SIGKILL) or hung (SIGSTOP) at a protocol step."""

    rank: int = Field(ge=0)
    at: Literal["publish", "consume", "ack"]
    after_chunks: int = Field(1, ge=0, description="chunks of this epoch completed at that step before the fault")
    kind: Literal["kill", "hang"] = "kill"


class StressConfig(_Strict):
    """What ``streamring stress`` does."""

    chunks_per_rank: Union[NonNegativeInt, list[NonNegativeInt]] = Field(16, description="chunks each rank publishes (0 allowed)")
    tokens_per_chunk: Optional[Union[NonNegativeInt, list[NonNegativeInt]]] = Field(
        None, description="tokens in a full chunk (default ring.tokens_per_slot); per rank list allowed"
    )
    partial_last: int = Field(-1, ge=-1, description="tokens of each rank's last chunk (-1: full)")
    epochs: int = Field(2, ge=1)
    route_delay: Delay = Delay()
    layout_delay: Delay = Delay()
    consumer_delay: Delay = Delay()
    read_hold: Delay = Field(Delay(), description="hold between a consumer's two reads of a chunk")
    stragglers: dict[NonNegativeInt, float] = Field(default_factory=dict, description="rank -> delay multiplier")
    seed: int = 0
    inject: Literal[("none",) + INJECT_MODES] = "none"  # type: ignore[valid-type]
    inject_delay_s: float = Field(0.02, ge=0, description="signal-before-payload: the time between the early generation and the payload, the window a consumer must fall into for the mutation to be caught (long enough for a consumer process on a loaded, oversubscribed machine to get scheduled in it)")
    fault: Optional[Fault] = Field(None, description="kill or hang one rank mid-stream (rank-failure tests)")
    source_order: Literal[SOURCE_ORDERS] = Field(  # type: ignore[valid-type]
        "rank", description="consumer: wait for the sources of a chunk in rank order, or handle any ready source "
                            "first ('ready', an RFC later optimisation, model-checked at 2 ranks only: off by default)")


class Config(_Strict):
    """Root of a streamring YAML config."""

    backend: Literal["cpu", "nvshmem"] = "cpu"
    ranks: int = Field(4, ge=1, le=1024, description="ranks started by the local launcher")
    wait_timeout_s: float = Field(30.0, gt=0, description="watchdog deadline of every wait")
    progress_s: float = Field(10.0, ge=0, description="run and stress: rank 0 says what the job is doing at least "
                                                      "this often, on stderr (0: never)")
    ring: RingConfig = RingConfig()
    cpu: CpuConfig = CpuConfig()
    nvshmem: NvshmemConfig = NvshmemConfig()
    layer: LayerConfig = LayerConfig()
    run: RunConfig = RunConfig()
    stress: StressConfig = StressConfig()


DEFAULT_CONFIG = Config().model_dump()


# ----------------------------------------------------------------------------------------
# Errors in plain words: the field, the value given, what the schema allows there
# ----------------------------------------------------------------------------------------
_TYPE_TAGS = {"int", "float", "str", "bool", "none", "dict", "list"}


def _is_union_tag(part) -> bool:
    """pydantic names the branch of a union an error came from in its location (``constrained-int``,
    ``list[constrained-int]``): not a key of the config (``[key]`` is: the key of a mapping entry)."""
    return isinstance(part, str) and part != "[key]" and ("[" in part or "-" in part or part in _TYPE_TAGS)


def _unwrap(annotation) -> tuple:
    """``(type, [constraints])`` of an annotation, ``Annotated`` unwrapped."""
    meta: list = []
    while typing.get_origin(annotation) is Annotated:
        annotation, *more = typing.get_args(annotation)
        meta += more
    return annotation, meta


def _bounds(meta) -> str:
    lo = hi = None
    for m in meta:
        if getattr(m, "ge", None) is not None:
            lo = f"[{m.ge}"
        if getattr(m, "gt", None) is not None:
            lo = f"({m.gt}"
        if getattr(m, "le", None) is not None:
            hi = f"{m.le}]"
        if getattr(m, "lt", None) is not None:
            hi = f"{m.lt})"
    if lo and hi:
        return f" in {lo}, {hi}"
    if lo:
        return f" {'>=' if lo[0] == '[' else '>'} {lo[1:]}"
    if hi:
        return f" {'<=' if hi[-1] == ']' else '<'} {hi[:-1]}"
    return ""


def describe(annotation, meta=()) -> str:
    """What a field of this annotation (and these constraints) takes, in words."""
    annotation, more = _unwrap(annotation)
    meta = list(meta) + more
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union:
        options = [a for a in args if a is not type(None)]
        text = ", or ".join(describe(a, meta) for a in options)
        return text + (", or null" if len(options) < len(args) else "")
    if origin is Literal:
        values = [repr(v) for v in args]
        return values[0] if len(values) == 1 else \
            ("one of " if len(values) > 2 else "") + ", ".join(values[:-1]) + " or " + values[-1]
    if origin is list:
        return f"a list, each entry {describe(args[0])}"
    if origin is dict:
        return f"a mapping, each key {describe(args[0])} and each value {describe(args[1])}"
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "a whole number" + _bounds(meta)
    if annotation is float:
        return "a number" + _bounds(meta)
    if annotation is str:
        return "text"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"a section with the keys {', '.join(annotation.model_fields)}"
    return str(annotation)


def _walk(path: list) -> tuple:
    """The ``(model, field name, annotation, constraints)`` at ``path`` (keys, list indices; ``"[key]"`` last:
    the key of a mapping entry, not its value) from :class:`Config`; ``None`` past the schema."""
    model, annotation, meta, name = Config, Config, [], None
    for i, part in enumerate(path):
        if part == "[key]":
            continue
        key = i + 1 < len(path) and path[i + 1] == "[key]"
        annotation, more = _unwrap(annotation)
        options = typing.get_args(annotation) if typing.get_origin(annotation) is Union else (annotation,)
        for opt in options:  # through an Optional or a union: the branch that has this part
            opt, opt_meta = _unwrap(opt)
            if isinstance(opt, type) and issubclass(opt, BaseModel) and part in opt.model_fields:
                model, name = opt, part
                annotation, meta = opt.model_fields[part].annotation, list(opt.model_fields[part].metadata)
                break
            if typing.get_origin(opt) is list and isinstance(part, int):
                annotation, meta = typing.get_args(opt)[0], []
                break
            if typing.get_origin(opt) is dict:
                annotation, meta = typing.get_args(opt)[0 if key else 1], []
                break
        else:
            return None
    return model, name, annotation, meta


def _dotted(path: list) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            out += " (a key)"
        else:
            out += ("." if out else "") + str(part)
    return out or "(the top level)"


def _unknown_key(path: list) -> str:
    where = _walk(path[:-1])
    section = where[2] if where else None
    section, _ = _unwrap(section) if section is not None else (None, [])
    if typing.get_origin(section) is Union:  # an optional section
        section = next((a for a in typing.get_args(section) if a is not type(None)), None)
    keys = list(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
    owner = f"the keys of {_dotted(path[:-1])}" if path[:-1] else "the top-level keys"
    line = f"{_dotted(path)}: unknown key; {owner} are {', '.join(keys)}"
    close = difflib.get_close_matches(str(path[-1]), keys, n=1)
    return line + (f" (did you mean {_dotted(path[:-1] + [close[0]])}?)" if close else "")


def _format_error(err: ValidationError) -> str:
    """Every error of ``err`` in plain words: the field, the value given and what the field allows (the
    schema's range or choices; the check's own sentence where a validator refused it); an unknown key
    lists the keys of its section, with the closest one to a misspelt key."""
    found = []
    for e in err.errors():
        loc = list(e["loc"])
        tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
        path = [part for part in loc if not _is_union_tag(part)]
        found.append((tuple(loc[:tag]) if tag is not None else None, path, e))
    # of one union's branches, the one whose error lies deepest says most (a list's bad entry, not "not a number")
    deepest: dict = {}
    for union, path, _ in found:
        if union is not None:
            deepest[union] = max(deepest.get(union, 0), len(path))
    lines: list[str] = []
    for union, path, e in found:
        if union is not None and len(path) < deepest[union]:
            continue
        typ, msg, value = e["type"], e["msg"], e.get("input")
        if typ == "extra_forbidden":
            line = _unknown_key(path)
        elif typ in ("value_error", "assertion_error"):
            why = msg.split(", ", 1)[1] if msg.startswith(("Value error, ", "Assertion failed, ")) else msg
            line = why if why.startswith(_dotted(path) + ".") else f"{_dotted(path)}: {why}"
        else:
            where = _walk(path)
            allowed = describe(where[2], where[3]) if where and where[2] is not None else None
            field = where[0].model_fields.get(where[1]) if where and where[1] and path[-1] == where[1] else None
            if allowed and field is not None and field.description:
                allowed += f" ({field.description.split(';')[0]})"
            if typ == "missing":
                line = f"{_dotted(path)}: missing" + (f"; it must be {allowed}" if allowed else "")
            else:
                line = f"{_dotted(path)}: got {value!r}; it must be {allowed}" if allowed else \
                    f"{_dotted(path)}: got {value!r}: {msg}"
        if line not in lines:
            lines.append(line)
    return "invalid config:\n  " + "\n  ".join(lines)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {} if k not in node else node[k]
            if not isinstance(node[k], dict):
                raise ConfigError(f"--set {dotted}: {k!r} is not a section")
        node = node[k]
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, object]:
    """Parse one ``key=value`` (value in YAML syntax) from ``--set``."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value (dotted keys such as ring.num_slots=3), got {text!r}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {exc}") from exc
    return key, value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, **top) -> Config:
    """Load a YAML config (or the default), apply ``--set`` overrides and top-level values, validate.

    Raises :class:`ConfigError` naming every bad field.
    """
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {path}: not valid YAML: {exc}") from exc
        if not isinstance(tree, dict):
            raise ConfigError(f"--config {path}: the top level must be a mapping, got {type(tree).__name__}")
    tree = copy.deepcopy(tree)
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    for key, value in top.items():
        if value is not None:
            tree[key] = value
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def per_rank(value, num_ranks: int, field: str) -> list[int]:
    """Expand an int-or-list config value to one entry per rank."""
    if isinstance(value, list):
        if len(value) != num_ranks:
            raise ConfigError(f"{field}: a list needs one entry per rank ({num_ranks}), got {len(value)}")
        return list(value)
    return [value] * num_ranks
