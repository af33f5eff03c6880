"""streamring: a chunk-ready symmetric-memory ring that streams MoE inputs.

Layers (arrows point down only):

* ``streamring.cli``                 command line (thin)
* ``streamring.host``                bootstrap, launchers, per-rank drivers
* ``streamring.ring`` / ``moe``      the ring (layout, protocol, device form, roles) and the MoE layer on it
* ``streamring.device``              the symmetric-heap verbs and their backends
"""

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "config", "ConfigError": "config", "load_config": "config",
    "Inject": "ring.policies", "ProtocolViolation": "ring.protocol", "Ring": "ring.protocol",
    "RingLayout": "ring.layout", "StreamPlan": "ring.layout", "WatchdogError": "ring.protocol",
    "make_gen": "ring.layout", "split_gen": "ring.layout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    # Lazy: importing streamring.device.* must not load the layers above it.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'streamring' has no attribute {name!r}")
