"""Checks that drive the protocol: the stress harness and the explicit-state model checkers.

* ``verify.stress``: ``streamring stress``, run on every rank (host starts it): producers and a
  consumer per rank with random delays, every read checked against the pattern its source wrote.
* ``verify.model``: ``streamring model-check --layer ring|ep``, every interleaving of the ring
  protocol's steps (and of the expert-parallel layer's handoffs).
* ``verify.queue``: ``streamring model-check --layer queue``, the persistent consumer's work queue.
* ``verify.names``: their layers and mutations, which the CLI offers (loaded by every rank's CLI,
  so kept apart from the checkers).

Nothing is imported here: a stress rank loads only what it runs.
"""
