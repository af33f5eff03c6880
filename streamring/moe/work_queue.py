"""The ready-block work queue of one forward and its persistent expert consumer (Python side).

:class:`WorkQueue` wraps a :class:`~streamring.moe.blocks.BlockConsumer` built for the
expert-parallel dispatch (``ep_entries > 0``): the dispatch fills its blocks as before, and instead
of one L1 grid + one L2 grid + ``ep_signal_arrivals`` per dispatch step, ONE persistent kernel
(``streamring.device.persistent_moe``) per forward computes every ready block's tiles as they are
published, stores the L2 rows straight into the owners' combine rows and signals the owners'
``arrived[chunk]`` words from the L2 epilogue.

Stream order of one forward (every call enqueues on the *current* stream; nothing syncs the host)::

    dispatch stream                                consumer stream
    bc.begin(); q.reset()                          (forked after both: wait on the dispatch stream)
                                                   q.launch(fw, ctas=SMs - k, ...)   <- one launch
    per dispatch step j:
      [acquire] ep_gather; bc.dispatch_ep(..., step=j); [ack]
      q.publish(j)                                 (CTAs pick the new blocks up)
    bc.seal(n); q.seal(n)                          (partial blocks ready; CTAs end)
                                                   owner: ep_wait_arrivals -> combine_owner

``reset`` must precede, in stream order, both the launch and the first ``publish`` of the forward
(``bc.begin`` likewise precedes the first dispatch). The launch may come before any publish: its
CTAs wait (acquire, deadline) for the blocks. ``ctas`` must leave SMs free for the dispatch and the
producers while the CTAs wait (see ``persistent_moe``'s docstring: the SM reservation is what makes
the queue deadlock-free).
"""

from __future__ import annotations

import torch

from ..device import persistent_moe as PM
from ..device.queue_order import COUNT_MASK, CTRL_CLAIM, CTRL_READY, CTRL_WORDS, SEALED, total_items
from .blocks import FP8, BlockConsumer
from .weight_views import FP8BlocksView

QUEUE_INJECT_MODES = tuple(m for m in PM.QUEUE_INJECT_BITS if m != "none")


class WorkQueue:
    """The device work queue of ``bc``'s ready list (one per :class:`BlockConsumer`).

    Args:
        bc: the expert-parallel block consumer whose ready list the queue serves (``ep_entries > 0``:
            the queue needs each row's owner, combine row and chunk).
        group: ready positions per group of the item order (CTAs that claim consecutive items share
            a weight tile; ``queue_order``).
    """

    def __init__(self, bc: BlockConsumer, *, group: int = 8):
        if not bc.ep:
            raise ValueError("WorkQueue needs an expert-parallel BlockConsumer (made with ep_entries > 0): the "
                             "persistent consumer stores each row into its owner and signals its chunk")
        if not isinstance(group, int) or group < 1:
            raise ValueError(f"group must be an integer >= 1, got {group!r}")
        self.bc, self.group = bc, group
        self.cap = bc.max_blocks
        self.nt1 = bc.shape.intermediate // 128
        self.nt2 = bc.shape.hidden // 128
        # one tensor, one memset per forward: claim counter, ready word, l1_done[cap], l2_done[cap]
        self.ctrl = torch.zeros(CTRL_WORDS + 2 * self.cap, dtype=torch.int32, device=bc.device)
        self.l1_done = self.ctrl[CTRL_WORDS: CTRL_WORDS + self.cap]
        self.l2_done = self.ctrl[CTRL_WORDS + self.cap:]

    def reset(self) -> None:
        """Zero the claim counter, the ready word and the per-block counters (a memset, current stream)."""
        self.ctrl.zero_()

    def publish(self, step: int) -> None:
        """After dispatch step ``step`` (stream order): ``ready_hi[step + 1]`` positions are ready (release)."""
        PM.queue_publish(self.ctrl, self.bc.ready_hi, step + 1, seal=False)

    def seal(self, step: int) -> None:
        """After ``bc.seal(step)`` (stream order): the final count ``ready_hi[step + 1]`` with the SEALED bit
        (release); claims past the last item then end the CTAs."""
        PM.queue_publish(self.ctrl, self.bc.ready_hi, step + 1, seal=True)

    def total_items(self, n: int) -> int:
        """Claim indices of a forward with ``n`` ready blocks (``queue_order.total_items``)."""
        return total_items(n, self.nt1, self.nt2, self.group)

    def launch(self, fw: FP8BlocksView, *, ctas: int, comb_rows: torch.Tensor, comb_delta: torch.Tensor,
               arrived: torch.Tensor, arrived_delta: torch.Tensor, status: torch.Tensor, deadline_ns: int,
               inject: str = "none", trace: torch.Tensor | None = None, witness: torch.Tensor | None = None,
               stall_l1_us: int = 0):
        """Launch the persistent consumer of this forward (``ctas`` CTAs) on the current stream.

        ``fw``: this PE's experts. ``comb_rows``: this PE's combine rows (bf16 ``[rows, H]``) and
        ``comb_delta`` (int64 ``[R]``: element distance from ``comb_rows`` to PE r's copy); ``arrived``:
        this PE's arrival words (int64, one per chunk) and ``arrived_delta`` (int64 ``[R]``: word distance
        to PE r's copy; for the symmetric combine area, ``(peer_base - base) // 8``); ``status``: the ring's
        status words (int64 ``[RS_WORDS]``: timeouts are recorded there and its abort word ends every
        wait); ``deadline_ns``: every wait gives up after this long. ``inject``: one of
        ``QUEUE_INJECT_MODES`` or ``"none"``. ``trace``/``witness``/``stall_l1_us``: see
        ``persistent_moe.persistent_moe`` (tests). Returns Triton's compiled-kernel handle (also added to ``bc.gemm_kernels``).
        """
        if inject not in PM.QUEUE_INJECT_BITS:
            raise ValueError(f"inject must be one of {list(PM.QUEUE_INJECT_BITS)}, got {inject!r}")
        if deadline_ns <= 0:
            raise ValueError(f"deadline_ns must be > 0, got {deadline_ns}")
        for name, t, dt in (("comb_delta", comb_delta, torch.int64), ("arrived", arrived, torch.int64),
                            ("arrived_delta", arrived_delta, torch.int64), ("status", status, torch.int64),
                            ("comb_rows", comb_rows, torch.bfloat16)):
            if t.dtype != dt:
                raise ValueError(f"{name} must be {dt}, got {t.dtype}")
        if comb_rows.shape[-1] != self.bc.shape.hidden:
            raise ValueError(f"comb_rows must be [rows, hidden={self.bc.shape.hidden}], got {list(comb_rows.shape)}")
        bc = self.bc
        k = PM.persistent_moe(self.ctrl, self.cap, bc.ready_list, bc.block_expert, bc.a.view(FP8), bc.a_sf, fw.w1,
                              fw.w1_sf, bc.h1.view(FP8), bc.h1_sf, fw.w2, fw.w2_sf, bc.row_weight, comb_rows,
                              bc.row_src, bc.row_tok, bc.row_chunk, comb_delta, arrived, arrived_delta, status,
                              ctas=ctas, deadline_ns=deadline_ns, block_m=bc.block_m, group=self.group,
                              inject=PM.QUEUE_INJECT_BITS[inject], trace=trace, witness=witness,
                              stall_l1_us=stall_l1_us)
        if k is not None:
            bc.gemm_kernels.add(k)
        return k

    def state(self) -> dict:
        """The queue's counters (host copy: tests and diagnostics, syncs the device)."""
        c = self.ctrl.cpu()
        word = int(c[CTRL_READY])
        return {"claimed": int(c[CTRL_CLAIM]), "ready": word & COUNT_MASK, "sealed": bool(word & SEALED),
                "l1_done": c[CTRL_WORDS: CTRL_WORDS + self.cap].tolist(),
                "l2_done": c[CTRL_WORDS + self.cap:].tolist()}
