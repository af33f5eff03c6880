"""The kernels of the streamring CUDA library and one typed Python launcher per kernel.

The C signature of every ``extern "C" __global__`` kernel in ``csrc/*.cu`` is parsed from the
source (:func:`kernel_signatures`); :class:`DeviceLibrary` marshals keyword arguments by that
signature (pointer -> address int, ``int`` -> ``np.int32``, ``int64_t``/``long long`` ->
``np.int64``, ``uint64_t`` -> ``np.uint64``) and refuses a missing, extra or misspelled
parameter, naming the kernel. The launchers below are the only call sites of the kernels:
one function per kernel, keyword-only parameters named exactly as in C (``tests/unit/test_gpu.py``
checks every launcher against the parsed signature), so a kernel whose signature changes
fails the tests on any machine instead of receiving shifted arguments on the GPU.

``stream`` is anything :class:`StreamRef` wraps (a torch CUDA stream) or a ``StreamRef``.
Imports of cuda.core are lazy: this module imports without a GPU.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import numpy as np

from .ringdesc import CSRC

_SCALARS = {
    "int": np.int32, "unsignedint": np.uint32, "int64_t": np.int64, "longlong": np.int64, "uint64_t": np.uint64,
    "unsignedlonglong": np.uint64,
}


def parse_kernel_signatures(paths) -> dict[str, tuple[tuple[str, str], ...]]:
    """``{kernel: ((ctype, name), ...)}`` of every ``extern "C" __global__ void`` in ``paths``.

    ``ctype`` is normalised: qualifiers dropped, spaces removed, ``*`` kept (``"uint8_t*"``).
    """
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for path in paths:
        text = re.sub(r"//[^\n]*", "", Path(path).read_text())
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(?:SR_ONE_WARP\s+)?(\w+)\s*\(([^)]*)\)', text):
            params = []
            for decl in (p.strip() for p in m.group(2).split(",")):
                if not decl:
                    continue
                pm = re.match(r"(.+?)\s*(\**)\s*([A-Za-z_]\w*)$", " ".join(decl.split()))
                if not pm:
                    raise ValueError(f"{Path(path).name}: cannot parse parameter {decl!r} of {m.group(1)}")
                ctype = (pm.group(1).replace("const ", "").replace("const", "") + pm.group(2)).replace(" ", "")
                params.append((ctype, pm.group(3)))
            if m.group(1) in out:
                raise ValueError(f"kernel {m.group(1)} is defined twice in {CSRC}")
            out[m.group(1)] = tuple(params)
    return out


@functools.lru_cache(maxsize=1)
def kernel_signatures() -> dict[str, tuple[tuple[str, str], ...]]:
    """The parsed signatures of every kernel of the library (``csrc/*.cu``)."""
    return parse_kernel_signatures(sorted(CSRC.glob("*.cu")))


def marshal(name: str, params: dict) -> list:
    """Positional launch arguments of kernel ``name`` from keyword ``params`` (by its C signature)."""
    sig = kernel_signatures().get(name)
    if sig is None:
        raise KeyError(f"no kernel {name!r} in the streamring CUDA library ({sorted(kernel_signatures())})")
    want = [n for _, n in sig]
    if set(params) != set(want):
        missing = [n for n in want if n not in params]
        extra = [n for n in params if n not in want]
        raise TypeError(f"kernel {name}({', '.join(want)}): missing {missing}, unexpected {extra}")
    args = []
    for ctype, pname in sig:
        v = params[pname]
        if ctype.endswith("*"):
            args.append(int(v))  # a device address
        elif ctype in _SCALARS:
            t = _SCALARS[ctype]
            iv = int(v)
            if t is np.uint64:
                iv &= 0xFFFFFFFFFFFFFFFF
            info = np.iinfo(t)
            if not info.min <= iv <= info.max:
                raise ValueError(f"kernel {name}: {pname}={v} does not fit {ctype}")
            args.append(t(iv))
        else:
            raise TypeError(f"kernel {name}: parameter {pname} has unsupported C type {ctype!r}")
    return args


class StreamRef:
    """A torch stream seen by cuda.core (``core``, a borrowed ``cuda.core.Stream``) and by
    nvshmem4py (``__cuda_stream__``). The torch stream must outlive this object."""

    def __init__(self, torch_stream):
        self.torch = torch_stream
        self.handle = int(torch_stream.cuda_stream)
        try:
            from cuda.core import Stream

            self.core = Stream.from_handle(self.handle)
        except Exception:  # noqa: BLE001 - older cuda.core: launch() takes the protocol object itself
            self.core = None

    def __cuda_stream__(self):
        return (0, self.handle)


def as_stream_ref(stream) -> StreamRef:
    """``stream`` as a :class:`StreamRef` (a StreamRef passes through; a torch stream is wrapped)."""
    return stream if isinstance(stream, StreamRef) else StreamRef(stream)


class DeviceLibrary:
    """The cubin of ``csrc/*.cu`` loaded with cuda.core and registered with NVSHMEM.

    A cuda.core ObjectCode is a CUlibrary, so it is registered with ``library_init`` (not
    ``module_init``). Kernels are launched only through the typed launchers of this module.
    """

    def __init__(self, nv, cubin_path: str | Path):
        from cuda.core import LaunchConfig, ObjectCode, launch

        self.path = Path(cubin_path)
        self.obj = ObjectCode.from_cubin(self.path.read_bytes())
        self.kernels = {name: self.obj.get_kernel(name) for name in kernel_signatures()}
        self.nvobj = nv.NvshmemKernelObject.from_obj(self.obj)
        nv.library_init(self.nvobj)
        self._LaunchConfig = LaunchConfig
        self._launch = launch
        self._configs: dict = {}

    def launch(self, stream, name: str, grid: int | tuple, block: int, **params) -> None:
        """Launch kernel ``name`` on ``stream`` with keyword ``params`` (checked against its C signature);
        ``grid`` an int or an (x, y) tuple."""
        args = marshal(name, params)
        cfg = self._configs.get((grid, block))
        if cfg is None:
            cfg = self._configs[(grid, block)] = self._LaunchConfig(grid=grid, block=block)
        ref = as_stream_ref(stream)
        self._launch(ref.core if ref.core is not None else ref, cfg, self.kernels[name], *args)


# ----------------------------------------------------------------------------------------------
# verbs.cu: the heap's verb kernels (one launch per host verb; the caller syncs)
# ----------------------------------------------------------------------------------------------
def sr_put(lib, stream, *, dst: int, src: int, nbytes: int, pe: int, block: int = 256) -> None:
    """``nbytes`` from symmetric ``src`` (ours) to ``dst`` at PE ``pe`` (nvshmemx_putmem_block)."""
    lib.launch(stream, "sr_put", 1, block, dst=dst, src=src, nbytes=nbytes, pe=pe)


def sr_get(lib, stream, *, dst: int, src: int, nbytes: int, pe: int, block: int = 256) -> None:
    """``nbytes`` from ``src`` at PE ``pe`` into our symmetric ``dst`` (nvshmemx_getmem_block)."""
    lib.launch(stream, "sr_get", 1, block, dst=dst, src=src, nbytes=nbytes, pe=pe)


def sr_put_signal(lib, stream, *, dst: int, src: int, nbytes: int, sig: int, value: int, op: int, pe: int,
                  block: int = 256) -> None:
    """Put, then the signal (``op`` 0 = SET, 1 = ADD) at PE ``pe``: payload visible before the signal."""
    lib.launch(stream, "sr_put_signal", 1, block, dst=dst, src=src, nbytes=nbytes, sig=sig, value=value, op=op, pe=pe)


def sr_signal_op(lib, stream, *, sig: int, value: int, op: int, pe: int) -> None:
    """Release signal op (quiet + fence first) on ``sig`` at PE ``pe``."""
    lib.launch(stream, "sr_signal_op", 1, 1, sig=sig, value=value, op=op, pe=pe)


def sr_signal_fetch(lib, stream, *, sig: int, out: int) -> None:
    """Acquire load of our own word ``sig`` into ``out``."""
    lib.launch(stream, "sr_signal_fetch", 1, 1, sig=sig, out=out)


def sr_atomic_fetch_or(lib, stream, *, dst: int, value: int, pe: int, out: int) -> None:
    """Release fetch-or on ``dst`` at PE ``pe``; the old value goes to ``out``."""
    lib.launch(stream, "sr_atomic_fetch_or", 1, 1, dst=dst, value=value, pe=pe, out=out)


def sr_atomic_fetch_add(lib, stream, *, dst: int, value: int, pe: int, out: int) -> None:
    """Release fetch-add on ``dst`` at PE ``pe``; the old value goes to ``out``."""
    lib.launch(stream, "sr_atomic_fetch_add", 1, 1, dst=dst, value=value, pe=pe, out=out)


def sr_fence(lib, stream) -> None:
    """``nvshmem_fence`` (+ ``__threadfence_system``)."""
    lib.launch(stream, "sr_fence", 1, 1)


def sr_quiet(lib, stream) -> None:
    """``nvshmem_quiet`` (+ ``__threadfence_system``)."""
    lib.launch(stream, "sr_quiet", 1, 1)


def sr_peer_table(lib, stream, *, base: int, out: int, npes: int) -> None:
    """``out[pe] = nvshmem_ptr(base, pe)`` for every PE (0 where not load/store reachable)."""
    lib.launch(stream, "sr_peer_table", 1, 32, base=base, out=out, npes=npes)


def sr_my_pe(lib, stream, *, out: int) -> None:
    """``out[0] = nvshmem_my_pe()``, ``out[1] = nvshmem_n_pes()`` (int32)."""
    lib.launch(stream, "sr_my_pe", 1, 1, out=out)


# ----------------------------------------------------------------------------------------------
# ring_kernels.cu: what a streamed layer enqueues (streamring.ring.device.DeviceRing calls these)
# ----------------------------------------------------------------------------------------------
def ring_reuse_wait(lib, stream, *, d: int, buf: int, me: int, chunk: int, inject: int) -> None:
    """Owner: wait for every ack of ``chunk - num_slots`` before writing ``chunk`` (no-op below S)."""
    lib.launch(stream, "ring_reuse_wait", 1, 1, d=d, buf=buf, me=me, chunk=chunk, inject=inject)


def ring_drain(lib, stream, *, d: int, buf: int, me: int) -> None:
    """Owner, end of stream: collect the last acks of every slot (every mask left zero)."""
    lib.launch(stream, "ring_drain", 1, 1, d=d, buf=buf, me=me)


def ring_advance_epoch(lib, stream, *, d: int) -> None:
    """Increment the device epoch word (last in a captured graph: the next replay is the next epoch)."""
    lib.launch(stream, "ring_advance_epoch", 1, 1, d=d)


def ring_spin_wait(lib, stream, *, d: int, buf: int, src0: int, chunk: int, inject: int, sources: int) -> None:
    """Acquire (spin with deadline) both generations of ``chunk`` of sources ``src0 .. src0+sources-1``."""
    lib.launch(stream, "ring_spin_wait", sources, 1, d=d, buf=buf, src0=src0, chunk=chunk, inject=inject)


def ring_publish(lib, stream, *, d: int, buf: int, peers: int, me: int, chunk: int, kind: int, valid: int,
                 valid_ptr: int = 0) -> None:
    """Write the kind's slot metadata (``valid`` tokens, or the device int64 at ``valid_ptr`` when
    it is not 0), then release my slot's ``kind`` (RING_ROUTE / RING_LAYOUT) generation of ``chunk``
    at every PE."""
    lib.launch(stream, "ring_publish", 1, 1, d=d, buf=buf, peers=peers, me=me, chunk=chunk, kind=kind, valid=valid,
               valid_ptr=valid_ptr)


def ring_acquire_checked(lib, stream, *, d: int, buf: int, peers: int, me: int, src0: int, chunk: int,
                         valid_tab: int, inject: int, sources: int) -> None:
    """Acquire ``chunk`` of sources ``src0 ..``, check their metadata words and record each source's
    valid token count in ``valid_tab`` (device int32 ``[num_chunks][num_ranks]``; 0 on a mismatch)."""
    lib.launch(stream, "ring_acquire_checked", sources, 1, d=d, buf=buf, peers=peers, me=me, src0=src0, chunk=chunk,
               valid_tab=valid_tab, inject=inject)


def ring_ack(lib, stream, *, d: int, buf: int, peers: int, me: int, src0: int, chunk: int, sources: int) -> None:
    """Acknowledge ``chunk`` of sources ``src0 ..`` (their slots' reads are complete in stream order)."""
    lib.launch(stream, "ring_ack", sources, 1, d=d, buf=buf, peers=peers, me=me, src0=src0, chunk=chunk)


def ring_wait_any(lib, stream, *, d: int, buf: int, peers: int, me: int, chunk: int, valid_tab: int, pending: int,
                  first: int, chosen: int, max_take: int, window_ns: int, inject: int) -> None:
    """Ready order: acquire (and check, recording its valid count in ``valid_tab``) whichever pending
    source of ``chunk`` is ready first, then (``max_take`` > 1) the pending sources ready within
    ``window_ns`` of it; their indices go to the device int32 ``chosen[0:max_take]``, -1 past the last
    (``pending``: a device uint64 bitmask of sources; nothing pending: all -1, no wait)."""
    lib.launch(stream, "ring_wait_any", 1, 1, d=d, buf=buf, peers=peers, me=me, chunk=chunk, valid_tab=valid_tab,
               pending=pending, first=first, chosen=chosen, max_take=max_take, window_ns=window_ns, inject=inject)


def ring_ack_chosen(lib, stream, *, d: int, buf: int, peers: int, me: int, chosen: int, count: int,
                    chunk: int) -> None:
    """Acknowledge ``chunk`` of the sources in the device int32 ``chosen[0:count]`` (-1 entries skipped)."""
    lib.launch(stream, "ring_ack_chosen", 1, 1, d=d, buf=buf, peers=peers, me=me, chosen=chosen, count=count,
               chunk=chunk)


# ----------------------------------------------------------------------------------------------
# selftest.cu: the synthetic producer/consumer of `streamring gpu-check`
# ----------------------------------------------------------------------------------------------
def ring_produce(lib, stream, *, d: int, buf: int, peers: int, me: int, chunk: int, kind: int, inject: int,
                 delay_cycles: int, t_pub: int, block: int = 256) -> None:
    """Fill my slot's ``kind`` payload of ``chunk`` with the pattern, then publish it."""
    lib.launch(stream, "ring_produce", 1, block, d=d, buf=buf, peers=peers, me=me, chunk=chunk, kind=kind,
               inject=inject, delay_cycles=delay_cycles, t_pub=t_pub)


def ring_consume(lib, stream, *, d: int, buf: int, peers: int, me: int, src0: int, chunk: int, inject: int,
                 hold_cycles: int, t_acq: int, sources: int, block: int = 256) -> None:
    """Acquire, check and acknowledge ``chunk`` of sources ``src0 ..`` (one block per source)."""
    lib.launch(stream, "ring_consume", sources, block, d=d, buf=buf, peers=peers, me=me, src0=src0, chunk=chunk,
               inject=inject, hold_cycles=hold_cycles, t_acq=t_acq)


# ----------------------------------------------------------------------------------------------
# ep_kernels.cu: the cross-PE handoffs of the expert-parallel layer
# ----------------------------------------------------------------------------------------------
def ep_signal_arrivals(lib, stream, *, d: int, comb: int, comb_peers: int, me: int, off_arrived: int,
                       ready_list: int, ready_hi: int, lo_index: int, hi_index: int, row_src: int, row_chunk: int,
                       block_m: int, max_items: int) -> None:
    """After an L2 that stored into the owners: add each ready block's (owner, chunk) row counts."""
    if max_items > 0:
        lib.launch(stream, "ep_signal_arrivals", max_items, 32, d=d, comb=comb, comb_peers=comb_peers, me=me,
                   off_arrived=off_arrived, ready_list=ready_list, ready_hi=ready_hi, lo_index=lo_index,
                   hi_index=hi_index, row_src=row_src, row_chunk=row_chunk, block_m=block_m)


#: ``ep_put_rows`` keeps one CTA per ready block where its grid has at least this many blocks (prefill sizes)
PUT_ROWS_SPLIT_BELOW = 256
#: below that, it splits each block over up to this many CTAs in all
PUT_ROWS_TARGET_CTAS = 2048
#: the fewest rows one of its CTAs copies (one per warp of a 256-thread CTA)
PUT_ROWS_MIN_ROWS = 8


def put_rows_parts(block_m: int, max_items: int) -> int:
    """CTAs per ready block of ``ep_put_rows``: 1 where ``max_items`` >= :data:`PUT_ROWS_SPLIT_BELOW` (prefill
    sizes: the grid is unchanged); at decode sizes, where a forward has few blocks and one CTA per block leaves
    most SMs idle while the result rows are copied, as many as keep :data:`PUT_ROWS_MIN_ROWS` rows a CTA and
    :data:`PUT_ROWS_TARGET_CTAS` CTAs in all (16 per 128-row block at 48 blocks, the fastest split measured:
    docs/performance.md). ``STREAMRING_PUT_ROWS_PARTS`` (a positive int, at most ``block_m``) fixes it, for an
    A/B in one run."""
    forced = os.environ.get("STREAMRING_PUT_ROWS_PARTS")
    if forced:
        if not forced.isdigit() or not 1 <= int(forced) <= block_m:
            raise ValueError(f"STREAMRING_PUT_ROWS_PARTS must be an int in [1, block_m={block_m}], got {forced!r}")
        return int(forced)
    if max_items >= PUT_ROWS_SPLIT_BELOW:
        return 1
    return max(1, min(block_m // PUT_ROWS_MIN_ROWS, PUT_ROWS_TARGET_CTAS // max(1, max_items)))


def ep_put_rows(lib, stream, *, d: int, comb: int, comb_peers: int, me: int, off_arrived: int, off_rows: int,
                y_stage: int, hidden: int, ready_list: int, ready_hi: int, lo_index: int, hi_index: int, row_src: int,
                row_tok: int, row_chunk: int, block_m: int, max_items: int, block: int = 256) -> None:
    """Copy the ready blocks' rows from the staging rows into their owners' combine rows, then add the counts:
    through the peer pointers ``comb_peers`` (P2P), or NVSHMEM puts where it is 0. Grid
    ``(max_items, put_rows_parts(block_m, max_items))``: each CTA a part of one block's rows."""
    if max_items > 0:
        grid = (max_items, put_rows_parts(block_m, max_items))
        lib.launch(stream, "ep_put_rows", grid, block, d=d, comb=comb, comb_peers=comb_peers, me=me,
                   off_arrived=off_arrived,
                   off_rows=off_rows, y_stage=y_stage, hidden=hidden, ready_list=ready_list, ready_hi=ready_hi,
                   lo_index=lo_index, hi_index=hi_index, row_src=row_src, row_tok=row_tok, row_chunk=row_chunk,
                   block_m=block_m)


def ep_pull_slots(lib, stream, *, d: int, buf: int, mirror: int, mirror_stride: int, src_list: int, chunk: int,
                  sources: int, block: int = 256) -> None:
    """NVSHMEM path: get the slot of ``chunk`` of the ``sources`` sources listed in the device int32
    ``src_list`` into the local mirror."""
    lib.launch(stream, "ep_pull_slots", sources, block, d=d, buf=buf, mirror=mirror, mirror_stride=mirror_stride,
               src_list=src_list, chunk=chunk)


def ep_wait_arrivals(lib, stream, *, d: int, comb: int, off_arrived: int, expected: int, first_chunk: int,
                     num_chunks: int) -> None:
    """Owner: wait (acquire, deadline) until the rows of chunks ``first_chunk ..`` (``num_chunks`` of
    them) arrived (``expected``: the device int64 counts of every chunk)."""
    lib.launch(stream, "ep_wait_arrivals", 1, 1, d=d, comb=comb, off_arrived=off_arrived, expected=expected,
               first_chunk=first_chunk, num_chunks=num_chunks)


def ep_delay(lib, stream, *, ns: int) -> None:
    """A device-side straggler: one thread spins for as many nanoseconds as the int64 at ``ns`` holds."""
    lib.launch(stream, "ep_delay", 1, 1, ns=ns)


def ring_pingpong(lib, stream, *, d: int, buf: int, peers: int, me: int, peer: int, initiator: int, together: int,
                  nchunks: int, out_ns: int) -> None:
    """Ring publish/acquire ping-pong of chunks 0 .. nchunks-1 between ``me`` and ``peer``
    (``together``: both generations under one release; else two publications, as the layer does)."""
    lib.launch(stream, "ring_pingpong", 1, 1, d=d, buf=buf, peers=peers, me=me, peer=peer, initiator=initiator,
               together=together, nchunks=nchunks, out_ns=out_ns)


def flag_pingpong(lib, stream, *, my_flag: int, peer_flag: int, initiator: int, iters: int, base: int,
                  deadline_cycles: int, out_ns: int) -> None:
    """The floor: one flag st.release.sys / ld.acquire.sys ping-pong with the peer."""
    lib.launch(stream, "flag_pingpong", 1, 1, my_flag=my_flag, peer_flag=peer_flag, initiator=initiator, iters=iters,
               base=base, deadline_cycles=deadline_cycles, out_ns=out_ns)


#: every typed launcher, by kernel name (tests check it covers kernel_signatures() exactly)
LAUNCHERS = {f.__name__: f for f in (
    sr_put, sr_get, sr_put_signal, sr_signal_op, sr_signal_fetch, sr_atomic_fetch_or, sr_atomic_fetch_add, sr_fence,
    sr_quiet, sr_peer_table, sr_my_pe, ring_reuse_wait, ring_drain, ring_advance_epoch, ring_spin_wait,
    ring_publish, ring_acquire_checked, ring_wait_any, ring_ack_chosen, ring_ack, ring_produce, ring_consume, ep_signal_arrivals, ep_put_rows,
    ep_pull_slots, ep_wait_arrivals, ep_delay, ring_pingpong, flag_pingpong,
)}
