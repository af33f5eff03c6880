"""The model checkers' names: layers and mutations (``streamring model-check --layer/--inject``).

One definition, shared by the model checkers of this package and the CLI; kept
apart from the checkers so that every process that builds the CLI parser (each rank of a job) does
not load them.
"""

from __future__ import annotations

import enum

from ..ring.policies import INJECT_MODES

LAYERS = ("ring", "ep")


class EPInject(enum.Enum):
    """Deliberately broken handoffs of the expert-parallel layer (``--layer ep`` only)."""

    NONE = "none"
    ACK_BEFORE_COPY = "ack-before-copy"  # input_consumed acknowledged before the copy's reads complete
    SIGNAL_BEFORE_COMBINE = "signal-before-combine"  # arrived[c] added before the combine writes are released
    SKIP_ARRIVAL_WAIT = "skip-arrival-wait"  # the owner reduces chunk c without waiting for its count
    NO_COUNTER_RESET = "no-counter-reset"  # arrived[c] is not reset after the reduce
    # the combine area indexed by slot (as the CPU layer's combine[slot][token][k]) instead of by
    # logical token: with the early acknowledgement a later chunk of the slot overwrites entries
    COMBINE_BY_SLOT = "combine-by-slot"


EP_INJECT_MODES = tuple(m.value for m in EPInject if m is not EPInject.NONE)
MODEL_INJECT_MODES = INJECT_MODES + EP_INJECT_MODES

# the persistent consumer's work-queue handoffs (``--layer queue``)
QUEUE_INJECT_MODES = ("claim-before-ready", "l2-before-l1", "arrival-before-store")
