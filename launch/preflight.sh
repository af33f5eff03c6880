# The tool checks of every launch/ script, sourced (bash) before the script does anything else:
#
#   . "$ROOT/launch/preflight.sh"          # ROOT: the checkout; PREFLIGHT_NAME: the script's name in messages
#
# A missing tool ends the script at once with exit status 2 and ONE line on stderr: what is missing and
# the command that fixes it ("NAME: cannot start: WHAT. Fix: COMMAND"), never a silent status 1.
# With PREFLIGHT_ONLY=1 a script stops after its checks (status 0, one "preflight ok" line naming the
# tools it found): what the tests run on a machine without the tools.
#
#   preflight_fail WHAT FIX        the line above, exit 2
#   preflight_done SUMMARY         with PREFLIGHT_ONLY=1: "NAME: preflight ok: SUMMARY", exit 0
#   need_cmd CMD FIX               CMD on PATH
#   missing_modules PY MOD...      the first of MOD... that PY cannot find (importlib.util.find_spec, so
#                                  nothing heavy is imported), or PY itself when it does not run
#   streamring_python MOD...       the interpreter that finds streamring and MOD...: $PYTHON when set (it
#                                  must), else $ROOT/.venv/bin/python, python3, python on PATH
#   mpiexec_for PY                 the mpiexec of PY's MPI: $MPIEXEC when set, else the one beside PY (the
#                                  mpich wheel puts it there), else mpiexec / mpirun on PATH
PREFLIGHT_NAME=${PREFLIGHT_NAME:-$(basename "$0")}
: "${ROOT:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
VENV_FIX="python3 -m venv $ROOT/.venv && $ROOT/.venv/bin/pip install torch==2.13.0 -e '$ROOT[test]'"

preflight_fail() {
  echo "$PREFLIGHT_NAME: cannot start: $1. Fix: $2" >&2
  exit 2
}

preflight_done() {
  if [ "${PREFLIGHT_ONLY:-0}" = 1 ]; then
    echo "$PREFLIGHT_NAME: preflight ok: $1"
    exit 0
  fi
}

need_cmd() {
  command -v "$1" >/dev/null 2>&1 || preflight_fail "no \`$1\` on PATH" "$2"
}

missing_modules() {
  local py=$1; shift
  "$py" - "$@" <<'EOF' 2>/dev/null || echo "$py"
import importlib.util, sys
for name in sys.argv[1:]:
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        print(name)
        break
EOF
}

streamring_python() {
  local cand miss tried=()
  if [ -n "${PYTHON:-}" ]; then
    miss=$(missing_modules "$PYTHON" streamring "$@")
    [ -z "$miss" ] || preflight_fail "PYTHON=$PYTHON cannot import $miss" \
      "unset PYTHON, or install streamring into it: $PYTHON -m pip install -e '$ROOT'"
    echo "$PYTHON"
    return
  fi
  for cand in "$ROOT/.venv/bin/python" "$(command -v python3 || true)" "$(command -v python || true)"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    miss=$(missing_modules "$cand" streamring "$@")
    if [ -z "$miss" ]; then echo "$cand"; return; fi
    tried+=("$cand lacks $miss")
  done
  local with="$*" list="no .venv/bin/python, python3 or python"
  [ ${#tried[@]} -gt 0 ] && printf -v list '%s; ' "${tried[@]}" && list=${list%; }
  preflight_fail "no python that can import streamring${with:+ (with ${with// /, })}: $list" "$VENV_FIX"
}

mpiexec_for() {
  local beside
  beside="$(dirname "$1")/mpiexec"
  if [ -n "${MPIEXEC:-}" ]; then
    command -v "$MPIEXEC" >/dev/null 2>&1 || preflight_fail "MPIEXEC=$MPIEXEC does not run" \
      "unset MPIEXEC to take the one beside $1, or point it at your MPI's mpiexec"
    echo "$MPIEXEC"
  elif [ -x "$beside" ]; then echo "$beside"
  elif command -v mpiexec >/dev/null 2>&1; then command -v mpiexec
  elif command -v mpirun >/dev/null 2>&1; then command -v mpirun
  else
    preflight_fail "no mpiexec beside $1 or on PATH" "$1 -m pip install mpich (MPICH's mpiexec into that environment), or put your site MPI's mpiexec on PATH"
  fi
}
