"""The ring's choices, named in one place: progress policies, source orders, mutations.

Plain data (no imports beyond ``enum``): the config, the CLI, the device ring, its self-test, the
GPU MoE layer and the model checkers all read these tuples, so each choice is spelled once.
"""

from __future__ import annotations

import enum


class Inject(enum.Enum):
    """Deliberate protocol mutations, used to prove the checkers can fail."""

    NONE = "none"
    SKIP_ACQUIRE = "skip-acquire"
    SIGNAL_BEFORE_PAYLOAD = "signal-before-payload"
    SKIP_ACK_WAIT = "skip-ack-wait"
    IGNORE_EPOCH = "ignore-epoch"


INJECT_MODES = tuple(m.value for m in Inject if m is not Inject.NONE)

# The order in which a consumer takes the sources of one chunk: rank order (the default, model-
# checked up to 3 ranks), or any source whose chunk is ready first (an RFC later optimisation,
# model-checked at 2 ranks; see streamring.verify).
SOURCE_ORDERS = ("rank", "ready")
# The expert-parallel GPU layer's dispatch orders: the ring's two and ``arrival`` (sources in the order their
# first chunk is published, all of a source's chunks before the next source's; streamring.moe.ep_buffer)
EP_SOURCE_ORDERS = SOURCE_ORDERS + ("arrival",)

# How a consumer that is enqueued on a GPU *before* its producers still lets them run (the RFC's
# "progress mechanism"); one definition for the config, the device ring, its self-test and the
# GPU MoE layer:
#   serialized  - producer then consumer, chunk by chunk, on one stream: no overlap, always valid;
#   stream_wait - the consumer stream blocks in cuStreamWaitValue64 on the ring's doorbell words
#                 (no SM held while it waits), then the exact generation check runs;
#   spin_kernel - a one-thread-per-source kernel polls the generations (acquire, with a deadline);
#   green_ctx   - producer and consumer on disjoint green-context SM partitions (P2P transport).
PROGRESS_POLICIES = ("serialized", "stream_wait", "spin_kernel", "green_ctx")

# Progress policies that were tried and are refused, with the measured reason (docs/gpu.md): a config or an
# EPTuning naming one gets this reason instead of a bare "not one of". Nothing else implements them.
REFUSED_POLICIES = {
    "pdl": "programmatic dependent launch of the expert GEMMs in the serialized order overlaps nothing (1.17x "
           "batch at 4 chunks on one H200), and one measured run's streamed output was not bitwise equal to batch "
           "where every other policy's was (not reproduced on one H200 since, "
           "docs/results/pdl-probe-1h200-2026-12-01.log); it gains nothing to weigh against that doubt",
}
