"""The expert GEMM backends: one interface and the one registry every selection reads.

A backend is a :class:`GemmBackend` subclass made for one :class:`~streamring.moe.blocks.BlockConsumer` ``bc``
(``cls(bc, **options)``: it allocates, so before a graph capture) with

* ``name`` (what ``gemm=`` names it) and ``capabilities`` (its :class:`Capabilities`), declared once, on the class;
* ``compute(lo_index, hi_index, max_items, fw, *, max_ctas=None, expect_items=None, out=None, direct=None)``:
  L1 + SwiGLU + L2 of the blocks ``bc.ready_list[bc.ready_hi[lo_index] : bc.ready_hi[hi_index]]``
  (``max_items``: the grid bound; ``expect_items``: how many the call is expected to have, a hint that a
  backend whose grid the host sizes uses to launch for those rather than for the bound, and the others
  ignore) with the weights ``fw``, into ``bc.y`` (or ``out``; ``direct``: each row straight into its owner's
  combine row). A call asking for what the backend cannot do raises ValueError naming it
  (:func:`refuse_unsupported`);
* ``status() -> int``: the ready-range status bits of the calls so far (0: fine; synchronises);
* ``check()``: raise when ``status()`` is not 0;
* the class methods the measured choice asks (:mod:`streamring.gemm.choice`; :class:`GemmBackend` has the
  defaults): whether it runs here (``probe``, ``require``), its options for a choice, its table keys and its
  rule where nothing is measured.

Every backend computes each result row from that row's inputs and its expert's weights only, whatever the
ready ranges of the calls: streamed (a call per dispatch step, over any range) and batch (one call) outputs
are bitwise equal on it. A backend that could not compute an arbitrary ready range would not meet this
interface.

A backend module registers its class (:func:`register_backend`); so does a backend from anywhere else (an
engine's module, a test), which is then selectable as ``gemm=<name>`` like the built-in ones. The built-in
backends are the modules :data:`BUILTIN` names, each registering the backend of its own name; they are imported
at the first lookup that needs them, so importing this module loads neither torch nor a backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Capabilities:
    """What a backend's ``compute`` can do beside the GEMMs themselves.

    ``max_ctas``: a capped (persistent) grid, leaving SMs to other streams; ``persistent_grid``: its own grid is
    a CTA per SM, each CTA with a fixed share of the tiles, which holds every SM until the call ends, so no other
    stream's kernel runs beside it (streamed forwards group the sources ready together at every size,
    ``EPTuning.group_max_tokens``); ``owner_rows``: L2 writes each row straight into its owner PE's combine row
    (``direct=``), no local ``y`` and no puts; ``persistent``: its tile functions make the persistent consumer
    kernel (``device/persistent_moe.py``); ``waves``: with a persistent grid, ``max_ctas`` above the SM count
    runs it in waves instead (each CTA a share of the tiles: CTAs retire during a call and other streams' CTAs
    get SMs between them); ``kernel_names``: parts of
    the (mangled) names of its GEMM kernels that a library launches (Python sees no handle of them), so that a
    captured graph's node priorities leave them at the default (``EPBuffer.prioritize``); ``block_sizes``: the
    consumer block sizes (``block_m``) it runs, None for every one the consumer takes."""

    max_ctas: bool = False
    persistent_grid: bool = False
    owner_rows: bool = False
    persistent: bool = False
    waves: bool = False
    kernel_names: tuple = ()
    block_sizes: Optional[tuple] = None


class GemmBackend:
    """The base of a backend class: the interface (module doc) and the defaults of what the choice asks.

    Override what differs. ``title``: how messages name it (default ``gemm='<name>'``); ``fallback_rank``: its
    place in the rule that decides where the measured table has nothing (lower first; None: the rule takes it
    only when it is the one implementation asked for)."""

    name: str = ""
    capabilities: Capabilities = Capabilities()
    title: str = ""
    fallback_rank: Optional[int] = None

    def compute(self, lo_index: int, hi_index: int, max_items: int, fw, *, max_ctas: Optional[int] = None,
                expect_items: Optional[int] = None, out=None, direct=None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.compute")

    def status(self) -> int:
        """0: nothing recorded (a backend whose kernels record no ready-range status)."""
        return 0

    def check(self) -> None:
        """Raise when :meth:`status` is not 0."""
        st = self.status()
        if st:
            raise RuntimeError(f"gemm={self.name!r}: ready-range status {st:#x}")

    @classmethod
    def label(cls) -> str:
        return cls.title or f"gemm={cls.name!r}"

    @classmethod
    def probe(cls, block_m: int) -> str:
        """For ``gemm="auto"``: "" where a consumer of ``block_m``-row blocks can run it here now, else why not.
        Loads nothing that is not built and builds nothing (a build takes minutes)."""
        return ""

    @classmethod
    def require(cls, block_m: int) -> None:
        """For ``gemm=<name>`` asked for explicitly: raise (ValueError for a setting, RuntimeError for this
        machine) naming why it cannot run with ``block_m``-row blocks here. Default: the block sizes."""
        sizes = cls.capabilities.block_sizes
        if sizes is not None and block_m not in sizes:
            raise ValueError(f"block_m must be one of {sizes} for gemm={cls.name!r}, got {block_m}")

    @classmethod
    def options(cls, choice, *, staging_y: bool) -> dict:
        """Its constructor's options for ``choice`` (a :class:`~streamring.gemm.choice.LayerChoice` of this
        backend). ``staging_y``: the caller reads ``bc.y``'s rows of each ready range right after computing them,
        so the backend may overwrite the other rows."""
        return {}

    @classmethod
    def variant_key(cls, choice) -> str:
        """The measured table's name of ``choice``'s variant (a :class:`~streamring.gemm.choice.GemmChoice`)."""
        return cls.name

    @classmethod
    def parse_variant(cls, fields: list) -> Optional[dict]:
        """A table key's fields after ``<name>:`` as the :class:`~streamring.gemm.choice.GemmChoice` fields
        they name, None where they name no variant."""
        return {} if not fields else None

    @classmethod
    def key_form(cls) -> str:
        """The form of its table keys (for the message of a key that names nothing)."""
        return cls.name

    @classmethod
    def runs_variant(cls, choice, block_m: Optional[int]) -> bool:
        """Whether a consumer of ``block_m``-row blocks runs ``choice`` (None: the size is not known, so only
        what runs at every size)."""
        return True

    @classmethod
    def fallback_variant(cls, rows_per_expert: float) -> tuple:
        """Its variant where nothing is measured: ``(GemmChoice fields, what the rule says)``."""
        return {}, cls.label()

    @classmethod
    def left_out(cls, reason: str, instead: str) -> None:
        """Called when a ``gemm="auto"`` run left it out for ``reason`` and runs ``instead`` (a title): where a
        user should hear of it (say, a library not built), say so."""


#: the built-in backends: modules of this package, each registering the backend of its own name
BUILTIN = ("triton", "cutlass", "deep_gemm")
_BACKENDS: dict = {}  # name -> class, in registration order
_FAILED: dict = {}  # built-in name -> why its module does not import here


def register_backend(cls: type) -> type:
    """Make ``cls`` (a :class:`GemmBackend` subclass) selectable by its ``name``; returns ``cls`` (a class
    decorator). A name may be registered once (:func:`unregister_backend` first to replace it)."""
    if not (isinstance(cls, type) and issubclass(cls, GemmBackend)):
        raise ValueError(f"a backend must be a GemmBackend subclass, got {cls!r}")
    name = cls.name
    if not isinstance(name, str) or not name.isidentifier() or name == "auto":
        raise ValueError(f"{cls.__name__}.name must be an identifier other than 'auto', got {name!r}")
    if not isinstance(cls.capabilities, Capabilities):
        raise ValueError(f"{cls.__name__}.capabilities must be a Capabilities, got {cls.capabilities!r}")
    have = _BACKENDS.get(name)
    if have is not None and have is not cls:
        raise ValueError(f"gemm backend {name!r} is registered already ({have.__module__}.{have.__qualname__})")
    _BACKENDS[name] = cls
    return cls


def unregister_backend(name: str) -> None:
    """Forget backend ``name`` (a test's, or one to be replaced); the built-in ones stay (ValueError)."""
    if name in BUILTIN:
        raise ValueError(f"gemm backend {name!r} is built in: it cannot be unregistered")
    _BACKENDS.pop(name, None)


def names() -> tuple:
    """Every backend name: the built-in ones, then those registered elsewhere. Imports nothing."""
    return BUILTIN + tuple(n for n in _BACKENDS if n not in BUILTIN)


def _load(name: str) -> None:
    if name in BUILTIN and name not in _BACKENDS and name not in _FAILED:
        try:
            importlib.import_module(f"{__package__}.{name}")
        except ImportError as exc:
            _FAILED[name] = f"its module does not import here: {type(exc).__name__}: {exc}"
            return
        if name not in _BACKENDS:
            raise RuntimeError(f"{__package__}.{name} registered no backend named {name!r}")


def backend(name: str) -> type:
    """The class of backend ``name`` (a built-in one imported on demand): ValueError listing the names for
    one that is not a backend, RuntimeError with the reason for a built-in one that cannot load here."""
    if name not in _BACKENDS and name not in BUILTIN:
        raise ValueError(f"gemm implementation must be one of {names()}, got {name!r}")
    _load(name)
    if name in _FAILED:
        raise RuntimeError(f"gemm={name!r} cannot be used here: {_FAILED[name]}")
    return _BACKENDS[name]


def backends() -> dict:
    """Every backend that loads here, by name (:func:`names` order)."""
    out = {}
    for n in names():
        _load(n)
        if n in _BACKENDS:
            out[n] = _BACKENDS[n]
    return out


def unavailable(name: str) -> str:
    """Why a built-in backend cannot load here ("" when it can, or is not built in)."""
    _load(name)
    return _FAILED.get(name, "")


class _Capabilities(Mapping):
    """Each backend's :class:`Capabilities` by name (a view of the registry; a lookup loads that backend)."""

    def __getitem__(self, name):
        try:
            return backend(name).capabilities
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self):
        return iter(backends())

    def __len__(self):
        return len(backends())

    def __contains__(self, name):
        return name in names() and not unavailable(name)


#: every backend's capabilities by name (``CAPABILITIES[name]``; ``name in CAPABILITIES``)
CAPABILITIES = _Capabilities()


def make_experts(impl: str, bc, **options):
    """Backend ``impl`` made for the block consumer ``bc`` with its ``options`` (allocates)."""
    return backend(impl)(bc, **options)


def refuse_unsupported(impl: str, *, max_ctas=None, out=None, direct=None) -> None:
    """ValueError naming the argument when a ``compute`` call of ``impl`` asks for what it cannot do
    (``out``: L2 into rows other than the consumer's ``y``, which only the owner-rows backends take)."""
    cap = backend(impl).capabilities
    if max_ctas is not None and not cap.max_ctas:
        raise ValueError(f"max_ctas must be None for gemm={impl!r} (it sizes its own persistent grid from the "
                         f"device's SM count; a capped grid would change its configuration), got {max_ctas}")
    for arg, value in (("direct", direct), ("out", out)):
        if value is not None and not cap.owner_rows:
            raise ValueError(f"{arg}= (L2 into rows other than the consumer's y: the owners' combine rows) is not "
                             f"implemented for gemm={impl!r} (only for "
                             f"{[k for k, b in backends().items() if b.capabilities.owner_rows]})")
