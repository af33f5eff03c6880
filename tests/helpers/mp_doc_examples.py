"""The Python examples of README.md and docs/*.md that run on CPU ranks (the :class:`doc_examples.Ranks`
entries of ``doc_examples.HOW``), as a reader runs them: ``mpiexec -n 2 python this.py [GROUP ...]``, started
by tests/ranks/test_docs_examples_on_ranks.py. The blocks of one group run in one namespace, in the order of
the docs; rank 0 prints ``DOC OK <file> block <i>`` after each. Any failure prints the block and the traceback
and ends the whole job non-zero."""

from __future__ import annotations

import os
import sys
import traceback

import torch

torch.set_num_threads(1)  # the ranks share the machine's cores

from doc_examples import HOW, Ranks, all_blocks  # noqa: E402


def main(groups: list[str]) -> None:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    spaces: dict = {}
    block = None
    try:
        for block in all_blocks():
            how = HOW.get((block.file, block.index))
            if how is None or not isinstance(how[2], Ranks) or (groups and how[2].group not in groups):
                continue
            ns = spaces.setdefault(how[2].group, {"__name__": f"doc_example_{how[2].group}"})
            exec(compile(block.code, f"{block.file}:block{block.index}", "exec"), ns)
            MPI.COMM_WORLD.Barrier()
            if rank == 0:
                print(f"DOC OK {block.file} block {block.index}", flush=True)
    except BaseException:
        where, code = (block.where, block.code) if block else ("?", "")
        sys.stderr.write(f"rank {rank}: the example {where} failed:\n{code}")
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
