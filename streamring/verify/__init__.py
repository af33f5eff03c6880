"""Checks that drive the protocol: the stress harness and the explicit-state model checkers.

* ``verify.stress``: ``streamring stress``, run on every rank (host starts it): producers and a
  consumer per rank with random delays, every read checked against the pattern its source wrote.
* ``streamring model-check --layer ring|ep``: every interleaving of the ring protocol's steps (and
  of the expert-parallel layer's handoffs), in modules by concern: ``verify.state`` (configuration,
  properties, the flat state and its variables as bits), ``verify.steps`` (the ring's steps:
  :class:`~streamring.verify.steps.RingModel`), ``verify.ep`` (the expert-parallel layer's steps:
  :class:`~streamring.verify.ep.EPModel`, a subclass), ``verify.lookahead`` and
  ``verify.ep_lookahead`` (what each process may access until it must wait, for the reduction),
  ``verify.footprints`` and ``verify.memo`` (the fields each process's steps depend on, and the
  expansion memoised on them, which the search uses),
  ``verify.search`` (breadth-first search, the partial-order reduction, counter-examples, the
  serialised schedule, the CLI entry point) and ``verify.report`` (the result and how it is printed).
* ``verify.queue``: ``streamring model-check --layer queue``, the persistent consumer's work queue.
* ``verify.names``: their layers and mutations, which the CLI offers (loaded by every rank's CLI,
  so kept apart from the checkers).

Nothing is imported here: a stress rank loads only what it runs.
"""
