"""Ring publish->acquire latency across hosts against a raw MPI put+flush ping-pong over the same link.

    python -m bench.multihost_latency                      # as root: 2 simulated hosts, both netmods
    python -m bench.multihost_latency --slots 1 2 --netmod ucx
    mpiexec -f hosts -n 2 python -m bench.multihost_latency --worker   # real hosts (see below)

Without ``--worker`` it builds simulated hosts (network namespaces on a veth bridge,
``streamring.host.netns``) and runs itself on them once per (netmod, ranks per host),
so both measurements of a row come from one MPI job over one link:

* raw: rank 0 and the first rank on another host ping-pong one chunk's bytes with
  plain mpi4py on a ``Win.Allocate`` window: ``Put`` + ``Flush`` + ``Accumulate`` of a
  signal word + ``Flush``; the receiver polls its own word (``Fetch_and_op(NO_OP)`` +
  ``Flush`` on itself, which also drives MPI's progress). One-way = half a round trip.
  The other ranks sleep in a barrier meanwhile.
* ring: every rank streams ``--chunks`` chunks through the full protocol (reserve,
  route + layout publish, acquire every source, read, acknowledge) on the same
  window kind; latency = the consumer's acquire time minus the publish time stamped
  in the slot's metadata, for sources on another host only.

The ring's publish stamp and the consumer's clock are ``CLOCK_MONOTONIC`` of two
processes: comparable only on one kernel (the simulated hosts). The worker checks
the ranks' boot ids and prints no ring latency when they differ (real hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.ring_loop import publish_acquire_latencies


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def raw_pingpong(comm, peer_of_0: int, nbytes: int, iters: int) -> list[float]:
    """One-way latencies (s) of put+flush+signal ping-pongs between rank 0 and ``peer_of_0``."""
    from mpi4py import MPI

    me = comm.Get_rank()
    sig_off = (nbytes + 7) // 8 * 8
    win = MPI.Win.Allocate(sig_off + 8, 1, comm=comm)
    np.frombuffer(win.tomemory(), dtype=np.uint8)[:] = 0
    win.Lock_all(MPI.MODE_NOCHECK)
    comm.Barrier()
    payload = np.random.default_rng(me).integers(0, 255, nbytes, dtype=np.uint8)
    val, res = np.zeros(1, np.uint64), np.zeros(1, np.uint64)

    def send(to: int, i: int) -> None:
        win.Put([payload, MPI.BYTE], to, target=(0, nbytes, MPI.BYTE))
        win.Flush(to)  # payload complete at the target before the signal (MPI orders nothing else)
        val[0] = i
        win.Accumulate([val, MPI.UINT64_T], to, target=(sig_off, 1, MPI.UINT64_T), op=MPI.REPLACE)
        win.Flush(to)

    def wait(i: int, deadline: float) -> None:
        while True:
            win.Fetch_and_op([val, MPI.UINT64_T], [res, MPI.UINT64_T], me, sig_off, op=MPI.NO_OP)
            win.Flush(me)
            if int(res[0]) == i:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {me}: raw ping-pong message {i} did not arrive in time")

    one_way = []
    deadline = time.monotonic() + 120
    for i in range(1, iters + 1):  # bounded: iters round trips, 120 s
        if me == 0:
            t0 = time.perf_counter()
            send(peer_of_0, 2 * i - 1)
            wait(2 * i, deadline)
            one_way.append((time.perf_counter() - t0) / 2)
        elif me == peer_of_0:
            wait(2 * i - 1, deadline)
            send(0, 2 * i)
    _idle_barrier(comm)
    win.Unlock_all()
    win.Free()
    return one_way


def _idle_barrier(comm, timeout_s: float = 300) -> None:
    """Barrier that sleeps while it waits: ranks outside the ping-pong must leave the cores to it."""
    req = comm.Ibarrier()
    end = time.monotonic() + timeout_s
    while not req.Test():  # bounded by timeout_s
        if time.monotonic() > end:
            raise TimeoutError(f"rank {comm.Get_rank()}: barrier after the raw ping-pong took over {timeout_s}s")
        time.sleep(0.001)


def ring_latency(heap, hosts: list[str], args) -> tuple[list[float], float]:
    """Publish->acquire latencies (s) of chunks from other hosts, and this rank's wall time."""
    me = heap.rank
    lat, wall, _ = publish_acquire_latencies(heap, args.num_slots, args.tokens_per_slot, args.hidden, 8, args.chunks,
                                             counted=lambda src: hosts[src] != hosts[me])
    return lat, wall


def worker(args) -> None:
    from mpi4py import MPI

    from streamring.device.cpu import MpiHeap

    comm = MPI.COMM_WORLD
    me, R = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    boot = comm.allgather(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    peers = [r for r in range(R) if hosts[r] != hosts[0]]
    if not peers:
        raise SystemExit("bench.multihost_latency: every rank is on one host; give a hostfile with two hosts")
    H, C = args.hidden, args.tokens_per_slot
    chunk_bytes = C * (H + (H // 128) * 4 + 8 * 12)  # x + x_sf + topk idx/weights of one chunk
    one_way = raw_pingpong(comm, peers[0], chunk_bytes, args.iters)
    heap = MpiHeap()  # window "auto": Win.Allocate, the ranks are on two nodes
    lat, wall = ring_latency(heap, hosts, args)
    res = heap.allgather_obj({"lat": lat, "wall": wall})
    heap.close()
    if me == 0:
        ring_all = [v for r in res for v in r["lat"]]
        same_clock = len(set(boot)) == 1
        out = {
            "ranks": R, "hosts": len(set(hosts)), "chunk_bytes": chunk_bytes, "chunks_per_rank": args.chunks,
            "raw_one_way_p50_us": statistics.median(one_way) * 1e6, "raw_one_way_p90_us": _pct(one_way, 90) * 1e6,
            "ring_p50_us": statistics.median(ring_all) * 1e6 if same_clock else None,
            "ring_p90_us": _pct(ring_all, 90) * 1e6 if same_clock else None,
            "chunks_per_s_per_rank": statistics.median(args.chunks * R / r["wall"] for r in res),
        }
        out["ratio_p50"] = out["ring_p50_us"] / out["raw_one_way_p50_us"] if same_clock else None
        print("RESULT " + json.dumps(out), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.multihost_latency", description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help="run as one rank (under mpiexec)")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2], help="ranks per simulated host (one job each)")
    ap.add_argument("--netmod", choices=["ucx", "ofi", "both"], default="both")
    ap.add_argument("--iters", type=int, default=500, help="raw ping-pong round trips")
    ap.add_argument("--chunks", type=int, default=300, help="ring chunks per rank")
    ap.add_argument("--num-slots", type=int, default=4)
    ap.add_argument("--tokens-per-slot", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per job")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from streamring.host.launch import find_mpiexec
    from streamring.host.netns import SimCluster

    netmods = ["ucx", "ofi"] if args.netmod == "both" else [args.netmod]
    passthrough = ["--iters", str(args.iters), "--chunks", str(args.chunks), "--num-slots", str(args.num_slots),
                   "--tokens-per-slot", str(args.tokens_per_slot), "--hidden", str(args.hidden)]
    rows = []
    for netmod in netmods:
        for slots in args.slots:
            with SimCluster(hosts=2, slots=slots, netmod=netmod) as cluster:
                cmd = [find_mpiexec(), *cluster.mpiexec_args(), "-n", str(cluster.num_ranks), sys.executable, "-m",
                       "bench.multihost_latency", "--worker", *passthrough]
                env = {**os.environ, **cluster.mpi_env()}
                env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
                before = cluster.link_bytes()
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout,
                                   start_new_session=True)
                after = cluster.link_bytes()
                line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if p.returncode != 0 or line is None:
                    print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"bench job failed (rc {p.returncode}): {' '.join(cmd)}")
                r = json.loads(line[len("RESULT "):])
                r["netmod"] = netmod
                r["link_mb"] = sum(a[0] - b[0] for a, b in zip(after.values(), before.values())) / 1e6
                rows.append(r)
    load = os.getloadavg()[0]
    print(f"2 simulated hosts (network namespaces, veth bridge), chunk {args.tokens_per_slot} tokens x hidden "
          f"{args.hidden} ({rows[0]['chunk_bytes']} B), {args.num_slots} slots, {args.chunks} chunks per rank, "
          f"{args.iters} raw round trips; {os.cpu_count()} cores, load average {load:.1f}")
    hdr = (f"{'netmod':<7}{'ranks':>6}  {'raw put+flush one-way p50 / p90':>32}  {'ring publish->acquire p50 / p90':>32}"
           f"  {'ratio p50':>9}  {'chunks/s/rank':>13}  {'MB over veths':>13}")
    print(hdr)
    for r in rows:
        ring = (f"{r['ring_p50_us']:10.0f} us / {r['ring_p90_us']:.0f} us" if r["ring_p50_us"] is not None
                else "(clocks differ)")
        ratio = f"{r['ratio_p50']:8.1f}x" if r["ratio_p50"] is not None else "-"
        print(f"{r['netmod']:<7}{r['ranks']:>6}  {r['raw_one_way_p50_us']:13.0f} us / {r['raw_one_way_p90_us']:.0f} us"
              f"{'':>4}  {ring:>32}  {ratio:>9}  {r['chunks_per_s_per_rank']:13.0f}  {r['link_mb']:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
