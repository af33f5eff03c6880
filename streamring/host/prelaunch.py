"""Everything about a job that is knowable before any rank starts, checked once.

Checked here rather than on every rank (which would print 2 x N messages, or find them only
after the whole run): the config against the number of ranks, the ``--json`` path, the
GPU backend's requirements, and whether the ring fits in memory at all. The local
launcher checks them before it starts ``mpiexec``; ranks started by another launcher
(``mpirun``, ``srun``) check them together and rank 0 prints each problem once.
Every problem found here exits with code 2.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from ..config import Config, ConfigError
from ..device.memcheck import HeapSizeError, check_fits


def _json_problem(json_path: str | None) -> str | None:
    if not json_path:
        return None
    parent = Path(json_path).expanduser().resolve().parent
    if not parent.is_dir():
        return f"--json {json_path}: the directory {parent} does not exist (create it or choose another path)"
    if not os.access(parent, os.W_OK):
        return f"--json {json_path}: the directory {parent} is not writable"
    if Path(json_path).is_dir():
        return f"--json {json_path}: is a directory, not a file path"
    return None


def gpu_problems() -> list[str]:
    """What this process lacks for ``--backend nvshmem`` (a CUDA GPU torch can see, nvshmem4py)."""
    problems = []
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return [f"--backend nvshmem needs torch with CUDA: {exc}"]
    if not torch.cuda.is_available():
        problems.append("--backend nvshmem needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is "
                        "False); on a machine without a GPU use --backend cpu (the default)")
    try:
        found = importlib.util.find_spec("nvshmem.core") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        problems.append("--backend nvshmem needs nvshmem4py (`pip install -e '.[gpu]'`, see docs/gpu.md); "
                        "`import nvshmem.core` fails here")
    return problems


def config_problems(command: str, cfg: Config, num_ranks: int) -> list[str]:
    """The config against the number of ranks (list lengths, divisibility, rank indices)."""
    try:
        if command == "stress":
            from ..verify.stress import check_stress_job

            check_stress_job(cfg, num_ranks)
        elif command == "run":
            from ..runner import check_run_job

            check_run_job(cfg, num_ranks)
    except ConfigError as exc:
        return [str(exc)]
    return []


def heap_bytes_per_rank(command: str, cfg: Config, num_ranks: int) -> tuple[int, str]:
    """Symmetric bytes each rank of ``command`` allocates, and the config keys (with their values) that set them."""
    ring = f"ring.tokens_per_slot (now {cfg.ring.tokens_per_slot}), ring.num_slots (now {cfg.ring.num_slots})"
    if command == "stress":
        from ..verify.stress import stress_heap_bytes

        return stress_heap_bytes(cfg, num_ranks), ring
    from ..config import per_rank
    from ..runner import run_heap_bytes

    most = max(per_rank(cfg.run.tokens_per_rank, num_ranks, "run.tokens_per_rank"))
    return run_heap_bytes(cfg, num_ranks), (f"run.tokens_per_rank (now up to {most}: the batch ring holds a rank's "
                                            f"tokens), {ring}, layer.hidden (now {cfg.layer.hidden}) or layer.topk "
                                            f"(now {cfg.layer.topk})")


def memory_problem(command: str, cfg: Config, num_ranks: int, ranks_on_this_node: int) -> str | None:
    """Does the job's ring fit in this node's memory? (CPU backend: free /dev/shm and MemAvailable.)

    The NVSHMEM backend's limits (symmetric heap size, free GPU memory) are checked by
    that backend with the same :func:`~streamring.device.memcheck.check_fits`.
    """
    if cfg.backend != "cpu":
        return None
    nbytes, keys = heap_bytes_per_rank(command, cfg, num_ranks)
    try:
        check_fits(nbytes, ranks_on_this_node, what=f"the symmetric heap of `streamring {command}`",
                   keys=f"{keys}, or --ranks (now {num_ranks})")
    except HeapSizeError as exc:
        return str(exc)
    return None


def job_problems(command: str, cfg: Config, num_ranks: int, json_path: str | None = None,
                 ranks_on_this_node: int | None = None) -> list[str]:
    """Every problem knowable before the ranks start; ``[]`` when the job may launch.

    Args:
        ranks_on_this_node: ranks of the job on this node, for the memory check
            (``None``: skip it; a heap's ``alloc`` checks each region on every node).
    """
    problems = config_problems(command, cfg, num_ranks)
    json_problem = _json_problem(json_path)
    if json_problem:
        problems.append(json_problem)
    if cfg.backend == "nvshmem":
        problems += gpu_problems()
    if not problems and ranks_on_this_node:
        mem = memory_problem(command, cfg, num_ranks, ranks_on_this_node)
        if mem:
            problems.append(mem)
    return problems


def agree_on_problems(comm, mine: list[str], timeout_s: float) -> list[str]:
    """Exchange every rank's problems (under ``mpirun``); each distinct problem once, naming its ranks.

    The exchange starts with an ``Ibarrier`` polled against ``timeout_s``, so a rank that
    never arrives gives an error instead of a hang.
    """
    deadline = time.monotonic() + timeout_s
    req = comm.Ibarrier()
    while not req.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"pre-launch check: not every rank arrived within {timeout_s:.0f}s")
        os.sched_yield()
    every = comm.allgather(list(mine))
    seen: dict[str, list[int]] = {}
    for rank, problems in enumerate(every):
        for p in problems:
            seen.setdefault(p, []).append(rank)
    n = len(every)
    return [p if len(ranks) == n else f"{p} (ranks {ranks})" for p, ranks in seen.items()]
