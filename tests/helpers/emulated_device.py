"""One PE of the GPU layer on the CPU: a symmetric heap in host memory and the CUDA library's ring
and expert-parallel kernels re-stated in Python, kernel by kernel.

What it is for: running the library's own pipeline object (:class:`streamring.moe.ep_buffer.EPBuffer`)
on a machine without a GPU, with the Triton kernels under ``TRITON_INTERPRET=1``. Every launch goes
through :func:`streamring.device.kernels.marshal`, so the parameters the layer passes are checked
against the C signatures of ``csrc/*.cu`` exactly as on the GPU; the kernels then act on the same
memory the CUDA code would (raw addresses, the descriptor words of ``RingLayout.descriptor()``).

What it is not: a transport. It serves ONE PE (``num_ranks == 1``): its own chunks go through its
own ring, so the generations, metadata checks, acknowledgements, arrival counts and epochs are all
exercised, but no handoff between processes is (the GPU check runs those on real PEs). Kernels run
in call order; there is no concurrency to get wrong here.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from streamring.device import kernels as DKN
from streamring.device.ringdesc import (
    DESC_INDEX,
    ERRORS,
    INJECT_BITS,
    META_BASE,
    META_CHUNK,
    META_LAYOUT_GEN,
    META_ROUTE_GEN,
    META_VALID,
    RING_DESC_WORDS,
    RING_ROUTE,
    RS_ABORT,
    RS_BAD_SEEN,
    RS_BAD_WANT,
    RS_CONSUMED,
    RS_FIRST_ERROR,
    RS_PUBLISHED,
    RS_TIMEOUTS,
    RS_VIOLATIONS,
)
from streamring.device.verbs import Region
from streamring.ring.layout import make_gen

if os.environ.get("TRITON_INTERPRET") == "1":  # (a rank script's process: pytest's conftest installs it in its own)
    from triton_interp_patch import install as _install_interp_patch

    _install_interp_patch()

CODE = {name: code for name, (code, _) in ERRORS.items()}
TIMEOUT_CODES = {CODE[n] for n in ("RE_ACQUIRE_TIMEOUT", "RE_REUSE_TIMEOUT", "RE_DRAIN_TIMEOUT", "RE_COMBINE_TIMEOUT")}


def words(addr: int, n: int, dtype=np.int64) -> np.ndarray:
    """``n`` words of ``dtype`` at host address ``addr`` (a view: writes go to that memory)."""
    ct = {np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32}[dtype]
    return np.ctypeslib.as_array((ct * n).from_address(int(addr)))


class Desc:
    """A RingDesc read from its int64 words (``ringdesc.DESC_FIELDS``)."""

    def __init__(self, addr: int):
        w = words(addr, RING_DESC_WORDS)
        self.f = {name: int(w[i]) for name, i in DESC_INDEX.items()}

    def __getattr__(self, name):
        return self.f[name]

    def epoch(self) -> int:
        return int(words(self.f["epoch"], 1, np.uint64)[0])

    def status(self) -> np.ndarray:
        return words(self.f["status"], 16, np.uint64)

    def record_error(self, code, src, chunk, seen, want):
        st = self.status()
        if st[RS_FIRST_ERROR] == 0:
            st[RS_FIRST_ERROR] = np.uint64(code | ((src & 0xFFFF) << 8) | ((chunk & 0xFFFFFFFF) << 24))
            st[RS_BAD_SEEN] = np.uint64(seen & 0xFFFFFFFFFFFFFFFF)
            st[RS_BAD_WANT] = np.uint64(want & 0xFFFFFFFFFFFFFFFF)
        if code in TIMEOUT_CODES:
            st[RS_TIMEOUTS] += np.uint64(1)
            st[RS_ABORT] = np.uint64(1)
        else:
            st[RS_VIOLATIONS] += np.uint64(1)

    def word(self, buf: int, off: int) -> np.ndarray:
        return words(buf + off, 1, np.uint64)

    def gen_word(self, buf, kind, src, slot):
        base = self.off_route_ready_gen if kind == RING_ROUTE else self.off_layout_ready_gen
        return self.word(buf, base + (src * self.num_slots + slot) * 8)

    def meta(self, buf, slot) -> np.ndarray:
        return words(buf + self.off_meta + slot * self.meta_words * 8, self.meta_words, np.uint64)

    def ack_word(self, buf, slot):
        return self.word(buf, self.off_ack_mask + slot * self.mask_words * 8)


class EmulatedLibrary:
    """The kernels the expert-parallel layer launches, for one PE in host memory (see the module doc)."""

    def __init__(self):
        self.launches: list[str] = []

    def launch(self, stream, name: str, grid: int | tuple, block: int, **params) -> None:
        DKN.marshal(name, params)  # the C signature, exactly as on the GPU
        self.launches.append(name)
        getattr(self, name)(grid, **params)

    # -- ring_kernels.cu ---------------------------------------------------------------------------
    def ring_publish(self, grid, *, d, buf, peers, me, chunk, kind, valid, valid_ptr):
        D = Desc(d)
        if D.num_chunks <= 0:
            return
        g = make_gen(D.epoch(), chunk + 1)
        m = D.meta(buf, chunk % D.num_slots)
        if kind == RING_ROUTE:
            m[META_CHUNK] = chunk
            m[META_BASE] = chunk * D.tokens_per_slot
            m[META_VALID] = np.uint64(int(words(valid_ptr, 1)[0]) & (2**64 - 1)) if valid_ptr else valid
            m[META_ROUTE_GEN] = g
        else:
            m[META_LAYOUT_GEN] = g
        D.gen_word(buf, kind, me, chunk % D.num_slots)[0] = g
        D.status()[RS_PUBLISHED] += np.uint64(1)

    def _acquire(self, D, buf, src, chunk, inject) -> bool:
        if inject & INJECT_BITS["skip-acquire"]:
            return True
        g = make_gen(D.epoch(), chunk + 1)
        for kind in (0, 1):
            seen = int(D.gen_word(buf, kind, src, chunk % D.num_slots)[0])
            if seen != g:
                # nothing else runs while this PE waits: a generation that is not there now never comes
                D.record_error(CODE["RE_ACQUIRE_TIMEOUT"], src, chunk, seen, g)
                return False
        return True

    def _ready(self, D, buf, src, chunk) -> bool:
        g = make_gen(D.epoch(), chunk + 1)
        return all(int(D.gen_word(buf, kind, src, chunk % D.num_slots)[0]) == g for kind in (0, 1))

    def _newer(self, D, buf, src, chunk) -> bool:
        g = make_gen(D.epoch(), chunk + 1)
        return any(int(D.gen_word(buf, kind, src, chunk % D.num_slots)[0]) > g for kind in (0, 1))

    def _check_meta(self, D, buf, src, chunk, valid_tab, inject):
        learned = words(valid_tab + (chunk * D.num_ranks + src) * 4, 1, np.int32)
        learned[0] = 0
        m = D.meta(buf, chunk % D.num_slots)
        g = make_gen(D.epoch(), chunk + 1)
        want = {META_CHUNK: chunk, META_BASE: chunk * D.tokens_per_slot, META_ROUTE_GEN: g, META_LAYOUT_GEN: g}
        for w, v in want.items():
            if int(m[w]) != v:
                D.record_error(CODE["RE_META"], src, chunk, int(m[w]), v)
                return
        valid = int(m[META_VALID])
        if valid > D.tokens_per_slot:
            D.record_error(CODE["RE_META"], src, chunk, valid, D.tokens_per_slot)
            return
        learned[0] = valid

    def ring_acquire_checked(self, grid, *, d, buf, peers, me, src0, chunk, valid_tab, inject):
        D = Desc(d)
        if D.num_chunks <= 0:
            return
        for src in range(src0, src0 + grid):
            if self._acquire(D, buf, src, chunk, inject):
                self._check_meta(D, buf, src, chunk, valid_tab, inject)
            else:
                words(valid_tab + (chunk * D.num_ranks + src) * 4, 1, np.int32)[0] = 0

    def ring_wait_any(self, grid, *, d, buf, peers, me, chunk, valid_tab, pending, first, chosen, max_take, window_ns,
                      inject):
        D = Desc(d)
        if D.num_chunks <= 0:
            return
        pend = words(pending, 1, np.uint64)
        if first:
            pend[0] = np.uint64((1 << D.num_ranks) - 1)
        out = words(chosen, max_take, np.int32)
        out[:] = -1
        m = int(pend[0])
        if not m:
            return
        # kernels run in call order here: every pending source's chunk is published or never will be, so
        # the first wait takes the lowest and the window every other one that is ready (no time passes)
        pick = (m & -m).bit_length() - 1
        ok = self._acquire(D, buf, pick, chunk, inject)
        taken = [pick]
        if ok:
            rest = m & ~(1 << pick)
            while rest and len(taken) < max_take:
                src = (rest & -rest).bit_length() - 1
                rest &= ~(1 << src)
                if self._newer(D, buf, src, chunk):  # as the kernel: a later step's first wait records it
                    break
                if self._ready(D, buf, src, chunk):
                    taken.append(src)
        for i, src in enumerate(taken):
            out[i] = src
            if ok:
                self._check_meta(D, buf, src, chunk, valid_tab, inject)
            else:
                words(valid_tab + (chunk * D.num_ranks + src) * 4, 1, np.int32)[0] = 0
            pend[0] = np.uint64(int(pend[0]) & ~(1 << src))

    def _ack(self, D, buf, src, chunk, me):
        mask = D.ack_word(buf, chunk % D.num_slots)
        bit = 1 << me
        if int(mask[0]) & bit:
            D.record_error(CODE["RE_DOUBLE_ACK"], src, chunk, int(mask[0]), bit)
        mask[0] = np.uint64(int(mask[0]) | bit)
        D.status()[RS_CONSUMED] += np.uint64(1)

    def ring_ack(self, grid, *, d, buf, peers, me, src0, chunk):
        D = Desc(d)
        if D.num_chunks > 0:
            for src in range(src0, src0 + grid):
                self._ack(D, buf, src, chunk, me)

    def ring_ack_chosen(self, grid, *, d, buf, peers, me, chosen, count, chunk):
        D = Desc(d)
        if D.num_chunks > 0:
            for src in words(chosen, count, np.int32):
                if src >= 0:
                    self._ack(D, buf, int(src), chunk, me)

    def _collect(self, D, buf, me, slot, prev_chunk, code, inject=0):
        mask = D.ack_word(buf, slot)
        full = (1 << D.num_ranks) - 1
        if not inject & INJECT_BITS["skip-ack-wait"] and int(mask[0]) != full:
            D.record_error(code, me, prev_chunk, int(mask[0]), full)
            return
        mask[0] = 0

    def ring_reuse_wait(self, grid, *, d, buf, me, chunk, inject):
        D = Desc(d)
        if D.num_chunks > 0 and chunk >= D.num_slots:
            self._collect(D, buf, me, chunk % D.num_slots, chunk - D.num_slots, CODE["RE_REUSE_TIMEOUT"], inject)

    def ring_drain(self, grid, *, d, buf, me):
        D = Desc(d)
        n, S = D.num_chunks, D.num_slots
        for s in range(min(S, max(n, 0))):
            last = s + ((n - 1 - s) // S) * S
            self._collect(D, buf, me, s, last, CODE["RE_DRAIN_TIMEOUT"])

    def ring_advance_epoch(self, grid, *, d):
        D = Desc(d)
        w = words(D.f["epoch"], 1, np.uint64)
        w[0] += np.uint64(1)

    # -- ep_kernels.cu -------------------------------------------------------------------------------
    @staticmethod
    def _runs(row_src, row_chunk, row0, block_m):
        src = words(row_src + row0 * 4, block_m, np.int32)
        chk = words(row_chunk + row0 * 4, block_m, np.int32)
        runs, cur, n = [], None, 0
        for s, c in zip(src.tolist(), chk.tolist()):
            if (s, c) != cur:
                if n and cur[0] >= 0:
                    runs.append((cur[0], cur[1], n))
                cur, n = (s, c), 0
            n += 1
        if n and cur[0] >= 0:
            runs.append((cur[0], cur[1], n))
        return runs

    def _ready_blocks(self, grid, ready_list, ready_hi, lo_index, hi_index):
        hi_w = words(ready_hi, max(lo_index, hi_index) + 1, np.int32)
        lo, hi = int(hi_w[lo_index]), int(hi_w[hi_index])
        return words(ready_list + lo * 4, max(0, min(hi - lo, grid)), np.int32).tolist()

    def ep_signal_arrivals(self, grid, *, d, comb, comb_peers, me, off_arrived, ready_list, ready_hi, lo_index,
                           hi_index, row_src, row_chunk, block_m):
        for bid in self._ready_blocks(grid, ready_list, ready_hi, lo_index, hi_index):
            for src, chunk, n in self._runs(row_src, row_chunk, bid * block_m, block_m):
                assert src == me, "one PE: every row belongs to this PE"
                words(comb + off_arrived + chunk * 8, 1, np.uint64)[0] += np.uint64(n)

    def ep_put_rows(self, grid, *, d, comb, comb_peers, me, off_arrived, off_rows, y_stage, hidden, ready_list, ready_hi,
                    lo_index, hi_index, row_src, row_tok, row_chunk, block_m):
        row_bytes = hidden * 2
        blocks, parts = grid  # CTA (b, p): part p of block b's rows, its own count ADDs (as the kernel)
        per_part = -(-block_m // parts)
        for bid in self._ready_blocks(blocks, ready_list, ready_hi, lo_index, hi_index):
            src = words(row_src + bid * block_m * 4, block_m, np.int32)
            tok = words(row_tok + bid * block_m * 8, block_m, np.int64)
            for r0 in range(0, block_m, per_part):
                r1 = min(block_m, r0 + per_part)
                for i in range(r0, r1):
                    if src[i] >= 0:
                        ctypes.memmove(comb + off_rows + int(tok[i]) * row_bytes,
                                       y_stage + (bid * block_m + i) * row_bytes, row_bytes)
                for s, chunk, n in self._runs(row_src, row_chunk, bid * block_m + r0, r1 - r0):
                    words(comb + off_arrived + chunk * 8, 1, np.uint64)[0] += np.uint64(n)

    def ep_pull_slots(self, grid, *, d, buf, mirror, mirror_stride, src_list, chunk):
        D = Desc(d)
        if D.num_chunks > 0:
            for j in range(grid):
                src = int(words(src_list + j * 4, 1, np.int32)[0])
                if src < 0:  # no source in this place of the list
                    continue
                ctypes.memmove(mirror + src * mirror_stride, buf, D.total_bytes)

    def ep_wait_arrivals(self, grid, *, d, comb, off_arrived, expected, first_chunk, num_chunks):
        D = Desc(d)
        if D.num_chunks <= 0:
            return
        arrived = words(comb + off_arrived, first_chunk + num_chunks, np.uint64)
        want = words(expected, first_chunk + num_chunks, np.int64)
        for c in range(first_chunk, first_chunk + num_chunks):
            if int(arrived[c]) != int(want[c]):
                code = "RE_COMBINE_COUNT" if int(arrived[c]) > int(want[c]) else "RE_COMBINE_TIMEOUT"
                D.record_error(CODE[code], -1, c, int(arrived[c]), int(want[c]))
                return

    def ep_delay(self, grid, *, ns):
        pass  # a straggler delays nothing in a sequential emulation


class _Handle:
    def __init__(self, tensor):
        self.tensor = tensor
        self.ptr = int(tensor.data_ptr())


class EmulatedHeap:
    """A one-PE symmetric heap in host memory with :class:`EmulatedLibrary` as its ``lib``: what
    :class:`~streamring.ring.device.DeviceRing` and ``EPBuffer`` need of an ``NvshmemHeap``."""

    rank = 0
    num_ranks = 1
    device = torch.device("cpu")
    device_index = 0
    _torch = torch

    def __init__(self):
        self.lib = EmulatedLibrary()
        self.regions: list[Region] = []

    def alloc(self, name: str, nbytes: int) -> Region:
        t = torch.zeros(int(nbytes), dtype=torch.uint8)
        r = Region(name=name, nbytes=int(nbytes), handle=_Handle(t), local=t)
        self.regions.append(r)
        return r

    def free(self, region: Region) -> None:
        self.regions = [r for r in self.regions if r is not region]

    def peer_table(self, region: Region) -> torch.Tensor:
        return torch.tensor([region.handle.ptr], dtype=torch.int64)

    def barrier(self) -> None:
        pass

    def sync(self) -> None:
        pass
