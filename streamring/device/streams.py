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
