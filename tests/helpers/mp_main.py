"""The main of a multi-rank scenario script (``mp_*.py``, started on every rank by ``tests/ranks/``)."""

from __future__ import annotations

import os
import sys
import traceback


def run_scenarios(scenarios: dict, names, heap) -> None:
    """Run each named scenario on this rank, then a barrier; rank 0 prints ``SCENARIO OK <name>`` after each.
    Any failure prints its traceback and ends the whole job non-zero (``MPI.COMM_WORLD.Abort``, then
    ``os._exit``: MPICH's Abort has been seen to return, and the rank must not go on to report OK). The heap
    is closed after the last one."""
    try:
        for name in names:
            scenarios[name](heap)
            heap.barrier()
            if heap.rank == 0:
                print("SCENARIO OK", name, flush=True)
    except BaseException:
        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        os._exit(1)
    heap.close()
