"""streamring: a chunk-ready symmetric-memory ring that streams MoE inputs.

Layers (arrows point down only):

* ``streamring.cli``                 command line (thin)
* ``streamring.host``                bootstrap, launchers, per-rank drivers
* ``streamring.protocol`` / ``moe``  the ring protocol and the MoE layer on it
* ``streamring.device``              the symmetric-heap verbs and their backends
"""

__version__ = "0.1.0"

from .config import Config, ConfigError, load_config  # noqa: E402
from .protocol import Inject, ProtocolViolation, Ring, RingLayout, StreamPlan, WatchdogError, make_gen, split_gen  # noqa: E402

__all__ = [
    "Config", "ConfigError", "load_config", "Inject", "ProtocolViolation", "Ring", "RingLayout", "StreamPlan",
    "WatchdogError", "make_gen", "split_gen",
]
