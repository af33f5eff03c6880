"""The argument checks of a forward, shared by :class:`~streamring.moe.layer.MoEBuffer` and
:class:`~streamring.moe.ep_buffer.EPBuffer`.

Each buffer calls them at the top of ``forward``, before anything is enqueued or published. Every check
raises :class:`ValueError` naming the argument and what it must be, and changes no state: a buffer whose
forward raised one of these errors stays usable. A buffer refuses further work only after a failure
inside a running stream (a watchdog, a protocol violation), when the ranks may disagree on what was
published and acknowledged.

Values of a tensor argument (routing ids, a tensor ``num_tokens``) are read on the host only where
:func:`host_read_allowed` says so: always off the GPU, and on a GPU while the current stream is not
capturing a CUDA graph (a host read there would end the capture, and a replay would not read it again).
Under capture the device-side checks stay the mechanism: the GPU buffer clamps what gets through, counts
it (``EPBuffer.status()``: ``bad_routes``, ``bad_counts``) and refuses further work at the next
``replay``/``status``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["host_read_allowed", "check_x", "check_finite_rows", "check_out", "check_num_tokens", "check_routing",
           "check_streaming", "check_stream_epoch"]


def host_read_allowed(device) -> bool:
    """Whether a check may read a tensor's values on ``device`` from the host now: always off the GPU; on
    a GPU only while the current stream is not capturing a CUDA graph."""
    if torch.device(device).type != "cuda":
        return True
    return not torch.cuda.is_current_stream_capturing()


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {str(t.dtype).replace('torch.', '')} tensor of shape {list(t.shape)} on {t.device}"
    return f"{type(t).__name__} {t!r}" if isinstance(t, (int, float, str, bool)) else type(t).__name__


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d).replace("torch.", "") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_x(x, hidden: int, *, dtypes: Optional[Sequence[torch.dtype]] = None, device=None,
            max_rows: Optional[int] = None, max_rows_name: str = "max_tokens_per_rank") -> None:
    """``x`` is a 2-D ``[T, hidden]`` float tensor: of one of ``dtypes`` (default: any float dtype), on
    ``device`` (default: any), ``T <= max_rows`` (default: any)."""
    allowed = _dtype_names(dtypes) if dtypes else "a bfloat16 (or other float) tensor"
    where = f" on {device}" if device is not None else ""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor [tokens, hidden={hidden}] ({allowed}{where}), got {_desc(x)}")
    if (dtypes and x.dtype not in dtypes) or (not dtypes and not x.is_floating_point()):
        raise ValueError(f"x must be {allowed}, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must have shape [tokens, hidden={hidden}], got {list(x.shape)}")
    if device is not None and x.device != torch.device(device):
        raise ValueError(f"x must be on {device} (the buffer's device), got {x.device}")
    if max_rows is not None and x.shape[0] > max_rows:
        raise ValueError(f"x has {x.shape[0]} tokens, more than {max_rows_name}={max_rows}")


def check_finite_rows(x: torch.Tensor, valid: int) -> None:
    """The first ``valid`` rows of ``x`` hold no NaN/Inf (host read)."""
    xv = x[:valid]
    if xv.numel() and not torch.isfinite(xv).all():
        bad = int((~torch.isfinite(xv)).any(dim=1).nonzero()[0, 0])
        raise ValueError(f"x contains NaN/Inf at token {bad} (x's valid rows must be finite: non-finite "
                         f"activations are not propagated)")


def check_out(out, shape: Sequence[int], dtype: torch.dtype, device) -> None:
    """``out`` (``None``: the buffer allocates it) is a ``dtype`` tensor of ``shape`` on ``device``."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != tuple(shape) \
            or out.device != torch.device(device):
        raise ValueError(f"out must be None or a {str(dtype).replace('torch.', '')} tensor of shape {list(shape)} "
                         f"on {device} (x's shape), got {_desc(out)}")


def check_num_tokens(num_tokens, rows: int, *, device=None, read: bool = True) -> Optional[int]:
    """The valid row count of an ``x`` with ``rows`` rows.

    Args:
        num_tokens: ``None`` (every row), an int, or a 0-d / one-element integer tensor (on ``device``
            when given: the GPU buffer reads it on the device).
        rows: ``x.shape[0]``.
        device: where a tensor count must be (``None``: anywhere).
        read: whether a tensor's value may be read on the host (:func:`host_read_allowed`).
    Returns:
        the count, ``0 <= count <= rows``; ``None`` for a tensor that was not read.
    """
    if num_tokens is None:
        return rows
    allowed = f"an int or a 0-d/1-element integer tensor, in [0, {rows}] (x has {rows} rows; None: every row)"
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1 or num_tokens.dtype.is_floating_point or num_tokens.dtype.is_complex \
                or num_tokens.dtype == torch.bool:
            raise ValueError(f"num_tokens must be {allowed}, got {_desc(num_tokens)}")
        if device is not None and num_tokens.device != torch.device(device):
            raise ValueError(f"num_tokens must be {allowed} on {device} (read on the device), got {_desc(num_tokens)}")
        if not read:
            return None
        n = int(num_tokens.reshape(()).item())
    elif isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, (bool, np.bool_)):
        n = int(num_tokens)
    else:
        raise ValueError(f"num_tokens must be {allowed}, got {_desc(num_tokens)}")
    if not 0 <= n <= rows:
        raise ValueError(f"num_tokens must be in [0, {rows}] (x has {rows} rows), got {n}")
    return n


def check_routing(routing, rows: int, topk: int, num_experts: int, *, valid: Optional[int] = None, device=None,
                  exact_dtypes: bool = True, read: bool = True) -> tuple:
    """A routing given by the caller, ``(topk_idx, topk_weights)``, both ``[rows, topk]``.

    Args:
        routing: the pair; ``topk_idx`` int64 expert ids in ``[-1, num_experts)`` (-1: a masked route),
            ``topk_weights`` float32, finite.
        rows: ``x.shape[0]``.
        valid: the rows whose values are read and checked (default all ``rows``; rows past it are
            never routed).
        device: where both must be (``None``: anywhere).
        exact_dtypes: ``False`` accepts any integer ``topk_idx`` and any float ``topk_weights`` and
            returns them as int64 / float32.
        read: whether the values may be read on the host (:func:`host_read_allowed`); without it only
            the types, shapes and devices are checked.
    Returns:
        ``(topk_idx, topk_weights)``, contiguous.
    """
    where = f" on {device}" if device is not None else ""
    if not isinstance(routing, (tuple, list)) or len(routing) != 2:
        raise ValueError(f"routing must be None or a pair (topk_idx int64 [{rows}, {topk}], topk_weights float32 "
                         f"[{rows}, {topk}]){where}, got {_desc(routing)}")
    idx, w = routing
    if not isinstance(idx, torch.Tensor) or tuple(idx.shape) != (rows, topk) or \
            (idx.dtype != torch.int64 if exact_dtypes else (idx.is_floating_point() or idx.is_complex()
                                                             or idx.dtype == torch.bool)) \
            or (device is not None and idx.device != torch.device(device)):
        raise ValueError(f"routing[0] (topk_idx) must be int64 [{rows}, {topk}]{where}, got {_desc(idx)}")
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (rows, topk) or \
            (w.dtype != torch.float32 if exact_dtypes else not w.is_floating_point()) \
            or (device is not None and w.device != torch.device(device)):
        raise ValueError(f"routing[1] (topk_weights) must be float32 [{rows}, {topk}]{where}, got {_desc(w)}")
    if not exact_dtypes:
        idx, w = idx.to(torch.int64), w.to(torch.float32)
    idx, w = idx.contiguous(), w.contiguous()
    if read:
        n = rows if valid is None else valid
        iv, wv = idx[:n], w[:n]
        if iv.numel():
            bad = (iv < -1) | (iv >= num_experts)
            if bool(bad.any()):
                t, k = (int(v) for v in bad.nonzero()[0])
                raise ValueError(f"routing[0] (topk_idx) values must be expert ids in [0, {num_experts}) or -1 "
                                 f"(a masked route), got {int(iv[t, k])} at token {t}, entry {k}")
            if not bool(torch.isfinite(wv).all()):
                t, k = (int(v) for v in (~torch.isfinite(wv)).nonzero()[0])
                raise ValueError(f"routing[1] (topk_weights) must be finite, got {float(wv[t, k])} at token {t}, "
                                 f"entry {k}")
    return idx, w


def check_streaming(streaming, *, auto: bool = False) -> None:
    """``streaming`` is ``True`` or ``False`` (or ``"auto"`` where ``auto``)."""
    if isinstance(streaming, (bool, np.bool_)):
        return
    if auto and isinstance(streaming, str) and streaming == "auto":
        return
    allowed = "True, False or 'auto'" if auto else "True or False"
    raise ValueError(f"streaming must be {allowed}, got {streaming!r}")


def check_stream_epoch(stream_epoch, *, streaming: bool, last: int, max_epoch: int,
                       capturing: bool = False) -> Optional[int]:
    """``stream_epoch``: ``None`` (the buffer's next epoch) or, on the streamed path outside a CUDA graph
    capture, an int in ``(last, max_epoch]``. Returns it as an int (or ``None``)."""
    if stream_epoch is None:
        return None
    if not streaming:
        raise ValueError(f"stream_epoch is for streaming=True (the batch ring counts its own epochs), got "
                         f"stream_epoch={stream_epoch!r} with streaming=False")
    if capturing:
        raise ValueError("stream_epoch must be None while capturing a CUDA graph: every replay would reuse it "
                         "(ABA); the device epoch advances by itself")
    if not isinstance(stream_epoch, (int, np.integer)) or isinstance(stream_epoch, (bool, np.bool_)):
        raise ValueError(f"stream_epoch must be None or an int in ({last}, {max_epoch}], got {_desc(stream_epoch)}")
    if not last < int(stream_epoch) <= max_epoch:
        raise ValueError(f"stream_epoch must grow from call to call: an int in ({last}, {max_epoch}] (the last "
                         f"epoch used on these buffers was {last}), got {int(stream_epoch)}")
    return int(stream_epoch)
