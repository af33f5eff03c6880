#!/usr/bin/env bash
# The test command (README, CI): installs into ./.venv when needed, then runs pytest and prints the 15
# slowest tests and every test over 30 s with the reason it gives (tests/conftest.py).
#   bash tests/run.sh            the full suite (what CI runs)
#   bash tests/run.sh --quick    the edit loop: the in-process tests not marked slow, one 2-rank run and
#                                one stress config (pytest option of tests/conftest.py)
# Other arguments go to pytest (e.g. `bash tests/run.sh -k stress`).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch 2.13.0 first: on the project's machines its CPU build lies on disk (a bare `torch`
# would resolve to a multi-GB CUDA build); GPU users install their own torch instead.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]'
exec .venv/bin/python -m pytest -q --durations=15 "$@"
