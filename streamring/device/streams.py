"""Stream memory operations: a stream that waits on a device word without holding an SM.

Progress policy ``stream_wait``: ``cuStreamWaitValue64`` blocks a stream until a 64-bit word
in device memory is >= a value. Verified on the H200: it is captured into a CUDA graph (a
batch-memop node) and replays correctly; the waited value is baked into the graph; wake-up to
the next kernel p50 3.4 us. It has no deadline: the ring's doorbell words it waits on are
always rung by a producer that needs nothing from the waiting stream (see
``streamring.ring.device``), and every stream gets its own hardware queue
(``CUDA_DEVICE_MAX_CONNECTIONS=32``), or a blocked wait can block an unrelated stream.
"""

from __future__ import annotations

from .green import drv_check


def stream_wait_geq(torch_stream, addr: int, value: int) -> None:
    """Enqueue ``cuStreamWaitValue64(stream, addr, value, GEQ)`` (no SM held while blocked)."""
    from cuda.bindings import driver

    flag = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    st = driver.CUstream(int(torch_stream.cuda_stream))
    try:
        res = driver.cuStreamWaitValue64(st, driver.CUdeviceptr(int(addr)), driver.cuuint64_t(int(value)), int(flag))
    except TypeError:
        res = driver.cuStreamWaitValue64(st, driver.CUdeviceptr(int(addr)), driver.cuuint64_t(int(value)), flag)
    drv_check(res, "cuStreamWaitValue64")


class OwnStream:
    """A CUDA stream this process created for itself, as a torch stream (:attr:`torch`), destroyed by
    :meth:`close`.

    Why not ``torch.cuda.Stream()``: torch hands out streams from a small pool per priority, round robin, so a
    later ``torch.cuda.Stream()`` of the caller (a capture stream, say) can be the very same CUDA stream. A
    layer's side stream that is also its caller's stream puts the caller's work and the layer's GEMMs in one
    stream order: the producer behind GEMMs that wait for the producer's chunks (caught only by the deadline).
    Non-blocking (no implicit order with the legacy default stream); ``priority`` is clamped into the
    device's range (lower is higher, as for torch streams)."""

    def __init__(self, device, priority: int = 0):
        import torch
        from cuda.bindings import driver

        with torch.cuda.device(device):
            torch.cuda.current_stream().synchronize()  # the device's primary context is current from here
            least, greatest = drv_check(driver.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
            prio = min(max(int(priority), int(greatest)), int(least))
            flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._handle = drv_check(driver.cuStreamCreateWithPriority(flags, prio), "cuStreamCreateWithPriority")
        self.torch = torch.cuda.ExternalStream(int(self._handle), device=device)

    def close(self) -> None:
        """Wait for the stream's work and destroy it (idempotent)."""
        if self._handle is None:
            return
        from cuda.bindings import driver

        self.torch.synchronize()
        drv_check(driver.cuStreamDestroy(self._handle), "cuStreamDestroy")
        self._handle = None
