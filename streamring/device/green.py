"""Green contexts: a producer partition and a consumer partition of one GPU's SMs.

Progress policy ``green_ctx`` (``streamring.ring.policies.PROGRESS_POLICIES``): producer and
consumer run on streams of two green contexts with disjoint SM sets, so a consumer kernel can
never occupy the SMs its producer needs. Kernels launched there must use the P2P transport of
the ring kernels (NVSHMEM's device state is initialised only in the primary context).

Verified on the H200 (``../shared/notes/gpu-machine.md``): SM counts are multiples of 8; MPS
clients cannot create green contexts (``CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION``); with one
PE per GPU they work.
"""

from __future__ import annotations

import contextlib

from .kernels import StreamRef


class _GreenSide:
    """One green context: its torch stream, a cuda.core stream ref, and how to make it current."""

    def __init__(self, stream, push, pop, sms: int, how: str, keep=None):
        self.stream = stream
        self.sref = StreamRef(stream)
        self._push, self._pop = push, pop
        self.sms = sms
        self.how = how
        self._keep = keep

    @contextlib.contextmanager
    def current(self):
        self._push()
        try:
            yield
        finally:
            self._pop()


def drv_check(res, what: str):
    """Raise RuntimeError naming ``what`` unless a cuda.bindings driver call succeeded; return its values."""
    from cuda.bindings import driver

    err = res[0] if isinstance(res, tuple) else res
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


def make_green_pair(device_index: int, producer_sms: int) -> tuple[_GreenSide, _GreenSide]:
    """Producer green context of ``producer_sms`` SMs and a consumer one of the remaining SMs.

    Uses the driver's disjoint split (``cuDevSmResourceSplitByCount`` + remainder). Falls back
    to ``torch.cuda.green_contexts.GreenContext.create(num_sms=N)`` for both sides when that
    fails (torch carves every context from the same first SMs, so the sides may overlap:
    recorded in ``how``).
    """
    import torch

    if producer_sms % 8 or producer_sms < 8:
        raise ValueError(f"producer_sms must be a positive multiple of 8, got {producer_sms}")
    total = torch.cuda.get_device_properties(device_index).multi_processor_count
    try:
        return _driver_split(device_index, producer_sms)
    except Exception as exc:  # noqa: BLE001 - fall back to torch's API
        driver_err = f"{type(exc).__name__}: {exc}"
    return _torch_pair(device_index, producer_sms, total, driver_err)


def _driver_split(device_index: int, producer_sms: int) -> tuple[_GreenSide, _GreenSide]:
    """The producer and consumer sides from the driver's split of the current context's SMs (disjoint);
    raises where any driver call fails."""
    from cuda.bindings import driver

    dev = drv_check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    sm_type = driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
    # Split the SMs of the current (primary) context: under MPS a client only has its share
    # of the device's SMs, and splitting the whole device's asks for SMs it cannot have.
    try:
        cur = drv_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        res = drv_check(driver.cuCtxGetDevResource(cur, sm_type), "cuCtxGetDevResource")
    except Exception:  # noqa: BLE001
        res = drv_check(driver.cuDeviceGetDevResource(dev, sm_type), "cuDeviceGetDevResource")
    groups, nb, remainder = drv_check(driver.cuDevSmResourceSplitByCount(1, res, 0, producer_sms),
                                       "cuDevSmResourceSplitByCount")
    if nb < 1:
        raise RuntimeError("cuDevSmResourceSplitByCount made no group")
    return (_driver_side(driver, dev, device_index, groups[0], "producer"),
            _driver_side(driver, dev, device_index, remainder, "consumer"))


def _driver_side(driver, dev, device_index: int, rsrc, label: str) -> _GreenSide:
    """One green context of the SM resource ``rsrc``, with a non-blocking stream of its own (``label`` names
    the side in errors)."""
    import torch

    desc = drv_check(driver.cuDevResourceGenerateDesc([rsrc], 1), f"cuDevResourceGenerateDesc({label})")
    gctx = drv_check(driver.cuGreenCtxCreate(desc, dev, int(driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)),
                      f"cuGreenCtxCreate({label})")
    ctx = drv_check(driver.cuCtxFromGreenCtx(gctx), "cuCtxFromGreenCtx")
    cs = drv_check(driver.cuGreenCtxStreamCreate(gctx, int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), 0),
                    "cuGreenCtxStreamCreate")
    ts = torch.cuda.ExternalStream(int(cs), device=torch.device("cuda", device_index))
    sms = int(rsrc.sm.smCount) if hasattr(rsrc, "sm") else -1

    def push(ctx=ctx):
        drv_check(driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")

    def pop():
        drv_check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")

    return _GreenSide(ts, push, pop, sms, "driver split (disjoint)", keep=(gctx, cs, desc))


def _torch_pair(device_index: int, producer_sms: int, total: int, driver_err: str) -> tuple[_GreenSide, _GreenSide]:
    """Both sides from torch's ``GreenContext`` (``producer_sms`` SMs, and the rest of the ``total`` in whole
    groups of 8): they may overlap; ``driver_err`` (why the driver split failed) goes into ``how`` and into the
    error where torch fails too."""
    from torch.cuda.green_contexts import GreenContext

    cons_sms = max(8, (total - producer_sms) // 8 * 8)
    sides = []
    for n in (producer_sms, cons_sms):
        try:
            gc = GreenContext.create(num_sms=n, device_id=device_index)
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"green contexts unavailable: driver split: {driver_err}; torch GreenContext.create"
                               f"(num_sms={n}): {exc}") from exc
        gc.set_context()
        try:
            st = gc.Stream()
        finally:
            gc.pop_context()
        sides.append(_GreenSide(st, gc.set_context, gc.pop_context, n,
                                f"torch GreenContext (may overlap; driver split failed: {driver_err})", keep=gc))
    return sides[0], sides[1]
