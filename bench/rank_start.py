"""Preloaded ranks against fresh interpreters: a local job's wall time and CPU time, both ways in one run.

Runs ``python -m streamring <command> --ranks N`` with ``STREAMRING_PRELOAD=1`` and ``=0`` in turn
(interleaved, ``--repeats`` times each) and prints, per way, the median wall time and CPU time of the
whole job (the launcher, mpiexec, the stubs or interpreters and the ranks: the children's rusage), and
the ratio fresh / preloaded. Both ways must pass.

    python -m bench.rank_start --command run --ranks 4 --repeats 3
    python -m bench.rank_start --command stress --ranks 65 --set ring.num_slots=2 --set stress.chunks_per_rank=3
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time


def one_job(argv: list[str], preload: str) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    env = {**os.environ, "STREAMRING_PRELOAD": preload}
    p = subprocess.run([sys.executable, "-m", "streamring", *argv], env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"STREAMRING_PRELOAD={preload}: the job failed (rc {p.returncode}):\n{p.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--command", choices=["run", "stress"], default="run")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="a config override for the job (repeatable)")
    args = ap.parse_args(argv)
    job = [args.command, "--ranks", str(args.ranks)] + [x for s in args.set for x in ("--set", s)]
    res = {"1": [], "0": []}
    for i in range(args.repeats):
        for way in ("1", "0"):
            res[way].append(one_job(job, way))
            print(f"[{i + 1}/{args.repeats}] STREAMRING_PRELOAD={way}: wall {res[way][-1][0]:.2f} s, "
                  f"CPU {res[way][-1][1]:.2f} s", flush=True)
    med = {w: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for w, v in res.items()}
    print(f"\nstreamring {' '.join(job)} on {os.cpu_count()} cores, medians of {args.repeats}:")
    print(f"{'ranks start as':22s} {'wall s':>7s} {'CPU s':>7s}")
    print(f"{'forks (preloaded)':22s} {med['1'][0]:7.2f} {med['1'][1]:7.2f}")
    print(f"{'fresh interpreters':22s} {med['0'][0]:7.2f} {med['0'][1]:7.2f}")
    print(f"fresh / preloaded: wall {med['0'][0] / med['1'][0]:.2f}x, CPU {med['0'][1] / med['1'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
