#!/usr/bin/env bash
# The test command (README, CI): installs into ./.venv when needed, then runs pytest and prints the 15
# slowest tests and every test over 30 s with the reason it gives (tests/conftest.py).
#   bash tests/run.sh            the full suite (what CI runs), in 2 pytest-xdist workers
#   bash tests/run.sh --quick    the edit loop: the in-process tests not marked slow, one 2-rank run and
#                                one stress config (pytest option of tests/conftest.py)
# Other arguments go to pytest (e.g. `bash tests/run.sh -k stress`).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch 2.13.0 first: on the project's machines its CPU build lies on disk (a bare `torch`
# would resolve to a multi-GB CUDA build); GPU users install their own torch instead.
# Bytecode: pip would byte-compile all it installs on one core (about 55 s of a fresh install here, and
# compileall -j 0 still 26 s); instead each module is compiled at its first import and kept under
# .venv/pycache (PYTHONPYCACHEPREFIX: the source tree stays clean), so only what the tests import is
# compiled, once, and every later process (each rank imports torch) loads the .pyc. This overrides a
# PYTHONDONTWRITEBYTECODE of the caller's environment for the test run only.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 -e '.[test]'
export PYTHONPYCACHEPREFIX="$PWD/.venv/pycache"
unset PYTHONDONTWRITEBYTECODE
# The full run: 2 pytest-xdist workers, one per core (measured 8:57 against 11:05 in one process; 4
# workers measured no faster and starved a timing test); tests that share one expensive fixture carry
# one pytest.mark.xdist_group and run in one worker; the slow tests are handed out first
# (tests/conftest.py). The edit loop stays in one process (workers would cost it their start-up).
workers=(-n 2 --dist loadgroup)
for arg in "$@"; do [ "$arg" = --quick ] && workers=(); done
exec .venv/bin/python -m pytest -q --durations=15 "${workers[@]}" "$@"
