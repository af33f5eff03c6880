#!/usr/bin/env python3
"""Can N processes create a CUDA context each on this GPU under the running MPS daemon? (GPU check step.)

    python3 launch/mps_contexts.py 4

Starts N processes at once, each with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / N and the phase's
CUDA_DEVICE_MAX_CONNECTIONS, each creating its context (torch.cuda.set_device + a tensor) and holding it
until all have tried. Prints one line per process; on a failure also what else holds the GPU
(nvidia-smi's compute processes: leftovers of an earlier step) and the connections each client asked
for, so a recurrence says which it is. Exit 0 iff all N succeed.
"""

from __future__ import annotations

import os
import subprocess
import sys

CLIENT = r"""
import os, sys, time
try:
    import torch
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    print(f"ok pid {os.getpid()}", flush=True)
    time.sleep(2)
except Exception as exc:
    print(f"FAIL pid {os.getpid()}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
    sys.exit(1)
"""


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    env = dict(os.environ, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(100 // n))
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(n)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    ok = sum(p.returncode == 0 for p in procs)
    conns = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)")
    print(f"mps contexts: {ok} of {n} processes made a context (CUDA_DEVICE_MAX_CONNECTIONS={conns}, "
          f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 // n})")
    for o in outs:
        print("  " + o.splitlines()[-1] if o else "  (no output)")
    if ok < n:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        print("  other compute processes on the GPU now: " + (apps.replace("\n", "; ") or "none"))
        print("  (leftovers would show above; with none, the clients' connection count is the suspect: "
              "launch/mps_probe.sh compares CUDA_DEVICE_MAX_CONNECTIONS values)")
    return 0 if ok == n else 1


if __name__ == "__main__":
    sys.exit(main())
