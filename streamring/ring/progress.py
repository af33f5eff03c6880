"""The streams of a progress policy: where the sides of a streamed sequence run, for the expert-parallel layer
(producer, dispatch, GEMMs, result puts) and the ring's GPU self-test (producer, consumer) alike.

What each policy is, is described once, backend-free, in ``streamring.ring.policies.PROGRESS``: its streams (``one``
shared stream, streams of their ``own``, or two ``green`` contexts) and how its consumer waits (``order``,
``doorbell``, ``spin``). This module makes the streams of each kind, one class per kind:

* ``one`` (:class:`Progress` itself): no stream of its own; everything runs on the caller's stream, chunk by chunk,
  each wait after the publish it waits for (the correctness fallback);
* ``own`` (:class:`OwnStreams`): a stream per role, this process's own (:class:`~streamring.device.streams.OwnStream`).
  With a ``spin`` wait (one-thread kernels with a deadline) every role but the GEMMs (and those the caller names:
  ``make(default_priority_roles=)``) runs at the high priority, so the producer's, the dispatch's and the puts' CTAs
  are scheduled before the next pending CTA of a big GEMM grid;
  with a ``doorbell`` wait (``cuStreamWaitValue64``: no SM held, no deadline either) every stream keeps the
  default priority, so nothing depends on a blocked stream being scheduled first;
* ``green`` (:class:`GreenCtx`): the producer in one green context and every consumer role in a disjoint one
  (``streamring.device.green``; P2P transport only), on one stream there.

A new policy of an existing kind is one line of ``PROGRESS``; a new kind of streams is one class here. Roles
(:data:`ROLES`): ``p`` the producer, ``d`` the consumer's acquires and copies, ``g`` the expert GEMMs, ``u`` the
result puts. Imports of torch / cuda.* are lazy.
"""

from __future__ import annotations

import contextlib

from .policies import Progress as Description
from .policies import progress as describe

ROLES = ("p", "d", "g", "u")
#: the priority asked for the high-priority roles (clamped into the device's range: its highest)
HIGH_PRIORITY = -10


def high_priority(desc: Description) -> bool:
    """Whether a policy's roles but the GEMMs run at the high priority: streams of their own and a spin wait."""
    return desc.streams == "own" and desc.wait == "spin"


class Progress:
    """The streams of policy ``desc`` for ``roles`` on ``device`` (owned: :meth:`close` destroys them); this base
    class is the ``one`` kind: every role on the caller's stream."""

    def __init__(self, desc: Description, device, *, roles: tuple = ROLES, producer_sms: int = 16,
                 priorities: bool = True, default_priority_roles: tuple = ("g",)):
        #: the policy (``ring.policies.Progress``)
        self.policy = desc
        self.green = None
        self._own: list = []
        self._streams: dict = {}
        #: how the streams were made (a green context's partition)
        self.how = ""

    @property
    def rings_doorbells(self) -> bool:
        """The ring rings its doorbell words and the consumer waits on them first (``DeviceRing(wake=True)``)."""
        return self.policy.doorbells

    @property
    def high_priority(self) -> bool:
        """The roles but the GEMMs (and those the caller kept at the default: ``make(default_priority_roles=)``) run
        at the high priority (their kernels' graph nodes get it too)."""
        return high_priority(self.policy)

    @property
    def concurrent(self) -> bool:
        """Whether the roles have streams of their own (every kind but ``one``)."""
        return bool(self._streams)

    def stream(self, role: str):
        """The torch stream of ``role``, or None (it runs on the current stream)."""
        return self._streams.get(role)

    def streams(self, roles: tuple = ROLES) -> list:
        """The distinct streams of ``roles`` (a stream serving two roles once)."""
        return list(dict.fromkeys(s for s in (self._streams.get(r) for r in roles) if s is not None))

    def library_stream(self, role: str):
        """What the library's kernel launchers take for ``role``: its stream (a green side: its stream ref)."""
        return self._streams.get(role)

    def side(self, role: str):
        """A context manager making ``role``'s stream current."""
        import torch

        stream = self._streams.get(role)
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def fork(self, origin, roles: tuple = ROLES) -> None:
        """Start ``roles``' streams behind everything ``origin`` holds now."""
        for s in self.streams(roles):
            s.wait_stream(origin)

    def join(self, origin, roles: tuple = ROLES) -> None:
        """Make ``origin`` wait for everything ``roles``' streams hold now."""
        for s in self.streams(roles):
            origin.wait_stream(s)

    def close(self) -> None:
        """Destroy the streams this object made (after their work)."""
        for s in self._own:
            s.close()
        self._own = []


class OwnStreams(Progress):
    """The ``own`` kind: a stream of this process's own per role (``priorities=False``: every one at the default
    priority, whatever the policy's: the ring's self-test, whose timings predate them)."""

    def __init__(self, desc: Description, device, *, roles: tuple = ROLES, producer_sms: int = 16,
                 priorities: bool = True, default_priority_roles: tuple = ("g",)):
        from ..device.streams import OwnStream

        super().__init__(desc, device, roles=roles, producer_sms=producer_sms)
        for r in roles:
            hi = priorities and high_priority(desc) and r not in default_priority_roles
            self._own.append(OwnStream(device, HIGH_PRIORITY if hi else 0))
            self._streams[r] = self._own[-1].torch


class GreenCtx(Progress):
    """The ``green`` kind: the producer's green context and the consumer's (every other role), disjoint SMs."""

    def __init__(self, desc: Description, device, *, roles: tuple = ROLES, producer_sms: int = 16,
                 priorities: bool = True, default_priority_roles: tuple = ("g",)):
        import torch

        from ..device.green import make_green_pair

        super().__init__(desc, device, roles=roles, producer_sms=producer_sms)
        self.green = make_green_pair(torch.device(device).index or 0, producer_sms)
        self.how = f"{self.green[0].how}; producer {self.green[0].sms} SMs, consumer {self.green[1].sms} SMs"
        self._streams = {r: self._green_side(r).stream for r in roles if r != "u"}

    def _green_side(self, role: str):
        return self.green[0 if role == "p" else 1]

    def library_stream(self, role: str):
        return self._green_side(role).sref if role in self._streams else None

    def side(self, role: str):
        """``role``'s green context and stream made current."""
        import torch

        stream = self._streams.get(role)
        if stream is None:
            return contextlib.nullcontext()
        green = self._green_side(role)

        @contextlib.contextmanager
        def both():
            with green.current(), torch.cuda.stream(stream):
                yield
        return both()


#: the class of each kind of streams (``ring.policies.Progress.streams``)
KINDS = {"one": Progress, "own": OwnStreams, "green": GreenCtx}


def make(name: str, device, *, roles: tuple = ROLES, producer_sms: int = 16, priorities: bool = True,
         default_priority_roles: tuple = ("g",)) -> Progress:
    """The streams of progress policy ``name`` (``ring.policies.progress``: ValueError naming the policies, and the
    reason for a refused one) for ``roles`` on ``device``; ``default_priority_roles`` keep the default priority where
    the policy raises the others (the GEMMs always; a caller may add others, e.g. result puts that would otherwise
    take the SMs a GEMM call frees from the next dispatch)."""
    desc = describe(name)
    return KINDS[desc.streams](desc, device, roles=roles, producer_sms=producer_sms, priorities=priorities,
                               default_priority_roles=default_priority_roles)
