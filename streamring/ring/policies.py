"""The ring's choices, named in one place: progress policies, source orders, mutations.

Plain data (no imports beyond the standard library's): the config, the CLI, the device ring, its self-test,
the GPU MoE layer and the model checkers all read these, so each choice is spelled once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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



@dataclass(frozen=True)
class Progress:
    """A progress policy: how a consumer that is enqueued on a GPU *before* its producers still lets them run
    (the RFC's "progress mechanism"). What the device ring's self-test and the GPU MoE layer set up for it:

    ``streams``: ``"one"`` (producer then consumer, chunk by chunk, on the caller's stream: no overlap, always
    valid), ``"own"`` (producer and consumer on streams of their own) or ``"green"`` (on the streams of two
    green contexts with disjoint SMs: the ring then takes the P2P transport, green contexts hold no NVSHMEM
    state); ``wait``: how the consumer's stream waits for a chunk before the exact generation check, ``"order"``
    (stream order: its producer ran before it), ``"doorbell"`` (``cuStreamWaitValue64`` on the ring's doorbell
    words: no SM held while it waits; the ring needs them) or ``"spin"`` (a one-thread-per-source kernel polls
    the generations, acquire, with a deadline)."""

    name: str
    streams: str
    wait: str

    def __post_init__(self):
        if self.streams not in ("one", "own", "green") or self.wait not in ("order", "doorbell", "spin"):
            raise ValueError(f"progress {self.name!r}: streams must be one/own/green and wait order/doorbell/spin, "
                             f"got {self.streams!r}/{self.wait!r}")
        if (self.streams == "one") != (self.wait == "order"):
            raise ValueError(f"progress {self.name!r}: a consumer waits by stream order exactly when it shares the "
                             f"producer's one stream (streams {self.streams!r}, wait {self.wait!r})")

    @property
    def doorbells(self) -> bool:
        """The ring must carry doorbell words (``DeviceRing(wake=True)``)."""
        return self.wait == "doorbell"

    @property
    def p2p(self) -> bool:
        """The ring must use the P2P transport."""
        return self.streams == "green"


#: every progress policy by name, the one definition the config, the device ring's self-test and the GPU MoE
#: layer read
PROGRESS = {p.name: p for p in (
    Progress("serialized", streams="one", wait="order"),
    Progress("stream_wait", streams="own", wait="doorbell"),
    Progress("spin_kernel", streams="own", wait="spin"),
    Progress("green_ctx", streams="green", wait="spin"),
)}
PROGRESS_POLICIES = tuple(PROGRESS)


def progress(name: str) -> Progress:
    """The progress policy ``name``; ValueError listing the policies (and the reason, for a refused one)."""
    if name in REFUSED_POLICIES:
        raise ValueError(f"progress policy {name!r} is refused: {REFUSED_POLICIES[name]}")
    if name not in PROGRESS:
        raise ValueError(f"progress policy {name!r} is not one of {PROGRESS_POLICIES}")
    return PROGRESS[name]

# Progress policies that were tried and are refused, with the measured reason (docs/gpu.md): a config or an
# EPTuning naming one gets this reason instead of a bare "not one of". Nothing else implements them.
REFUSED_POLICIES = {
    "pdl": "programmatic dependent launch of the expert GEMMs in the serialized order overlaps nothing (1.17x "
           "batch at 4 chunks on one H200), and one measured run's streamed output was not bitwise equal to batch "
           "where every other policy's was (not reproduced on one H200 since, "
           "docs/results/pdl-probe-1h200-2026-12-01.log); it gains nothing to weigh against that doubt",
}
