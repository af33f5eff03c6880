"""Progress policies: where the sides of a streamed sequence run and how its consumer waits, one class per policy,
for the expert-parallel layer (producer, dispatch, GEMMs, result puts) and the ring's GPU self-test (producer,
consumer) alike.

The consumer side is enqueued before the producer and waits on the ring's generations, so a policy must keep those
waits from blocking the producer (the names: ``streamring.ring.policies.PROGRESS_POLICIES``):

* :class:`Serialized`: no stream of its own; everything runs on the caller's stream, chunk by chunk, each wait after
  the publish it waits for (the correctness fallback);
* :class:`SpinKernel`: a stream per role, this process's own (:class:`~streamring.device.streams.OwnStream`), the
  waits one-thread kernels with a deadline; every role but the GEMMs at the high priority, so the producer's, the
  dispatch's and the puts' CTAs are scheduled before the next pending CTA of a big GEMM grid;
* :class:`StreamWait`: the same streams at the default priority, and the consumer first blocks in
  ``cuStreamWaitValue64`` on the ring's doorbells (no SM held; no deadline either, so nothing may depend on its
  stream being scheduled first); the exact generation check with its deadline follows;
* :class:`GreenCtx`: the producer in one green context and every consumer role in a disjoint one
  (``device.green``; P2P transport only), on one stream there.

A new policy is one class here, registered by :func:`register` (and its name in ``PROGRESS_POLICIES``). Roles
(:data:`ROLES`): ``p`` the producer, ``d`` the consumer's acquires and copies, ``g`` the expert GEMMs, ``u`` the
result puts. Imports of torch / cuda.* are lazy.
"""

from __future__ import annotations

import contextlib

ROLES = ("p", "d", "g", "u")
#: the priority asked for the high-priority roles (clamped into the device's range: its highest)
HIGH_PRIORITY = -10


class Progress:
    """A policy's streams for ``roles`` on ``device`` (owned: :meth:`close` destroys them); the base class runs
    every role on the caller's stream.

    Class attributes a policy sets: ``name``; ``rings_doorbells`` (the ring rings the doorbell words and the
    consumer waits on them first: ``DeviceRing(wake=True)``, ``DeviceRing.wait_doorbells``); ``high_priority``
    (the roles but the GEMMs at the high priority: their kernels' graph nodes get it too, ``EPBuffer.prioritize``).
    """

    name = ""
    rings_doorbells = False
    high_priority = False

    def __init__(self, device, *, roles: tuple = ROLES, producer_sms: int = 16, priorities: bool = True):
        self.green = None
        self._own: list = []
        self._streams: dict = {}
        #: how the streams were made (a green context's partition)
        self.how = ""

    @property
    def concurrent(self) -> bool:
        """Whether the roles have streams of their own (every policy but :class:`Serialized`)."""
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


class Serialized(Progress):
    name = "serialized"


class SpinKernel(Progress):
    name = "spin_kernel"
    high_priority = True

    def __init__(self, device, *, roles: tuple = ROLES, producer_sms: int = 16, priorities: bool = True):
        from .streams import OwnStream

        super().__init__(device, roles=roles, producer_sms=producer_sms)
        for r in roles:
            hi = priorities and self.high_priority and r != "g"
            self._own.append(OwnStream(device, HIGH_PRIORITY if hi else 0))
            self._streams[r] = self._own[-1].torch


class StreamWait(SpinKernel):
    name = "stream_wait"
    rings_doorbells = True
    high_priority = False


class GreenCtx(Progress):
    name = "green_ctx"

    def __init__(self, device, *, roles: tuple = ROLES, producer_sms: int = 16, priorities: bool = True):
        import torch

        from .green import make_green_pair

        super().__init__(device, roles=roles, producer_sms=producer_sms)
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


_POLICIES: dict = {}


def register(cls: type) -> type:
    """Make the policy class ``cls`` known by its ``name`` (:func:`make`)."""
    _POLICIES[cls.name] = cls
    return cls


for _cls in (Serialized, SpinKernel, StreamWait, GreenCtx):
    register(_cls)


def policy_class(name: str) -> type:
    """The class of progress policy ``name``; ValueError listing the known ones."""
    if name not in _POLICIES:
        raise ValueError(f"progress policy {name!r} has no streams here: one of {sorted(_POLICIES)}")
    return _POLICIES[name]


def make(name: str, device, *, roles: tuple = ROLES, producer_sms: int = 16, priorities: bool = True) -> Progress:
    """The streams of policy ``name`` for ``roles`` on ``device`` (``priorities=False``: every stream at the default
    priority, whatever the policy's: the ring's self-test, whose timings predate them)."""
    return policy_class(name)(device, roles=roles, producer_sms=producer_sms, priorities=priorities)
