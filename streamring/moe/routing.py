"""The routers: how a token's router logits become its top-k experts and their weights. One registry.

A router is one function, registered by name (:func:`register_router`)::

    select(logits, bias, shape) -> (topk_idx, topk_weights)

``logits``: float32 (float64 for the reference) ``[T, E]``; ``bias``: the layer's correction bias ``[E]`` or
None; ``shape``: the layer's :class:`~streamring.moe.shape.MoEShape` (``topk`` and whatever else the router
reads). It returns int64 ``[T, topk]`` expert ids and ``[T, topk]`` weights in the logits' dtype. It must be
row-local (a token's choice never depends on another row, which keeps streamed output bitwise equal to batch)
and deterministic. :attr:`MoEShape.router <streamring.moe.shape.MoEShape.router>` names it, and every layer
routes through this registry: the reference layer (:func:`streamring.moe.routers.select_experts`), the GPU
producers (:func:`streamring.moe.blocks.select_experts_into`) and the config's allowed values.

Optional, per router: ``select_into(logits, bias, shape, idx_out, w_out, launch=None)``, the same rule as one
kernel writing the producer's buffers (the GPU producers use it where given, else ``select`` and a copy;
``launch``: the kernel's launch parameters); ``uses_bias``: it reads the layer's correction bias (random weights
get one); ``check(shape)``: raise ValueError naming what a shape lacks for it (``MoEShape.validate`` calls it).

Functions may be given as ``"module:function"``, imported at first use: the built-in routers are listed here
without loading torch (the launcher validates a run's shape in a process that computes nothing).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional, Union

Function = Union[Callable, str]


@dataclass(frozen=True)
class Router:
    """A registered router (module doc)."""

    name: str
    select: Function
    select_into: Optional[Function] = None
    uses_bias: bool = False
    check: Optional[Callable] = None

    def function(self, which: str = "select") -> Callable:
        """``select`` or ``select_into`` as a callable (a ``"module:function"`` imported here)."""
        f = getattr(self, which)
        if isinstance(f, str):
            module, _, attr = f.partition(":")
            f = getattr(importlib.import_module(module), attr)
        return f


_ROUTERS: dict = {}


def register_router(name: str, select: Function, *, select_into: Optional[Function] = None, uses_bias: bool = False,
                    check: Optional[Callable] = None) -> Router:
    """Make ``select`` the router ``name`` (module doc for the contract); returns its :class:`Router`. A name
    may be registered once (:func:`unregister_router` first to replace it)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a router name must be an identifier, got {name!r}")
    if name in _ROUTERS:
        raise ValueError(f"router {name!r} is registered already")
    for what, f in (("select", select), ("select_into", select_into), ("check", check)):
        if f is not None and not (callable(f) or (what != "check" and isinstance(f, str) and ":" in f)):
            raise ValueError(f"router {name!r}: {what} must be a callable or 'module:function', got {f!r}")
    r = _ROUTERS[name] = Router(name, select, select_into, bool(uses_bias), check)
    return r


def unregister_router(name: str) -> None:
    """Forget router ``name`` (a test's, or one to be replaced)."""
    _ROUTERS.pop(name, None)


def router_names() -> tuple:
    """Every registered router's name, in registration order (the built-in ones first)."""
    return tuple(_ROUTERS)


def router_of(name: str) -> Router:
    """The router ``name``; ValueError listing the names when none is registered under it."""
    try:
        return _ROUTERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"router must be one of {router_names()}, got {name!r}") from None


def _deepseek_v3_check(shape) -> None:
    cap = shape.topk_group * (shape.num_experts // shape.n_group)
    if shape.topk > cap:
        raise ValueError(f"topk must be <= topk_group * (num_experts // n_group) = {cap} for router 'deepseek_v3', "
                         f"got {shape.topk}")


# Mixtral's: softmax over the experts, the top k, optionally renormalised (shape.renormalize)
register_router("softmax_topk", "streamring.moe.routers:softmax_topk",
                select_into="streamring.moe.blocks:softmax_topk_into")
# DeepSeek-V3's: sigmoid scores, a correction bias for the choice, group-limited top-k, scaled weights
register_router("deepseek_v3", "streamring.moe.routers:deepseek_v3", select_into="streamring.moe.blocks:deepseek_v3_into",
                uses_bias=True, check=_deepseek_v3_check)
