"""The Python examples of README.md and docs/*.md that need a symmetric heap run as a reader runs them: on 2 real
CPU ranks under mpiexec, in one job (tests/helpers/mp_doc_examples.py; which blocks: tests/helpers/doc_examples.py).
An example that drifts from the code (a name it never defines, an argument the code refuses) fails here."""

from doc_examples import HOW, Ranks, all_blocks


def test_the_docs_examples_run_on_two_ranks(mpirun):
    want = [f"DOC OK {b.file} block {b.index}" for b in all_blocks()
            if isinstance(HOW.get((b.file, b.index), (None, None, None))[2], Ranks)]
    assert want, "no example runs on ranks"
    r = mpirun(2, "tests/helpers/mp_doc_examples.py", timeout=240)
    assert r.rc == 0, r
    assert [ln for ln in r.out.splitlines() if ln.startswith("DOC OK")] == want, r
