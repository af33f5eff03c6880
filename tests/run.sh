#!/usr/bin/env bash
# The test command (README, CI): installs into ./.venv when needed, then runs pytest and prints the 15
# slowest tests and every test over 30 s with the reason it gives (tests/conftest.py).
#   bash tests/run.sh            the full suite (what CI runs), in 2 pytest-xdist workers
#   bash tests/run.sh --quick    the edit loop: the in-process tests not marked slow, one 2-rank run and
#                                one stress config (pytest option of tests/conftest.py)
# Other arguments go to pytest (e.g. `bash tests/run.sh -k stress`).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv --without-pip .venv
# The installer is uv where it can be had: pip spent about 40 s of a fresh install here resolving (parsing
# the index pages of 60 packages on one core: its --dry-run alone took 24 s), uv installs the same
# versions in about 10 s and finds them satisfied in a fraction of a second on every later run (pip: 7 s).
# uv reads neither pip.conf nor PIP_* variables: the find-links pip is configured with are passed on
# (on the project's machines torch's CPU build lies there). pip itself goes into the venv too, for users.
# Where uv cannot be installed or fails, pip installs instead.
# torch pinned to 2.13.0: on the project's machines its CPU build lies on disk (a bare `torch`
# would resolve to a multi-GB CUDA build); GPU users install their own torch instead.
# Bytecode: neither installer byte-compiles (pip would, on one core: about 55 s of a fresh install here,
# and compileall -j 0 still 26 s); instead each module is compiled at its first import and kept under
# .venv/pycache (PYTHONPYCACHEPREFIX: the source tree stays clean), so only what the tests import is
# compiled, once, and every later process (each rank imports torch) loads the .pyc. This overrides a
# PYTHONDONTWRITEBYTECODE of the caller's environment for the test run only.
pip_in_venv() { [ -x .venv/bin/pip ] || .venv/bin/python -m ensurepip -q; .venv/bin/python -m pip "$@"; }
if [ ! -x .venv/bin/uv ]; then
    if [ -x .venv/bin/pip ]; then .venv/bin/python -m pip install -q --disable-pip-version-check uv
    else python3 -m pip --python .venv/bin/python install -q --disable-pip-version-check uv; fi \
        || echo "tests/run.sh: uv could not be installed; pip installs instead" >&2
fi
links=()
for l in $(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u); do
    links+=(--find-links "$l")
done
if ! { [ -x .venv/bin/uv ] && .venv/bin/uv pip install -q --python .venv/bin/python "${links[@]}" \
        pip torch==2.13.0 -e '.[test]'; }; then
    [ ! -x .venv/bin/uv ] || echo "tests/run.sh: uv could not install the packages; pip instead" >&2
    pip_in_venv install -q --disable-pip-version-check --no-compile torch==2.13.0 -e '.[test]'
fi
export PYTHONPYCACHEPREFIX="$PWD/.venv/pycache"
unset PYTHONDONTWRITEBYTECODE
# The full run: 2 pytest-xdist workers, one per core (measured 8:57 against 11:05 in one process; 4
# workers measured no faster and starved a timing test); tests that share one expensive fixture carry
# one pytest.mark.xdist_group and run in one worker; the slow tests are handed out first
# (tests/conftest.py). The edit loop stays in one process (workers would cost it their start-up).
workers=(-n 2 --dist loadgroup)
for arg in "$@"; do [ "$arg" = --quick ] && workers=(); done
exec .venv/bin/python -m pytest -q --durations=15 "${workers[@]}" "$@"
