"""A single-process expert-parallel case for the persistent-consumer tests (CPU interpreter and GPU).

As in ``tests/unit/test_ep_kernels.py``, the "PEs" are objects of this process: each has its ring copy,
its combine rows and its arrival words, and the distances (``delta``) between them stand for the
peer mappings, so the kernels' index arithmetic, item order and arrival counts are exercised; the
protocol between real processes is not (``streamring model-check --layer queue`` checks the handoffs,
``tests/gpu/test_gpu_persistent.py`` runs them concurrently on a GPU).

Every source's chunks are produced first (each chunk in its own slot: no reuse), then a PE's
dispatch steps run one after another (one per chunk, or one per (chunk, source) with
``per_source``), as ``streamring.moe.ep_buffer`` runs them.
"""

from __future__ import annotations

import torch

from streamring.device import ep_triton as K
from streamring.moe import blocks as B
from streamring.moe.math import MoEShape
from streamring.moe.work_queue import WorkQueue
from streamring.ring.layout import RingLayout, StreamPlan

R = 2


class FakePE:
    """One 'PE': its ring copy, its expert blocks, its routing (for the owner's reduce)."""

    def __init__(self, me, shape, fw_full, layout, tokens, chunk, num_steps, block_m, dev):
        self.me, self.shape, self.layout, self.dev = me, shape, layout, dev
        self.E_loc = shape.num_experts // R
        self.fw = fw_full.local(me, R)
        self.ring = torch.zeros(layout.nbytes, dtype=torch.uint8, device=dev)
        self.idx = torch.full((layout.num_slots * chunk, shape.topk), -1, dtype=torch.int64, device=dev)
        local = MoEShape(**{**shape.__dict__, "num_experts": self.E_loc, "n_group": 1, "topk_group": 1,
                            "router": "softmax_topk"})
        self.entries = R * chunk * shape.topk
        self.bc = B.BlockConsumer(local, sum(tokens), num_steps, block_m, dev, ep_entries=self.entries, local_y=False)
        self.flat_e = torch.zeros(self.entries, dtype=torch.int32, device=dev)
        self.flat_w = torch.zeros(self.entries, dtype=torch.float32, device=dev)
        self.bad = torch.zeros(1, dtype=torch.int32, device=dev)

    def views(self, s, n):
        L, H, Kk = self.layout, self.shape.hidden, self.shape.topk
        u8 = self.ring
        return (u8[L.topk_idx_off(s): L.topk_idx_off(s) + n * Kk * 8].view(torch.int64).view(n, Kk),
                u8[L.topk_weights_off(s): L.topk_weights_off(s) + n * Kk * 4].view(torch.float32).view(n, Kk),
                u8[L.x_off(s): L.x_off(s) + n * H].view(B.FP8).view(n, H),
                u8[L.x_sf_off(s): L.x_sf_off(s) + n * L.sf_cols * 4].view(torch.float32).view(n, L.sf_cols))


class EPCase:
    """``R`` fake PEs with every chunk of every source produced into their rings."""

    def __init__(self, shape, fw, xs, chunk, *, per_source=False, block_m=16, dev="cpu"):
        self.shape, self.fw, self.xs, self.dev = shape, fw, xs, dev
        self.tokens = [x.shape[0] for x in xs]
        self.plan = StreamPlan(epoch=1, tokens_per_rank=tuple(self.tokens), tokens_per_slot=chunk)
        self.C = max(1, self.plan.num_chunks)
        self.chunk = chunk
        self.layout = RingLayout(num_ranks=R, num_slots=self.C, tokens_per_slot=chunk, hidden=shape.hidden,
                                 topk=shape.topk, num_experts=shape.num_experts)
        self.per_source = per_source
        self.nsteps = self.C * (R if per_source else 1)
        self.pes = [FakePE(r, shape, fw, self.layout, self.tokens, chunk, self.nsteps, block_m, dev) for r in range(R)]
        self.valid_tab = torch.tensor([[self.plan.chunk_tokens(r, c)[1] for r in range(R)] for c in range(self.C)],
                                      dtype=torch.int32, device=dev)
        src_all = torch.arange(R, dtype=torch.int32, device=dev)
        self.delta = torch.tensor([q.ring.data_ptr() - self.pes[0].ring.data_ptr() for q in self.pes],
                                  dtype=torch.int64, device=dev)
        for c in range(self.C):
            for r, p in enumerate(self.pes):
                base, n = self.plan.chunk_tokens(r, c)
                if n:
                    idx, w, q, sf = p.views(c, n)
                    prod = B.Producer(n, shape.num_experts, dev)
                    prod.route(xs[r][base:base + n], fw, shape, idx, w)
                    prod.layout(xs[r][base:base + n], q, sf)
                    p.idx[base:base + n].copy_(idx)
        # the dispatch steps of each PE: (chunk, step, sources); per source: the PE's own source last on
        # PE 0 and first on PE 1 (an arbitrary order, as the device decides it)
        self.steps = []
        for p in self.pes:
            order = [src_all] if not per_source else [src_all[j:j + 1] for j in
                                                      (range(R) if p.me else range(R - 1, -1, -1))]
            self.steps.append([(c, c * len(order) + j, srcs) for c in range(self.C) for j, srcs in enumerate(order)])

    def row_bytes(self) -> int:
        return self.shape.hidden + 4 * (self.shape.hidden // 128)

    def dispatch(self, p, *, pull="route", upto=None, on_step=None) -> None:
        """``bc.begin()`` then PE ``p``'s dispatch steps ``[0, upto)`` (all by default), counting the pulled
        bytes; ``on_step(step)`` after each (the queue's publish)."""
        pe, L, Kk = self.pes[p], self.layout, self.shape.topk
        delta = self.delta - self.delta[p]
        pe.bc.begin()
        for c, step, srcs in self.steps[p][:upto]:
            n = srcs.shape[0] * self.chunk * Kk
            K.ep_gather(pe.ring.view(torch.int64), pe.ring.view(torch.float32), delta // 8, delta // 4, srcs,
                        self.valid_tab, c, p * pe.E_loc, L.topk_idx_off(c) // 8, L.topk_weights_off(c) // 4,
                        pe.flat_e[:n], pe.flat_w[:n], pe.bad, num_ranks=R, tokens_per_slot=self.chunk, topk=Kk,
                        local_experts=pe.E_loc, num_experts=self.shape.num_experts, pull_bytes=pe.bc.pull_bytes,
                        me=p, hidden=self.shape.hidden)
            pe.bc.dispatch_ep(c, pe.flat_e[:n], pe.flat_w[:n], srcs, (pe.ring, pe.ring.view(torch.float32)),
                              (delta, delta // 4), (L.x_off(c), L.x_sf_off(c) // 4), step=step, pull=pull)
            if on_step is not None:
                on_step(step)

    def seal(self, p) -> int:
        """Seal PE ``p``'s blocks; returns the seal's ready index (the number of dispatch steps)."""
        self.pes[p].bc.seal(self.nsteps)
        return self.nsteps

    def combs(self):
        """Fresh combine rows of every owner, poisoned with NaN (every routed (token, k) must be written)."""
        return [torch.full((max(self.tokens) * self.shape.topk, self.shape.hidden), float("nan"),
                           dtype=torch.bfloat16, device=self.dev) for _ in range(R)]

    def comb_delta(self, combs, p):
        return torch.tensor([(c.data_ptr() - combs[p].data_ptr()) // 2 for c in combs], dtype=torch.int64,
                            device=self.dev)

    def compute_per_range(self, p, combs) -> None:
        """The existing path on PE ``p``'s dispatched blocks: one L1 + L2 launch per ready range, each grid
        bounded as ``EPBuffer`` bounds it (``max_ready_per_step`` for a dispatch step, the local experts for
        the seal)."""
        pe = self.pes[p]
        bc, d = pe.bc, self.comb_delta(combs, p)
        per_step = min(bc.max_blocks, pe.entries // (R if self.per_source else 1) // bc.block_m + pe.E_loc)
        for lo in range(self.nsteps + 1):
            bound = per_step if lo < self.nsteps else min(bc.max_blocks, pe.E_loc)
            bc.compute(lo, lo + 1, bound, pe.fw, out=combs[p], direct=(bc.row_src, bc.row_tok, d))

    def queue(self, p, *, group=2) -> WorkQueue:
        return WorkQueue(self.pes[p].bc, group=group)

    def arrived(self):
        """Every owner's arrival words (one int64 per chunk), one tensor ``[R, C]``."""
        return torch.zeros(R, self.C, dtype=torch.int64, device=self.dev)

    def launch(self, q: WorkQueue, p, combs, arrived, status, *, ctas=2, deadline_ns=10**9, **kw):
        d_arr = torch.tensor([(r - p) * self.C for r in range(R)], dtype=torch.int64, device=self.dev)
        return q.launch(self.pes[p].fw, ctas=ctas, comb_rows=combs[p], comb_delta=self.comb_delta(combs, p),
                        arrived=arrived[p], arrived_delta=d_arr, status=status, deadline_ns=deadline_ns, **kw)

    def routed_rows(self, p):
        """``[R, C]``: rows of owner r's chunk c routed to PE ``p``'s experts (what its arrivals must add)."""
        lo, hi = p * self.pes[p].E_loc, (p + 1) * self.pes[p].E_loc
        out = torch.zeros(R, self.C, dtype=torch.int64)
        for r in range(R):
            for c in range(self.C):
                base, n = self.plan.chunk_tokens(r, c)
                idx = self.pes[r].idx[base:base + n].cpu()
                out[r, c] = int(((idx >= lo) & (idx < hi)).sum())
        return out

    def pulled(self, p):
        """``(route rows, token rows)`` PE ``p`` pulls from its peers' slots in one forward."""
        lo, hi = p * self.pes[p].E_loc, (p + 1) * self.pes[p].E_loc
        routes = tokens = 0
        for r in range(R):
            if r == p:
                continue
            mine = (self.pes[r].idx[: self.tokens[r]].cpu() >= lo) & (self.pes[r].idx[: self.tokens[r]].cpu() < hi)
            routes += int(mine.sum())
            tokens += int(mine.any(dim=1).sum())
        return routes, tokens

    def outputs(self, combs):
        """Every owner's reduce of its combine rows (``combine_owner``, k-ordered)."""
        outs = []
        for r in range(R):
            out = torch.zeros(self.tokens[r], self.shape.hidden, dtype=torch.bfloat16, device=self.dev)
            K.combine_owner(combs[r][: self.tokens[r] * self.shape.topk], self.pes[r].idx[: self.tokens[r]], out,
                            topk=self.shape.topk)
            outs.append(out)
        return outs
