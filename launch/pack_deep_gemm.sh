#!/usr/bin/env bash
# Packs what launch/build_deep_gemm.sh needs on the GPU host (no network there) into .deepgemm/ of the
# repository (git-ignored through .git/info/exclude; third-party source stays out of git):
#
#   .deepgemm/deepgemm-54e2261.tar.gz       DeepGEMM 54e2261 (deep_gemm 2.6.1): csrc/, deep_gemm/, LICENSE
#   .deepgemm/cutlass-f3fde58-include.tar.gz its pinned CUTLASS (v4.2.1): include/ only (cute/, cutlass/)
#   .deepgemm/fmt-553ec11-include.tar.gz     its pinned fmt: include/ only
#   .deepgemm/MANIFEST                       commits and sha256 of the three
#
# Run on a machine with the three git repositories (default: mirrors laid out as
# $MIRROR_ROOT/<owner>+<name>/repo, MIRROR_ROOT defaulting to .mirror beside the checkout; or set
# DEEPGEMM_GIT, CUTLASS_GIT, FMT_GIT to any clone's .git directory that holds those commits):
#
#   bash launch/pack_deep_gemm.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
. "$ROOT/launch/preflight.sh"
need_cmd git "install git (apt-get install git)"
need_cmd gzip "install gzip (apt-get install gzip)"
top=$(git -C "$ROOT" rev-parse --show-toplevel 2>/dev/null) || preflight_fail "$ROOT is not a git checkout" \
  "run it in the streamring checkout you carry to the GPU host"
cd "$top"
DG_COMMIT=54e2261
CUTLASS_COMMIT=f3fde58
FMT_COMMIT=553ec11
MIRROR_ROOT=${MIRROR_ROOT:-$(cd "$top/.." && pwd)/.mirror}
DEEPGEMM_GIT=${DEEPGEMM_GIT:-$MIRROR_ROOT/deepseek-ai+DeepGEMM/repo}
CUTLASS_GIT=${CUTLASS_GIT:-$MIRROR_ROOT/NVIDIA+cutlass/repo}
FMT_GIT=${FMT_GIT:-$MIRROR_ROOT/fmtlib+fmt/repo}
for need in DEEPGEMM_GIT:$DG_COMMIT CUTLASS_GIT:$CUTLASS_COMMIT FMT_GIT:$FMT_COMMIT; do
  var=${need%%:*}; commit=${need#*:}
  git --git-dir="${!var}" rev-parse --verify -q "$commit^{commit}" >/dev/null 2>&1 || preflight_fail \
    "no git repository holding commit $commit at $var=${!var}" \
    "set $var to a clone's .git directory that holds it (or MIRROR_ROOT to where the mirrors lie)"
done
preflight_done "DeepGEMM $DEEPGEMM_GIT, CUTLASS $CUTLASS_GIT, fmt $FMT_GIT"
OUTDIR=.deepgemm

# keep the folder out of git (worktrees share the main repository's info/exclude)
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.deepgemm/' "$exclude" 2>/dev/null || echo '/.deepgemm/' >> "$exclude"
mkdir -p "$OUTDIR"

# the submodule pins of DeepGEMM must be the commits packed here
for sub in cutlass:$CUTLASS_COMMIT fmt:$FMT_COMMIT; do
  name=${sub%%:*}; want=${sub#*:}
  pin=$(git --git-dir="$DEEPGEMM_GIT" ls-tree "$DG_COMMIT" "third-party/$name" | awk '{print $3}')
  case "$pin" in
    "$want"*) ;;
    *) echo "pack_deep_gemm: DeepGEMM $DG_COMMIT pins third-party/$name at $pin, not $want" >&2; exit 1 ;;
  esac
done

git --git-dir="$DEEPGEMM_GIT" archive --format=tar --prefix=DeepGEMM/ "$DG_COMMIT" csrc deep_gemm LICENSE \
  | gzip -9 > "$OUTDIR/deepgemm-$DG_COMMIT.tar.gz"
git --git-dir="$CUTLASS_GIT" archive --format=tar --prefix=DeepGEMM/third-party/cutlass/ "$CUTLASS_COMMIT" include LICENSE.txt \
  | gzip -9 > "$OUTDIR/cutlass-$CUTLASS_COMMIT-include.tar.gz"
git --git-dir="$FMT_GIT" archive --format=tar --prefix=DeepGEMM/third-party/fmt/ "$FMT_COMMIT" include LICENSE \
  | gzip -9 > "$OUTDIR/fmt-$FMT_COMMIT-include.tar.gz"

{
  echo "deepgemm $DG_COMMIT $(git --git-dir="$DEEPGEMM_GIT" rev-parse "$DG_COMMIT^{commit}")"
  echo "cutlass $CUTLASS_COMMIT $(git --git-dir="$CUTLASS_GIT" rev-parse "$CUTLASS_COMMIT^{commit}")"
  echo "fmt $FMT_COMMIT $(git --git-dir="$FMT_GIT" rev-parse "$FMT_COMMIT^{commit}")"
  (cd "$OUTDIR" && sha256sum ./*.tar.gz)
} > "$OUTDIR/MANIFEST"
cat "$OUTDIR/MANIFEST"
du -ch "$OUTDIR"/*.tar.gz | tail -1
