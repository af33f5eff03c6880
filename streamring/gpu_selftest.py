"""The GPU self-test (``streamring gpu-check``): the device ring under every progress policy,
captured into one CUDA graph and replayed with the device epoch, with negative controls.

The synthetic streamed sequence (:class:`StreamedSequence`): per chunk, the owner's reuse wait
(chunk >= num_slots), route and layout producers (alternating order) that write a pattern and
publish, a consumer per source that acquires, checks the pattern on the device and
acknowledges; then the owner's drain and ``advance_epoch``. It is captured into one
``torch.cuda.CUDAGraph`` and replayed (:func:`graph_check`); the device status words count
violations and timeouts. The consumer is enqueued *before* its producers, so the progress
policy (``streamring.ring.policies.PROGRESS_POLICIES``) must keep it from blocking them:

* ``stream_wait`` - the consumer stream blocks in ``cuStreamWaitValue64`` on the ring's
  doorbells (no SM held), then the consume kernel (acquire + verify + ack) runs. A captured
  graph bakes the waited value, so the doorbell carries an epoch-free value: the lap of the
  slot within the stream, waited with GEQ; every consumer resets its doorbells of a slot on
  the slot's last lap *before* it acknowledges, so the owner's next-epoch doorbell (which needs
  that acknowledgement first) can never be lost. The exact generation check stays in the
  consume kernel (it carries the device epoch).
* ``spin_kernel`` - a one-thread-per-source spin kernel (acquire loads, clock64 deadline) before
  the consume kernel; holds one SM slot per waiting source.
* ``green_ctx`` - producer and consumer on streams of two green contexts with disjoint SMs
  (``producer_sms`` for the producer); the ring uses the P2P transport.
* ``serialized`` - producer then consumer, chunk by chunk, on one stream. Always valid.

Run it on every PE of a job (``mpiexec -n 2 streamring gpu-check``; or ``--ranks N`` to start
the ranks) or as one PE (``streamring gpu-check``); exit 0 iff every expectation held.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path


from .ring import progress as PG
from .device.ringdesc import CLOCK_HZ, INJECT_BITS, RING_LAYOUT, RING_ROUTE
from .ring.device import DeviceRing
from .ring.layout import RingLayout
from .ring.policies import PROGRESS_POLICIES, progress

POLICIES = PROGRESS_POLICIES


class StreamedSequence:
    """Enqueues one stream (epoch) of the synthetic producer/consumer sequence under a policy."""

    def __init__(self, heap, ring: DeviceRing, policy: str, *, inject: int = 0, delay_cycles: int = 0,
                 hold_cycles: int = 0, producer_sms: int = 16):
        how = progress(policy)  # ValueError naming the policies (and the reason, for a refused one)
        self.heap, self.ring, self.policy = heap, ring, policy
        self.inject = int(inject)
        self.delay = int(delay_cycles)
        self.hold = int(hold_cycles)
        if how.p2p and ring.transport != "p2p":
            raise ValueError(f"{policy} needs a DeviceRing with transport='p2p' (no NVSHMEM state in green contexts)")
        # the producer and the consumer ("d": the dispatch role) on the policy's streams (ring.progress)
        self.progress = PG.make(policy, heap.device, roles=("p", "d"), producer_sms=producer_sms, priorities=False)
        self.green = self.progress.green
        self.green_how = self.progress.how
        self.pstream, self.cstream = self.progress.stream("p"), self.progress.stream("d")
        if how.doorbells and ring.off_wake < 0:
            raise ValueError(f"the {policy} policy needs a DeviceRing made with wake=True")

    def warm_up(self) -> None:
        """Load every kernel in every context used, before any wait is enqueued."""
        if self.green is None:
            return
        scratch = self.heap._torch.zeros(128 + self.heap.num_ranks, dtype=self.heap._torch.int64,
                                         device=self.heap.device)
        dummy = self.heap.dummy_desc(scratch)
        for side in self.green:
            with side.current():
                self.heap.warm_up_ring(scratch, stream=side.sref, dummy=dummy)
        self.heap._torch.cuda.synchronize(self.heap.device)

    def _side(self, which):
        """(stream, context manager) of side 'p' (producer) or 'c' (consumer)."""
        role = "p" if which == "p" else "d"
        ctx = self.progress.side(role) if self.green is not None else contextlib.nullcontext()
        return self.progress.library_stream(role), ctx

    def enqueue(self, origin) -> None:
        """Enqueue one epoch on ``origin`` (a torch stream; the capture stream when capturing)."""
        r = self.ring
        n = r.num_chunks
        inj = self.inject
        kinds = lambda c: (RING_ROUTE, RING_LAYOUT) if c % 2 == 0 else (RING_LAYOUT, RING_ROUTE)  # noqa: E731

        def produce_chunk(st, c):
            r.reuse_wait(st, c, inject=inj)
            for k in kinds(c):
                r.produce(st, c, k, inject=inj, delay_cycles=self.delay)

        if self.pstream is None:  # one stream: producer then consumer, chunk by chunk
            for c in range(n):
                produce_chunk(origin, c)
                r.consume(origin, c, inject=inj, hold_cycles=self.hold)
        else:
            self.pstream.wait_stream(origin)
            self.cstream.wait_stream(origin)
            # The consumer is enqueued FIRST: the progress policy must keep it from blocking producers.
            cst, cctx = self._side("c")
            with cctx:
                for c in range(n):
                    if self.progress.rings_doorbells:
                        if not inj & INJECT_BITS["skip-acquire"]:
                            r.wait_doorbells(self.cstream, c)
                    else:
                        r.spin_wait(cst, c, inject=inj)
                    r.consume(cst, c, inject=inj, hold_cycles=self.hold)
            pst, pctx = self._side("p")
            with pctx:
                for c in range(n):
                    produce_chunk(pst, c)
            origin.wait_stream(self.pstream)
            origin.wait_stream(self.cstream)
        r.drain(origin)
        r.advance_epoch(origin)


# --------------------------------------------------------------------------------------------
# Capture and replay with device-side epochs
# --------------------------------------------------------------------------------------------
def _agree(heap, ok: bool) -> bool:
    return all(bool(v) for v in heap.allgather_obj(bool(ok)))


def _capture(seq, origin) -> tuple:
    """``(graph, mode)``: one epoch of ``seq`` captured on ``origin``, or no graph and why (an eager loop)."""
    import torch

    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=origin, capture_error_mode="thread_local"):
            seq.enqueue(origin)
        return graph, "cuda graph"
    except Exception as exc:  # noqa: BLE001
        return None, f"eager loop (capture failed: {type(exc).__name__}: {str(exc)[:200]})"


def _judge(heap, ring, res: dict, st: dict, *, inject: str, replays: int, first_epoch: int) -> None:
    """Set ``res['ok']`` and ``res['problems']``: with no mutation, no violation or timeout, every chunk
    published and consumed, the epoch advanced once per replay and the ring quiescent (collective: every PE
    checks after a barrier); with one, that the checks detected it."""
    problems = []
    done = res["replays"]
    epochs = 1 + done
    if inject == "none":
        if st["violations"]:
            problems.append(f"{st['violations']} violations")
        if st["timeouts"]:
            problems.append(f"{st['timeouts']} timeouts")
        if st["consumed"] != res["expected_consumed"]:
            problems.append(f"consumed {st['consumed']} != {res['expected_consumed']}")
        if st["published"] != res["expected_published"]:
            problems.append(f"published {st['published']} != {res['expected_published']}")
        if res["epoch_end"] != first_epoch + epochs:
            problems.append(f"epoch {res['epoch_end']} != {first_epoch + epochs}")
        if done != replays:
            problems.append(f"stopped after {done} of {replays} replays")
        heap.barrier()  # every PE drained: masks must be clear now
        problems += ring.check_quiescent(first_epoch + epochs - 1)
        res["ok"] = not problems
    else:
        res["detected"] = st["violations"] + st["timeouts"] > 0
        res["ok"] = res["detected"]
        if not res["detected"]:
            problems.append(f"inject={inject} was NOT detected (no violation, no timeout)")
    res["problems"] = problems


def _eager_then_capture(heap, ring: DeviceRing, seq: StreamedSequence, origin, res: dict, capture: bool):
    """One eager epoch of ``seq`` on ``origin`` (it validates the sequence before it is baked into a graph), then
    its capture: the graph, or None where it is not asked, the eager epoch aborted the ring or the capture failed
    on any PE (collective: every PE then replays the eager loop). Records ``eager_epoch_ms``, ``after_eager``
    and ``mode`` in ``res``."""
    import torch

    t0 = time.perf_counter()
    with torch.cuda.stream(origin):
        seq.enqueue(origin)
    origin.synchronize()
    res["eager_epoch_ms"] = (time.perf_counter() - t0) * 1e3
    st = ring.status()
    res["after_eager"] = st
    graph, mode = _capture(seq, origin) if capture and not st["aborted"] else (None, "eager loop")
    if not _agree(heap, graph is not None):
        if graph is not None:
            mode = "eager loop (capture failed on another PE)"
        graph = None
    res["mode"] = mode
    return graph


def _replay(ring: DeviceRing, seq: StreamedSequence, origin, graph, replays: int, check_every: int) -> tuple:
    """``(replays done, wall seconds)``: ``graph`` replayed (None: ``seq`` enqueued eagerly) ``replays`` times on
    ``origin``, synchronising every ``check_every`` replays and stopping early once the ring is aborted."""
    import torch

    done = 0
    t0 = time.perf_counter()
    with torch.cuda.stream(origin):
        while done < replays:
            k = min(check_every, replays - done)
            for _ in range(k):
                if graph is not None:
                    graph.replay()
                else:
                    seq.enqueue(origin)
            done += k
            origin.synchronize()
            if ring.status()["aborted"]:
                break
    return done, time.perf_counter() - t0


def _record_replays(res: dict, ring: DeviceRing, st: dict, done: int, wall: float, num_chunks: int, pes: int) -> None:
    """Into ``res``: the ring's status ``st`` after ``done`` replays in ``wall`` seconds, the times per replay and
    per chunk, the epoch reached and what every epoch (the eager one and the replays) should have consumed
    (each of the ``pes`` sources' chunks) and published (a route and a layout per chunk)."""
    epochs = 1 + done
    res.update(st)
    res["replays"] = done
    res["us_per_replay"] = wall / max(done, 1) * 1e6
    res["us_per_chunk"] = wall / max(done * num_chunks, 1) * 1e6
    res["epoch_end"] = ring.epoch()
    res["expected_consumed"] = epochs * num_chunks * pes
    res["expected_published"] = epochs * num_chunks * 2


def graph_check(heap, policy: str, *, replays: int = 10000, num_slots: int = 4, num_chunks: int = 6,
                tokens_per_slot: int = 32, producer_sms: int = 16, inject: str = "none", delay_us: float = 0.0,
                hold_us: float = 0.0, deadline_s: float = 10.0, check_every: int = 1000, capture: bool = True,
                first_epoch: int = 1) -> dict:
    """Capture the synthetic stream under ``policy`` once and replay it ``replays`` times.

    Collective. Returns this PE's result dict; ``ok`` is the expectation: no violation, no
    timeout, every (src, chunk) consumed in every epoch, the epoch advanced once per replay
    and the ring quiescent at the end (for ``inject != 'none'`` the expectation is the
    opposite: the checks must detect the mutation).
    """
    import torch

    R = heap.num_ranks
    layout = RingLayout(num_ranks=R, num_slots=num_slots, tokens_per_slot=tokens_per_slot, hidden=128, topk=4,
                        num_experts=64)
    res = {"policy": policy, "pes": R, "rank": heap.rank, "inject": inject, "replays_asked": replays,
           "num_slots": num_slots, "num_chunks": num_chunks, "mode": "", "ok": False, "error": None}
    how = progress(policy)
    ring = DeviceRing(heap, layout, num_chunks, transport="p2p" if how.p2p else "nv", wake=how.doorbells,
                      deadline_s=deadline_s, name="gpu-check-ring")
    seq = None
    try:
        err = None
        try:
            seq = StreamedSequence(heap, ring, policy, inject=INJECT_BITS[inject],
                                   delay_cycles=int(delay_us * 1e-6 * CLOCK_HZ),
                                   hold_cycles=int(hold_us * 1e-6 * CLOCK_HZ), producer_sms=producer_sms)
            seq.warm_up()
            res["green"] = seq.green_how
        except Exception as exc:  # noqa: BLE001 - reported, and every PE skips together
            err = f"{type(exc).__name__}: {exc}"
        if not _agree(heap, err is None):
            res["error"] = err or "another PE could not set this policy up"
            res["mode"] = "not run"
            return res
        ring.set_epoch(first_epoch)
        origin = torch.cuda.Stream(device=heap.device)
        heap.barrier()
        graph = _eager_then_capture(heap, ring, seq, origin, res, capture)
        heap.barrier()
        done, wall = _replay(ring, seq, origin, graph, replays, check_every)
        torch.cuda.synchronize(heap.device)
        st = ring.status()
        _record_replays(res, ring, st, done, wall, num_chunks, R)
        _judge(heap, ring, res, st, inject=inject, replays=replays, first_epoch=first_epoch)
        del graph
        return res
    finally:
        torch.cuda.synchronize(heap.device)
        try:
            heap.barrier()
        finally:
            ring.close()
            if seq is not None:
                seq.progress.close()


# --------------------------------------------------------------------------------------------
# Command line (run under mpiexec / torchrun; one process per PE)


def _table(rows: list[dict]) -> str:
    head = f"{'policy':<12} {'inject':<22} {'PEs':>3} {'mode':<11} {'replays':>7} {'us/replay':>9} {'viol':>5} " \
           f"{'tmo':>4} {'consumed':>9} {'result':<6}"
    out = [head, "-" * len(head)]
    for r in rows:
        mode = "graph" if r.get("mode") == "cuda graph" else ("n/a" if r.get("mode") == "not run" else "eager")
        out.append(f"{r['policy']:<12} {r['inject']:<22} {r['pes']:>3} {mode:<11} {r.get('replays', 0):>7} "
                   f"{r.get('us_per_replay', 0):>9.1f} {r.get('violations', 0):>5} {r.get('timeouts', 0):>4} "
                   f"{r.get('consumed', 0):>9} {r.get('verdict', '?'):<6}")
    return "\n".join(out)


def run_checks(heap, *, policies=POLICIES, replays: int = 10000, slots: int = 4, chunks: int = 6,
               producer_sms: int = 16, controls: bool = False, control_replays: int = 40,
               deadline_s: float = 10.0, json_path: str | None = None, echo=print) -> int:
    """Run :func:`graph_check` for every policy (and the negative controls) on every PE of ``heap``.

    Collective. Rank 0 prints one line per check and a table (and writes ``json_path``).
    Returns the exit code: 0 iff every check passed (green_ctx not runnable under MPS counts as n/a).
    """
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown progress policies {bad}; allowed: {list(POLICIES)}")
    runs = [dict(policy=p, replays=replays) for p in policies]
    if controls:
        runs += [
            dict(policy="spin_kernel", inject="skip-acquire", delay_us=50.0),
            dict(policy="spin_kernel", inject="signal-before-payload", delay_us=50.0),
            dict(policy="spin_kernel", inject="ignore-epoch", delay_us=50.0),
            dict(policy="spin_kernel", inject="skip-ack-wait", delay_us=50.0, hold_us=300.0, num_slots=2),
        ]
    rows = []
    for spec in runs:
        spec = dict(spec)
        ctl = spec.get("inject", "none") != "none"
        kw = dict(replays=control_replays if ctl else spec.pop("replays"), num_slots=spec.pop("num_slots", slots),
                  num_chunks=chunks, producer_sms=producer_sms, deadline_s=0.5 if ctl else deadline_s,
                  check_every=10 if ctl else 1000)
        spec.pop("replays", None)
        t0 = time.perf_counter()
        try:
            r = graph_check(heap, **spec, **kw)
        except Exception as exc:  # noqa: BLE001 - one policy's failure must not hide the others
            r = {"policy": spec["policy"], "inject": spec.get("inject", "none"), "pes": heap.num_ranks,
                 "ok": False, "error": f"{type(exc).__name__}: {exc}", "mode": "crashed"}
        r["wall_s"] = time.perf_counter() - t0
        all_r = heap.allgather_obj(r)
        merged = dict(all_r[0])
        merged["ok"] = all(x.get("ok") for x in all_r)
        for key in ("violations", "timeouts", "consumed"):
            merged[key] = sum(int(x.get(key, 0) or 0) for x in all_r)
        merged["per_pe"] = all_r
        if merged.get("mode") == "not run" and progress(spec["policy"]).streams == "green" and heap.num_ranks > 1:
            merged["verdict"] = "n/a"  # green contexts under MPS: reported, not counted
        else:
            merged["verdict"] = "PASS" if merged["ok"] else "FAIL"
        rows.append(merged)
        if heap.rank == 0:
            echo(f"[gpu-check] {spec['policy']} inject={spec.get('inject', 'none')}: {merged['verdict']} "
                 f"mode={merged.get('mode')} replays={merged.get('replays')} "
                 f"us/replay={merged.get('us_per_replay', 0):.1f} problems={[x.get('problems') for x in all_r]} "
                 f"errors={[x.get('error') for x in all_r if x.get('error')]} "
                 f"first_error={[x.get('first_error') for x in all_r if x.get('first_error')]}")
    code = 0 if all(r["verdict"] in ("PASS", "n/a") for r in rows) else 1
    if heap.rank == 0:
        echo(_table(rows))
        if json_path:
            Path(json_path).write_text(json.dumps(rows, indent=1, default=str))
    heap.barrier()
    return code
