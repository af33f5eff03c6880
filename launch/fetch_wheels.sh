#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels the GPU machine lacks (it has none) into .whl/ of this
# checkout, kept out of git:
#
#   bash launch/fetch_wheels.sh              # nvshmem4py-cu13 0.4.1, pydantic and its dependencies
#   bash launch/fetch_wheels.sh --cutlass    # also nvidia-cutlass 4.2.0.0 (CUTLASS/CuTe C++ headers, 6.4 MB),
#                                            # unpacked into .whl/cutlass/ for the CUTLASS GEMM library's build
#
# Carry .whl/ with the working tree to the GPU machine: launch/device_env.sh (sourced by every
# launch/*.sh device script) installs .whl/*.whl into .site there and puts it on PYTHONPATH. The CUTLASS
# GEMM library can be built ahead here too (no GPU needed, nvcc and the headers are):
# `python -m streamring.gemm.build --out .gemm-build`, then carry .gemm-build/ as well.
# Wheels for CPython 3.12 on x86_64 manylinux (the GPU machine's Python).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
. "$ROOT/launch/preflight.sh"
need_cmd git "install git (apt-get install git); .whl/ is kept out of git through the checkout's exclude list"
git -C "$ROOT" rev-parse --show-toplevel >/dev/null 2>&1 || preflight_fail "$ROOT is not a git checkout" \
  "run it in the streamring checkout you carry to the GPU machine"
need_cmd python3 "install Python 3 with pip (apt-get install python3-pip)"
python3 -m pip --version >/dev/null 2>&1 || preflight_fail "python3 has no pip" "python3 -m ensurepip --upgrade"
preflight_done "git $(command -v git), python3 $(command -v python3) with pip (the downloads need network)"
cd "$(git -C "$ROOT" rev-parse --show-toplevel)"
# keep .whl/ out of git (a worktree's .git is a file: its exclude list is the common directory's)
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "nvshmem4py-cu13==0.4.1" \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
if [ "${1:-}" = "--cutlass" ]; then
  python3 -m pip download -q --no-deps -d .whl nvidia-cutlass==4.2.0.0
  # where streamring.gemm.build looks for the headers on a machine without the wheel installed
  python3 -m zipfile -e .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl .whl/cutlass
fi
ls -la .whl
echo "fetch_wheels: carry .whl/ to the GPU machine; launch/device_env.sh installs it there (into .site)"
